"""A torch-free stand-in for the model runner that checks what the scheduler hands it.

It keeps a fake paged KV cache: each slot stores the token id written there. When a request samples, the
fake "model" reads the request's whole context back through its block table and derives the next token
from it, so any scheduler bug (wrong tokens, wrong positions, a block shared by two live requests, stale
blocks after preemption) changes the output and fails the test against `expected_continuation`.
"""

from __future__ import annotations

from batchllm.engine.interfaces import ModelRunnerOutput, SampledToken, SchedulerOutput


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the full context."""
    return (sum(t * (i + 1) for i, t in enumerate(context)) % 997) + 3


def expected_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeExecutor:
    def __init__(self, num_blocks: int, block_size: int, max_num_batched_tokens: int) -> None:
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.block_tables: dict[str, list[int]] = {}
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        assert so.num_scheduled_tokens == sum(len(r.token_ids) for r in so.requests)
        assert so.num_scheduled_tokens <= self.max_num_batched_tokens, "token budget exceeded"
        for request_id in so.finished_request_ids:
            self.block_tables.pop(request_id, None)
        sampled = {}
        for r in so.requests:
            if r.new is not None:
                self.block_tables[r.request_id] = list(r.block_ids)
            else:
                self.block_tables[r.request_id].extend(r.block_ids)
            table = self.block_tables[r.request_id]
            end = r.num_computed_tokens + len(r.token_ids)
            assert len(table) * self.block_size >= end, "block table too short for the scheduled tokens"
            for offset, token in enumerate(r.token_ids):
                pos = r.num_computed_tokens + offset
                self.slots[table[pos // self.block_size] * self.block_size + pos % self.block_size] = token
            if r.sample:
                context = [self.slots[table[p // self.block_size] * self.block_size + p % self.block_size]
                           for p in range(end)]
                sampled[r.request_id] = SampledToken(next_token(context))
        self._check_no_shared_blocks(so)
        return ModelRunnerOutput(sampled)

    def _check_no_shared_blocks(self, so: SchedulerOutput) -> None:
        live = [rid for rid in self.block_tables if rid in {r.request_id for r in so.requests}]
        owned = [b for rid in live for b in self.block_tables[rid]]
        assert len(owned) == len(set(owned)), "a KV block is owned by two live requests"
