"""A step's requests gathered into the flat batch's host-side lists (executor/step_batch.py), without a model:
each expectation is worked out by hand from `ScheduledRequest`'s invariants (tokens, then the placeholder, then
the drafts; a sampled row's first new token sits after its tokens but before its drafts)."""

from __future__ import annotations

import torch

from batchllm.engine.interfaces import NewRequestData, ScheduledRequest, SchedulerOutput
from batchllm.executor.step_batch import RequestStates
from batchllm.lora.request import LoRARequest
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams


def _new(request_id: str, tokens: list[int], **extra) -> NewRequestData:
    params = extra.pop("params", SamplingParams(max_tokens=8))
    return NewRequestData(request_id, tokens, len(tokens), params, **extra)


def _step(*requests: ScheduledRequest, speculative: bool = False) -> SchedulerOutput:
    return SchedulerOutput(list(requests), sum(r.num_tokens for r in requests), speculative=speculative)


def test_a_pooling_chunk_then_a_speculative_step():
    requests = RequestStates(max_blocks_per_seq=4, max_num_seqs=2, device=torch.device("cpu"))
    pooling = PoolingParams(pooling="mean")
    first = requests.gather(_step(
        ScheduledRequest("b", [21, 22], 0, [3], sample=True, new=_new("b", [21, 22], pooling=pooling),
                         full_block_table=True),
        ScheduledRequest("a", [11, 12, 13], 0, [7], sample=False, new=_new("a", [11, 12, 13, 14, 15]),
                         full_block_table=True)), last_rows={})
    assert first.token_ids == [21, 22, 11, 12, 13]
    assert first.num_scheduled.tolist() == [2, 3] and first.num_computed.tolist() == [0, 0]
    assert first.table_rows.tolist() == [0, 1] and first.new_rows == [True, True]
    assert first.sample_index.tolist() == [] and first.sampled_states == []  # a pooling row is not sampled
    assert [(r.request_id, r.start, r.num_tokens, r.position, r.num_prompt_tokens, r.final)
            for r in first.pool_rows] == [("b", 0, 2, 0, 2, True)]
    assert first.drafts is None and first.sample_counts is None and first.lookahead is None
    assert requests.block_tables.table[0, 0] == 3 and requests.block_tables.table[1, 0] == 7

    assert requests.remove("b").pooling == pooling and requests.remove("b") is None
    second = requests.gather(_step(
        ScheduledRequest("a", [14, 15], 3, [2], sample=True, draft_token_ids=[16, 17], num_lookahead=2),
        speculative=True), last_rows={})
    assert second.token_ids == [14, 15, 16, 17]
    assert second.num_scheduled.tolist() == [4] and second.num_computed.tolist() == [3]
    assert second.table_rows.tolist() == [1] and second.new_rows == [False] and second.num_drafts == [2]
    assert second.sample_index.tolist() == [0] and [rid for rid, _ in second.sampled_states] == ["a"]
    assert second.sample_positions == [5]  # 3 computed + 4 scheduled - 2 drafts
    assert second.drafts == [[16, 17]] and second.sample_counts.tolist() == [3]
    lookahead = second.lookahead
    assert (lookahead.sampled_rows, lookahead.table_rows, lookahead.positions, lookahead.num_drafts) == (
        [0], [1], [5], [2])
    assert requests.block_tables.table[1, :2].tolist() == [7, 2]


def test_a_placeholder_an_adapter_and_a_preempted_request():
    requests = RequestStates(max_blocks_per_seq=4, max_num_seqs=2, device=torch.device("cpu"))
    adapter = LoRARequest("sql", 1, "/adapters/sql")
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    requests.gather(_step(ScheduledRequest("a", [5, 6], 0, [4], sample=True, full_block_table=True,
                                           new=_new("a", [5, 6], lora_request=adapter, params=seeded))),
                    last_rows={})
    state = requests.states["a"]
    batch = requests.gather(_step(
        ScheduledRequest("c", [1, 2, 3], 0, [9], sample=True, new=_new("c", [1, 2, 3]), full_block_table=True),
        ScheduledRequest("a", [], 2, [], sample=True, placeholder=True)), last_rows={"a": 3})
    assert batch.token_ids == [1, 2, 3, 0]  # the placeholder's token is written on the device later
    assert batch.placeholder_slots == [3] and batch.placeholder_rows == [3]
    assert batch.lora_rows == [(adapter, 3, 1)]
    assert batch.table_rows.tolist() == [1, 0] and batch.sample_index.tolist() == [0, 1]
    assert batch.sample_positions == [3, 3]  # each one's first token past the scheduled ones (a's placeholder: 2)

    # Preempted and scheduled again as new: the same table row and RNG stream, its blocks as a whole table.
    again = requests.gather(_step(ScheduledRequest("a", [5, 6, 8], 0, [6], sample=True, full_block_table=True,
                                                   new=_new("a", [5, 6, 8], lora_request=adapter,
                                                            params=seeded))), last_rows={})
    assert again.table_rows.tolist() == [0] and again.new_rows == [True]
    assert requests.states["a"].generator is state.generator is not None
    assert requests.block_tables.table[0, 0] == 6 and requests.block_tables.num_blocks[0] == 1
