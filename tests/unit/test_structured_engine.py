"""Structured outputs through EngineCore with a fake executor and a fake grammar (no torch, no llguidance).

The fake grammar ("L tokens, the i-th congruent to i mod 3, then EOS") is simple enough to simulate by hand,
so the test checks what the engine does with a grammar: every sampled token obeys the mask computed from
exactly the tokens before it (also when the bitmask of step N+1 is filled while step N+1 runs), finished
requests are complete or carry the "incomplete" note, and preemption does not disturb a matcher.
"""

from __future__ import annotations

import numpy as np
import pytest

import batchllm.engine.structured.llguidance_backend as grammar_module
from batchllm.engine.request import Request, RequestStatus
from batchllm.engine.structured.manager import StructuredOutputManager
from batchllm.sampling_params import SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams
from tests.unit.fake_executor import expected_continuation, next_token
from tests.unit.test_scheduler import _engine, _prompts, _run

EOS = 2
VOCAB = 1000
WIDTH = (VOCAB + 31) // 32


class _FakeMatcher:
    def __init__(self, length: int) -> None:
        self.length, self.accepted, self.ended = length, 0, False

    def allowed(self) -> set[int]:
        if self.ended:
            return {EOS}
        if self.accepted == self.length:
            return {EOS}
        return {t for t in range(3, VOCAB) if t % 3 == self.accepted % 3}

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed():
            return False
        if token_id == EOS:
            self.ended = True
        else:
            self.accepted += 1
        return True

    def fill_bitmask(self, out: np.ndarray) -> None:
        bits = np.zeros(WIDTH * 32, dtype=np.uint32)
        bits[sorted(self.allowed())] = 1
        out[:] = (bits.reshape(WIDTH, 32) << np.arange(32, dtype=np.uint32)).sum(1).astype(np.uint32).view(np.int32)

    @property
    def is_terminated(self) -> bool:
        return self.ended

    @property
    def can_finish(self) -> bool:
        return self.ended or self.accepted == self.length


class _FakeCompiler:
    bitmask_width = WIDTH

    def new_matcher(self, params: StructuredOutputsParams) -> _FakeMatcher:
        return _FakeMatcher(int(params.spec))


def _fill_bitmasks(matchers, out):
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(out[row])


def _reference(prompt: list[int], length: int, max_tokens: int) -> list[int]:
    """The fake grammar by hand: the first allowed id at or after the fake model's choice, wrapping around."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        if len(out) == length:
            out.append(EOS)
            break
        start = next_token(tokens)
        allowed = [t for t in range(3, VOCAB) if t % 3 == len(out) % 3]
        token = next((t for t in allowed if t >= start), allowed[0])
        tokens.append(token)
        out.append(token)
    return out


def _check_stop(request: Request) -> bool:
    if request.token_ids[-1] == EOS:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if request.num_output_tokens >= request.sampling_params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


@pytest.mark.parametrize("num_blocks,budget", [(400, 8192), (14, 16)])
def test_constrained_rows_follow_their_grammar_and_the_rest_is_untouched(num_blocks, budget, async_scheduling,
                                                                          monkeypatch):
    monkeypatch.setattr(grammar_module, "fill_bitmasks", _fill_bitmasks)
    engine, executor = _engine(num_blocks, budget, async_scheduling=async_scheduling)
    engine.scheduler.check_stop = _check_stop
    engine.structured = StructuredOutputManager(None, VOCAB, [EOS])
    engine.structured._compiler = _FakeCompiler()
    prompts = _prompts(16, seed=num_blocks, low=5, high=min(120, num_blocks * 16 - 60))
    cases = {}  # request id → (prompt, grammar length or None, max_tokens)
    for i, prompt in enumerate(prompts):
        length = None if i % 3 == 0 else (i * 5) % 17 + 1
        max_tokens = 12 + i % 7
        constraint = None if length is None else StructuredOutputsParams(regex=str(length))
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, structured_outputs=constraint))
        cases[str(i)] = (prompt, length, max_tokens)
    done = _run(engine)

    for request_id, (prompt, length, max_tokens) in cases.items():
        request = done[request_id]
        if length is None:
            assert request.output_token_ids == expected_continuation(prompt, max_tokens), request_id
            assert request.error is None
            continue
        assert request.output_token_ids == _reference(prompt, length, max_tokens), request_id
        if length < max_tokens:
            assert request.status is RequestStatus.FINISHED_STOPPED and request.error is None, request_id
        else:
            assert request.status is RequestStatus.FINISHED_LENGTH, request_id
            assert "incomplete" in request.error, request_id
    assert engine.structured.num_active == 0
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    if num_blocks < 20:
        assert engine.scheduler.stats.num_preemptions > 0, "the small pool was meant to force preemption"
    if async_scheduling:
        assert any(r.placeholder for step in executor.steps for r in step.requests), "nothing was overlapped"


def test_a_constraint_the_grammar_engine_rejects_fails_that_request_alone(async_scheduling, monkeypatch):
    class _Rejecting(_FakeCompiler):
        def new_matcher(self, params):
            if params.spec == "bad":
                raise grammar_module.GrammarError("structured outputs: the regex constraint is rejected")
            return super().new_matcher(params)

    monkeypatch.setattr(grammar_module, "fill_bitmasks", _fill_bitmasks)
    engine, _ = _engine(100, 256, async_scheduling=async_scheduling)
    engine.scheduler.check_stop = _check_stop
    engine.structured = StructuredOutputManager(None, VOCAB, [EOS])
    engine.structured._compiler = _Rejecting()
    engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="bad")))
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=4))
    done = _run(engine)
    assert done["bad"].status is RequestStatus.FINISHED_ERROR and "rejected" in done["bad"].error
    assert done["bad"].output_token_ids == []
    assert done["good"].output_token_ids == expected_continuation([5, 6, 7], 4)
