"""Every collective timed, whoever calls it: FSDP2's, FSDP1's, a user's own.

Where it hooks, and why there. Every collective function of ``torch.distributed``
(``all_reduce``, ``broadcast``, ``all_gather_single`` and its old name
``all_gather_into_tensor``, ``reduce_scatter_single`` and ``reduce_scatter_tensor``,
``all_to_all_single``, the list forms, the coalesced forms) ends in one method of the
group's C++ ``ProcessGroup`` (``group.allreduce``, ``group.all_gather_single``,
``group.reduce_scatter_single``, ``group.alltoall_base``, ...), whatever Python name
the caller used: FSDP2 in torch 2.13 calls ``dist.all_gather_single`` and
``dist.reduce_scatter_single``, FSDP1 ``dist.all_gather_single`` (``dist.all_gather``
on CPU) and ``dist.reduce_scatter_single``. So, while a probe watches, rtop replaces
those methods on the ``ProcessGroup`` class with thin wrappers (:data:`METHODS`), and
``Work.wait`` with one that notes how long the caller was blocked; :func:`release`
puts the originals back. Nothing else is touched and nothing synchronises:

* at the call, the wrapper counts the bytes (the nccl-tests convention: the buffer of
  an allreduce or broadcast, the full output of an all-gather, the full input of a
  reduce-scatter, the input of an all-to-all) and marks the launch. Which clock marks
  it depends on where the collective runs (:func:`on_device`): one a device backend
  runs (NCCL's) with a pooled CUDA event on the watched model's device, recorded on the
  caller's current stream (``collectors.cuda_events``, resolved later by the sender
  thread); one the host runs (gloo's, in a CPU job or a GPU one, on CPU tensors or
  CUDA ones) with ``time.perf_counter()``: a CUDA event marks a point of a stream, and
  a host collective's completion is no point of any stream. A device
  collective with no event pool (CUDA timing off after a CUDA error, a model whose
  parameters are on the CPU) is not measured: NCCL's futures complete at enqueue, so
  the host would read ~0 (its entry's launch is None, and the step's collective figures
  are then None, never ~0);
* a callback on the work's future marks the completion, as rtop's DDP comm hook
  does: on the host when gloo's thread finishes it, on GPU an event that the GPU
  passes once the collective is done (the future runs its callbacks on a stream that
  waits for it). On the host a synchronous call (``async_op=False``:
  ``torch.distributed`` waits on the work as soon as the group returns it) is marked
  complete when that ``wait()`` returns instead: a future callback runs on gloo's
  thread, and handing it the GIL costs several microseconds a call. A synchronous
  device collective returns no work at all (NCCL since torch 2.12: it ran on the
  caller's current stream): an event recorded on that stream right after it marks its
  completion, and if that stream is the step's own (the one the step's events are
  recorded on), the whole collective was exposed: the step's stream ran nothing else;
* the step's stream waiting for a collective is blocked time: ``Work.wait()`` on that
  stream (events before and after: the span in which it waits) and
  ``torch.cuda.Stream.wait_event`` called on it (FSDP2 waits for its all-gathers and
  reduce-scatters that way, on events its own streams recorded); on the host, around
  ``Work.wait()`` and the call itself (a synchronous gloo collective may run inside it).
  A wait on another stream (FSDP2's all-gather stream waiting for its copy-in) is not
  the step's;
* with old-style coalescing (``_coalescing_manager(device=...)``: the group's
  ``_start_coalescing`` ... ``_end_coalescing``), the collectives called in between are
  only queued, and their works complete at once; the group is launched by
  ``_end_coalescing``, so each of them is marked complete with the work it returns;
* inside a CUDA graph capture nothing is recorded (``collectors.cuda_events``); a
  collective launched then is in the graph, and a step that replays that graph says
  its collectives are not measured.

A collective's time is its launch-to-completion interval; the step's ``comm_s`` is
the union of every interval (DDP's buckets included); ``comm_exposed_s`` is the part
of that union during which the caller was blocked (the intersection with the blocked
intervals) plus DDP's own exposed part: an asynchronous collective that completes
while the training thread computes is overlapped, not exposed.

What is not seen here: collectives launched from C++ (DDP's reducer: timed by
``collectors.ddptimer`` or ``collectors.commhook``; functional collectives,
``torch.ops._c10d_functional``, as traced by ``torch.compile``), point-to-point
``send``/``recv``, and a backend's own methods called directly
(``group._get_backend(device).allreduce(...)``). A collective that a DDP model's comm
hook launches is DDP's (already timed there) and is not counted twice: while a DDP
model's allreduce is timed, a call made from inside one of its registered comm hooks
(found in the caller's frames) is left alone.

Costs on the training thread: nothing while no probe watches (the class holds torch's
own methods); a few microseconds per collective call and per ``wait()`` while one
does. Every wrapper guards rtop's part (``collectors.guard``: points
``collectives.launch``, ``collectives.done``, ``collectives.wait``): an error there
turns this timing off for the rest of the run, and the collective runs as it would
have.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from collectors.cuda_events import CAPTURES
from collectors.schema import COLLECTIVE_OPS
from collectors.timeline import merged, union_length

if TYPE_CHECKING:
    from collectors.handover import CommTiming
    from collectors.probe import Probe

log = logging.getLogger("collectors")

#: ``ProcessGroup`` method -> (collective, the positional argument whose tensors are
#: counted, its keyword names, multiplier of those bytes by the group's size). Bytes
#: follow nccl-tests (``src/*.cu``): an allreduce, broadcast or reduce moves its
#: buffer; an all-gather its whole output (count x ranks); a reduce-scatter its whole
#: input; an all-to-all its input buffer; a gather or scatter its root's full buffer.
METHODS: Final[dict[str, tuple[str, int, tuple[str, ...], bool]]] = {
    "allreduce": ("all_reduce", 0, ("tensors", "tensor"), False),
    "allreduce_coalesced": ("all_reduce", 0, ("tensors",), False),
    "broadcast": ("broadcast", 0, ("tensors", "tensor"), False),
    "reduce": ("reduce", 0, ("tensors", "tensor"), False),
    "all_gather_single": ("all_gather", 0, ("output",), False),
    "_allgather_base": ("all_gather", 0, ("output",), False),
    "allgather": ("all_gather", 0, ("output_tensors",), False),
    "allgather_coalesced": ("all_gather", 0, ("output_lists",), False),
    "allgather_into_tensor_coalesced": ("all_gather", 0, ("outputs",), False),
    "all_gather_single_coalesced": ("all_gather", 0, ("outputs",), False),
    "reduce_scatter_single": ("reduce_scatter", 1, ("inputTensor",), False),
    "_reduce_scatter_base": ("reduce_scatter", 1, ("inputTensor",), False),
    "reduce_scatter": ("reduce_scatter", 1, ("input_tensors",), False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1, ("inputs",), False),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1, ("inputs",), False),
    "alltoall_base": ("all_to_all", 1, ("input",), False),
    "all_to_all_single": ("all_to_all", 1, ("input",), False),
    "alltoall": ("all_to_all", 1, ("input_tensors",), False),
    "gather": ("gather", 1, ("input_tensors",), True),
    "scatter": ("scatter", 0, ("output_tensors",), True),
    "barrier": ("barrier", -1, (), False),
}

#: The collectives, in the order the UI and the report list them.
OPS: Final = COLLECTIVE_OPS

#: A step keeps at most this many collective calls and blocked intervals.
MAX_CALLS_PER_STEP = 4096
#: How far up the caller's frames a DDP comm hook is looked for.
HOOK_FRAMES = 12


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` over ``n`` ranks: ``busbw = algbw x
    factor``; 2(n-1)/n for an allreduce, (n-1)/n for an all-gather, reduce-scatter,
    all-to-all, gather and scatter, 1 for a broadcast and a reduce; 0 for one rank
    (nothing crosses a link) and for a barrier (no bytes)."""
    if n < 2 or op == "barrier":
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n


#: Backend names whose collectives run on a device (for a barrier, which has no tensor).
DEVICE_BACKENDS: Final = ("nccl", "xccl", "hccl", "rccl")
#: Backend names whose collectives run on the host, whatever their tensors (gloo's on
#: CUDA tensors included: its own threads copy them and complete the work).
HOST_BACKENDS: Final = ("gloo", "mpi")


def first_tensor(x: Any, depth: int = 0) -> Any:
    """The first tensor of ``x`` (a tensor, or a (nested) list of them), or None."""
    if getattr(x, "numel", None) is not None:
        return x
    if depth < 2 and isinstance(x, (list, tuple)):
        for t in x:
            found = first_tensor(t, depth + 1)
            if found is not None:
                return found
    return None


def on_device(x: Any, group: Any) -> bool:
    """Whether a collective on ``x`` runs on a device, its completion a point of a stream
    rather than of the host: its first tensor is not on the CPU and the group's backend
    for that tensor's device is not a host one (gloo, MPI); with no tensor (a barrier),
    whether the group's backend is a device one (NCCL)."""
    t = first_tensor(x)
    try:
        if t is None:
            name = str(group._get_backend_name()).lower()
            return any(b in name for b in DEVICE_BACKENDS)
        if str(t.device.type) == "cpu":
            return False
        try:
            name = str(group._get_backend(t.device).name()).lower()
        except Exception:  # no backend registered for that device type: the group's own
            name = str(group._get_backend_name()).lower()
    except Exception:
        return t is not None
    return not any(h in name for h in HOST_BACKENDS)


def tensor_bytes(x: Any, depth: int = 0) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list of them."""
    numel = getattr(x, "numel", None)
    if numel is not None:
        return int(numel()) * int(x.element_size())
    if depth < 2 and isinstance(x, (list, tuple)):
        return sum(tensor_bytes(t, depth + 1) for t in x)
    return 0


# ---- what a step's collectives add up to (pure; on the sender thread) ----------------

#: One collective in a step: ``(op, start, end, nbytes, group_size, count, group)``;
#: ``count`` is how many calls it stands for (DDP's timer gives one span for all its
#: buckets), ``group`` the ``ProcessGroup`` it ran on (None: not known).
Call = tuple[str, float, float, int, int, int, Any]


def by_op(calls: Sequence[Call]) -> list[list[Any]]:
    """``calls`` split by collective, in :data:`OPS`' order: one ``[op, s, bytes, calls,
    busbw_Bps]`` per collective that ran, ``s`` the union of its own intervals."""
    ops: dict[str, list[Call]] = {}
    for c in calls:
        ops.setdefault(c[0], []).append(c)
    out: list[list[Any]] = []
    for op in sorted(ops, key=lambda o: (OPS.index(o) if o in OPS else len(OPS), o)):
        cs = ops[op]
        s = union_length((c[1], c[2]) for c in cs)
        b = sum(c[3] * bus_factor(c[0], c[4]) for c in cs)
        out.append([op, s, sum(c[3] for c in cs), sum(c[5] for c in cs),
                    b / s if s > 0 and b > 0 else None])
    return out


def by_group(calls: Sequence[Call], name: Callable[[Any], str | None], world: str | None
             ) -> dict[str, dict[str, list[Any]]] | None:
    """``calls`` split by the process group they ran on (named by ``name``), then by
    collective (:func:`by_op`): ``{group: {op: [s, bytes, calls, busbw_Bps]}}``; None when
    every one ran on the default group ``world`` (or on no known group)."""
    groups: dict[str, list[Call]] = {}
    for c in calls:
        g = name(c[6]) if c[6] is not None else None
        if g is not None:
            groups.setdefault(g, []).append(c)
    if not groups or set(groups) <= {world}:
        return None
    return {g: {row[0]: row[1:] for row in by_op(cs)} for g, cs in groups.items()}


class StepCollectives:
    """A step's collectives in figures: ``comm`` (``(comm_s, comm_exposed_s,
    comm_bytes, comm_calls, algbw_Bps, busbw_Bps)``), ``exposed_in`` (the exposed time
    inside ``[lo, hi]``, the step body, which compute excludes) and ``split`` (one
    ``[op, s, bytes, calls, busbw_Bps]`` per collective that ran, ``s`` the union of
    its own intervals)."""

    __slots__ = ("comm", "exposed_in", "split")

    def __init__(self, calls: Sequence[Call], exposed: Iterable[tuple[float, float]],
                 lo: float, hi: float) -> None:
        intervals = [(c[1], c[2]) for c in calls]
        comm_s = union_length(intervals)
        exp = merged(exposed)
        exposed_s = sum(e - s for s, e in exp)
        self.exposed_in = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in exp)
        nbytes = sum(c[3] for c in calls)
        bus = sum(c[3] * bus_factor(c[0], c[4]) for c in calls)
        algbw = nbytes / comm_s if comm_s > 0 and nbytes > 0 else None
        busbw = bus / comm_s if comm_s > 0 and bus > 0 else None
        self.comm: tuple[Any, ...] = (comm_s, min(exposed_s, comm_s), nbytes,
                                      sum(c[5] for c in calls), algbw, busbw)
        self.split: list[list[Any]] = by_op(calls)


def direct_calls(entries: Sequence[Sequence[Any]], end: float) -> list[Call]:
    """The step's direct collective entries (``[op, launch, done, nbytes, group_size,
    count, group]``, times on one clock; ``group`` absent from an older entry) as calls;
    one still in flight ends at ``end``."""
    return [(str(e[0]), float(e[1]), float(e[2]) if e[2] is not None else end, int(e[3]),
             int(e[4]), int(e[5]), e[6] if len(e) > 6 else None) for e in entries]


# ---- on the training thread: the wrappers -------------------------------------------

class _Installed:
    """What this process's ``ProcessGroup`` and ``Work`` classes hold of rtop's: the
    original methods, and the probe the wrappers report to (None: they only call the
    original). One per process, like the classes it patches."""

    def __init__(self) -> None:
        self.probe: Probe | None = None
        self.originals: dict[tuple[Any, str], Any] = {}
        self.wrappers: dict[tuple[Any, str], Any] = {}
        #: ``(work, entry)`` of the last synchronous collective on CPU, until the
        #: ``wait()`` that ``torch.distributed`` calls on it marks its completion.
        self.waiting: tuple[Any, list[Any]] | None = None
        #: Works of host collectives in a GPU job (gloo's): their ``wait()`` blocks the
        #: host, so it is timed on the host's clock.
        self.host_works: weakref.WeakSet[Any] = weakref.WeakSet()
        #: Groups between ``_start_coalescing`` and ``_end_coalescing`` (by id): the
        #: collectives queued there, ``(entry, event pool or None)``.
        self.coalescing: dict[int, list[tuple[list[Any], Any]]] = {}


_STATE = _Installed()


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) has no probe of its own: the wrappers it
    # inherits only call torch's methods.
    _STATE.probe = None
    _STATE.waiting = None
    _STATE.coalescing = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def installed() -> bool:
    """Whether rtop's wrappers are on the ``ProcessGroup`` and ``Work`` classes now."""
    return bool(_STATE.wrappers)


def _hook_codes(comm: CommTiming) -> frozenset[Any] | None:
    """The code of the watched DDP model's comm hooks while its allreduce is timed
    there (a collective they launch is DDP's own), else None."""
    ref = comm.ddp_ref
    if ref is None or not comm.ddp_measured:
        return None
    model = ref()
    hooks = getattr(model, "_comm_hooks", None) if model is not None else None
    if not hooks:
        return None
    cached = comm.hook_codes
    if cached is not None and cached[0] == id(hooks) and cached[1] == len(hooks):
        return cached[2]
    codes = set()
    for hook, _ in hooks:
        fn = getattr(hook, "func", hook)  # a functools.partial: its function
        code = getattr(fn, "__code__", None) or getattr(
            vars(type(fn)).get("__call__"), "__code__", None)  # a callable object
        if code is not None:
            codes.add(code)
    frozen = frozenset(codes)
    comm.hook_codes = (id(hooks), len(hooks), frozen)
    return frozen


def _inside(codes: frozenset[Any]) -> bool:
    """Whether one of the callers (up to ``HOOK_FRAMES`` up) runs one of ``codes``."""
    frame: Any = sys._getframe(3)
    for _ in range(HOOK_FRAMES):
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


#: What :func:`_launch` hands to :func:`_launched`: the entry, the host clock at the
#: call, the event pool that timed it (None: the host's clock), the stream its launch
#: was recorded on, whether the call is synchronous, and whether it is timed at all.
Launch = tuple[list[Any], float, Any, Any, bool, bool]


def _launch(probe: Probe, comm: CommTiming, group: Any, op: str, pos: int,
            keys: tuple[str, ...], times_size: bool, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Launch | None:
    """Before a collective is launched: its entry (appended to the step's) and how it
    is timed (:data:`Launch`); None when it is not counted (DDP's own)."""
    t = time.perf_counter()
    codes = _hook_codes(comm)
    if codes and _inside(codes):
        return None
    x = None
    if pos >= 0:
        x = args[pos] if len(args) > pos else next(
            (kwargs[k] for k in keys if k in kwargs), None)
    nbytes = tensor_bytes(x) if x is not None else 0
    size = int(group.size())
    if times_size:
        nbytes *= size
    device = on_device(x, group)
    cuda = probe.cuda if device else None
    stream = None
    launch: Any = t
    if device:
        if CAPTURES.busy():
            CAPTURES.note_comm()  # launched while a CUDA graph captures: it is in the graph
        if cuda is not None:
            stream = cuda.stream()
            launch = cuda.record(stream)  # None while a graph is captured
        else:  # a device collective timed on the host would read ~0: not measured
            launch = None
    entry: list[Any] = [op, launch, None, nbytes, size, 1, group]
    calls = comm.calls
    if calls is not None and len(calls) < MAX_CALLS_PER_STEP:
        calls.append(entry)
    opts = kwargs.get("opts", args[-1] if args else None)
    return (entry, t, cuda, stream, getattr(opts, "asyncOp", True) is False,
            launch is not None)


def _main(cuda: Any, stream: Any) -> bool:
    """Whether ``stream`` is the step's own (its waits are the step's exposed time)."""
    main = cuda.step_stream
    return main is None or stream == main


def _launched(comm: CommTiming, entry: list[Any], t0: float, cuda: Any, stream: Any,
              sync: bool, timed: bool, group: Any, work: Any) -> None:
    """After the launch (see the module doc): on the host the call itself was blocked
    time and a synchronous call completes when its ``wait()`` returns; a synchronous
    device collective that returned no work completed on the caller's stream; inside
    old-style coalescing the completion waits for the group's work; otherwise the
    work's future marks the completion."""
    if not timed:
        return
    if cuda is None:  # the host's clock
        t1 = time.perf_counter()
        blocked = comm.blocked
        if len(blocked) < MAX_CALLS_PER_STEP:
            blocked.append((t0, t1))
        if work is not None and _STATE.probe is not None and _STATE.probe.cuda is not None:
            _STATE.host_works.add(work)  # in a GPU job: its wait() is the host's too
    queued = _STATE.coalescing.get(id(group))
    if queued is not None:  # launched with the group, at _end_coalescing
        queued.append((entry, cuda))
        return
    if cuda is None:
        if sync and work is not None:
            before, _STATE.waiting = _STATE.waiting, (work, entry)
            if before is not None:  # never waited on: its future says when it ended
                _complete_later(comm, before[1], None, before[0])
            return
    elif work is None:  # ran on the caller's stream (a synchronous NCCL collective)
        _done_on_stream(comm, [entry], cuda, stream)
        return
    _complete_later(comm, entry, cuda, work)


def _done_on_stream(comm: CommTiming, entries: list[list[Any]], cuda: Any,
                    stream: Any) -> None:
    """``entries`` ran on ``stream`` and the host did not wait: mark their completion
    there; on the step's own stream they were exposed throughout."""
    done = cuda.record(stream)
    for entry in entries:
        entry[2] = done
        if done is None:
            entry[1] = None  # no completion could be marked: not measured
    first = entries[0][1] if entries else None  # the first launch, on the same stream
    if done is not None and first is not None and _main(cuda, stream):
        blocked = comm.blocked
        if len(blocked) < MAX_CALLS_PER_STEP:
            blocked.append((first, done))


def _complete_later(comm: CommTiming, entry: list[Any], cuda: Any, work: Any) -> None:
    """Mark ``entry`` complete when ``work`` is (a callback on its future)."""

    def on_done(_fut: Any) -> None:
        try:  # guard point "collectives.done"
            if cuda is None:
                entry[2] = time.perf_counter()
                return
            done = cuda.record()  # the stream the future's callbacks run on
            if done is None:
                entry[1] = None  # no completion could be marked: not measured
            entry[2] = done
        except Exception as exc:
            comm.fail_direct("collectives.done", exc)

    if work is None:  # the backend ran it inside the call
        on_done(None)
        return
    try:
        future = work.get_future()
    except Exception:  # a backend without futures: complete when the call returned
        on_done(None)
        return
    future.add_done_callback(on_done)


F = TypeVar("F", bound=Callable[..., Any])


def _named(wrapper: F, name: str, original: Any) -> F:
    """``wrapper`` under the name of the method it wraps, with its doc (what torch's own
    introspection, a traceback and ``help()`` see)."""
    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper


def _wrap_method(name: str, original: Any) -> Callable[..., Any]:
    op, pos, keys, times_size = METHODS[name]

    def rtop_collective(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = _STATE.probe
        if probe is None:
            return original(self, *args, **kwargs)
        comm = probe.comm
        if comm.calls is None:  # not timed (off after an error, or closed)
            return original(self, *args, **kwargs)
        try:  # guard point "collectives.launch": rtop's part only, never the collective
            launch = _launch(probe, comm, self, op, pos, keys, times_size, args, kwargs)
        except Exception as exc:
            comm.fail_direct("collectives.launch", exc)
            return original(self, *args, **kwargs)
        if launch is None:
            return original(self, *args, **kwargs)
        work = original(self, *args, **kwargs)  # the job's own errors propagate
        try:
            _launched(comm, *launch, group=self, work=work)
        except Exception as exc:
            comm.fail_direct("collectives.launch", exc)
        return work

    return _named(rtop_collective, name, original)


def _wrap_wait(original: Any) -> Callable[..., Any]:
    def rtop_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = _STATE.probe
        if probe is None or probe.comm.calls is None:
            return original(self, *args, **kwargs)
        comm = probe.comm
        try:  # guard point "collectives.wait"
            cuda = probe.cuda
            if cuda is not None and (self in _STATE.host_works or (
                    _STATE.waiting is not None and _STATE.waiting[0] is self)):
                cuda = None  # a host collective's work: its wait blocks the host
            t0 = time.perf_counter()
            stream = cuda.stream() if cuda is not None else None
            w0 = cuda.record(stream) if cuda is not None else t0
            act = probe.activity
            mine = act.thread_id == threading.get_ident()
            if mine:
                before = act.phase, act.since
                act.phase, act.since = "comm", t0
        except Exception as exc:
            comm.fail_direct("collectives.wait", exc)
            return original(self, *args, **kwargs)
        result = original(self, *args, **kwargs)  # the job's own errors propagate
        try:
            if mine and act.phase == "comm":
                act.phase, act.since = before
            w1 = cuda.record(stream) if cuda is not None else time.perf_counter()
            waiting = _STATE.waiting
            if waiting is not None and waiting[0] is self:  # a synchronous call's end
                _STATE.waiting = None
                if waiting[1][2] is None:
                    waiting[1][2] = w1
            blocked = comm.blocked
            if len(blocked) < MAX_CALLS_PER_STEP and (cuda is None or _main(cuda, stream)):
                blocked.append((w0, w1))  # on another stream: not the step's wait
        except Exception as exc:
            comm.fail_direct("collectives.wait", exc)
        return result

    return _named(rtop_wait, "wait", original)


def _wrap_wait_event(original: Any) -> Callable[..., Any]:
    """``Stream.wait_event`` (``wait_stream`` goes through it): on the step's own
    stream, the span that stream waits is blocked time (FSDP2's waits for its
    collectives)."""

    def rtop_wait_event(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = _STATE.probe
        cuda = probe.cuda if probe is not None else None
        if cuda is None or probe is None or probe.comm.calls is None:
            return original(self, *args, **kwargs)
        comm = probe.comm
        try:  # guard point "collectives.wait"
            main = cuda.step_stream
            w0 = cuda.record(self) if main is not None and self == main else None
        except Exception as exc:
            comm.fail_direct("collectives.wait", exc)
            return original(self, *args, **kwargs)
        result = original(self, *args, **kwargs)  # the job's own errors propagate
        if w0 is not None:
            try:
                w1 = cuda.record(self)
                if w1 is not None and len(comm.blocked) < MAX_CALLS_PER_STEP:
                    comm.blocked.append((w0, w1))
            except Exception as exc:
                comm.fail_direct("collectives.wait", exc)
        return result

    return _named(rtop_wait_event, "wait_event", original)


def _wrap_start_coalescing(original: Any) -> Callable[..., Any]:
    def rtop_start_coalescing(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)  # the job's own errors propagate
        probe = _STATE.probe
        if probe is not None and probe.comm.calls is not None:
            try:  # guard point "collectives.launch"
                _STATE.coalescing[id(self)] = []
            except Exception as exc:
                probe.comm.fail_direct("collectives.launch", exc)
        return result

    return _named(rtop_start_coalescing, "_start_coalescing", original)


def _wrap_end_coalescing(original: Any) -> Callable[..., Any]:
    def rtop_end_coalescing(self: Any, *args: Any, **kwargs: Any) -> Any:
        queued = _STATE.coalescing.pop(id(self), None)
        work = original(self, *args, **kwargs)  # the job's own errors propagate
        probe = _STATE.probe
        if queued and probe is not None and probe.comm.calls is not None:
            comm = probe.comm
            try:  # guard point "collectives.done"
                gpu = [entry for entry, cuda in queued if cuda is not None]
                if gpu and work is None:  # the group ran on the caller's stream
                    pool = next(cuda for _, cuda in queued if cuda is not None)
                    _done_on_stream(comm, gpu, pool, pool.stream())
                for entry, cuda in queued:
                    if cuda is None or work is not None:
                        _complete_later(comm, entry, cuda, work)
            except Exception as exc:
                comm.fail_direct("collectives.done", exc)
        return work

    return _named(rtop_end_coalescing, "_end_coalescing", original)


def _graph_replayed() -> None:
    """A CUDA graph whose capture launched a collective is replayed: the step's
    collectives are not measured (an entry that could not be timed)."""
    probe = _STATE.probe
    calls = probe.comm.calls if probe is not None else None
    if calls is not None and len(calls) < MAX_CALLS_PER_STEP:
        calls.append(["all_reduce", None, None, 0, 1, 0, None])


def _patch(cls: Any, name: str, wrap: Callable[[Any], Callable[..., Any]]) -> None:
    original = cls.__dict__.get(name)
    if original is None or (cls, name) in _STATE.wrappers:  # not in this torch, or done
        return
    wrapper = wrap(original)
    _STATE.originals[(cls, name)] = original
    _STATE.wrappers[(cls, name)] = wrapper
    setattr(cls, name, wrapper)


def use_cuda(probe: Probe) -> None:
    """``probe`` times on a GPU now: watch its CUDA module's ``Stream.wait_event``
    (the step's stream waiting for a collective) and CUDA graph replays, while the
    wrappers are installed for it."""
    pool = probe.cuda
    if _STATE.probe is not probe or pool is None:
        return
    stream_cls = getattr(pool.module, "Stream", None)
    if stream_cls is not None:
        _patch(stream_cls, "wait_event", _wrap_wait_event)
    CAPTURES.on_replay = _graph_replayed


def install(probe: Probe) -> str | None:
    """Time every collective of this process for ``probe`` from now on (see the
    module doc); a note saying so, or None when ``torch.distributed`` is not in use
    (not available, or no process group initialised). A second probe takes over
    from the first."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    if not _STATE.wrappers:
        for name in METHODS:
            _patch(dist.ProcessGroup, name, functools.partial(_wrap_method, name))
        _patch(dist.ProcessGroup, "_start_coalescing", _wrap_start_coalescing)
        _patch(dist.ProcessGroup, "_end_coalescing", _wrap_end_coalescing)
        _patch(dist.Work, "wait", _wrap_wait)
    _STATE.probe = probe
    probe.comm.use_direct()
    use_cuda(probe)
    return ("every collective timed at the process group (all-gather, reduce-scatter, "
            "all-to-all, broadcast and allreduce calls outside DDP's own, FSDP's "
            "included): launch to completion, exposed while the caller waited")


def release(probe: Probe) -> None:
    """``probe`` closes: if the wrappers report to it, put torch's own methods back
    (a method that someone replaced after rtop is left as it is, and rtop's wrapper
    under it only calls the original from now on)."""
    probe.comm.stop_direct()
    if _STATE.probe is not probe:
        return
    _STATE.probe = None
    _STATE.waiting = None
    _STATE.coalescing = {}
    if CAPTURES.on_replay is _graph_replayed:
        CAPTURES.on_replay = None
    for key, wrapper in list(_STATE.wrappers.items()):
        cls, name = key
        try:
            if cls.__dict__.get(name) is wrapper:
                setattr(cls, name, _STATE.originals[key])
        except Exception as exc:  # never break the job because of rtop (at exit too)
            log.debug("rtop: could not restore %s.%s: %r", cls.__name__, name, exc)
    _STATE.wrappers.clear()
    _STATE.originals.clear()
