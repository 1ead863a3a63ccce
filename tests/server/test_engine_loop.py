"""EngineLoop itself, on the default model: plain-thread consumers, the Batch API's `BatchEngine` (LLM.stream's
contract), live-before-batch admission, draining shutdown (HTTP 503) and an engine that raises."""

from __future__ import annotations

import queue
import threading

import httpx
import pytest

from batchllm import LLM, SamplingParams
from batchllm.connectors.engine_cache import get_llm
from batchllm.engine_client import EngineClient
from batchllm.entrypoints.server.app import build_app
from batchllm.entrypoints.server.engine_loop import BATCH, LIVE, EngineLoop
from batchllm.entrypoints.server.request_stream import EngineDead, ServerShuttingDown
from tests.server.conftest import serving, wait_until

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Water boils at", "The sky is"]
GREEDY = SamplingParams(max_tokens=6, temperature=0)
TIMEOUT = 60


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_num_seqs=8, num_kv_blocks=128)
    llm.reference = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return llm


@pytest.fixture
def loop(llm):
    loop = EngineLoop(llm)
    yield loop
    loop.shutdown(5)
    pool = llm.engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"


def _events(stream):
    events = []
    while not events or not events[-1].finished:
        events.append(stream.next_event_blocking(timeout=TIMEOUT))
    return events


def test_a_plain_thread_consumer_gets_deltas_that_add_up(llm, loop):
    token_ids = llm.tokenizer(PROMPTS[0])["input_ids"]
    events = _events(loop.submit(token_ids, SamplingParams(n=2, max_tokens=6, temperature=0)))
    ref = llm.reference[0].outputs[0]
    output = events[-1].output
    assert [c.token_ids for c in output.outputs] == [ref.token_ids] * 2
    for index in range(2):
        updates = [u for e in events for u in e.updates if u.index == index]
        assert sum((u.token_ids for u in updates), []) == ref.token_ids
        assert "".join(u.text for u in updates) == ref.text
        assert [u.finish_reason for u in updates][-1] == ref.finish_reason
    assert len(events) > 2, "updates come per step, not only at the end"


def test_batch_engine_keeps_the_stream_contract(llm, loop):
    engine = loop.batch_engine()
    assert isinstance(engine, EngineClient) and get_llm(llm=engine) is engine
    assert (engine.tokenizer, engine.model_path, engine.max_model_len) == (llm.tokenizer, llm.model_path,
                                                                           llm.max_model_len)
    assert engine.max_num_seqs == 8
    pulled, done, peak = [0], [0], [0]

    def source():
        for i, prompt in enumerate(PROMPTS):
            if i == 3:
                yield None  # a pause: admission waits for the next result
            pulled[0] += 1
            peak[0] = max(peak[0], pulled[0] - done[0])
            yield (f"key{i}", prompt, GREEDY)

    results = {}
    for key, output in engine.stream(source(), max_in_flight=3):
        done[0] += 1
        results[key] = output
    assert set(results) == {f"key{i}" for i in range(len(PROMPTS))}
    for i in range(len(PROMPTS)):
        assert results[f"key{i}"].outputs[0].token_ids == llm.reference[i].outputs[0].token_ids
    assert peak[0] <= 3


def test_closing_a_batch_stream_early_aborts_what_it_has_in_flight(llm, loop):
    engine = loop.batch_engine()
    long = SamplingParams(max_tokens=1000, ignore_eos=True)
    stream = engine.stream(((i, PROMPTS[0], long if i else GREEDY) for i in range(4)))
    key, _ = next(stream)
    assert key == 0
    stream.close()
    wait_until(lambda: loop.snapshot.num_running == 0 and loop.snapshot.num_used_blocks == 0, 20,
               "the abandoned batch requests to be aborted")


def test_a_stop_event_ends_a_batch_stream(llm, loop):
    stop = threading.Event()
    engine = loop.batch_engine(stop_event=stop, abort_on_stop=True)
    long = SamplingParams(max_tokens=1000, ignore_eos=True)
    stream = engine.stream((i, PROMPTS[0], long) for i in range(100))
    timer = threading.Timer(0.5, stop.set)
    timer.start()
    assert list(stream) == []
    timer.join()
    wait_until(lambda: loop.snapshot.num_running == 0, 20, "the stopped batch to be aborted")


def test_live_requests_are_admitted_ahead_of_a_big_batch(llm, loop):
    finished: queue.Queue = queue.Queue()
    token_ids = llm.tokenizer(PROMPTS[1])["input_ids"]
    few = SamplingParams(max_tokens=3, temperature=0)
    batch = [loop.submit(token_ids, few, priority=BATCH, incremental=False, sink=finished) for _ in range(24)]
    live = loop.submit(token_ids, few, priority=LIVE, incremental=False, sink=finished)
    order = []
    while len(order) < 25:
        stream, event = finished.get(timeout=TIMEOUT)
        assert event.output is not None
        order.append(stream)
    assert set(order) == {*batch, live}
    assert order.index(live) < 14, f"the live request finished {order.index(live) + 1}th of 25"


def test_shutdown_drains_then_aborts_and_answers_503(llm, loop):
    token_ids = llm.tokenizer(PROMPTS[0])["input_ids"]
    with serving(build_app(loop)) as url:
        short = loop.submit(token_ids, GREEDY)
        long = loop.submit(token_ids, SamplingParams(max_tokens=1000, ignore_eos=True))
        draining = threading.Thread(target=loop.shutdown, args=(3.0,))
        draining.start()
        wait_until(lambda: not loop.healthy, 10, "the loop to stop admitting")
        with pytest.raises(ServerShuttingDown):
            loop.submit(token_ids, GREEDY)
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "service_unavailable"
        draining.join(timeout=30)
        assert not draining.is_alive()
    assert _events(short)[-1].output.outputs[0].token_ids == llm.reference[0].outputs[0].token_ids
    last = _events(long)[-1].output.outputs[0]
    assert last.finish_reason == "abort" and 0 < len(last.token_ids) < 1000


def test_an_engine_error_fails_every_stream_and_marks_the_loop_dead(llm, loop, monkeypatch):
    def broken_step():
        raise RuntimeError("the device fell off the bus")

    token_ids = llm.tokenizer(PROMPTS[0])["input_ids"]
    with serving(build_app(loop)) as url:
        monkeypatch.setattr(llm.engine, "step", broken_step)
        streams = [loop.submit(token_ids, GREEDY) for _ in range(3)]
        for stream in streams:
            event = stream.next_event_blocking(timeout=TIMEOUT)
            assert isinstance(event.error, EngineDead) and "fell off the bus" in str(event.error)
        assert loop.dead and not loop.healthy
        with pytest.raises(EngineDead):
            loop.submit(token_ids, GREEDY)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 503
    monkeypatch.undo()
    for request_id in list(llm.engine.scheduler.requests):  # what the broken engine never ran
        llm.engine.abort(request_id)
