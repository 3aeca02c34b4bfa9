"""On-demand ``torch.profiler`` capture over a few training steps (``rtop profile``).

:class:`ProfileCapture` is a training-thread action (see
:class:`collectors.control.TrainingAction`): the rank's training thread calls
:meth:`~ProfileCapture.at_boundary` at each step boundary from the step the hub chose.
The first call starts ``torch.profiler.profile`` (CPU activity, plus CUDA where the job
uses a GPU); after ``steps`` more boundaries it stops, the trace is written as
``torch.profiler.tensorboard_trace_handler`` names and writes it
(``<worker>.<ns>.pt.trace.json``, so ``tensorboard --logdir DIR`` with torch-tb-profiler,
HTA's ``TraceAnalysis`` and Perfetto open it), and ``on_done`` gets one small answer::

    {"rank": 0, "steps": [10, 14], "trace": "/abs/DIR/rank0.<ns>.pt.trace.json",
     "steps_asked": 5, "trace_bytes": 212345, "note": None,
     "timeline": "cpu",                       # or "gpu": which timeline the split uses
     "top_ops": [{"name": "aten::addmm", "self_s": 0.0012, "calls": 15}, ...],
     "wall_s": ..., "compute_s": ..., "comm_s": ..., "overlap_s": ..., "idle_s": ...}

or ``{"rank": 0, "error": "..."}``. ``on_done`` is called exactly once. ``note`` says why
fewer steps than asked were captured (see "Bounded" below), else it is None.

**Private.** The trace is written 0600, in a staging folder of its own (0700) first and
then renamed into ``DIR``, so nobody else can read it even for a moment; ``DIR`` and
every parent folder the capture creates are made 0700 (folders that already exist are
left as they are).

**Bounded, and released.** What a capture costs the rank grows with the profiler's
events: measured here, about 330 bytes of resident memory per event while it captures,
280 bytes of trace, and at the end, while the trace is written and summarised, about
5 KB per event for a moment (a 1,000-step capture of a small DDP model: 180,000 events,
52 MB of trace, +0.9 GB resident). So a capture stops early, at a step boundary, once the
rank's resident memory has grown by more than :data:`MAX_CAPTURE_GROWTH_BYTES` since it
started (some 50,000 events: about 14 MB of trace and 250 MB at the end), and its answer
says so (``note``); steps are at most ``collectors.control.MAX_PROFILE_STEPS``. With CUDA
activity each launched kernel adds its runtime call and the kernel itself to the trace
beside the operator that launched it, kept in CUPTI's activity buffers rather than in
the memory the bound watches: such a capture is refused beyond
:data:`MAX_CUDA_PROFILE_STEPS` steps (a clear error, nothing started) and stops at half
the growth (:data:`MAX_CAPTURE_GROWTH_BYTES_CUDA`). The work at the end is bounded too:
torch's parsing of the events stops after :data:`SUMMARY_TIMEOUT_S` (where this torch
can: ``post_processing_timeout_s``) and the summary reads at most
:data:`MAX_SUMMARY_EVENTS` events within the same time; a summary made from part of the
events says so in ``note``. Once the
answer is made, everything the capture held is let go: the profiler and its results are
dropped, cycles collected (``gc.collect``) and, with glibc, the freed heap handed back
to the system (``malloc_trim``), so the rank's resident memory returns to about where it
was.

**How the time is split** (all from the profiler's own events, over the captured steps:
from the start of the first ``ProfilerStep#N`` to the end of the last; intervals are
clipped to that window):

* ``comm_s``: wall-clock time during which at least one collective was in flight, the
  union of the collectives' intervals (as the step records' ``comm_s``). On CPU these
  are the backend's own records, which span a collective from its launch to its
  completion on the backend's threads (``gloo:all_reduce``, ``nccl:*``), and the c10d
  operators that launch or wait on one (``c10d::allreduce_``,
  ``c10d_functional::wait_tensor``, ``record_param_comms``); see :func:`is_comm`.
* ``compute_s``: the union of every other operator's interval (``cpu_op`` events on any
  thread; user annotations such as ``ProfilerStep#N`` or ``Optimizer.step`` are not
  operators), less the time its own thread spent inside a collective operator nested in
  it (DDP launches its allreduce from inside autograd's ``AccumulateGrad``). Compute on
  one thread while a collective is in flight on another (backward overlapping DDP's
  allreduce on gloo's threads) counts here too: ``overlap_s`` is that shared time.
* ``idle_s``: the rest of the window, when no operator ran and no collective was in
  flight (Python between operators, waiting for data, host-side waits outside any
  operator). So ``compute_s + comm_s - overlap_s + idle_s == wall_s``.
* With a GPU (``timeline: "gpu"``) the same split is made over the GPU's activity
  instead, as HTA does: ``comm`` is the NCCL kernels (``nccl*``), ``compute`` every
  other kernel, memcpy and memset, ``idle`` the time the GPU ran none of them. The
  window is then the GPU's own: from the start of the first ``ProfilerStep#N`` on the
  GPU timeline (kineto's GPU-side annotation, which spans the kernels the step
  launched) to the end of the last, or, where the trace has none, from the first
  kernel to the last. Never the CPU's steps: the GPU runs behind the host, so the
  CPU's window would drop the kernels that lag and count as idle the time before the
  first step's kernels began.

``top_ops`` ranks operators by self time: self CUDA time on the GPU timeline, else self
CPU time (time in the operator, not in the operators it called).

**Never disturbs the job or a user's profiler.** Every failure (a profiler already
running in this process, an unwritable directory, a full disk, a bug) becomes an answer
``{"error": ...}``; nothing raises into the job and a profiler that rtop started is
stopped. If any profiler is active anywhere in the process when the capture should
start, the capture is refused: torch keeps one profiler per process, and a second start
(from another thread) silently takes the user's session away. Limits: a user's
``torch.profiler.profile`` with a schedule still in its *wait* phase is not yet active
as far as torch knows, and if its schedule turns it on during rtop's capture, torch
refuses *that* start; and a profiler the user starts during rtop's capture is refused
by torch in the same way.

**The model's GPU.** With CUDA activity, torch's profiler synchronises the *current*
device when it stops (``torch/autograd/profiler.py``: ``device_module.synchronize()``):
in a job that never calls ``torch.cuda.set_device`` the training thread's current device
is GPU 0 whatever GPU its model is on, so every rank would open a CUDA context on GPU 0.
The profiler is started and stopped with the model's device current
(``torch.cuda.device(device)``, which gives the previous device back without opening a
context there). If stopping fails (a CUDA error in that synchronise), the profiler is
switched off all the same: rtop never leaves its profiler running.

**Threads.** ``torch.profiler`` must be stopped on the thread that started it, so
:meth:`~ProfileCapture.abort` from another thread (the hub cancelled, from the sender
thread) answers at once but leaves the stop to the next step boundary; a job that never
reaches another boundary keeps the profiler running (and its events in memory) until
the process ends. Called on the training thread itself (``probe.close()``), ``abort``
stops at once.

**Cost.** Only while capturing: the profiler's own overhead on the captured steps, and
at the last boundary, on the training thread, writing the trace and reading the events
for the summary (tens of milliseconds for a small model, about 0.1 ms per event here, so
some seconds at the bound). Before the first and after the last boundary nothing runs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import psutil

from collectors.control import AnswerOnce
from collectors.timeline import intersection, merged

log = logging.getLogger("collectors")

__all__ = ["MAX_CAPTURE_GROWTH_BYTES", "MAX_CAPTURE_GROWTH_BYTES_CUDA",
           "MAX_CUDA_PROFILE_STEPS", "MAX_SUMMARY_EVENTS", "SUMMARY_TIMEOUT_S",
           "ProfileCapture", "is_comm", "make_private_dirs", "profiler_active",
           "release_memory", "split_time", "subtract", "summarise"]

#: An interval of time, ``(start_s, end_s)``.
Interval = tuple[float, float]

#: Name prefixes (lower case) of collective records and operators.
COMM_PREFIXES = ("gloo:", "nccl", "mpi:", "ucc:", "c10d::", "c10d_functional::",
                 "_c10d_functional::", "record_param_comms")
#: Substrings (lower case) that name a collective wherever they appear.
COMM_WORDS = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
              "reducescatter", "alltoall", "all_to_all", "sendrecv")
#: Kineto activity types of GPU work (kernels and copies; not annotations).
GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: The longest operator name an answer carries.
MAX_NAME = 200
#: A capture stops early at the first step boundary where the rank's resident memory
#: has grown by more than this since the capture started (module doc, "Bounded"):
#: about 50,000 profiler events, 14 MB of trace, 250 MB for a moment at the end.
MAX_CAPTURE_GROWTH_BYTES: Final = 16 << 20
#: The same with CUDA activity (module doc, "Bounded"): each kernel's runtime call and
#: kernel records add to the trace outside the memory the bound watches.
MAX_CAPTURE_GROWTH_BYTES_CUDA: Final = MAX_CAPTURE_GROWTH_BYTES // 2
#: The most steps a capture with CUDA activity takes; more is refused with an error.
MAX_CUDA_PROFILE_STEPS: Final = 20
#: The most events the summary reads, and the time torch's parsing and the summary
#: each get (seconds) before the answer is made from what was read.
MAX_SUMMARY_EVENTS: Final = 500_000
SUMMARY_TIMEOUT_S: Final = 30.0

_WAITING, _RUNNING, _DONE = "waiting", "running", "done"


def is_comm(name: str) -> bool:
    """Whether a profiler event's name is a collective's (see the module doc).

    Backend records (``gloo:all_reduce``, ``nccl:all_reduce``), c10d operators
    (``c10d::allreduce_``, ``c10d_functional::wait_tensor``), ``record_param_comms`` and
    NCCL kernels (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``) are; ``aten::broadcast_to``
    is not.
    """
    low = name.lower()
    return low.startswith(COMM_PREFIXES) or any(w in low for w in COMM_WORDS)


def _total(intervals: Sequence[Interval]) -> float:
    return sum((b - a for a, b in intervals), 0.0)


def subtract(x: Sequence[Interval], y: Sequence[Interval]) -> list[Interval]:
    """The parts of merged intervals ``x`` that merged intervals ``y`` do not cover."""
    out: list[Interval] = []
    j = 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while a < b and k < len(y) and y[k][0] < b:
            if y[k][0] > a:
                out.append((a, y[k][0]))
            a = max(a, y[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def split_time(compute: Iterable[Interval], comm: Iterable[Interval],
               window: Interval) -> dict[str, float]:
    """Split ``window`` into compute, communication and idle time (module doc):
    ``wall_s``, ``compute_s``, ``comm_s``, ``overlap_s`` and ``idle_s``, in seconds.

    ``compute`` and ``comm`` are intervals that may overlap each other and themselves;
    both are clipped to ``window``. ``compute_s + comm_s - overlap_s + idle_s`` equals
    ``wall_s``.
    """
    lo, hi = window
    wall = max(0.0, hi - lo)
    cu = merged((max(a, lo), min(b, hi)) for a, b in compute)
    co = merged((max(a, lo), min(b, hi)) for a, b in comm)
    compute_s, comm_s, overlap_s = _total(cu), _total(co), _total(intersection(cu, co))
    idle_s = max(0.0, wall - (compute_s + comm_s - overlap_s))
    return {"wall_s": wall, "compute_s": compute_s, "comm_s": comm_s,
            "overlap_s": overlap_s, "idle_s": idle_s}


def _interval(e: Any) -> Interval:
    tr = e.time_range  # microseconds since the trace began
    return (float(tr.start) / 1e6, float(tr.end) / 1e6)


def summarise(events: Iterable[Any], *, gpu: bool, top: int = 10,
              max_events: int = MAX_SUMMARY_EVENTS,
              timeout_s: float | None = SUMMARY_TIMEOUT_S) -> dict[str, Any]:
    """The summary of a capture from ``torch.profiler``'s events (``prof.events()``).

    ``gpu``: split the GPU's timeline (when the events hold any GPU work) over the GPU's
    own window (module doc) and rank operators by self CUDA time; else the CPU's, over
    the ``ProfilerStep#N`` window. Returns ``timeline``, ``top_ops``, the
    :func:`split_time` figures, and ``events_read``; at most ``max_events`` events are
    read, within ``timeout_s`` seconds, and then ``partial`` is True.
    """
    steps: list[Interval] = []
    gpu_steps: list[Interval] = []
    cpu_comm: dict[Any, list[Interval]] = {}  # by thread
    cpu_ops: dict[Any, list[Interval]] = {}
    dev_comm: list[Interval] = []
    dev_work: list[Interval] = []
    cpu_self: dict[str, list[float]] = {}
    dev_self: dict[str, list[float]] = {}
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    read, partial = 0, False
    for e in events:
        if read >= max_events or (deadline is not None and read % 1024 == 0
                                  and read and time.monotonic() > deadline):
            partial = True
            break
        read += 1
        name = str(e.name)
        trace_name = str(getattr(e, "trace_name", None) or name)
        device = str(e.device_type).rsplit(".", 1)[-1]
        activity = getattr(e, "activity_type", None)
        if device != "CPU":
            if trace_name.startswith("ProfilerStep"):  # the step on the GPU's timeline
                gpu_steps.append(_interval(e))
            elif activity is None or str(activity) in GPU_ACTIVITIES:
                (dev_comm if is_comm(name) else dev_work).append(_interval(e))
            continue
        if trace_name.startswith("ProfilerStep"):
            steps.append(_interval(e))
            continue
        op = (str(activity) == "cpu_op" if activity is not None
              else not getattr(e, "is_user_annotation", False))
        thread = getattr(e, "thread", None)
        if is_comm(name):
            cpu_comm.setdefault(thread, []).append(_interval(e))
        elif op:
            cpu_ops.setdefault(thread, []).append(_interval(e))
        if op:
            for table, t_us in ((cpu_self, e.self_cpu_time_total),
                                (dev_self, e.self_device_time_total if gpu else 0.0)):
                row = table.setdefault(name, [0.0, 0.0])
                row[0] += float(t_us) / 1e6
                row[1] += 1
    use_gpu = gpu and bool(dev_comm or dev_work)
    if use_gpu:  # the GPU's own window: its steps, else its kernels' (module doc)
        compute, comm = dev_work, dev_comm
        every = gpu_steps or compute + comm
    else:  # a collective called inside an operator (DDP's backward hooks) is not compute
        compute = [iv for t, ops in cpu_ops.items()
                   for iv in subtract(merged(ops), merged(cpu_comm.get(t, [])))]
        comm = [iv for ivs in cpu_comm.values() for iv in ivs]
        every = steps or compute + comm
    window = (min(a for a, _ in every), max(b for _, b in every)) if every else (0.0, 0.0)
    table = dev_self if use_gpu else cpu_self
    ranked = sorted(((n, s, c) for n, (s, c) in table.items() if s > 0),
                    key=lambda x: (-x[1], x[0]))[:max(0, top)]
    return {"timeline": "gpu" if use_gpu else "cpu",
            "top_ops": [{"name": n[:MAX_NAME], "self_s": s, "calls": int(c)}
                        for n, s, c in ranked],
            **split_time(compute, comm, window), "events_read": read, "partial": partial}


def profiler_active() -> str | None:
    """Which profiler is running in this process, or None (torch already imported)."""
    import torch
    import torch.autograd.profiler as autograd_profiler

    if getattr(autograd_profiler, "_is_profiler_enabled", False):
        return "torch.profiler (or torch.autograd.profiler) is already running in this process"
    if torch._C._autograd._profiler_enabled():
        return "a torch profiler is already enabled on the training thread"
    return None


def make_private_dirs(path: str) -> list[str]:
    """Create ``path`` and its missing parents, each 0700 (``os.makedirs`` would leave
    them to the umask); folders that already exist are left as they are. Returns the
    folders made. Another process making one of them meanwhile is fine (it is not
    ours to change, then)."""
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    made: list[str] = []
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # a umask may have taken the owner's bits
        made.append(d)
    return made


def release_memory() -> None:
    """Give back what a finished capture held: collect reference cycles (the profiler's
    objects hold some) and, with glibc, hand the freed heap back to the system
    (``malloc_trim``: glibc keeps freed memory for reuse otherwise, and a capture frees
    hundreds of megabytes of small objects). Never raises."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
        if trim is not None:
            trim(0)
    except Exception as exc:
        log.debug("rtop: malloc_trim failed: %r", exc)


def _rss() -> int | None:
    try:
        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


def _parameters(fn: Any) -> set[str]:
    """The parameter names ``fn`` (a class: its ``__init__``) accepts; empty if unknown."""
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _switch_off() -> None:
    """Switch off the profiler rtop started, after its own stop failed: the profiler of
    this process is disabled and torch's flag cleared. Never raises."""
    with contextlib.suppress(Exception):
        import torch

        if torch._C._autograd._profiler_enabled():
            torch.autograd._disable_profiler()  # type: ignore[attr-defined,unused-ignore]
    with contextlib.suppress(Exception):
        import torch.autograd.profiler as autograd_profiler

        autograd_profiler._run_on_profiler_stop()  # type: ignore[no-untyped-call]


def _always_record(step: int) -> Any:
    from torch.profiler import ProfilerAction

    return ProfilerAction.RECORD


class ProfileCapture:
    """``torch.profiler`` over ``steps`` training steps, answering through ``on_done``.

    ``out_dir``: where the trace goes (made if missing); ``worker_name``: the trace's
    worker name, one per rank (``rank3``); ``rank``: put in the answer; ``cuda``: profile
    CUDA activity too (None: when CUDA is available and initialised in this process);
    ``device``: the CUDA device the model lives on, current while the profiler starts
    and stops (None: leave the current device as it is); ``top``: how many operators the
    answer lists. See the module doc for the answer, the split, the bounds and what
    happens on errors and aborts. Never raises into the job.
    """

    def __init__(self, out_dir: str, worker_name: str, steps: int, rank: int,
                 on_done: Callable[[dict[str, Any]], None], *, cuda: bool | None = None,
                 device: int | None = None, top: int = 10) -> None:
        self.out_dir = os.path.abspath(out_dir)
        self.worker_name = worker_name
        self.steps = steps
        self.rank = rank
        self.top = top
        self.device = device
        self._cuda = cuda
        self._answer = AnswerOnce(on_done, "a profile's answer")
        self._lock = threading.Lock()
        self._state = _WAITING
        self._abort_why: str | None = None
        self._prof: Any = None
        self._thread: int | None = None
        self._first = 0
        self._count = 0
        self._trace: str | None = None
        self._rss0: int | None = None
        self._note: str | None = None

    # ---- the training thread --------------------------------------------------------

    def at_boundary(self, step: int) -> bool:
        """Start at the first call, count a step at each later one, finish after
        ``steps``; True once finished (or refused, or aborted). Never raises."""
        try:
            with self._lock:
                state, why = self._state, self._abort_why
                if state == _WAITING:
                    self._state = _RUNNING
                    self._thread = threading.get_ident()
            if state == _WAITING:
                return self._start(step)
            if self._prof is None:
                return True  # done, or aborted before it started
            if why is not None:
                self._discard()
                self._answer({"rank": self.rank, "error": why})
                return True
            self._count += 1
            if self._count < self.steps and not self._over_bound():
                self._prof.step()
                return False
            self._finish()
            return True
        except Exception as exc:  # rtop's failure costs the capture, never the job
            self._fail(f"profiling failed: {type(exc).__name__}: {exc}")
            return True

    def _start(self, step: int) -> bool:
        if self.steps < 1:
            self._fail(f"a profile needs at least 1 step, not {self.steps}")
            return True
        import torch

        busy = profiler_active()
        if busy is not None:
            self._fail(f"{busy}; rtop does not start a second one, which would disturb it")
            return True
        cuda = self._cuda
        if cuda is None:
            initialised: Callable[[], bool] = torch.cuda.is_initialized
            cuda = torch.cuda.is_available() and initialised()
        self._cuda = cuda
        if cuda and self.steps > MAX_CUDA_PROFILE_STEPS:
            self._fail(f"a profile with CUDA activity takes at most {MAX_CUDA_PROFILE_STEPS} "
                       f"steps, not {self.steps}: every kernel adds to the trace, which is "
                       f"written and summarised on the training thread while the other "
                       f"ranks wait; ask for fewer steps")
            return True
        try:
            make_private_dirs(self.out_dir)
            fd, probe_path = tempfile.mkstemp(prefix=".rtop-write-test-", dir=self.out_dir)
            os.close(fd)
            os.unlink(probe_path)
        except OSError as exc:
            self._fail(f"cannot write traces to {self.out_dir}: {exc}")
            return True
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        options: dict[str, Any] = {}
        if "post_processing_timeout_s" in _parameters(profile):  # bounded parsing
            options["post_processing_timeout_s"] = SUMMARY_TIMEOUT_S
        prof = profile(activities=activities, schedule=_always_record,
                       on_trace_ready=self._trace_ready, **options)
        prof.step_num = step  # ProfilerStep#N names the job's own step index
        self._first = step
        try:
            with self._on_device():
                prof.start()
        except Exception as exc:
            if "already enabled" not in str(exc):  # that one is the user's: leave it be
                with contextlib.suppress(Exception):
                    prof.on_trace_ready = None
                    self._stop(prof)
            self._fail(f"could not start the profiler: {type(exc).__name__}: {exc}")
            return True
        self._rss0 = _rss()
        self._prof = prof
        return False

    def _over_bound(self) -> bool:
        """Whether the rank's memory grew past :data:`MAX_CAPTURE_GROWTH_BYTES` (with
        CUDA activity :data:`MAX_CAPTURE_GROWTH_BYTES_CUDA`) since the capture started
        (then :attr:`_note` says so)."""
        bound = MAX_CAPTURE_GROWTH_BYTES_CUDA if self._cuda else MAX_CAPTURE_GROWTH_BYTES
        now = _rss()
        if now is None or self._rss0 is None or now - self._rss0 <= bound:
            return False
        self._note = (f"stopped after {self._count} of the {self.steps} steps asked: the "
                      f"rank's memory had grown by {(now - self._rss0) / 2**20:.0f} MiB "
                      f"during the capture, beyond the {bound >> 20} MiB a capture "
                      f"{'with CUDA activity ' if self._cuda else ''}may take; profile "
                      f"fewer steps for a complete one")
        return True

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """The model's device current on this thread (module doc), with CUDA activity."""
        if not self._cuda or self.device is None:
            return contextlib.nullcontext()
        from collectors import cuda_events

        ctx: contextlib.AbstractContextManager[Any] = cuda_events.cuda_module().device(
            self.device)
        return ctx

    def _stop(self, prof: Any) -> None:
        """Stop rtop's profiler with the model's device current; if that fails, switch
        the profiler off all the same (and raise what stopping raised)."""
        try:
            with self._on_device():
                prof.stop()
        except Exception:
            _switch_off()
            raise

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        with self._lock:
            self._state = _DONE
        events: Any = None
        try:
            self._stop(prof)  # stops, then writes the trace (on_trace_ready)
            if self._answer.given:
                return  # aborted meanwhile from another thread: that was the answer
            size = None
            if self._trace is not None:
                with contextlib.suppress(OSError):
                    size = os.path.getsize(self._trace)
            answer: dict[str, Any] = {"rank": self.rank,
                                      "steps": [self._first, self._first + self._count - 1],
                                      "trace": self._trace, "steps_asked": self.steps,
                                      "trace_bytes": size, "note": self._note}
            t0 = time.monotonic()
            events = prof.events()  # torch's parsing: bounded where torch can
            parse_s = time.monotonic() - t0
            summary = summarise(events, gpu=bool(self._cuda), top=self.top)
            events = None  # let go before the memory is handed back (finally)
            read, partial = summary.pop("events_read"), summary.pop("partial")
            answer.update(summary)
            if partial or parse_s >= 0.95 * SUMMARY_TIMEOUT_S:
                said = (f"the summary is made from the first {read} events: reading them "
                        f"all would hold the training thread too long (the trace has them "
                        f"all)")
                answer["note"] = f"{self._note}; {said}" if self._note else said
        finally:
            events = None
            prof.on_trace_ready = None
            del prof
            release_memory()
        self._answer(answer)

    def _trace_ready(self, prof: Any) -> None:
        """Write the trace as ``tensorboard_trace_handler`` names it, 0600: exported into
        a 0700 staging folder of its own inside ``out_dir``, made 0600 there, then renamed
        into ``out_dir`` (the exporter creates its file with the process's umask)."""
        stage = tempfile.mkdtemp(prefix=".rtop-trace-", dir=self.out_dir)
        try:
            name = f"{self.worker_name}.{time.time_ns()}.pt.trace.json"
            staged = os.path.join(stage, name)
            prof.export_chrome_trace(staged)
            os.chmod(staged, 0o600)
            final = os.path.join(self.out_dir, name)
            if os.path.lexists(final):
                raise FileExistsError(f"{final} exists already")
            os.rename(staged, final)
            self._trace = final
        finally:  # a partial trace (disk full) goes with its staging folder
            shutil.rmtree(stage, ignore_errors=True)

    def _discard(self) -> None:
        """Stop rtop's profiler if it runs, writing no trace (on the thread that
        started it)."""
        prof, self._prof = self._prof, None
        with self._lock:
            self._state = _DONE
        if prof is None:
            return
        prof.on_trace_ready = None
        with contextlib.suppress(Exception):
            self._stop(prof)
        del prof
        release_memory()

    def _fail(self, why: str) -> None:
        if self._thread == threading.get_ident():
            self._discard()
        with self._lock:
            self._state = _DONE
        self._answer({"rank": self.rank, "error": why})

    # ---- any thread -----------------------------------------------------------------

    def abort(self, why: str) -> None:
        """Stop the capture and answer ``{"error": why}`` unless already answered.

        On the thread that started the profiler it stops now; from another thread the
        answer goes now and the profiler stops at the next step boundary (module doc).
        """
        with self._lock:
            if self._state == _DONE:
                return
            if self._state == _WAITING:
                self._state = _DONE
            elif self._thread != threading.get_ident():
                self._abort_why = why
        try:
            if self._thread == threading.get_ident():
                self._discard()
        finally:
            self._answer({"rank": self.rank, "error": why})
