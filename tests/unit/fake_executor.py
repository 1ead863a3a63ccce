"""A torch-free stand-in for the model runner that checks what the scheduler hands it.

It keeps a fake paged KV cache: each slot stores the token id written there. When a request samples, the
fake "model" reads the request's whole context back through its block table and derives the next token
from it, so any scheduler bug (wrong tokens, wrong positions, a block shared by two live requests, stale
blocks after preemption) changes the output and fails the test against `expected_continuation`.

`execute_model_async` plays the asynchronous runner: a placeholder token is the token this executor
sampled for the request in the step launched just before (as a real runner reads it on the device), and
results must be read in launch order.

A decode burst (`num_steps` k > 1) runs k passes: each pass writes the token the pass before sampled into the next
slot and samples again from the context read back, so the k slots the scheduler allocated are checked too.

Grammar-constrained steps: the sampled token is the first token the step's bitmask allows, counting up
(cyclically) from the fake model's choice. Asynchronously, such a step waits for its bitmask
(`AwaitingGrammar`) before it runs; synchronously, it must carry it.
"""

from __future__ import annotations

import numpy as np

from batchllm.engine.interfaces import (
    AwaitingGrammar,
    GrammarBitmask,
    ModelRunnerOutput,
    ReadyOutput,
    SampledToken,
    SchedulerOutput,
)


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
        self._last_sampled: dict[str, int] = {}  # of the step launched last
        self._num_read = 0

    def execute_model_async(self, so: SchedulerOutput) -> _InOrder | AwaitingGrammar:
        index = len(self.steps)
        if so.grammar_request_ids and so.grammar is None:
            return AwaitingGrammar(lambda grammar: _InOrder(self, index, self._execute(so, grammar)))
        return _InOrder(self, index, self._execute(so, so.grammar))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert not any(r.placeholder for r in so.requests), "a synchronous step has no unknown tokens"
        assert bool(so.grammar_request_ids) == (so.grammar is not None), "a constrained step needs its bitmask"
        self._num_read += 1
        return self._execute(so, so.grammar)

    def _execute(self, so: SchedulerOutput, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        self.steps.append(so)
        masks = {} if grammar is None else dict(zip(grammar.request_ids, grammar.bitmask))
        assert so.num_scheduled_tokens == sum(r.num_tokens for r in so.requests)
        assert so.num_scheduled_tokens <= self.max_num_batched_tokens, "token budget exceeded"
        for request_id in so.finished_request_ids:
            self.block_tables.pop(request_id, None)
        for src, dst in so.block_copies:
            size = self.block_size
            self.slots[dst * size : (dst + 1) * size] = self.slots[src * size : (src + 1) * size]
        for r in so.requests:
            if r.full_block_table:
                self.block_tables[r.request_id] = list(r.block_ids)
            else:
                self.block_tables[r.request_id].extend(r.block_ids)
        sampled = {}
        self._written_this_step: set[int] = set()
        for r in so.requests:
            table = self.block_tables[r.request_id]
            end = r.num_computed_tokens + r.num_tokens
            self._check_writes_are_private(so, r, table)
            assert len(table) * self.block_size >= end, "block table too short for the scheduled tokens"
            tokens = list(r.token_ids)
            if r.placeholder:
                assert r.request_id in self._last_sampled, f"{r.request_id}: placeholder without a sample before it"
                tokens.append(self._last_sampled[r.request_id])
            for offset, token in enumerate(tokens):
                pos = r.num_computed_tokens + offset
                self.slots[table[pos // self.block_size] * self.block_size + pos % self.block_size] = token
            if r.sample:
                context = [self.slots[table[p // self.block_size] * self.block_size + p % self.block_size]
                           for p in range(end)]
                token = next_token(context)
                if r.request_id in masks:
                    token = first_allowed(masks[r.request_id], token)
                sampled[r.request_id] = SampledToken(token)
        accepted = self._burst_passes(so, sampled) if so.num_steps > 1 else {}
        self._last_sampled = {request_id: token.token_id for request_id, token in sampled.items()}
        return ModelRunnerOutput(sampled, accepted)

    def _burst_passes(self, so: SchedulerOutput, sampled: dict[str, SampledToken]) -> dict[str, list[SampledToken]]:
        """A decode burst's passes after the first: `sampled` ends with each row's last token; returns the ones
        before it."""
        accepted = {}
        for r in so.requests:
            assert r.sample and r.num_tokens == 1 and not r.draft_token_ids, f"{r.request_id}: not a decode row"
            table = self.block_tables[r.request_id]
            tokens = [sampled[r.request_id]]
            for step in range(1, so.num_steps):
                pos = r.num_computed_tokens + step
                assert len(table) * self.block_size > pos, "block table too short for the burst"
                self.slots[table[pos // self.block_size] * self.block_size + pos % self.block_size] = \
                    tokens[-1].token_id
                context = [self.slots[table[p // self.block_size] * self.block_size + p % self.block_size]
                           for p in range(pos + 1)]
                tokens.append(SampledToken(next_token(context)))
            accepted[r.request_id], sampled[r.request_id] = tokens[:-1], tokens[-1]
        return accepted

    def _check_writes_are_private(self, so: SchedulerOutput, r, table: list[int]) -> None:
        """No two requests of a step write into the same block. (A request may read a block another request
        fills in the same step: a prefix-cache hit on a block being computed, safe because every layer
        writes the step's K/V before attention reads it. Overwrites of shared contents show up as wrong
        tokens, since the fake model reads its context back from the slots.)"""
        written = {table[p // self.block_size] for p in range(r.num_computed_tokens,
                                                               r.num_computed_tokens + r.num_tokens)}
        overlap = written & self._written_this_step
        assert not overlap, f"{r.request_id} writes blocks {overlap} that another request writes this step"
        self._written_this_step |= written


def first_allowed(bitmask: np.ndarray, start: int) -> int:
    """The first token the bitmask allows, counting up from `start` and wrapping around."""
    vocab = bitmask.shape[0] * 32
    allowed = (bitmask.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    ids = np.flatnonzero(allowed.reshape(vocab))
    assert ids.size, "the bitmask allows nothing"
    after = ids[ids >= start]
    return int(after[0] if after.size else ids[0])


class _InOrder(ReadyOutput):
    """A launched step's result; reading results out of launch order fails the test."""

    def __init__(self, executor: FakeExecutor, index: int, output: ModelRunnerOutput) -> None:
        super().__init__(output)
        self.executor, self.index, self.read = executor, index, False

    def result(self) -> ModelRunnerOutput:
        if not self.read:
            assert self.index == self.executor._num_read, "step results read out of launch order"
            self.executor._num_read += 1
            self.read = True
        return self.output
