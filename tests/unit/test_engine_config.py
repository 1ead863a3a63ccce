"""`EngineConfig.from_kwargs`: the one place `LLM(...)`'s keywords are checked (no model is read here)."""

import inspect

import pytest

from batchllm import LLM
from batchllm.engine_config import DEFAULTS, EngineConfig


def test_defaults_are_the_llm_signature():
    signature = {name: p.default for name, p in inspect.signature(LLM).parameters.items()}
    assert signature == DEFAULTS


def test_defaults_on_the_cpu():
    config = EngineConfig.from_kwargs(device="cpu")
    assert (config.model.device, config.model.dtype) == ("cpu", "float32")
    assert config.async_scheduling is False  # None resolves to "on for CUDA only"
    assert not config.step_budget_given and config.scheduler.max_num_batched_tokens == 8192
    assert config.scheduler.max_loras == 0 and config.lora.max_loras == 1  # no adapter slots without enable_lora
    assert config.kv_transfer.disaggregated is None and config.speculative is None


def test_values_reach_their_sub_configs():
    config = EngineConfig.from_kwargs(device="cpu", dtype="half", max_num_batched_tokens=512, enable_lora=True,
                                      max_loras=3, swap_space=1, preemption_mode="swap", task="embed",
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                                      structured_outputs_backend="llguidance", pipeline_parallel_size=1)
    assert config.model.dtype == "float16"
    assert config.step_budget_given and config.scheduler.max_num_batched_tokens == 512
    assert config.scheduler.max_loras == 3 and config.lora.enable_lora
    assert config.cache.swap_space_bytes == 1 << 30 and config.scheduler.preemption_mode == "swap"
    assert config.pooling.task == "embed" and config.structured_outputs.backend == "llguidance"
    assert config.speculative.num_speculative_tokens == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": 0}, "LLM argument max_num_seqs must be an int >= 1, got 0"),
    ({"block_size": 12}, "LLM argument block_size must be a positive multiple of 8, got 12"),
    ({"max_model_len": 1}, "LLM argument max_model_len must be an int >= 2 or None, got 1"),
    ({"tensor_parallel_size": True}, "LLM argument tensor_parallel_size must be an int >= 1, got True"),
    ({"preemption_mode": "swap"}, "preemption_mode='swap' needs swap_space > 0"),
    ({"dtype": "float64"}, "dtype='float64' must be 'auto'"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"async_scheduling": "yes"}, "async_scheduling must be None, True or False, got 'yes'"),
    ({"pipeline_parallel_size": 2, "enable_lora": True},
     "pipeline_parallel_size=2 does not work with enable_lora=True yet"),
    ({"disaggregated": {"prefill": 1, "decode": 1}, "tensor_parallel_size": 2},
     "disaggregated does not work with tensor_parallel_size yet"),
])
def test_errors_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EngineConfig.from_kwargs(device="cpu", **kwargs) if "device" not in kwargs else EngineConfig.from_kwargs(
            **kwargs)


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        EngineConfig.from_kwargs(max_num_seq=4)
