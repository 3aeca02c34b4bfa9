"""From the training thread's raw steps to step records: pure, on the sender thread.

The training thread leaves one :data:`RawStep` tuple per finished step (timestamps
only). Here they become rows in the order of ``collectors.schema.STEP_FIELDS``:

* :func:`step_row` computes a step's figures: its time, data wait, compute, and its
  collective figures from whichever sources timed them (a DDP model's allreduce: the
  comm hook's buckets on the CPU clock or on the GPU's, or DDP's own stamps,
  :func:`ddp_comm`; every other collective: ``collectors.collectives``), and the
  step's per-collective split (its ``collectives`` field).
* A step timed with CUDA events waits in :class:`PendingCudaSteps` until the GPU has
  passed all its events (``query()``, never a synchronize), or until a timeout, after
  which its GPU figures are sent as not measured. Nothing is queried while a CUDA graph
  is being captured (``collectors.cuda_events.CAPTURES``): a query then would
  invalidate the user's capture.
* A step's collectives may be timed on two clocks: a collective on device tensors with
  CUDA events, one on host tensors (gloo's, in a GPU job) on the host's clock, which is
  put on the step's GPU timeline by its offset from the step's start on the host (the
  two starts taken as one instant). A collective that could not be timed (its launch is
  None: a device collective with no event pool, whose host-side future completes at
  enqueue; one inside a CUDA graph) makes the step's collective total not measured.
  Each read works on a copy of the step's entries taken before its queries: a
  completion that another thread (gloo's) marks after them counts as still in flight.

Nothing here touches a probe, a socket or a clock of its own: callers pass the time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from collectors.collectives import Call, StepCollectives, by_group, direct_calls
from collectors.cuda_events import CAPTURES, EventPool, seconds_between
from collectors.timeline import comm_figures, intersection, span_comm_figures

if TYPE_CHECKING:
    from collectors.groups import ProcessGroups

#: A step's collectives other than DDP's (``collectors.collectives``): ``(calls,
#: blocked, complete)``: the calls ``[op, launch, done, nbytes, group_size, count,
#: group]``,
#: the intervals ``(start, end)`` the caller was blocked in them, and whether the DDP
#: part is measured or absent (False: a DDP model's timing failed, so the step's total
#: is not known); ``()``: timing them failed (not measured); None: not timed at all.
Direct = "tuple[list[Any], list[Any], bool] | tuple[()] | None"

#: A finished step as the training thread leaves it for the sender thread:
#: (step, t_start, data_wait_s, t_enter, t_exit, samples, buckets, gap_s, cuda_pair,
#: direct, given); ``buckets`` is the comm hook's bucket list, or DDP's own stamps (a
#: tuple, see ``collectors.ddptimer``), or None when a DDP model's allreduce is not
#: timed; ``direct`` is :data:`Direct`; ``given`` what the loop said of the step
#: (``probe.step(tokens=..., flops=...)``: ``(tokens, flops)``), None when nothing. A
#: shorter tuple, from an older caller, has None for what it lacks.
RawStep = tuple[
    int, float, "float | None", float, float, "int | None", "list[Any] | tuple[int, ...] | None",
    "float | None", "tuple[Any, Any] | None",
    "tuple[list[Any], list[Any], bool] | tuple[()] | None",
    "tuple[int | None, float | None] | None",
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


def ddp_span(stamps: tuple[int, ...], t_enter: float, t_exit: float
             ) -> tuple[float, float, float] | None:
    """DDP's stamps (``collectors.ddptimer``) as ``(first launch, last gradient, last
    completion)`` on ``time.perf_counter``'s clock; None when they are unreadable.
    Only for stamps of a synchronized backward that ran in this step (see
    :func:`ddp_comm`)."""
    start_ns, compute_end_ns, end_ns, _, exit_ns = stamps

    def perf(ns: int) -> float:  # time.time_ns's clock to time.perf_counter's
        return t_exit - (exit_ns - ns) / 1e9

    if start_ns <= 0 or end_ns < start_ns:
        return None
    return (perf(start_ns), perf(compute_end_ns) if compute_end_ns > 0 else perf(start_ns),
            perf(end_ns))


def ddp_comm(stamps: tuple[int, ...], t_enter: float, t_exit: float, nbytes: int,
             world: int) -> CommFigures:
    """A step's collective figures from DDP's own stamps (``collectors.ddptimer``)."""
    if not stamps:
        return NO_COLLECTIVE  # no synchronized backward in this step
    span = ddp_span(stamps, t_enter, t_exit)
    if span is None:
        return NOT_MEASURED
    if span[2] < t_enter - 0.001:  # an earlier step's stamps: no allreduce here
        return NO_COLLECTIVE
    return span_comm_figures(span[0], span[1], span[2], nbytes, stamps[3], world)


def _ddp_calls(buckets: list[Any] | tuple[int, ...], gpu_buckets: list[Any] | None,
               t_enter: float, t_exit: float, nbytes: int, world: int, group: Any = None
               ) -> tuple[list[Call], list[tuple[float, float]]]:
    """A DDP model's allreduce in a measured step as calls (``all_reduce`` on ``group``,
    its process group) and its exposed intervals, as :func:`comm_figures` and
    :func:`ddp_comm` count them."""
    if isinstance(buckets, tuple):
        if not buckets:
            return [], []
        span = ddp_span(buckets, t_enter, t_exit)
        if span is None or span[2] < t_enter - 0.001:
            return [], []
        start, last, end = span
        return ([("all_reduce", start, max(start, end), nbytes, world, buckets[3], group)],
                [(max(last, start), end)])
    if gpu_buckets is not None:
        entries = [(float(b[0]), float(b[1]), int(b[2])) for b in gpu_buckets]
    else:
        entries = [(b[0], b[1] if b[1] is not None else t_exit, b[2]) for b in buckets]
    if not entries:
        return [], []
    last_launch = max(b[0] for b in entries)
    return ([("all_reduce", b[0], b[1], b[2], world, 1, group) for b in entries],
            [(max(b[0], last_launch), b[1]) for b in entries if b[1] > last_launch])


class StepContext:
    """What the sender knows that a step's record needs beside its raw step: the model
    FLOPs of a step unless the loop gave its own (``flops``), how to name a process
    group (``groups``: :class:`collectors.groups.ProcessGroups`, None: no split by
    group) and the group a DDP model's allreduce runs on (``ddp_group``)."""

    __slots__ = ("ddp_group", "flops", "groups")

    def __init__(self, flops: float | None = None, groups: ProcessGroups | None = None,
                 ddp_group: Any = None) -> None:
        self.flops = flops
        self.groups = groups
        self.ddp_group = ddp_group


_NO_CONTEXT = StepContext()


def step_row(raw: RawStep, gpu: GpuTimes | None, clock: ClockMap, *, world: int,
             nbytes: int, context: StepContext = _NO_CONTEXT) -> list[Any]:
    """One step record (``STEP_FIELDS`` order) from a raw step.

    ``gpu`` is the step's resolved GPU times when it was timed with CUDA events (else
    None); ``world`` is the collective's size, ``nbytes`` what DDP's timer counts as
    one allreduce (``CommTiming``'s figures); ``context`` the rest
    (:class:`StepContext`).

    ``tokens`` and ``flops`` are what the loop gave (``probe.step``), the FLOPs else the
    context's. The ``groups`` field splits the step's collectives by process group, then
    by collective, when some ran on another group than the default one.

    With direct collectives (``collectors.collectives``) in the step, ``comm_s`` is the
    union of every collective's interval (DDP's included), ``comm_exposed_s`` the part
    the caller spent blocked in them plus DDP's exposed part, ``busbw_Bps`` the sum of
    each collective's bytes times its own nccl-tests factor, over ``comm_s``. The
    ``collectives`` field splits the step by collective: ``{op: [s, bytes, calls,
    busbw_Bps]}`` (``s`` the union of that collective's own intervals), None when no
    collective was measured.
    """
    step, t_start, wait, t_enter, t_exit, samples, buckets, gap, _ = raw[:9]
    direct = raw[9] if len(raw) > 9 else None
    given = raw[10] if len(raw) > 10 else None
    tokens, flops = given if given is not None else (None, None)
    if flops is None:
        flops = context.flops
    namer = context.groups
    by_groups: dict[str, dict[str, list[Any]]] | None = None
    body = t_exit - t_enter
    gpu_s = gpu[0] if gpu is not None else None
    comm: CommFigures = NOT_MEASURED
    gpu_buckets = None
    if gpu is not None:
        if gpu[1] is not None and buckets is not None:
            gpu_buckets = gpu[1]
            comm = comm_figures([tuple(b) for b in gpu_buckets], world)
    elif isinstance(buckets, tuple):
        comm = ddp_comm(buckets, t_enter, t_exit, nbytes, world)
    elif buckets is not None:
        comm = comm_figures(
            [(b[0], b[1] if b[1] is not None else t_exit, b[2]) for b in buckets], world)
    lo, hi = (0.0, gpu_s or 0.0) if gpu is not None else (t_enter, t_exit)
    ddp_ok = comm is not NOT_MEASURED and comm[0] is not None
    exposed_in: float | None = comm[1]
    split: dict[str, list[Any]] | None = None
    if direct is None:  # only a DDP model's allreduce is timed (or nothing)
        if ddp_ok and comm[3]:
            split = {"all_reduce": [comm[0], comm[2], comm[3], comm[5]]}
            if namer is not None:
                g = namer.name(context.ddp_group)
                if g is not None and g != namer.world:
                    by_groups = {g: dict(split)}
    elif not direct or (gpu is not None and gpu_s is None):
        # timing the direct collectives failed, or their GPU events were never read
        if ddp_ok and comm[3]:
            split = {"all_reduce": [comm[0], comm[2], comm[3], comm[5]]}
        comm, exposed_in = NOT_MEASURED, None
    else:
        entries, blocked, complete = direct
        calls = direct_calls(entries, hi)
        ddp_calls, ddp_exposed = _ddp_calls(buckets, gpu_buckets, t_enter, t_exit, nbytes,
                                            world, context.ddp_group) \
            if ddp_ok and buckets is not None else ([], [])
        exposed = intersection([(c[1], c[2]) for c in calls], blocked) + ddp_exposed
        figures = StepCollectives(ddp_calls + calls, exposed, lo, hi)
        split = {row[0]: row[1:] for row in figures.split} or None
        if namer is not None:
            by_groups = by_group(ddp_calls + calls, namer.name, namer.world)
        if not complete or (buckets is not None and not ddp_ok):
            comm, exposed_in = NOT_MEASURED, None  # a part is missing: the total is unknown
        elif calls:
            comm, exposed_in = figures.comm, figures.exposed_in
        elif buckets is None:
            comm, exposed_in = NO_COLLECTIVE, 0.0  # timed, and none ran
    if split is not None and comm[0] is not None and list(split) == ["all_reduce"]:
        split = None  # only allreduces: the step's own comm figures are theirs (schema)
    if gpu_s is not None:
        compute = max(0.0, gpu_s - min(exposed_in or 0.0, gpu_s))
    else:
        compute = max(0.0, body - min(exposed_in or 0.0, body))
    step_s = (t_exit - t_start) + (gap or 0.0)
    return [step, clock.wall(t_start), step_s, wait, compute, gpu_s, *comm, samples, gap,
            split, tokens, flops, by_groups]


#: Words of CUDA's errors about graph capture (``cudaErrorCapturedEvent``, ``...Capture
#: Unsupported``, ``...CaptureInvalidated``): an event recorded in a capture rtop did not
#: see begin can never be read; that costs its step's GPU figures, not CUDA timing.
CAPTURE_ERRORS = ("capturing stream", "stream is capturing", "during capture")


def capture_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of CUDA's errors about a graph capture."""
    text = str(exc).lower()
    return any(w in text for w in CAPTURE_ERRORS)


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


def direct_events(direct: Any) -> list[Any]:
    """The CUDA events among a step's direct collectives (:data:`Direct`)."""
    if not direct:
        return []
    entries, blocked, _ = direct
    return [e for x in entries for e in (x[1], x[2]) if e is not None and not _is_time(e)] \
        + [e for b in blocked for e in b if e is not None and not _is_time(e)]


def host_direct(direct: Any) -> bool:
    """Whether a step's direct collectives were all timed on the host clock."""
    if not direct:
        return True
    entries, blocked, _ = direct
    return all(_is_time(x[1]) and (x[2] is None or _is_time(x[2])) for x in entries) \
        and all(_is_time(b[0]) and _is_time(b[1]) for b in blocked)


def _with_direct(raw: RawStep, direct: Any) -> RawStep:
    """``raw`` with its direct collectives replaced."""
    return (*raw[:9], direct, raw[10] if len(raw) > 10 else None)


class PendingCudaStep:
    """One CUDA-timed step waiting for the GPU: its raw record and when it was queued.

    Once resolved, :attr:`direct` holds its direct collectives (:data:`Direct`) in
    seconds from the step's start event, or ``()`` when they could not be read."""

    __slots__ = ("direct", "queued", "raw")

    def __init__(self, raw: RawStep, queued: float) -> None:
        self.raw = raw
        self.queued = queued
        self.direct: Any = raw[9] if len(raw) > 9 and not raw[9] else ()

    def buckets(self) -> list[Any]:
        """The comm hook's bucket entries of the step (``[launch, done, nbytes]``)."""
        buckets = self.raw[6]
        return buckets if isinstance(buckets, list) else []

    def _snapshot(self) -> tuple[list[Any], Any]:
        """Copies of the step's bucket entries and direct collectives, as they are now
        (another thread may still mark a completion in the originals)."""
        buckets = [list(b) for b in self.buckets()]
        direct = self.raw[9] if len(self.raw) > 9 else None
        if direct:
            entries, blocked, complete = direct
            direct = ([list(x) for x in entries], [tuple(b) for b in blocked], complete)
        return buckets, direct

    def events(self) -> list[Any]:
        """Every CUDA event of the step: its start and end, then each bucket's two, then
        its direct collectives' (launch, completion, and each blocked span's two)."""
        buckets, direct = self._snapshot()
        return self._events(buckets, direct)

    def _events(self, buckets: list[Any], direct: Any) -> list[Any]:
        pair = self.raw[8]
        assert pair is not None
        return [pair[0], pair[1], *bucket_events(buckets), *direct_events(direct)]

    def resolved(self) -> RawStep:
        """The raw step with its direct collectives on the GPU timeline (see
        :attr:`direct`), for :func:`step_row`."""
        if len(self.raw) <= 9:
            return self.raw
        return _with_direct(self.raw, self.direct)

    def resolve(self, pool: EventPool | None,
                on_error: Callable[[BaseException], None] | None = None) -> GpuTimes | None:
        """GPU seconds of the step and its buckets on the GPU timeline, once the GPU has
        passed every event (then the events go back to ``pool``); None until then.

        A CUDA error while reading the events (a sticky error, the driver shutting
        down) is told to ``on_error``; the step is then sent with its GPU figures not
        measured, and its events are dropped, never put back in the pool. An error about
        a graph capture (an event recorded in a capture: :func:`capture_error`) costs
        the step's GPU figures only and is not told.
        """
        buckets, direct = self._snapshot()
        events = self._events(buckets, direct)
        try:
            if not all(e.query() for e in events):
                return None
            start, end = events[0], events[1]
            gpu_s = seconds_between(start, end)
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
            self.direct = self._resolve_direct(direct, start, gpu_s)
        except Exception as exc:
            self.direct = ()
            if on_error is not None and not capture_error(exc):
                on_error(exc)
            return None, None
        if pool is not None:
            pool.release(*events)
        return gpu_s, gpu_buckets

    def _resolve_direct(self, direct: Any, start: Any, gpu_s: float) -> Any:
        """The direct collectives on the GPU timeline (module doc: events, or host times
        put there by their offset from the step's start on the host); ``()`` when one
        could not be timed."""
        if not direct:
            return direct
        entries, blocked, complete = direct
        t_enter = self.raw[3]

        def at(x: Any) -> float:
            return x - t_enter if _is_time(x) else seconds_between(start, x)

        if any(x[1] is None for x in entries) or any(b[0] is None or b[1] is None
                                                     for b in blocked):
            return ()  # a collective (or a wait) that could not be timed
        return (
            [[x[0], at(x[1]), at(x[2]) if x[2] is not None else gpu_s, x[3], x[4], x[5],
              x[6] if len(x) > 6 else None] for x in entries],
            [(at(b[0]), at(b[1])) for b in blocked],
            complete,
        )


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
            with CAPTURES.quiet() as may_query:  # no query while a graph is captured
                resolved = pending.resolve(pool, on_error) if may_query else None
            if resolved is None:
                if not final and now - pending.queued < self.timeout_s:
                    return
                resolved = (None, None)
            queue.popleft()
            yield pending.resolved(), resolved


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
        """``now``'s clock reading of when the GPU entered its current collective (None
        too while a CUDA graph is being captured: nothing is queried then)."""
        with CAPTURES.quiet() as may_query:
            return self._check(bucket_lists, now) if may_query else None

    def _check(self, bucket_lists: list[list[Any]], now: float) -> float | None:
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
              nbytes: int, now: float, final: bool = False,
              context: StepContext = _NO_CONTEXT) -> list[list[Any]]:
        """Take every raw step from ``raws`` (popped from the left) and return the step
        records that can be made now (``context``: see :func:`step_row`); ``final``: the
        last call, nothing waits."""
        rows: list[list[Any]] = []
        while raws:
            raw = raws.popleft()
            if raw[8] is not None:
                self.pending.add(raw, now)
                continue
            buckets = raw[6]
            direct = raw[9] if len(raw) > 9 else None
            if isinstance(buckets, list) and buckets and host_buckets(buckets) is None:
                # CUDA events in a host-timed step: not measured, the events go back
                if pool is not None:
                    pool.release(*bucket_events(buckets))
                raw = (*raw[:6], None, *raw[7:])
                if direct:  # and the step's total with them
                    direct = (direct[0], direct[1], False)
                    raw = _with_direct(raw, direct)
            if direct and not host_direct(direct):
                if pool is not None:
                    pool.release(*direct_events(direct))
                raw = _with_direct(raw, ())
            self._row(rows, raw, None, world, nbytes, context)
        if self.pending:
            for raw, gpu in self.pending.ready(now, pool, final, self.on_error):
                self._row(rows, raw, gpu, world, nbytes, context)
        return rows

    def _row(self, rows: list[list[Any]], raw: RawStep, gpu: GpuTimes | None, world: int,
             nbytes: int, context: StepContext) -> None:
        try:
            rows.append(step_row(raw, gpu, self.clock, world=world, nbytes=nbytes,
                                 context=context))
        except Exception as exc:
            self.unreadable += 1
            if self.on_error is not None:
                self.on_error(exc)
