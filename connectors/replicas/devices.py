"""Where each data-parallel replica runs: its own group of GPUs, or an equal share of the CPU threads.

With GPUs visible to the parent, replica i gets GPUs [i * tp, (i + 1) * tp) of the parent's visible list
(tp = `tensor_parallel_size`, default 1) through `CUDA_VISIBLE_DEVICES`; an existing list in the parent
(`CUDA_VISIBLE_DEVICES=4,5,6,7`) is indexed into, so replicas stay inside what the user gave the job.
Inside a replica its GPUs are then cuda:0 .. cuda:tp-1. Without GPUs (or with device="cpu") the replicas
split the CPUs the parent may run on, so N replicas do not oversubscribe the cores N times.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class Placement:
    env: dict[str, str]  # set in the replica's environment before it starts, so before it can import torch
    num_threads: int | None  # torch intra-op threads (CPU replicas); None: torch's default


def plan_placements(num_replicas: int, engine_kwargs: Mapping[str, Any]) -> list[Placement]:
    device = str(engine_kwargs.get("device", "auto"))
    if device.startswith("cuda:"):
        raise ValueError(f"device={device!r} names one GPU, but with data_parallel_size > 1 each replica gets its "
                         f"own GPUs: pass device='cuda' or 'auto'")
    gpu_count = 0 if device == "cpu" else _cuda_device_count()
    if gpu_count == 0:
        threads = max(1, _usable_cpus() // num_replicas)
        return [Placement({}, threads) for _ in range(num_replicas)]
    groups = gpu_groups(num_replicas, engine_kwargs.get("tensor_parallel_size", 1), gpu_count,
                        os.environ.get("CUDA_VISIBLE_DEVICES"), engine_kwargs.get("pipeline_parallel_size", 1),
                        2 if engine_kwargs.get("disaggregated") else 1)
    return [Placement({"CUDA_VISIBLE_DEVICES": group}, None) for group in groups]


def gpu_groups(num_replicas: int, tensor_parallel_size: Any, device_count: int, visible: str | None,
               pipeline_parallel_size: Any = 1, engines: int = 1) -> list[str]:
    """The `CUDA_VISIBLE_DEVICES` value of each replica: its tensor-parallel ranks times its pipeline stages, times
    its `engines` (2: disaggregated prefill and decode)."""
    sizes = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be an int >= 1, got {size!r}")
    per_replica = tensor_parallel_size * pipeline_parallel_size * engines
    needed = num_replicas * per_replica
    if needed > device_count:
        named = " x ".join(f"{name}={size}" for name, size in sizes.items() if size > 1 or name[0] == "t")
        named += " x 2 engines (disaggregated)" if engines == 2 else ""
        raise ValueError(f"data_parallel_size={num_replicas} x {named} needs {needed} GPUs, but {device_count} are "
                         f"visible")
    ids = [s.strip() for s in visible.split(",")][:device_count] if visible else [str(i) for i in range(device_count)]
    return [",".join(ids[i * per_replica:(i + 1) * per_replica]) for i in range(num_replicas)]


def _cuda_device_count() -> int:
    import torch  # counting devices does not create a CUDA context, so the replicas start from a clean slate

    return torch.cuda.device_count()


def _usable_cpus() -> int:
    # The affinity mask, not os.cpu_count(): in a container or under taskset only those cores are ours.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
