"""Handing activations from one pipeline stage to the next (NCCL on GPUs, gloo on the CPU).

Each step every stage reads the same `SchedulerOutput` and lays out the same flat batch, so the receiver knows
the shape of what comes: `[num_tokens, hidden]` hidden states and residual stream. A stage sends to the rank of
its own tensor-parallel rank in the next stage, without waiting for the receiver: it goes on to the next step's
micro-batch while the next stage computes this one. A send's buffers are kept until it completes (checked before
the next send), so the caching allocator cannot hand them out while they are still being read.
"""

from __future__ import annotations

import torch

from batchllm.distributed.parallel_state import get_pp, get_tp, global_rank


class StageLink:
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        pp, tp = get_pp(), get_tp()
        self._prev = None if pp.is_first else global_rank(pp.rank - 1, tp.rank)
        self._next = None if pp.is_last else global_rank(pp.rank + 1, tp.rank)
        self._hidden_size, self._dtype, self._device = hidden_size, dtype, device
        self._sending: list = []  # the works of the last send and the tensors they read

    def receive(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        hidden, residual = (torch.empty(num_tokens, self._hidden_size, dtype=self._dtype, device=self._device)
                            for _ in range(2))
        for work in [dist.irecv(hidden, self._prev), dist.irecv(residual, self._prev)]:
            work.wait()
        return hidden, residual

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        import torch.distributed as dist

        self.wait_sent()
        tensors = (hidden.contiguous(), residual.contiguous())
        self._sending = [*(dist.isend(tensor, self._next) for tensor in tensors), tensors]

    def wait_sent(self) -> None:
        for work in self._sending[:-1]:
            work.wait()
        self._sending = []
