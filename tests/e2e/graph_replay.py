"""A stand-in for CUDA graphs on the CPU: "replays" run the model eagerly on the runner's input buffers,
exactly what a captured graph reads, so the layouts the graphs replay are tested where graphs cannot run."""

from __future__ import annotations

from batchllm.executor.cuda_graphs import DecodeGraphs, graph_sizes
from batchllm.forward_context import AttentionMetadata, set_forward_context


class EagerReplay(DecodeGraphs):
    """A `DecodeGraphs` whose replays run the model eagerly on the runner's input buffers."""

    def __init__(self, runner) -> None:
        self.model, self.inputs = runner.model, runner.inputs
        k = runner.speculative.num_speculative_tokens
        self.sizes = graph_sizes(runner.scheduler_config.max_num_seqs, 1 + k, self.inputs.max_num_tokens)
        self.replayed: list[tuple[int, int]] = []

    def replay(self, size: int, query_len: int = 1):
        self.replayed.append((size, query_len))
        inputs, n = self.inputs, size * query_len
        seq_lens = inputs.seq_lens.np[:size]
        metadata = AttentionMetadata(inputs.slot_mapping.device[:n], inputs.query_start_loc.device[: size + 1],
                                     inputs.seq_lens.device[:size], inputs.block_tables.device[:size], query_len,
                                     int(seq_lens.max()), inputs.query_start_loc.np[: size + 1].tolist(),
                                     seq_lens.tolist())
        with set_forward_context(metadata):
            return self.model(inputs.input_ids.device[:n], inputs.positions.device[:n])
