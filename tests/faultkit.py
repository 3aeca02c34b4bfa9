"""What the fault tests (``tests/test_faults_*.py``) share: a job run in the background,
when each of its steps ran, what a recording holds, how much memory a process uses,
and ``rtop serve`` as a real subprocess."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import psutil

from collectors import wire
from collectors.schema import STEP_FIELDS, TABLES
from rtop.run.recording import read
from rtop.workload import WorkloadSpec, run_local
from tests.waiting import wait_for

RTOP = [sys.executable, "-m", "rtop"]
ROOT = Path(__file__).resolve().parent.parent
_STEP = STEP_FIELDS.index("step")


def start_serve(port: int, token: str, record: Path | str | None, *extra: str,
                host: str = "127.0.0.1") -> subprocess.Popen[str]:
    """``rtop serve`` as a user starts it, listening once this returns; its output
    (log included) is in the returned process's stdout."""
    rec = ["--record", str(record)] if record is not None else ["--no-record"]
    proc = subprocess.Popen([*RTOP, "serve", "--host", host, "--port", str(port),
                             "--token", token, *rec, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                out = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(f"rtop serve exited: {out}") from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("rtop serve did not start listening")


def stop_serve(proc: subprocess.Popen[str]) -> str:
    """Stop ``rtop serve`` as a user does (Ctrl-C); everything it printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # in case a test left it stopped
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.stdout.read() if proc.stdout else ""


class BackgroundJob:
    """A :func:`rtop.workload.run_local` job on a thread: ``results`` once it is done.

    The spec should set ``fault_mark_dir`` (each rank writes its wall time when its
    faults begin: at step 0 unless the faults say otherwise) for :meth:`wait_started`,
    and for :meth:`step_starts` to place each step in time (faults from step 0 only)."""

    def __init__(self, spec: WorkloadSpec, timeout_s: float = 240.0, check: bool = True
                 ) -> None:
        self.spec = spec
        self.results: list[dict[str, Any]] | None = None
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(timeout_s, check),
                                        daemon=True)
        self._thread.start()

    def _run(self, timeout_s: float, check: bool) -> None:
        try:
            self.results = run_local(self.spec, timeout_s=timeout_s, check=check,
                                     stop=self.stop)
        except BaseException as exc:  # reported by join()
            self.error = exc

    def started(self) -> float | None:
        """The wall time by which every rank has begun its step 0 (None: not yet)."""
        assert self.spec.fault_mark_dir
        marks = [Path(self.spec.fault_mark_dir, f"fault-rank{r}")
                 for r in range(self.spec.world_size)]
        if not all(m.exists() for m in marks):
            return None
        return max(float(m.read_text()) for m in marks)

    def wait_started(self, timeout: float = 120.0) -> float:
        """Wait until every rank's faults have begun (with none, until every rank
        trains); the wall time they all had begun by."""
        assert wait_for(lambda: self.started() is not None or not self.alive(), timeout), \
            "the ranks' faults never began (or they never started training)"
        started = self.started()
        assert started is not None, \
            f"the job ended before every rank's faults began: {self.error!r}"
        return started

    def alive(self) -> bool:
        """True while the job runs."""
        return self._thread.is_alive()

    def join(self, timeout: float = 240.0) -> list[dict[str, Any]]:
        """Wait for the job; each rank's results (failing if the job failed)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the job did not finish"
        if self.error is not None:
            raise self.error
        assert self.results is not None
        return self.results

    def step_starts(self, rank: int) -> list[tuple[float, float]]:
        """``(wall time the step began, its duration)`` for each step of ``rank``."""
        assert self.results is not None and self.spec.fault_mark_dir
        t0 = float(Path(self.spec.fault_mark_dir, f"fault-rank{rank}").read_text())
        times = self.results[rank]["times"]
        starts = [t0, *itertools.accumulate(times, initial=t0)][1:-1]
        return list(zip(starts, times, strict=True))


def median_between(job: BackgroundJob, t0: float, t1: float, skip: int = 5) -> float:
    """Median step time of every rank over the steps that began in ``[t0, t1)``
    (each rank's first ``skip`` steps, its warm-up, left out)."""
    vals = [d for r in range(job.spec.world_size)
            for i, (s, d) in enumerate(job.step_starts(r)) if i >= skip and t0 <= s < t1]
    assert len(vals) >= 5, f"too few steps between {t0:.1f} and {t1:.1f}: {len(vals)}"
    return statistics.median(vals)


def kept_pace(fault: str, before: float, during: float, after: float,
              bound: float = 1.5) -> dict[str, float]:
    """Assert that the job's median step during ``fault`` stayed under ``bound`` times
    the slower of the medians before and after it, and return the figures for the
    reliability table. Both sides, because this shared machine's pace moves by tens of
    percent over seconds: one side alone would measure the machine, not the fault."""
    print(f"median step: {before * 1e3:.2f} ms before, {during * 1e3:.2f} ms during "
          f"{fault}, {after * 1e3:.2f} ms after")
    assert during < bound * max(before, after), (fault, before, during, after)
    return {"step_ratio_to_before": round(during / before, 3),
            "step_ratio_to_after": round(during / after, 3)}


def recorded(path: Path | str) -> tuple[dict[int, list[int]], dict[int, int], list[str]]:
    """What a recording holds: each rank's steps in order, each rank's records of
    every table, and the kinds of its frames in order."""
    steps: dict[int, list[int]] = defaultdict(list)
    records: Counter[int] = Counter()
    kinds = []
    for _, frame in read(path):
        kinds.append(frame.kind)
        if frame.kind == wire.KIND_BATCH:
            rank = frame.payload["rank"]
            steps[rank] += [row[_STEP] for row in frame.payload.get("steps", [])]
            records[rank] += sum(len(frame.payload.get(t) or []) for t in TABLES)
    return dict(steps), dict(records), kinds


def twice(steps: list[int]) -> list[int]:
    """The steps that appear more than once."""
    return sorted(s for s, n in Counter(steps).items() if n > 1)


def rss_mb(pid: int) -> float:
    """A process's resident memory, MB."""
    return psutil.Process(pid).memory_info().rss / 1e6


class PeakRss:
    """Samples processes' resident memory every ``every_s`` on a thread: the first
    and the highest figure of each (MB)."""

    def __init__(self, pids: list[int], every_s: float = 0.2) -> None:
        self.first: dict[int, float] = {}
        self.peak: dict[int, float] = {}
        self._pids = pids
        self._every = every_s
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for pid in self._pids:
            try:
                mb = rss_mb(pid)
            except psutil.Error:
                continue
            self.first.setdefault(pid, mb)
            self.peak[pid] = max(self.peak.get(pid, 0.0), mb)

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            self._sample()

    def growth(self) -> dict[int, float]:
        """Peak minus first figure, MB, by process."""
        return {pid: self.peak[pid] - self.first[pid] for pid in self.first}

    def close(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join(2)


def header_text(snap: dict[str, Any]) -> str:
    """The TUI header's second line for a snapshot, as the header draws it (the same
    widget, run in a headless app)."""
    import asyncio

    from textual.app import App, ComposeResult

    from rtop.tui.header import JobHeader

    class _One(App[None]):
        def compose(self) -> ComposeResult:
            yield JobHeader()

    async def main() -> str:
        app = _One()
        async with app.run_test(size=(240, 5)):
            header = app.query_one(JobHeader)
            header.show(snap)  # type: ignore[arg-type]
            return str(header.render())

    return asyncio.run(main())


def proc_alive(pid: int) -> bool:
    """True if ``pid`` runs (and is not a zombie)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class JobNetns:
    """A network namespace for a job's ranks, joined to this one by a veth pair: the
    hub listens on ``hub_ip`` (this side), the ranks reach it through ``host_dev``'s
    peer ``dev`` inside ``ns``. Root only; :meth:`build` skips the test where it cannot
    be built."""

    def __init__(self, ns: str, dev: str, host_dev: str, hub_ip: str, job_ip: str) -> None:
        self.ns, self.dev, self.host_dev = ns, dev, host_dev
        self.hub_ip, self.job_ip = hub_ip, job_ip

    def sh(self, *cmd: str) -> None:
        """Run a command, failing on error."""
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def build(self) -> JobNetns:
        """Make the namespace and the link (skipping the test if it cannot)."""
        import shutil

        import pytest

        if os.geteuid() != 0:
            pytest.skip("needs root to build network namespaces")
        if not shutil.which("ip"):
            pytest.skip("needs the 'ip' command (iproute2)")
        self.teardown()
        try:
            self.sh("ip", "netns", "add", self.ns)
            self.sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            self.sh("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name",
                    self.dev)
            self.sh("ip", "link", "set", self.dev, "netns", self.ns)
            self.sh("ip", "addr", "add", f"{self.hub_ip}/24", "dev", self.host_dev)
            self.sh("ip", "link", "set", self.host_dev, "up")
            self.sh("ip", "-n", self.ns, "addr", "add", f"{self.job_ip}/24", "dev", self.dev)
            self.sh("ip", "-n", self.ns, "link", "set", self.dev, "up")
        except subprocess.CalledProcessError as exc:
            self.teardown()
            pytest.skip(f"cannot build network namespaces here: {exc.stderr.strip()}")
        return self

    def teardown(self) -> None:
        """Remove the namespace and the link (whatever exists of them)."""
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)

    def start_ranks(self, spec: WorkloadSpec, out: Path, port: int
                    ) -> list[subprocess.Popen[str]]:
        """The job's ranks (:mod:`rtop.workload`), inside the namespace; each writes
        ``out/rank<r>.json``."""
        return start_ranks(spec, out, port, prefix=("ip", "netns", "exec", self.ns))


def start_ranks(spec: WorkloadSpec, out: Path, port: int, prefix: tuple[str, ...] = ()
                ) -> list[subprocess.Popen[str]]:
    """The job's ranks, each a process of its own (``python -m rtop.workload``, after
    ``prefix``: ``ip netns exec NS`` puts them in a namespace), rendezvous on
    ``127.0.0.1:port``; each writes ``out/rank<r>.json``. Their environment is this
    process's (a test's ``monkeypatch.setenv`` reaches them)."""
    env = {**os.environ, "RTOP_AUTOHUB": "0", "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen(
        [*prefix, sys.executable, "-m", "rtop.workload",
         "--rank", str(r), "--local-rank", str(r), "--master", f"127.0.0.1:{port}",
         "--spec", spec.to_json(), "--out", str(out)], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(spec.world_size)]


def finish_ranks(procs: list[subprocess.Popen[str]], out: Path, timeout: float = 120.0
                 ) -> list[dict[str, Any]]:
    """Wait for ranks started by :meth:`JobNetns.start_ranks`; their results."""
    import json

    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))]


def kill_ranks(procs: list[subprocess.Popen[str]]) -> None:
    """Kill whatever of ``procs`` still runs."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def median_steps(results: list[dict[str, Any]], marks: Path, t0: float, t1: float,
                 skip: int = 5) -> float:
    """Median step time of every rank over the steps that began in ``[t0, t1)``, for
    ranks that wrote ``marks/fault-rank<r>`` at their step 0 (``fault_mark_dir``) and
    their step times to ``results`` (each rank's first ``skip`` steps left out)."""
    vals = []
    for rank, res in enumerate(results):
        t = float((marks / f"fault-rank{rank}").read_text())
        for i, d in enumerate(res["times"]):
            if i >= skip and t0 <= t < t1:
                vals.append(d)
            t += d
    assert len(vals) >= 5, f"too few steps between {t0:.1f} and {t1:.1f}: {len(vals)}"
    return statistics.median(vals)


def acked_once(path: Path | str, results: list[dict[str, Any]]) -> dict[str, int]:
    """Assert that every record the hub acknowledged to a rank is in the recording at
    ``path`` exactly once: no step recorded twice, and each rank's records in the
    recording are the records the hub acknowledged (``sent_records``, none let go
    unconfirmed) plus those the rank spooled at its exit (that the hub had, or took);
    a step missing from the recording is one the rank dropped and counted. Returns
    the figures: ``acked`` records, ``lost`` (acknowledged, not recorded: 0 here),
    ``dropped`` (counted by the ranks), ``resent_frames`` (sent again after a break),
    ``spooled`` (not acknowledged when the rank ended: spooled, and recorded)."""
    steps, records, _ = recorded(path)
    acked = dropped = resent = spooled = 0
    for rank, res in enumerate(results):
        stats = res["stats"]
        mine = steps.get(rank, [])
        assert stats["unconfirmed_records"] == 0, (rank, stats)
        assert not twice(mine), (rank, twice(mine)[:20])
        assert records.get(rank, 0) == stats["sent_records"] + stats["spooled_records"], \
            (rank, records.get(rank, 0), stats)
        lost_here = stats["dropped_unsent"] + stats["dropped_buffer"]
        missing = set(range(len(res["times"]))) - set(mine)
        assert len(missing) <= lost_here, (rank, sorted(missing)[:20], stats)
        acked += stats["sent_records"]
        dropped += lost_here
        resent += stats["resent_frames"]
        spooled += stats["spooled_records"]
    return {"acked": acked, "lost": 0, "dropped": dropped, "resent_frames": resent,
            "spooled": spooled}


def relay_pids() -> list[int]:
    """The live relays of this test's runtime directory (each named by the discovery
    file it wrote, ``relay-<key>.json``): the ones its ranks started."""
    from collectors.discovery import read_hub_file, runtime_dir

    pids = []
    for path in sorted(runtime_dir().glob("relay-*.json")):
        info = read_hub_file(path)
        if info is not None and proc_alive(int(info["pid"])):
            pids.append(int(info["pid"]))
    return pids


def stop_relays() -> None:
    """Stop the relays of this test's runtime directory (:func:`relay_pids`), stopped
    (SIGSTOP) ones included."""
    for pid in relay_pids():
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
