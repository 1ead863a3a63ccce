"""A stand-in for CUDA graphs on the CPU: "replays" run the model eagerly on the staged arrays of the replayed
shape (`InputBatch.replay_layout`), exactly what a captured graph reads, so the layouts the graphs replay are
tested where graphs cannot run."""

from __future__ import annotations

from batchllm.executor.cuda_graphs import DecodeGraphs, graph_sizes
from batchllm.forward_context import AttentionMetadata, set_forward_context


class EagerReplay(DecodeGraphs):
    """A `DecodeGraphs` whose replays run the model eagerly on the arrays its graph would read."""

    def __init__(self, runner) -> None:
        self.model, self.inputs = runner.model, runner.inputs
        k = runner.speculative.num_speculative_tokens
        self.sizes = graph_sizes(runner.scheduler_config.max_num_seqs, 1 + k, self.inputs.max_num_tokens)
        self.replayed: list[tuple[int, int]] = []

    def replay(self, size: int, query_len: int = 1):
        self.replayed.append((size, query_len))
        step = self.inputs.replay_layout(size, query_len)
        host, device = step.host, step.device
        metadata = AttentionMetadata(device["slot_mapping"], device["query_start_loc"], device["seq_lens"],
                                     device["block_tables"], query_len, int(host["seq_lens"].max()),
                                     host["query_start_loc"].tolist(), host["seq_lens"].tolist())
        with set_forward_context(metadata):
            return self.model(device["input_ids"], device["positions"])
