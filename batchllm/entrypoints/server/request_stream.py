"""What the engine thread hands a request's consumer: typed events, delivered across threads.

The engine thread only ever calls `RequestStream.deliver`; the consumer reads events in its own thread, either
in an asyncio event loop (the HTTP handlers: an `asyncio.Queue`, filled in the loop's thread) or in a plain
thread (a `queue.Queue`, e.g. the Batch API's job thread). Deliveries into one event loop go through its
`_Mailbox`: one `call_soon_threadsafe` (a wake-up of the loop) carries every event posted until the loop runs
it, not one wake-up per event: a step that streams a token to 200 clients would otherwise wake the loop 200
times, and each wake-up takes the GIL from the engine thread. A consumer that reads many streams at once may pass
a shared sink instead (a `queue.Queue`, or an `asyncio.Queue` of the running event loop): it then receives
`(stream, event)` pairs, and the stream's own `next_event*` methods are not used.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import weakref
from dataclasses import dataclass, field

from batchllm.outputs import RequestOutput, SampleLogprobs


class ServerShuttingDown(RuntimeError):
    """The loop no longer admits requests (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine raised: every request in flight fails with this, and the loop admits nothing more (HTTP 503)."""


@dataclass(slots=True)
class SampleUpdate:
    """What one sample (`index` among the prompt's n) produced since its previous update."""

    index: int
    token_ids: list[int]
    text: str  # new text; a stop string is never part of it, and the texts of all updates add up to the final one
    logprobs: SampleLogprobs | None = None  # one dict per new token, as in CompletionOutput.logprobs
    finish_reason: str | None = None  # set on the sample's last update: "stop", "length", "error" or "abort"
    stop_reason: int | str | None = None
    reasoning: str = ""  # new reasoning, with a reasoning parser (`text` is then new answer text only)


@dataclass(slots=True)
class StreamEvent:
    """Per engine step that changed something; the last one carries `output` (the prompt's whole result, as
    `LLM.generate` returns it) or `error`. Streams submitted with `incremental=False` get only the last one."""

    updates: list[SampleUpdate] = field(default_factory=list)
    output: RequestOutput | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None or self.error is not None


_ids = itertools.count()


class _Mailbox:
    """Events for the asyncio queues of one event loop, posted from other threads, handed over in batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []

    def post(self, target: asyncio.Queue, item: object) -> None:
        with self._lock:
            self._items.append((target, item))
            if len(self._items) > 1:
                return  # a hand-over is already scheduled and will take this one too
        try:
            self._loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the event loop is closed: nobody is left to read it
            with self._lock:
                self._items.clear()

    def _hand_over(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for target, item in items:
            target.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    with _mailboxes_lock:
        mailbox = _mailboxes.get(loop)
        if mailbox is None:
            mailbox = _mailboxes[loop] = _Mailbox(loop)
        return mailbox


class RequestStream:
    """The consumer's end of one prompt's request (all its n samples). Made by `EngineLoop.submit`, in the
    consumer's thread: inside a running event loop it is read with `await next_event()` / `async for`, else
    with `next_event_blocking()`."""

    def __init__(self, num_samples: int, num_prompt_tokens: int,
                 sink: queue.Queue | asyncio.Queue | None = None) -> None:
        self.prompt_id = f"srv{next(_ids)}"
        self.num_samples = num_samples
        self.num_prompt_tokens = num_prompt_tokens
        self.cancelled = False  # set by EngineLoop.abort
        self._tagged = sink is not None  # a shared sink receives (stream, event)
        self._queue: queue.Queue | asyncio.Queue = sink
        if sink is None:
            try:
                asyncio.get_running_loop()
                self._queue = asyncio.Queue()
            except RuntimeError:
                self._queue = queue.Queue()
        # An asyncio queue is only touched in its event loop's thread (the one creating the stream).
        self._mailbox = _mailbox(asyncio.get_running_loop()) if isinstance(self._queue, asyncio.Queue) else None

    def deliver(self, event: StreamEvent) -> None:
        """Called by the engine thread."""
        item = (self, event) if self._tagged else event
        if self._mailbox is None:
            self._queue.put(item)
        else:
            self._mailbox.post(self._queue, item)

    async def next_event(self) -> StreamEvent:
        return await self._queue.get()

    def next_event_blocking(self, timeout: float | None = None) -> StreamEvent:
        """Raises queue.Empty after `timeout` seconds without an event."""
        return self._queue.get(timeout=timeout)

    def __aiter__(self):
        return self._events()

    async def _events(self):
        """Events up to the last one; the engine's error is raised instead of being yielded."""
        while True:
            event = await self.next_event()
            if event.error is not None:
                raise event.error
            yield event
            if event.finished:
                return

    async def result(self) -> RequestOutput:
        """The whole result (for consumers that do not stream)."""
        async for event in self:
            if event.output is not None:
                return event.output
        raise AssertionError("a stream ended without its output")  # deliver() always ends with one
