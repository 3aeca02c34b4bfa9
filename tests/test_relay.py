"""Relays, for real: a real hub, a real ``rtop relay`` process, and ranks that connect
through it over real sockets: hand-driven rank connections (:class:`RankClient`), the
collectors' own connection code (:class:`HubConnection`, which finds and starts the
relay through the runtime directory as ranks do), and real rank processes.

What is checked: the rank's whole conversation goes through (the hub proves itself to
the rank, records arrive attributed to the right rank, acknowledgements come back, a
stacks action reaches a relayed rank and its answer returns); a relay speaks for its
own node only (a rank of another node on it is refused, and so is a second relay for a
node); and no acknowledged record is lost or recorded twice when the relay is killed,
when its connection to the hub is cut, or when the hub restarts: every batch ``seq`` a
rank sent is in the recording exactly once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import auth, wire
from collectors.config import ProbeConfig
from collectors.connection import ConnState, HubConnection
from collectors.discovery import read_hub_file, runtime_dir
from collectors.identity import detect
from rtop.client import HubClient
from rtop.hub.service import ThreadedHub
from rtop.run.recording import read
from tests.rankclient import RankClient, step_row
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
NODE = "node-a"
JOB = "relay-test"


# ---- helpers -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RelayProcess:
    """``python -m rtop relay`` for ``node``, its token in its environment."""

    def __init__(self, hub: str, token: str, node: str = NODE, linger: float = 30.0
                 ) -> None:
        env = {**os.environ, "RTOP_TOKEN": token, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rtop", "relay", "--hub", hub, "--node", node, "--job",
             JOB, "--linger", str(linger)], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.address = ""
        deadline = time.monotonic() + 30
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.match(r"rtop relay (\S+:\d+) for node", line)
            if m:
                self.address = m.group(1)
                break
        assert self.address, "the relay did not start:\n" + "".join(self.lines)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[ThreadedHub]:
    h = ThreadedHub(job=JOB, record=str(tmp_path / "run.rtop"), port=free_port()).start()
    yield h
    h.stop()


@pytest.fixture
def relays() -> Iterator[list[RelayProcess]]:
    """Relays a test starts; stopped at its end."""
    started: list[RelayProcess] = []
    yield started
    for r in started:
        r.stop()


@pytest.fixture
def spawned_relays() -> Iterator[None]:
    """Relays the ranks start through the runtime directory: killed at the test's end
    (each named by its own discovery file)."""
    yield
    with contextlib.suppress(OSError):
        for path in runtime_dir().glob("relay-*.json"):
            info = read_hub_file(path)
            if info is not None:
                with contextlib.suppress(OSError):
                    os.kill(int(info["pid"]), signal.SIGTERM)


def ingest(hub: ThreadedHub) -> str:
    return auth.role_token(hub.token, "ingest")


def batch(rank: int, seq: int, group: str = "g0") -> dict[str, Any]:
    return {"rank": rank, "group": group, "seq": seq, "t_wall": time.time(), "dropped": 0,
            "steps": [step_row(seq)]}


def welcomed(client: RankClient) -> wire.Frame:
    frame = client.recv()
    assert frame is not None and frame.kind == wire.KIND_WELCOME, frame
    assert client.welcome_proven(frame), "the hub's proof did not come through the relay"
    return frame


def until_ack(client: RankClient, seq: int, timeout: float = 10.0) -> None:
    """Read (answering pings) until the hub acknowledges ``seq``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        f = client.recv(max(0.1, deadline - time.monotonic()))
        assert f is not None, "the connection closed before the ack"
        if f.kind == wire.KIND_PING:
            client.send(wire.KIND_PONG, {"t_hub": f.payload["t_hub"],
                                         "seq": f.payload["seq"], "t_rank": time.time()})
        elif f.kind == wire.KIND_ACK and f.payload["seq"] >= seq:
            return
    raise AssertionError(f"no ack of seq {seq} within {timeout} s")


def snapshot_when(viewer: HubClient, cond: Any) -> Any:
    """The hub's snapshot if ``cond`` holds for it, else None."""
    snap = viewer.snapshot()
    return snap if cond(snap) else None


def recorded_seqs(path: Path | str) -> dict[int, list[int]]:
    """Each rank's batch ``seq`` numbers in a recording, in order."""
    seqs: dict[int, list[int]] = defaultdict(list)
    for _, frame in read(path):
        if frame.kind == wire.KIND_BATCH:
            seqs[frame.payload["rank"]].append(frame.payload["seq"])
    return dict(seqs)


class Rank(threading.Thread):
    """One rank's connection as the collectors run it (:class:`HubConnection` on a
    thread of its own, found through discovery: the node's relay in a large job), a
    batch every ``every_s`` with the next ``seq`` until stopped, then its goodbye."""

    def __init__(self, rank: int, world: int, hub: str, token: str,
                 every_s: float = 0.05, spool_dir: str | None = None) -> None:
        super().__init__(daemon=True)
        self.rank = rank
        self.identity = detect(rank=rank, local_rank=rank, world_size=world,
                               hostname=NODE, job=JOB, group=f"{JOB}#0", source="env")
        self.conn = HubConnection(ProbeConfig(
            hub=hub, token=token, backoff_initial_s=0.05, backoff_max_s=0.5,
            welcome_timeout_s=2.0, spool_dir=spool_dir), self.identity)
        self.every_s = every_s
        self.sent = 0  # the last seq queued
        self.stop_at = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            next_batch = time.monotonic()
            while not self.stop_at.is_set():
                now = time.monotonic()
                if now >= next_batch:
                    self.sent += 1
                    frame = wire.encode(wire.KIND_BATCH, {
                        **batch(self.rank, self.sent, self.identity.group)})
                    self.conn.send(frame, 1, self.sent)
                    next_batch = now + self.every_s
                self.conn.pump(now)
                time.sleep(0.005)
            self.conn.finish(time.monotonic() + 10, lambda: {
                "rank": self.rank, "group": self.identity.group, "dropped": 0,
                "reason": "exit"})
        except BaseException as exc:  # reported to the test
            self.error = exc

    def up(self) -> bool:
        return self.conn.state is ConnState.UP

    def end(self) -> None:
        self.stop_at.set()
        self.join(30)
        assert not self.is_alive() and self.error is None, self.error


def all_once(seqs: dict[int, list[int]], ranks: list[Rank]) -> None:
    """Every seq each rank sent, recorded exactly once."""
    for r in ranks:
        got = seqs.get(r.rank, [])
        twice = sorted(s for s, n in Counter(got).items() if n > 1)
        assert not twice, f"rank {r.rank}: seq recorded twice: {twice[:20]}"
        missing = sorted(set(range(1, r.sent + 1)) - set(got))
        assert not missing, f"rank {r.rank}: {len(missing)} of {r.sent} batches lost: " \
                            f"{missing[:20]}"
        stats = r.conn.stats()
        assert stats["dropped_unsent"] == 0 and stats["unconfirmed_records"] == 0, stats
        assert stats["spooled_records"] == 0, stats


def relay_pid() -> int:
    """The pid of the relay the ranks started (its discovery file)."""
    files = [read_hub_file(p) for p in runtime_dir().glob("relay-*.json")]
    pids = [int(i["pid"]) for i in files if i is not None]
    assert len(pids) == 1, files
    return pids[0]


def relayed_ranks(hub: ThreadedHub) -> list[int]:
    """The ranks whose connection comes through a relay, now."""
    return hub.call(lambda h: sorted(c.rank.rank for c in h.rank_connections().values()
                                     if c.via is not None and c.rank is not None))


# ---- through a relay -----------------------------------------------------------------


def test_ranks_through_a_relay_are_attributed_acknowledged_and_timed(
        hub: ThreadedHub, relays: list[RelayProcess]):
    relay = RelayProcess(hub.address, ingest(hub))
    relays.append(relay)
    clients = [RankClient(relay.address, ingest(hub), rank=r, world=2, host=NODE,
                          job=JOB) for r in (0, 1)]
    for c in clients:
        welcomed(c)  # the handshake went to the hub and back, proofs included
    for seq in (1, 2, 3):
        for c in clients:
            c.send(wire.KIND_BATCH, batch(c.rank, seq, c.group))
    for c in clients:
        until_ack(c, 3)  # an ack only the hub sends, once it holds the batches
    viewer = HubClient(hub.address, hub.token)
    snap = wait_for(lambda: snapshot_when(viewer, lambda s: all(
        o is not None for o in s["ranks"]["offset_s"])), 10,
        what="clock offsets measured through the relay")
    assert snap["ranks"]["rank"] == [0, 1] and snap["ranks"]["node"] == [NODE, NODE]
    assert snap["ranks"]["status"] == ["active", "active"]
    assert snap["ranks"]["step"] == [3, 3]
    assert snap["hub"]["counters"]["relays"] == 1
    assert snap["hub"]["counters"]["relay_streams"] == 2
    assert relayed_ranks(hub) == [0, 1]
    for c in clients:
        c.send(wire.KIND_BYE, {"rank": c.rank, "group": c.group, "dropped": 0,
                               "reason": "exit"})
        until_ack(c, 3)
        c.close()
    wait_for(lambda: snapshot_when(viewer, lambda s: s["ranks"]["status"] == [
        "exited", "exited"]), 10, what="both goodbyes")
    viewer.close()
    seqs = recorded_seqs(hub.record_path or "")
    assert seqs == {0: [1, 2, 3], 1: [1, 2, 3]}


def test_a_relay_speaks_for_its_own_node_only(hub: ThreadedHub,
                                              relays: list[RelayProcess]):
    relay = RelayProcess(hub.address, ingest(hub))
    relays.append(relay)
    ours = RankClient(relay.address, ingest(hub), rank=0, world=2, host=NODE, job=JOB)
    welcomed(ours)
    # a rank of another node through this node's relay: refused, that stream alone
    other = RankClient(relay.address, ingest(hub), rank=1, world=2, host="node-b", job=JOB)
    refusal = other.recv()
    assert refusal is not None and refusal.kind == wire.KIND_ERROR
    assert refusal.payload["code"] == "relay_node"
    assert other.closed_by_hub()
    ours.send(wire.KIND_BATCH, batch(0, 1, ours.group))
    until_ack(ours, 1)
    # a hostile relay, driven by hand, for another node: it may carry that node only
    hostile = RankClient(hub.address, ingest(hub), role="relay", hello=False)
    hostile.handshake(ingest(hub), "relay", {"node": "node-c"})
    assert hostile.recv().kind == wire.KIND_WELCOME
    hello = {"role": "rank", "nonce": auth.new_nonce(), "auth": auth.VERSION,
             "identity": {**_identity(1), "hostname": NODE}}
    hostile.send(wire.KIND_RELAY, {"open": [0], "data": [0, wire.encode(wire.KIND_HELLO,
                                                                        hello)]})
    down = hostile.recv()
    assert down is not None and down.kind == wire.KIND_DOWN, down
    # the hub answered the stream's hello with a challenge: the rank proves itself to
    # the hub, not the relay; proving it, its identity is checked against the node
    sid, challenge = down.payload["data"]
    assert sid == 0 and wire.FrameDecoder().feed(challenge)[0].kind == wire.KIND_CHALLENGE
    # a relay holds the ingest key, so it can prove itself as any rank: what the hub
    # checks once it has is the node the rank's hello names
    nonce = wire.FrameDecoder().feed(challenge)[0].payload["nonce"]
    key = auth.key_for(ingest(hub), "ingest")
    assert key is not None
    proof = auth.client_proof(key, "rank", nonce, hello["nonce"])
    hostile.send(wire.KIND_RELAY, {"data": [0, wire.encode(wire.KIND_AUTH,
                                                           {"proof": proof})]})
    down = hostile.recv()
    assert down is not None and down.kind == wire.KIND_DOWN
    refused = wire.FrameDecoder().feed(down.payload["data"][1])[0]
    assert refused.kind == wire.KIND_ERROR and refused.payload["code"] == "relay_node"
    assert down.payload.get("close") == [0]
    counters = hub.call(lambda h: dict(h.counters))
    assert counters["relay_foreign"] == 2
    # rank 1 of node-a was never taken by either: the node's own relay can still carry it
    again = RankClient(relay.address, ingest(hub), rank=1, world=2, host=NODE, job=JOB)
    welcomed(again)
    # a second relay for node-a: refused while the first is alive
    second = RankClient(hub.address, ingest(hub), role="relay", hello=False)
    second.handshake(ingest(hub), "relay", {"node": NODE})
    err = second.recv()
    assert err is not None and err.kind == wire.KIND_ERROR
    assert err.payload["code"] == "relay_taken"
    time.sleep(3.5)  # the holder was asked to show it is alive: it did (it answers pings)
    assert hub.call(lambda h: h.counters["dead_connections"]) == 0
    assert relayed_ranks(hub) == [0, 1]
    for c in (ours, other, hostile, again, second):
        c.close()


@pytest.mark.parametrize("payload", [
    {"open": [0, 0]},  # a stream opened twice
    {"open": ["x"]},
    {"data": [0]},  # not pairs
    {"open": [0], "data": [0, "not bytes"]},
    {"closed": "all"},
], ids=["opened-twice", "sid-not-int", "odd-data", "str-data", "closed-not-list"])
def test_a_malformed_relay_frame_closes_that_relay_alone(hub: ThreadedHub,
                                                        payload: dict[str, Any]):
    relay = RankClient(hub.address, ingest(hub), role="relay", hello=False)
    relay.handshake(ingest(hub), "relay", {"node": "node-z"})
    assert relay.recv().kind == wire.KIND_WELCOME
    direct = RankClient(hub.address, ingest(hub), rank=0, world=2, host="node-y", job=JOB)
    welcomed(direct)
    relay.send(wire.KIND_RELAY, payload)
    err = relay.recv()
    while err is not None and err.kind == wire.KIND_DOWN:  # a stream opened first
        err = relay.recv()
    assert err is not None and err.kind == wire.KIND_ERROR, err
    assert err.payload["code"] == "bad_frame"
    assert relay.closed_by_hub()
    direct.send(wire.KIND_BATCH, batch(0, 1, direct.group))
    until_ack(direct, 1)  # the hub and its other peers go on
    assert hub.call(lambda h: h.relays.count()) == 0
    for c in (relay, direct):
        c.close()


def test_a_peer_that_streams_is_not_taken_for_one_that_stalls(tmp_path: Path):
    """A relay's frames are big and come back to back: most reads end inside one. The
    hub closes a peer that leaves half a frame unsent for ``frame_timeout_s``, timed from
    when that frame began, not from the first read that ended inside some frame."""
    h = ThreadedHub(job=JOB, record="", frame_timeout_s=1.0).start()
    try:
        rank = RankClient(h.address, auth.role_token(h.token, "ingest"), rank=0, world=2,
                          host=NODE, job=JOB)
        welcomed(rank)
        stream = b"".join(wire.encode(wire.KIND_BATCH, batch(0, seq, rank.group))
                          for seq in range(1, 200))
        step = 997  # not a frame's length: every write ends inside a frame
        t0 = time.monotonic()
        for at in range(0, len(stream), step):
            rank.raw(stream[at:at + step])
            time.sleep(3.0 / (len(stream) / step))
        assert time.monotonic() - t0 > 2.5  # well past the 1 s allowed for half a frame
        until_ack(rank, 199)
        assert h.call(lambda hub: hub.counters["bad_frames"]) == 0
        rank.close()
    finally:
        h.stop()


def _identity(rank: int) -> dict[str, Any]:
    from tests.rankclient import identity

    return identity(rank, world=2, job=JOB)


def test_a_relay_the_hub_refuses_sends_the_ranks_to_the_hub(hub: ThreadedHub):
    from collectors.discovery import node_relay, relay_file_path, relay_off_path

    ident = detect(rank=0, world_size=512, hostname=NODE, job=JOB, source="env")
    path = relay_file_path(runtime_dir(), ident, hub.address)
    env = {**os.environ, "RTOP_TOKEN": ingest(hub), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(  # a node name no hub takes: refused for good
        [sys.executable, "-m", "rtop", "relay", "--hub", hub.address, "--node", "n" * 300,
         "--discovery-file", str(path)], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refused this relay (node)" in proc.stdout + proc.stderr
    assert not path.exists() and relay_off_path(path).exists()
    # the node's ranks go to the hub directly now, and start no other relay
    assert node_relay(ident, hub.address, ingest(hub)) is None
    assert not path.exists()


# ---- exactly once --------------------------------------------------------------------


@pytest.fixture
def large_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of a job this large send through their node's relay (found or started
    through the runtime directory, as the collectors do)."""
    monkeypatch.setenv("RTOP_RELAY_MIN_WORLD", "2")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def test_ranks_start_the_relay_and_lose_nothing_when_it_is_killed(
        hub: ThreadedHub, large_job: None, spawned_relays: None, tmp_path: Path):
    ranks = [Rank(r, 3, hub.address, ingest(hub), spool_dir=str(tmp_path)) for r in range(3)]
    for r in ranks:
        r.start()
    wait_for(lambda: len(relayed_ranks(hub)) == 3, 30, what="3 ranks through a relay")
    first = relay_pid()
    time.sleep(1.5)
    # a pong goes up at once, not at the relay's next interval (0.25 s): the clock
    # offsets measured through a relay are as good as direct ones
    rtts = hub.call(lambda h: [h.state.rank_state(r.rank).rtt_s for r in ranks])
    assert all(rtt is not None and rtt < 0.05 for rtt in rtts), rtts
    os.kill(first, signal.SIGKILL)  # mid-run: batches in its hands, and in flight
    wait_for(lambda: all(r.up() for r in ranks) and hub.call(
        lambda h: len(h.rank_connections()) == 3), 30,
        what="the ranks back, through a new relay or directly")
    time.sleep(1.0)
    for r in ranks:
        r.end()
    assert all(r.sent > 20 for r in ranks)
    hub.stop()  # flushes the recording
    all_once(recorded_seqs(hub.record_path or ""), ranks)
    assert sum(r.conn.stats()["resent_frames"] for r in ranks) > 0  # some were in flight


def test_a_cut_link_to_the_hub_loses_and_doubles_nothing(
        hub: ThreadedHub, large_job: None, spawned_relays: None, tmp_path: Path):
    ranks = [Rank(r, 2, hub.address, ingest(hub), spool_dir=str(tmp_path)) for r in range(2)]
    for r in ranks:
        r.start()
    wait_for(lambda: len(relayed_ranks(hub)) == 2, 30, what="2 ranks through a relay")
    time.sleep(1.0)

    def cut(h: Any) -> int:
        links = list(h.relays.by_conn)
        for conn in links:
            conn.transport.abort()  # the relay's connection breaks, the hub stays
        return len(links)

    # a cut between a batch's arrival and its acknowledgement makes the ranks send it
    # again (a duplicate the hub drops by seq); one that falls between two sends does
    # not: cut again, a few times at most, until one did
    for _ in range(5):
        assert hub.call(cut) == 1
        wait_for(lambda: hub.call(lambda h: h.relays.count() == 1) and len(
            relayed_ranks(hub)) == 2, 30, what="the relay back on the hub, its ranks with it")
        time.sleep(1.0)
        if hub.call(lambda h: h.counters["duplicate_batches"]) > 0:
            break
    for r in ranks:
        r.end()
    dup = hub.call(lambda h: h.counters["duplicate_batches"])
    hub.stop()
    all_once(recorded_seqs(hub.record_path or ""), ranks)
    assert dup > 0  # sent again, and dropped by seq: the hub held them already


def test_a_relay_that_hears_nothing_from_its_hub_connects_again(hub: ThreadedHub):
    """A hub-to-relay direction that stays silent (a link cut and restored, whose
    acknowledgements wait on TCP's retransmission backoff; here: the hub's loop held)
    past ``hub_silent_s``: the relay drops that connection and connects again."""
    from rtop.hub.relay import RelayConfig, ThreadedRelay

    relay = ThreadedRelay(RelayConfig(hub=hub.address, token=ingest(hub), node=NODE,
                                      job=JOB, hub_silent_s=1.5, keepalive_s=0.5,
                                      linger_s=None)).start()
    rank: RankClient | None = None
    try:
        wait_for(lambda: hub.call(lambda h: h.relays.count()) == 1, 30,
                 what="the relay on the hub")
        assert relay.relay is not None
        counters = relay.relay.counters
        time.sleep(3.0)  # a relay with no rank: the hub has nothing to say to it, kept
        assert counters["hub_connects"] == 1 and counters["hub_losses"] == 0
        rank = RankClient(relay.address, ingest(hub), rank=0, world=2, host=NODE, job=JOB)
        for i in range(6):  # a rank through it, its batches acknowledged: kept
            rank.send(wire.KIND_BATCH, {"rank": 0, "group": rank.group, "seq": i + 1,
                                        "t_wall": time.time(), "dropped": 0,
                                        "steps": [step_row(i)]})
            time.sleep(0.5)
        assert counters["hub_losses"] == 0
        with contextlib.suppress(Exception):  # the hub's loop held: silent for 3 s
            hub.call(lambda h: time.sleep(3.0), timeout=10)
        wait_for(lambda: counters["hub_connects"] >= 2, 30, what="the relay back")
        assert counters["hub_losses"] >= 1
        wait_for(lambda: hub.call(lambda h: h.relays.count()) == 1, 30,
                 what="the relay on the hub again")
    finally:
        if rank is not None:
            rank.close()
        relay.stop()


def test_a_hub_restart_behind_a_relay_loses_and_doubles_nothing(
        tmp_path: Path, large_job: None, spawned_relays: None):
    port = free_port()
    first = ThreadedHub(job=JOB, record=str(tmp_path / "a.rtop"), port=port).start()
    token = first.token
    ranks = [Rank(r, 2, first.address, ingest(first), spool_dir=str(tmp_path))
             for r in range(2)]
    second: ThreadedHub | None = None
    try:
        for r in ranks:
            r.start()
        wait_for(lambda: len(relayed_ranks(first)) == 2, 30, what="2 ranks through a relay")
        relay = relay_pid()
        time.sleep(1.0)
        first.stop()
        time.sleep(0.5)
        second = ThreadedHub(job=JOB, record=str(tmp_path / "b.rtop"), port=port,
                             token=token).start()
        hub2 = second
        wait_for(lambda: hub2.call(lambda h: h.relays.count() == 1
                                   and len(h.rank_connections()) == 2), 30,
                 what="the relay and the ranks on the new hub")
        assert relay_pid() == relay  # the same relay: it reconnected
        time.sleep(1.0)
        for r in ranks:
            r.end()
    finally:
        if second is not None:
            second.stop()
    a, b = recorded_seqs(tmp_path / "a.rtop"), recorded_seqs(tmp_path / "b.rtop")
    for r in ranks:
        # each hub recorded each batch once; together they hold every one
        for seqs in (a.get(r.rank, []), b.get(r.rank, [])):
            assert len(seqs) == len(set(seqs)), seqs
        assert set(a.get(r.rank, [])) | set(b.get(r.rank, [])) == set(range(1, r.sent + 1))
        # what the first hub acknowledged, the second never got again
        assert b.get(r.rank) and min(b[r.rank]) > 1


# ---- a real rank process -------------------------------------------------------------

RANK_SCRIPT = """
import os, sys, time
import collectors
probe = collectors.start()
while not os.path.exists(sys.argv[1]):  # a step every 50 ms until the test says stop
    with probe.step():
        time.sleep(0.05)
probe.close()
"""


@pytest.mark.job
def test_stacks_reach_relayed_ranks_and_come_back(hub: ThreadedHub, large_job: None,
                                                 spawned_relays: None, tmp_path: Path):
    stop = tmp_path / "stop"
    env = {**os.environ, "RTOP_HUB": hub.address, "RTOP_TOKEN": ingest(hub),
           "WORLD_SIZE": "2", "RTOP_NODE": NODE, "RTOP_JOB": JOB}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(stop)], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        wait_for(lambda: relayed_ranks(hub) == [0, 1], 60,
                 what="both rank processes through their node's relay")
        with HubClient(hub.address, auth.role_token(hub.token, "control"),
                       role="control") as ctl:
            result = ctl.act("stacks", timeout_s=20)
        assert sorted(a["rank"] for a in result["answers"]) == [0, 1], result
        assert not result["missing"] and not result["errors"], result
        for answer in result["answers"]:
            names = [t["name"] for t in answer["threads"]]
            assert "MainThread" in names, names
    finally:
        stop.touch()
        for p in procs:
            p.wait(60)
    outs = [p.stdout.read() if p.stdout else "" for p in procs]
    assert all(p.returncode == 0 for p in procs), outs


# ---- on Ray --------------------------------------------------------------------------


@pytest.mark.ray
def test_on_ray_the_hub_actor_makes_the_nodes_relay(ray_cluster: dict[str, str],
                                                    monkeypatch: pytest.MonkeyPatch):
    import ray

    from collectors.discovery import ray_actor_name, resolve

    monkeypatch.setenv("RTOP_AUTOHUB", "1")  # found through Ray, as a Ray Train rank does
    job = f"relay-ray-{os.getpid()}"
    ident = detect(rank=0, local_rank=0, world_size=512, job=job, group=f"{job}#0",
                   source="ray")
    hub_actor = None
    try:
        found = resolve(ident, None, None)
        hub_actor = ray.get_actor(ray_actor_name(ident), namespace="rtop")
        hub_host, hub_port, _ = ray.get(hub_actor.address.remote())
        assert found is not None and found[0] == "127.0.0.1" and found[1] != hub_port, found
        # the relay actor: on this node, zero CPUs, found again by the next rank
        again = resolve(detect(rank=1, local_rank=1, world_size=512, job=job,
                               group=f"{job}#0", source="ray"), None, None)
        assert again is not None and again[:2] == found[:2]
        ranks = []
        for r in (0, 1):
            ident_r = detect(rank=r, local_rank=r, world_size=512, job=job,
                             group=f"{job}#0", source="ray")
            conn = HubConnection(ProbeConfig(backoff_initial_s=0.05, backoff_max_s=0.5),
                                 ident_r)
            ranks.append((ident_r, conn))
        for seq in (1, 2, 3):
            for ident_r, conn in ranks:
                conn.send(wire.encode(wire.KIND_BATCH, batch(ident_r.rank, seq,
                                                              ident_r.group)), 1, seq)
        deadline = time.monotonic() + 30
        while any(c.unacked_frames or c.queued_frames or c.state is not ConnState.UP
                  for _, c in ranks):
            assert time.monotonic() < deadline, [c.stats() for _, c in ranks]
            for _, c in ranks:
                c.pump(time.monotonic())
            time.sleep(0.01)
        view = ray.get(hub_actor.view_token.remote())
        with HubClient(f"{hub_host}:{hub_port}", view) as viewer:
            snap = viewer.snapshot()
        assert snap["ranks"]["rank"] == [0, 1] and snap["ranks"]["step"] == [3, 3]
        assert snap["hub"]["counters"]["relays"] == 1
        assert snap["hub"]["counters"]["relay_streams"] == 2
        for _, c in ranks:
            c.close()
    finally:
        if hub_actor is not None:
            ray.kill(hub_actor)  # its relay actor, which it owns, goes with it
