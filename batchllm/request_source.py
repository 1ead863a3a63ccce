"""Admission from a caller's request source, with backpressure: shared by `LLM.stream` and the replica pool."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_END = object()


class RequestSource(Generic[T]):
    """A lazily pulled source of requests; a `None` from it pauses admission until the next engine step."""

    def __init__(self, items: Iterator[T | None]) -> None:
        self._items = items
        self.exhausted = False

    def take(self, room: int | None) -> Iterator[T]:
        """Pull up to `room` requests (None: no limit), stopping early at a pause or at the end."""
        taken = 0
        while not self.exhausted and (room is None or taken < room):
            item = next(self._items, _END)
            if item is _END:
                self.exhausted = True
            elif item is None:
                return
            else:
                taken += 1
                yield item  # type: ignore[misc]

    def finished(self, num_in_flight: int) -> bool:
        """After admitting: True once the source is exhausted and nothing is left in flight."""
        if num_in_flight:
            return False
        if self.exhausted:
            return True
        raise RuntimeError("the request source paused admission with nothing in flight")
