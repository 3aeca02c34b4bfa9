"""Pooled CUDA events: GPU timing without ``torch.cuda.synchronize()`` on the hot path.

The training thread records an event from the pool on the current stream (a few
microseconds, no wait); the sender thread later asks ``query()`` whether the GPU has
reached it and reads ``elapsed_time`` between two completed events, then returns both
to the pool. The event factory is injectable so the resolution logic can be tested on
a machine without CUDA.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol


class TimingEvent(Protocol):
    """What rtop needs of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self) -> None:
        """Record the event on the current stream."""

    def query(self) -> bool:
        """True once the GPU has passed the event."""

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between this event and a later one (both completed)."""


class EventPool:
    """A bounded free list of timing events shared by the training and sender threads.

    ``deque.append``/``pop`` are atomic under the GIL, so no lock is needed.
    """

    def __init__(self, factory: Callable[[], TimingEvent], keep: int = 4096) -> None:
        self._factory = factory
        self._free: deque[TimingEvent] = deque()
        self._keep = keep
        self.created = 0

    def record(self) -> TimingEvent:
        """Take an event from the pool (or make one) and record it on the current stream."""
        try:
            event = self._free.pop()
        except IndexError:
            event = self._factory()
            self.created += 1
        event.record()
        return event

    def release(self, *events: Any) -> None:
        """Give events back once they have been read."""
        for event in events:
            if event is not None and len(self._free) < self._keep:
                self._free.append(event)


def torch_cuda_pool() -> EventPool:
    """An event pool backed by ``torch.cuda.Event(enable_timing=True)``."""
    import torch

    return EventPool(lambda: torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]


def seconds_between(start: TimingEvent, end: TimingEvent) -> float:
    """Seconds from ``start`` to ``end`` (both completed)."""
    return float(start.elapsed_time(end)) / 1000.0
