"""A fake of ``torch.cuda`` as far as rtop uses it, for a machine without CUDA.

It behaves like the real runtime where rtop's GPU path has gone wrong before
(``c10/cuda/CUDAEvent.h``, ``torch/cuda/streams.py``, CUDA's runtime):

* the current device is per thread, and a new thread starts on device 0;
* a CUDA context opens on a device at the first runtime call that needs one there:
  ``set_device(d)``, recording an event on a stream of ``d`` (``CUDAGuard`` on the
  event's device), and ``cudaEventQuery`` / ``cudaEventElapsedTime`` on the calling
  thread's *current* device (``CUDAEvent::query`` sets no device);
* an event belongs to the device of the stream it is first recorded on; recording it
  on another device's stream raises ``RuntimeError("Event device 0 does not match
  recording stream's device 1.")``;
* ``Event.record()`` without a stream records on ``current_stream()``, the current
  device's;
* an event never recorded reads as complete; a sticky CUDA error (:attr:`sticky`)
  makes every later call raise, as after a device-side assert.

* ``elapsed_time`` on an event the GPU has not passed raises, as ``cudaErrorNotReady``
  does (:class:`NotReady`, a ``RuntimeError``; also an ``AssertionError`` for code that
  caught the first fake's assertion).

Streams and CUDA graphs (:meth:`FakeCuda.stream`, :attr:`FakeCuda.Stream`,
:attr:`FakeCuda.CUDAGraph`, :meth:`FakeCuda.graph`), as CUDA's runtime rules them:

* each stream runs its work in order; ``wait_event`` makes a stream's later work wait
  until the GPU has passed the event (``cudaStreamWaitEvent``); the current stream is
  per thread and per device, the device's default stream unless ``stream(s)`` says;
* a capture (``CUDAGraph.capture_begin``) is made on the current stream, never the
  default one ("CUDA graphs must be captured on a non-default stream"); work launched
  on a capturing stream is recorded into the graph, not run; ``replay()`` runs it on
  the current stream;
* an event recorded on a capturing stream cannot be queried or timed
  (``cudaErrorCapturedEvent``);
* while a capture in mode ``"global"`` is in progress, a potentially unsafe call from
  *any* thread (``cudaEventQuery``, ``cudaEventElapsedTime``, a synchronize, and
  anything put on the legacy default stream, which synchronises implicitly with the
  capturing stream) fails and invalidates the capture; in ``"thread_local"`` mode only
  the capturing thread's own such calls do; ``"relaxed"`` forbids none. An invalidated
  capture fails at ``capture_end`` ("operation failed due to a previous error during
  capture").

:class:`FakeNccl` stands in for an NCCL process group (module doc there).

GPU time is simulated: each stream has a clock of issued work (ms; the default stream's
is :attr:`FakeCuda.issued`), advanced by :meth:`FakeCuda.run`; the device executes it
at once unless :attr:`paused` (then :attr:`FakeCuda.done` says how far it has got).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any


class NotReady(RuntimeError, AssertionError):
    """``cudaErrorNotReady``: the GPU has not passed the event yet."""


class FakeStream:
    """A stream of one device (``stream_id`` 0: the device's default stream)."""

    def __init__(self, device: int, stream_id: int = 0) -> None:
        self.device = device
        self.device_index = device
        self.stream_id = stream_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and (self.device, self.stream_id) == (
            other.device, other.stream_id)

    def __hash__(self) -> int:
        return hash((self.device, self.stream_id))

    def __repr__(self) -> str:
        return f"<FakeStream cuda:{self.device} #{self.stream_id}>"


class FakeCuda:
    """The fake runtime; pass it where ``torch.cuda`` is expected (see module doc)."""

    def __init__(self, devices: int = 2, total_memory: int = 80 * 2**30) -> None:
        self.devices = devices
        self._tls = threading.local()
        self._lock = threading.Lock()
        #: (device, thread name, what opened it): every CUDA context opened.
        self.contexts: list[tuple[int, str, str]] = []
        self.issued = [0.0] * devices  # ms of work enqueued per device
        self.done = [0.0] * devices  # ms of work executed per device
        self.paused = False
        #: A sticky CUDA error: every later call raises it.
        self.sticky: RuntimeError | None = None
        self.initialized = True
        self.allocated = [0] * devices
        self.reserved = [0] * devices
        self.peak_reserved = [0] * devices
        self.total_memory = total_memory
        #: bytes other processes hold on each device (``mem_get_info`` counts them used)
        self.others_use = [0] * devices
        self.uuids = [f"0000000{i}-1111-2222-3333-44444444444{i}" for i in range(devices)]
        #: clocks (ms) of the side streams, by (device, stream id)
        self._clocks: dict[tuple[int, int], float] = {}
        self._next_stream = 1
        #: captures in progress, by the (device, stream id) they capture on
        self._captures: dict[tuple[int, int], dict[str, Any]] = {}
        #: how many captures an unsafe call invalidated
        self.invalidated = 0
        self.Event = self._event_class()
        self.Stream = self._stream_class()
        self.CUDAGraph = self._graph_class()

    # ---- what rtop calls -------------------------------------------------------------

    def current_device(self) -> int:
        return int(getattr(self._tls, "device", 0))

    def set_device(self, device: int) -> None:
        self._check()
        self._tls.device = device
        self._context(device, "set_device")

    def current_stream(self, device: int | None = None) -> FakeStream:
        device = self.current_device() if device is None else device
        streams = getattr(self._tls, "streams", {})
        return self.Stream._existing(device, streams.get(device, 0))

    def default_stream(self, device: int | None = None) -> FakeStream:
        return self.Stream._existing(self.current_device() if device is None else device, 0)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        """``torch.cuda.stream(s)``: ``s`` is the calling thread's current stream of its
        device inside the block."""
        streams = self._tls.__dict__.setdefault("streams", {})
        before = streams.get(stream.device, 0)
        streams[stream.device] = stream.stream_id
        try:
            yield
        finally:
            streams[stream.device] = before

    @contextlib.contextmanager
    def device(self, device: int) -> Iterator[None]:
        """``torch.cuda.device(d)``: ``d`` is current inside the block (a context opens
        there, as ``cudaSetDevice`` does); the previous device comes back without opening
        one (torch's ``_maybe_exchange_device``)."""
        before = self.current_device()
        self.set_device(device)
        try:
            yield
        finally:
            self._tls.device = before

    def synchronize(self, device: int | None = None) -> None:
        """``torch.cuda.synchronize()``: on the current device (a context opens there);
        the host waits until the GPU has run everything enqueued there."""
        device = self.current_device() if device is None else device
        self._unsafe("synchronize")
        self._context(device, "synchronize")
        self._check()
        self.done[device] = max(self.done[device], self._latest(device))

    def is_current_stream_capturing(self) -> bool:
        """Whether the calling thread's current stream (current device) is capturing."""
        s = self.current_stream()
        return (s.device, s.stream_id) in self._captures

    def is_available(self) -> bool:
        return self.devices > 0

    @contextlib.contextmanager
    def graph(self, cuda_graph: Any, pool: Any = None, stream: FakeStream | None = None,
              capture_error_mode: str = "global") -> Iterator[None]:
        """``torch.cuda.graph``: synchronize, then capture on ``stream`` (a side stream of
        the current device by default) until the block ends."""
        self.synchronize()
        stream = stream if stream is not None else self.Stream(self.current_device())
        with self.stream(stream):
            cuda_graph.capture_begin(pool, capture_error_mode=capture_error_mode)
            try:
                yield
            finally:
                cuda_graph.capture_end()

    def is_initialized(self) -> bool:
        return self.initialized

    def memory_allocated(self, device: int) -> int:
        return self.allocated[device]

    def memory_reserved(self, device: int) -> int:
        return self.reserved[device]

    def max_memory_reserved(self, device: int) -> int:
        return self.peak_reserved[device]

    def mem_get_info(self, device: int) -> tuple[int, int]:
        """``(free, total)`` bytes of the device, as ``cudaMemGetInfo`` says: memory that
        any context holds is not free, and that includes what torch's caching allocator
        of this process has reserved from the device but not handed out (torch reuses
        that first); :attr:`others_use` is what other processes hold."""
        self._check()
        self._context(device, "mem_get_info")
        used = self.reserved[device] + self.others_use[device]
        return max(0, self.total_memory - used), self.total_memory

    def get_device_properties(self, device: int) -> Any:
        return SimpleNamespace(total_memory=self.total_memory, uuid=self.uuids[device],
                               pci_bus_id=0x10 + device, pci_domain_id=0, pci_device_id=0)

    # ---- what a test drives ----------------------------------------------------------

    def run(self, device: int, ms: float, stream: FakeStream | None = None) -> None:
        """Enqueue ``ms`` of GPU work on ``device``, on ``stream`` (default: the calling
        thread's current stream there); it executes at once unless paused. On a capturing
        stream it goes into the graph instead."""
        s = stream if stream is not None else self.current_stream(device)
        capture = self._captures.get((s.device, s.stream_id))
        if capture is not None:
            capture["ms"] += ms
            return
        if s.stream_id == 0:
            self._unsafe("work on the legacy default stream")
        self._advance(s, ms)

    def finish(self) -> None:
        """The GPU catches up with everything enqueued."""
        self.paused = False
        self.done = [self._latest(d) for d in range(self.devices)]

    def as_autograd_thread(self, device: int) -> None:
        """Make the calling thread current on ``device`` without opening a context there
        (autograd's device thread for a device whose context exists)."""
        self._tls.device = device

    def context_devices(self) -> set[int]:
        with self._lock:
            return {d for d, _, _ in self.contexts}

    # ---- internals -------------------------------------------------------------------

    def _check(self) -> None:
        if self.sticky is not None:
            raise self.sticky

    def _clock(self, s: FakeStream) -> float:
        if s.stream_id == 0:
            return self.issued[s.device]
        return self._clocks.get((s.device, s.stream_id), 0.0)

    def _set_clock(self, s: FakeStream, t: float) -> None:
        if s.stream_id == 0:
            self.issued[s.device] = t
        else:
            self._clocks[(s.device, s.stream_id)] = t
        if not self.paused:
            self.done[s.device] = max(self.done[s.device], t)

    def _advance(self, s: FakeStream, ms: float) -> None:
        self._set_clock(s, self._clock(s) + ms)

    def _latest(self, device: int) -> float:
        return max([self.issued[device]] + [t for (d, _), t in self._clocks.items()
                                            if d == device])

    def _unsafe(self, what: str) -> None:
        """A potentially unsafe call while a capture is in progress (module doc): it
        fails, and invalidates the capture, in the modes that forbid it."""
        me = threading.get_ident()
        hit = [c for c in self._captures.values()
               if c["mode"] == "global" or (c["mode"] == "thread_local" and c["thread"] == me)]
        if not hit:
            return
        for c in hit:
            if not c["invalid"]:
                c["invalid"] = True
                self.invalidated += 1
        raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing "
                           f"({what})")

    def _stream_class(self) -> type:
        runtime = self

        class Stream(FakeStream):
            """``torch.cuda.Stream``: ``Stream(device)`` makes a new side stream."""

            def __init__(self, device: int | None = None, priority: int = 0, *,
                         _id: int | None = None) -> None:
                device = runtime.current_device() if device is None else int(device)
                if _id is None:
                    _id = runtime._next_stream
                    runtime._next_stream += 1
                    # a new stream starts where the device is now
                    runtime._clocks[(device, _id)] = runtime.done[device]
                super().__init__(device, _id)

            @classmethod
            def _existing(cls, device: int, stream_id: int) -> FakeStream:
                return cls(device, _id=stream_id)

            def wait_event(self, event: Any) -> None:
                event.wait(self)

            def wait_stream(self, stream: FakeStream) -> None:
                self.wait_event(stream.record_event())  # type: ignore[attr-defined]

            def record_event(self, event: Any = None) -> Any:
                event = event if event is not None else runtime.Event()
                event.record(self)
                return event

        return Stream

    def _graph_class(self) -> type:
        runtime = self

        class CUDAGraph:
            """``torch.cuda.CUDAGraph``: what a capture recorded, replayed on demand."""

            def __init__(self) -> None:
                self.ms = 0.0
                self.device: int | None = None
                self.captured = False

            def capture_begin(self, pool: Any = None, capture_error_mode: str = "global"
                              ) -> None:
                s = runtime.current_stream()
                if s.stream_id == 0:
                    raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
                runtime._check()
                runtime._captures[(s.device, s.stream_id)] = {
                    "mode": capture_error_mode, "thread": threading.get_ident(), "ms": 0.0,
                    "invalid": False}

            def capture_end(self) -> None:
                s = runtime.current_stream()
                capture = runtime._captures.pop((s.device, s.stream_id))
                if capture["invalid"]:
                    raise RuntimeError("CUDA error: operation failed due to a previous error "
                                       "during capture")
                self.ms, self.device, self.captured = capture["ms"], s.device, True

            def replay(self) -> None:
                assert self.captured and self.device is not None
                runtime.run(self.device, self.ms)

        return CUDAGraph

    def _context(self, device: int, why: str) -> None:
        with self._lock:
            if device not in {d for d, _, _ in self.contexts}:
                self.contexts.append((device, threading.current_thread().name, why))

    def _event_class(self) -> type:
        runtime = self

        class Event:
            """``torch.cuda.Event`` (timing only)."""

            def __init__(self, enable_timing: bool = False) -> None:
                self.enable_timing = enable_timing
                self.device: int | None = None
                self.t: float | None = None
                #: last recorded on a capturing stream (cudaErrorCapturedEvent from then)
                self.captured = False

            def record(self, stream: FakeStream | None = None) -> None:
                if stream is None:
                    stream = runtime.current_stream()
                runtime._check()
                if self.device is None:
                    self.device = stream.device
                if self.device != stream.device:
                    raise RuntimeError(
                        f"Event device {self.device} does not match recording stream's "
                        f"device {stream.device}.")
                runtime._context(self.device, "event record")
                if (stream.device, stream.stream_id) in runtime._captures:
                    self.captured, self.t = True, 0.0  # a node of the graph, not a time
                    return
                if stream.stream_id == 0:
                    runtime._unsafe("event record on the legacy default stream")
                self.captured = False
                self.t = runtime._clock(stream)

            def wait(self, stream: FakeStream | None = None) -> None:
                """``cudaStreamWaitEvent``: ``stream``'s later work waits for this event."""
                stream = stream if stream is not None else runtime.current_stream()
                if self.t is None or self.captured:
                    return
                if (stream.device, stream.stream_id) in runtime._captures:
                    return  # a dependency inside the graph
                runtime._set_clock(stream, max(runtime._clock(stream), self.t))

            def query(self) -> bool:
                if self.t is None:
                    return True  # never recorded: torch answers without calling CUDA
                runtime._context(runtime.current_device(), "event query")
                runtime._unsafe("cudaEventQuery")
                runtime._check()
                if self.captured:
                    raise RuntimeError("CUDA error: operation not permitted on an event last "
                                       "recorded in a capturing stream")
                assert self.device is not None
                return runtime.done[self.device] >= self.t

            def elapsed_time(self, end: Event) -> float:
                runtime._context(runtime.current_device(), "elapsed_time")
                runtime._unsafe("cudaEventElapsedTime")
                runtime._check()
                if self.captured or end.captured:
                    raise RuntimeError("CUDA error: operation not permitted on an event last "
                                       "recorded in a capturing stream")
                assert self.t is not None and end.t is not None
                if not (self.query() and end.query()):
                    raise NotReady("CUDA error: device not ready (elapsed_time on an "
                                   "incomplete event)")
                return end.t - self.t

            def synchronize(self) -> None:
                raise AssertionError("rtop must never synchronize")

        return Event


class FakeFuture:
    """The future of an NCCL work (:class:`FakeNccl`): complete from the start; a callback
    runs at once, on the calling thread, with the device's current stream set to a stream
    that waits for the collective (c10's CUDA-aware ``ivalue::Future``)."""

    def __init__(self, nccl: FakeNccl, end: Any, value: Any = None) -> None:
        self._nccl = nccl
        self._end = end
        self._value = value

    def done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self._value

    def value(self) -> Any:
        return self._value

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        cuda, device = self._nccl.cuda, self._nccl.device
        stream = cuda.Stream(device)
        self._end.wait(stream)
        with cuda.stream(stream):
            return fn(self)

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        self._run(fn)

    def then(self, fn: Callable[[Any], Any]) -> FakeFuture:
        return FakeFuture(self._nccl, self._end, self._run(fn))


class FakeNccl:
    """An NCCL process group as rtop sees one, made of a real one-rank gloo group.

    :meth:`install` replaces methods of ``torch.distributed.ProcessGroup`` and ``Work``
    (until :meth:`remove`) with what ProcessGroupNCCL and ``torch.distributed`` do since
    torch 2.12; rtop, installed after, wraps them as torch's own. The rules:

    * a collective takes :attr:`ms` of GPU time on :attr:`device`; its tensors are meta
      tensors, which stand for CUDA tensors (neither is on the CPU; a one-rank collective
      moves no data);
    * ``async_op=True``: it runs on NCCL's own stream, which first waits for the caller's
      current stream (ProcessGroupNCCL's ``syncStream``), and returns a ``Work``;
    * **sync NCCL ops return no Work**: ``async_op=False`` runs it on the caller's
      current stream and returns None (``distributed_c10d``: "the backend has sync'ed at
      CPP level");
    * **NCCL futures complete at enqueue**: a callback on ``work.get_future()`` runs at
      once, on the host, on a stream that waits for the collective (:class:`FakeFuture`);
    * ``work.wait()`` makes the caller's current stream wait for the collective; the
      host does not wait;
    * between ``_start_coalescing(device)`` and ``_end_coalescing(device)`` nothing is
      launched (``ncclGroupStart``/``End``): an inner op's work completes at once (it
      marks nothing); ``_end_coalescing`` launches the whole group on NCCL's stream and
      returns its ``Work``;
    * the group's backend is named ``"nccl"``.
    """

    COLLECTIVES = ("allreduce", "allreduce_coalesced", "all_gather_single",
                   "reduce_scatter_single", "broadcast", "allgather_into_tensor_coalesced",
                   "reduce_scatter_tensor_coalesced")

    def __init__(self, cuda: FakeCuda, device: int = 0, ms: float = 3.0) -> None:
        self.cuda = cuda
        self.device = device
        #: GPU time of one collective (ms)
        self.ms = ms
        #: collectives launched on the GPU (a coalesced group counts once)
        self.launches = 0
        self.works: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._grouped: dict[int, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._stream: Any = None

    def install(self) -> FakeNccl:
        import torch.distributed as dist

        self._stream = self.cuda.Stream(self.device)
        for name in self.COLLECTIVES:
            if name in vars(dist.ProcessGroup):
                self._patch(dist.ProcessGroup, name, self._collective())
        fake = self

        def start_coalescing(group: Any, device: Any) -> None:
            fake._grouped[id(group)] = 0.0

        def end_coalescing(group: Any, device: Any) -> Any:
            return fake._work(fake._on_nccl_stream(fake._grouped.pop(id(group))))

        self._patch(dist.ProcessGroup, "_start_coalescing", start_coalescing)
        self._patch(dist.ProcessGroup, "_end_coalescing", end_coalescing)
        self._patch(dist.ProcessGroup, "_get_backend_name", lambda group: "nccl")
        wait, get_future = vars(dist.Work)["wait"], vars(dist.Work)["get_future"]

        def nccl_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            found = fake.works.get(work)
            if found is None:
                return wait(work, *args, **kwargs)
            found[0].wait(fake.cuda.current_stream(fake.device))
            return True

        def nccl_future(work: Any) -> Any:
            found = fake.works.get(work)
            return get_future(work) if found is None else FakeFuture(fake, *found)

        self._patch(dist.Work, "wait", nccl_wait)
        self._patch(dist.Work, "get_future", nccl_future)
        return self

    def remove(self) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()

    def __enter__(self) -> FakeNccl:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- the backend ---------------------------------------------------------------

    def _patch(self, cls: Any, name: str, fn: Any) -> None:
        self._saved.append((cls, name, vars(cls)[name]))
        setattr(cls, name, fn)

    def _collective(self) -> Callable[..., Any]:
        fake = self

        def nccl_collective(group: Any, *args: Any, **kwargs: Any) -> Any:
            opts = kwargs.get("opts", args[-1] if args else None)
            value = args[0] if args else None  # what the future holds: the tensors
            if id(group) in fake._grouped:  # coalescing: nothing launched yet
                fake._grouped[id(group)] += fake.ms
                return fake._work(fake._mark(fake._stream), value)
            if getattr(opts, "asyncOp", True) is False:  # the caller's stream, no Work
                fake.cuda.run(fake.device, fake.ms)
                fake.launches += 1
                return None
            return fake._work(fake._on_nccl_stream(fake.ms), value)

        return nccl_collective

    def _mark(self, stream: Any) -> Any:
        event = self.cuda.Event()
        event.record(stream)
        return event

    def _on_nccl_stream(self, ms: float) -> Any:
        """Run ``ms`` on NCCL's stream once the caller's current stream gets there; the
        event that marks its end."""
        self._mark(self.cuda.current_stream(self.device)).wait(self._stream)
        self.cuda.run(self.device, ms, stream=self._stream)
        self.launches += 1
        return self._mark(self._stream)

    def _work(self, end: Any, value: Any = None) -> Any:
        import torch.distributed as dist

        work = dist.Work()
        self.works[work] = (end, value)
        return work


# ---- the link probe's runtime: NCCL point-to-point between ranks -----------------------
#
# :class:`FakeLinkJob` is a job of ranks (threads of one test process), each with its
# own GPUs (:class:`FakeLinkGpu`, standing for ``torch.cuda``), its own
# ``torch.distributed`` (:class:`FakeLinkDist`: an initialised NCCL job whose
# ``ProcessGroupNCCL`` is faked) and its own allocator (:class:`FakeLinkTorch`), sharing
# one real store (a ``HashStore``). :meth:`FakeLinkJob.runtime` is what a
# ``collectors.linkprobe.LinkProbe`` takes as its ``runtime``. The rules it encodes are
# CUDA's and NCCL's (ProcessGroupNCCL.cpp, the NCCL and CUDA runtime guides), not rtop's:
#
# * NCCL matches the point-to-point operations of a communicator in order, per
#   direction, and ignores tags: the k-th send from a to b meets the k-th receive at b
#   from a; the two must carry the same number of bytes.
# * **A send or receive posted on one rank never completes unless the peer posts the
#   matching operation.** Nothing cancels it but aborting its communicator
#   (``ProcessGroupNCCL.abort()``: ``ncclCommAbort``); an operation still posted when
#   the test ends is one NCCL's watchdog would tear the process down for
#   (:meth:`FakeLinkJob.left_posted`).
# * **The first operation between the ranks of a process group creates their
#   communicator inside the call** (``ncclCommInitRank``, collective over both ranks):
#   the lower rank puts the unique id in the group's store (key ``"0:1"``), the other
#   reads it (a blocking ``get``), and the call blocks the host until the peer's first
#   operation has joined too. A communicator holds device memory until its process group
#   is shut down or aborted (:meth:`FakeLinkJob.live`); shutting one down with an
#   operation of its own still posted blocks in ``ncclCommFinalize`` (recorded in
#   :attr:`FakeLinkJob.problems`).
# * GPU time: an operation runs on its group's NCCL stream for its device, after
#   everything already on that stream and after the work the caller's *current* stream
#   had when it was posted (ProcessGroupNCCL's ``syncStream``). A transfer starts when
#   both its operations have started and takes ``latency_s + bytes / bandwidth``.
#   ``work.block_current_stream()`` (and ``wait()`` without a timeout) makes the
#   caller's current stream wait for it, not the host; ``wait(timeout)`` blocks the host.
# * An event recorded on a stream completes when the stream gets there, with the GPU
#   time then; ``elapsed_time`` between two completed events is that GPU time (ms) and
#   raises on an incomplete one (``cudaErrorNotReady``).
# * **Host timing includes launch and poll overhead of at least 100 µs; CUDA events
#   measure the transfer**: the host sees a completion (``is_completed``, ``query``)
#   ``host_lag_s`` (default 300 µs) after the GPU finished it.
# * ``torch.cuda.current_device()`` is 0 on a thread that never called ``set_device``;
#   a CUDA context opens on a device at the first call that needs one there
#   (``set_device`` / entering ``torch.cuda.device``, making a stream, allocating,
#   recording an event on a stream of it, an NCCL operation on it, and ``cudaEventQuery``
#   on the calling thread's *current* device): :meth:`FakeLinkGpu.contexts`.
# * The job's own group (``dist.isend`` / ``irecv`` here) is counted in
#   :attr:`FakeLinkJob.job_ops`: under NCCL the probe has no business posting there.

import contextlib as _contextlib  # noqa: E402
import math as _math  # noqa: E402
import time as _time  # noqa: E402
import weakref as _weakref  # noqa: E402
from collections.abc import Callable as _Callable  # noqa: E402
from collections.abc import Iterator as _Iterator  # noqa: E402
from datetime import timedelta as _timedelta  # noqa: E402


class _GpuTime:
    """A point of GPU time (host ``perf_counter`` seconds) that may not be known yet:
    the latest of ``base`` and its ``deps``, plus ``plus``; None while a dependency is
    unknown (a transfer whose peer has not posted)."""

    __slots__ = ("_t", "base", "deps", "plus")

    def __init__(self, base: float = -_math.inf, deps: tuple[Any, ...] = (),
                 plus: float = 0.0) -> None:
        self.base = base
        self.deps = deps
        self.plus = plus
        self._t: float | None = None

    def time(self) -> float | None:
        if self._t is not None:
            return self._t
        t = self.base
        for dep in self.deps:
            d = dep.time()
            if d is None:
                return None
            t = max(t, d)
        self._t = t + self.plus
        self.deps = ()
        return self._t


class _Never(_GpuTime):
    """The end of an operation whose peer has not posted its half."""

    def time(self) -> float | None:
        return None


class _LinkStream:
    """A CUDA stream of one device: its work in order (``last``: when it gets through
    what is on it so far)."""

    def __init__(self, gpu: FakeLinkGpu, device: int, name: str) -> None:
        self.gpu = gpu
        self.device = device
        self.device_index = device
        self.name = name
        self.last: _GpuTime = _GpuTime()
        #: operations it was made to wait for (``block_current_stream``)
        self.waits = 0

    def __repr__(self) -> str:
        return f"<stream {self.name} of cuda:{self.device}, rank {self.gpu.rank}>"


class FakeLinkGpu:
    """``torch.cuda`` of one rank of a :class:`FakeLinkJob` (see the rules above)."""

    def __init__(self, job: FakeLinkJob, rank: int, devices: int) -> None:
        self.job = job
        self.rank = rank
        self.devices = devices
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._contexts: dict[int, list[str]] = {}
        self.default = [_LinkStream(self, d, "default") for d in range(devices)]
        self.streams: list[_LinkStream] = []
        #: bytes allocated on each device now, and at most
        self.allocated = [0] * devices
        self.peak = [0] * devices
        gpu = self

        class Event:
            """``torch.cuda.Event``."""

            def __init__(self, enable_timing: bool = False) -> None:
                self.enable_timing = enable_timing
                self.node: _GpuTime | None = None

            def record(self, stream: _LinkStream | None = None) -> None:
                s = stream if stream is not None else gpu.current_stream()
                gpu._context(s.device, "event record")
                self.node = _GpuTime(_time.perf_counter(), (s.last,))
                s.last = self.node

            def query(self) -> bool:
                gpu._context(gpu.current_device(), "event query")
                return self.node is None or gpu.job._seen(self.node.time())

            def elapsed_time(self, end: Event) -> float:
                gpu._context(gpu.current_device(), "elapsed_time")
                if self.node is None or end.node is None or not (self.query()
                                                                 and end.query()):
                    raise RuntimeError("CUDA error: device not ready")
                a, b = self.node.time(), end.node.time()
                assert a is not None and b is not None
                return (b - a) * 1000.0

        self.Event = Event

    # ---- torch.cuda ------------------------------------------------------------------

    def is_available(self) -> bool:
        return self.devices > 0

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return int(getattr(self._tls, "device", 0))

    def set_device(self, device: int) -> None:
        self._context(device, "set_device")
        self._tls.device = device

    @_contextlib.contextmanager
    def device(self, device: int) -> _Iterator[None]:
        before = self.current_device()
        self.set_device(int(device))
        try:
            yield
        finally:
            self._tls.device = before

    def Stream(self, device: Any = None, priority: int = 0) -> _LinkStream:
        index = self._index(device)
        self._context(index, "stream")
        s = _LinkStream(self, index, f"side{len(self.streams) + 1}")
        self.streams.append(s)
        return s

    def current_stream(self, device: Any = None) -> _LinkStream:
        index = self._index(device)
        return getattr(self._tls, "streams", {}).get(index, self.default[index])

    @_contextlib.contextmanager
    def stream(self, stream: _LinkStream) -> _Iterator[None]:
        """``torch.cuda.stream(s)``: ``s`` current (and its device, as torch's
        ``StreamContext`` does) inside the block."""
        streams = self._tls.__dict__.setdefault("streams", {})
        before = streams.get(stream.device)
        with self.device(stream.device):
            streams[stream.device] = stream
            try:
                yield
            finally:
                if before is None:
                    streams.pop(stream.device, None)
                else:
                    streams[stream.device] = before

    # ---- what a test reads -----------------------------------------------------------

    def contexts(self) -> set[int]:
        """Devices on which this rank opened a CUDA context."""
        with self._lock:
            return set(self._contexts)

    def why(self, device: int) -> list[str]:
        with self._lock:
            return list(self._contexts.get(device, []))

    # ---- internals -------------------------------------------------------------------

    def _index(self, device: Any) -> int:
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            return device
        index = getattr(device, "index", None)
        return self.current_device() if index is None else int(index)

    def _context(self, device: int, why: str) -> None:
        if not 0 <= device < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
        with self._lock:
            self._contexts.setdefault(device, []).append(why)

    def _alloc(self, device: int, nbytes: int) -> None:
        self._context(device, "allocation")
        with self._lock:
            self.allocated[device] += nbytes
            self.peak[device] = max(self.peak[device], self.allocated[device])

    def _free(self, device: int, nbytes: int) -> None:
        with self._lock:
            self.allocated[device] -= nbytes


class FakeLinkTorch:
    """The part of ``torch`` a probe allocates with: tensors asked for on ``cuda:N`` are
    CPU tensors counted on that device of the rank's :class:`FakeLinkGpu` until freed."""

    def __init__(self, gpu: FakeLinkGpu) -> None:
        import torch

        self._torch = torch
        self.gpu = gpu
        self.uint8 = torch.uint8
        self.device = torch.device
        self._where: dict[int, tuple[Any, int]] = {}

    def full(self, size: Any, fill: Any, *, dtype: Any = None, device: Any = None) -> Any:
        t = self._torch.full(size, fill, dtype=dtype)
        d = self._torch.device(device if device is not None else "cpu")
        if d.type == "cuda":
            index = self.gpu._index(d)
            nbytes = t.numel() * t.element_size()
            self.gpu._alloc(index, nbytes)
            _weakref.finalize(t, self.gpu._free, index, nbytes)
            self._where[id(t)] = (_weakref.ref(t), index)
        return t

    def device_of(self, tensor: Any) -> int | None:
        """The CUDA device a tensor stands for (None: a CPU tensor)."""
        found = self._where.get(id(tensor))
        if found is None or found[0]() is not tensor:
            return None
        return found[1]


class _LinkOp:
    """One send or receive posted on a communicator."""

    def __init__(self, rank: int, kind: str, peer: int, tensor: Any, device: int,
                 start: _GpuTime, comm: _LinkComm) -> None:
        self.rank = rank
        self.kind = kind
        self.peer = peer
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.device = device
        self.start = start
        self.end: _GpuTime = _Never()
        self.comm = comm
        #: the rank's rank in the communicator's group
        self.rank_group = -1
        self.matched = False
        self.aborted = False

    def __repr__(self) -> str:
        return (f"<{self.kind} of {self.nbytes} B by rank {self.rank} to/from rank "
                f"{self.peer}{' (aborted)' if self.aborted else ''}>")


class _LinkComm:
    """A communicator between the ranks of one fake ProcessGroupNCCL (by its unique id)."""

    def __init__(self, uid: str, size: int) -> None:
        self.uid = uid
        self.size = size
        self.joined: dict[int, Any] = {}  # group rank -> its process group
        self.freed: set[int] = set()
        self.sends: dict[tuple[int, int], list[_LinkOp]] = {}
        self.recvs: dict[tuple[int, int], list[_LinkOp]] = {}


class FakeLinkWork:
    """``Work`` of a fake NCCL point-to-point operation."""

    def __init__(self, op: _LinkOp, gpu: FakeLinkGpu) -> None:
        self.op = op
        self.gpu = gpu

    def is_completed(self) -> bool:
        return self.op.aborted or self.gpu.job._seen(self.op.end.time())

    def block_current_stream(self) -> None:
        s = self.gpu.current_stream(self.op.device)
        s.last = _GpuTime(deps=(s.last, _Follow(self.op)))
        s.waits += 1

    def synchronize(self) -> None:
        self.block_current_stream()

    def wait(self, timeout: _timedelta | None = None) -> bool:
        if timeout is None or timeout.total_seconds() <= 0:
            self.block_current_stream()
            return True
        deadline = _time.monotonic() + timeout.total_seconds()
        while not self.is_completed():  # the host blocks
            if _time.monotonic() > deadline:
                raise RuntimeError(f"Work timed out after {timeout}")
            _time.sleep(1e-4)
        return True

    def exception(self) -> Any:
        return RuntimeError("aborted") if self.op.aborted else None


class FakeLinkJob:
    """A job of ``ranks`` ranks over fake NCCL (see the rules above). ``bandwidth_Bps``
    is every link's (``links`` overrides a pair's: ``{(a, b): Bps}``)."""

    def __init__(self, ranks: int = 2, *, bandwidth_Bps: float = 2e9,
                 latency_s: float = 5e-6, host_lag_s: float = 300e-6,
                 init_cap_s: float = 10.0) -> None:
        import torch.distributed as dist

        self.ranks = ranks
        self.bandwidth_Bps = bandwidth_Bps
        self.links: dict[tuple[int, int], float] = {}
        self.latency_s = latency_s
        self.host_lag_s = host_lag_s
        self.init_cap_s = init_cap_s
        self.store = dist.HashStore()
        self.store.set_timeout(_timedelta(seconds=init_cap_s))
        self._cond = threading.Condition()
        self._comms: dict[str, _LinkComm] = {}
        self._uids = 0
        #: every operation posted on a probe-made process group
        self.ops: list[_LinkOp] = []
        #: operations posted on the job's own group
        self.job_ops = 0
        #: what a real run would have hung or failed on
        self.problems: list[str] = []
        #: communicators alive per rank now, and the most at once
        self._live = [0] * ranks
        self.max_live = [0] * ranks
        self.groups_made = [0] * ranks
        self.gpus: dict[int, FakeLinkGpu] = {}
        #: a test's hook, called on the posting thread after each operation is posted
        self.on_post: _Callable[[_LinkOp], None] | None = None

    def runtime(self, rank: int, *, devices: int = 2, bound: int | None = None) -> Any:
        """The ``runtime`` of rank ``rank``'s probe: ``torch``, ``torch.distributed`` and
        ``torch.cuda`` of a process with ``devices`` GPUs (``bound``: the device its
        default group was initialised with)."""
        gpu = self.gpus.setdefault(rank, FakeLinkGpu(self, rank, devices))
        torch_ = FakeLinkTorch(gpu)
        return SimpleNamespace(torch=torch_, dist=FakeLinkDist(self, rank, gpu, torch_,
                                                               bound), cuda=gpu)

    # ---- what a test reads -----------------------------------------------------------

    def live(self, rank: int) -> int:
        """Communicators of probe-made process groups alive on ``rank``."""
        with self._cond:
            return self._live[rank]

    def left_posted(self) -> list[_LinkOp]:
        """Operations posted that neither completed nor were aborted: NCCL's watchdog
        would tear their process down once the group's timeout passed."""
        with self._cond:
            return [op for op in self.ops if not op.aborted and op.end.time() is None]

    def aborted(self) -> list[_LinkOp]:
        with self._cond:
            return [op for op in self.ops if op.aborted]

    # ---- internals -------------------------------------------------------------------

    def _seen(self, t: float | None) -> bool:
        """The host sees what the GPU finished at ``t`` ``host_lag_s`` later."""
        return t is not None and _time.perf_counter() >= t + self.host_lag_s

    def _join(self, uid: str, size: int, group_rank: int, pg: Any) -> _LinkComm:
        deadline = _time.monotonic() + self.init_cap_s
        with self._cond:
            comm = self._comms.setdefault(uid, _LinkComm(uid, size))
            comm.joined[group_rank] = pg
            self._cond.notify_all()
            while len(comm.joined) < size:
                left = deadline - _time.monotonic()
                if left <= 0:
                    self.problems.append(f"rank {pg.global_rank} blocked in ncclCommInitRank "
                                         f"for {self.init_cap_s} s: its peer never joined")
                    raise RuntimeError("fake NCCL: blocked in ncclCommInitRank (a real "
                                       "process hangs here)")
                self._cond.wait(left)
            r = pg.global_rank
            self._live[r] += 1
            self.max_live[r] = max(self.max_live[r], self._live[r])
            return comm

    def _free(self, comm: _LinkComm, pg: Any) -> None:
        with self._cond:
            if pg.group_rank not in comm.freed:
                comm.freed.add(pg.group_rank)
                self._live[pg.global_rank] -= 1

    def _post(self, op: _LinkOp) -> None:
        with self._cond:
            self.ops.append(op)
            comm = op.comm
            if op.kind == "send":  # by ranks of the group
                key = (op.rank_group, op.peer)
                mine, theirs = comm.sends.setdefault(key, []), comm.recvs.setdefault(key, [])
            else:
                key = (op.peer, op.rank_group)
                mine, theirs = comm.recvs.setdefault(key, []), comm.sends.setdefault(key, [])
            mine.append(op)
            k = len(mine) - 1
            # an operation meets its counterpart only while the counterpart's rank still
            # has the communicator: one posted to a peer that aborted never completes
            if k < len(theirs) and not theirs[k].aborted \
                    and theirs[k].rank_group not in comm.freed:
                self._match(op, theirs[k])
        if self.on_post is not None:
            self.on_post(op)

    def _match(self, a: _LinkOp, b: _LinkOp) -> None:
        send, recv = (a, b) if a.kind == "send" else (b, a)
        if send.nbytes != recv.nbytes:
            self.problems.append(f"a send of {send.nbytes} B met a receive of {recv.nbytes} B")
        else:
            recv.tensor.copy_(send.tensor)
        lo, hi = sorted((send.rank, recv.rank))
        bw = self.links.get((lo, hi), self.bandwidth_Bps)
        took = self.latency_s + send.nbytes / bw
        for op in (send, recv):
            op.end = _GpuTime(deps=(send.start, recv.start), plus=took)
            op.matched = True


class FakeLinkDist:
    """``torch.distributed`` of one rank of a :class:`FakeLinkJob`: initialised, backend
    NCCL, the job's store; ``ProcessGroupNCCL`` made on its GPUs."""

    def __init__(self, job: FakeLinkJob, rank: int, gpu: FakeLinkGpu,
                 torch_: FakeLinkTorch, bound: int | None) -> None:
        import torch
        import torch.distributed as dist

        self.job = job
        self.rank = rank
        self.PrefixStore = dist.PrefixStore
        self.group = SimpleNamespace(WORLD=object())
        bound_device = None if bound is None else torch.device("cuda", bound)
        self.distributed_c10d = SimpleNamespace(
            _get_default_store=lambda: job.store,
            _get_default_group=lambda: SimpleNamespace(bound_device_id=bound_device))
        self.ProcessGroupNCCL = _pg_class(job, rank, gpu, torch_)

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_backend(self, group: Any = None) -> str:
        return "nccl"

    def get_rank(self, group: Any = None) -> int:
        return self.rank

    def get_world_size(self, group: Any = None) -> int:
        return self.job.ranks

    def get_global_rank(self, group: Any, rank: int) -> int:
        return rank

    def isend(self, *args: Any, **kwargs: Any) -> Any:
        self.job.job_ops += 1
        raise RuntimeError("fake NCCL: the probe posted on the job's own group")

    irecv = isend


def _pg_class(job: FakeLinkJob, global_rank: int, gpu: FakeLinkGpu,
              torch_: FakeLinkTorch) -> type:
    class ProcessGroupNCCL:
        """A fake ``torch.distributed.ProcessGroupNCCL`` (a backend) of one rank."""

        class Options:
            def __init__(self, is_high_priority_stream: bool = False) -> None:
                self.is_high_priority_stream = is_high_priority_stream
                self._timeout = _timedelta(minutes=10)
                self.config = SimpleNamespace(blocking=1)

        def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
            self.store = store
            self.group_rank = rank
            self.global_rank = global_rank
            self.size = size
            self.options = options
            self.comm: _LinkComm | None = None
            self.state = "open"
            self._nccl_streams: dict[int, _LinkStream] = {}
            job.groups_made[global_rank] += 1

        def rank(self) -> int:
            return self.group_rank

        def send(self, tensors: list[Any], dst: int, tag: int = 0) -> FakeLinkWork:
            return self._op("send", tensors[0], dst)

        def recv(self, tensors: list[Any], src: int, tag: int = 0) -> FakeLinkWork:
            return self._op("recv", tensors[0], src)

        def shutdown(self) -> None:
            if self.comm is not None:
                mine = [op for op in job.ops if op.comm is self.comm and op.rank ==
                        self.global_rank and not op.aborted and op.end.time() is None]
                if mine:
                    job.problems.append(f"rank {self.global_rank} shut a group down with "
                                        f"{len(mine)} operations posted: ncclCommFinalize "
                                        "blocks")
                job._free(self.comm, self)
            self.state = "shut down"

        def abort(self) -> None:
            if self.comm is not None:
                with job._cond:
                    for op in job.ops:
                        if op.comm is self.comm and op.rank == self.global_rank \
                                and op.end.time() is None:
                            op.aborted = True
                job._free(self.comm, self)
            self.state = "aborted"

        def _op(self, kind: str, tensor: Any, peer: int) -> FakeLinkWork:
            if self.state != "open":
                raise RuntimeError(f"fake NCCL: the process group was {self.state}")
            device = torch_.device_of(tensor)
            if device is None:
                raise ValueError("Tensors must be CUDA and dense")
            if self.comm is None:  # ncclCommInitRank, inside the first operation
                if self.group_rank == 0:
                    job._uids += 1
                    uid = f"uid{job._uids}"
                    self.store.set("0:1", uid)
                else:
                    uid = self.store.get("0:1").decode()
                gpu._context(device, "ncclCommInitRank")
                self.comm = job._join(uid, self.size, self.group_rank, self)
            gpu._context(device, f"nccl {kind}")
            nccl = self._nccl_streams.setdefault(device, _LinkStream(gpu, device, "nccl"))
            current = gpu.current_stream(device)
            start = _GpuTime(_time.perf_counter(), (nccl.last, current.last))
            op = _LinkOp(self.global_rank, kind, peer, tensor, device, start, self.comm)
            op.rank_group = self.group_rank
            nccl.last = _Follow(op)  # its end is known once the peer posts
            job._post(op)
            return FakeLinkWork(op, gpu)

    return ProcessGroupNCCL


class _Follow(_GpuTime):
    """When an operation ends (its ``end`` is set once its peer posts)."""

    def __init__(self, op: _LinkOp) -> None:
        super().__init__()
        self.op = op

    def time(self) -> float | None:
        return self.op.end.time()
