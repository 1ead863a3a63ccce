"""The HTTP side's view of an engine: what app.py, the embeddings route and the Batch API call, whichever way the
engine runs — in a process of its own (`EngineProcess`, what `batchllm serve` uses) or in a thread of this process
(`EngineLoop`, for tests and embedding a server in a program).

`submit` returns a `RequestStream` at once and sends the request to the engine; `abort` asks the engine to end it at
its next step boundary (its last event, finish reason "abort", still comes). The engine's results come back through
`_on_results`, which detokenises and delivers them (`admitted.AdmittedRequests`). `shutdown` drains: new submissions
raise ServerShuttingDown while the requests in flight get up to `grace_seconds`; the rest is then aborted.
An engine that fails fails every request in flight with `EngineDead`; `healthy` and `dead` report it.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any

from batchllm.entrypoints.server.admitted import AdmittedRequests, LoopObserver, replay
from batchllm.entrypoints.server.engine_protocol import LIVE, Abort, Compile, EngineSnapshot, StepResults, Submit
from batchllm.entrypoints.server.request_stream import EngineDead, RequestStream, ServerShuttingDown
from batchllm.lora.request import LoRARequest
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams

COMPILE_TIMEOUT = 300.0  # a grammar compiles in well under a second; an engine busy with a long step answers later


class EngineHandle:
    """`llm`: the engine's LLM, or what the HTTP side knows of it (`remote_llm.RemoteLLM`): task, tokenizer,
    model_path, max_model_len, pooling_params, ..."""

    def __init__(self, llm: Any, observer: LoopObserver | None = None) -> None:
        self.llm = llm
        self.observer = observer  # per-request measurements; build_app sets the server's metrics here
        self._book = AdmittedRequests(llm.tokenizer, getattr(llm, "reasoning_parser", None))
        self._lock = threading.Lock()  # submissions and aborts reach the engine in the order they were made
        self._accepting = True
        self._dead: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._compiles: dict[int, Future] = {}
        self._tokens = itertools.count()
        self.snapshot = EngineSnapshot(num_blocks=self._num_blocks())

    # -- what a transport provides -----------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        raise NotImplementedError

    def _num_blocks(self) -> int:
        raise NotImplementedError

    def stop(self) -> None:
        """Abort what is left in the engine and end it (after a drain: `shutdown`, `draining.drain`)."""
        raise NotImplementedError

    # -- any thread --------------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
               lora_request: LoRARequest | None = None, priority: int = LIVE, *, incremental: bool = True,
               prompt_text: str | None = None, sink: Any = None, mm: MultiModalPrompt | None = None,
               error: str | None = None) -> RequestStream:
        """Queue one prompt (its `params.n` samples) and return its stream. `incremental=False`: only the final
        event (no per-step updates, no streamed text). `PoolingParams` (the LLM's `pooling_params`; ValueError on
        an engine that generates, as SamplingParams on one that pools): one pooling request, one final event.
        `mm`: the prompt's images (`prompt_token_ids` holds their placeholders); `error`: the prompt already failed
        (its image did not load): it ends with that error. Raises ServerShuttingDown / EngineDead when the engine no
        longer admits requests."""
        pooling = isinstance(params, PoolingParams)
        task = self.llm.task
        if pooling == (task == "generate"):
            raise ValueError(f"this engine's task is {task!r}: it takes "
                             f"{'SamplingParams' if task == 'generate' else 'its PoolingParams'}, "
                             f"not {type(params).__name__}")
        stream = RequestStream(1 if pooling else params.n, len(prompt_token_ids), sink)
        token_ids = list(prompt_token_ids)
        incremental = incremental and not pooling
        with self._lock:
            self._check_admitting()
            self._book.add(stream, token_ids, params, prompt_text, incremental)
            self._idle.clear()
            self._send(Submit(stream.prompt_id, token_ids, params, lora_request, priority, incremental,
                              time.perf_counter(), mm, error))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Cancel a stream's request; its last event (finish_reason "abort") still comes. A no-op once finished."""
        with self._lock:
            if stream.cancelled or self._dead is not None:
                return
            stream.cancelled = True
            self._send(Abort(stream.prompt_id))

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """`LLM.check_structured_outputs` on the engine: ValueError when the constraint does not compile."""
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDead(f"the engine failed: {self._dead!r}")
            token = next(self._tokens)
            self._compiles[token] = future
            self._send(Compile(token, params))
        error = future.result(COMPILE_TIMEOUT)
        if error is not None:
            raise ValueError(error)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every submitted request has ended; False after `timeout` seconds."""
        return self._idle.wait(timeout)

    def shutdown(self, grace_seconds: float = 30.0) -> None:
        """Stop admitting (submits raise ServerShuttingDown), let the requests in flight finish for up to
        `grace_seconds`, then abort the rest (their streams end with finish_reason "abort") and end the engine."""
        self.stop_admitting()
        self._idle.wait(grace_seconds)
        self.stop()

    def stop_admitting(self) -> None:
        """From now on submissions raise ServerShuttingDown (and `healthy` is False)."""
        with self._lock:
            self._accepting = False

    def batch_engine(self, stop_event: threading.Event | None = None, abort_on_stop: bool = False):
        """An `llm=` for `run_jsonl_job` whose requests run here at BATCH priority (see `batch_engine.py`)."""
        from batchllm.entrypoints.server.batch_engine import BatchEngine

        return BatchEngine(self, stop_event, abort_on_stop)

    def _check_admitting(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"the engine failed: {self._dead!r}")
        if not self._accepting:
            raise ServerShuttingDown("the server is shutting down")

    # -- the thread that hears from the engine -----------------------------------------------------------------
    def _on_results(self, results: StepResults) -> None:
        if results.snapshot is not None:
            self.snapshot = results.snapshot
        replay(results.observations, self.observer)
        self._book.apply(results)
        for token, error in results.compiled:
            future = self._compiles.pop(token, None)
            if future is not None:
                future.set_result(error)
        self._set_idle_if_empty()

    def _on_stopped(self) -> None:
        """The engine ended as asked: whatever it did not report ends as aborted."""
        self._book.abort_all()
        self._end_compiles(ServerShuttingDown("the engine stopped"))
        self._set_idle_if_empty()

    def _on_death(self, error: BaseException) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
        failure = EngineDead(f"the engine failed: {error!r}")
        self._book.fail_all(failure)
        self._end_compiles(failure)
        self._idle.set()

    def _end_compiles(self, error: BaseException) -> None:
        for future in [self._compiles.pop(token) for token in list(self._compiles)]:
            future.set_exception(error)

    def _set_idle_if_empty(self) -> None:
        with self._lock:  # a submit between the check and the set would otherwise be missed
            if not len(self._book):
                self._idle.set()
