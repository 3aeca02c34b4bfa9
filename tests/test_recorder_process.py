"""The recording written by a process of the recorder's own (:mod:`rtop.hub.record_proc`).

Checked with real processes: the same file whether the hub's process or the recorder's
writes it (or the one, then the other); a flush with ``then`` hands over and returns at
once, ``then`` coming once the frames are in the file; the recorder's process killed
mid-run under a live hub (the hub keeps serving, one error is logged, and no batch it
acknowledged, nor any other, is missing from the recording); a hung process (stopped)
taken over; a hub killed right after it handed frames over loses none of them; a full
disk stops the recording with one error while flushes still call back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from collectors import wire
from rtop import fleetsim
from rtop.hub import recorder as recorder_mod
from rtop.hub.recorder import Recorder
from rtop.hub.service import ThreadedHub
from rtop.run.recording import ReadResult, read
from tests import waiting
from tests.rankclient import RankClient, step_row

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "tok-7d1c0e9a-process-never-written"
END_T = 1_900_000_000.0


def _stream() -> list[tuple[float, bytes]]:
    """A simulated 16-rank run's frames (as a hub gets them), some holding the token."""
    spec = fleetsim.FleetSpec(ranks=16, duration_s=30.0, step_s=0.5, seed=3)
    out = [(t, wire.encode(kind, payload)) for t, kind, payload in
           fleetsim.frames(spec, "straggler")]
    t = out[-1][0]
    out.append((t, wire.encode(wire.KIND_BATCH, {
        "rank": 0, "group": "g", "seq": 99, "meta": {"note": f"x {TOKEN} y",
                                                      "password": "p"}})))
    return out


def _write(path: Path, frames: list[tuple[float, bytes]], process: bool | None,
           monkeypatch: pytest.MonkeyPatch, switch_at: int | None = None) -> Recorder:
    rec = Recorder(path, {"job": "same", "hub": {"started": 1.0}}, secrets=[TOKEN],
                   process=process)
    for i, (t, data) in enumerate(frames):
        rec.raw(data, t)
        if i % 100 == 99:
            if switch_at is not None and i >= switch_at and rec.process_pid is None:
                time.sleep(1.05)  # a second of frames above the rate: a process takes over
            rec.flush()
            if switch_at is not None and i >= switch_at:
                assert rec.process_pid is not None
        if i == len(frames) // 2:
            rec.add_secret("added-later-secret")
    rec.frame("finding", {"event": "onset", "note": "added-later-secret"}, frames[-1][0])
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: END_T)
        rec.close()
    return rec


def test_the_same_file_whoever_writes_it(tmp_path, monkeypatch):
    """In the hub's process, in the recorder's from the start, and the one then the
    other: byte for byte the same file (secrets taken out, ``end`` frame, counts)."""
    frames = _stream()
    monkeypatch.setattr(recorder_mod, "PROCESS_BYTES_PER_S", 0)
    files, recs = [], []
    for name, process, switch in (("here", False, None), ("there", True, None),
                                  ("switched", None, len(frames) // 3)):
        path = tmp_path / f"{name}.rtop"
        recs.append(_write(path, frames, process, monkeypatch, switch))
        files.append(path.read_bytes())
    assert files[0] == files[1] == files[2]
    assert [r.frames for r in recs] == [recs[0].frames] * 3
    assert recs[0].secrets_dropped == recs[1].secrets_dropped >= 3
    assert TOKEN.encode() not in files[0]
    got = list(read(tmp_path / "there.rtop"))
    assert got[-1][1].kind == "end" and got[-1][1].payload["frames"] == len(got)
    assert sum(1 for _, f in got if f.kind == wire.KIND_BATCH) == \
        sum(1 for _, d in frames if wire.decode_body(d[wire.HEADER_BYTES:]).kind ==
            wire.KIND_BATCH)
    assert (tmp_path / "there.rtop").stat().st_mode & 0o777 == 0o600


def test_a_flush_with_then_returns_at_once_and_calls_back_once_written(tmp_path):
    path = tmp_path / "run.rtop"
    frames = _stream()

    async def main() -> list[tuple[int, int]]:
        rec = Recorder(path, {"job": "x"}, process=True)
        pid = rec.process_pid
        assert pid is not None
        seen: list[tuple[int, int]] = []
        done = asyncio.Event()
        for i, (t, data) in enumerate(frames):
            rec.raw(data, t)
            if i % 200 == 199 or i == len(frames) - 1:
                n = i + 1

                def then(n: int = n) -> None:
                    # every frame given so far reads back from the file by now
                    batches = sum(1 for _, f in read(path) if f.kind != wire.KIND_CLOCK)
                    seen.append((n, batches))
                    if n == len(frames):
                        done.set()
                t0 = time.perf_counter()
                rec.flush(then=then)
                assert time.perf_counter() - t0 < 0.05  # handed over, not waited for
        await asyncio.wait_for(done.wait(), 30)
        rec.close()
        return seen

    seen = asyncio.run(main())
    assert [n for n, _ in seen] == sorted(n for n, _ in seen)  # in order
    for n, in_file in seen:
        assert in_file >= n + 1  # the run frame and the frames given, at least


def _batch(rank: int, seq: int, group: str) -> dict[str, Any]:
    return {"rank": rank, "group": group, "seq": seq, "t_wall": time.time(), "dropped": 0,
            "steps": [step_row(seq)]}


def _acks(r: RankClient, got: list[int]) -> None:
    """The acks waiting on ``r``'s connection (without waiting for more)."""
    while True:
        try:
            f = r.recv(timeout=0.001)
        except TimeoutError:
            return
        if f is None:
            return
        if f.kind == wire.KIND_ACK:
            got.append(int(f.payload["seq"]))


def test_the_recorders_process_killed_under_a_live_hub(tmp_path, monkeypatch, caplog):
    """A real hub whose recording a process of its own writes; a rank streams batches;
    the process is killed (SIGKILL) mid-run. The hub logs one error, goes on serving
    (acks keep coming, the state keeps taking batches) and writes the recording itself:
    every batch the rank sent, among them every one acknowledged, is in it."""
    monkeypatch.setattr(recorder_mod, "PROCESS_BYTES_PER_S", 0)
    caplog.set_level(logging.INFO, logger="rtop.hub")
    path = tmp_path / "run.rtop"
    hub = ThreadedHub(record=str(path), token="t" * 24).start()
    acks: list[int] = []
    seq = 0
    try:
        r = RankClient(hub.address, hub.token, 0, world=1)
        assert r.recv().kind == wire.KIND_WELCOME

        def send_for(seconds: float) -> None:
            nonlocal seq
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                seq += 1
                r.send(wire.KIND_BATCH, _batch(0, seq, r.group))
                _acks(r, acks)
                time.sleep(0.005)

        deadline = time.monotonic() + 20
        pid = None
        while pid is None and time.monotonic() < deadline:
            send_for(0.2)
            pid = hub.call(lambda h: h.recorder.process_pid)
        assert pid is not None, "no recorder process started"
        send_for(1.5)
        assert acks, "acks came while the process wrote"
        os.kill(pid, signal.SIGKILL)
        killed_at = seq
        send_for(3.0)
        assert hub.call(lambda h: h.recorder.process_pid) is None  # the hub writes now
        assert max(acks) > killed_at  # acks went on after the kill
        assert waiting.wait_for(lambda: hub.call(lambda h: h.state.step_records) == seq,
                                timeout=10)
        r.send(wire.KIND_BYE, {"rank": 0, "group": r.group, "dropped": 0, "reason": "done"})
        while True:  # the bye's ack: the last batch acknowledged
            f = r.recv(timeout=10)
            assert f is not None
            if f.kind == wire.KIND_ACK:
                acks.append(int(f.payload["seq"]))
                if acks[-1] == seq:
                    break
    finally:
        hub.stop(timeout=30)
    result = ReadResult()
    seqs = {f.payload["seq"] for _, f in read(path, result) if f.kind == wire.KIND_BATCH}
    assert set(range(1, max(acks) + 1)) <= seqs  # nothing acknowledged is lost
    assert seqs == set(range(1, seq + 1))  # nor anything else
    assert result.closed and not result.damaged, (result.warnings, result.damaged)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "recorder's process" in errors[0] and str(pid) in errors[0], \
        errors


def test_a_hung_process_is_taken_over(tmp_path, monkeypatch, caplog):
    """A recorder process that stops answering (SIGSTOP) is killed after ``HUNG_S``; the
    hub's process writes what it had not confirmed, and the flushes' callbacks come."""
    monkeypatch.setattr(recorder_mod, "HUNG_S", 1.0)
    path = tmp_path / "run.rtop"
    frames = _stream()

    async def main() -> int:
        rec = Recorder(path, {"job": "x"}, process=True)
        pid = rec.process_pid
        assert pid is not None
        rec.flush()
        os.kill(pid, signal.SIGSTOP)
        called = 0

        def then() -> None:
            nonlocal called
            called += 1
        for i, (t, data) in enumerate(frames):
            rec.raw(data, t)
            if i % 100 == 99:
                rec.flush(then=then)
                await asyncio.sleep(0.05)
        flushes = len(frames) // 100
        end = time.monotonic() + 15
        while called < flushes and time.monotonic() < end:
            rec.flush(then=then)
            await asyncio.sleep(0.1)
        assert rec.process_pid is None
        rec.close()
        return called

    assert asyncio.run(main()) >= len(frames) // 100
    got = [f for _, f in read(path)]
    assert sum(1 for f in got if f.kind == wire.KIND_BATCH) == \
        sum(1 for _, d in frames if wire.decode_body(d[wire.HEADER_BYTES:]).kind ==
            wire.KIND_BATCH)
    assert got[-1].kind == "end"
    assert any("confirmed nothing" in r.getMessage() for r in caplog.records
               if r.levelno >= logging.ERROR)


def test_a_hub_killed_after_handing_over_loses_none_of_it(tmp_path):
    """A process records through a recorder process, which is stopped (SIGSTOP) while
    the process hands 500 frames over (a flush that does not wait; they lie in the pipe,
    which holds them all) and is killed (SIGKILL). Let go on (SIGCONT), the recorder's
    process writes them all, then ends."""
    path = tmp_path / "run.rtop"
    script = textwrap.dedent(f"""
        import asyncio, os, signal, sys, time
        from collectors import wire
        from rtop.hub.recorder import Recorder

        async def main():
            rec = Recorder({str(path)!r}, {{"job": "x"}}, process=True)
            rec.frame("note", {{"ready": 1}}, 99.0)
            rec.flush()  # it answered: it runs
            print(rec.process_pid, flush=True)
            os.kill(rec.process_pid, signal.SIGSTOP)
            for i in range(500):
                rec.raw(wire.encode("batch", {{"rank": 0, "group": "g", "seq": i + 1,
                                              "steps": [[i, 1.0 + i, 0.5]]}}), 100.0 + i)
            rec.flush(then=lambda: None)
            time.sleep(0.5)  # the hub's writer thread puts them in the pipe
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60,
                          stdout=subprocess.PIPE, text=True)
    assert proc.returncode == -signal.SIGKILL
    pid = int(proc.stdout.split()[0])

    def written() -> set[int]:
        return {f.payload["seq"] for _, f in read(path) if f.kind == wire.KIND_BATCH}
    assert written() == set()
    os.kill(pid, signal.SIGCONT)
    assert waiting.wait_for(lambda: len(written()) == 500, timeout=20), len(written())
    assert [f.kind for _, f in read(path)][-1] != "end"  # cut short, as it was
    assert waiting.wait_for(lambda: not Path(f"/proc/{pid}").exists()
                            or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
                            timeout=10)  # it ended


def test_a_full_disk_stops_the_process_recording_with_one_error(tiny_disk, caplog):
    path = tiny_disk / "run.rtop"
    frames = _stream() * 8

    async def main() -> tuple[int, int]:
        rec = Recorder(path, {"job": "x"}, process=True, rounded=False)
        called = flushes = 0

        def then() -> None:
            nonlocal called
            called += 1
        for i, (t, data) in enumerate(frames):
            rec.raw(data, t)
            if i % 200 == 199:
                flushes += 1
                rec.flush(then=then)
                await asyncio.sleep(0.02)
        rec.flush()
        assert rec.failed
        await asyncio.sleep(0.2)
        rec.close()
        return called, flushes

    called, flushes = asyncio.run(main())
    assert called == flushes  # the hub's acks are not held up by a full disk
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left" in errors[0] and str(path) in errors[0], \
        errors
    assert any(f.kind == wire.KIND_BATCH for _, f in read(path))  # what fitted reads


def test_a_process_that_ran_a_while_is_started_again(tmp_path, monkeypatch, caplog):
    """The recorder's process killed after it ran long enough (``RESTART_AFTER_S``): the
    hub's process writes meanwhile, a new process takes over at a later flush, and the
    recording holds every frame once."""
    monkeypatch.setattr(recorder_mod, "RESTART_AFTER_S", 0.0)
    path = tmp_path / "run.rtop"
    frames = _stream()
    rec = Recorder(path, {"job": "x"}, process=True)
    first = rec.process_pid
    assert first is not None
    pids = set()
    for i, (t, data) in enumerate(frames):
        rec.raw(data, t)
        if i == len(frames) // 3:
            rec.flush()
            os.kill(first, signal.SIGKILL)
        if i % 100 == 99:
            if rec.process_pid is None:
                time.sleep(1.05)  # a second on: the pace is looked at again
            rec.flush()
            pids.add(rec.process_pid)
    rec.close()
    assert first in pids and len(pids - {first, None}) == 1  # one new process
    got = [f for _, f in read(path)]
    sent = [wire.decode_body(d[wire.HEADER_BYTES:]) for _, d in frames]
    assert [(f.kind, f.payload.get("seq")) for f in got if f.kind == wire.KIND_BATCH] == \
        [(f.kind, f.payload.get("seq")) for f in sent if f.kind == wire.KIND_BATCH]
    assert got[-1].kind == "end"
    assert sum(1 for r in caplog.records if r.levelno >= logging.ERROR) == 1


def test_a_process_that_falls_behind_holds_the_hub_back_not_its_memory(
        tmp_path, monkeypatch, caplog):
    """The recorder's process stopped (SIGSTOP: a machine whose cores are all busy)
    while frames keep coming, and nobody to tell (no ``on_behind``: the hub's pause is
    ``tests/test_ingest_pause.py``): what it has not written stays under
    ``BACKLOG_BYTES`` plus one flush; the flush past that waits for it, counted, logged
    once; the file is whole, every flush called back."""
    bound = 128 * 1024  # the stream is 333 kB, 1.3 MB four times over
    monkeypatch.setattr(recorder_mod, "BACKLOG_BYTES", bound)
    path = tmp_path / "run.rtop"
    frames = _stream() * 4

    async def main() -> tuple[Recorder, int, float, int, int]:
        rec = Recorder(path, {"job": "x"}, process=True)
        pid = rec.process_pid
        assert pid is not None
        rec.flush()
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        threading.Timer(1.0, os.kill, (pid, signal.SIGCONT)).start()
        most, flushed_at, called, flushes = 0, 0.0, 0, 0

        def then() -> None:
            nonlocal called
            called += 1
        for i, (t, data) in enumerate(frames):
            rec.raw(data, t)
            if i % 50 == 49:
                rec.flush(then=then)  # as the hub does: it returns at once ...
                flushes += 1
                proc = rec._proc
                assert proc is not None and rec.process_pid == pid
                most = max(most, proc.backlog)
                if rec.stalls and not flushed_at:
                    flushed_at = time.monotonic() - stopped_at
        end = time.monotonic() + 10
        while called < flushes and time.monotonic() < end:
            await asyncio.sleep(0.05)
        rec.close()
        return rec, most, flushed_at, called, flushes

    rec, most, waited, called, flushes = asyncio.run(main())
    assert rec.stalls >= 1 and waited >= 0.9  # ... but for those that found it behind
    assert rec.stalled_s >= 0.5
    assert called == flushes
    chunk = max(len(d) for _, d in frames) * 50
    assert most <= bound + chunk
    got = [f for _, f in read(path)]
    assert sum(1 for f in got if f.kind == wire.KIND_BATCH) == \
        sum(1 for _, d in frames if wire.decode_body(d[wire.HEADER_BYTES:]).kind ==
            wire.KIND_BATCH)
    assert got[-1].kind == "end"
    stalls = [r for r in caplog.records if "fell" in r.getMessage()]
    assert len(stalls) == 1 and stalls[0].levelno == logging.WARNING
