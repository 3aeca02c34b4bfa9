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
from collections.abc import Iterator
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


class PendingCudaStep:
    """One CUDA-timed step waiting for the GPU: its raw record and when it was queued."""

    __slots__ = ("queued", "raw")

    def __init__(self, raw: RawStep, queued: float) -> None:
        self.raw = raw
        self.queued = queued

    def events(self) -> list[Any]:
        """Every CUDA event of the step: its start and end, then each bucket's two."""
        pair = self.raw[8]
        assert pair is not None
        buckets = self.raw[6] if isinstance(self.raw[6], list) else []  # the comm hook's
        return [pair[0], pair[1]] + [e for b in buckets for e in (b[0], b[1])]

    def resolve(self, pool: EventPool | None) -> GpuTimes | None:
        """GPU seconds of the step and its buckets on the GPU timeline, once the GPU has
        passed every event (then the events go back to ``pool``); None until then."""
        events = self.events()
        if any(e is not None and not e.query() for e in events):
            return None
        start, end = events[0], events[1]
        buckets = self.raw[6] if isinstance(self.raw[6], list) else []
        try:
            gpu_s = seconds_between(start, end)
            gpu_buckets = [
                [
                    seconds_between(start, b[0]),
                    seconds_between(start, b[1]) if b[1] is not None else gpu_s,
                    b[2],
                ]
                for b in buckets
            ]
        finally:
            if pool is not None:
                pool.release(*events)
        return gpu_s, gpu_buckets


class PendingCudaSteps:
    """CUDA-timed steps waiting for the GPU, oldest first.

    Steps leave in order: :meth:`ready` yields the oldest ones whose events have all
    completed, and stops at the first that has not, unless it has waited longer than
    ``timeout_s`` (its GPU figures are then not measured: ``(None, None)``) or this is
    the final drain. Each step is resolved on its own (:meth:`PendingCudaStep.resolve`),
    so one step's outcome never depends on another's.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._queue: deque[PendingCudaStep] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, raw: RawStep, now: float) -> None:
        """Queue a step whose ``cuda_pair`` is set; ``now`` on the caller's monotonic clock."""
        self._queue.append(PendingCudaStep(raw, now))

    def ready(self, now: float, pool: EventPool | None,
              final: bool = False) -> Iterator[tuple[RawStep, GpuTimes]]:
        """Yield ``(raw, gpu_times)`` for each step that can be sent now, oldest first."""
        queue = self._queue
        while queue:
            pending = queue[0]
            resolved = pending.resolve(pool)
            if resolved is None:
                if not final and now - pending.queued < self.timeout_s:
                    return
                resolved = (None, None)
            queue.popleft()
            yield pending.raw, resolved


class StepRecords:
    """Raw steps in, step records out, in the order the steps finished.

    A step timed on the host becomes a record at once; a CUDA-timed one waits in a
    :class:`PendingCudaSteps` (``timeout_s``) and follows once resolved. ``clock`` maps
    the training thread's ``perf_counter`` to wall-clock time.
    """

    def __init__(self, timeout_s: float, clock: ClockMap | None = None) -> None:
        self.clock = clock or ClockMap()
        self.pending = PendingCudaSteps(timeout_s)

    def drain(self, raws: deque[RawStep], pool: EventPool | None, *, world: int,
              nbytes: int, now: float, final: bool = False) -> list[list[Any]]:
        """Take every raw step from ``raws`` (popped from the left) and return the step
        records that can be made now; ``final``: the last call, nothing waits."""
        rows: list[list[Any]] = []
        while raws:
            raw = raws.popleft()
            if raw[8] is not None:
                self.pending.add(raw, now)
            else:
                rows.append(step_row(raw, None, self.clock, world=world, nbytes=nbytes))
        if self.pending:
            for raw, gpu in self.pending.ready(now, pool, final):
                rows.append(step_row(raw, gpu, self.clock, world=world, nbytes=nbytes))
        return rows
