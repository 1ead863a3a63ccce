import functools

import pytest
import torch

from batchllm import LoRARequest
from tests.hf_greedy import hf_greedy_tokens


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
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Write one word about the sea."]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> str:
    """The session's tiny random Llama (tests/conftest.py) as `model=`: the door tests' engine."""
    return str(tiny_llama_dir)


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory):
    """Three PEFT adapters of the default model (`peft_adapters.ADAPTERS`), saved as PEFT writes them."""
    from tests.e2e.peft_adapters import write_adapters

    return write_adapters(_default_model(), tmp_path_factory.mktemp("adapters"))


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
    from tests.e2e.peft_adapters import peft_greedy_tokens

    return peft_greedy_tokens(_default_model(), adapter_dirs, prompts, MAX_NEW)


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
            tokens = hf_greedy_tokens(self._model, [prompt], max_new_tokens)[0]
            self._runs[tuple(prompt)] = (max_new_tokens, tokens)
        return list(tokens)


@pytest.fixture(scope="session")
def hf_default_greedy():
    """`hf_default_greedy(prompts, max_new_tokens)`: HF's greedy new tokens of each prompt (fresh lists)."""
    return _DefaultModelGreedy()
