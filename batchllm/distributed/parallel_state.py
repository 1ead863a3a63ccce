"""This process's place in the model-parallel world, and the tensor-parallel group's collectives.

A process holds one rank of `pipeline_parallel_size` stages × `tensor_parallel_size` ranks each: global rank
`stage * tp_size + tp_rank`. Each stage's ranks form a tensor-parallel group; a stage hands its activations to
the rank of the same `tp_rank` in the next stage (executor/pipeline.py). With both sizes 1 (the default, and
the engine's own process) every collective is a no-op, so single-device code pays nothing and never imports
`torch.distributed`. Worker processes call `init_model_parallel` once, before building the model: the layers
read their ranks and group sizes when they are constructed.

Expert parallelism (`enable_expert_parallel=True`) reuses each stage's tensor-parallel group: its ranks hold the
MoE layers' experts whole instead of a slice of every expert, and exchange tokens with `all_to_all`
(model/layers/expert_parallel.py).
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


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """Rank r of n holds the experts `[r * E/n, (r + 1) * E/n)` of every MoE layer. size 1: off (the default, and
    what `enable_expert_parallel=True` means without tensor parallelism)."""

    rank: int = 0
    size: int = 1

    def local_experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        check_expert_parallel(num_experts, self.size)
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


_state = TensorParallel()
_pp = PipelineParallel()
_ep = ExpertParallel()
_tp_group = None  # this stage's tensor-parallel group; None: the whole world is one stage
_tp_root = 0  # the global rank of this stage's tensor-parallel rank 0


def get_tp() -> TensorParallel:
    return _state


def get_pp() -> PipelineParallel:
    return _pp


def get_ep() -> ExpertParallel:
    return _ep


def global_rank(stage: int, tp_rank: int) -> int:
    return stage * _state.size + tp_rank


def init_model_parallel(rank: int, tp_size: int, pp_size: int, backend: str, init_method: str,
                        timeout_s: float, expert_parallel: bool = False) -> None:
    """Join the world of `tp_size * pp_size` ranks (NCCL on GPUs, gloo on CPU) as global `rank`; with
    `expert_parallel`, the tensor-parallel group also splits the experts (a no-op when `tp_size` is 1)."""
    global _state, _pp, _ep, _tp_group, _tp_root
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp_size * pp_size,
                            timeout=timedelta(seconds=timeout_s))
    stage, tp_rank = divmod(rank, tp_size)
    if pp_size > 1 and tp_size > 1:
        # Every rank creates every group, in the same order (torch.distributed requires it).
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        _tp_group = groups[stage]
    _state, _pp, _tp_root = TensorParallel(tp_rank, tp_size), PipelineParallel(stage, pp_size), stage * tp_size
    _ep = ExpertParallel(tp_rank, tp_size) if expert_parallel else ExpertParallel()


def destroy_model_parallel() -> None:
    global _state, _pp, _ep, _tp_group, _tp_root
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _state, _pp, _ep, _tp_group, _tp_root = TensorParallel(), PipelineParallel(), ExpertParallel(), None, 0


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


def all_to_all(tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Across the tensor-parallel group: the first `send_counts[0]` rows of `tensor` go to rank 0, the next
    `send_counts[1]` to rank 1, ...; returns the rows received, `recv_counts[r]` from rank r, in rank order.
    (gloo implements `all_to_all_single` with split sizes on the CPU, as NCCL does on GPUs.)"""
    received = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
    torch.distributed.all_to_all_single(received, tensor.contiguous(), recv_counts, send_counts, group=_tp_group)
    return received


def all_gather_rows(tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's rows (rank r holds `counts[r]`) concatenated in rank order, on every rank of the group.
    `all_gather` needs one shape on every rank: each rank's rows are padded to the largest count."""
    most = max(counts)
    padded = tensor.new_zeros((most, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in counts]
    torch.distributed.all_gather(parts, padded, group=_tp_group)
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])


def check_expert_parallel(num_experts: int, ep_size: int) -> None:
    """Refuse expert parallelism whose ranks cannot hold the same number of whole experts."""
    if num_experts % ep_size:
        raise ValueError(f"enable_expert_parallel=True places each MoE layer's {num_experts} experts whole on the "
                         f"tensor_parallel_size={ep_size} ranks, but {num_experts} is not divisible by {ep_size}")


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
