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

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from batchllm.config import GENERATE_STEP_BUDGET, CacheConfig, SchedulerConfig, default_step_budget
from batchllm.disaggregation import parse_layout
from batchllm.engine.spec.config import parse_speculative_config
from batchllm.engine.structured_output import StructuredOutputManager, check_backend
from batchllm.lora.registry import AdapterRegistry, check_lora_options
from batchllm.lora.request import LoRARequest
from batchllm.model.config import ModelConfig, architecture_of, read_hf_config
from batchllm.model.size import model_size
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
    from batchllm.executor.build import check_parallel_sizes, check_quantization, resolve_device, resolve_dtype
    from batchllm.llm import LLM
    from batchllm.model.loader import resolve_model_path
    from batchllm.model.pooling_config import pooled_dim, resolve_pooling
    from batchllm.model.quantization import FP8, INT, pinned_quantization, resolve_quantization
    from batchllm.model.registry import get_model_class
    from batchllm.model.spec_checks import check_speculative_model
    from batchllm.tokenizer import load_tokenizer, resolve_eos_token_ids

    try:
        bound = inspect.signature(LLM).bind(model, **dict(engine_kwargs or {}))
    except TypeError as exc:
        raise TypeError(f"LLM() {exc}") from None
    bound.apply_defaults()
    a = bound.arguments
    cache_config = CacheConfig(a["block_size"], a["num_kv_blocks"], a["gpu_memory_utilization"],
                               a["kv_cache_memory_bytes"], a["enable_prefix_caching"], a["swap_space"])
    check_lora_options(a["enable_lora"], a["max_loras"], a["max_lora_rank"])
    tp, pp = a["tensor_parallel_size"], a["pipeline_parallel_size"]
    check_parallel_sizes(tp, pp)
    max_num_batched_tokens = a["max_num_batched_tokens"]
    scheduler_config = SchedulerConfig(a["max_num_seqs"], GENERATE_STEP_BUDGET if max_num_batched_tokens is None
                                       else max_num_batched_tokens,
                                       max_loras=a["max_loras"] if a["enable_lora"] else 0,
                                       preemption_mode=a["preemption_mode"], num_micro_batches=pp)
    cache_config.validate()
    scheduler_config.validate()
    if a["preemption_mode"] == "swap" and not a["swap_space"]:
        raise ValueError("LLM argument preemption_mode='swap' needs swap_space > 0 (GiB of host memory to swap to)")
    requested_len = a["max_model_len"]
    if requested_len is not None and (not isinstance(requested_len, int) or requested_len < 2):
        raise ValueError(f"LLM argument max_model_len must be an int >= 2 or None, got {requested_len!r}")
    device = resolve_device(a["device"])
    dtype = resolve_dtype(a["dtype"], device)
    if a["async_scheduling"] not in (None, True, False):
        raise ValueError(f"LLM argument async_scheduling must be None, True or False, got {a['async_scheduling']!r}")
    check_backend(a["structured_outputs_backend"], "LLM argument structured_outputs_backend")
    spec_config = parse_speculative_config(a["speculative_config"], "LLM argument speculative_config")
    if pp > 1 and (spec_config is not None or a["enable_lora"]):
        raise ValueError(f"LLM argument pipeline_parallel_size={pp} does not work with "
                         f"{'speculative_config' if spec_config is not None else 'enable_lora=True'} yet")
    layout = parse_layout(a["disaggregated"])
    if layout is not None:
        conflicts = [name for name, used in (("tensor_parallel_size", tp > 1), ("pipeline_parallel_size", pp > 1),
                                             ("speculative_config", spec_config is not None),
                                             ("enable_lora", a["enable_lora"])) if used]
        if conflicts:
            raise ValueError(f"LLM argument disaggregated does not work with {conflicts[0]} yet")

    model_path = resolve_model_path(model)
    hf_config = read_hf_config(model_path)
    get_model_class(architecture_of(hf_config))  # the loader's first check, made before it reads any weight
    model_config = ModelConfig.from_hf_dict(hf_config)
    if max_num_batched_tokens is None:
        scheduler_config.max_num_batched_tokens = default_step_budget(a["task"], device.type,
                                                                      model_size(model_config).layers)
    pooling_params = resolve_pooling(model_path, model_config, a["task"], a["pooling"], a["normalize"])
    if pooling_params is not None and (layout is not None or spec_config is not None):
        raise ValueError(f"LLM argument task={a['task']!r} does not work with "
                         f"{'disaggregated' if layout is not None else 'speculative_config'}")
    kv_cache_dtype = check_quantization(model_path, a["quantization"], a["kv_cache_dtype"], device, a["load_format"])
    if spec_config is not None:
        check_speculative_model(spec_config, model_path, tp)
    tokenizer = None if a["skip_tokenizer_init"] else load_tokenizer(a["tokenizer"] or model_path,
                                                                     trust_remote_code=a["trust_remote_code"])
    eos_token_ids = resolve_eos_token_ids(model_path, tokenizer)
    structured = None if tokenizer is None else StructuredOutputManager(
        tokenizer, model_config.vocab_size, eos_token_ids, a["structured_outputs_backend"])

    dtype_bytes = dtype.itemsize
    quant = resolve_quantization(hf_config, a["quantization"])
    linear_bits = 8 * dtype_bytes
    if quant is not None and quant.method == FP8:
        linear_bits = 8
    elif quant is not None and quant.method == INT and device.type == "cuda":  # the CPU dequantizes on load
        linear_bits = quant.bits
    kv_bytes_per_token = (2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
                          * (1 if kv_cache_dtype == "fp8" else dtype_bytes))
    kv_tokens = _known_kv_tokens(cache_config, device.type, kv_bytes_per_token // max(1, tp * pp))
    model_limit = model_config.max_model_len
    if requested_len is not None and requested_len > model_limit:  # the runner's check, with its message
        raise ValueError(f"max_model_len={requested_len} exceeds the model's limit of {model_limit} positions")
    max_model_len = min(requested_len or model_limit, kv_tokens or model_limit)
    return EnginePreview(model_path, a["task"], tokenizer, model_config, max_model_len, pooling_params,
                         pooled_dim(model_config, pooling_params), pinned_quantization(hf_config, a["quantization"]),
                         kv_cache_dtype, device.type, str(dtype).removeprefix("torch."), dtype_bytes, linear_bits,
                         a["max_num_seqs"], scheduler_config.max_num_batched_tokens, kv_tokens, tp * pp, structured,
                         AdapterRegistry(model_config, a["max_lora_rank"], a["enable_lora"]))


def _known_kv_tokens(cache: CacheConfig, device_type: str, kv_bytes_per_token: int) -> int | None:
    """Tokens the KV pool holds, as the runner sizes it (executor/profiling.py), where that needs no device."""
    from batchllm.executor.profiling import _default_cpu_kv_bytes

    per_block = kv_bytes_per_token * cache.block_size
    if cache.num_blocks:
        blocks = cache.num_blocks
    elif device_type == "cpu":
        blocks = (cache.kv_cache_memory_bytes or _default_cpu_kv_bytes()) // per_block
    else:
        return None
    return blocks * cache.block_size
