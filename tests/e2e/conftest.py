import functools

import pytest
import torch

from batchllm import LoRARequest


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """Every engine of these tests is built with and without asynchronous scheduling; the references (HF
    transformers, caching off) do not change, so both must match them."""
    return request.param


@pytest.fixture(scope="module")
def model_path():
    """The default model's directory: the HF references load it without an engine, so they are computed once
    per module, not once per scheduling mode."""
    from batchllm.model.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from batchllm.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


# ---- LoRA: adapters made with PEFT and PEFT's greedy tokens, once per session (test_lora*.py) ----------------

@functools.cache
def _default_model():
    from batchllm.model.default_model import default_model_path

    return default_model_path()


@functools.cache
def _default_tokenizer():
    from batchllm.tokenizer import load_tokenizer

    return load_tokenizer(_default_model())


MAX_NEW = 12
ADAPTERS = {  # name: (rank, alpha, target modules, rslora)
    "qv": (8, 16, ["q_proj", "v_proj"], False),
    "all": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp": (16, 32, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
}
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Write one word about the sea."]


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory):
    """Three PEFT adapters of the default model (see `ADAPTERS`), saved as PEFT writes them."""
    import peft
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    base = AutoModelForCausalLM.from_pretrained(_default_model(), dtype=torch.float32)
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
        model = peft.get_peft_model(base, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:  # B is zero at PEFT's init: both halves random, so every delta counts
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
        model.save_pretrained(root / name)
        dirs[name] = root / name
        base = model.unload()  # the base model again, without this adapter's layers
    return dirs


@pytest.fixture(scope="session")
def loras(adapter_dirs):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapter_dirs.items())}


@pytest.fixture(scope="session")
def prompts():
    tokenizer = _default_tokenizer()
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=False) for q in QUESTIONS]
    return [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chat]


@pytest.fixture(scope="session")
def peft_greedy(adapter_dirs, prompts):
    """(prompt index, adapter name or None) → PEFT's greedy new tokens."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(_default_model(), dtype=torch.float32)
    names = list(adapter_dirs)
    model = peft.PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.eval()
    reference = {}
    with torch.inference_mode():
        for name in [None, *names]:
            for i, prompt in enumerate(prompts):
                ids = torch.tensor([prompt])
                kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
                if name is None:
                    with model.disable_adapter():
                        out = model.generate(input_ids=ids, **kwargs)
                else:
                    model.set_adapter(name)
                    out = model.generate(input_ids=ids, **kwargs)
                reference[(i, name)] = out[0, len(prompt):].tolist()
    return reference


# ---- HF's greedy tokens of the default model, once per session (test_generate_vs_hf.py) ----------------------

class _DefaultModelGreedy:
    """HF `generate` on the default model: greedy, float32, one prompt at a time, no padding. Each prompt's run is
    kept, and a shorter request is cut from a longer run: the token of each step does not depend on how many steps
    follow, and both runs stop at the same EOS, so HF's n-token run is the first n tokens of its longer run."""

    def __init__(self):
        self._model = None
        self._runs: dict[tuple[int, ...], tuple[int, list[int]]] = {}  # prompt → (max_new_tokens, new tokens)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [self._new_tokens(prompt, max_new_tokens)[:max_new_tokens] for prompt in prompts]

    def _new_tokens(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        asked, tokens = self._runs.get(tuple(prompt), (0, []))
        if asked < max_new_tokens:
            if self._model is None:
                from transformers import AutoModelForCausalLM

                self._model = AutoModelForCausalLM.from_pretrained(_default_model(), dtype=torch.float32).eval()
            with torch.inference_mode():
                ids = torch.tensor([prompt])
                out = self._model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                           do_sample=False)
            tokens = out[0, len(prompt):].tolist()
            self._runs[tuple(prompt)] = (max_new_tokens, tokens)
        return list(tokens)


@pytest.fixture(scope="session")
def hf_default_greedy():
    """`hf_default_greedy(prompts, max_new_tokens)`: HF's greedy new tokens of each prompt (fresh lists)."""
    return _DefaultModelGreedy()
