"""CUDA graphs for decode-only steps.

A decode step of a small model is hundreds of tiny kernel launches; replaying a captured graph turns them
into one launch, which is what keeps the GPU busy when the host is the bottleneck. Graphs are captured at
a ladder of batch sizes (all sharing one memory pool) and a step is padded up to the next size. Prefill and
mixed steps run eagerly: their shapes vary too much, and their large matmuls hide the launch cost anyway.
"""

from __future__ import annotations

import bisect

import torch

from batchllm.executor.input_batch import InputBatch
from batchllm.forward_context import set_forward_context
from batchllm.model.layers.lora import LoRABatch, set_lora_batch


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs: 20 graphs for 256 sequences, and the padding
    of a step is under 16 rows (under 12 % of the rows past 128)."""
    ladder = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    sizes = sorted({min(size, max_num_seqs) for size in ladder})
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, inputs: InputBatch, max_num_seqs: int, max_seq_len: int,
                 lora_batch: LoRABatch | None = None) -> None:
        """`lora_batch`: the adapter segments' fixed buffers, when the engine runs adapters: the graphs then hold
        the LoRA kernels too, and a replay applies whatever segments the step uploaded (none: base rows only)."""
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        # Each size's graph, its hidden-state output and (EAGLE-3) the target's fused stream it also writes.
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        pool = None
        # Largest first: later (smaller) graphs fit into the memory the first one reserved in the shared pool.
        for size in reversed(self.sizes):
            input_ids, positions, metadata = inputs.graph_inputs(size, max_seq_len)
            with set_forward_context(metadata), set_lora_batch(lora_batch):
                model(input_ids, positions)  # warm-up: Triton autotuning and lazy init happen outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = model(input_ids, positions)
            pool = graph.pool()
            self._graphs[size] = (graph, hidden, model.model.aux_hidden)
        torch.cuda.synchronize()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` rows on the current buffer contents; returns its hidden-state output."""
        graph, hidden, aux_hidden = self._graphs[size]
        graph.replay()
        if aux_hidden is not None:
            self.model.model.aux_hidden = aux_hidden
        return hidden
