"""The recording's block format (rtop.run.blocks): what goes in comes back, a cut or
damaged block loses that block alone, the older format still reads as it did, no
secret reaches the file, a realistic stream is ten times smaller, and a replay's jump
lands on the state a replay from the start reaches.

Recordings are written through the hub's own Recorder; the streams are real runs (the
fixtures, recorded from real jobs) and the fleet simulator's (rtop.fleetsim).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from collectors import wire
from collectors.figures import FIGURES
from collectors.schema import STEP_FIELDS, TABLES
from rtop import fleetsim
from rtop.hub.recorder import Recorder
from rtop.hub.service import ThreadedHub
from rtop.report import build_report
from rtop.run import blocks, seek
from rtop.run.columns import MEASURE_BITS
from rtop.run.recording import (
    ReadResult,
    index,
    is_blocks,
    plain_bytes,
    read,
    replay,
    scrub,
)
from rtop.run.spool import KIND_SPOOL_BEGIN_REC, KIND_SPOOL_END_REC, recorded_ranks
from rtop.run.state import KIND_JOB_EXIT, KIND_LINKS
from rtop.tui.source import ReplaySource
from tests import waiting
from tests.rankclient import RankClient, step_row

ROOT = Path(__file__).resolve().parent.parent
#: Snapshot figures made from a rank's whole rolling window (quantiles over it).
WINDOWED = {f.name for f in FIGURES if f.quantile is not None}
STEP_DATA = STEP_FIELDS.index("data_wait_s")
FIXTURES = sorted((ROOT / "tests" / "fixtures").glob("*.rtop"))
END_T = 1_900_000_000.0  # the end mark's time in re-recordings (the same in both formats)

Frames = list[tuple[float, str, dict[str, Any]]]


def frames_of(path: Path, result: ReadResult | None = None) -> Frames:
    return [(t, f.kind, f.payload) for t, f in read(path, result)]


def rerecord(frames: Frames, path: Path, monkeypatch: pytest.MonkeyPatch,
             flush_every: int = 50, **kw: Any) -> Path:
    """Write ``frames`` (a recording's, as read) through a Recorder: the run header as
    its own, clock frames where they were, every other frame as the hub gives them."""
    (_, kind, run_info), rest = frames[0], frames[1:]
    assert kind == wire.KIND_RUN
    rec = Recorder(path, run_info, **kw)
    for i, (t, kind, payload) in enumerate(rest):
        if kind == wire.KIND_CLOCK:
            rec.clock(payload["t_hub"], force=True)
        elif kind != "end":
            rec.raw(wire.encode(kind, payload), t)
        if i % flush_every == flush_every - 1:
            rec.flush()
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: END_T)
        rec.close()
    return path


def hub_recording(path: Path, spec: fleetsim.FleetSpec, scenario: str = "healthy",
                  **kw: Any) -> Path:
    """A simulated run recorded as a hub records it: flushed every second of hub time."""
    rec = Recorder(path, {"hub": {"version": "sim", "address": "sim", "pid": 0,
                                  "started": fleetsim.T0}, "job": spec.job}, **kw)
    next_flush = fleetsim.T0 + 1.0
    for t, kind, payload in fleetsim.frames(spec, scenario):
        if t >= next_flush:
            rec.flush()
            next_flush = t - (t - fleetsim.T0) % 1.0 + 1.0
        rec.raw(wire.encode(kind, payload), t)
    rec.close()
    return path


def odd_frames() -> Frames:
    """Frames of every other kind a recording holds, and payloads that fit no column."""
    t = 1_800_000_100.0
    group = "odd#0"
    ident = {"rank": 7, "world_size": 8, "hostname": "n7", "pid": 7, "job": "odd",
             "group": group, "local_rank": 7}
    long_row = [1, t, 0.5, 0.01, 0.4, None, 0.1, 0.02, 10**6, 3, 1e7, 1.5e7, 32, 0.001,
                {"all_reduce": [0.1, 10**6, 3, 1.5e7]}]
    short_row = long_row[:-1]  # an older collector's step row
    return [
        (t, wire.KIND_HELLO, {"role": "rank", "identity": ident, "clock": {"t_wall": t},
                              "collector": {"version": "0.1", "dropped": 0}}),
        (t, wire.KIND_BATCH, {"rank": 7, "group": group, "seq": 1, "t_wall": t,
                              "dropped": 0, "steps": [long_row, short_row],
                              "meta": {"device": {"name": "GPU ünïcode"}, "flag": True},
                              "events": [[t, "checkpoint", 2.5, 4]],
                              "hb": [[t, "comm", 12.0, 4, 'File "x.py", line 1']]}),
        (t, wire.KIND_BATCH, {"rank": 7, "group": group, "seq": 2, "steps": "not rows",
                              "gpu": [[t, 1, 2], "not a row"], "blob": b"\x00\xff",
                              "huge": 2**64 - 1, "neg": -(2**63), "nan": math.nan,
                              "inf": -math.inf, "mixed": [1, 2.5, None, "s"]}),
        (t, wire.KIND_BATCH, {"rank": 7, "group": group, "seq": 3, "steps": [],
                              "host": [[t, 1.5, None, 2, 10**10, 5, 6, None, 7.5, 0.5]]}),
        (t, "offset", {"rank": 7, "group": group, "offset_s": 0.003, "rtt_s": 0.0002}),
        (t, KIND_LINKS, {"ranks": [0, 7], "nodes": ["a", "b"],
                         "matrix_Bps": [[None, 1e9], [1.1e9, None]], "seconds": 1.0,
                         "nbytes": 1 << 20, "errors": []}),
        (t, KIND_JOB_EXIT, {"code": 0, "exited_at": t}),
        (t, KIND_SPOOL_BEGIN_REC, {"path": "/tmp/x", "records": 3}),
        (t, KIND_SPOOL_END_REC, {}),
        (t, "finding", {"event": "onset", "kind": "straggler", "ranks": [7]}),
        (t, "conn", {"event": "close", "rank": 7, "group": group, "clean": False,
                     "how": "reset"}),
        (t, "kind-from-the-future", {"k": [[1], [2, 3]], "": None}),
        (t, wire.KIND_BYE, {"rank": 7, "group": group, "dropped": 0, "reason": "closed",
                            "error": None}),
    ]


def with_clocks(frames: Frames) -> Frames:
    """``frames`` with the clock frame before each, as a recording holds them."""
    out: Frames = []
    last = None
    for t, kind, payload in frames:
        if t != last:
            out.append((t, wire.KIND_CLOCK, {"t_hub": t}))
            last = t
        out.append((t, kind, payload))
    return out


def same(a: Any, b: Any) -> bool:
    """Equal, NaN included."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def tolerance(name: str, value: float) -> float:
    """How far a rounded measurement named ``name`` may be from ``value``: its
    significant bits, or half its unit's floor (``blocks.FLOORS``)."""
    floor = next((e for unit, e in blocks.FLOORS.items() if name.endswith(unit)), None)
    return max(abs(value) * 2.0 ** -MEASURE_BITS, 0.0 if floor is None else 2.0 ** (floor - 1))


def close_enough(a: Any, b: Any, name: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ by more than a rounded measurement named ``name``
    may (the names of the fields and keys on the way say the unit)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
            and not isinstance(a, bool) and not isinstance(b, bool) \
            and (isinstance(a, float) or isinstance(b, float)):  # a median may be an int
        if a == b or abs(a - b) <= tolerance(name, b):
            return []
        return [f"{name}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{name}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in close_enough(a[k], b[k], str(k))]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{name}: {len(a)} items != {len(b)}"]
        fields = TABLES.get(name)  # a row of that table, or its rows
        row = fields is not None and not any(isinstance(x, list) for x in a)
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in close_enough(x, y, fields[i] if row and fields and i < len(fields)
                                      else name)]
    return [] if type(a) is type(b) and a == b else [f"{name}: {a!r} != {b!r}"]


def report_json(path: Path) -> dict[str, Any]:
    rep = build_report(path, find_spools=False)
    for key in ("path", "end_byte"):  # where the file is, and how long: not the run
        rep["run"].pop(key)
    return json.loads(json.dumps(rep, default=str))


# ---- what goes in comes back ------------------------------------------------------------


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.stem)
def test_a_real_run_reads_back_the_same_in_both_formats(fixture, tmp_path, monkeypatch):
    """A real run (a fixture: a job recorded by a real hub) written again in the older
    format and in the block format (exact) reads back frame for frame the same, gives
    the same RunState, and the same ``rtop report --json``."""
    frames = frames_of(fixture)
    old = rerecord(frames, tmp_path / "old.rtop", monkeypatch, legacy=True)
    new = rerecord(frames, tmp_path / "new.rtop", monkeypatch, rounded=False)
    assert not is_blocks(old) and is_blocks(new)
    back_old, back_new = frames_of(old), frames_of(new)
    # the same run (less its end mark, and the tokens an earlier rtop recorded)
    assert back_old[:-1] == [(t, k, scrub(p)) for t, k, p in frames[:len(back_old) - 1]]
    assert back_new == back_old
    st_old, _ = replay(old)
    st_new, _ = replay(new)
    assert st_new.view() | {"build_s": 0} == st_old.view() | {"build_s": 0}
    assert report_json(new) == report_json(old)


def test_every_kind_of_frame_and_payload_comes_back(tmp_path, monkeypatch):
    """The hub's frames of every kind, and payloads that fit no column (rows that are
    not rows, an older collector's shorter rows, bytes, bools, huge ints, NaN, nested
    lists, unknown kinds), read back exactly as the older format gives them."""
    head = (fleetsim.T0, wire.KIND_RUN, {"hub": {"started": fleetsim.T0}, "job": "odd"})
    frames = [head, *with_clocks(odd_frames())]
    old = rerecord(frames, tmp_path / "old.rtop", monkeypatch, legacy=True)
    new = rerecord(frames, tmp_path / "new.rtop", monkeypatch, rounded=False)
    back_old, back_new = frames_of(old), frames_of(new)
    assert len(back_new) == len(back_old) == len(frames) + 1  # and the end mark
    for a, b in zip(back_new, back_old, strict=True):
        assert same(list(a), list(b)), (a, b)
    st_old, _ = replay(old)
    st_new, _ = replay(new)
    assert st_new.bad_frames == st_old.bad_frames
    assert st_new.view() | {"build_s": 0} == st_old.view() | {"build_s": 0}


def test_rounded_measurements_stay_within_their_precision(tmp_path, monkeypatch):
    """By default the records' measurements are rounded (to MEASURE_BITS significant
    bits, no finer than a microsecond of a second): every other field comes back exact,
    every measurement within that, and the report says the same within it."""
    frames = frames_of(FIXTURES[0])
    old = rerecord(frames, tmp_path / "old.rtop", monkeypatch, legacy=True)
    new = rerecord(frames, tmp_path / "new.rtop", monkeypatch)
    back_old, back_new = frames_of(old), frames_of(new)
    rounded = 0
    for (t1, k1, p1), (t2, k2, p2) in zip(back_new, back_old, strict=True):
        assert (t1, k1) == (t2, k2)
        if k1 != wire.KIND_BATCH:
            assert p1 == p2
            continue
        assert {k: v for k, v in p1.items() if k not in TABLES} == \
            {k: v for k, v in p2.items() if k not in TABLES}
        for table in TABLES:
            rows1, rows2 = p1.get(table) or [], p2.get(table) or []
            for r1, r2 in zip(rows1, rows2, strict=True):
                assert close_enough(r1, r2, table) == []
                t_wall = TABLES[table].index("t_wall")
                assert r1[t_wall] == r2[t_wall]  # time stamps: exact
                rounded += sum(a != b for a, b in zip(r1, r2, strict=True))
    assert rounded > 0, "nothing was rounded: the test tests nothing"
    assert close_enough(report_json(new), report_json(old)) == []


def test_a_realistic_stream_is_ten_times_smaller(tmp_path):
    """128 simulated ranks for 20 s, recorded as a hub records them (a block a second):
    the block format takes a tenth of the older format's bytes or less."""
    spec = fleetsim.FleetSpec(ranks=128, duration_s=20.0, step_s=0.5, seed=4)
    old = hub_recording(tmp_path / "old.rtop", spec, legacy=True)
    new = hub_recording(tmp_path / "new.rtop", spec)
    ratio = old.stat().st_size / new.stat().st_size
    assert ratio >= 10.0, f"only {ratio:.1f}x smaller"
    assert len(frames_of(new)) == len(frames_of(old))


# ---- cut and damaged --------------------------------------------------------------------


def small_recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    frames = frames_of(FIXTURES[0])[:120]
    return rerecord(frames, tmp_path / "small.rtop", monkeypatch, flush_every=30)


def test_a_recording_cut_anywhere_in_its_last_block_reads_up_to_the_block_before(
        tmp_path, monkeypatch):
    path = small_recording(tmp_path, monkeypatch)
    data = path.read_bytes()
    blocks_ = index(path)
    assert len(blocks_) >= 4
    last = blocks_[-1]
    whole = frames_of(path)
    before = len(whole) - last.frames
    cut = tmp_path / "cut.rtop"
    for end in range(last.offset + 1, last.end):
        cut.write_bytes(data[:end])
        res = ReadResult()
        got = frames_of(cut, res)
        assert got == whole[:before], end
        assert res.truncated and not res.closed and res.end_byte == last.offset, end
        assert any("truncated" in w for w in res.warnings), (end, res.warnings)
        assert "mid-frame" in (res.cut() or "") and "cut short" in (res.cut() or "")
    for end in range(1, len(blocks.FILE_MAGIC)):  # cut inside the file's first bytes
        cut.write_bytes(data[:end])
        res = ReadResult()
        assert frames_of(cut, res) == [] and res.truncated


def test_a_damaged_block_is_skipped_and_said(tmp_path, monkeypatch):
    path = small_recording(tmp_path, monkeypatch)
    data = bytearray(path.read_bytes())
    bl = index(path)
    whole = frames_of(path)
    hit = bl[2]
    data[hit.offset + blocks.HEADER_BYTES + hit.body_len // 2] ^= 0xFF  # its body
    bad = tmp_path / "bad.rtop"
    bad.write_bytes(bytes(data))
    res = ReadResult()
    got = frames_of(bad, res)
    firsts = sum(b.frames for b in bl[:2])
    assert got[:firsts] == whole[:firsts]
    assert got[firsts:] == whole[firsts + hit.frames:]
    assert res.damaged == 1 and not res.truncated and res.closed
    assert any("damaged" in w and f"{hit.offset:,}" in w for w in res.warnings)
    rep = build_report(bad, find_spools=False)  # the report reads on, and says so
    assert rep["run"]["warnings"] and rep["run"]["frames"] == len(got)
    data[bl[3].offset:bl[3].offset + 4] = b"XXXX"  # and the next one's header
    bad.write_bytes(bytes(data))
    res = ReadResult()
    got = frames_of(bad, res)
    assert got[firsts:] == whole[firsts + hit.frames + bl[3].frames:]
    assert res.damaged == 1 and got[-1][1] == "end"
    garbage = tmp_path / "garbage.rtop"  # garbage after the last whole block
    garbage.write_bytes(path.read_bytes() + b"\x00" * 100)
    res = ReadResult()
    assert frames_of(garbage, res) == whole and res.truncated
    assert any("corrupt" in w for w in res.warnings)


def test_any_damage_is_read_calmly(tmp_path, monkeypatch):
    """Bytes overwritten, inserted or deleted anywhere in a block recording (300 cases,
    seeded), or garbage after its first bytes: reading yields every frame of the blocks
    before the damage unchanged and raises nothing but the WireError of a file that is
    no recording; replaying it, spanning it and jumping in it raise nothing."""
    path = small_recording(tmp_path, monkeypatch)
    data = path.read_bytes()
    whole = frames_of(path)
    ends = [(b.end, b.frames) for b in index(path)]
    rng = random.Random(28)
    bad = tmp_path / "bad.rtop"
    monkeypatch.setattr(seek, "HISTORY_FRAMES", 10)  # jumps condense, even here
    for case in range(300):
        blob = bytearray(data)
        first = len(blob)
        for _ in range(rng.randint(1, 3)):
            op, at = rng.randrange(3), rng.randrange(len(blob))
            chunk = rng.randbytes(rng.randint(1, 16))
            first = min(first, at)
            if op == 0:
                blob[at:at + len(chunk)] = chunk
            elif op == 1:
                blob[at:at] = chunk
            else:
                del blob[at:at + len(chunk)]
        if case % 10 == 0:
            blob = bytearray(blocks.FILE_MAGIC + rng.randbytes(rng.randint(0, 2000)))
            first = len(blocks.FILE_MAGIC)
        bad.write_bytes(bytes(blob))
        intact = sum(n for end, n in ends if end <= first)
        try:
            got = frames_of(bad)
        except wire.WireError:
            assert intact == 0, case
            continue
        assert got[:intact] == whole[:intact], case
        replay(bad)
        src = ReplaySource(bad, paused=True)
        for at in (1.0, 8.0):
            src.jump(at)
            src.monitor.snapshot()


def test_a_hub_restarted_on_a_cut_recording_appends_after_the_cut(tmp_path, monkeypatch):
    path = small_recording(tmp_path, monkeypatch)
    whole = frames_of(path)
    kept = len(whole) - index(path)[-1].frames  # the frames of its whole blocks, once cut
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 10])  # killed mid-block
    rec = Recorder(path, {"hub": {"started": END_T + 1}, "job": "again"})
    rec.frame("finding", {"event": "onset", "kind": "x"}, END_T + 2)
    rec.sync()  # everything given is in the file now
    res = ReadResult()
    got = frames_of(path, res)
    assert got[:kept] == whole[:kept]
    assert [(k, p) for _, k, p in got[kept:]] == [
        (wire.KIND_RUN, {"hub": {"started": END_T + 1}, "job": "again"}),
        (wire.KIND_CLOCK, {"t_hub": END_T + 2}),
        ("finding", {"event": "onset", "kind": "x"})]
    assert res.damaged == 1 and not res.closed
    assert any("damaged" in w for w in res.warnings)
    rec.close()


def test_a_recording_started_in_the_older_format_goes_on_in_it(tmp_path, monkeypatch):
    frames = frames_of(FIXTURES[0])[:50]
    path = rerecord(frames, tmp_path / "old.rtop", monkeypatch, legacy=True)
    rec = Recorder(path, {"hub": {"started": END_T}, "job": "again"})
    rec.close()
    assert not is_blocks(path)
    kinds = [k for _, k, _ in frames_of(path)]
    assert kinds.count(wire.KIND_RUN) == 2 and kinds[-1] == "end"


# ---- the older format, secrets ----------------------------------------------------------


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.stem)
def test_the_older_format_reads_as_it_always_did(fixture):
    """A fixture (the older format) reads frame for frame as the wire format decodes
    it, and ``rtop replay`` finds its span as before."""
    assert not is_blocks(fixture)
    with fixture.open("rb") as f:
        expected = [(fr.kind, fr.payload) for fr in wire.iter_frames(f)]
    assert [(k, p) for _, k, p in frames_of(fixture)] == expected
    src = ReplaySource(fixture, paused=True)
    assert src.start is not None and src.end is not None and src.end > src.start
    assert not src.jump(5.0)  # no jumping in the older format: replayed as before


def test_no_secret_reaches_the_file(tmp_path):
    token = "tok-3f9a0c51-never-in-a-block"
    path = tmp_path / "run.rtop"
    rec = Recorder(path, {"job": "x", "hub_token": token}, secrets=[token])
    t = 1_800_000_000.0
    rec.raw(wire.encode(wire.KIND_HELLO, {
        "role": "rank", "nonce": b"n" * 16, "identity": {"rank": 0, "world_size": 1},
        "auth": {"proof": "ab" * 16, "clientSecret": "s"}, "note": f"a {token} b"}), t)
    rec.raw(wire.encode(wire.KIND_BATCH, {
        "rank": 0, "seq": 1, "steps": [[0, t, 0.5, 0.1, 0.3, None, 0.1, 0.05, 1, 1, 1.0,
                                        1.0, 1, 0.0, None]],
        "hb": [[t, "compute", 9.0, 0, f"stack with {token} in it"]],
        "events": [[t, f"kind {token}", 1.0, 0]],
        "meta": {"password": "p", "notes": [f"n {token}"]}}), t)
    rec.frame("finding", {"evidence": {"secret": "s", "ok": 1}}, t + 1)
    rec.close()
    stored = path.read_bytes() + plain_bytes(path)
    assert len(plain_bytes(path)) > len(path.read_bytes())  # decompressed: searched
    assert token.encode() not in stored
    for word in (b"proof", b"nonce", b"clientSecret", b"hub_token", b"password",
                 b"secret"):
        assert word not in stored, word
    frames = [(k, p) for _, k, p in frames_of(path)]
    batch = next(p for k, p in frames if k == wire.KIND_BATCH)
    assert batch["hb"][0][4] == "[redacted]" and batch["events"][0][1] == "[redacted]"
    assert batch["meta"] == {"notes": ["[redacted]"]}
    assert rec.secrets_dropped >= 8


# ---- the hub writes it, the tools read it -------------------------------------------------


def test_sync_puts_everything_given_in_the_file(tmp_path):
    path = tmp_path / "run.rtop"
    rec = Recorder(path, {"job": "x"})
    for i in range(5):
        rec.frame("offset", {"rank": i, "offset_s": 0.001 * i, "rtt_s": 0.0}, 100.0 + i)
    rec.sync()
    assert [k for _, k, _ in frames_of(path)] == \
        ["run"] + ["clock", "offset"] * 5
    rec.close()
    assert [k for _, k, _ in frames_of(path)][-1] == "end"


def test_a_real_hub_records_what_its_state_took(tmp_path):
    """Through a real hub (which gives the recorder each frame as it decoded and
    checked it): a rank's frames come back as the hub's state took them (an older
    collector's short step row padded with None, a number that is no number made None),
    the exact ones exactly; a frame the hub refused is not recorded."""
    path = tmp_path / "run.rtop"
    hub = ThreadedHub(record=str(path), token="t" * 24).start()
    try:
        r = RankClient(hub.address, hub.token, 0, world=1)
        assert r.recv().kind == wire.KIND_WELCOME
        short = step_row(0)[:-1]  # no "collectives": an older collector's row
        odd = step_row(1)
        odd[STEP_DATA] = math.inf
        r.send(wire.KIND_BATCH, {"rank": 0, "group": r.group, "seq": 1, "t_wall": 1.5,
                                 "dropped": 0, "steps": [short, odd]})
        r.send(wire.KIND_BATCH, {"rank": 0, "group": r.group, "seq": 2, "steps": "bad"})
        assert waiting.wait_for(lambda: hub.call(lambda h: h.state.step_records) == 2,
                                timeout=10)
    finally:
        hub.stop()
    batches = [p for _, k, p in frames_of(path) if k == wire.KIND_BATCH]
    assert len(batches) == 1  # the refused one was not recorded
    rows = batches[0]["steps"]
    assert len(rows[0]) == len(STEP_FIELDS) and rows[0][-1] is None  # padded
    assert close_enough(rows[0], [*short, None], "steps") == []
    assert rows[1][STEP_DATA] is None
    assert rows[0][1] == short[1] and batches[0]["t_wall"] == 1.5  # times: exact
    odd[STEP_DATA] = None
    assert close_enough(rows[1], odd, "steps") == []


def test_rtop_report_and_the_spool_scan_read_the_block_format(tmp_path):
    """``rtop report --json`` on a simulated straggler run recorded as a hub records it:
    the same findings (kinds, ranks) in the block format, rounded, as in the older
    format; and a hub restarted on it knows its rank processes."""
    spec = fleetsim.FleetSpec(ranks=16, duration_s=40.0, step_s=0.5, seed=1)
    reports = []
    for name, kw in (("old", {"legacy": True}), ("new", {})):
        path = hub_recording(tmp_path / f"{name}.rtop", spec, "straggler", **kw)
        proc = subprocess.run([sys.executable, "-m", "rtop", "report", str(path),
                               "--json"], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        reports.append(json.loads(proc.stdout))
        assert len(recorded_ranks(path)) == 16
    old, new = reports
    assert len(new["ranks"]) == 16 and new["run"]["closed"] and not new["run"]["warnings"]
    assert [(f["kind"], f["ranks"]) for f in new["findings"]] == \
        [(f["kind"], f["ranks"]) for f in old["findings"]]
    assert "straggler" in [f["kind"] for f in new["findings"]]


# ---- jumping ----------------------------------------------------------------------------


def test_a_jump_lands_where_a_replay_from_the_start_does(tmp_path, monkeypatch):
    """64 simulated ranks, one of them lost half a minute in: a replay's jump (from the blocks'
    index: the frames that make each rank's state, then the last seconds) shows every
    rank as a replay from the start to the same moment does: the same status, step,
    latest samples, clock offset, the same medians of its recent steps and findings."""
    spec = fleetsim.FleetSpec(ranks=64, duration_s=100.0, step_s=0.5, seed=2)
    path = hub_recording(tmp_path / "run.rtop", spec, "lost_rank")
    monkeypatch.setattr(ReplaySource, "JUMP_ANALYSE_S", 15.0)  # as a replay's seek does
    # the last 15 s of frames (what 4,000 frames are of a thousand ranks: two seconds)
    monkeypatch.setattr(seek, "HISTORY_FRAMES", 15 * 2 * spec.ranks)
    for at in (20.0, 27.0, 45.0, 99.0):
        jumped = ReplaySource(path, paused=True)
        assert jumped.jump(at)
        played = ReplaySource(path, paused=True)
        played._seeker = None  # the older way: every frame from the start
        played._open()
        played._do_seek(lambda message: None, "time", at)
        # it applied the last 15 s and a handful of frames per rank, not every frame
        assert jumped.state.frames <= seek.HISTORY_FRAMES + 8 * spec.ranks \
            < played.state.frames
        a, b = jumped.monitor.snapshot(), played.monitor.snapshot()
        differ = {c for c in a["ranks"] if a["ranks"][c] != b["ranks"][c]}
        # but the figures of a whole rolling window (which holds the last seconds
        # only), and the collector's CPU (a rate between batches a second apart or more:
        # from other batches)
        assert differ <= WINDOWED | {"rtop_cpu"}, (at, differ)
        assert {"status", "step", "step_s", "offset_s", "last_seen_s", "gpu_util_pct",
                "mem_used_bytes"} <= a["ranks"].keys() - differ
        assert [(f["kind"], f["ranks"]) for f in a["findings"]] == \
            [(f["kind"], f["ranks"]) for f in b["findings"]], at
    # going to a step jumps too: to the block whose steps reach it, then plays on to it
    monkeypatch.setattr(ReplaySource, "JUMP_FRAMES", 0)
    src = ReplaySource(path, paused=True)
    src._open()
    src._do_seek(lambda message: None, "step", 40)
    assert src._max_step() == 40
    assert src.state.frames <= seek.HISTORY_FRAMES + 10 * spec.ranks
