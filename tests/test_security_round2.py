"""Security, second round (issue 24): what a holder of the ingest token, or anyone who can
connect, could do to the hub, the job and its view. One test per attack of the issue's
table (A, B, B2, C, G), replayed against a real hub process or a real hub thread and a
real 2-rank gloo job where the attack touches the job; each failed on the code before
the fix (see each test's docstring). ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from collectors import auth, wire
from rtop.client import HubClient
from rtop.hub.admission import addr_group
from rtop.hub.answers import MAX_ERROR, BadAnswer, clean_result
from rtop.hub.service import ThreadedHub
from rtop.report import build_report
from rtop.workload import Faults, WorkloadSpec, free_port, run_local
from tests.rankclient import RankClient, step_row
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
MASTER = "round-two-master-token-0123456789"
INGEST = auth.role_token(MASTER, "ingest")
CONTROL = auth.role_token(MASTER, "control")
VIEW = auth.role_token(MASTER, "view")


def peak_rss(pid: int) -> int:
    """A process's peak resident set (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return int(psutil.Process(pid).memory_info().rss)


class HubProcess:
    """``rtop serve`` in its own process (so its memory is its own to measure)."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.record = tmp / "run.rtop"
        env = dict(os.environ, PYTHONPATH=str(ROOT), RTOP_TOKEN=MASTER)
        self.log = open(tmp / "hub.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rtop.cli", "serve", "--port", str(self.port),
             "--record", str(self.record), "--job", "round2", *extra],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        assert wait_for(self._listening, 30), "the hub did not start"

    def _listening(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=0.5):
            return True
        return False

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(15)
        self.proc.kill()
        self.log.close()


class Job:
    """A real 2-rank DDP job over gloo streaming to ``hub``, in the background, until
    its stop file appears."""

    def __init__(self, tmp: Path, hub: str) -> None:
        self.stop_file = tmp / "stop"
        self.spec = WorkloadSpec(world_size=2, duration_s=120.0, hub=hub, token=INGEST,
                                 dim=64, hidden=128, faults=Faults(all_loader_sleep_s=0.01),
                                 stop_file=str(self.stop_file))
        self.hub = hub
        self.stop = threading.Event()
        self.results: list[dict[str, Any]] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.results = run_local(self.spec, timeout_s=300, check=False, stop=self.stop)

    def snapshot(self) -> dict[str, Any]:
        with HubClient(self.hub, VIEW) as c:
            return dict(c.snapshot())

    def running(self, at_least: int = 5) -> bool:
        steps = self.snapshot()["ranks"]["step"]
        return len(steps) == 2 and None not in steps and min(steps) >= at_least

    def identity(self, rank: int) -> dict[str, Any]:
        with HubClient(self.hub, VIEW) as c:
            return dict(c.rank(rank)["identity"])

    def close(self) -> None:
        self.stop_file.touch()
        self.thread.join(60)
        self.stop.set()
        self.thread.join(30)


@pytest.fixture
def hub_process(tmp_path: Path) -> Iterator[HubProcess]:
    hub = HubProcess(tmp_path)
    try:
        yield hub
    finally:
        hub.stop()


@pytest.fixture
def job(tmp_path: Path, hub_process: HubProcess) -> Iterator[Job]:
    j = Job(tmp_path, hub_process.address)
    try:
        assert wait_for(j.running, 120), "the job never reached the hub"
        yield j
    finally:
        j.close()


def rogue(job: Job, rank: int, world: int, **over: Any) -> RankClient:
    """A connection that holds the ingest token and claims ``rank`` of the job's own
    group (unless ``over`` says otherwise)."""
    ident = job.identity(0)
    kw = {"group": ident["group"], "job": ident["job"], "host": "rogue-node", **over}
    return RankClient(job.hub, INGEST, rank, world=world, **kw)


def step_walls(record: Path, rank: int) -> list[float]:
    """The wall times of a rank's recorded steps."""
    from collectors.schema import STEP_FIELDS
    from rtop.run.recording import read

    i = STEP_FIELDS.index("t_wall")
    out = []
    for _, frame in read(record):
        if frame.kind == wire.KIND_BATCH and frame.payload.get("rank") == rank:
            out += [row[i] for row in frame.payload.get("steps") or []]
    return sorted(out)


# ---- A: a huge field in a rank's answer ------------------------------------------------


@pytest.mark.job
def test_a_a_huge_late_answer_costs_the_hub_nothing_and_breaks_no_one(
        job: Job, hub_process: HubProcess) -> None:
    """Before: a rank answering a probe with a ``late`` result whose ``step`` was a 31 MB
    string took the hub from 50 MB to 5.57 GB (the reason was copied into every
    target's cancel and every pending answer), reset every rank's connection (a 31 MB
    control frame), stalled training 10 s and left the requester unanswered. Now the
    answer is an error for that rank alone, the reason is bounded, the requester hears
    within seconds, and the real ranks neither drop nor stall."""
    world_claim = rogue(job, 2, world=3)  # a buggy or hostile third rank of the group
    assert world_claim.recv().kind == wire.KIND_WELCOME
    world_claim.batch(steps=[step_row(10**6)])
    pid = hub_process.proc.pid
    rss_before = peak_rss(pid)
    t_before = time.time()
    result: dict[str, Any] = {}

    def ask() -> None:
        with HubClient(job.hub, CONTROL, role="control") as c:
            result["out"] = c.act("probe", args={"bytes": 1 << 16}, timeout_s=60)
            result["took"] = time.monotonic() - t0

    t0 = time.monotonic()
    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    frame = world_claim.recv(timeout=20)
    while frame is not None and frame.kind != wire.KIND_CONTROL:
        frame = world_claim.recv(timeout=20)
    assert frame is not None and frame.payload["action"] == "probe"
    world_claim.send(wire.KIND_RESULT, {"id": frame.payload["id"], "state": "late",
                                        "step": "9" * 31_000_000, "rank": 2})
    asker.join(60)
    assert "out" in result, "the requester was never answered"
    out = result["out"]
    grew = peak_rss(pid) - rss_before
    print(f"\nA: the requester heard in {result['took']:.1f} s; the hub's peak RSS grew "
          f"{grew / 1e6:.0f} MB")
    assert result["took"] < 20
    assert out["cancelled"] and "rank 2" in out["cancelled"]
    assert len(out["cancelled"]) < 600 and "9" * 1000 not in json.dumps(out)
    assert all(len(e["error"]) <= MAX_ERROR + 200 for e in out["errors"])
    assert grew < 400e6, f"the hub grew {grew / 1e6:.0f} MB"
    # the real ranks stayed connected and kept training
    time.sleep(2.0)
    snap = job.snapshot()
    assert snap["ranks"]["status"][:2] == ["active", "active"]
    steps_then = snap["ranks"]["step"][:2]
    assert wait_for(lambda: min(job.snapshot()["ranks"]["step"][:2]) > max(steps_then) + 5,
                    30)
    world_claim.close()
    # no real rank stalled (it never waited for a go: the cancel came first)
    time.sleep(1.5)  # the hub flushes its recording every second
    for r in (0, 1):
        walls = [t for t in step_walls(hub_process.record, r) if t >= t_before - 1]
        gaps = [b - a for a, b in itertools.pairwise(walls)]
        assert gaps and max(gaps) < 5.0, f"rank {r} stalled {max(gaps):.1f} s"


def test_a_answers_are_typed_and_bounded_where_they_enter() -> None:
    """Each field of a result the hub copies is typed and bounded at entry."""
    state, body = clean_result("probe", {"id": "x", "state": "late", "step": "9" * 10**6})
    assert (state, body) == ("late", {"step": None})
    state, body = clean_result("stacks", {"state": "error", "error": "e" * 10**6})
    assert state == "error" and len(body["error"]) <= MAX_ERROR
    with pytest.raises(BadAnswer, match="more than"):
        clean_result("stacks", {"state": "done", "threads": [{}] * 50_000})
    with pytest.raises(BadAnswer, match="nested"):
        deep: Any = "x"
        for _ in range(20):
            deep = [deep]
        clean_result("profile", {"state": "done", "top_ops": deep})
    with pytest.raises(BadAnswer, match="link"):
        clean_result("probe", {"state": "done", "links": [["a", 1.0]]})
    with pytest.raises(BadAnswer, match="state"):
        clean_result("stacks", {"state": "x" * 10**6})
    state, body = clean_result("profile", {"state": "done", "trace": "p" * 10**5,
                                           "wall_s": float("nan"), "blob": b"x" * 100,
                                           "name": "\x1b]0;pwned\x07"})
    assert state == "done" and len(body["trace"]) <= 4096 and body["wall_s"] is None
    assert body["blob"] is None and "\x1b" not in body["name"]


# ---- B: a second connection claims a connected rank ------------------------------------


@pytest.mark.job
def test_b_a_second_connection_cannot_take_a_connected_rank(job: Job) -> None:
    """Before: a second connection claiming rank 1 won (the last connection for a rank
    won): ``rtop stacks`` showed its forged stack, it received rank 1's control frames
    and overwrote its identity. Now it is refused (``rank_taken``), rank 1's identity
    and stacks stay the real process's, and action ids are unguessable."""
    real = job.identity(1)
    thief = rogue(job, 1, world=2, host=real["hostname"])
    frame = thief.recv()
    assert frame is not None and frame.kind == wire.KIND_ERROR, frame
    assert frame.payload["code"] == "rank_taken"
    assert "connected already" in frame.payload["message"]
    assert thief.closed_by_hub()
    assert job.identity(1)["pid"] == real["pid"]
    with HubClient(job.hub, CONTROL, role="control") as c:
        out = c.act("stacks", timeout_s=20)
    by_rank = {a["rank"]: a for a in out["answers"]}
    assert sorted(by_rank) == [0, 1] and by_rank[1]["pid"] == real["pid"]
    assert any(f["function"] == "train_loop" for t in by_rank[1]["threads"]
               for f in t["frames"])
    assert job.snapshot()["ranks"]["status"][:2] == ["active", "active"]


def test_b_answers_count_only_on_the_connection_the_action_went_to() -> None:
    """A connected rank answering for another rank's action (even with its id), or an
    action it was never sent, changes nothing; ids are unguessable."""
    hub = ThreadedHub(record="", token=MASTER).start()
    try:
        r0 = RankClient(hub.address, INGEST, 0, world=2)
        r1 = RankClient(hub.address, INGEST, 1, world=2)
        assert r0.recv().kind == r1.recv().kind == wire.KIND_WELCOME
        result: dict[str, Any] = {}

        def ask() -> None:
            with HubClient(hub.address, CONTROL, role="control") as c:
                result["out"] = c.act("stacks", ranks=[0], timeout_s=3)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        frame = r0.recv()
        while frame is not None and frame.kind != wire.KIND_CONTROL:
            frame = r0.recv()
        assert frame is not None
        aid = frame.payload["id"]
        assert len(aid) >= 16 and aid != "a1-" + str(os.getpid())
        # rank 1 answers rank 0's action with a forged stack: ignored
        r1.send(wire.KIND_RESULT, {"id": aid, "state": "done", "rank": 0,
                                   "threads": [{"name": "forged", "frames": []}]})
        asker.join(15)
        out = result["out"]
        assert out["answers"] == [] and out["missing"] == [0]
        assert hub.hub.actions.counters["stray_answers"] >= 1
    finally:
        hub.stop()


def test_b_a_rank_process_takes_its_place_back_and_a_dead_holder_is_replaced() -> None:
    """The same rank process (its ``instance`` secret) back on a new connection before
    the hub saw the old one break: it takes its place at once. Another process claiming
    a rank whose holder is dead (silent): refused, the holder closed within 3 s, and the
    next try gets in."""
    hub = ThreadedHub(record="", token=MASTER, lost_after_s=60).start()
    try:
        me = os.urandom(16)
        first = RankClient(hub.address, INGEST, 0, world=1, instance=me)
        assert first.recv().kind == wire.KIND_WELCOME
        again = RankClient(hub.address, INGEST, 0, world=1, instance=me)
        assert again.recv().kind == wire.KIND_WELCOME
        assert first.closed_by_hub(5.0)
        assert hub.hub.counters["rank_replaced"] == 1
        # a new process (another instance) while the holder is silent
        other = RankClient(hub.address, INGEST, 0, world=1, instance=os.urandom(16))
        frame = other.recv()
        assert frame is not None and frame.payload["code"] == "rank_taken"
        assert again.closed_by_hub(6.0), "a silent holder was not closed as dead"
        assert hub.hub.counters["dead_connections"] == 1
        later = RankClient(hub.address, INGEST, 0, world=1, instance=os.urandom(16))
        assert later.recv().kind == wire.KIND_WELCOME
        # a holder that answers its ping stays: the claim is refused, the holder kept
        live = RankClient(hub.address, INGEST, 0, world=1, instance=os.urandom(16))
        assert live.recv().payload["code"] == "rank_taken"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            later.batch(steps=[step_row(1)])
            time.sleep(0.3)
        assert not later.closed_by_hub(0.2)
    finally:
        hub.stop()


# ---- B2: a stray hello as rank 0 of a new group ----------------------------------------


@pytest.mark.job
def test_b2_a_stray_group_neither_hides_the_job_nor_leaves_a_false_lost_rank(
        job: Job, hub_process: HubProcess) -> None:
    """Before: one hello as rank 0 of a new group (world 1) became the current attempt:
    the healthy job vanished from the view, actions were refused ("no rank is
    connected"), and after the rogue left a false critical ``lost_rank``. Now the stray
    group waits apart; the view, the actions and the findings stay the job's."""
    stray = rogue(job, 0, world=1, group="stray-group")
    assert stray.recv().kind == wire.KIND_WELCOME
    stray.batch(steps=[step_row(0)])
    time.sleep(1.0)
    snap = job.snapshot()
    assert snap["run"]["attempt"] == 0 and snap["run"]["world_size"] == 2
    assert snap["ranks"]["rank"] == [0, 1] and snap["ranks"]["status"] == ["active"] * 2
    with HubClient(job.hub, CONTROL, role="control") as c:
        out = c.act("stacks", timeout_s=20)
    assert sorted(a["rank"] for a in out["answers"]) == [0, 1]
    stray.close()
    time.sleep(13.0)  # past lost_after_s (10 s): a lost rank would be named by now
    snap = job.snapshot()
    assert snap["ranks"]["status"] == ["active", "active"]
    assert not [f for f in snap["findings"] if f["kind"] == "lost_rank"], snap["findings"]
    job.close()
    report = build_report(hub_process.record)
    assert not [f for f in report["findings"] if f["kind"] == "lost_rank"]
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    assert report["run"]["attempts"] == 1
    assert [(g["group"], g["ranks"], g["hosts"]) for g in report["other_groups"]] == \
        [("stray-group", [0], ["rogue-node"])]


# ---- C: nothing to guess against --------------------------------------------------------


def test_c_an_unauthenticated_hello_gets_nothing_to_guess_against(tmp_path: Path) -> None:
    """Before: the challenge to any hello carried the hub's proof over known data, and a
    20-character user-chosen token was guessed offline in 0.2 s from a word list, with
    no failed attempt ever reaching the hub. Now the challenge is a nonce and nothing
    else (the peer proves first), and a weak token is refused beyond loopback."""
    token = "trainingcluster2026!"  # 20 characters, user-chosen
    hub = ThreadedHub(record="", token=token).start()
    try:
        with socket.create_connection(wire.parse_address(hub.address)) as s:
            s.sendall(wire.encode(wire.KIND_HELLO, {"role": "viewer", "auth": auth.VERSION,
                                                    "nonce": auth.new_nonce()}))
            [challenge] = wire.FrameDecoder().feed(s.recv(4096))
        assert challenge.kind == wire.KIND_CHALLENGE
        assert set(challenge.payload) == {"nonce"}, "the hub proved something first"
        # an older peer (the hub-proves-first handshake) is told to upgrade
        with socket.create_connection(wire.parse_address(hub.address)) as s:
            s.sendall(wire.encode(wire.KIND_HELLO, {"role": "viewer",
                                                    "nonce": auth.new_nonce()}))
            [old] = wire.FrameDecoder().feed(s.recv(4096))
        assert old.kind == wire.KIND_ERROR and "upgrade" in old.payload["message"]
    finally:
        hub.stop()
    # beyond loopback a token like that is refused, saying why and what to do
    env = dict(os.environ, PYTHONPATH=str(ROOT), RTOP_TOKEN=token)
    out = subprocess.run([sys.executable, "-m", "rtop.cli", "serve", "--host", "0.0.0.0",
                          "--port", str(free_port()), "--no-record"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "too weak" in out.stderr and "token_urlsafe" in out.stderr, out.stderr
    assert token not in out.stderr


# ---- G: stalled connections from a few addresses ---------------------------------------


def test_g_stalled_http_requests_from_8_addresses_cannot_stop_the_scrapes() -> None:
    """Before: 64 unfinished HTTP requests from 8 loopback addresses (8 each, the
    per-address cap) filled the table, and every ``/metrics`` scrape was refused while
    they lasted. Now loopback is one group, and a newcomer closes the oldest unfinished
    request: every scrape is served."""
    hub = ThreadedHub(record="", token=MASTER, http_deadline_s=30.0).start()
    host, port = wire.parse_address(hub.address)
    stalled = []
    try:
        for i in range(64):
            s = socket.create_connection((host, port), source_address=(f"127.0.0.{i % 8 + 1}", 0))
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # ... and never the rest
            stalled.append(s)
        time.sleep(0.3)
        served = 0
        for _ in range(5):
            req = urllib.request.Request(f"http://{hub.address}/metrics",
                                         headers={"Authorization": f"Bearer {VIEW}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                served += resp.status == 200 and b"rtop_" in resp.read()
        print(f"\nG: {served} of 5 scrapes served beside 64 stalled requests from 8 "
              f"addresses; {hub.hub.counters['evicted']} stalled ones closed")
        assert served == 5
        assert hub.hub.counters["evicted"] >= 5
    finally:
        for s in stalled:
            s.close()
        hub.stop()


def test_g_address_groups() -> None:
    assert addr_group("127.0.0.1") == addr_group("127.0.0.8") == addr_group("::1") \
        == "loopback"
    assert addr_group("10.1.2.3") == addr_group("10.1.2.250") == "10.1.2.0/24"
    assert addr_group("10.1.3.3") != addr_group("10.1.2.3")
    assert addr_group("::ffff:10.1.2.3") == "10.1.2.0/24"
    assert addr_group("2001:db8::1") == addr_group("2001:db8::ffff") == "2001:db8::/64"


def test_g_stalled_handshakes_cannot_keep_a_rank_out() -> None:
    """Connections that never authenticate, from several loopback addresses, up to
    every cap: a rank still gets in (the oldest stalled one is closed for it)."""
    hub = ThreadedHub(record="", token=MASTER, max_unauth=32, max_unauth_per_addr=16,
                      auth_timeout_s=30.0, hello_timeout_s=30.0).start()
    host, port = wire.parse_address(hub.address)
    stalled = []
    try:
        for i in range(48):
            s = socket.create_connection((host, port), source_address=(f"127.0.0.{i % 8 + 1}", 0))
            s.sendall(wire.encode(wire.KIND_HELLO, {"role": "rank", "auth": auth.VERSION,
                                                    "nonce": auth.new_nonce()}))
            stalled.append(s)
        time.sleep(0.3)
        rank = RankClient(hub.address, INGEST, 0, world=1)
        assert rank.recv().kind == wire.KIND_WELCOME
        assert hub.hub.counters["evicted"] >= 32
    finally:
        for s in stalled:
            s.close()
        hub.stop()


# ---- D (the hub's side): a probe a rank could not afford is refused at once --------------


def test_d_the_hub_refuses_a_probe_the_ranks_memory_cannot_afford() -> None:
    """The hub judges ``--bytes`` against each rank's latest samples before it arms
    anything: two ranks on a node whose host has 1 GiB available cannot take a probe
    of 256 MiB per transfer (2 x 512 MiB of buffers); 16 MiB is fine. (The ranks check
    again themselves: tests/test_security_round2_rank.py.)"""
    from collectors.schema import HOST_FIELDS

    def host_row(avail: float) -> list[Any]:
        row: dict[str, Any] = dict.fromkeys(HOST_FIELDS)
        row.update(t_wall=time.time(), proc_cpu_pct=100.0, rss_bytes=2e9,
                   sys_mem_avail_bytes=avail)
        return [row[f] for f in HOST_FIELDS]

    hub = ThreadedHub(record="", token=MASTER).start()
    try:
        ranks = [RankClient(hub.address, INGEST, r, world=2) for r in (0, 1)]
        for c in ranks:
            assert c.recv().kind == wire.KIND_WELCOME
            c.batch(steps=[step_row(5)], host=[host_row(float(1 << 30))])
        assert wait_for(lambda: hub.hub.state.rank_state(1) is not None
                        and hub.hub.state.rank_state(1).host is not None, 10)
        with HubClient(hub.address, CONTROL, role="control") as c, \
                pytest.raises(Exception, match=r"rank 0: a link probe of 268435456 bytes "
                                               r"per transfer would allocate 512.0 MiB"):
            c.act("probe", args={"bytes": 256 << 20}, timeout_s=5)
        assert hub.hub.actions.running == {}  # nothing was armed
        for c in ranks:
            kinds = []
            with contextlib.suppress(TimeoutError):
                while (f := c.recv(timeout=0.3)) is not None:
                    kinds.append(f.kind)
            assert wire.KIND_CONTROL not in kinds, "a rank was sent the probe"
        assert hub.hub.probe_refusal(16 << 20, [0, 1]) is None
    finally:
        hub.stop()
