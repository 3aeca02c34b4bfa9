"""From the training thread's raw steps to step records: pure, on the sender thread.

The training thread leaves one :data:`RawStep` tuple per finished step (timestamps
only). Here they become rows in the order of ``collectors.schema.STEP_FIELDS``:

* :func:`step_row` computes a step's figures: its time, data wait, compute, and its
  collective figures from whichever source timed them (the comm hook's buckets on the
  CPU clock or on the GPU's, or DDP's own stamps: :func:`ddp_comm`).
* A step timed with CUDA events waits in :class:`PendingCudaSteps` until the GPU has
  passed all its events (``query()``, never a synchronize), or until a timeout, after
  which its GPU figures are sent as not measured.

Nothing here touches a probe, a socket or a clock of its own: callers pass the time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from collectors.cuda_events import EventPool, seconds_between
from collectors.timeline import comm_figures, span_comm_figures

#: A finished step as the training thread leaves it for the sender thread:
#: (step, t_start, data_wait_s, t_enter, t_exit, samples, buckets, gap_s, cuda_pair);
#: ``buckets`` is the comm hook's bucket list, or DDP's own stamps (a tuple, see
#: ``collectors.ddptimer``), or None when the collectives are not timed.
RawStep = tuple[
    int, float, "float | None", float, float, "int | None", "list[Any] | tuple[int, ...] | None",
    "float | None", "tuple[Any, Any] | None",
]

#: A step's figures on the GPU: ``(gpu_s, buckets)``, the buckets as ``[launch, done,
#: nbytes]`` in seconds from the step's start event; ``(None, None)``: not measured.
GpuTimes = tuple["float | None", "list[Any] | None"]

#: ``(comm_s, comm_exposed_s, comm_bytes, comm_calls, algbw_Bps, busbw_Bps)``.
CommFigures = tuple[Any, ...]

#: The collectives were not timed (or their timing could not be read): missing, not zero.
NOT_MEASURED: CommFigures = (None,) * 6
#: The step ran no collective (``no_sync``): measured, and zero.
NO_COLLECTIVE: CommFigures = (0.0, 0.0, 0, 0, None, None)


class ClockMap:
    """Maps ``time.perf_counter()`` readings (the training thread's) to wall-clock time.

    :meth:`refresh` re-anchors it (the sender does every 10 s, so the wall clock's
    adjustments are followed without a step ever jumping).
    """

    def __init__(self) -> None:
        self.wall0 = time.time()
        self.pc0 = time.perf_counter()

    def refresh(self) -> None:
        """Anchor the mapping at the current time."""
        self.wall0, self.pc0 = time.time(), time.perf_counter()

    def wall(self, pc: float) -> float:
        """The wall-clock time of a ``time.perf_counter()`` reading."""
        return self.wall0 + (pc - self.pc0)


def ddp_comm(stamps: tuple[int, ...], t_enter: float, t_exit: float, nbytes: int,
             world: int) -> CommFigures:
    """A step's collective figures from DDP's own stamps (``collectors.ddptimer``)."""
    if not stamps:
        return NO_COLLECTIVE  # no synchronized backward in this step
    start_ns, compute_end_ns, end_ns, calls, exit_ns = stamps
    if start_ns <= 0 or end_ns < start_ns:
        return NOT_MEASURED

    def perf(ns: int) -> float:  # time.time_ns's clock to time.perf_counter's
        return t_exit - (exit_ns - ns) / 1e9

    if perf(end_ns) < t_enter - 0.001:  # an earlier step's stamps: no allreduce here
        return NO_COLLECTIVE
    return span_comm_figures(
        perf(start_ns), perf(compute_end_ns) if compute_end_ns > 0 else perf(start_ns),
        perf(end_ns), nbytes, calls, world,
    )


def step_row(raw: RawStep, gpu: GpuTimes | None, clock: ClockMap, *, world: int,
             nbytes: int) -> list[Any]:
    """One step record (``STEP_FIELDS`` order) from a raw step.

    ``gpu`` is the step's resolved GPU times when it was timed with CUDA events (else
    None); ``world`` is the collective's size, ``nbytes`` what DDP's timer counts as
    one allreduce (``CommTiming``'s figures).
    """
    step, t_start, wait, t_enter, t_exit, samples, buckets, gap, _ = raw
    body = t_exit - t_enter
    gpu_s = gpu[0] if gpu is not None else None
    comm: CommFigures = NOT_MEASURED
    if gpu is not None:
        if gpu[1] is not None and buckets is not None:
            comm = comm_figures([tuple(b) for b in gpu[1]], world)
    elif isinstance(buckets, tuple):
        comm = ddp_comm(buckets, t_enter, t_exit, nbytes, world)
    elif buckets is not None:
        comm = comm_figures(
            [(b[0], b[1] if b[1] is not None else t_exit, b[2]) for b in buckets], world)
    exposed = comm[1]
    if gpu_s is not None:
        compute = max(0.0, gpu_s - (exposed or 0.0))
    else:
        compute = max(0.0, body - min(exposed or 0.0, body))
    step_s = (t_exit - t_start) + (gap or 0.0)
    return [step, clock.wall(t_start), step_s, wait, compute, gpu_s, *comm, samples, gap]


def _is_time(value: Any) -> bool:
    """A host timestamp (the comm hook's ``perf_counter`` reading), not an event."""
    return isinstance(value, float)


def host_buckets(buckets: list[Any]) -> list[Any] | None:
    """A host-timed step's bucket entries, or None when any entry is not made of host
    timestamps (CUDA events from a step that began before ``watch``, or from a pool
    that failed mid-step): its collectives are then not measured."""
    for b in buckets:
        if not _is_time(b[0]) or not (b[1] is None or _is_time(b[1])):
            return None
    return buckets


def bucket_events(buckets: list[Any]) -> list[Any]:
    """The CUDA events among a step's bucket entries (to give back to the pool)."""
    return [e for b in buckets for e in (b[0], b[1])
            if e is not None and not _is_time(e)]


class PendingCudaStep:
    """One CUDA-timed step waiting for the GPU: its raw record and when it was queued."""

    __slots__ = ("queued", "raw")

    def __init__(self, raw: RawStep, queued: float) -> None:
        self.raw = raw
        self.queued = queued

    def buckets(self) -> list[Any]:
        """The comm hook's bucket entries of the step (``[launch, done, nbytes]``)."""
        buckets = self.raw[6]
        return buckets if isinstance(buckets, list) else []

    def events(self) -> list[Any]:
        """Every CUDA event of the step: its start and end, then each bucket's two."""
        pair = self.raw[8]
        assert pair is not None
        return [pair[0], pair[1], *bucket_events(self.buckets())]

    def resolve(self, pool: EventPool | None,
                on_error: Callable[[BaseException], None] | None = None) -> GpuTimes | None:
        """GPU seconds of the step and its buckets on the GPU timeline, once the GPU has
        passed every event (then the events go back to ``pool``); None until then.

        A CUDA error while reading the events (a sticky error, the driver shutting
        down) is told to ``on_error``; the step is then sent with its GPU figures not
        measured, and its events are dropped, never put back in the pool.
        """
        events = self.events()
        try:
            if not all(e.query() for e in events):
                return None
            start, end = events[0], events[1]
            gpu_s = seconds_between(start, end)
            buckets = self.buckets()
            gpu_buckets: list[Any] | None = None
            if all(b[0] is not None and not _is_time(b[0])
                   and (b[1] is None or not _is_time(b[1])) for b in buckets):
                gpu_buckets = [
                    [
                        seconds_between(start, b[0]),
                        seconds_between(start, b[1]) if b[1] is not None else gpu_s,
                        b[2],
                    ]
                    for b in buckets
                ]
        except Exception as exc:
            if on_error is not None:
                on_error(exc)
            return None, None
        if pool is not None:
            pool.release(*events)
        return gpu_s, gpu_buckets


class PendingCudaSteps:
    """CUDA-timed steps waiting for the GPU, oldest first.

    Steps leave in order: :meth:`ready` yields the oldest ones whose events have all
    completed, and stops at the first that has not, unless it has waited longer than
    ``timeout_s`` (its GPU figures are then not measured: ``(None, None)``) or this is
    the final drain. Each step is resolved on its own (:meth:`PendingCudaStep.resolve`),
    so one step's outcome never depends on another's, and a CUDA error reading one
    step's events costs that step's GPU figures only.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._queue: deque[PendingCudaStep] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, raw: RawStep, now: float) -> None:
        """Queue a step whose ``cuda_pair`` is set; ``now`` on the caller's monotonic clock."""
        self._queue.append(PendingCudaStep(raw, now))

    def oldest(self) -> PendingCudaStep | None:
        """The step the GPU has been slowest to finish, if any is waiting."""
        return self._queue[0] if self._queue else None

    def ready(self, now: float, pool: EventPool | None, final: bool = False,
              on_error: Callable[[BaseException], None] | None = None,
              ) -> Iterator[tuple[RawStep, GpuTimes]]:
        """Yield ``(raw, gpu_times)`` for each step that can be sent now, oldest first."""
        queue = self._queue
        while queue:
            pending = queue[0]
            resolved = pending.resolve(pool, on_error)
            if resolved is None:
                if not final and now - pending.queued < self.timeout_s:
                    return
                resolved = (None, None)
            queue.popleft()
            yield pending.raw, resolved


class CollectiveWatch:
    """Whether the GPU is inside a collective, and since when (for the heartbeat).

    On a GPU the host rarely waits in the comm hook: a hung allreduce shows on the host
    as "compute" or "data" while the GPU sits in the collective. The comm hook's bucket
    events tell: the GPU has passed a bucket's launch event but not its completion
    event. :meth:`check` looks at the buckets in launch order (the oldest waiting
    step's, then the step in progress) and returns when it first saw the GPU inside
    the same collective, on the caller's clock; None when it is not in one.
    """

    def __init__(self) -> None:
        self._event: Any = None
        self._since = 0.0

    def check(self, bucket_lists: list[list[Any]], now: float) -> float | None:
        """``now``'s clock reading of when the GPU entered its current collective."""
        try:
            for buckets in bucket_lists:
                for b in list(buckets):
                    launch, done = b[0], b[1]
                    if launch is None or _is_time(launch):
                        return self._none()  # timed on the host: the host phase says it
                    if done is not None and not _is_time(done) and done.query():
                        continue  # this collective finished on the GPU
                    if not launch.query():
                        return self._none()  # the GPU has not reached it yet
                    if self._event is not launch:
                        self._event, self._since = launch, now
                    return self._since
        except Exception:  # a CUDA error: the resolver reports it
            return self._none()
        return self._none()

    def _none(self) -> float | None:
        """Not in a collective: forget the one seen before."""
        self._event = None
        return None


class StepRecords:
    """Raw steps in, step records out, in the order the steps finished.

    A step timed on the host becomes a record at once; a CUDA-timed one waits in a
    :class:`PendingCudaSteps` (``timeout_s``) and follows once resolved. ``clock`` maps
    the training thread's ``perf_counter`` to wall-clock time. ``on_error`` is told of
    any error making a record (a CUDA error reading events, a malformed raw step): the
    step is then sent with what could be measured, or, if nothing could, skipped and
    counted in :attr:`unreadable`.
    """

    def __init__(self, timeout_s: float, clock: ClockMap | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.clock = clock or ClockMap()
        self.pending = PendingCudaSteps(timeout_s)
        self.on_error = on_error
        #: Raw steps that could not be made into a record at all.
        self.unreadable = 0

    def drain(self, raws: deque[RawStep], pool: EventPool | None, *, world: int,
              nbytes: int, now: float, final: bool = False) -> list[list[Any]]:
        """Take every raw step from ``raws`` (popped from the left) and return the step
        records that can be made now; ``final``: the last call, nothing waits."""
        rows: list[list[Any]] = []
        while raws:
            raw = raws.popleft()
            if raw[8] is not None:
                self.pending.add(raw, now)
                continue
            buckets = raw[6]
            if isinstance(buckets, list) and buckets and host_buckets(buckets) is None:
                # CUDA events in a host-timed step: not measured, the events go back
                if pool is not None:
                    pool.release(*bucket_events(buckets))
                raw = (*raw[:6], None, *raw[7:])
            self._row(rows, raw, None, world, nbytes)
        if self.pending:
            for raw, gpu in self.pending.ready(now, pool, final, self.on_error):
                self._row(rows, raw, gpu, world, nbytes)
        return rows

    def _row(self, rows: list[list[Any]], raw: RawStep, gpu: GpuTimes | None, world: int,
             nbytes: int) -> None:
        try:
            rows.append(step_row(raw, gpu, self.clock, world=world, nbytes=nbytes))
        except Exception as exc:
            self.unreadable += 1
            if self.on_error is not None:
                self.on_error(exc)
