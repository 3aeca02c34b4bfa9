"""The control channel end to end (issue 13): a real 2-rank DDP job over gloo with the
real collectors, a real hub, and ``rtop profile|probe|stacks`` as a user runs them.

What is checked: each action reaches the ranks through the hub and its answer comes
back (stacks off the training thread, so a hung rank answers; profile and probe at a
step common to every rank, on the training thread); the job goes on and finishes
normally afterwards; a wrong token is refused with a non-zero exit and never printed;
a rank that does not answer is named by the deadline; a probe that cannot start on
every rank starts on none.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import auth, wire
from rtop import workload
from rtop.client import HubClient, HubError
from rtop.hub.service import ThreadedHub
from rtop.workload import Faults, WorkloadSpec, run_local
from tests.rankclient import RankClient
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
MASTER = "control-test-master-token-0123456789"


class Job:
    """A hub and a 2-rank job streaming to it, in the background."""

    def __init__(self, tmp: Path, faults: Faults | None = None, duration_s: float = 90.0,
                 failure_grace_s: float = 5.0,
                 probe_settings: dict[str, Any] | None = None) -> None:
        self.failure_grace_s = failure_grace_s
        self.hub = ThreadedHub(record=str(tmp / "run.rtop"), token=MASTER).start()
        #: its appearance ends the job normally, before ``duration_s``
        self.stop_file = tmp / "stop"
        self.spec = WorkloadSpec(world_size=2, duration_s=duration_s, hub=self.hub.address,
                                 token=auth.role_token(MASTER, "ingest"), dim=64, hidden=128,
                                 faults=faults or Faults(all_loader_sleep_s=0.01),
                                 stop_file=str(self.stop_file),
                                 probe_settings=dict(probe_settings or {}))
        self.stop = threading.Event()
        self.results: list[dict[str, Any]] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.results = run_local(self.spec, timeout_s=300, check=False, stop=self.stop,
                                 failure_grace_s=self.failure_grace_s)

    def steps(self) -> list[int]:
        with HubClient(self.hub.address, MASTER) as c:
            return [int(s) for s in c.snapshot()["ranks"]["step"]]

    def running(self, at_least: int = 5) -> bool:
        steps = self.steps()
        return len(steps) == 2 and min(steps) >= at_least

    def pids(self) -> dict[int, int]:
        state = self.hub.hub.state  # type: ignore[union-attr]
        return {rs.rank: rs.identity.pid for rs in state.active_ranks()}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.hub.stop()


def rtop(*args: str, token: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RTOP_TOKEN", None)
    if token is not None:
        env["RTOP_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "rtop.cli", *args], env=env,
                          capture_output=True, text=True, timeout=240)


def control(job: Job) -> HubClient:
    return HubClient(job.hub.address, auth.role_token(MASTER, "control"), role="control")


@pytest.fixture
def short_job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path)
    try:
        assert wait_for(j.running, 90), "the job never reached the hub"
        yield j
    finally:
        j.close()


@pytest.mark.job
def test_stacks_profile_and_probe_through_the_hub(short_job: Job, tmp_path: Path) -> None:
    """The three actions as a user runs them, one after the other, on one job, which
    then finishes normally."""
    job = short_job
    ctl = auth.role_token(MASTER, "control")
    # stacks: every rank, every thread; the training thread is in the training loop
    t0 = time.monotonic()
    out = rtop("stacks", job.hub.address, "--json", token=ctl)
    assert out.returncode == 0, out.stderr
    stacks = json.loads(out.stdout)
    assert time.monotonic() - t0 < 30
    assert [r["rank"] for r in stacks["ranks"]] == [0, 1]
    for r in stacks["ranks"]:
        main = next(t for t in r["threads"] if t["name"] == "MainThread")
        functions = [f["function"] for f in main["frames"]]
        assert "train_loop" in functions, functions
        assert main["frames"][0]["function"] != "train_loop"  # outermost first
        assert any(t["name"] == "rtop-sender" for t in r["threads"])
    # profile: both ranks, 3 steps, traces torch-tb-profiler can read
    before = min(job.steps())
    out = rtop("profile", job.hub.address, "--ranks", "0,1", "--steps", "3",
               "--out", str(tmp_path / "traces"), "--json", token=ctl)
    assert out.returncode == 0, out.stderr + out.stdout
    prof = json.loads(out.stdout)
    assert prof["dir"] == str(tmp_path / "traces")
    assert sorted(t["rank"] for t in prof["traces"]) == [0, 1]
    for t in prof["traces"]:
        assert Path(t["path"]).is_file() and Path(t["path"]).stat().st_size > 0
    for r in prof["summary"]["ranks"]:
        names = [op["name"] for op in r["top_ops"]]
        assert any(n.startswith("aten::") for n in names), names
        assert r["compute_s"] > 0
    # probe: the link between the two ranks, measured over the job's own group
    out = rtop("probe", job.hub.address, "--bytes", str(1 << 20), "--json", token=ctl)
    assert out.returncode == 0, out.stderr + out.stdout
    probe = json.loads(out.stdout)
    assert probe["ranks"] == [0, 1] and len(probe["nodes"]) == 2
    m = probe["matrix_Bps"]
    assert m[0][0] is None and m[1][1] is None
    assert m[0][1] is not None and m[0][1] > 1e6 and m[1][0] == m[0][1]
    assert probe["findings"] == []  # one healthy link
    with HubClient(job.hub.address, MASTER) as c:
        links = c.snapshot()["links"]
        assert links is not None and links["ranks"] == [0, 1]
        assert [lk[:2] for lk in links["links"]] == [[0, 1]] and links["links"][0][2] > 1e6
    # the text forms read
    text = rtop("stacks", job.hub.address, token=ctl)
    assert text.returncode == 0 and "train_loop" in text.stdout
    # the job went on, and finishes normally when told to (all ranks leave the loop
    # together and close their probes)
    assert wait_for(lambda: min(job.steps()) > before + 20, 60)
    job.stop_file.touch()
    job.thread.join(60)
    assert job.results is not None and all(r.get("times") for r in job.results), \
        "the job did not finish normally"

    def finished() -> bool:
        with HubClient(job.hub.address, MASTER) as c:
            return bool(c.snapshot()["ranks"]["status"] == ["finished", "finished"])

    assert wait_for(finished, 10), "the ranks did not say goodbye to the hub"


@pytest.mark.parametrize("action", ["profile", "probe", "stacks"])
def test_each_action_refuses_a_wrong_token(action: str) -> None:
    hub = ThreadedHub(record="", token=MASTER).start()
    try:
        ranks = RankClient(hub.address, auth.role_token(MASTER, "ingest"), 0, world=1)
        assert ranks.recv().kind == wire.KIND_WELCOME
        for token, says in ((auth.role_token(MASTER, "view"), "control"),
                            (auth.role_token(MASTER, "ingest"), "control"),
                            ("a-wrong-token-of-enough-length-42", "wrong token"),
                            (None, "no token")):
            out = rtop(action, hub.address, "--json", token=token)
            assert out.returncode == 2, (token, out.stdout, out.stderr)
            assert says in out.stderr, out.stderr
            assert out.stdout == ""
            if token:
                assert token not in out.stderr
        with pytest.raises(HubError, match="control"):
            HubClient(hub.address, auth.role_token(MASTER, "view"), role="control")
        with HubClient(hub.address, auth.role_token(MASTER, "view")) as viewer, \
                pytest.raises(HubError, match="control token"):
            viewer.act(action)
    finally:
        hub.stop()


def test_a_rank_that_never_answers_is_named_by_the_deadline() -> None:
    hub = ThreadedHub(record="", token=MASTER).start()
    try:
        silent = RankClient(hub.address, auth.role_token(MASTER, "ingest"), 0, world=1)
        assert silent.recv().kind == wire.KIND_WELCOME
        with HubClient(hub.address, MASTER, role="control") as c:
            t0 = time.monotonic()
            out = c.act("stacks", timeout_s=1.0)
            assert time.monotonic() - t0 < 5
        assert out["missing"] == [0] and out["answers"] == []
        # and a rank that is not connected is refused at once, by number
        with HubClient(hub.address, MASTER, role="control") as c, \
                pytest.raises(HubError, match="rank 7 not connected"):
            c.act("stacks", ranks=[7])
    finally:
        hub.stop()


@pytest.mark.job
def test_a_hung_rank_answers_stacks_and_a_probe_starts_nowhere(tmp_path: Path) -> None:
    """Rank 1 hangs in the training loop (a known line of rtop/workload.py): its stacks
    still come back, at that line; a probe cannot start on every rank, so it starts on
    none and says why, by its deadline."""
    j = Job(tmp_path, Faults(all_loader_sleep_s=0.01, hang_at_step={1: 40}))
    try:
        assert wait_for(lambda: j.running(38), 90)
        time.sleep(1.0)  # rank 1 is now asleep at the hang; rank 0 waits in allreduce
        source, first = inspect.getsourcelines(workload.train_loop)
        line = first + next(i for i, text in enumerate(source)
                            if "time.sleep(3600)" in text)
        with control(j) as c:
            out = c.act("stacks", timeout_s=10)
        assert out["missing"] == [] and out["errors"] == []
        by_rank = {a["rank"]: a for a in out["answers"]}
        main = next(t for t in by_rank[1]["threads"] if t["name"] == "MainThread")
        inner = main["frames"][-1]
        assert (Path(inner["file"]).name, inner["function"], inner["line"]) == \
            ("workload.py", "train_loop", line)
        with control(j) as c:
            t0 = time.monotonic()
            out = c.act("probe", args={"bytes": 1 << 16}, timeout_s=6)
            took = time.monotonic() - t0
        assert took < 20
        assert out["cancelled"] and "links" not in out
        assert {e["rank"] for e in out["errors"]} == {0, 1}
    finally:
        j.close()


@pytest.mark.job
def test_a_rank_killed_during_a_probe_ends_it_for_everyone(tmp_path: Path) -> None:
    """SIGKILL rank 1 while the probe's transfers run: the probe ends with rank 1's
    error, rank 0's probe gives up on its dead peer instead of hanging, and the
    answer names both."""
    j = Job(tmp_path)
    try:
        assert wait_for(j.running, 90)
        pids = j.pids()
        result: dict[str, Any] = {}

        def ask() -> None:
            with control(j) as c:
                result["out"] = c.act("probe", args={"bytes": 64 << 20}, timeout_s=90)

        asker = threading.Thread(target=ask)
        asker.start()
        hub = j.hub.hub
        assert hub is not None
        assert wait_for(lambda: any(a.go_sent for a in list(hub.actions.running.values())),
                        30, every=0.01), "the probe never started"
        time.sleep(0.2)
        os.kill(pids[1], signal.SIGKILL)
        asker.join(120)
        assert not asker.is_alive(), "the probe's answer never came"
        out = result["out"]
        errors = {e["rank"]: e["error"] for e in out["errors"]}
        assert 1 in errors and "closed" in errors[1]
        assert 0 in errors or 0 in out["missing"]
        from tests import reliability

        reliability.record(
            "a rank SIGKILLed in the middle of a link probe's transfers",
            f"answer named rank 1 ({errors[1]!r}); rank 0's probe gave up on its dead peer "
            f"({errors.get(0, 'no answer by the deadline')!r})",
            "the probe's result (it could not finish)")
    finally:
        j.close()


@pytest.mark.job
def test_a_rank_killed_during_a_profile_is_named_and_rtop_holds_no_one(tmp_path: Path
                                                                       ) -> None:
    """SIGKILL rank 1 while both ranks capture a profile: the answer names rank 1 (its
    connection closed) by the deadline, and rank 0 is not held by rtop: the job's own
    allreduce with its dead peer fails, and rank 0 leaves on its own, never stuck in
    rtop's code (its training thread's stack, if it is still there, is the job's)."""
    from tests import reliability
    from tests.faultkit import proc_alive

    # 100 steps (the most a profile may take) of at least 50 ms: long enough to kill in
    j = Job(tmp_path, Faults(all_loader_sleep_s=0.05), failure_grace_s=120.0)
    try:
        assert wait_for(j.running, 90)
        pids = j.pids()
        result: dict[str, Any] = {}

        def ask() -> None:
            with control(j) as c:
                t0 = time.monotonic()
                result["out"] = c.act("profile", ranks=[0, 1],
                                      args={"steps": 100, "dir": str(tmp_path / "tr")},
                                      timeout_s=20)
                result["took"] = time.monotonic() - t0

        asker = threading.Thread(target=ask)
        asker.start()
        hub = j.hub.hub
        assert hub is not None

        def capturing() -> bool:
            acts = list(hub.actions.running.values())
            return any(a.at_step is not None and min(j.steps()) > a.at_step + 3
                       for a in acts)

        assert wait_for(capturing, 30, every=0.05), "the profile never started"
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        asker.join(60)
        assert not asker.is_alive(), "the profile's answer never came"
        out = result["out"]
        errors = {e["rank"]: e["error"] for e in out["errors"]}
        assert 1 in errors and "closed" in errors[1], out
        assert 0 in errors or 0 in out["missing"] or 0 in [a["rank"] for a in out["answers"]]
        assert result["took"] < 20 + 10
        # rank 0: out on its own (its allreduce fails on the dead peer) ...
        gone = wait_for(lambda: not proc_alive(pids[0]), 60, every=0.2)
        where = "left on its own"
        if not gone:  # ... or, if the job's collective waits on, not in rtop's code
            with control(j) as c:
                st = c.act("stacks", ranks=[0], timeout_s=10)
            main = next(t for t in st["answers"][0]["threads"] if t["name"] == "MainThread")
            inner = main["frames"][-1]["file"]
            assert "/collectors/" not in inner and "/rtop/" not in inner, main["frames"][-5:]
            where = f"blocked in the job's code ({Path(inner).name})"
        reliability.record(
            "a rank SIGKILLed in the middle of a profile",
            f"answer named rank 1 ({errors[1]!r}) in {result['took']:.1f} s; rank 0 "
            f"{where}, {time.monotonic() - killed:.0f} s after the kill",
            "rank 1's capture (it was killed)", answer_s=round(result["took"], 1))
    finally:
        j.close()
