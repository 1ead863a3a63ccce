"""`LLM.stream`: the incremental feed the jobs use (bounded admission, backpressure, early close)."""

from __future__ import annotations

import pytest

from batchllm import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0)
PROMPTS = ["One", "Two", "Three", "Four", "Five"]


def test_bounded_admission_and_results_equal_generate(llm):
    scheduler = llm.engine.scheduler
    in_engine_at_pull = []

    def source():
        for i, prompt in enumerate(PROMPTS):
            in_engine_at_pull.append(len(scheduler.waiting) + len(scheduler.running))
            yield i, prompt, PARAMS

    results = dict(llm.stream(source(), max_in_flight=2))
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert [results[i].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    assert max(in_engine_at_pull) < 2  # a request is pulled only when one of the 2 slots is free


def test_source_may_pause_but_not_with_nothing_in_flight(llm):
    def pausing():
        yield 0, "One", PARAMS
        yield None  # wait for a step
        yield 1, "Two", PARAMS

    assert sorted(key for key, _ in llm.stream(pausing())) == [0, 1]
    with pytest.raises(RuntimeError, match="paused admission with nothing in flight"):
        list(llm.stream(iter([None])))


def test_closing_early_leaves_the_engine_empty(llm):
    stream = llm.stream(((i, p, PARAMS) for i, p in enumerate(PROMPTS)), max_in_flight=3)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()

    def failing():
        yield 0, "One", PARAMS
        raise OSError("the source broke")

    with pytest.raises(OSError, match="the source broke"):
        list(llm.stream(failing()))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)) == 2
