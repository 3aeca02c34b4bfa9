"""Pooled CUDA events: GPU timing without ``torch.cuda.synchronize()`` on the hot path.

The training thread records an event from the pool (a few microseconds, no wait); the
sender thread later asks ``query()`` whether the GPU has reached it and reads
``elapsed_time`` between two completed events, then returns both to the pool.

A pool belongs to one device, the watched model's (``torch_cuda_pool(device)``):

* every event is recorded on ``torch.cuda.current_stream(device)``, whatever device is
  current on the recording thread. The training thread of a script that never calls
  ``torch.cuda.set_device`` stays on ``cuda:0`` while its model lives on ``cuda:N``,
  and DDP's comm hook runs on autograd's ``cuda:N`` thread: recording on the current
  stream would put step events on GPU 0 (a CUDA context there in every rank, and the
  wrong GPU timed) and mix devices in the pool ("Event device ... does not match
  recording stream's device", raised inside backward).
* :meth:`EventPool.bind_thread` makes the device current on the thread that queries the
  events (the sender), before its first CUDA call: a new thread starts on device 0,
  and ``cudaEventQuery`` on it would open a context on GPU 0.
* A failure to record turns CUDA timing off for the rest of the run (:attr:`failure`,
  one warning through ``on_failure``); :meth:`record` then returns None and never
  raises into the job.

The CUDA module is injectable (``torch_cuda_pool(device, cuda=...)``) so the pool's
code is tested on a machine without CUDA against a fake that behaves like the real one.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol


class TimingEvent(Protocol):
    """What rtop needs of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self, stream: Any = None) -> None:
        """Record the event on ``stream`` (the current stream when None)."""

    def query(self) -> bool:
        """True once the GPU has passed the event."""

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between this event and a later one (both completed)."""


class EventPool:
    """A bounded free list of timing events shared by the training and sender threads.

    ``factory`` makes a new event; ``stream()`` gives the stream to record on (None:
    the event's own default, the current stream); ``bind()`` makes the pool's device
    current on the calling thread. ``deque.append``/``pop`` are atomic under the GIL,
    so no lock is needed.
    """

    def __init__(
        self,
        factory: Callable[[], TimingEvent],
        keep: int = 4096,
        *,
        device: int | None = None,
        stream: Callable[[], Any] | None = None,
        bind: Callable[[], None] | None = None,
    ) -> None:
        self._factory = factory
        self._free: deque[TimingEvent] = deque()
        self._keep = keep
        self._stream = stream
        self._bind = bind
        #: The CUDA device index whose events this pool holds (None: not tied to one).
        self.device = device
        #: Events made so far (the pool reuses them: this stops growing).
        self.created = 0
        #: Why recording failed, once it has (CUDA timing is then off); else None.
        self.failure: str | None = None
        #: Called once, with the failure's text, when recording first fails.
        self.on_failure: Callable[[str], None] | None = None

    def record(self) -> TimingEvent | None:
        """Take an event from the pool (or make one) and record it on the device's
        current stream; None once recording has failed (it never raises)."""
        if self.failure is not None:
            return None
        try:
            try:
                event = self._free.pop()
            except IndexError:
                event = self._factory()
                self.created += 1
            if self._stream is None:
                event.record()
            else:
                event.record(self._stream())
        except Exception as exc:
            self.fail(f"recording a CUDA event failed: {type(exc).__name__}: {exc}")
            return None
        return event

    def fail(self, why: str) -> None:
        """Turn CUDA timing off for good: :meth:`record` returns None from now on.
        The first failure is reported through ``on_failure``."""
        if self.failure is not None:
            return
        self.failure = why[:500]
        self._free.clear()
        callback = self.on_failure
        if callback is not None:
            with contextlib.suppress(Exception):  # the report must not break the job
                callback(self.failure)

    def bind_thread(self) -> None:
        """Make the pool's device current on the calling thread (the sender, before it
        first queries an event), so no CUDA context opens on another GPU."""
        if self._bind is not None:
            self._bind()

    def release(self, *events: Any) -> None:
        """Give events back once they have been read."""
        if self.failure is not None:
            return  # events of a failed pool are dropped, never reused
        for event in events:
            if event is not None and len(self._free) < self._keep:
                self._free.append(event)


def cuda_module() -> Any:
    """``torch.cuda`` (a seam: tests on a machine without CUDA replace it)."""
    import torch

    return torch.cuda


def torch_cuda_pool(device: int, cuda: Any = None) -> EventPool:
    """A pool of ``torch.cuda.Event(enable_timing=True)`` tied to ``cuda:device``:
    recorded on that device's current stream, queried from a thread bound to it."""
    cuda = cuda if cuda is not None else cuda_module()
    event_cls = cuda.Event
    current_stream = cuda.current_stream
    set_device = cuda.set_device
    return EventPool(
        lambda: event_cls(enable_timing=True),
        device=device,
        stream=lambda: current_stream(device),
        bind=lambda: set_device(device),
    )


def seconds_between(start: TimingEvent, end: TimingEvent) -> float:
    """Seconds from ``start`` to ``end`` (both completed)."""
    return float(start.elapsed_time(end)) / 1000.0
