"""The engine a job would build, known without building it: for `batchllm run --dry-run`.

`preview_engine(model, engine_kwargs)` makes the checks `LLM(model, **engine_kwargs)` makes before it loads any
weight, with the same messages (tests compare the two), and loads what a job needs of the engine besides the
weights: the tokenizer, the chat template, the model's config, the pooling of an embedding task, the grammar
engine (constraints compile on the host) and the adapter checks. Nothing here reads a weight tensor, allocates a
KV cache or takes GPU memory: the device is resolved as a run resolves it (`torch.cuda.is_available()`, a
driver query); only FP8 weights or KV cache ask torch for the card's compute capability, as a run's check does. As in
a run, the default model (`model=None`) is converted from its GGUF package into the cache on its very first use
(`batchllm/model/default_model.py`).

`max_model_len` is what a run gets unless the KV pool is smaller than one sequence: on the CPU the pool's size
is known (`--num-kv-blocks`, else the runner's default share of memory); on a GPU profiling sizes it from
the memory left after loading, which only a run can measure, so the model's limit (or `--max-model-len`) stands.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from batchllm.config import CacheConfig
from batchllm.engine.build import resolve_engine
from batchllm.engine.structured.manager import StructuredOutputManager
from batchllm.engine_config import EngineConfig
from batchllm.lora.registry import AdapterRegistry
from batchllm.lora.request import LoRARequest
from batchllm.model.config import ModelConfig
from batchllm.pooling_params import PoolingParams
from batchllm.structured_outputs import StructuredOutputsParams


@dataclass(slots=True)
class EnginePreview:
    """What `LLM` would expose to a job (`model_path`, `task`, `tokenizer`, `max_model_len`, `pooling_params`,
    `embedding_dim`, `quantization`, `kv_cache_dtype`, `check_structured_outputs`, `check_lora`), and what an
    estimate of the run needs: the model's shape, the device, the dtype and the batch limits."""

    model_path: Path
    task: str
    tokenizer: Any
    model_config: ModelConfig
    max_model_len: int
    pooling_params: PoolingParams | None
    embedding_dim: int
    quantization: str | None  # as LLM.quantization: what a job manifest pins
    kv_cache_dtype: str
    device_type: str  # "cpu" or "cuda"
    dtype_name: str  # the weights' and activations' dtype, e.g. "bfloat16"
    dtype_bytes: int
    linear_weight_bits: int  # bits per weight of the linear layers, as they sit on the device
    expert_weight_bits: float  # the same of a MoE model's routed experts, scales included where they are MXFP4
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_tokens: int | None  # tokens the KV pool holds, where known before a run (see the module docstring)
    gpus_per_replica: int  # tensor_parallel_size * pipeline_parallel_size
    _structured: StructuredOutputManager | None
    _adapters: AdapterRegistry

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint, as `LLM.check_structured_outputs` does (GrammarError when it cannot be)."""
        if self._structured is None:
            raise ValueError("structured outputs need a tokenizer (the LLM was built with skip_tokenizer_init=True)")
        self._structured.check(params)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter (its own small files, not the model's weights), as `LLM.check_lora` does."""
        self._adapters.check_call(lora_request, 1)


def preview_engine(model: str | Path | None = None, engine_kwargs: Mapping[str, Any] | None = None) -> EnginePreview:
    """The checks of `LLM(model, **engine_kwargs)` up to its weights, in its order; see the module docstring."""
    import torch

    from batchllm.kernels.moe_reference import MXFP4_BLOCK
    from batchllm.model.quantization import FP8, INT, MXFP4, resolve_quantization

    kwargs = dict(engine_kwargs or {})
    if "model" in kwargs:
        raise TypeError("LLM() got multiple values for argument 'model'")
    resolved = resolve_engine(EngineConfig.from_kwargs(model=model, **kwargs))
    config, model_config = resolved.config, resolved.model_config
    device_type, dtype = torch.device(config.model.device).type, getattr(torch, config.model.dtype)
    dtype_bytes = dtype.itemsize
    quant = resolve_quantization(resolved.hf_config, config.quantization.quantization)
    linear_bits = 8 * dtype_bytes
    if quant is not None and quant.method == FP8:
        linear_bits = 8
    elif quant is not None and quant.method == INT and device_type == "cuda":  # the CPU dequantizes on load
        linear_bits = quant.bits
    expert_bits = linear_bits
    if quant is not None and quant.method == MXFP4:  # only the experts: E2M1 codes and an E8M0 scale byte per block
        expert_bits = 4 + 8 / MXFP4_BLOCK
    elif quant is not None and quant.method == INT:  # integer experts stay packed on the CPU too
        expert_bits = quant.bits
    kv_bytes_per_token = (2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
                          * (1 if resolved.kv_cache_dtype == "fp8" else dtype_bytes))
    gpus = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size
    model_limit, requested_len = model_config.max_model_len, config.model.max_model_len
    if requested_len is not None and requested_len > model_limit:  # the runner's check, with its message
        raise ValueError(f"max_model_len={requested_len} exceeds the model's limit of {model_limit} positions")
    kv_tokens = _known_kv_tokens(config.cache, device_type, kv_bytes_per_token // max(1, gpus),
                                 config.scheduler.max_num_seqs, requested_len or model_limit)
    max_model_len = min(requested_len or model_limit, kv_tokens or model_limit)
    return EnginePreview(resolved.model_path, config.pooling.task, resolved.tokenizer, model_config, max_model_len,
                         resolved.pooling_params, resolved.embedding_dim, resolved.pinned_quantization,
                         resolved.kv_cache_dtype, device_type, config.model.dtype, dtype_bytes, linear_bits,
                         expert_bits, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
                         kv_tokens, gpus, resolved.structured,
                         AdapterRegistry(model_config, config.lora.max_lora_rank, config.lora.enable_lora))


def _known_kv_tokens(cache: CacheConfig, device_type: str, kv_bytes_per_token: int, max_num_seqs: int,
                     max_model_len: int) -> int | None:
    """Tokens the KV pool holds, as the runner sizes it (executor/profiling.py), where that needs no device."""
    from batchllm.executor.profiling import cpu_pool_blocks

    per_block = kv_bytes_per_token * cache.block_size
    if cache.num_blocks:
        blocks = cache.num_blocks
    elif device_type == "cpu":
        blocks = cpu_pool_blocks(cache, per_block, max_num_seqs, max_model_len, cache.block_size)
    else:
        return None
    return blocks * cache.block_size
