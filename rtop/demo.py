"""``rtop demo``: a real Ray Train job with an injected fault, watched by rtop.

The job is a Ray Train ``TorchTrainer`` on CPU: ``N`` workers, real DDP over gloo, the
small MLP of :mod:`rtop.workload` on synthetic data, every rank instrumented with
``collectors``. A hub runs on a thread of this process (and records the run); the
ranks find it through ``RTOP_HUB``/``RTOP_TOKEN`` in Ray's runtime environment. After
about 40 healthy steps the fault starts on rank 1.

With a terminal, the live view (:func:`rtop.tui.attach`) takes the screen while the job
runs; ``--headless`` prints a progress line every few seconds instead and, at the end,
the report of the recording. Ray itself is kept quiet: no dashboard, no worker output
forwarded to this terminal, its loggers at ERROR.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtop.hub.service import ThreadedHub
from rtop.run.snapshot import FindingDict, Snapshot
from rtop.tui.logs import logs_to_file
from rtop.workload import Faults, WorkloadSpec, ray_train_loop

#: Healthy steps before the fault starts on rank 1.
FAULT_STEP = 40
#: The rank the fault is injected on.
FAULT_RANK = 1
#: The memory the ``memory`` demo tells rank probes their device has (a rehearsal of a
#: small device: a Ray worker here starts near 0.6 GB of RSS).
MEMORY_CAPACITY_BYTES = 2_000_000_000
#: How much rank 1 keeps per step in the ``memory`` demo (~13 MB/s at ~25 steps/s: the
#: finding appears ~15 s after the fault starts).
MEMORY_GROW_BYTES = 512 << 10
#: ... and stops growing there: past the rehearsed capacity, never much past it for real
MEMORY_GROW_MAX_BYTES = 1_800_000_000

#: The workload: mostly compute when healthy (see tests/scenarios.py BASE).
WORKLOAD: dict[str, Any] = {"batch": 768, "dim": 256, "hidden": 512, "layers": 3}


@dataclass(frozen=True)
class DemoFault:
    """One fault the demo can inject: what it does, and what rtop should call it."""

    description: str
    faults: Faults
    expect: str | None  # the finding's kind
    probe_settings: dict[str, Any] = field(default_factory=dict)


FAULTS: dict[str, DemoFault] = {
    "starved": DemoFault(
        "rank 1's data loader sleeps 40 ms per batch",
        Faults(loader_sleep_s={FAULT_RANK: 0.040}, start_step=FAULT_STEP), "starved_rank"),
    "straggler": DemoFault(
        "rank 1 computes 30 ms more per step",
        Faults(extra_compute_s={FAULT_RANK: 0.030}, start_step=FAULT_STEP), "straggler"),
    "memory": DemoFault(
        f"rank 1 keeps {MEMORY_GROW_BYTES >> 10} KiB more every step "
        f"(on a rehearsed {MEMORY_CAPACITY_BYTES / 1e9:.0f} GB device)",
        Faults(mem_grow_bytes_per_step={FAULT_RANK: MEMORY_GROW_BYTES},
               mem_grow_max_bytes=MEMORY_GROW_MAX_BYTES,
               start_step=FAULT_STEP), "memory_wall",
        {"memory_capacity_bytes": MEMORY_CAPACITY_BYTES}),
    "hang": DemoFault(
        "rank 1 stops inside a step (its peers wait in the allreduce)",
        Faults(hang_at_step={FAULT_RANK: FAULT_STEP}, start_step=FAULT_STEP), "hung_rank",
        {"stack_after_s": 2.0}),
    "none": DemoFault("no fault: a healthy job", Faults(), None),
}

#: Seconds Ray and its workers get to start before the headless demo gives up.
STARTUP_TIMEOUT_S = 180.0
#: Seconds the ranks get to leave their loop together after a stop was asked for,
#: before Ray is shut down under them.
STOP_GRACE_S = 8.0


_RAY_LOGGERS = ("ray", "ray.train", "ray.data", "ray.tune")


def _quiet_ray() -> None:
    """Keep Ray's own messages off the terminal (before ``ray`` is imported)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name in _RAY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


class DemoJob:
    """A hub on a thread of this process and a Ray Train job reporting to it.

    ``start()`` returns once the hub listens (``address``, ``token`` and
    ``record_path`` are then set); Ray starts and the job runs on a background thread.
    ``wait()`` waits for the job to end, ``stop()`` ends it early and shuts Ray down;
    ``error`` holds what went wrong, if anything did.
    """

    def __init__(self, fault: str = "starved", workers: int = 3, duration_s: float = 300.0,
                 record: str | None = None) -> None:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose from {', '.join(FAULTS)}")
        if not 2 <= workers <= 4:
            raise ValueError("workers must be 2 to 4")
        self.fault = fault
        self.workers = workers
        self.duration_s = duration_s
        self.job_name = f"demo-{fault}"
        self._record = record
        self._hub: ThreadedHub | None = None
        self._thread: threading.Thread | None = None
        self._tmp: str | None = None
        self._stop_file = ""
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._ray_lock = threading.Lock()
        self._ray_up = False
        self._preexisting: set[int] = set()
        self.error: BaseException | None = None
        self.started_at: float | None = None

    # ---- what a viewer needs ------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port`` of the demo's hub."""
        return self._hub.address if self._hub else ""

    @property
    def token(self) -> str:
        """The hub's (master) token, for the viewer the demo attaches."""
        return self._hub.token if self._hub else ""

    @property
    def rank_token(self) -> str:
        """The hub's ingest token: all the demo's ranks are given (they send records)."""
        from collectors import auth

        return auth.role_token(self.token, "ingest") if self.token else ""

    @property
    def record_path(self) -> str | None:
        """Where the hub records the run."""
        return self._hub.record_path if self._hub else None

    @property
    def hub(self) -> ThreadedHub:
        """The running hub (after :meth:`start`)."""
        if self._hub is None:
            raise RuntimeError("the demo job has not started")
        return self._hub

    @property
    def running(self) -> bool:
        """Whether the job has started and not ended yet."""
        return self._thread is not None and not self._done.is_set()

    def title(self) -> str:
        """A one-line description of the job, for a title bar."""
        what = FAULTS[self.fault].description
        if self.fault != "none":
            what = f"fault: {what} from step {FAULT_STEP}"
        return f"rtop demo: Ray Train, {self.workers} workers, DDP over gloo on CPU; {what}"

    # ---- lifecycle ----------------------------------------------------------------

    def start(self) -> DemoJob:
        """Start the hub and Ray (here, in the calling thread: Ray ties the lifetime of
        its processes to the thread that started them, and wants the real terminal's
        file descriptors), then the training job on a background thread.

        Raises ``RuntimeError`` if the hub or Ray does not start; nothing is left
        running then.
        """
        from collectors.discovery import runtime_dir

        self._tmp = tempfile.mkdtemp(prefix="rtop-demo-")
        self._stop_file = str(Path(self._tmp, "stop"))
        discovery: str | None
        try:
            discovery = str(runtime_dir() / f"hub-{self.job_name}-{os.getpid()}.json")
        except OSError:
            discovery = None
        try:
            self._hub = ThreadedHub(job=self.job_name, record=self._record,
                                    discovery_file=discovery).start()
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"the hub did not start: {_describe(exc)}") from exc
        self.started_at = time.time()
        try:
            self._start_ray()
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"Ray did not start: {_describe(exc)}") from exc
        self._thread = threading.Thread(target=self._run, name="rtop-demo-job", daemon=True)
        self._thread.start()
        return self

    def _start_ray(self) -> None:
        _quiet_ray()
        import ray

        with self._ray_lock:
            self._preexisting = {c.pid for c in _descendants()}
            self._ray_up = True  # from here on, stop() shuts Ray down
            ray.init(address="local", num_cpus=self.workers, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.ERROR,
                     configure_logging=True,
                     runtime_env={"env_vars": {"RTOP_HUB": self.address,
                                               "RTOP_TOKEN": self.rank_token,
                                               "RTOP_AUTOHUB": "0"}})
        for name in _RAY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)

    def _spec(self) -> WorkloadSpec:
        demo = FAULTS[self.fault]
        return WorkloadSpec(world_size=self.workers, duration_s=self.duration_s,
                            hub=self.address, token=self.rank_token, faults=demo.faults,
                            probe_settings=dict(demo.probe_settings),
                            stop_file=self._stop_file, **WORKLOAD)

    def _fit(self) -> None:
        """Run the Ray Train job to its end (raises what ``fit()`` raises)."""
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        assert self._tmp is not None
        trainer = TorchTrainer(
            ray_train_loop,
            train_loop_config={"spec": self._spec().to_json()},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=self.workers, use_gpu=False),
            run_config=RunConfig(storage_path=str(Path(self._tmp, "ray")),
                                 name=self.job_name),
        )
        trainer.fit()

    def _run(self) -> None:
        try:
            if not self._stopping.is_set():
                self._fit()
        except BaseException as exc:
            if not self._stopping.is_set():  # what stopping does to a job is our doing
                self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the job to end; whether it has."""
        if self._thread is None:
            return True
        return self._done.wait(timeout)

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """End the job (the ranks leave together), shut Ray down and close the hub.

        Ranks that do not leave within ``timeout`` seconds (a hung rank, say) are ended
        by shutting Ray down under them. Safe to call more than once.
        """
        self._stopping.set()
        if self._stop_file:
            with contextlib.suppress(OSError):
                Path(self._stop_file).touch()
        if self._thread is not None:
            self._done.wait(timeout)
        with self._ray_lock:
            if self._ray_up:
                self._shutdown_ray()
                self._ray_up = False
        if self._thread is not None:
            self._thread.join(15.0)
        if self._hub is not None:
            self._hub.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _shutdown_ray(self) -> None:
        """``ray.shutdown()``, then make sure every process Ray started here is gone.

        Ray's dashboard and runtime-env agents sometimes outlive their raylet (they log
        that it died and stay); they, and only they, are ended by their process ids.
        """
        import ray

        started = [p for p in _descendants() if p.pid not in self._preexisting]
        with contextlib.suppress(Exception):
            ray.shutdown()
        _end_processes(started)

    # ---- what the hub sees --------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The hub's current snapshot (ranks and live findings)."""
        snap: Snapshot = self.hub.call(lambda h: h.snapshot())
        return snap

    def findings(self) -> list[FindingDict]:
        """The hub's live findings."""
        found: list[FindingDict] = self.hub.call(lambda h: list(h.monitor.findings))
        return found


def _descendants() -> list[Any]:
    """This process's children and their children (``psutil.Process`` objects)."""
    import psutil

    try:
        return list(psutil.Process().children(recursive=True))
    except psutil.Error:
        return []


def _end_processes(procs: list[Any], grace_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` for ``procs`` to exit; terminate, then kill, the rest.

    A zombie counts as gone: an orphan's exit status is for its new parent to collect.
    """
    import psutil

    def alive(proc: Any) -> bool:
        try:
            return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    def wait(left: list[Any], seconds: float) -> list[Any]:
        end = time.monotonic() + seconds
        while True:
            left = [p for p in left if alive(p)]
            if not left or time.monotonic() >= end:
                return left
            time.sleep(0.1)

    left = wait(procs, grace_s)
    for sig in ("terminate", "kill"):
        for proc in left:
            with contextlib.suppress(psutil.Error):
                getattr(proc, sig)()
        left = wait(left, 2.0)
        if not left:
            return


def progress_line(job: DemoJob, snap: Snapshot) -> str:
    """One line of where the job stands: ranks, step, step time, live findings."""
    elapsed = time.time() - (job.started_at or time.time())
    cols = snap["ranks"]
    ranks = cols["rank"]
    if not ranks:
        return f"{elapsed:5.0f} s  starting {job.workers} Ray Train workers…"
    steps = [s for s in cols["step"] if isinstance(s, int) and s >= 0]
    step_s = [s for s in cols["step_s"] if isinstance(s, (int, float))]
    ms = f"{statistics.median(step_s) * 1e3:.0f} ms/step" if step_s else "-- ms/step"
    found = ", ".join(f"{f['kind']} on rank{'s' if len(f['ranks']) > 1 else ''} "
                      f"{','.join(str(r) for r in f['ranks'])}"
                      for f in snap["findings"]) or "none"
    step = str(max(steps)) if steps else "--"
    return (f"{elapsed:5.0f} s  {len(ranks)}/{job.workers} ranks  step {step:>5}  {ms:>12}"
            f"  findings: {found}")


def run_headless(job: DemoJob, every_s: float = 5.0, out: Any = None) -> int:
    """Run ``job`` to its end, printing progress, then the report; an exit code."""
    from collectors.wire import WireError
    from rtop.report import build_report, format_text

    out = out or sys.stdout
    # the progress lines name the live findings; the hub's own log of them would repeat it
    logging.getLogger("rtop.hub").setLevel(logging.ERROR)
    print(job.title(), file=out, flush=True)
    print("starting Ray…", file=out, flush=True)
    if not _start(job):
        return 1
    print(f"hub {job.address}  recording {job.record_path}", file=out, flush=True)
    deadline: float | None = None  # set once the ranks step: the duration plus slack
    began = time.monotonic()
    no_ranks = False
    try:
        next_line = began + every_s
        while not job.wait(0.5):
            now = time.monotonic()
            if deadline is None and now - began > STARTUP_TIMEOUT_S:
                no_ranks = True
                break
            if now >= next_line:
                next_line = now + every_s
                try:
                    snap = job.snapshot()
                except Exception:
                    continue
                print(progress_line(job, snap), file=out, flush=True)
                if deadline is None and (snap.get("ranks") or {}).get("rank"):
                    deadline = now + job.duration_s + 10.0
            if deadline is not None and now > deadline:
                break  # a rank that never returns (hang): stop it ourselves
    except KeyboardInterrupt:
        print("interrupted; stopping the job", file=out, flush=True)
    finally:
        _stop_uninterrupted(job)
    if job.error is not None:
        print(f"rtop demo: the Ray Train job failed: {_describe(job.error)}", file=sys.stderr)
        return 1
    if no_ranks:
        print(f"rtop demo: no rank reported to the hub within {STARTUP_TIMEOUT_S:.0f} s of "
              "starting; Ray or its workers did not come up", file=sys.stderr)
        return 1
    path = job.record_path
    if path is None:
        return 0
    print(file=out)
    try:
        print(format_text(build_report(path)), file=out, flush=True)
    except (OSError, WireError) as exc:
        print(f"rtop demo: cannot read the recording {path}: {exc}", file=sys.stderr)
        return 1
    return 0


def run_tui(job: DemoJob) -> int:
    """Start ``job``, hand the terminal to the live view, stop the job when it returns."""
    from rtop.tui import attach

    print(f"{job.title()}\nstarting Ray…", flush=True)
    if not _start(job):
        return 1
    log_path = f"{job.record_path}.log" if job.record_path else os.devnull
    try:
        with logs_to_file(log_path):
            code = attach(job.address, job.token, title=job.title())
    finally:
        _stop_uninterrupted(job)
    if job.error is not None:
        print(f"rtop demo: the Ray Train job failed: {_describe(job.error)}", file=sys.stderr)
        return 1
    if job.record_path:
        print(f"rtop demo: recorded to {job.record_path}\n"
              f"  see its report with: rtop report {job.record_path}")
    if log_path != os.devnull and os.path.exists(log_path):
        print(f"  what was logged meanwhile: {log_path}")
    return int(code or 0)


def _start(job: DemoJob) -> bool:
    """Start ``job``; on failure say why on stderr and return False."""
    try:
        job.start()
    except RuntimeError as exc:
        print(f"rtop demo: {exc}", file=sys.stderr)
        return False
    return True


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def default_workers() -> int:
    """3 workers where the machine has the cores for them, else 2 (with more ranks than
    cores their compute times swing, and the demo would show stragglers of its own)."""
    return 3 if (os.cpu_count() or 2) >= 4 else 2


def run(fault: str = "starved", workers: int | None = None, *, headless: bool = False,
        duration_s: float = 300.0, record: str | None = None) -> int:
    """``rtop demo``: run the demo job, live or headless; returns an exit code."""
    job = DemoJob(fault, workers or default_workers(), duration_s, record)
    try:
        return run_headless(job) if headless else run_tui(job)
    except KeyboardInterrupt:  # before the job was running, or while it started
        _stop_uninterrupted(job)
        print("rtop demo: interrupted", file=sys.stderr)
        return 130


def _stop_uninterrupted(job: DemoJob) -> None:
    """``job.stop()``, ignoring further Ctrl-C meanwhile (a half-stopped Ray would
    leave processes behind)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        job.stop()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        job.stop()
    finally:
        signal.signal(signal.SIGINT, previous)
