"""The Batch API's view of the server's engine: an `llm=` for `run_jsonl_job` that runs on an `EngineHandle`.

`BatchEngine.stream` keeps `LLM.stream`'s contract (items `(key, prompt, params[, lora_request])`, a prompt being text,
token ids, a dict with images (`multimodal_prompts.py`, prepared here: a row whose image fails ends with its error, and
a path is never read: `image_prompts`) or a job's prepared row, None pauses admission, `(key, RequestOutput)` in
completion order (`PoolingRequestOutput` for the PoolingParams items of an embed server's jobs), at most
`max_in_flight` prompts out at once), but its requests go through the loop at BATCH priority, so live HTTP traffic is
admitted ahead of them, and the job's thread never touches the engine. Every other attribute (tokenizer, model_path,
max_model_len, check_lora, quantization, kv_cache_dtype, max_num_seqs, ...) is the client's `llm` (the real LLM, or
what the HTTP process knows of it: `remote_llm.RemoteLLM`), read-only; `check_structured_outputs` compiles on the
engine, where the engine's own compilations happen. It implements `batchllm.engine_client.EngineClient`, which is
all a job uses; it builds no engine of its own.

Cancelling: when `stop_event` is set, the stream admits nothing more; the requests already out finish and are
yielded (the job saves them), then the stream ends. With `abort_on_stop=True` those are aborted instead and
not yielded, so the stream ends at once. Closing the stream early aborts what it has in flight. A request the
loop aborted itself (its shutdown) raises ServerShuttingDown instead of being yielded.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from batchllm.entrypoints.admission_order import admission_order
from batchllm.entrypoints.llm_inputs import encode_requests
from batchllm.entrypoints.server.admitted import was_aborted
from batchllm.entrypoints.server.image_chat import ServedImagePrompts
from batchllm.entrypoints.server.request_stream import EngineDead, RequestStream, ServerShuttingDown, StreamEvent
from batchllm.lora.request import LoRARequest
from batchllm.request_source import RequestSource
from batchllm.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from batchllm.entrypoints.server.engine_handle import EngineHandle
    from batchllm.outputs import RequestOutput

K = TypeVar("K")
_POLL_SECONDS = 1.0  # how often a blocked stream looks at its stop event and at the loop's health


class BatchEngine:
    def __init__(self, loop: EngineHandle, stop_event: threading.Event | None = None,
                 abort_on_stop: bool = False) -> None:
        self._loop = loop
        llm = self._llm = loop.llm
        self.tokenizer, self.model_path, self.task = llm.tokenizer, llm.model_path, llm.task
        self.pooling_params, self.embedding_dim = llm.pooling_params, llm.embedding_dim
        self.quantization, self.kv_cache_dtype = llm.quantization, llm.kv_cache_dtype
        self.max_model_len, self.max_num_seqs = llm.max_model_len, llm.max_num_seqs
        self.stop_event = stop_event
        self.abort_on_stop = abort_on_stop
        self._in_flight: dict[RequestStream, Any] = {}  # the current stream's requests out

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        self._loop.check_structured_outputs(params)

    def check_lora(self, lora_request: LoRARequest) -> None:
        self._llm.check_lora(lora_request)

    def admission_order(self, token_lists: Sequence[Any], loras: Sequence[LoRARequest | None] | None = None
                        ) -> list[int]:
        """`LLM.admission_order`: rows sharing a prefix (or an adapter) go out together (the server's engine caches
        prefixes unless built with enable_prefix_caching=False, which an engine in this process reports)."""
        return admission_order(token_lists, loras, getattr(self._llm, "reorder_by_prefix", True))

    def has_unfinished(self) -> bool:
        """`LLM.has_unfinished` for a stream's source: whether rows of the stream are out (it may pause only then)."""
        return bool(self._in_flight)

    def shutdown(self) -> None:
        """Nothing to stop: the server owns the engine (LLM.shutdown would stop its tensor-parallel workers)."""

    def stream(self, requests: Iterable[tuple | None], *, max_in_flight: int | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[tuple[K, RequestOutput]]:
        """`stop`, as for `LLM.stream`: once it returns True the requests in flight are aborted and the stream
        ends."""
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be an int >= 1 or None, got {max_in_flight!r}")
        return self._stream(encode_requests(requests, self.tokenizer, self.check_lora, self._prepare_image_prompt),
                            max_in_flight, stop)

    def image_prompts(self) -> ServedImagePrompts:
        """`LLM.image_prompts` for rows that came over HTTP (a job prepares its rows' images with it): a row whose
        image names a file of the server, or an http(s) URL without the opt-in, fails instead of being loaded."""
        return ServedImagePrompts(self._llm.image_prompts())

    def _prepare_image_prompt(self, index: int, prompt: dict) -> Any:
        prompts = self.image_prompts()
        prompts.check({index: prompt})
        return prompts.prepare({index: prompt})[index]

    def _stopped(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    def _stream(self, requests: Iterator[tuple | None], max_in_flight: int | None,
                stop: Callable[[], bool] | None) -> Iterator[tuple[K, Any]]:
        results: queue.Queue[tuple[RequestStream, StreamEvent]] = queue.Queue()
        in_flight: dict[RequestStream, K] = {}
        self._in_flight = in_flight
        source = RequestSource(requests)

        def halted() -> bool:
            return (self._stopped() and self.abort_on_stop) or (stop is not None and stop())

        try:
            while True:
                if halted():
                    return  # the finally clause aborts what is in flight
                if self._stopped():
                    if not in_flight:
                        return
                else:
                    room = None if max_in_flight is None else max_in_flight - len(in_flight)
                    for key, text, token_ids, params, lora, *images in source.take(room):
                        mm, error = images[0] if images else (None, None)  # a prompt dict's images, or its error
                        stream = self._loop.submit(token_ids, params, lora, priority=1, incremental=False,
                                                   prompt_text=text, sink=results, mm=mm, error=error)
                        in_flight[stream] = key
                    if source.finished(len(in_flight)):
                        return
                for stream, event in self._wait(results, halted):
                    key = in_flight.pop(stream)
                    if event.error is not None:
                        raise event.error
                    if was_aborted(event.output):
                        # The loop aborted it (its shutdown, past a drain's grace period): the row has no answer,
                        # and a job that saved it would count its request answered for good.
                        raise ServerShuttingDown("the engine stopped before a batch row finished")
                    yield key, event.output
        finally:
            for stream in in_flight:
                self._loop.abort(stream)

    def _wait(self, results: queue.Queue, halted: Callable[[], bool]) -> list[tuple[RequestStream, StreamEvent]]:
        """At least one finished request (every event of a one-shot stream is its last), and any others ready."""
        while True:
            try:
                ready = [results.get(timeout=_POLL_SECONDS)]
                break
            except queue.Empty:
                if self._loop.dead:
                    raise EngineDead("the server's engine loop failed") from None
                if halted():
                    return []
        while True:
            try:
                ready.append(results.get_nowait())
            except queue.Empty:
                return ready
