"""Where each served model's engine process runs: its own GPUs when enough are visible, else a share of the GPUs'
memory (`gpu_memory_utilization` divided by the number of models), or a share of the CPU's threads.

The GPU groups are the data-parallel replicas' (`connectors/replicas/devices.py`): model i gets GPUs
[i * per_engine, (i + 1) * per_engine) of the visible list through `CUDA_VISIBLE_DEVICES`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchllm.connectors.replicas.devices import gpu_groups, plan_placements

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # LLM's


@dataclass(frozen=True, slots=True)
class EnginePlacement:
    env: dict[str, str]
    num_threads: int | None
    engine_kwargs: dict[str, Any]


def gpu_count(engine_kwargs: Mapping[str, Any]) -> int:
    """The GPUs the engines may use (0: they run on the CPU)."""
    return 0 if str(engine_kwargs.get("device", "auto")) == "cpu" else _cuda_device_count()


def plan_engines(num_engines: int, engine_kwargs: Mapping[str, Any]) -> list[EnginePlacement]:
    kwargs = dict(engine_kwargs)
    device = str(kwargs.get("device", "auto"))
    num_gpus = gpu_count(kwargs)
    if num_engines == 1:
        return [EnginePlacement({}, None, kwargs)]
    if num_gpus == 0:
        return [EnginePlacement({}, p.num_threads, kwargs) for p in plan_placements(num_engines, kwargs)]
    per_engine = (kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
                  * (2 if kwargs.get("disaggregated") else 1))
    if not device.startswith("cuda:") and num_engines * per_engine <= num_gpus:
        groups = gpu_groups(num_engines, kwargs.get("tensor_parallel_size", 1), num_gpus,
                            os.environ.get("CUDA_VISIBLE_DEVICES"), kwargs.get("pipeline_parallel_size", 1),
                            2 if kwargs.get("disaggregated") else 1)
        return [EnginePlacement({"CUDA_VISIBLE_DEVICES": group}, None, kwargs) for group in groups]
    share = kwargs.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION) / num_engines
    return [EnginePlacement({}, None, {**kwargs, "gpu_memory_utilization": share}) for _ in range(num_engines)]


def _cuda_device_count() -> int:
    import torch  # counting devices does not create a CUDA context: the engines start from a clean slate

    return torch.cuda.device_count()
