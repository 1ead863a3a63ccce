"""`tokenized_ahead`: chunks that grow from a small first one, rows in order, pauses only while the engine has
work, and nothing tokenized after the consumer stops. No model: `tokenize` is a plain function."""

from __future__ import annotations

import threading

import pytest

from batchllm.entrypoints import tokenize_ahead
from batchllm.entrypoints.tokenize_ahead import chunk_bounds, tokenized_ahead


def test_chunks_grow_from_a_small_first_one():
    assert chunk_bounds(0) == [0]
    assert chunk_bounds(1) == [0, 1]
    assert chunk_bounds(128) == [0, 128]
    assert chunk_bounds(1000) == [0, 128, 640, 1000]  # 128, then 4 x 128 = 512, then the rest
    bounds = chunk_bounds(20_000)
    assert bounds == [0, 128, 640, 2688, 6784, 10880, 14976, 19072, 20000]  # 128, 512, 2048, then 4096 at most


def _items(iterator):
    return list(iterator)


def test_rows_come_in_order_and_admission_pauses_for_a_pending_chunk(monkeypatch):
    monkeypatch.setattr(tokenize_ahead, "FIRST_CHUNK_ROWS", 2)
    monkeypatch.setattr(tokenize_ahead, "MAX_CHUNK_ROWS", 3)
    release, calls = threading.Event(), []

    def tokenize(rows):
        calls.append((list(rows), threading.current_thread().name))
        if len(calls) == 2:
            assert release.wait(timeout=30)
        return [f"ids of {row}" for row in rows]

    in_flight = []
    stream = tokenized_ahead(["a", "b", "c", "d", "e", "f"], tokenize, busy=lambda: bool(in_flight))
    assert [next(stream), next(stream)] == [("a", "ids of a"), ("b", "ids of b")]  # nothing in flight: awaited
    in_flight.append("a")
    assert next(stream) is None and next(stream) is None  # the second chunk is held back: the engine steps on
    release.set()
    rest = [item for item in stream if item is not None]
    assert rest == [(row, f"ids of {row}") for row in "cdef"]
    assert [rows for rows, _ in calls] == [["a", "b"], ["c", "d", "e"], ["f"]]  # 2, then at most 3
    assert all(name.startswith("batchllm-tokenize") for _, name in calls)


def test_with_nothing_in_flight_the_stream_waits_instead_of_pausing(monkeypatch):
    monkeypatch.setattr(tokenize_ahead, "FIRST_CHUNK_ROWS", 1)
    release = threading.Event()

    def slow(rows):
        if rows[0] > 0:
            assert release.wait(timeout=30)
        return list(rows)

    threading.Timer(0.2, release.set).start()
    items = _items(tokenized_ahead(range(5), slow, busy=lambda: False))
    assert items == [(i, i) for i in range(5)]  # no None: pausing with nothing in flight would stall the stream


def test_one_chunk_or_a_shared_tokenizer_stays_on_the_callers_thread(monkeypatch):
    monkeypatch.setattr(tokenize_ahead, "FIRST_CHUNK_ROWS", 2)
    threads = []

    def tokenize(rows):
        threads.append((len(rows), threading.current_thread()))
        return list(rows)

    assert _items(tokenized_ahead([1, 2], tokenize, busy=lambda: True)) == [(1, 1), (2, 2)]
    assert _items(tokenized_ahead([1, 2, 3], tokenize, busy=lambda: True, on_worker=False)) == [(1, 1), (2, 2), (3, 3)]
    assert threads == [(2, threading.current_thread()), (3, threading.current_thread())]


def test_closing_early_tokenizes_no_further_chunk(monkeypatch):
    monkeypatch.setattr(tokenize_ahead, "FIRST_CHUNK_ROWS", 1)
    monkeypatch.setattr(tokenize_ahead, "MAX_CHUNK_ROWS", 1)
    started, release, calls = threading.Event(), threading.Event(), []

    def tokenize(rows):
        calls.append(rows[0])
        if rows[0] == 1:
            started.set()
            assert release.wait(timeout=30)
        return list(rows)

    stream = tokenized_ahead(range(6), tokenize, busy=lambda: False)
    assert next(stream) == (0, 0)
    assert started.wait(timeout=30)
    threading.Timer(0.2, release.set).start()
    stream.close()  # row 1's chunk is running: it finishes; rows 2.. never start
    assert calls == [0, 1]


def test_an_error_in_a_chunk_reaches_the_consumer(monkeypatch):
    monkeypatch.setattr(tokenize_ahead, "FIRST_CHUNK_ROWS", 1)

    def tokenize(rows):
        if rows[0] > 0:
            raise OSError("the tokenizer broke")
        return list(rows)

    stream = tokenized_ahead(range(3), tokenize, busy=lambda: False)
    assert next(stream) == (0, 0)
    with pytest.raises(OSError, match="the tokenizer broke"):
        next(stream)
