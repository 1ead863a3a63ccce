"""Building the executor of an `LLM`: one model runner, or a model-parallel group of worker processes."""

from __future__ import annotations

from typing import Any

import torch

from batchllm.distributed.parallel_state import check_tensor_parallel_shape
from batchllm.engine_config import check_parallel_sizes
from batchllm.executor.model_runner import ModelRunner, RunnerConfig
from batchllm.executor.multiproc_executor import MultiprocExecutor
from batchllm.model.config import ModelConfig, read_hf_config
from batchllm.model.quantization import FP8, check_on_load, resolve_kv_cache_dtype, resolve_quantization
from batchllm.model.quantization.fp8 import check_fp8_device
from batchllm.model.stages import stage_layers


def build_executor(config: RunnerConfig, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> Any:
    """The model runner in this process, or with model parallelism a group of worker processes."""
    check_parallel_sizes(tensor_parallel_size, pipeline_parallel_size)
    world = tensor_parallel_size * pipeline_parallel_size
    if world == 1:
        return ModelRunner(config)
    model = ModelConfig.from_hf_dict(read_hf_config(config.model_path))
    check_tensor_parallel_shape(model.num_heads, model.num_kv_heads, model.intermediate_size, tensor_parallel_size)
    stage_layers(model, pipeline_parallel_size)  # raises if the model has fewer layers than stages
    sizes = f"tensor_parallel_size={tensor_parallel_size} x pipeline_parallel_size={pipeline_parallel_size}"
    if config.device.type == "cuda" and config.device.index is not None:
        raise ValueError(f"device={str(config.device)!r} names one GPU, but {sizes} uses GPUs 0..{world - 1}: pass "
                         f"device='cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES")
    if config.device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"{sizes} needs {world} GPUs, {torch.cuda.device_count()} are visible")
    # Each CPU rank gets its share of this process's threads, so ranks do not oversubscribe the cores.
    num_threads = max(1, torch.get_num_threads() // world)
    return MultiprocExecutor(config, tensor_parallel_size, num_threads, pipeline_parallel_size)


def check_quantization(model_path: Any, quantization: str | None, kv_cache_dtype: str, device: torch.device,
                       load_format: str = "auto") -> str:
    """Validate `quantization` and `kv_cache_dtype` against the checkpoint and the device before anything loads;
    returns the KV dtype's canonical name ('auto' or 'fp8')."""
    quant = resolve_quantization(read_hf_config(model_path), quantization)
    check_on_load(quant, quantization, load_format)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
    if quant is not None and quant.method == FP8:
        check_fp8_device(device, "FP8 weights" if quantization is None else f"quantization={quantization!r}")
    if kv_dtype == "fp8":
        check_fp8_device(device, f"kv_cache_dtype={kv_cache_dtype!r}")
    return kv_dtype
