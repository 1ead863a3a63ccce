"""Tokenizing a batch while the engine runs on its first rows: one mechanism for `LLM.generate` / `chat`, the
table doors (`connectors/tables/mapper.py`) and the jobs (`connectors/jobs/job.py`).

The rows, already in admission order, are cut into chunks (`chunk_bounds`): a first one of at most
`FIRST_CHUNK_ROWS` rows, then chunks `GROWTH` times larger up to `MAX_CHUNK_ROWS`. One worker thread tokenizes
the chunks one after another while the caller's stream admits each chunk's rows as soon as it is ready, so
the first engine step waits only for the first chunk. The HF fast tokenizer encodes a batch in Rust with the
GIL released, on its own thread pool; the engine's thread keeps stepping meanwhile.

A chunk not ready yet pauses admission for a step (the stream's `None`) while the engine has work; with
nothing in flight the stream waits for it. The rows admitted late join the engine's FIFO waiting queue
behind the earlier ones, so the steps usually run the same rows as if all had been admitted at once; when a
chunk comes late, a step runs fewer rows than it could have, and bf16 results may then differ at near-ties,
as with any change of batch composition. A batch of at most `FIRST_CHUNK_ROWS` rows is one chunk: it is all
admitted before the first step, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Rows tokenized before the first engine step: 128 prompts of >= 64 tokens fill a default step (8192 tokens),
# and take a fast tokenizer a few milliseconds.
FIRST_CHUNK_ROWS = 128
GROWTH = 4  # each next chunk this many times the last: few calls, each a large batch for the tokenizer's threads
MAX_CHUNK_ROWS = 4096


def chunk_bounds(num_rows: int) -> list[int]:
    """[0, end of chunk 1, ..., num_rows]: chunk sizes FIRST_CHUNK_ROWS, then GROWTH times the last, at most
    MAX_CHUNK_ROWS; [0] for no rows."""
    bounds, size = [0], FIRST_CHUNK_ROWS
    while bounds[-1] < num_rows:
        bounds.append(min(num_rows, bounds[-1] + size))
        size = min(MAX_CHUNK_ROWS, size * GROWTH)
    return bounds


def can_tokenize_aside(tokenizer: Any) -> bool:
    """Whether a worker thread may tokenize with `tokenizer` while the engine's thread detokenizes with it: a fast
    tokenizer whose Rust side no call writes. transformers clears a truncation or padding set on the backend
    when a call does not ask for one, and aligns its `encode_special_tokens` with `split_special_tokens`: writes
    that would clash with a concurrent read ("Already borrowed"). A slow (Python) tokenizer holds the GIL
    throughout, so a worker would gain nothing."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (backend is not None and backend.truncation is None and backend.padding is None
            and getattr(backend, "encode_special_tokens", False) == getattr(tokenizer, "split_special_tokens", False))


def tokenized_ahead(rows: Sequence[T], tokenize: Callable[[Sequence[T]], Sequence[R]], busy: Callable[[], bool],
                    on_worker: bool = True) -> Iterator[tuple[T, R] | None]:
    """`(row, tokenize's result for it)` for every row in order, for a stream's request source; `None` pauses
    admission for a step while the next chunk is not ready and `busy()` (the engine has work in flight).

    `tokenize` maps a slice of `rows` to one result per row (a batched tokenizer call; a job's planner also
    renders its rows). `on_worker=False` (see `can_tokenize_aside`), or rows that make one chunk: every row in
    one call, on the caller's thread, when the first row is pulled. Closing the iterator early cancels the chunks
    not started."""
    if not on_worker or len(rows) <= FIRST_CHUNK_ROWS:  # one chunk: nothing to overlap
        yield from zip(rows, tokenize(rows))
        return
    bounds = chunk_bounds(len(rows))
    pool = ThreadPoolExecutor(1, thread_name_prefix="batchllm-tokenize")
    try:
        futures: list[Future[Sequence[R]]] = [pool.submit(tokenize, rows[start:end])
                                               for start, end in zip(bounds, bounds[1:])]
        for start, end, future in zip(bounds, bounds[1:], futures):
            while not future.done() and busy():
                yield None
            yield from zip(rows[start:end], future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
