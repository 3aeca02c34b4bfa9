"""A job that ends with ``os._exit``: ``rtop run -- torchrun ...`` over a plain DDP script
(nothing of rtop in it) that skips its teardown the way many real scripts do.

* ``os._exit(0)`` after training: each rank's goodbye still goes out first
  (``collectors.osexit``), so both ranks end "exited", and no ``lost_rank`` is raised.
* ``os._exit(0)`` taken before the probe started (no goodbye can precede it): the hub
  sees two connections close without a word, then ``rtop run`` tells it the command
  exited 0 (a recorded ``job_exit`` frame); the ranks ended with the job, the
  ``lost_rank`` they made is withdrawn, live and in the report alike.
* a non-zero exit is still a failure: ``rtop run`` exits with the command's code
  (torchrun's 1), and the ranks are lost, with a ``lost_rank`` finding.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from collectors import wire
from rtop.report import build_report
from rtop.run.recording import read
from rtop.run.state import KIND_JOB_EXIT, RunState
from rtop.workload import free_port
from tests.test_rtop_run import TORCHRUN, _env, _run
from tests.test_security_ingest import hello


def _torchrun(tmp: Path, *script_args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    record = tmp / "exit.rtop"
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m",
                                                         "torch.distributed.run"]
    proc = _run(["--record", str(record), "--", *launcher, "--nproc-per-node", "2",
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                 "tests/exit_ddp_train.py", "--steps", "20", *script_args],
                _env(tmp), timeout=300)
    return proc, record


def _job_exits(record: Path) -> list[dict[str, object]]:
    return [frame.payload for _, frame in read(record) if frame.kind == KIND_JOB_EXIT]


def _goodbyes(record: Path) -> dict[int, str]:
    """Each rank's goodbye reason, by rank."""
    return {frame.payload["rank"]: frame.payload.get("reason") for _, frame in read(record)
            if frame.kind == wire.KIND_BYE}


def test_os_exit_0_says_goodbye_first(tmp_path):
    proc, record = _torchrun(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("trained") == 2, proc.stdout
    assert _goodbyes(record) == {0: "exit", 1: "exit"}
    report = build_report(record)
    assert {r["rank"]: r["status"] for r in report["ranks"]} == {0: "exited", 1: "exited"}
    assert all(r["steps"] == 20 for r in report["ranks"])
    assert not [f for f in report["findings"] if f["kind"] == "lost_rank"], report["findings"]
    assert [e["code"] for e in _job_exits(record)] == [0]


def test_os_exit_0_without_a_goodbye_ends_with_the_job_not_lost(tmp_path):
    proc, record = _torchrun(tmp_path, "--raw-exit")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _goodbyes(record) == {}  # the original os._exit: nothing could say goodbye
    assert [e["code"] for e in _job_exits(record)] == [0]
    report = build_report(record)
    assert {r["rank"]: r["status"] for r in report["ranks"]} == {0: "exited", 1: "exited"}
    assert not [f for f in report["findings"] if f["kind"] == "lost_rank"], report["findings"]
    # the same recording without rtop run's word: both ranks lost, as the hub saw it live
    # before the command's exit reached it
    state = RunState()
    for t, frame in read(record):
        if frame.kind != KIND_JOB_EXIT:
            state.apply(frame, t)
    assert sorted(rs.status for rs in state.active_ranks()) == ["lost", "lost"]


@pytest.mark.parametrize("extra", [("--exit-code", "3"), ("--exit-code", "3", "--raw-exit")])
def test_a_non_zero_exit_is_still_a_failure(tmp_path, extra):
    proc, record = _torchrun(tmp_path, *extra)
    assert proc.returncode == 1, proc.stderr[-4000:]  # torchrun's code for failed workers
    assert _goodbyes(record) == {}  # a failing rank says no goodbye
    assert [e["code"] for e in _job_exits(record)] == [1]
    report = build_report(record)
    assert {r["rank"]: r["status"] for r in report["ranks"]} == {0: "lost", 1: "lost"}
    lost = [f for f in report["findings"] if f["kind"] == "lost_rank"]
    assert lost and sorted(lost[0]["ranks"]) == [0, 1], report["findings"]


def test_a_rank_may_not_say_how_the_command_exited():
    from rtop.run.state import ProtocolError

    state = RunState()
    rank = state.apply(hello(0), 1.0)
    assert rank is not None
    with pytest.raises(ProtocolError, match="may not say how its command exited"):
        state.apply(wire.Frame(KIND_JOB_EXIT, {"code": 0, "exited_at": 1.0}), 1.0, peer=rank)
    assert state.job_exit is None
