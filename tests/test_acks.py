"""The hub acknowledges batches; a rank keeps what was not acknowledged and sends it
again after a reconnect; the hub applies and records each batch once.

The rank's side against a scripted hub (what it keeps, resends, waits for at the end,
and spools), the hub's side with a real hub and a real rank connection (a batch sent
twice is applied and recorded once), and a real 2-rank job that ends normally (nothing
left unacknowledged, nothing spooled).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from collectors import wire
from collectors.config import ProbeConfig
from collectors.connection import ConnState, HubConnection
from collectors.identity import detect
from rtop.client import HubClient
from rtop.hub.service import ThreadedHub
from rtop.run.recording import read
from rtop.run.spool import read_spool, spool_files
from rtop.run.state import RunState
from rtop.workload import WorkloadSpec, run_local
from tests import reliability
from tests.faultkit import recorded, twice
from tests.test_connection import ScriptedHub, _batch, _conn, _pump_until


def _up(hub: ScriptedHub, conn: HubConnection) -> None:
    """Handshake and welcome."""
    hub.handshake(conn)
    hub.welcome({"t_hub": time.time(), "acks": True})
    _pump_until(conn, "the welcome", lambda: conn.state is ConnState.UP)


def _read_batches(hub: ScriptedHub, n: int) -> list[int]:
    """The seqs of the next ``n`` frames the rank sent (batches, several per read)."""
    assert hub.conn is not None
    frames: list[wire.Frame] = []
    while len(frames) < n:
        frames += hub._dec.feed(hub.conn.recv(65536))
    assert len(frames) == n, frames
    return [f.payload["seq"] for f in frames]


def test_rank_keeps_unacknowledged_batches_and_sends_them_again_first():
    hub = ScriptedHub()
    try:
        conn = _conn(hub.address)
        conn.pump(time.monotonic())
        _up(hub, conn)
        for seq in range(1, 6):
            conn.send(_batch(seq), 10, seq)
        _pump_until(conn, "the writes", _drained(conn))
        assert _read_batches(hub, 5) == [1, 2, 3, 4, 5]
        assert conn.unacked_frames == 5 and conn.sent_records == 0  # none confirmed yet
        hub.send(wire.KIND_ACK, {"seq": 3})
        _pump_until(conn, "the ack", lambda: conn.unacked_frames == 2)
        assert conn.sent_records == 30 and conn.sent_frames == 3
        # the connection breaks: 4 and 5 may never have reached the hub
        assert hub.conn is not None
        hub.conn.close()
        _pump_until(conn, "the loss", lambda: conn.state is ConnState.DOWN)
        conn.send(_batch(6), 10, 6)
        _pump_until(conn, "a reconnect", lambda: conn.state is ConnState.HELLO)
        _up(hub, conn)
        _pump_until(conn, "the writes", _drained(conn))
        # sent again first, in order, then the new one
        assert _read_batches(hub, 3) == [4, 5, 6]
        assert conn.stats()["resent_frames"] == 2
        hub.send(wire.KIND_ACK, {"seq": 6})
        _pump_until(conn, "the ack", lambda: conn.unacked_frames == 0)
        assert conn.sent_records == 60 and conn.dropped_unsent == 0
    finally:
        hub.close()


def test_unacknowledged_batches_are_bounded():
    hub = ScriptedHub()
    try:
        conn = _conn(hub.address, max_unsent_bytes=20_000)
        conn.pump(time.monotonic())
        _up(hub, conn)
        for seq in range(1, 11):
            conn.send(_batch(seq, pad=4000), 2, seq)
            _pump_until(conn, "the write", lambda: not conn.wants_write
                        and conn.queued_frames == 0)
            assert _read_batches(hub, 1) == [seq]
        # ~4 kB each: at most 20 kB kept; the oldest let go unconfirmed, counted
        assert conn.unacked_frames <= 5
        assert conn.unconfirmed_records == 2 * (10 - conn.unacked_frames)
        assert conn.sent_records == conn.unconfirmed_records
    finally:
        hub.close()


def _drained(conn: HubConnection) -> Callable[[], bool]:
    return lambda: not conn.wants_write and conn.queued_frames == 0


@pytest.mark.parametrize("acked", [True, False], ids=["hub-acks", "hub-silent"])
def test_finish_waits_for_the_ack_and_spools_what_is_not_acknowledged(
        tmp_path: Path, acked: bool):
    hub = ScriptedHub()
    try:
        conn = _conn(hub.address, spool_dir=str(tmp_path))
        conn.pump(time.monotonic())
        _up(hub, conn)
        for seq in (1, 2):
            conn.send(_batch(seq), 5, seq)
        _pump_until(conn, "the writes", _drained(conn))
        assert _read_batches(hub, 2) == [1, 2]

        def answer() -> None:  # as a real hub does: the bye answered with an ack
            assert hub.read().kind == wire.KIND_BYE
            if acked:
                hub.send(wire.KIND_ACK, {"seq": 2})
        helper = threading.Thread(target=answer)
        helper.start()
        t0 = time.monotonic()
        conn.finish(time.monotonic() + 1.5, lambda: {"rank": 0, "group": "g"})
        took = time.monotonic() - t0
        helper.join(5)
        if acked:
            assert conn.sent_records == 10 and conn.spooled_records == 0, conn.stats()
            assert took < 1.0 and not spool_files(tmp_path)
        else:  # what the hub did not acknowledge is kept for a later hub
            assert conn.sent_records == 0 and conn.spooled_records == 10, conn.stats()
            (path,) = spool_files(tmp_path)
            seqs = [f.payload["seq"] for _, f in read_spool(path).frames
                    if f.kind == wire.KIND_BATCH]
            assert seqs == [1, 2]
    finally:
        hub.close()


def test_hub_applies_and_records_a_batch_sent_again_once(tmp_path: Path):
    record = tmp_path / "run.rtop"
    hub = ThreadedHub(record=str(record), token="acks-token-0123456789").start()
    ident = detect(rank=0, world_size=1, group="acks")
    cfg = ProbeConfig(hub=hub.address, token=hub.token, backoff_initial_s=0.01,
                      backoff_max_s=0.05)
    conn = HubConnection(cfg, ident)

    def batch(seq: int) -> bytes:
        return wire.encode(wire.KIND_BATCH, {"rank": 0, "group": ident.group, "seq": seq,
                                             "dropped": 0})
    try:
        _pump_until(conn, "the welcome", lambda: conn.state is ConnState.UP)
        for seq in (1, 2):
            conn.send(batch(seq), 1, seq)
        _pump_until(conn, "the hub's ack", lambda: conn.sent_records == 2)
        for seq in (3, 4):
            conn.send(batch(seq), 1, seq)
        _pump_until(conn, "the writes", lambda: not conn.wants_write
                    and conn.queued_frames == 0)
        assert conn.unacked_frames == 2
        conn.close()  # before the hub acknowledged 3 and 4 (it acks once a second)
        _pump_until(conn, "the reconnect", lambda: conn.state is ConnState.UP)
        conn.send(batch(5), 1, 5)
        _pump_until(conn, "every ack", lambda: conn.unacked_frames == 0
                    and conn.queued_frames == 0 and conn.sent_records == 5, timeout=15)
        assert conn.stats()["resent_frames"] == 2
        with HubClient(hub.address, hub.token) as viewer:
            counters = viewer.snapshot()["hub"]["counters"]
        assert counters["duplicate_batches"] == 2, counters
    finally:
        conn.close()
        hub.stop()
    seqs = [f.payload["seq"] for _, f in read(record) if f.kind == wire.KIND_BATCH]
    assert seqs == [1, 2, 3, 4, 5]  # each once, in order
    reliability.record(
        "a rank's connection breaks after it wrote batches the hub had not yet "
        "acknowledged",
        "the rank sent them again first on its next connection; the hub applied and "
        "recorded each batch once (2 duplicates ignored)",
        0, resent_frames=2, duplicates_ignored=counters["duplicate_batches"])


def test_run_state_applies_a_rank_process_batch_once():
    state = RunState()
    ident = detect(rank=0, world_size=1, group="g", pid=100)
    hello = wire.Frame(wire.KIND_HELLO, {"identity": ident.to_wire()})

    def batch(seq: int, step: int) -> wire.Frame:
        return wire.Frame(wire.KIND_BATCH, {"rank": 0, "group": "g", "seq": seq,
                                            "steps": [[step, 1.0] + [None] * 13]})
    rs = state.apply(hello, 1.0)
    assert rs is not None
    state.apply(batch(1, 0), 1.1)
    state.apply(batch(2, 1), 1.2)
    state.apply(hello, 2.0)  # the same process, reconnected
    assert state.is_duplicate(batch(2, 1), rs)
    state.apply(batch(2, 1), 2.1)  # sent again
    state.apply(batch(3, 2), 2.2)
    assert rs.steps_seen == 3 and state.duplicate_frames == 1
    # another process in rank 0's place counts its batches afresh
    other = wire.Frame(wire.KIND_HELLO, {"identity": detect(
        rank=0, world_size=1, group="g", pid=200).to_wire()})
    state.apply(other, 3.0)
    state.apply(batch(1, 0), 3.1)
    assert rs.steps_seen == 4 and state.duplicate_frames == 1


@pytest.mark.job
def test_a_job_that_ends_normally_leaves_nothing_unacknowledged(tmp_path: Path):
    token = "acks-job-token-0123456789"
    record = tmp_path / "run.rtop"
    hub = ThreadedHub(record=str(record), token=token, spool_dir=str(tmp_path)).start()
    try:
        results = run_local(WorkloadSpec(world_size=2, duration_s=3.0, dim=32, hidden=32,
                                         hub=hub.address, token=token,
                                         probe_settings={"spool_dir": str(tmp_path)}),
                            timeout_s=120)
    finally:
        hub.stop()
    steps, records, _ = recorded(record)
    for rank, res in enumerate(results):
        stats = res["stats"]
        # every record confirmed by the hub's ack before the rank left: none spooled
        assert stats["spooled_records"] == 0 and stats["dropped_unsent"] == 0, stats
        assert stats["resent_frames"] == 0 and stats["unconfirmed_records"] == 0, stats
        assert records[rank] == stats["sent_records"], (records[rank], stats)
        assert steps[rank] == list(range(len(res["times"]))) and not twice(steps[rank])
    assert not spool_files(tmp_path)
