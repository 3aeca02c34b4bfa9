"""``rtop demo``: the command line, the pieces of the demo job, and one real headless run
of a Ray Train job with a starved rank."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from rtop import demo
from rtop.analysis import RANK_FAULTS
from rtop.workload import WorkloadSpec


def test_demo_help_lists_the_faults():
    proc = subprocess.run([sys.executable, "-m", "rtop", "demo", "--help"],
                          capture_output=True, text=True, timeout=60, check=True)
    for flag in ("--fault", "--workers", "--headless", "--duration", "--record"):
        assert flag in proc.stdout
    for fault in ("starved", "straggler", "memory", "hang", "none"):
        assert fault in proc.stdout
    # the command line offers exactly the faults the demo knows
    assert set(demo.FAULTS) == {"starved", "straggler", "memory", "hang", "none"}


@pytest.mark.parametrize("argv", [["--workers", "5"], ["--workers", "1"], ["--fault", "x"]])
def test_demo_rejects_bad_arguments(argv):
    proc = subprocess.run([sys.executable, "-m", "rtop", "demo", "--headless", *argv],
                          capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_demo_job_checks_its_arguments():
    with pytest.raises(ValueError, match="unknown fault"):
        demo.DemoJob("bogus")
    with pytest.raises(ValueError, match="2 to 4"):
        demo.DemoJob("starved", workers=5)


@pytest.mark.parametrize("fault", sorted(demo.FAULTS))
def test_every_fault_is_on_rank_1_after_healthy_steps_and_survives_json(fault):
    job = demo.DemoJob(fault, workers=2, duration_s=30.0)
    spec = job._spec()
    again = WorkloadSpec.from_json(spec.to_json())
    assert again == spec
    f = spec.faults
    if fault == "none":
        assert demo.FAULTS[fault].expect is None
        return
    assert f.start_step == demo.FAULT_STEP >= 40
    keyed = {**f.loader_sleep_s, **f.extra_compute_s, **f.hang_at_step,
             **f.mem_grow_bytes_per_step}
    assert set(keyed) == {1}
    assert demo.FAULTS[fault].expect in RANK_FAULTS
    assert spec.batch == 768 and spec.dim == 256 and spec.hidden == 512 and spec.layers == 3


def test_a_stop_file_ends_the_run_at_the_next_check(tmp_path):
    """How the demo stops its job early (``WorkloadSpec.stop_file``): the ranks leave the
    loop together at the next 20-step check once the file exists, and not before."""
    from rtop.workload import build_model, train_loop

    stop = tmp_path / "stop"
    spec = WorkloadSpec(world_size=1, steps=50, dim=8, hidden=8, batch=4, stop_file=str(stop))
    assert len(train_loop(0, spec, build_model(spec), None)) == 50
    stop.touch()
    timed = WorkloadSpec(world_size=1, duration_s=300.0, dim=8, hidden=8, batch=4,
                         stop_file=str(stop))
    assert len(train_loop(0, timed, build_model(timed), None)) == 20


def test_a_start_file_starts_the_faults_when_it_appears(tmp_path):
    """``Faults.start_file``: the faults begin at the first step at which the file exists
    (from ``start_step`` on), whatever the pace of the steps; the rank marks that moment."""
    from rtop.workload import Faults, build_model, train_loop

    start, marks = tmp_path / "start", tmp_path / "marks"
    marks.mkdir()
    # no file: no fault and no mark, however long the run
    quiet = WorkloadSpec(world_size=1, steps=30, dim=8, hidden=8, batch=4,
                         faults=Faults(loader_sleep_s={0: 0.1}, start_file=str(start)),
                         fault_mark_dir=str(marks))
    times = train_loop(0, quiet, build_model(quiet), None)
    assert len(times) == 30 and max(times) < 0.1, max(times)
    assert not (marks / "fault-rank0").exists()
    # the file appears during the run: every step from then on sleeps, none before
    timer = threading.Timer(0.5, start.touch)
    timer.start()
    spec = WorkloadSpec(world_size=1, duration_s=2.0, dim=8, hidden=8, batch=4,
                        faults=Faults(loader_sleep_s={0: 0.1}, start_file=str(start)),
                        fault_mark_dir=str(marks))
    began = time.time()
    times = train_loop(0, spec, build_model(spec), None)
    timer.join()
    slow = [i for i, t in enumerate(times) if t >= 0.1]
    assert slow and slow == list(range(slow[0], len(times))), slow
    assert slow[0] > 10  # fast steps came first
    mark = float((marks / "fault-rank0").read_text())
    assert began + 0.4 < mark < began + 1.5, (mark - began)


def test_logs_go_to_a_file_while_a_view_owns_the_terminal(tmp_path, capfd):
    log = logging.getLogger("rtop.test_demo")
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    try:
        with demo.logs_to_file(tmp_path / "demo.log"):
            log.warning("during the view")
        log.warning("after the view")
    finally:
        logging.getLogger().removeHandler(handler)
    err = capfd.readouterr().err
    assert "during the view" not in err and "after the view" in err
    assert "during the view" in (tmp_path / "demo.log").read_text()


def test_without_headless_the_live_view_gets_the_job_and_the_job_is_stopped(monkeypatch):
    calls: list[tuple] = []

    class FakeJob:
        address, token, record_path, error = "127.0.0.1:1", "tok", None, None

        def start(self):
            calls.append(("start",))
            return self

        def stop(self):
            calls.append(("stop",))

        def title(self):
            return "the demo"

    def attach(address, token, *, title=None):
        calls.append(("attach", address, token, title))
        return 0

    monkeypatch.setitem(sys.modules, "rtop.tui", types.SimpleNamespace(attach=attach))
    assert demo.run_tui(FakeJob()) == 0  # type: ignore[arg-type]
    assert calls == [("start",), ("attach", "127.0.0.1:1", "tok", "the demo"), ("stop",)]


@pytest.mark.ray
def test_headless_demo_names_the_starved_rank_and_nothing_else(tmp_path):
    """The demo's Ray Train job (2 CPU workers, rank 1's loader 40 ms slower from step
    FAULT_STEP) under the live hub: the starved rank named, live and in the report,
    within 3 s of the fault's onset, and no other rank fault; Ray's own output kept off
    the terminal. (The one test of the diagnosis on a Ray Train job: the scenario suite
    runs its faults on plain DDP jobs.)"""
    pytest.importorskip("ray")
    from collectors import wire
    from collectors.schema import TABLES
    from rtop.report import build_report
    from rtop.run.recording import read

    record = tmp_path / "demo.rtop"
    proc = subprocess.run(
        [sys.executable, "-m", "rtop", "demo", "--headless", "--duration", "14",
         "--fault", "starved", "--workers", "2", "--record", str(record)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # nothing from Ray or the workers reaches the terminal: only rtop's own lines
    assert proc.stderr == "", proc.stderr[-3000:]
    out = proc.stdout
    assert "findings: starved_rank on rank 1" in out  # a live progress line
    assert "starved_rank (ranks 1;" in out  # the report printed at the end
    report = build_report(Path(record))
    rank_faults = {(f["kind"], tuple(f["ranks"])) for f in report["findings"]
                   if f["kind"] in RANK_FAULTS}
    assert rank_faults == {("starved_rank", (1,))}, report["findings"]
    assert [r["status"] for r in report["ranks"]] == ["finished", "finished"]
    assert all(r["steps"] > 100 for r in report["ranks"])
    # how long after the onset: the report's diagnosis runs over the recording as the
    # hub ran it live (every half second of its time, on the frames as they arrived);
    # the onset is when rank 1 began its first slow step, by its own clock (this host's)
    fields = TABLES["steps"]
    onset = min(row[fields.index("t_wall")] for _, frame in read(record)
                if frame.kind == wire.KIND_BATCH and frame.payload["rank"] == demo.FAULT_RANK
                for row in frame.payload.get("steps", [])
                if row[fields.index("step")] >= demo.FAULT_STEP)
    starved = next(f for f in report["findings"] if f["kind"] == "starved_rank")
    assert 0 < starved["since"] - onset <= 3.0, f"named {starved['since'] - onset:.1f} s after"


def test_ray_that_does_not_start_is_reported_and_leaves_nothing_running(monkeypatch, capsys):
    def broken() -> None:
        raise RuntimeError("no raylet")

    monkeypatch.setattr(demo, "_quiet_ray", broken)
    job = demo.DemoJob("starved", workers=2, duration_s=5.0)
    assert demo.run_headless(job, every_s=0.5) == 1
    assert "rtop demo: Ray did not start: RuntimeError: no raylet" in capsys.readouterr().err
    assert not job.running and job._tmp is None
    assert not job.hub._thread.is_alive()


def test_a_failed_job_is_reported_with_a_non_zero_exit(monkeypatch, capsys):
    def fit(self) -> None:
        raise RuntimeError("worker 1 died")

    monkeypatch.setattr(demo.DemoJob, "_start_ray", lambda self: None)
    monkeypatch.setattr(demo.DemoJob, "_fit", fit)
    job = demo.DemoJob("starved", workers=2, duration_s=5.0)
    assert demo.run_headless(job, every_s=0.5) == 1
    assert isinstance(job.error, RuntimeError)
    assert not job.running
    err = capsys.readouterr().err
    assert "the Ray Train job failed: RuntimeError: worker 1 died" in err
