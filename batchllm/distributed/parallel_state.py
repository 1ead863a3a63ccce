"""This process's place in the model-parallel world, and the tensor-parallel group's collectives.

A process holds one rank of `pipeline_parallel_size` stages × `tensor_parallel_size` ranks each: global rank
`stage * tp_size + tp_rank`. Each stage's ranks form a tensor-parallel group; a stage hands its activations to
the rank of the same `tp_rank` in the next stage (executor/pipeline.py). With both sizes 1 (the default, and
the engine's own process) every collective is a no-op, so single-device code pays nothing and never imports
`torch.distributed`. Worker processes call `init_model_parallel` once, before building the model: the layers
read their ranks and group sizes when they are constructed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and answers the engine; the other ranks only compute their shards."""
        return self.rank == 0


@dataclass(frozen=True, slots=True)
class PipelineParallel:
    rank: int = 0  # this process's stage
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


_state = TensorParallel()
_pp = PipelineParallel()
_tp_group = None  # this stage's tensor-parallel group; None: the whole world is one stage
_tp_root = 0  # the global rank of this stage's tensor-parallel rank 0


def get_tp() -> TensorParallel:
    return _state


def get_pp() -> PipelineParallel:
    return _pp


def global_rank(stage: int, tp_rank: int) -> int:
    return stage * _state.size + tp_rank


def init_model_parallel(rank: int, tp_size: int, pp_size: int, backend: str, init_method: str,
                        timeout_s: float) -> None:
    """Join the world of `tp_size * pp_size` ranks (NCCL on GPUs, gloo on CPU) as global `rank`."""
    global _state, _pp, _tp_group, _tp_root
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp_size * pp_size,
                            timeout=timedelta(seconds=timeout_s))
    stage, tp_rank = divmod(rank, tp_size)
    if pp_size > 1 and tp_size > 1:
        # Every rank creates every group, in the same order (torch.distributed requires it).
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        _tp_group = groups[stage]
    _state, _pp, _tp_root = TensorParallel(tp_rank, tp_size), PipelineParallel(stage, pp_size), stage * tp_size


def destroy_model_parallel() -> None:
    global _state, _pp, _tp_group, _tp_root
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _state, _pp, _tp_group, _tp_root = TensorParallel(), PipelineParallel(), None, 0


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` across the tensor-parallel group, in place (row-parallel outputs, the vocab-parallel embedding)."""
    if _state.size > 1:
        torch.distributed.all_reduce(tensor, group=_tp_group)
    return tensor


def all_reduce_min(value: int) -> int:
    """The smallest `value` across every rank of every stage: all must agree on, e.g., the KV pool size."""
    if _state.size == 1 and _pp.size == 1:
        return value
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def gather_last_dim(tensor: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's `tensor` along the last dimension on rank 0 (None on the other ranks).

    Only rank 0 samples, so the vocab-parallel logits go to it alone rather than to every rank.
    """
    if _state.size == 1:
        return tensor
    import torch.distributed as dist

    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_state.size)] if _state.is_driver else None
    dist.gather(tensor, parts, dst=_tp_root, group=_tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast_from_driver(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, in place (the sampled ids that the next step's inputs read)."""
    if _state.size > 1:
        torch.distributed.broadcast(tensor, src=_tp_root, group=_tp_group)
    return tensor


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads are split across ranks; with more ranks than KV heads each rank keeps one, replicated."""
    return max(1, num_kv_heads // tp_size)


def check_tensor_parallel_shape(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> None:
    """Refuse a `tensor_parallel_size` the model's shape cannot be split by, before any process starts."""
    problems = []
    if num_heads % tp_size:
        problems.append(f"num_attention_heads={num_heads} is not divisible by it")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        problems.append(f"num_key_value_heads={num_kv_heads} neither divides it nor is divisible by it")
    if intermediate_size % tp_size:
        problems.append(f"intermediate_size={intermediate_size} is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp_size} does not fit this model: " + "; ".join(problems))
