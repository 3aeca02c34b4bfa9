"""The hub over real sockets: ranks, viewers, tokens, bad input, clocks, attempts."""

from __future__ import annotations

import logging
import os
import random
import socket
import stat
import time
import urllib.request
from functools import partial

import pytest

from collectors import auth, wire
from rtop.client import HubClient, HubError
from rtop.hub.server import HubConfig
from rtop.hub.service import ThreadedHub
from rtop.report import build_report
from rtop.workload import WorkloadSpec, run_local
from tests import waiting
from tests.rankclient import RankClient, gpu_row, hb_row, step_row

#: This module's pace: hubs in this process, polled often, given 10 s by default.
wait_for = partial(waiting.wait_for, timeout=10.0, every=0.05)


@pytest.fixture
def hub(tmp_path):
    h = ThreadedHub(job="test-job", record=str(tmp_path / "run.rtop"), token="secret-token",
                    hello_timeout_s=0.5, frame_timeout_s=1.0, lost_after_s=1.0,
                    flood_frames_per_s=200, flood_burst_s=1.0, viewer_high_water=64 * 1024)
    h.start()
    yield h
    h.stop()


def snapshot(hub):
    with HubClient(hub.address, hub.token) as c:
        return c.snapshot()


@pytest.mark.job
def test_real_ddp_job_and_a_viewer(hub):
    spec = WorkloadSpec(world_size=2, steps=40, dim=64, hidden=128, hub=hub.address,
                        token=hub.token)
    run_local(spec, timeout_s=120)
    snap = snapshot(hub)
    cols = snap["ranks"]
    assert cols["rank"] == [0, 1]
    assert cols["status"] == ["finished", "finished"]
    assert cols["step"] == [39, 39]
    assert all(v is not None and v > 0 for v in cols["step_s"])
    assert cols["gpu_util_pct"] == [None, None]  # no GPU here: missing, not zero
    assert snap["run"]["world_size"] == 2 and snap["run"]["attempt"] == 0
    # a rank's full window
    with HubClient(hub.address, hub.token) as c:
        detail = c.rank(1)
    assert detail["found"] and len([s for s in detail["steps"]["step"] if s is not None]) == 40


def test_a_viewer_asks_for_each_snapshot_and_may_not_subscribe(hub):
    """The hub answers each request; it pushes nothing (the retired ``subscribe`` is a
    kind a viewer may not send)."""
    r = RankClient(hub.address, hub.token, 0)
    assert r.recv().kind == wire.KIND_WELCOME
    r.batch(steps=[step_row(0)])
    with HubClient(hub.address, hub.token) as c:
        snaps = [c.snapshot() for _ in range(3)]
        assert snaps[-1]["ranks"]["rank"] == [0]
        c._send("subscribe", {"rate_hz": 4.0})
        with pytest.raises(HubError, match="may not send 'subscribe'"):
            c.snapshot()
    r.close()


def test_wrong_token_refused_and_others_unaffected(hub, caplog):
    good = RankClient(hub.address, hub.token, 0)
    assert good.recv().kind == wire.KIND_WELCOME
    with caplog.at_level(logging.WARNING, logger="rtop.hub"):
        bad = RankClient(hub.address, "not-the-token", 1)
        frame = bad.recv()
        assert frame.kind == wire.KIND_ERROR and frame.payload["code"] == "token"
        assert bad.closed_by_hub()
    # the hub proved nothing to a peer that had not proved itself
    assert bad.challenge is not None and set(bad.challenge.payload) == {"nonce"}
    assert "wrong token" in caplog.text
    assert hub.token not in caplog.text and "not-the-token" not in caplog.text
    # a viewer with a wrong token refused by the hub (when it sends its proof anyway) ...
    viewer = RankClient(hub.address, "also-wrong", role="viewer")
    frame = viewer.recv()
    assert frame.kind == wire.KIND_ERROR and frame.payload["code"] == "token"
    # ... and HubClient says so
    with pytest.raises(HubError, match="refused us: wrong token"):
        HubClient(hub.address, "also-wrong")
    good.batch(steps=[step_row(0)])
    assert wait_for(lambda: snapshot(hub)["ranks"]["step"] == [0])


BAD_INPUTS = {
    "garbage": lambda c: c.raw(b"\x00\x01garbage that is not a frame at all" * 3),
    "oversized": lambda c: c.raw(wire.HEADER.pack(wire.MAGIC, wire.VERSION, 2**31)),
    "wrong_version": lambda c: c.raw(wire.HEADER.pack(wire.MAGIC, 7, 3) + b"abc"),
    "half_frame": lambda c: c.raw(wire.encode(wire.KIND_BATCH, {"rank": 9})[:-3]),
    "never_speaks": lambda c: None,
    "not_msgpack": lambda c: c.raw(wire.HEADER.pack(wire.MAGIC, wire.VERSION, 4) + b"\xc1\xc1"
                                   b"\xc1\xc1"),
    "http_without_token": lambda c: c.raw(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_bad_input_closes_only_that_connection(hub, bad, caplog, tmp_path):
    good = RankClient(hub.address, hub.token, 0)
    assert good.recv().kind == wire.KIND_WELCOME
    good.batch(steps=[step_row(0), step_row(1)])
    assert wait_for(lambda: snapshot(hub)["ranks"]["step"] == [1])
    with caplog.at_level(logging.WARNING, logger="rtop.hub"):
        offender = RankClient(hub.address, hub.token, 1, hello=False)
        BAD_INPUTS[bad](offender)
        assert offender.closed_by_hub(timeout=5.0), f"{bad}: connection left open"
    assert "rtop hub:" in caplog.text, f"{bad}: no log line"
    # the healthy rank carries on, and what was recorded stays recorded
    good.batch(steps=[step_row(2)])
    assert wait_for(lambda: snapshot(hub)["ranks"]["step"] == [2])
    # the hub flushes its recording at least once a second
    def recorded_steps() -> int | None:
        ranks = build_report(tmp_path / "run.rtop")["ranks"]
        return ranks[0]["steps"] if ranks else None

    assert wait_for(lambda: recorded_steps() == 3, timeout=5.0), \
        f"{bad}: the recording holds {recorded_steps()} of the rank's 3 steps after 5 s"


def test_bad_frames_after_hello(hub, caplog):
    r = RankClient(hub.address, hub.token, 0)
    assert r.recv().kind == wire.KIND_WELCOME
    with caplog.at_level(logging.WARNING, logger="rtop.hub"):
        r.batch(steps=[[1, 2, 3]])  # a row of the wrong width
        assert r.closed_by_hub()
    assert "bad frame" in caplog.text


def test_flood_closes_the_flooder(hub, caplog):
    calm = RankClient(hub.address, hub.token, 0)
    assert calm.recv().kind == wire.KIND_WELCOME
    flood = RankClient(hub.address, hub.token, 1)
    assert flood.recv().kind == wire.KIND_WELCOME
    frame = wire.encode(wire.KIND_BATCH, {"rank": 1, "group": "g0", "hb": [hb_row()]})
    with caplog.at_level(logging.WARNING, logger="rtop.hub"):
        with pytest.raises(OSError):
            for _ in range(20000):
                flood.raw(frame)
        assert flood.closed_by_hub()
    assert "floods the hub" in caplog.text
    calm.batch(steps=[step_row(5)])
    assert wait_for(lambda: snapshot(hub)["ranks"]["step"][0] == 5)


def test_random_bytes_never_take_the_hub_down(hub):
    rng = random.Random(7)
    host, port = hub.address.rsplit(":", 1)
    for _ in range(40):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))))
    r = RankClient(hub.address, hub.token, 0)
    assert r.recv().kind == wire.KIND_WELCOME


def test_silent_rank_is_marked_lost_and_a_dropped_connection_too(hub):
    a = RankClient(hub.address, hub.token, 0)
    b = RankClient(hub.address, hub.token, 1)
    for c in (a, b):
        assert c.recv().kind == wire.KIND_WELCOME
        c.batch(steps=[step_row(0)])
    b.close()  # gone without a bye
    assert wait_for(lambda: snapshot(hub)["ranks"]["status"][1] == "lost", timeout=3)
    assert snapshot(hub)["ranks"]["status"][0] == "active"
    # rank 0 keeps its connection but sends nothing for longer than lost_after_s
    assert wait_for(lambda: snapshot(hub)["ranks"]["status"][0] == "lost", timeout=5)
    a.batch(steps=[step_row(1)])
    assert wait_for(lambda: snapshot(hub)["ranks"]["status"][0] == "active", timeout=3)


def test_clock_offset_is_estimated_from_pings(hub):
    skew = 100.0
    r = RankClient(hub.address, hub.token, 0)
    pongs = 0
    deadline = time.monotonic() + 5
    while pongs < 3 and time.monotonic() < deadline:
        frame = r.recv()
        if frame.kind == wire.KIND_PING:
            r.send(wire.KIND_PONG, {"t_hub": frame.payload["t_hub"],
                                    "seq": frame.payload["seq"],
                                    "t_rank": time.time() + skew})
            pongs += 1
    assert pongs == 3
    assert wait_for(lambda: snapshot(hub)["ranks"]["offset_s"][0] is not None)
    assert snapshot(hub)["ranks"]["offset_s"][0] == pytest.approx(skew, abs=0.05)


def test_a_new_worker_group_is_a_new_attempt(hub):
    """A restart: rank 1 of the first group fails (its connection drops), rank 0 is
    still being torn down, and the new group's ranks arrive: once the new group is whole
    it is the job's new attempt (a group that merely says hello beside a healthy one is
    not: tests/test_security_round2.py)."""
    old = [RankClient(hub.address, hub.token, r, group="first") for r in (0, 1)]
    for c in old:
        assert c.recv().kind == wire.KIND_WELCOME
        c.batch(steps=[step_row(10)])
    assert wait_for(lambda: snapshot(hub)["ranks"]["step"] == [10, 10])
    old[1].close()
    assert wait_for(lambda: hub.hub.state.attempts[0].ranks[1].status == "lost")
    new = [RankClient(hub.address, hub.token, r, group="second") for r in (0, 1)]
    for c in new:
        assert c.recv().kind == wire.KIND_WELCOME
        c.batch(steps=[step_row(0)])
    assert wait_for(lambda: snapshot(hub)["ranks"]["step"] == [0, 0])
    snap = snapshot(hub)
    assert snap["run"]["attempt"] == 1 and snap["run"]["attempts"] == 2
    assert snap["ranks"]["rank"] == [0, 1]
    state = hub.hub.state
    assert [rs.status for rs in state.attempts[0].ranks.values()] == ["ended", "ended"]
    assert state.attempts[0].ranks[0].last_step == 10  # the old attempt's history is kept


def test_slow_viewer_gets_fewer_snapshots_not_a_backlog(tmp_path):
    hub = ThreadedHub(record="", viewer_high_water=64 * 1024, lost_after_s=60).start()

    # one connection is one rank: 400 of them make a big snapshot
    ranks = [RankClient(hub.address, hub.token, rank, world=400) for rank in range(400)]
    r = ranks[0]
    assert r.recv().kind == wire.KIND_WELCOME
    r.batch(steps=[step_row(i) for i in range(50)], gpu=[gpu_row()])
    assert wait_for(lambda: len(snapshot(hub)["ranks"]["rank"]) == 400)
    host, port = hub.address.rsplit(":", 1)
    lazy = socket.socket()
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    lazy.connect((host, int(port)))
    nonce, key = auth.new_nonce(), auth.key_for(hub.token, "view")
    lazy.sendall(wire.encode(wire.KIND_HELLO, {"role": "viewer", "nonce": nonce,
                                               "auth": auth.VERSION}))
    [challenge] = wire.FrameDecoder().feed(lazy.recv(4096))
    lazy.sendall(wire.encode(wire.KIND_AUTH, {"proof": auth.client_proof(
        key, "viewer", challenge.payload["nonce"], nonce)}))

    def ask() -> bool:  # asks for a snapshot 20 times a second ... and never reads them
        lazy.sendall(wire.encode(wire.KIND_REQUEST, {"what": "snapshot"}))
        return bool(hub.hub.counters["snapshots_skipped"] > 0)

    assert wait_for(ask, timeout=30)
    t0 = time.monotonic()
    assert len(snapshot(hub)["ranks"]["rank"]) == 400  # an attentive viewer: served at once
    assert time.monotonic() - t0 < 2.0
    lazy.close()
    for c in ranks:
        c.close()
    hub.stop()


def test_prometheus_metrics_need_the_view_token(hub):
    r = RankClient(hub.address, hub.token, 0)
    assert r.recv().kind == wire.KIND_WELCOME
    r.batch(steps=[step_row(3, step_s=0.25)])
    assert wait_for(lambda: snapshot(hub)["ranks"]["step"] == [3])
    url = f"http://{hub.address}/metrics"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=5)
    assert err.value.code == 401
    view = auth.role_token(hub.token, "view")
    with pytest.raises(urllib.error.HTTPError) as err:  # no token in URLs
        urllib.request.urlopen(f"{url}?token={view}", timeout=5)
    assert err.value.code == 401
    for acting in (hub.token, auth.role_token(hub.token, "control")):  # never in a scraper
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {acting}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 403
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {view}"})
    text = urllib.request.urlopen(req, timeout=5).read().decode()
    assert 'rtop_step_seconds{job="test-job",node="node-a",rank="0"} 0.25' in text
    assert 'rtop_rank_up{job="test-job",node="node-a",rank="0"} 1.0' in text


def test_security_defaults(hub, tmp_path):
    host = hub.address.rsplit(":", 1)[0]
    assert host == "127.0.0.1"
    mode = stat.S_IMODE(os.stat(tmp_path / "run.rtop").st_mode)
    assert mode == 0o600
    with pytest.raises(ValueError, match="without a token"):
        from rtop.hub.server import Hub

        Hub(HubConfig(host="0.0.0.0", token=""))
    # a random token per hub
    other = ThreadedHub(record="").start()
    try:
        assert other.token != hub.token and len(other.token) >= 16
    finally:
        other.stop()


def test_snapshot_groups_ranks_by_node(hub):
    clients = []
    for rank, node in ((0, "node-a"), (1, "node-a"), (2, "node-b")):
        c = RankClient(hub.address, hub.token, rank, world=3, host=node)
        assert c.recv().kind == wire.KIND_WELCOME
        c.batch(steps=[step_row(0, step_s=0.1 * (rank + 1), comm=0.01 * (rank + 1))])
        clients.append(c)
    assert wait_for(lambda: snapshot(hub)["ranks"]["step"] == [0, 0, 0])
    nodes = snapshot(hub)["nodes"]
    assert nodes["node"] == ["node-a", "node-b"] and nodes["ranks"] == [2, 1]
    assert nodes["step_s"] == pytest.approx([0.2, 0.3])  # the slowest rank of each node


def test_collectors_own_cpu_is_shown_per_rank(hub):
    """Each batch carries the sender thread's CPU time; the hub turns it into a share of
    a core, so the UI can say what rtop costs the job."""
    c = RankClient(hub.address, hub.token, rank=0)
    c.batch(steps=[step_row(0)], cpu_s=2.000)
    time.sleep(1.2)
    c.batch(steps=[step_row(1)], cpu_s=2.012)
    assert wait_for(lambda: snapshot(hub)["ranks"]["rtop_cpu"][0] is not None)
    share = snapshot(hub)["ranks"]["rtop_cpu"][0]
    assert 0.012 / 1.6 < share < 0.012 / 1.1
    c.close()
