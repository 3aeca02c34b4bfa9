"""A rank is SIGKILLed: the hub names it, and only it, even though the launcher tears the
other ranks down milliseconds later (issue 15).

Real processes only: gloo DDP ranks with the real collectors (tests/lost_workers.py)
under ``torch.multiprocessing`` and under torchrun, reporting to a real hub
(:class:`rtop.hub.service.ThreadedHub`); and plain Python processes for the SIGTERM
goodbye itself (:mod:`collectors.lastgasp`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from collectors import auth
from rtop.analysis import AnalysisConfig
from rtop.hub.service import ThreadedHub
from rtop.report import build_report
from tests import reliability, waiting
from tests.lost_workers import train

#: This module's pace: polled every 50 ms.
wait_for = partial(waiting.wait_for, every=0.05)

pytest.importorskip("torch")

MASTER = "lost-culprit-master-token"
INGEST = auth.role_token(MASTER, "ingest")
LOST_AFTER_S = 10.0  # the hub's default timeout: a lost rank must be shown within it
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_hub(tmp: Path) -> ThreadedHub:
    return ThreadedHub(record=str(tmp / "run.rtop"), token=MASTER,
                       thresholds=AnalysisConfig(), lost_after_s=LOST_AFTER_S).start()


def lost_finding(hub: ThreadedHub) -> dict[str, Any] | None:
    for f in hub.call(lambda h: h.snapshot()["findings"]):
        if f["kind"] == "lost_rank":
            return dict(f)
    return None


def steps_done(out: Path, rank: int) -> list[int]:
    path = out / f"steps-rank{rank}"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def wait_steps(out: Path, ranks: list[int], n: int, timeout: float) -> None:
    ok = wait_for(lambda: all(len(steps_done(out, r)) >= n for r in ranks), timeout, every=0.1)
    assert ok, f"the ranks did not reach step {n}: " + str(
        {r: len(steps_done(out, r)) for r in ranks})


def hub_steps(hub: ThreadedHub, rank: int) -> set[int]:
    detail = hub.call(lambda h: h.rank_detail(rank))
    return {int(s) for s in detail["steps"]["step"] if s is not None}


def assert_views_intact(hub: ThreadedHub, out: Path, ranks: list[int]) -> dict[int, int]:
    """Every step a surviving rank finished is in the hub's window of it."""
    done = {}
    for r in ranks:
        finished = steps_done(out, r)
        assert finished, f"rank {r} finished no step"
        missing = sorted(set(finished) - hub_steps(hub, r))
        assert not missing, f"rank {r}: steps {missing[:10]} never reached the hub"
        done[r] = len(finished)
    return done


def rank_states(hub: ThreadedHub) -> dict[int, dict[str, Any]]:
    """Each rank's state at the hub, for a failure's message."""
    def read(h: Any) -> dict[int, dict[str, Any]]:
        return {rs.rank: {"status": rs.status, "last_seen": round(rs.last_seen, 3),
                          "lost_at": rs.lost_at, "lost_how": rs.lost_how,
                          "bye": rs.bye_reason, "error": rs.meta.get("error"),
                          "connected": rs.connected, "last_step": rs.last_step}
                for rs in h.state.active_ranks()}
    return hub.call(read)  # type: ignore[no-any-return]


def named(hub: ThreadedHub, culprits: list[int], followers: list[int], timeout: float
          ) -> dict[str, Any]:
    """Wait until the lost_rank finding names ``culprits`` with ``followers``."""
    def right() -> dict[str, Any] | None:
        f = lost_finding(hub)
        if f and f["ranks"] == culprits and \
                sorted(f["evidence"]["lost_after_them"]) == followers:
            return f
        return None

    f = wait_for(right, timeout)
    assert f is not None, (f"not named {culprits} then {followers}: {lost_finding(hub)}; "
                           f"the ranks at the hub: {rank_states(hub)}")
    return f


def first_named(hub: ThreadedHub, timeout: float) -> tuple[float, dict[str, Any]]:
    """The hub's lost_rank finding as it first appears, and when (time.time())."""
    f = wait_for(lambda: lost_finding(hub), timeout, every=0.02)
    assert f is not None, "no lost_rank finding"
    return time.time(), f


def run_spawned(tmp: Path, world: int, opts: dict[str, Any],
                fault: Callable[[Path], None] | None = None
                ) -> tuple[ThreadedHub, Path, Any]:
    """Start ``world`` ranks under torch.multiprocessing (a thread joins them as
    ``mp.spawn`` does: the first to die gets the rest terminated with SIGTERM)."""
    import threading

    import torch.multiprocessing as mp

    out = tmp / "out"
    out.mkdir()
    hub = start_hub(tmp)
    ctx = mp.start_processes(train, args=(world, free_port(), hub.address, INGEST, str(out),
                                          opts), nprocs=world, start_method="spawn",
                             join=False)
    box: dict[str, Any] = {}

    def join() -> None:
        try:
            while not ctx.join(timeout=0.05):
                pass
        except Exception as exc:  # ProcessExitedException: what mp.spawn raises
            box["error"] = exc

    joiner = threading.Thread(target=join, daemon=True)
    joiner.start()
    box["joiner"] = joiner
    return hub, out, (ctx, box)


def end_spawned(handle: Any, timeout: float = 40.0) -> Any:
    ctx, box = handle
    box["joiner"].join(timeout)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    return box.get("error")


def test_spawn_sigkilled_rank_is_named_alone_its_peers_as_followers(tmp_path):
    hub, out, handle = run_spawned(tmp_path, 3, {"kill_at": {1: 25}})
    try:
        t_shown, first = first_named(hub, 60.0)
        killed_at = float((out / "killed-rank1").read_text())
        f = named(hub, [1], [0, 2], 5.0)
        error = end_spawned(handle)
        assert error is not None and "signal SIGKILL" in str(error)  # mp.spawn's own word
        assert first["ranks"] == [1], first  # named alone from its first appearance
        shown_s = t_shown - killed_at
        assert shown_s <= LOST_AFTER_S, f"lost shown after {shown_s:.1f} s"
        ev = f["evidence"]
        assert ev["ranks"]["1"]["how"] in ("reset", "eof")
        followers = ev["followers"]
        # torn down by mp.spawn's SIGTERM, and they said so on the way out
        assert {followers["0"]["how"], followers["2"]["how"]} == {"SIGTERM"}, followers
        assert all(0 <= followers[r]["after_s"] < 1.0 for r in ("0", "2")), followers
        assert f["summary"].startswith("Rank 1 died (connection "), f["summary"]
        assert "ranks 0 and 2 were torn down after it (SIGTERM)." in f["summary"]
        for r in (0, 2):
            assert json.loads((out / f"lastgasp-rank{r}").read_text()) is True
        done = assert_views_intact(hub, out, [0, 2])
    finally:
        end_spawned(handle, 5.0)
        hub.stop()
    # the recording says the same when replayed (rtop report)
    reported = [x for x in build_report(tmp_path / "run.rtop")["findings"]
                if x["kind"] == "lost_rank"]
    assert reported and reported[0]["ranks"] == [1], reported
    assert sorted(reported[0]["evidence"]["lost_after_them"]) == [0, 2], reported
    reliability.record(fault="rank 1 of 3 SIGKILLed under torch.multiprocessing spawn",
                       outcome=f"named rank 1 alone; 0, 2 followers (SIGTERM); "
                               f"{f['summary']}", lost=0,
                       lost_shown_s=round(shown_s, 2), named=f["ranks"],
                       followers=ev["lost_after_them"], survivor_steps=done)


def test_torchrun_sigkilled_rank_is_named_alone_its_peers_as_followers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    hub = start_hub(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "3", "--monitor-interval", "0.1",
           str(ROOT / "tests" / "lost_workers.py"), hub.address, INGEST, str(out),
           json.dumps({"kill_at": {"1": 25}})]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        t_shown, first = first_named(hub, 90.0)
        killed_at = float((out / "killed-rank1").read_text())
        f = named(hub, [1], [0, 2], 10.0)
        log = proc.communicate(timeout=60)[0].decode(errors="replace")
        assert proc.returncode != 0
        assert "Signal 9 (SIGKILL)" in log or "SIGKILL" in log, log[-3000:]
        assert first["ranks"] == [1], first
        shown_s = t_shown - killed_at
        assert shown_s <= LOST_AFTER_S, f"lost shown after {shown_s:.1f} s"
        ev = f["evidence"]
        assert ev["ranks"]["1"]["how"] in ("reset", "eof")
        assert {ev["followers"]["0"]["how"], ev["followers"]["2"]["how"]} == {"SIGTERM"}, ev
        assert "ranks 0 and 2 were torn down after it (SIGTERM)." in f["summary"]
        done = assert_views_intact(hub, out, [0, 2])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        hub.stop()
    reliability.record(fault="rank 1 of 3 SIGKILLed under torchrun",
                       outcome=f"named rank 1 alone; 0, 2 followers (SIGTERM); "
                               f"{f['summary']}", lost=0,
                       lost_shown_s=round(shown_s, 2), named=f["ranks"],
                       followers=ev["lost_after_them"], survivor_steps=done)


def test_a_node_dying_whole_names_all_its_ranks(tmp_path):
    nodes = ["node-a", "node-a", "node-b", "node-b"]
    hub, out, handle = run_spawned(tmp_path, 4, {"nodes": nodes})
    try:
        wait_steps(out, [0, 1, 2, 3], 20, 90.0)
        pids = [int((out / f"pid-rank{r}").read_text()) for r in (2, 3)]
        killed_at = time.time()
        for pid in pids:  # node-b goes away: both its ranks at once, no word from either
            os.kill(pid, signal.SIGKILL)
        t_shown, first = first_named(hub, 30.0)
        f = named(hub, [2, 3], [0, 1], 5.0)
        end_spawned(handle)
        assert first["ranks"] == [2, 3], first
        shown_s = t_shown - killed_at
        assert shown_s <= LOST_AFTER_S
        ev = f["evidence"]
        assert ev["whole_node"] == "node-b"
        assert {ev["ranks"][r]["node"] for r in ("2", "3")} == {"node-b"}
        assert f["summary"].startswith("Ranks 2 and 3 died together, every rank of node "
                                       "node-b (connection "), f["summary"]
        done = assert_views_intact(hub, out, [0, 1])
    finally:
        end_spawned(handle, 5.0)
        hub.stop()
    reliability.record(fault="node-b (ranks 2, 3 of 4) SIGKILLed whole",
                       outcome=f"named ranks 2, 3 (node-b); 0, 1 followers; {f['summary']}",
                       lost=0, lost_shown_s=round(shown_s, 2), named=f["ranks"],
                       followers=ev["lost_after_them"], survivor_steps=done)


def test_a_jobs_own_sigterm_handler_is_kept(tmp_path):
    hub, out, handle = run_spawned(tmp_path, 3, {"kill_at": {1: 25}, "own_handler": True})
    try:
        f = named(hub, [1], [0, 2], 60.0)
        end_spawned(handle)
        for r in (0, 2):
            # rtop installed nothing, and the job's handler ran when mp.spawn's SIGTERM came
            assert json.loads((out / f"lastgasp-rank{r}").read_text()) is False
            assert (out / f"handler-rank{r}").read_text() == "ran"
        # the job's handler exits: the interpreter's exit says goodbye ("exit")
        assert {f["evidence"]["followers"][r]["how"] for r in ("0", "2")} == {"exit"}, f
        assert "ranks 0 and 2 exited after it" in f["summary"]
        done = assert_views_intact(hub, out, [0, 2])
    finally:
        end_spawned(handle, 5.0)
        hub.stop()
    reliability.record(fault="rank 1 of 3 SIGKILLed; the job has its own SIGTERM handler",
                       outcome=f"rtop installed nothing, the job's handler ran; named rank 1 "
                               f"alone; {f['summary']}", lost=0, named=f["ranks"],
                       followers=f["evidence"]["lost_after_them"], survivor_steps=done)


# ---- the order at the hub: a teardown's goodbye handled before the death ----------------

def _hand_ranks(hub: ThreadedHub, world: int) -> list[Any]:
    from tests.rankclient import RankClient, step_row

    ranks = [RankClient(hub.address, INGEST, r, world=world) for r in range(world)]
    for c in ranks:
        assert c.recv() is not None  # the welcome
        c.batch(steps=[step_row(s) for s in range(5)])
    assert wait_for(lambda: len(rank_states(hub)) == world, 10.0), rank_states(hub)
    return ranks


@pytest.mark.parametrize("before_s,error,follows", [
    (0.0, "terminated by SIGTERM", True),  # its goodbye handled first, in the same turn
    (0.1, "terminated by SIGTERM", True),  # ... or a turn or two before (a busy hub)
    (1.0, "terminated by SIGTERM", False),  # a SIGTERM long before: not a teardown of it
    (0.0, "RuntimeError: CUDA error", False),  # a failure before the loss: not after it
])
def test_a_teardown_goodbye_handled_before_the_death_still_follows(tmp_path, before_s,
                                                                   error, follows):
    """mp.spawn SIGTERMs rank 0 after rank 1 died, but rank 0's goodbye and rank 1's
    closed connection reach the hub's loop together and the goodbye can be handled
    first (seen under load: 0.2-1.5 ms before). Rank 0 is still rank 1's follower."""
    from collectors import wire

    hub = start_hub(tmp_path)
    ranks = _hand_ranks(hub, 3)
    try:
        ranks[0].send(wire.KIND_BYE, {"rank": 0, "group": "g0", "dropped": 0,
                                      "reason": "signal", "error": error})
        assert wait_for(lambda: rank_states(hub)[0]["status"] == "failed", 5.0)
        time.sleep(before_s)
        ranks[1].close()  # rank 1 dies: its connection closes without a goodbye
        assert wait_for(lambda: lost_finding(hub), 5.0)
        ranks[2].send(wire.KIND_BYE, {"rank": 2, "group": "g0", "dropped": 0,
                                      "reason": "signal", "error": "terminated by SIGTERM"})
        expect = [0, 2] if follows else [2]
        f = named(hub, [1], expect, 5.0)
        followers = f["evidence"]["followers"]
        assert followers["2"]["how"] == "SIGTERM"
        if follows:
            assert followers["0"] == {"node": "node-a", "how": "SIGTERM", "after_s": 0.0}
            assert "ranks 0 and 2 were torn down after it (SIGTERM)." in f["summary"]
    finally:
        for c in ranks:
            c.close()
        hub.stop()


# ---- the goodbye on SIGTERM in plain processes -------------------------------------------

RANK = """
import os, signal, sys, time
import collectors
from collectors import lastgasp
mode = sys.argv[1]
if mode == "own-before":
    signal.signal(signal.SIGTERM, lambda s, f: (print("job handler", flush=True), sys.exit(3)))
probe = collectors.start(hub=os.environ["HUB"], token=os.environ["TOK"], rank=0,
                         world_size=1, local_rank=0, flush_interval_s=0.2)
print("installed", lastgasp.installed(), flush=True)
if mode == "own-after":
    previous = signal.getsignal(signal.SIGTERM)  # rtop's
    def handler(s, f):
        print("job handler", flush=True)
        if callable(previous):
            previous(s, f)  # chained, as Lightning does: rtop's must leave it to the job
        time.sleep(0.5)  # the watch thread must not end the process meanwhile
        print("job handler done", flush=True)
        sys.exit(4)
    signal.signal(signal.SIGTERM, handler)
with probe.step():
    pass
time.sleep(0.5)
print("ready", flush=True)
if mode == "fork":  # a forked child (a data-loader worker) SIGTERMed: it alone dies
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    print("child", child, flush=True)
    _, status = os.waitpid(child, 0)
    print("child ended", os.waitstatus_to_exitcode(status), flush=True)
if mode == "stuck":  # the main thread blocked in C for good: a mutex locked twice
    import ctypes
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
while True:
    time.sleep(0.01)
"""


def run_rank(hub: ThreadedHub, mode: str, **env: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", RANK, mode], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "HUB": hub.address, "TOK": INGEST, **env})
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready"):
            break
    return proc, "".join(lines)


def rank0_status(hub: ThreadedHub) -> tuple[str | None, str | None]:
    def read(h: Any) -> tuple[str | None, str | None]:
        rs = h.state.rank_state(0)
        return (rs.status, rs.meta.get("error")) if rs is not None else (None, None)
    return hub.call(read)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["plain", "stuck"])
def test_sigterm_says_goodbye_and_dies_of_sigterm(tmp_path, mode):
    hub = start_hub(tmp_path)
    try:
        proc, said = run_rank(hub, mode)
        assert "installed True" in said, said
        time.sleep(0.3)  # "stuck": the main thread is in pthread_mutex_lock by now
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=10)[0]
        died_s = time.monotonic() - t0
        assert proc.returncode == -signal.SIGTERM, (proc.returncode, said + rest)
        assert died_s < 1.0, f"died {died_s:.2f} s after SIGTERM"
        got = wait_for(lambda: rank0_status(hub)[0] == "failed", 5.0)
        assert got, rank0_status(hub)
        assert rank0_status(hub) == ("failed", "terminated by SIGTERM")
    finally:
        hub.stop()
    reliability.record(fault=f"SIGTERM to a rank ({mode} main thread)",
                       outcome="goodbye 'terminated by SIGTERM' reached the hub; the "
                               "process died of SIGTERM", lost=0,
                       death_after_sigterm_s=round(died_s, 3))


@pytest.mark.parametrize("mode,code", [("own-before", 3), ("own-after", 4)])
def test_the_jobs_sigterm_handler_runs_not_rtops(tmp_path, mode, code):
    hub = start_hub(tmp_path)
    try:
        proc, said = run_rank(hub, mode)
        # before: rtop installs nothing; after: the job's handler replaces rtop's
        assert f"installed {mode == 'own-after'}" in said, said
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=10)[0]
        assert proc.returncode == code, (proc.returncode, said + rest)
        assert "job handler" in rest
        if mode == "own-after":
            assert "job handler done" in rest
        # the job exited through its own handler: the interpreter's exit said goodbye
        assert wait_for(lambda: rank0_status(hub)[0] == "exited", 5.0), rank0_status(hub)
    finally:
        hub.stop()


def test_a_forked_child_dies_of_sigterm_alone(tmp_path):
    hub = start_hub(tmp_path)
    try:
        proc, _ = run_rank(hub, "fork")
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("child "), line
        os.kill(int(line.split()[1]), signal.SIGTERM)
        assert proc.stdout.readline().strip() == f"child ended {-signal.SIGTERM}"
        time.sleep(0.5)
        assert proc.poll() is None, "the parent died of its child's SIGTERM"
        assert rank0_status(hub)[0] == "active"
        proc.send_signal(signal.SIGTERM)  # and the parent still says goodbye on its own
        proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGTERM
        assert wait_for(lambda: rank0_status(hub) == ("failed", "terminated by SIGTERM"), 5.0)
    finally:
        hub.stop()


def test_rtop_disabled_installs_nothing(tmp_path):
    script = textwrap.dedent("""
        import signal, collectors
        collectors.start()
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "RTOP_DISABLE": "1"}, timeout=60)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
