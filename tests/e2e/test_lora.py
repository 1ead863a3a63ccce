"""Multi-LoRA against HF transformers + PEFT on the same float32 weights.

The base is a tiny random Llama with the default model's tokenizer (6 query and 3 KV heads, for tensor parallelism
over 3 ranks): the point is each row's adapter, slots, preemption and sharding, not the real weights, and PEFT
loads the same checkpoint. Three adapters made for it with PEFT (peft_adapters.py: random non-zero A and B; ranks
8, 4 and 16; different target modules; one with rslora), saved as PEFT writes them. One batch mixes rows of every
adapter and base rows; each row's greedy tokens must be PEFT's for that adapter, also under preemption with a
16-token budget and with fewer device slots than adapters. The reference runs one prompt at a time, with PEFT's
own LoRA layers.
"""

from __future__ import annotations

import json

import pytest

from batchllm import LLM, LoRARequest, SamplingParams
from batchllm.model.lora_adapter import LoRAError
from tests.e2e.conftest import MAX_NEW
from tests.e2e.peft_adapters import peft_greedy_tokens, write_adapters
from tests.tiny_models import TINY_LLAMA_TP3, write_tiny_llama


# These override e2e/conftest.py's session fixtures of the default model, for this module.
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("lora-base"), **TINY_LLAMA_TP3)


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    return write_adapters(base, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def loras(adapter_dirs):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapter_dirs.items())}


@pytest.fixture(scope="module")
def peft_greedy(base, adapter_dirs, prompts):
    return peft_greedy_tokens(base, adapter_dirs, prompts, MAX_NEW)


def _llm(base, **options) -> LLM:
    return LLM(str(base), device="cpu", **options)


def _rows(prompts, loras):
    """Every prompt under every adapter and the base model, interleaved in one batch."""
    return [(i, name) for i in range(len(prompts)) for name in [None, *loras]]


def _run(llm, prompts, loras, rows):
    outs = llm.generate([prompts[i] for i, _ in rows], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False, lora_request=[None if name is None else loras[name] for _, name in rows])
    return {row: out.outputs[0].token_ids for row, out in zip(rows, outs)}


def test_a_mixed_batch_equals_peft_for_every_row(base, prompts, loras, peft_greedy):
    llm = _llm(base, enable_lora=True, max_loras=3, max_lora_rank=16)
    rows = _rows(prompts, loras)
    assert _run(llm, prompts, loras, rows) == {row: peft_greedy[row] for row in rows}
    for name in loras:  # else the check could not tell an adapter from the base model
        assert any(peft_greedy[(i, name)] != peft_greedy[(i, None)] for i in range(len(prompts))), name


def test_preemption_a_tiny_budget_and_fewer_slots_than_adapters(base, prompts, loras, peft_greedy):
    # Two slots for three adapters: the scheduler holds back the third adapter's rows until a slot frees up.
    # Asynchronous scheduling (the CPU's default is synchronous, which the other tests run): the next step is
    # scheduled while this one runs, slot writes included.
    llm = _llm(base, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_batched_tokens=16, num_kv_blocks=8,
               max_num_seqs=4, async_scheduling=True, admission_policy="optimistic")
    rows = _rows(prompts, loras)
    assert _run(llm, prompts, loras, rows) == {row: peft_greedy[row] for row in rows}
    assert llm.stats.num_preemptions > 0


def test_tensor_parallel_3_equals_peft_for_every_row(base, prompts, loras, peft_greedy):
    # The base has 6 query and 3 KV heads: each rank holds its third of every adapter's B (q, k, v, gate, up) or
    # A (o, down), split like the base weights.
    llm = _llm(base, enable_lora=True, max_loras=3, max_lora_rank=16, tensor_parallel_size=3)
    rows = _rows(prompts, loras)
    try:
        assert _run(llm, prompts, loras, rows) == {row: peft_greedy[row] for row in rows}
    finally:
        llm.shutdown()


def test_the_prefix_cache_never_shares_blocks_across_adapters(base, prompts, loras):
    llm = _llm(base, enable_lora=True, max_loras=2, max_lora_rank=16)
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


def test_adapters_the_engine_cannot_apply_fail_the_call_naming_them(base, adapter_dirs, prompts, tmp_path):
    llm = _llm(base, enable_lora=True, max_loras=1, max_lora_rank=8)
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
        _llm(base).generate([prompts[0]], params, use_tqdm=False, lora_request=LoRARequest("qv", 1, "x"))


def test_the_map_operator_takes_each_rows_adapter_from_a_column(base, adapter_dirs, prompts, tokenizer,
                                                                peft_greedy):
    import pandas as pd

    import batchllm

    llm = _llm(base, enable_lora=True, max_loras=3, max_lora_rank=16)
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
