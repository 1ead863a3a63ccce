"""CUDA graphs for decode steps and for speculative decoding's verification steps.

A decode step of a small model is hundreds of tiny kernel launches; replaying a captured graph turns them
into one launch, which is what keeps the GPU busy when the host is the bottleneck. Graphs are captured at
a ladder of batch sizes (all sharing one memory pool) and a step is padded up to the next size.

A verification step is a decode step with a few more query tokens per row (the row's drafts), and is just as
launch-bound: run eagerly, it cost ~15 ms more than a decode step on an 8B model. Its graphs are captured per
query length q (2 .. k + 1 tokens per row), for the small batches where speculation can pay; every row of the
step is laid out as q tokens (`InputBatch.prepare(query_stride=q)`), its unused ones inert. Prefill and other
mixed steps run eagerly: their shapes vary too much, and their large matmuls hide the launch cost anyway.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from batchllm.executor.input_batch import InputBatch
from batchllm.forward_context import set_forward_context
from batchllm.model.layers.lora import LoRABatch, set_lora_batch

# The adaptive policy speculates where the verification's extra tokens are cheap next to the step: in small
# batches. Past this many rows it plans no drafts on the models we run, so larger graphs would be captured in vain.
MAX_VERIFY_GRAPH_ROWS = 64


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs: 20 graphs for 256 sequences, and the padding
    of a step is under 16 rows (under 12 % of the rows past 128)."""
    ladder = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    sizes = sorted({min(size, max_num_seqs) for size in ladder})
    return sizes


def graph_sizes(max_num_seqs: int, max_query_len: int, max_num_tokens: int) -> dict[int, list[int]]:
    """The batch sizes captured for each query length: decode's (1) up to max_num_seqs, verification's up to
    MAX_VERIFY_GRAPH_ROWS rows and the input buffers' tokens."""
    sizes = {1: capture_sizes(max_num_seqs)}
    verify_rows = min(max_num_seqs, MAX_VERIFY_GRAPH_ROWS)
    for query_len in range(2, max_query_len + 1):
        fitting = [size for size in capture_sizes(verify_rows) if size * query_len <= max_num_tokens]
        if fitting:
            sizes[query_len] = fitting
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, inputs: InputBatch, max_num_seqs: int, max_seq_len: int,
                 lora_batch: LoRABatch | None = None, max_query_len: int = 1) -> None:
        """`lora_batch`: the adapter segments' fixed buffers, when the engine runs adapters: the graphs then hold
        the LoRA kernels too, and a replay applies whatever segments the step uploaded (none: base rows only).
        `max_query_len > 1` (speculative decoding: 1 + k) also captures verification graphs of 2 .. that many
        tokens per row."""
        self.model = model
        self.sizes = graph_sizes(max_num_seqs, max_query_len, inputs.max_num_tokens)
        # Each (rows, query length)'s graph, its hidden-state output and (EAGLE-3) the target's fused stream.
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        pool = None
        # Largest first: later (smaller) graphs fit into the memory the first one reserved in the shared pool.
        shapes = sorted(((size, q) for q, sizes in self.sizes.items() for size in sizes),
                        key=lambda shape: shape[0] * shape[1], reverse=True)
        for size, query_len in shapes:
            input_ids, positions, metadata = inputs.graph_inputs(size, max_seq_len, query_len)
            with set_forward_context(metadata), set_lora_batch(lora_batch):
                model(input_ids, positions)  # warm-up: Triton autotuning and lazy init happen outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = model(input_ids, positions)
            pool = graph.pool()
            self._graphs[size, query_len] = (graph, hidden, model.model.aux_hidden)
        torch.cuda.synchronize()

    @property
    def max_verify_rows(self) -> int:
        """The most rows a verification step replays from a graph (0: none captured)."""
        return max((sizes[-1] for q, sizes in self.sizes.items() if q > 1), default=0)

    def step_shape(self, num_tokens: int, num_scheduled: np.ndarray, num_computed: np.ndarray, speculative: bool,
                   packed_only: bool, max_row_tokens: int) -> tuple[int, int] | None:
        """The captured (rows, tokens per row) a step replays, or None to run it eagerly: a decode-only step, or
        a verification step whose every row, laid out at the graph's stride, still fits its block table
        (`max_row_tokens`); not when adapter segments or placeholder tokens index the packed layout
        (`packed_only`)."""
        num_seqs = len(num_scheduled)
        if num_tokens == num_seqs:
            return self.shape_for(num_seqs, 1)
        if not speculative or packed_only:
            return None
        shape = self.shape_for(num_seqs, int(num_scheduled.max()))
        if shape is None or int(num_computed.max()) + shape[1] > max_row_tokens:
            return None
        return shape

    def shape_for(self, num_seqs: int, query_len: int) -> tuple[int, int] | None:
        """The captured (rows, tokens per row) a step of `num_seqs` rows of up to `query_len` tokens replays
        padded to, or None when it must run eagerly."""
        lengths = sorted(self.sizes)
        i = bisect.bisect_left(lengths, query_len)
        if i == len(lengths):
            return None
        sizes = self.sizes[lengths[i]]
        if num_seqs > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, num_seqs)], lengths[i]

    def replay(self, size: int, query_len: int = 1) -> torch.Tensor:
        """Run the graph of `size` rows of `query_len` tokens on the current buffer contents; returns its
        hidden-state output."""
        graph, hidden, aux_hidden = self._graphs[size, query_len]
        graph.replay()
        if aux_hidden is not None:
            self.model.model.aux_hidden = aux_hidden
        return hidden
