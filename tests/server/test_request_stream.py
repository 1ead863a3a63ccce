"""Deliveries from the engine thread into an event loop: every event arrives, in order, and a burst of them
costs one wake-up of the loop, not one each."""

from __future__ import annotations

import asyncio
import threading
import time

from batchllm.entrypoints.server.request_stream import RequestStream, StreamEvent


def test_a_burst_of_deliveries_arrives_in_order_with_one_wake_up():
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal wake_ups
            wake_ups += 1
            return call_soon_threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counting
        streams = [RequestStream(1, 3) for _ in range(4)]
        posted = threading.Event()

        def engine_thread() -> None:
            for step in range(50):
                for stream in streams:
                    stream.deliver(StreamEvent(updates=[step]))  # a stand-in payload: the step number
            posted.set()

        thread = threading.Thread(target=engine_thread)
        thread.start()
        posted.wait(10)  # blocks the event loop: every delivery is posted before it can hand any over
        thread.join()
        received = [[(await stream.next_event()).updates[0] for _ in range(50)] for stream in streams]
        assert all(not stream._queue.qsize() for stream in streams)
        return received, wake_ups

    received, wake_ups = asyncio.run(main())
    assert received == [list(range(50))] * 4
    assert wake_ups == 1


def test_delivery_after_the_event_loop_closed_is_dropped_quietly():
    stream = None

    async def make() -> None:
        nonlocal stream
        stream = RequestStream(1, 3)

    asyncio.run(make())
    start = time.monotonic()
    stream.deliver(StreamEvent(updates=[1]))  # nobody is left to read it: no error, no hang
    assert time.monotonic() - start < 1
