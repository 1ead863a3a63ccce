"""Multi-LoRA on the real default model against HF transformers + PEFT on the same float32 weights.

Three adapters made with PEFT (random non-zero A and B; ranks 8, 4 and 16; different target modules; one with
rslora), saved as PEFT writes them. One batch mixes rows of every adapter and base rows; each row's greedy
tokens must be PEFT's for that adapter, also under preemption with a 16-token budget and with fewer device
slots than adapters. The reference runs one prompt at a time, with PEFT's own LoRA layers.
"""

from __future__ import annotations

import json

import pytest
import torch

from batchllm import LLM, LoRARequest, SamplingParams
from batchllm.model.lora_adapter import LoRAError

MAX_NEW = 12
ADAPTERS = {  # name: (rank, alpha, target modules, rslora)
    "qv": (8, 16, ["q_proj", "v_proj"], False),
    "all": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp": (16, 32, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
}
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Write one word about the sea."]


@pytest.fixture(scope="module")
def adapter_dirs(model_path, tmp_path_factory):
    import peft
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
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
    return dirs


@pytest.fixture(scope="module")
def loras(adapter_dirs):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapter_dirs.items())}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=False) for q in QUESTIONS]
    return [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chat]


@pytest.fixture(scope="module")
def peft_greedy(model_path, adapter_dirs, prompts):
    """(prompt index, adapter name or None) → PEFT's greedy new tokens."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
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


def _rows(prompts, loras):
    """Every prompt under every adapter and the base model, interleaved in one batch."""
    return [(i, name) for i in range(len(prompts)) for name in [None, *loras]]


def _run(llm, prompts, loras, rows):
    outs = llm.generate([prompts[i] for i, _ in rows], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False, lora_request=[None if name is None else loras[name] for _, name in rows])
    return {row: out.outputs[0].token_ids for row, out in zip(rows, outs)}


def test_a_mixed_batch_equals_peft_for_every_row(prompts, loras, peft_greedy):
    llm = LLM(enable_lora=True, max_loras=3, max_lora_rank=16)
    rows = _rows(prompts, loras)
    assert _run(llm, prompts, loras, rows) == {row: peft_greedy[row] for row in rows}
    for name in loras:  # else the check could not tell an adapter from the base model
        assert any(peft_greedy[(i, name)] != peft_greedy[(i, None)] for i in range(len(prompts))), name


def test_preemption_a_tiny_budget_and_fewer_slots_than_adapters(prompts, loras, peft_greedy):
    # Two slots for three adapters: the scheduler holds back the third adapter's rows until a slot frees up.
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=16, max_num_batched_tokens=16, num_kv_blocks=8,
              max_num_seqs=4)
    rows = _rows(prompts, loras)
    assert _run(llm, prompts, loras, rows) == {row: peft_greedy[row] for row in rows}
    assert llm.stats.num_preemptions > 0


def test_the_prefix_cache_never_shares_blocks_across_adapters(prompts, loras):
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompts[0]], params, use_tqdm=False, lora_request=loras["qv"])
    for lora, shares in [(loras["qv"], True), (loras["all"], False), (None, False)]:
        llm.generate([prompts[0]], params, use_tqdm=False, lora_request=lora)
        assert (llm.stats.prefix_cache_hits > 0) == shares, lora


def _edited(adapter_dir, tmp_path, **changes):
    target = tmp_path / "edited"
    target.mkdir()
    settings = json.loads((adapter_dir / "adapter_config.json").read_text())
    settings.update(changes)
    (target / "adapter_config.json").write_text(json.dumps(settings))
    (target / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    return target


def test_adapters_the_engine_cannot_apply_fail_the_call_naming_them(adapter_dirs, prompts, tmp_path):
    llm = LLM(enable_lora=True, max_loras=1, max_lora_rank=8)
    params = SamplingParams(max_tokens=2)
    cases = [
        (LoRARequest("big", 1, str(adapter_dirs["mlp"])), "rank 16 is above max_lora_rank=8"),
        (LoRARequest("gone", 2, str(tmp_path / "nowhere")), "adapter_config.json is missing"),
        (LoRARequest("saved", 3, str(_edited(adapter_dirs["qv"], tmp_path, modules_to_save=["lm_head"]))),
         "modules_to_save"),
    ]
    for lora, message in cases:
        with pytest.raises(LoRAError, match=message) as error:
            llm.generate([prompts[0]], params, use_tqdm=False, lora_request=lora)
        assert repr(lora.lora_name) in str(error.value)
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM().generate([prompts[0]], params, use_tqdm=False, lora_request=LoRARequest("qv", 1, "x"))


def test_the_map_operator_takes_each_rows_adapter_from_a_column(adapter_dirs, prompts, tokenizer, peft_greedy):
    import pandas as pd

    import batchllm

    llm = LLM(enable_lora=True, max_loras=3, max_lora_rank=16)
    texts = [tokenizer.decode(p) for p in prompts]
    names = [None, "qv", "all", "mlp", "", "nope"]
    frame = pd.DataFrame({"q": [texts[i % len(texts)] for i in range(len(names))], "adapter": names})
    out = batchllm.generate(frame, prompt_column="q", lora_column="adapter", llm=llm, use_tqdm=False,
                            loras={name: str(path) for name, path in adapter_dirs.items()}, temperature=0,
                            max_tokens=MAX_NEW)
    expected = [tokenizer.decode(peft_greedy[(i % len(texts), name or None)], skip_special_tokens=True)
                for i, name in enumerate(names[:5])]
    assert out.generated_text[:5].tolist() == expected
    assert "names 'nope', which is not one of loras= (all, mlp, qv)" in out.error[5]
    with pytest.raises(ValueError, match="go together"):
        batchllm.generate(frame, prompt_column="q", lora_column="adapter", llm=llm, use_tqdm=False)
