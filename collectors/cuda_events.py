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

**CUDA graphs** (:data:`CAPTURES`). While a graph is being captured, CUDA forbids what
rtop would do: an event recorded on the capturing stream becomes a node of the graph
and can never be queried or timed (``cudaErrorCapturedEvent``), and in the default
capture mode (``"global"``) a ``cudaEventQuery`` from *any* thread, or anything put on
the legacy default stream, invalidates the user's capture. So while any capture is in
progress in the process rtop records nothing (:meth:`EventPool.record` returns None:
the figures it would have timed are not measured) and queries nothing (the sender
thread holds :meth:`Captures.quiet` around each read, and a capture begins only once
that read is over). Captures are seen two ways: ``CUDAGraph.capture_begin`` and
``capture_end`` are watched while a probe uses a pool (``torch.cuda.graph`` and
``make_graphed_callables`` go through them), and before each record the recording
thread asks ``torch.cuda.is_current_stream_capturing()`` (a capture rtop did not see
begin: nothing is then queried either, until that thread's stream no longer captures).
Every mode is treated alike: ``"thread_local"`` and ``"relaxed"`` would allow some of
it, but an event recorded in a capture is unreadable in any mode. A graph's replay
launches its work on the current stream, so a step that replays a graph is timed by its
own events like any other; a collective inside a captured graph runs unseen, so a step
that replays such a graph reports its collectives as not measured (``on_replay``).

The CUDA module is injectable (``torch_cuda_pool(device, cuda=...)``) so the pool's
code is tested on a machine without CUDA against a fake that behaves like the real one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

log = logging.getLogger("collectors")


class TimingEvent(Protocol):
    """What rtop needs of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self, stream: Any = None) -> None:
        """Record the event on ``stream`` (the current stream when None)."""

    def query(self) -> bool:
        """True once the GPU has passed the event."""

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between this event and a later one (both completed)."""


class Captures:
    """The CUDA graph captures in progress in this process (one object, :data:`CAPTURES`,
    as captures are the process's; see the module doc).

    :meth:`install` watches a CUDA module's ``CUDAGraph`` (``capture_begin``,
    ``capture_end``, ``replay``) until :meth:`release`. The recording threads read
    :meth:`busy` (no lock); the sender thread reads under :meth:`quiet`, which a capture's
    begin waits for.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Captures in progress that rtop saw begin.
        self.active = 0
        #: A recording thread found its current stream capturing in a capture rtop did
        #: not see begin (cleared when that thread next finds it not capturing).
        self.unhooked = False
        #: Watching captures failed: whether one is in progress is unknown, so nothing is
        #: queried again (until :meth:`release`).
        self.broken = False
        #: The mode (``capture_error_mode``) of the last capture seen, and how many began.
        self.mode: str | None = None
        self.seen = 0
        #: A collective was launched while the capture in progress captured.
        self.comm = False
        #: Called on the replaying thread when a graph whose capture launched a collective
        #: is replayed (the probe: that step's collectives are not measured).
        self.on_replay: Callable[[], None] | None = None
        #: Told ``(point, error)`` when rtop's part of a watched method fails.
        self.on_failure: Callable[[str, BaseException], None] | None = None
        self._with_comm: weakref.WeakSet[Any] = weakref.WeakSet()
        self._with_comm_ids: set[int] = set()  # graphs no weak reference can point to
        self._installed: list[tuple[Any, str, Any, Any]] = []

    def busy(self) -> bool:
        """Whether a capture may be in progress (record and query nothing)."""
        return self.active > 0 or self.unhooked or self.broken

    @contextlib.contextmanager
    def quiet(self) -> Iterator[bool]:
        """Around a read of events (the sender thread): True when no capture is in
        progress; no capture begins until the block ends."""
        with self.lock:
            yield not self.busy()

    def saw_stream(self, capturing: bool) -> None:
        """What a recording thread found of its current stream (``capturing``)."""
        if capturing:
            self.unhooked = True
        elif self.unhooked:
            self.unhooked = False

    def note_comm(self) -> None:
        """A collective was launched during the capture in progress (it is in the graph)."""
        self.comm = True

    def install(self, cuda: Any) -> None:
        """Watch ``cuda.CUDAGraph`` (once; a second call with the same class does
        nothing). Never raises: a CUDA module without graphs is left alone."""
        graph_cls = getattr(cuda, "CUDAGraph", None)
        if graph_cls is None or any(c is graph_cls for c, _, _, _ in self._installed):
            return
        try:
            for name, wrap in (("capture_begin", self._wrap_begin),
                               ("capture_end", self._wrap_end), ("replay", self._wrap_replay)):
                original = getattr(graph_cls, name)
                wrapper = wrap(original)
                wrapper.__name__ = wrapper.__qualname__ = name
                wrapper.__doc__ = getattr(original, "__doc__", None)
                self._installed.append((graph_cls, name, original, wrapper))
                setattr(graph_cls, name, wrapper)
        except Exception as exc:  # a CUDAGraph unlike torch's: captures unseen, none queried
            self.release()
            self.broken = True
            log.debug("rtop: cannot watch CUDA graph captures: %r", exc)

    def release(self) -> None:
        """Put the watched methods back (those nobody replaced since) and forget every
        capture: the probe that used them closes."""
        for cls, name, original, wrapper in reversed(self._installed):
            try:
                if vars(cls).get(name) is wrapper:
                    setattr(cls, name, original)
            except Exception as exc:  # never break the job because of rtop
                log.debug("rtop: could not restore CUDAGraph.%s: %r", name, exc)
        self._installed.clear()
        self._with_comm_ids.clear()
        self.active, self.unhooked, self.broken, self.comm = 0, False, False, False
        self.on_replay = self.on_failure = None

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        callback = self.on_failure
        if callback is not None:
            with contextlib.suppress(Exception):
                callback("cuda.capture", exc)

    def _wrap_begin(self, original: Any) -> Callable[..., Any]:
        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            counted = False
            try:  # guard point "cuda.capture": rtop's part, never the capture
                mode = kwargs.get("capture_error_mode", args[1] if len(args) > 1 else "global")
                with self.lock:  # waits for a read of events in progress to end
                    self.active += 1
                    counted = True
                    self.mode, self.comm = str(mode), False
                    self.seen += 1
            except Exception as exc:
                self._fail(exc)
            try:
                return original(graph, *args, **kwargs)
            except BaseException:
                if counted:
                    self.active = max(0, self.active - 1)
                raise

        return capture_begin

    def _wrap_end(self, original: Any) -> Callable[..., Any]:
        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(graph, *args, **kwargs)
            finally:  # the capture is over, failed or not
                try:
                    if self.comm:
                        try:
                            self._with_comm.add(graph)
                        except TypeError:
                            self._with_comm_ids.add(id(graph))
                    self.comm = False
                    self.active = max(0, self.active - 1)
                except Exception as exc:
                    self._fail(exc)

        return capture_end

    def _has_comm(self, graph: Any) -> bool:
        """Whether ``graph``'s capture launched a collective."""
        if id(graph) in self._with_comm_ids:
            return True
        try:
            return graph in self._with_comm
        except TypeError:  # no weak reference to it: it was never added there
            return False

    def _wrap_replay(self, original: Any) -> Callable[..., Any]:
        def replay(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                callback = self.on_replay
                if callback is not None and self._has_comm(graph):
                    callback()
            except Exception as exc:
                self._fail(exc)
            return original(graph, *args, **kwargs)

        return replay


#: This process's CUDA graph captures (see the module doc).
CAPTURES = Captures()


class EventPool:
    """A bounded free list of timing events shared by the training and sender threads.

    ``factory`` makes a new event; ``stream()`` gives the stream to record on (None:
    the event's own default, the current stream); ``bind()`` makes the pool's device
    current on the calling thread; ``capturing()`` says whether the recording thread's
    current stream is capturing a CUDA graph (``torch.cuda.is_current_stream_capturing``);
    ``module`` is the CUDA module the events come from (its ``CUDAGraph`` and ``Stream``
    are watched while a probe uses the pool). ``deque.append``/``pop`` are atomic under
    the GIL, so no lock is needed.
    """

    def __init__(
        self,
        factory: Callable[[], TimingEvent],
        keep: int = 4096,
        *,
        device: int | None = None,
        stream: Callable[[], Any] | None = None,
        bind: Callable[[], None] | None = None,
        capturing: Callable[[], bool] | None = None,
        module: Any = None,
    ) -> None:
        self._factory = factory
        self._free: deque[TimingEvent] = deque()
        self._keep = keep
        self._stream = stream
        self._bind = bind
        self._capturing = capturing
        #: The CUDA module the events come from (None: injected events).
        self.module = module
        #: The stream the current step's start event was recorded on (the probe sets it):
        #: the stream whose waits are the step's exposed collective time.
        self.step_stream: Any = None
        #: The CUDA device index whose events this pool holds (None: not tied to one).
        self.device = device
        #: Events made so far (the pool reuses them: this stops growing).
        self.created = 0
        #: Why recording failed, once it has (CUDA timing is then off); else None.
        self.failure: str | None = None
        #: Called once, with the failure's text, when recording first fails.
        self.on_failure: Callable[[str], None] | None = None

    def stream(self) -> Any:
        """The stream :meth:`record` would record on now (the device's current stream),
        or None when the pool records on the event's default. Never raises: a failure
        turns CUDA timing off, as a failure to record does."""
        if self._stream is None or self.failure is not None:
            return None
        try:
            return self._stream()
        except Exception as exc:
            self.fail(f"reading the current CUDA stream failed: {type(exc).__name__}: {exc}")
            return None

    def record(self, stream: Any = None) -> TimingEvent | None:
        """Take an event from the pool (or make one) and record it on ``stream`` (default:
        the device's current stream); None once recording has failed, and while a CUDA
        graph is being captured (module doc). Never raises."""
        if self.failure is not None:
            return None
        try:
            capturing = self._capturing
            if CAPTURES.busy() and (CAPTURES.active or CAPTURES.broken or capturing is None):
                return None  # a capture rtop saw begin is in progress (or may be)
            if capturing is not None:  # one it did not see: this thread's stream says
                now = bool(capturing())
                CAPTURES.saw_stream(now)
                if now:
                    return None
            try:
                event = self._free.pop()
            except IndexError:
                event = self._factory()
                self.created += 1
            if stream is not None:
                event.record(stream)
            elif self._stream is None:
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
        """Give events back once they have been read (an event listed twice, as a step's
        collective and as the span its stream waited, goes back once)."""
        if self.failure is not None:
            return  # events of a failed pool are dropped, never reused
        seen: set[int] = set()
        for event in events:
            if event is None or id(event) in seen:
                continue
            seen.add(id(event))
            if len(self._free) < self._keep:
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
        capturing=getattr(cuda, "is_current_stream_capturing", None),
        module=cuda,
    )


def seconds_between(start: TimingEvent, end: TimingEvent) -> float:
    """Seconds from ``start`` to ``end`` (both completed)."""
    return float(start.elapsed_time(end)) / 1000.0
