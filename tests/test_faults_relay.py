"""Fault suite: a node's relay (``rtop relay``) fails under a live job.

A real 2-rank DDP job (:mod:`rtop.workload`, gloo on CPU, each rank its own process)
is made "large" (``RTOP_RELAY_MIN_WORLD=2``), so its ranks find no relay on their node
and the first of them starts one, which carries both to a real hub (``rtop serve``).
Then, mid-run:

1. the relay is SIGKILLed: its ranks connect again (to a relay the first of them starts
   again, or to the hub directly) and send again what the hub had not acknowledged;
2. the relay's link to the hub is cut (the ranks and their relay in a network
   namespace, the hub outside it, the veth between them ``ip link set down``) for 8 s
   (30 s under ``RTOP_RELIABILITY_LONG=1``), then restored;
3. hostile relays (any holder of the ingest token can say hello as a relay) try to
   speak for the node's ranks: one for the node itself, one for another node that
   carries ranks naming this node, one that carries a rank of its own node under the
   rank number of a live rank of this one; each sends a batch with a far-off ``seq``
   (accepted, it would make the hub drop the real rank's batches as duplicates);
4. the relay is overloaded: its link to the hub held to 256 kbit/s (``tbf``, the
   namespace of 2.) and the relay itself stopped (SIGSTOP) 3 s of every 4, for 16 s
   (60 s), while ~1 ms steps make the ranks send several times what it can forward;
   then the link is freed.

Checked each time: every record the hub acknowledged to a rank is in the recording
exactly once (:func:`tests.faultkit.acked_once`: no step twice, the records recorded
are the records acknowledged, a missing step is one the rank dropped and counted); the
job finishes; its median step time during the fault stays within the suite's noise
bound of its steps before and after it (:func:`tests.faultkit.kept_pace`). For the
hostile relays: each is refused, the node's own relay and its ranks are untouched; for
the overload: the ranks' and the relay's memory stay bounded and no step waited for the
relay.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import auth, wire
from rtop.client import HubClient
from rtop.run.recording import read
from rtop.workload import WorkloadSpec, free_port
from tests import reliability
from tests.faultkit import (
    JobNetns,
    PeakRss,
    acked_once,
    finish_ranks,
    kept_pace,
    kill_ranks,
    median_steps,
    proc_alive,
    recorded,
    relay_pids,
    start_ranks,
    start_serve,
    stop_relays,
    stop_serve,
    wait_for,
)
from tests.rankclient import RankClient, step_row

MASTER = "relay-fault-master-token-0123456789"
INGEST = auth.role_token(MASTER, "ingest")
NODE = "node-a"
NET = JobNetns("rtop-fr-job", "rfr0", "rfr0h", "10.79.2.1", "10.79.2.2")


@pytest.fixture
def large_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Ranks of this test's job go through their node's relay (world 2 counts as
    large), on node ``node-a``; the relays they start are stopped at the end."""
    monkeypatch.setenv("RTOP_RELAY_MIN_WORLD", "2")
    monkeypatch.setenv("RTOP_NODE", NODE)
    try:
        yield
    finally:
        stop_relays()


class Run:
    """A hub (``rtop serve``) and a 2-rank job whose ranks reach it through their
    node's relay; the job trains until :meth:`finish`."""

    def __init__(self, tmp: Path, host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
                 **spec: Any) -> None:
        self.tmp, self.host = tmp, host
        self.record = tmp / "run.rtop"
        self.out, self.marks = tmp / "out", tmp / "marks"
        self.out.mkdir()
        self.marks.mkdir()
        self.stop = tmp / "stop"
        port = free_port()
        self.address = f"{host}:{port}"
        self.hub = start_serve(port, MASTER, self.record, host=host)
        probe = {"flush_interval_s": 0.1, "backoff_max_s": 1.0,
                 **spec.pop("probe_settings", {})}
        spec = {"dim": 64, "hidden": 128, **spec}
        self.spec = WorkloadSpec(world_size=2, duration_s=600.0, hub=self.address,
                                 token=INGEST, probe_settings=probe,
                                 fault_mark_dir=str(self.marks), stop_file=str(self.stop),
                                 **spec)
        self.procs = start_ranks(self.spec, self.out, free_port(), prefix=prefix)
        self.viewer = HubClient(self.address, MASTER)
        self.results: list[dict[str, Any]] = []

    def snap(self) -> dict[str, Any]:
        """The hub's snapshot now."""
        return self.viewer.snapshot()

    def counters(self) -> dict[str, int]:
        """The hub's counters now."""
        return dict(self.snap()["hub"]["counters"])

    def relayed(self, timeout: float = 120.0) -> float:
        """Wait until both ranks train, through one relay; the wall time they began."""
        assert wait_for(lambda: all((self.marks / f"fault-rank{r}").exists()
                                    for r in (0, 1)), timeout), \
            "the ranks never started training"
        assert wait_for(lambda: self.active() and self.counters()["relay_streams"] >= 2
                        and len(relay_pids()) == 1, 30), \
            (self.snap()["ranks"]["status"], self.counters(), relay_pids())
        return max(float((self.marks / f"fault-rank{r}").read_text()) for r in (0, 1))

    def active(self) -> bool:
        """Both ranks active at the hub."""
        return self.snap()["ranks"]["status"] == ["active", "active"]

    def back(self, since_step: list[int], timeout: float) -> float:
        """Wait until the hub hears both ranks again, past the steps ``since_step``
        (the hub's figures when the fault ended); the wall time it did."""
        def fresh() -> bool:
            ranks = self.snap()["ranks"]
            return ranks["status"] == ["active", "active"] and all(
                s > b + 1 for s, b in zip(ranks["step"], since_step, strict=True)) \
                and max(ranks["last_seen_s"]) < 1.0

        assert wait_for(fresh, timeout), (self.snap()["ranks"]["status"],
                                          self.snap()["ranks"]["step"], since_step)
        return time.time()

    def steps(self) -> list[int]:
        """The last step the hub holds of each rank."""
        return list(self.snap()["ranks"]["step"])

    def finish(self, after_s: float = 5.0) -> list[dict[str, Any]]:
        """Train ``after_s`` more, stop the job, wait for it; each rank's results. The
        hub is stopped then (its recording flushed)."""
        time.sleep(after_s)
        self.stop.touch()
        self.results = finish_ranks(self.procs, self.out, 120)
        return self.results

    def close(self) -> str:
        """Whatever still runs, stopped; the hub's output."""
        self.viewer.close()
        kill_ranks(self.procs)
        return stop_serve(self.hub)

    def pace(self, fault: str, t0: float, fault_at: float, fault_end: float,
             back_at: float) -> dict[str, float]:
        """The job's median step before, during and after the fault, checked."""
        before = median_steps(self.results, self.marks, t0, fault_at)
        during = median_steps(self.results, self.marks, fault_at, fault_end)
        after = median_steps(self.results, self.marks, back_at + 1.0, float("inf"))
        return {**kept_pace(fault, before, during, after),
                "step_before_ms": round(before * 1e3, 2),
                "step_during_ms": round(during * 1e3, 2),
                "step_after_ms": round(after * 1e3, 2)}


def _lost(acked: dict[str, int]) -> str:
    spooled = (f"; {acked['spooled']} spooled at exit, unacknowledged yet, all of them "
               "recorded") if acked["spooled"] else ""
    return (f"0 of {acked['acked']} acknowledged records ({acked['dropped']} dropped by the "
            f"ranks' bounded buffers, counted; {acked['resent_frames']} frames sent again"
            f"{spooled})")


# ---- 1: the relay killed -------------------------------------------------------------


def test_relay_killed_mid_run(tmp_path: Path, large_job: None):
    run = Run(tmp_path)
    try:
        t0 = run.relayed()
        relay = relay_pids()[0]
        before = run.counters()
        time.sleep(4.0)
        killed = time.time()
        os.kill(relay, signal.SIGKILL)  # batches in its hands, in flight, unacknowledged
        assert wait_for(lambda: not proc_alive(relay), 10)
        back = run.back(run.steps(), 30)
        # through a relay the first of them started again (the killed one, a zombie
        # its parent rank never reaps, does not pass for alive): not to the hub directly
        assert wait_for(lambda: len(relay_pids()) == 1 and relay_pids() != [relay]
                        and run.counters()["relay_streams"] - before["relay_streams"] >= 2,
                        30), (relay_pids(), relay, run.counters())
        after = run.counters()
        results = run.finish()
    finally:
        out = run.close()
    acked = acked_once(run.record, results)
    assert after["relays"] - before["relays"] == 1, after
    assert "relay for node 'node-a'" in out and "disconnected" in out, out[-3000:]
    pace = run.pace("the relay's kill", t0, killed, back + 1.0, back)
    reliability.record(
        "a node's relay SIGKILLed under a live 2-rank job (its ranks' only way to the hub)",
        f"the ranks were back on the hub within {back - killed:.1f} s, through a relay the "
        "first of them started again, and sent again what the hub had not acknowledged; "
        "the job trained on at its pace and finished",
        _lost(acked), **pace, back_after_kill_s=round(back - killed, 1),
        resent_frames=acked["resent_frames"], dropped=acked["dropped"])


# ---- 2: the relay's link to the hub cut ----------------------------------------------


@pytest.fixture
def job_netns() -> Iterator[JobNetns]:
    """A namespace for the job's ranks and their relay, joined to the hub's by a veth
    pair (root only)."""
    NET.build()
    try:
        yield NET
    finally:
        NET.teardown()


@pytest.mark.root
def test_relay_link_to_the_hub_cut_then_restored(tmp_path: Path, large_job: None,
                                                  job_netns: JobNetns):
    cut_s = 30.0 if reliability.long_run() else 8.0
    run = Run(tmp_path, host=NET.hub_ip, prefix=("ip", "netns", "exec", NET.ns))
    try:
        t0 = run.relayed()
        relay = relay_pids()[0]
        time.sleep(4.0)
        cut = time.time()
        NET.sh("ip", "link", "set", NET.host_dev, "down")
        time.sleep(cut_s)
        NET.sh("ip", "link", "set", NET.host_dev, "up")
        restored = time.time()
        # after a long cut TCP's retransmission backoff may wait about as long again
        back = run.back(run.steps(), cut_s + 30)
        kept = "kept its connection" if relay_pids() == [relay] else "was replaced"
        results = run.finish()
    finally:
        subprocess.run(["ip", "link", "set", NET.host_dev, "up"], capture_output=True)
        run.close()
    acked = acked_once(run.record, results)
    pace = run.pace("the cut", t0, cut, restored, back)
    reliability.record(
        f"a node's relay cut off from the hub ({cut_s:.0f} s, `ip link set down` on the "
        "veth between the node's namespace and the hub), then restored",
        f"the job trained on at its pace; the ranks' records reached the hub again "
        f"{back - restored:.1f} s after the restore; the relay {kept}",
        _lost(acked), **pace, back_after_restore_s=round(back - restored, 1),
        resent_frames=acked["resent_frames"], dropped=acked["dropped"])


# ---- 3: hostile relays ---------------------------------------------------------------


def _hostile_relay(address: str, node: str) -> RankClient:
    """A relay driven by hand: authenticated with the ingest token, for ``node``."""
    relay = RankClient(address, INGEST, role="relay", hello=False)
    relay.handshake(INGEST, "relay", {"node": node})
    return relay


def _speak_as(relay: RankClient, sid: int, identity: dict[str, Any]) -> wire.Frame:
    """Open stream ``sid`` on a hostile relay and go through a rank's handshake on it
    as ``identity`` (the relay holds the ingest key: it can prove itself as any rank),
    then send a batch with a far-off ``seq``; the hub's answer to the proof."""
    hello = {"role": "rank", "nonce": auth.new_nonce(), "auth": auth.VERSION,
             "identity": identity}
    relay.send(wire.KIND_RELAY, {"open": [sid], "data": [sid, wire.encode(
        wire.KIND_HELLO, hello)]})
    down = relay.recv()
    assert down is not None and down.kind == wire.KIND_DOWN, down
    challenge = wire.FrameDecoder().feed(down.payload["data"][1])[0]
    assert challenge.kind == wire.KIND_CHALLENGE, challenge
    key = auth.key_for(INGEST, "ingest")
    assert key is not None
    proof = auth.client_proof(key, "rank", challenge.payload["nonce"], hello["nonce"])
    poison = wire.encode(wire.KIND_BATCH, {
        "rank": identity["rank"], "group": identity["group"], "seq": 1 << 40,
        "t_wall": time.time(), "dropped": 0, "steps": [step_row(1 << 20)]})
    relay.send(wire.KIND_RELAY, {"data": [sid, wire.encode(wire.KIND_AUTH, {
        "proof": proof}) + poison]})
    answer = relay.recv()
    assert answer is not None and answer.kind == wire.KIND_DOWN, answer
    return wire.FrameDecoder().feed(answer.payload["data"][1])[0]


def _real_identities(record: Path) -> dict[int, dict[str, Any]]:
    """The ranks' identities as the hub recorded their hellos (no secret in them)."""
    out = {}
    for _, frame in read(record):
        if frame.kind == wire.KIND_HELLO and frame.payload.get("role") == "rank":
            ident = frame.payload["identity"]
            out[ident["rank"]] = ident
    return out


def test_hostile_relays_cannot_speak_for_the_nodes_ranks(tmp_path: Path, large_job: None):
    run = Run(tmp_path)
    try:
        t0 = run.relayed()
        relay = relay_pids()[0]
        # the hub writes its recording once a second: the hellos may not be in it yet
        assert wait_for(lambda: sorted(_real_identities(run.record)) == [0, 1], 10), \
            _real_identities(run.record)
        idents = _real_identities(run.record)
        assert idents[1]["hostname"] == NODE, idents
        before = run.counters()
        time.sleep(4.0)
        began = time.time()
        # a second relay for the node: refused while its own relay lives (which shows
        # it is alive when the hub asks)
        taken = _hostile_relay(run.address, NODE)
        err = taken.recv()
        assert err is not None and err.kind == wire.KIND_ERROR, err
        assert err.payload["code"] == "relay_taken"
        assert taken.closed_by_hub()
        # a relay for another node carrying the node's ranks, as they are
        foreign = _hostile_relay(run.address, "node-evil")
        assert foreign.recv().kind == wire.KIND_WELCOME
        for sid, rank in enumerate((0, 1)):
            refused = _speak_as(foreign, sid, idents[rank])
            assert refused.kind == wire.KIND_ERROR, refused
            assert refused.payload["code"] == "relay_node", refused
        # ... and a rank of its own node under a live rank's number: that rank is taken
        # (its own process alone may take it back: the instance secret)
        own = {**idents[1], "hostname": "node-evil", "pid": 4242}
        refused = _speak_as(foreign, 2, own)
        assert refused.kind == wire.KIND_ERROR and refused.payload["code"] == "rank_taken", \
            refused
        time.sleep(4.0)  # past the hub's 3 s for the holders to show they are alive
        ended = time.time()
        after = run.counters()
        assert run.active() and relay_pids() == [relay]
        back = time.time()
        results = run.finish()
        foreign.close()
        taken.close()
    finally:
        run.close()
    # refused, counted; the node's relay and its ranks' connections untouched
    assert after["relay_taken"] - before["relay_taken"] == 1, after
    assert after["relay_foreign"] - before["relay_foreign"] == 2, after
    assert after["rank_taken"] - before["rank_taken"] == 1, after
    assert after["dead_connections"] == before["dead_connections"], after
    assert after["relays"] - before["relays"] == 1, after  # the hostile one for node-evil
    # nothing of the hostile frames recorded: two ranks, their own steps only
    steps, _, _ = recorded(run.record)
    assert sorted(steps) == [0, 1] and max(max(s) for s in steps.values()) < 1 << 20
    acked = acked_once(run.record, results)
    # the ranks' connections held throughout: the only new streams are the hostile ones
    assert after["relay_streams"] - before["relay_streams"] == 3, after
    assert after["rank_replaced"] == before["rank_replaced"], after
    pace = run.pace("the hostile relays", t0, began, ended, back)
    reliability.record(
        "hostile relays (ingest token) speak for a node's live ranks: a second relay for "
        "the node; a relay for another node carrying the node's ranks; one carrying a "
        "rank of its own node under a live rank's number; each with a batch of seq 2^40",
        "each refused (relay_taken, relay_node x2, rank_taken), counted; the node's relay "
        "and its ranks' connections untouched; no hostile batch recorded",
        _lost(acked), **pace, dropped=acked["dropped"])


# ---- 4: the relay overloaded ---------------------------------------------------------


@pytest.fixture
def throttled_netns(job_netns: JobNetns) -> JobNetns:
    """The job's namespace, its link to the hub held to 256 kbit/s each way (``tbf``):
    the relay cannot forward as fast as its ranks send (root)."""
    for ns, dev in ((NET.ns, NET.dev), (None, NET.host_dev)):
        pre = ["ip", "netns", "exec", ns] if ns else []
        NET.sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "256kbit",
               "burst", "16kb", "latency", "100ms")
    return job_netns


@pytest.mark.root
def test_relay_overloaded_costs_bounded_buffers_not_steps(tmp_path: Path,
                                                          large_job: None,
                                                          throttled_netns: JobNetns):
    stalled_s = 60.0 if reliability.long_run() else 16.0
    # ~1 ms steps, a record each, through a relay whose link to the hub takes a fraction
    # of that (256 kbit/s) and that is besides stopped (SIGSTOP) 3 s of every 4; small
    # bounds at the ranks (8 frames of 0.1 s, a 16 kB socket send buffer) so that the
    # test's length is enough to fill them. What a rank keeps to send again (4 MiB)
    # must exceed what the relay's path can hold unacknowledged (its capped kernel
    # buffers and its high-water mark: ~1.5 MB), or records are let go unconfirmed
    run = Run(tmp_path, host=NET.hub_ip, prefix=("ip", "netns", "exec", NET.ns), dim=16,
              hidden=16, layers=1, batch=8, probe_settings={
                  "backlog_frames": 8, "max_unsent_bytes": 4 << 20,
                  "send_buffer_bytes": 16 * 1024})
    stops = 0
    relay = 0
    try:
        t0 = run.relayed()
        relay = relay_pids()[0]
        time.sleep(3.0)  # warm: the ranks' and the relay's memory settle
        watch = PeakRss([*(p.pid for p in run.procs), relay])
        began = time.time()
        end = time.monotonic() + stalled_s
        while time.monotonic() < end:
            os.kill(relay, signal.SIGSTOP)
            stops += 1
            time.sleep(3.0)
            os.kill(relay, signal.SIGCONT)
            time.sleep(1.0)
        ended = time.time()
        for ns, dev in ((NET.ns, NET.dev), (None, NET.host_dev)):  # the overload ends
            pre = ["ip", "netns", "exec", ns] if ns else []
            NET.sh(*pre, "tc", "qdisc", "del", "dev", dev, "root")
        back = run.back(run.steps(), 30)
        watch.close()
        same = relay_pids() == [relay]
        results = run.finish()
    finally:
        if relay:
            with contextlib.suppress(OSError):
                os.kill(relay, signal.SIGCONT)
        run.close()
    growth = watch.growth()
    ranks_mb = max(growth.get(p.pid, 0.0) for p in run.procs)
    # the ranks hold at most their 4 MiB of unsent frames (plus noise); the relay stops
    # reading its ranks when the hub's socket is full, and holds an interval otherwise
    assert ranks_mb < 40, growth
    assert growth.get(relay, 0.0) < 30, growth
    # no step waited for the relay (one held back would take up to its 3 s stops)
    slowest = max(t for r in results for t in r["times"][5:])
    assert slowest < 1.5, slowest
    acked = acked_once(run.record, results)
    if reliability.long_run():
        # 60 s of ~1 ms steps is more than a rank keeps (4 MiB): its bounded buffers were
        # reached, and held; in the short run (16 s, ~2.5 MB a rank) they need not be
        assert acked["dropped"] > 0, results
    pace = run.pace("the relay's overload", t0, began, ended, back)
    reliability.record(
        f"a node's relay overloaded: its link to the hub held to 256 kbit/s (tbf) and the "
        f"relay SIGSTOPped 3 s of every 4 for {stalled_s:.0f} s, while ~1 ms steps from 2 "
        "ranks go through it",
        "the ranks kept their pace and dropped what their bounded buffers could not keep, "
        "counted; memory bounded in the ranks and the relay; "
        + ("the same relay throughout" if same else "the relay was replaced"),
        _lost(acked), **pace, slowest_step_s=round(slowest, 3),
        rank_rss_growth_MB=round(ranks_mb, 1),
        relay_rss_growth_MB=round(growth.get(relay, 0.0), 1), dropped=acked["dropped"],
        stops=stops, back_after_overload_s=round(back - ended, 1))
