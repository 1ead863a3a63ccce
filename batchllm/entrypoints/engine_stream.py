"""The loop behind `LLM.stream` and every batch call: admit requests, step the engine, yield what finishes.

Requests are pulled from the source lazily (`RequestSource`) up to `max_in_flight` prompts in the engine; `n > 1`
samples fork the prompt's K/V; pooling items (PoolingParams) come back as `PoolingRequestOutput`s. A `stop`
that turns True aborts what is in flight within a step; closing the generator early drains the engine, so it is
empty for the next call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from batchllm.entrypoints.output_assembly import complete, completion_output, sample_params
from batchllm.entrypoints.pooling import NO_SAMPLING, pooling_output
from batchllm.host_gc import objects_frozen
from batchllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from batchllm.pooling_params import PoolingParams
from batchllm.request_source import RequestSource

if TYPE_CHECKING:
    from batchllm.entrypoints.llm import LLM

K = TypeVar("K")


def stream_engine(llm: LLM, requests: Iterator[tuple | None], max_in_flight: int | None,
                  stop: Callable[[], bool] | None = None) -> Iterator[tuple[Any, RequestOutput | PoolingRequestOutput]]:
    """`(key, output)` as each of the `(key, text, token ids, params, adapter)` items finishes."""
    engine = llm.engine
    engine.scheduler.reset_stats()
    llm._transfer_seconds_before = llm._transfer_seconds()
    start = time.perf_counter()
    in_flight: dict[str, _InFlight[K]] = {}  # request-id prefix → the prompt's partial result
    pooled: dict[str, tuple[K, str | None, list[int]]] = {}  # pooling request id → its item
    source = RequestSource(requests)
    stepping = False
    # Full collections would otherwise scan the model and everything else alive, inside a step (host_gc.py).
    with objects_frozen():
        try:
            while True:
                if stop is not None and stop():
                    _abort(engine, in_flight, pooled)
                    return
                room = None if max_in_flight is None else max_in_flight - len(in_flight) - len(pooled)
                for key, text, token_ids, params, lora, *extra in source.take(room):
                    prompt_id = str(next(llm._request_counter))
                    mm, error = extra[0] if extra else (None, None)  # a prompt's images, or the door's error
                    if isinstance(params, PoolingParams) or llm.task != "generate":
                        llm._check_pooling_item(params)
                        pooled[f"{prompt_id}.0"] = (key, text, token_ids)
                        engine.add_request(f"{prompt_id}.0", token_ids, NO_SAMPLING, lora_request=lora,
                                           pooling=params, mm=mm, error=error)
                        continue
                    output = RequestOutput(prompt_id, text, token_ids, finished=False)
                    in_flight[prompt_id] = _InFlight(key, output, [None] * params.n)
                    for sample in range(params.n):
                        fork_of = f"{prompt_id}.0" if sample else None  # samples share the prompt's K/V
                        engine.add_request(f"{prompt_id}.{sample}", token_ids, sample_params(params, sample),
                                           fork_of=fork_of, lora_request=lora, mm=mm, error=error)
                if source.finished(len(in_flight) + len(pooled)):
                    return
                stepping = True
                finished_requests = engine.step()
                stepping = False
                for finished in finished_requests:
                    if finished.request.request_id in pooled:
                        key, text, token_ids = pooled.pop(finished.request.request_id)
                        yield key, pooling_output(finished.request, text, token_ids)
                        continue
                    prompt_id, sample = finished.request.request_id.rsplit(".", 1)
                    entry = in_flight[prompt_id]
                    entry.completions[int(sample)] = completion_output(int(sample), finished, llm.tokenizer,
                                                                         llm.reasoning_parser)
                    if all(c is not None for c in entry.completions):
                        del in_flight[prompt_id]
                        complete(entry.output, entry.completions)
                        yield entry.key, entry.output
        finally:
            # A step cut short (e.g. by KeyboardInterrupt) leaves the scheduler mid-update: nothing safe to do.
            if not stepping:
                while engine.has_unfinished():
                    engine.step()
            llm._last_call_seconds = time.perf_counter() - start


def _abort(engine: Any, in_flight: dict[str, _InFlight], pooled: dict[str, Any]) -> None:
    """End a stream's requests in the engine now; a step already launched is applied (and its tokens dropped)
    by the stream's final drain."""
    for prompt_id, entry in in_flight.items():
        for sample, completion in enumerate(entry.completions):
            if completion is None:
                engine.abort(f"{prompt_id}.{sample}")
    for request_id in pooled:
        engine.abort(request_id)
    in_flight.clear()
    pooled.clear()




@dataclass(slots=True)
class _InFlight(Generic[K]):
    key: K
    output: RequestOutput
    completions: list[CompletionOutput | None]
