"""When the recorder's process falls behind, the hub stops reading its ranks, not its
loop, and no rank is taken for silent for the hub's own deafness.

Found at 16,384 ranks on a machine whose cores were all busy (``benchmarks/
hub_scale.py``): the recorder's process fell 64 MB behind, the hub waited for it with
its loop held (32 s and 38 s), and on reading again it marked thousands of ranks lost
(a critical ``lost_rank`` on a healthy job) while the relays, hearing nothing, connected
again. Now the hub pauses reading its ranks (and relays) instead, goes on serving
viewers, and says in the state and the recording when it paused and read again
(``ingest`` frames): a rank's silence counts from the later of its last frame and the
hub's last resumption, live and in a replay alike.

Checked with real processes: a real hub (in this process, on its thread), its real
recorder process stopped with SIGSTOP, real rank connections over real sockets.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from collectors import wire
from rtop import fleetsim
from rtop.analysis import AnalysisConfig, Monitor
from rtop.cli import format_snapshot
from rtop.client import HubClient
from rtop.hub import recorder as recorder_mod
from rtop.hub import server as server_mod
from rtop.hub.recorder import Recorder
from rtop.hub.service import ThreadedHub
from rtop.run.recording import read, replay
from rtop.run.state import KIND_INGEST, ProtocolError, RunState
from tests import reliability, waiting
from tests.rankclient import RankClient, hb_row, identity, step_row


def _hello(rank: int) -> wire.Frame:
    return wire.Frame(wire.KIND_HELLO, {"identity": identity(rank, world=2)})


def _batch(rank: int, seq: int) -> wire.Frame:
    return wire.Frame(wire.KIND_BATCH, {"rank": rank, "group": "g0", "seq": seq,
                                        "steps": [step_row(seq)]})


def _two_ranks(at: float) -> RunState:
    state = RunState(lost_after_s=10.0)
    for r in (0, 1):
        state.apply(_hello(r), at)
        state.apply(_batch(r, 1), at)
    return state


def test_a_rank_is_not_silent_while_the_hub_does_not_hear_it():
    state = _two_ranks(100.0)
    state.apply(wire.Frame(KIND_INGEST, {"paused": True}), 101.0)
    assert state.tick(130.0) == []  # 30 s without a frame, 29 of them unheard
    state.apply(wire.Frame(KIND_INGEST, {"paused": False}), 130.0)
    state.apply(_batch(1, 2), 130.5)  # rank 1's frames come; rank 0's do not
    assert state.tick(138.5) == []  # 1 + 8.5 s heard: not yet
    lost = state.tick(140.5)
    assert [rs.rank for rs in lost] == [0]
    assert lost[0].lost_at == pytest.approx(139.0)  # its 10th second heard
    # without the ingest frames the same silence is a loss at once: the test can fail
    assert sorted(rs.rank for rs in _two_ranks(100.0).tick(130.0)) == [0, 1]


def test_a_stall_learnt_after_the_fact_and_short_deaf_spans():
    state = _two_ranks(100.0)
    # the hub's loop was held up from 102 to 125: it says so once it runs again
    state.apply(wire.Frame(KIND_INGEST, {"paused": False, "since": 102.0}), 125.0)
    assert state.tick(125.0) == []
    assert [rs.rank for rs in state.tick(133.5)] == [0, 1]  # 2 + 8.5 + ... > 10 heard
    # deaf a second out of every two: a rank silent all along is still named, in 20 s
    state = _two_ranks(100.0)
    t, lost_at = 100.0, None
    while lost_at is None and t < 160:
        state.apply(wire.Frame(KIND_INGEST, {"paused": True}), t + 1.0)
        state.apply(wire.Frame(KIND_INGEST, {"paused": False}), t + 2.0)
        t += 2.0
        lost = state.tick(t)
        lost_at = t if lost else None
    assert lost_at is not None and 120.0 <= lost_at <= 122.0, lost_at


def test_no_rank_is_stuck_in_its_phase_for_what_the_hub_did_not_hear():
    """The hung-rank detector reads how long a rank has been in its phase as its last
    heartbeat's age plus the time since: the hub's deaf time is not counted, else a
    minute of deafness would make every rank hung; a rank that is stuck still is."""
    from rtop.analysis import window

    def state_at(deaf: bool) -> RunState:
        state = RunState(lost_after_s=10.0)
        for r in (0, 1):
            state.apply(_hello(r), 100.0)
            state.apply(wire.Frame(wire.KIND_BATCH, {
                "rank": r, "group": "g0", "seq": 1, "steps": [step_row(1)],
                "hb": [hb_row("compute", 0.2, 1)]}), 100.0)
        if deaf:
            state.apply(wire.Frame(KIND_INGEST, {"paused": True}), 101.0)
            state.apply(wire.Frame(KIND_INGEST, {"paused": False}), 160.0)
        return state

    cfg = AnalysisConfig.load()
    heard = window.take(state_at(deaf=True), cfg, now=161.0).phase_age_s
    assert heard.tolist() == pytest.approx([2.2, 2.2])  # 0.2 + 1 + 1 heard
    unheard = window.take(state_at(deaf=False), cfg, now=161.0).phase_age_s
    assert unheard.tolist() == pytest.approx([61.2, 61.2])  # the test can fail
    still = state_at(deaf=True)
    still.apply(wire.Frame(KIND_INGEST, {"paused": True}), 161.0)  # deaf again, now
    assert window.take(still, cfg, now=170.0).phase_age_s.tolist() == pytest.approx(
        [2.2, 2.2])


def test_only_the_hub_says_when_it_reads():
    state = RunState()
    rs = state.apply(_hello(0), 1.0)
    with pytest.raises(ProtocolError, match="may not say when the hub reads"):
        state.apply(wire.Frame(KIND_INGEST, {"paused": True}), 2.0, peer=rs)
    with pytest.raises(ProtocolError, match="'paused'"):
        state.apply(wire.Frame(KIND_INGEST, {"paused": "yes"}), 2.0)
    assert not state.deaf


def _stream() -> list[tuple[float, bytes]]:
    spec = fleetsim.FleetSpec(ranks=16, duration_s=30.0, step_s=0.5, seed=5)
    return [(t, wire.encode(kind, payload)) for t, kind, payload in
            fleetsim.frames(spec, "healthy")]


def test_a_recorder_behind_tells_the_hub_and_does_not_hold_its_loop(tmp_path, monkeypatch):
    """The recorder's process stopped (SIGSTOP) under a stream of frames: past
    ``BACKLOG_BYTES`` the recorder says so (``on_behind(True)``) and flushes return at
    once; once the process runs again and has written half of it, ``on_behind(False)``;
    past ``HARD_BACKLOG_FACTOR`` times the bound (a caller that keeps feeding it) a
    flush waits, the bound of last resort. Every frame is in the file."""
    bound = 96 * 1024
    monkeypatch.setattr(recorder_mod, "BACKLOG_BYTES", bound)
    frames = _stream() * 3
    path = tmp_path / "run.rtop"

    async def main() -> dict[str, object]:
        rec = Recorder(path, {"job": "x"}, process=True)
        told: list[tuple[bool, float]] = []
        rec.on_behind = lambda behind: told.append((behind, time.monotonic()))
        pid = rec.process_pid
        assert pid is not None
        rec.flush()
        os.kill(pid, signal.SIGSTOP)
        resumed = threading.Event()
        most_flush, most = 0.0, 0
        i = 0
        # feed it until it is behind; the flushes meanwhile return at once
        while not told and i < len(frames):
            rec.raw(frames[i][1], frames[i][0])
            i += 1
            if i % 40 == 0:
                t0 = time.monotonic()
                rec.flush(then=lambda: None)
                most_flush = max(most_flush, time.monotonic() - t0)
        assert told == [(True, told[0][1])] and rec.behind
        behind_at = time.monotonic()
        await asyncio.sleep(0.5)  # the loop runs: nothing waits on the process
        assert rec.behind and len(told) == 1
        threading.Timer(0.5, lambda: (os.kill(pid, signal.SIGCONT), resumed.set())).start()
        # a caller that ignores it: past twice the bound a flush waits for the process
        waited = 0.0
        while i < len(frames):
            rec.raw(frames[i][1], frames[i][0])
            i += 1
            if i % 40 == 0:
                t0 = time.monotonic()
                rec.flush(then=lambda: None)
                waited = max(waited, time.monotonic() - t0)
                proc = rec._proc
                assert proc is not None
                most = max(most, proc.backlog)
        end = time.monotonic() + 10
        while (rec.behind or len(told) < 2) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        out = {"told": told, "most_flush": most_flush, "waited": waited, "most": most,
               "behind_at": behind_at, "stalls": rec.stalls, "waits": rec.waits,
               "stalled_s": rec.stalled_s, "resumed": resumed.is_set()}
        rec.close()
        return out

    got = asyncio.run(main())
    told = got["told"]
    assert isinstance(told, list) and [b for b, _ in told] == [True, False], told
    assert got["resumed"] and told[1][1] >= told[0][1] + 0.9  # not before it ran again
    assert got["most_flush"] < 0.5  # before it was behind, flushes never waited
    assert got["waits"] >= 1 and got["waited"] >= 0.2  # the bound of last resort held
    chunk = max(len(d) for _, d in frames) * 40
    assert got["most"] <= recorder_mod.HARD_BACKLOG_FACTOR * bound + chunk
    assert got["stalls"] == 1 and got["stalled_s"] >= 0.9
    written = [f for _, f in read(path)]
    assert sum(1 for f in written if f.kind == wire.KIND_BATCH) == sum(
        1 for _, d in frames if wire.decode_body(d[wire.HEADER_BYTES:]).kind ==
        wire.KIND_BATCH)
    assert written[-1].kind == "end"


class _Streams:
    """Ranks connected to a hub (:class:`RankClient`, handshake done), each streaming
    batches of ``rows`` step records every ``every_s`` from a thread of its own."""

    def __init__(self, hub: ThreadedHub, world: int, rows: int, every_s: float) -> None:
        self.hub, self.rows, self.every_s = hub, rows, every_s
        self.ranks = [RankClient(hub.address, hub.token, r, world=world)
                      for r in range(world)]
        self.sent = dict.fromkeys(range(world), 0)
        self.stopped = threading.Event()
        for rc in self.ranks:
            welcome = rc.recv()
            assert welcome is not None and welcome.kind == wire.KIND_WELCOME
        self.threads = [threading.Thread(target=self._stream, args=(rc,), daemon=True)
                        for rc in self.ranks]
        for t in self.threads:
            t.start()

    def _stream(self, rc: RankClient) -> None:
        while not self.stopped.is_set():
            self.sent[rc.rank] += 1
            seq = self.sent[rc.rank]
            rc.send(wire.KIND_BATCH, {"rank": rc.rank, "group": rc.group, "seq": seq,
                                      "steps": [step_row(seq * self.rows + i)
                                                for i in range(self.rows)]})
            time.sleep(self.every_s)

    def stop(self) -> dict[int, int]:
        """Stop sending; once the hub holds every batch sent, how many each rank sent."""
        self.stopped.set()
        for t in self.threads:
            t.join(5)
        last = dict(self.sent)
        waiting.wait_for(lambda: self.hub.call(lambda h: [
            rs.last_seq for rs in sorted(h.state.active_ranks(), key=lambda rs: rs.rank)])
            == [last[r] for r in sorted(last)], timeout=20, what="every batch sent")
        return last

    def close(self) -> None:
        self.stopped.set()
        for rc in self.ranks:
            rc.close()


def _each_once_in_order(frames: list[wire.Frame], last: dict[int, int]) -> None:
    """Every batch each rank sent (``last[rank]`` of them) is recorded once, in order."""
    for r, n in last.items():
        seqs = [f.payload["seq"] for f in frames
                if f.kind == wire.KIND_BATCH and f.payload.get("rank") == r]
        assert seqs == list(range(1, n + 1)), r


def test_the_hub_pauses_its_ranks_for_a_recorder_behind_and_loses_none(
        tmp_path: Path, monkeypatch, caplog):
    """A live hub whose recorder's process stops (SIGSTOP) while two ranks send ten
    batches a second: the hub stops reading them (``ingest_pauses``), answers a viewer
    meanwhile, takes neither rank for silent or lost though it hears nothing for 4 s,
    twice ``lost_after_s`` (2 s), reads again once the process caught up, and every
    batch is in the recording once. A replay of the recording agrees (no rank lost); the
    same replay without the hub's ``ingest`` frames marks both lost: the test can fail."""
    monkeypatch.setattr(recorder_mod, "BACKLOG_BYTES", 48 * 1024)
    monkeypatch.setattr(recorder_mod, "PROCESS_BYTES_PER_S", 1)  # a process at once
    path = tmp_path / "run.rtop"
    hub = ThreadedHub(record=str(path), token="pause-token-0123456789",
                      lost_after_s=2.0).start()
    streams = _Streams(hub, world=2, rows=10, every_s=0.1)
    sent = streams.sent
    try:
        pid = waiting.wait_for(lambda: hub.call(lambda h: h.recorder.process_pid),
                               timeout=10, what="the recorder's process")
        os.kill(pid, signal.SIGSTOP)
        sent_at_stop = max(sent.values())
        waiting.wait_for(lambda: hub.call(lambda h: h.ingest_paused_since is not None),
                         timeout=10, what="the hub to pause its ranks")
        paused = time.monotonic()
        with HubClient(hub.address, hub.token) as viewer:  # the loop serves meanwhile
            t0 = time.monotonic()
            snap = viewer.snapshot()
            answered = time.monotonic() - t0
        assert answered < 2.0 and hub.call(lambda h: h.ingest_paused_since is not None)
        assert snap["hub"]["counters"]["ingest_pauses"] == 1
        assert snap["run"]["deaf_s"] >= 0.0  # the viewer is told the hub does not hear
        assert "the hub is behind its ranks' data" in format_snapshot(snap)  # rtop status
        time.sleep(max(0.0, paused + 4.0 - time.monotonic()))
        status = hub.call(lambda h: {rs.rank: rs.status for rs in h.state.active_ranks()})
        assert status == {0: "active", 1: "active"}  # 4 s unheard, none silent
        os.kill(pid, signal.SIGCONT)
        waiting.wait_for(lambda: hub.call(lambda h: h.ingest_paused_since is None),
                         timeout=20, what="the hub to read again")
        # what was sent while it did not read comes in; then, still streaming, a look
        waiting.wait_for(lambda: hub.call(lambda h: min(
            rs.last_seq or 0 for rs in h.state.active_ranks())) > sent_at_stop,
            timeout=20, what="the batches sent while the hub did not read")
        time.sleep(2.5)  # more than lost_after_s of listening since
        checked = time.time()
        status = hub.call(lambda h: {rs.rank: rs.status for rs in h.state.active_ranks()})
        findings = hub.call(lambda h: [f["kind"] for f in h.monitor.findings])
        counters = hub.call(lambda h: dict(h.counters))
        logged = [r.getMessage() for r in caplog.records]
        last = streams.stop()
    finally:
        streams.close()
        hub.stop()
    assert status == {0: "active", 1: "active"}, status
    assert "lost_rank" not in findings, findings
    # (once more, maybe, briefly: what the ranks sent meanwhile comes in at once)
    assert counters["ingest_pauses"] >= 1 and counters["ingest_paused_ms"] >= 1000
    assert counters["bad_frames"] == 0 and counters["dead_connections"] == 0
    assert not [m for m in logged if "disconnected" in m or "silent for" in m
                or "closed" in m], logged
    frames = [f for _, f in read(path)]
    _each_once_in_order(frames, last)
    marks = [f.payload["paused"] for f in frames if f.kind == KIND_INGEST]
    assert marks[:2] == [True, False], marks

    def lost_in_replay(keep_marks: bool) -> list[int]:
        monitor = Monitor(RunState(lost_after_s=2.0), AnalysisConfig.load())
        lost: list[int] = []

        def on_frame(t_hub: float, frame: wire.Frame, st: RunState) -> None:
            ev = monitor.advance(t_hub) if t_hub <= checked else None
            if ev is not None:  # (after the look above the ranks stopped sending)
                lost.extend(rs.rank for rs in ev.lost)
        if keep_marks:
            replay(path, monitor.state, on_frame=on_frame)
        else:
            for t_hub, frame in read(path):
                if frame.kind != KIND_INGEST:
                    monitor.state.apply(frame, t_hub)
                    on_frame(t_hub, frame, monitor.state)
        return sorted(set(lost))

    assert lost_in_replay(keep_marks=True) == []
    assert lost_in_replay(keep_marks=False) == [0, 1]
    reliability.record(
        "the recorder's process stopped (SIGSTOP) under a live job: the hub heard nothing "
        "for 4 s, twice the silence after which it takes a rank for lost (2 s here)",
        "the hub stopped reading its ranks until the process caught up and served its "
        "viewer meanwhile; no rank taken for lost, live or in a replay; every batch "
        "recorded once", 0, pauses=counters["ingest_pauses"],
        paused_s=round(counters["ingest_paused_ms"] / 1000, 1),
        viewer_answer_s=round(answered, 2))


def test_data_that_waits_for_its_turn_arrives_whole_and_in_order(tmp_path: Path,
                                                                 monkeypatch):
    """Every pass of the hub's loop spends its slice for the ranks' data at the first
    read (``INGEST_SLICE_S`` = 0), so nearly everything the ranks send waits for a later
    pass (``ingest_deferred``): eight ranks streaming 100 batches a second still have
    every batch recorded once, in order, and a viewer is answered
    meanwhile."""
    monkeypatch.setattr(server_mod, "INGEST_SLICE_S", 0.0)
    path = tmp_path / "run.rtop"
    hub = ThreadedHub(record=str(path), token="slice-token-0123456789").start()
    streams = _Streams(hub, world=8, rows=1, every_s=0.01)
    try:
        with HubClient(hub.address, hub.token) as viewer:
            for _ in range(5):
                t0 = time.monotonic()
                snap = viewer.snapshot()
                assert time.monotonic() - t0 < 2.0
                time.sleep(0.3)
        last = streams.stop()
        counters = hub.call(lambda h: dict(h.counters))
        statuses = snap["ranks"]["status"]
    finally:
        streams.close()
        hub.stop()
    assert statuses == ["active"] * 8
    assert counters["ingest_deferred"] >= 50, counters  # the waiting path was taken
    assert counters["bad_frames"] == 0 and counters["floods"] == 0
    _each_once_in_order([f for _, f in read(path)], last)


async def test_the_header_says_when_the_hub_does_not_hear_its_ranks():
    """A snapshot taken while the hub did not hear its ranks for 12 s (``run.deaf_s``)
    says so in the header, in the real app; a moment of it (0.3 s) is not said."""
    from rtop.tui.app import make_app
    from rtop.tui.header import JobHeader
    from rtop.tui.source import StaticSource
    from tests.test_tui import fixture_source

    base = fixture_source("starved", 22.0)
    for deaf, shown in ((12.0, True), (0.3, False)):  # (0:00 is never said)
        snap = dict(base.snapshots[0])
        snap["run"] = {**snap["run"], "deaf_s": deaf}
        app = make_app(StaticSource([snap], base.details, title="deaf"))
        async with app.run_test(size=(160, 32)) as pilot:
            deadline = time.monotonic() + 10
            while app.snapshots_seen == 0:
                assert time.monotonic() < deadline
                await pilot.pause(0.05)
            text = str(app.query_one(JobHeader).render())
        assert ("hub behind its ranks' data for 0:12: figures lag" in text) == shown, text
        assert ("hub behind" in text) == shown, text
