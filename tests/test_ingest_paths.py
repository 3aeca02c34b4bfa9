"""The hub's cheaper ingest (issue 28, item 2) does what the plain one did.

Each shortcut of the ingest path is checked against what it stands for, on any input
hypothesis makes (malformed ones first of all):

* ``check_rows`` against the value-by-value check it replaced (kept here as
  ``reference_check_rows``, as it was): the same rows come out, or the same error;
* a string left as it is (already safe) is what ``safe_text`` gives back for it;
* ``FrameDecoder`` (one unpacker reused per thread, no copy of a whole read) against
  ``decode_body`` body by body: the same frames or the same error, and a bad body
  leaves nothing behind that changes the next one;
* ``Rings`` (per-slot counters kept as Python values, rows with None) against a plain
  model of a ring;
* what ``RunState`` stores of a batch (step and sample windows, latest values, the
  per-collective window) against the rows it was given.
"""

from __future__ import annotations

import copy
import math
from typing import Any, cast

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from collectors import wire
from collectors.schema import (
    ADDED_FIELDS,
    GPU_FIELDS,
    HEARTBEAT_FIELDS,
    HOST_FIELDS,
    MEM_FIELDS,
    STEP_FIELDS,
    TABLES,
)
from rtop.fmt import safe_text
from rtop.run import validate
from rtop.run.ring import Rings
from rtop.run.state import LATEST, SAMPLE_HISTORY, STEP_HISTORY, RunState
from rtop.run.validate import (
    MAX_MAGNITUDE,
    MAX_ROWS,
    ProtocolError,
    check_rows,
    check_text,
    clean_groups,
    clean_split,
    described,
)

SETTINGS = settings(max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- check_rows -----------------------------------------------------------------------


def reference_check_rows(name: str, rows: Any) -> list[list[Any]]:
    """``check_rows`` as it was before the ingest was made cheaper: value by value."""
    fields, kinds = validate._TABLES[name]
    width = len(fields)
    oldest = width - len(ADDED_FIELDS.get(name, ()))
    if not isinstance(rows, list):
        raise ProtocolError(f"'{name}' must be a list of rows, got {described(rows)}")
    if len(rows) > MAX_ROWS:
        raise ProtocolError(f"'{name}' has {len(rows)} rows in one batch (at most "
                            f"{MAX_ROWS})")
    strings = validate._STRINGS[name]
    maps = validate._MAPS[name] | validate._GROUP_MAPS[name]
    for i, r in enumerate(rows):
        if type(r) is not list or not oldest <= len(r) <= width:
            n = len(r) if type(r) is list else described(r)
            raise ProtocolError(f"malformed '{name}' rows: row {i} is not a list of "
                                f"{width} values (got {n})")
        if len(r) < width:
            r.extend([None] * (width - len(r)))
        for j, v in enumerate(r):
            t = type(v)
            if t is float:
                if not -MAX_MAGNITUDE <= v <= MAX_MAGNITUDE:
                    r[j] = None
            elif t is not int and v is not None and j not in strings and j not in maps:
                raise ProtocolError(f"'{name}' row {i}: '{fields[j]}' must be a number, "
                                    f"got {described(v)}")
        for j in validate._MAPS[name]:
            r[j] = clean_split(f"'{name}' row {i}: '{fields[j]}'", r[j])
        for j in validate._GROUP_MAPS[name]:
            r[j] = clean_groups(f"'{name}' row {i}: '{fields[j]}'", r[j])
        for j in strings:
            v = r[j]
            if v is not None:
                limit, multiline, keep_end = cast(validate._StrSpec, kinds[j])
                r[j] = check_text(f"'{name}' row {i}: '{fields[j]}'", v, limit,
                                  multiline=multiline, keep_end=keep_end)
    return rows


#: Text that needs making safe or not: printable, control and format characters,
#: newlines, separators, long.
texts = st.one_of(
    st.text(max_size=8),
    st.text(alphabet=st.sampled_from("ab \t\n\r\x1b\x00\u200b\u2028\u00a0é[]"),
            max_size=12),
    st.sampled_from([63, 64, 65, 19999, 20000, 20001]).map(lambda n: "x" * n),
    st.sampled_from([63, 64, 65]).map(lambda n: "\x1b" * n),
    st.just("cuda:0"), st.just("compute"))
numbers = st.one_of(
    st.floats(), st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([MAX_MAGNITUDE, -MAX_MAGNITUDE, math.nextafter(MAX_MAGNITUDE, math.inf),
                     1e308, -1e308, 0.0, -0.0, math.inf, -math.inf, math.nan]),
    st.integers(), st.integers(-(1 << 70), 1 << 70),
    st.sampled_from([1 << 64, (1 << 64) + 1, 10 ** 400, -(10 ** 400)]))
figures = st.lists(st.one_of(st.none(), numbers, st.booleans(), texts), min_size=3,
                   max_size=5)
splits = st.one_of(st.none(), st.dictionaries(st.one_of(texts, st.integers(0, 3)), figures,
                                              max_size=3))
group_maps = st.one_of(st.none(), st.dictionaries(texts, splits, max_size=3))
values = st.one_of(st.none(), numbers, st.booleans(), texts, st.binary(max_size=3),
                   st.lists(st.integers(), max_size=2), splits)


@st.composite
def table_rows(draw: st.DrawFn) -> tuple[str, Any]:
    """A table's name and rows for it: mostly well-formed (the fast way), each value
    possibly replaced by anything, rows shorter (an older collector) or malformed."""
    name = draw(st.sampled_from(sorted(TABLES)))
    fields = TABLES[name]
    rows: list[Any] = []
    for _ in range(draw(st.integers(0, 4))):
        shape = draw(st.integers(0, 9))
        if shape == 0:  # not a row at all
            rows.append(draw(st.one_of(st.none(), st.integers(), texts,
                                       st.dictionaries(texts, st.integers(), max_size=2))))
            continue
        row: list[Any] = []
        for f in fields:
            if f == "collectives":
                row.append(draw(splits))
            elif f == "groups":
                row.append(draw(group_maps))
            elif f in ("device", "phase", "kind", "stack"):
                row.append(draw(st.one_of(st.none(), texts)))
            else:
                row.append(draw(st.one_of(st.none(), numbers)))
        for _ in range(draw(st.integers(0, 2))):  # anything, anywhere
            row[draw(st.integers(0, len(row) - 1))] = draw(values)
        if shape == 1:
            row = row[:draw(st.integers(0, len(row)))]
        elif shape == 2:
            row += draw(st.lists(values, min_size=1, max_size=2))
        rows.append(row)
    return name, draw(st.one_of(st.just(rows), st.just(rows), st.just(rows), values))


def outcome(check: Any, name: str, rows: Any) -> tuple[str, Any]:
    """What ``check`` makes of (a deep copy of) ``rows``: ("rows", the rows) or
    ("error", its message)."""
    try:
        return "rows", check(name, copy.deepcopy(rows))  # both change rows in place
    except ProtocolError as exc:
        return "error", str(exc)


def same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, and of the same types (1 is not 1.0 here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@example(("steps", [[None] * len(STEP_FIELDS)]))
@example(("gpu", [[1e300] + [math.inf] * (len(GPU_FIELDS) - 1)]))
@example(("hb", [[0.0, "\x1b[2J", 1.0, 3, "a\nb"]]))
@example(("hb", [[0.0, "p" * 65, 1.0, 3, "s" * 20001]]))
@example(("mem", [[0.0, "cuda:0", 1, 2, 3, 4, 5, 6, 7]]))  # an older collector's row
@example(("host", [[True] * len(HOST_FIELDS)]))
@example(("mem", [[None, 1e30] + [None] * (len(MEM_FIELDS) - 2)]))  # absurd "device"
@SETTINGS
@given(table_rows())
def test_check_rows_keeps_refuses_and_cleans_as_value_by_value(case: tuple[str, Any]) -> None:
    """Whatever the rows, ``check_rows`` gives what the value-by-value check gave: the
    same rows (non-finite numbers None, strings made safe, maps copied clean, short
    rows padded) or the same error."""
    name, rows = case
    want = outcome(reference_check_rows, name, rows)
    got = outcome(check_rows, name, rows)
    assert got[0] == want[0], (got, want)
    assert same(got[1], want[1]), (got, want)


@SETTINGS
@given(texts, st.sampled_from([(64, False, False), (255, False, False),
                               (20000, True, True), (3, True, False)]))
def test_a_string_left_as_it_is_is_already_safe(text: str, spec: tuple[int, bool, bool]
                                                ) -> None:
    """The shortcut of ``check_rows`` (a string short enough and printable is kept as
    it is) agrees with ``safe_text``: such a string is returned unchanged."""
    limit, multiline, keep_end = spec
    if len(text) <= limit and text.isprintable():
        assert safe_text(text, limit, multiline=multiline, keep_end=keep_end) is text


# ---- frames ---------------------------------------------------------------------------


def decoded(body: bytes, limit: int) -> tuple[str, Any]:
    """``decode_body``'s answer for ``body``: ("frame", kind, payload) or the error."""
    try:
        f = wire.decode_body(body, limit)
    except wire.WireError as exc:
        return "error", (type(exc).__name__, str(exc))
    return "frame", (f.kind, f.payload)


def fed(dec: wire.FrameDecoder, body: bytes) -> tuple[str, Any]:
    """What a ``FrameDecoder`` makes of one frame of ``body`` (header added)."""
    data = wire.HEADER.pack(wire.MAGIC, wire.VERSION, len(body)) + body
    try:
        frames = dec.feed_raw(data)
    except wire.WireError as exc:
        return "error", (type(exc).__name__, str(exc))
    assert len(frames) == 1 and frames[0][0] == data
    return "frame", (frames[0][1].kind, frames[0][1].payload)


msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
              st.text(max_size=6), st.binary(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=12)
bodies = st.one_of(
    st.binary(max_size=40),  # anything
    st.builds(lambda k, p: msgpack.packb([k, p]), st.text(max_size=8),
              st.dictionaries(st.text(max_size=5), msgpack_values, max_size=4)),
    st.builds(msgpack.packb, msgpack_values),  # well-formed, not a frame
    st.builds(lambda k, p, tail: msgpack.packb([k, p]) + tail, st.text(max_size=4),
              st.dictionaries(st.text(max_size=3), msgpack_values, max_size=2),
              st.one_of(st.binary(min_size=1, max_size=4),
                        st.builds(lambda k: msgpack.packb([k, {}]), st.text(max_size=3)))),
    # bytes after the frame (another frame, even)
    st.builds(lambda k, p, cut: msgpack.packb([k, p])[:-cut], st.text(max_size=4),
              st.dictionaries(st.text(max_size=3), msgpack_values, min_size=1, max_size=3),
              st.integers(1, 3)))  # cut short


@example([b"\x92\xa5batch\x81\xa1a\xdd\xff\xff\xff\xff", b"\x92\xa1k\x80"])
@example([b"\x92\xa5batch\x81\xa1a\xc1", b"\x92\xa1k\x81\xa1a\x01"])
@example([msgpack.packb(["k", {}]) + b"\x01", msgpack.packb(["k", {"a": 1}])])
@example([msgpack.packb(["a", {}]) + msgpack.packb(["b", {}]), msgpack.packb(["c", {}])])
@SETTINGS
@given(st.lists(bodies, min_size=1, max_size=6))
def test_the_decoder_decodes_each_body_as_decode_body(seq: list[bytes]) -> None:
    """Body after body on one decoder (its thread's unpacker reused): each gives what
    ``decode_body`` gives it alone, frame or error; a bad one changes nothing of the
    next (each error here ends a connection: a fresh decoder follows, as a new
    connection's would, on the same thread)."""
    dec = wire.FrameDecoder(wire.MAX_FRAME_BYTES)
    for body in seq:
        want = decoded(body, wire.MAX_FRAME_BYTES)
        got = fed(dec, body)
        assert got[0] == want[0] and same(got[1], want[1]), (body, got, want)
        if got[0] == "error":
            dec = wire.FrameDecoder(wire.MAX_FRAME_BYTES)


@SETTINGS
@given(st.lists(st.builds(lambda k, p: wire.encode(k, p), st.text(max_size=6),
                          st.dictionaries(st.text(max_size=4), msgpack_values, max_size=3)),
                min_size=1, max_size=5),
       st.lists(st.integers(1, 40), max_size=8))
def test_frames_come_out_whole_from_any_reads(frames: list[bytes], cuts: list[int]) -> None:
    """Frames read in any pieces (a read ending inside a header, a body, or exactly at a
    frame's end; several frames in one read) come out as they were encoded, with their
    exact bytes, and nothing is left pending."""
    data = b"".join(frames)
    pieces, at = [], 0
    for c in cuts:
        pieces.append(data[at:at + c])
        at += c
    pieces.append(data[at:])
    dec = wire.FrameDecoder()
    got = [raw for piece in pieces for raw, _ in dec.feed_raw(piece)]
    assert got == frames
    assert dec.pending == 0


def test_a_large_body_is_decoded_as_a_small_one() -> None:
    """A body larger than the reused unpacker takes (a snapshot) decodes, whole or in
    pieces, and the small ones after it still do."""
    big = wire.encode("snapshot", {"x": "y" * (wire.REUSE_BYTES + 10), "n": list(range(50))})
    small = wire.encode("batch", {"rank": 1})
    dec = wire.FrameDecoder()
    out = dec.feed(big[:100]) + dec.feed(big[100:] + small) + dec.feed(small)
    assert [f.kind for f in out] == ["snapshot", "batch", "batch"]
    assert out[0].payload["n"] == list(range(50))


# ---- rings ----------------------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 5), st.lists(st.tuples(
    st.integers(0, 2), st.lists(st.one_of(st.none(), st.floats(-1e6, 1e6, width=32),
                                          st.just(math.nan)), min_size=3, max_size=3),
    st.booleans()), max_size=30))
def test_rings_hold_what_a_plain_ring_holds(window: int, ops: list[tuple[int, list[Any],
                                                                          bool]]) -> None:
    """Appends (rows with None or NaN), clears and reads of a ``Rings`` agree with a
    plain model: per slot its last ``window`` rows, ``t_wall`` relative to the slot's
    first one, None as NaN; ``pos``, ``count`` and ``base`` as arrays."""
    rings = Rings(("t_wall", "a", "b"), window, 2)
    rings.ensure(3)
    model: dict[int, list[list[float]]] = {s: [] for s in range(3)}
    base: dict[int, float] = {}
    written = dict.fromkeys(range(3), 0)
    for slot, row, clear in ops:
        if clear:
            rings.clear(slot)
            model[slot], written[slot] = [], 0
            base.pop(slot, None)
            continue
        vals = [math.nan if v is None else float(v) for v in row]
        if not math.isnan(vals[0]):
            b = base.setdefault(slot, vals[0])
            vals[0] = vals[0] - b
        rings.append(slot, row if slot else tuple(row))  # a list or a tuple
        model[slot] = (model[slot] + [vals])[-window:]
        written[slot] += 1
    slots = np.arange(3)
    assert len(rings.count) == len(rings.pos) == len(rings.base) == rings.slots
    assert rings.count.tolist()[:3] == [len(model[s]) for s in range(3)]
    assert rings.pos.tolist()[:3] == [written[s] % window for s in range(3)]
    assert [None if math.isnan(b) else b for b in rings.base.tolist()[:3]] == \
        [np.float64(base[s]) if s in base else None for s in range(3)]
    last = rings.last(slots, window)
    for s in range(3):
        want = np.full((window, 3), np.nan, dtype=np.float32)
        if model[s]:
            want[-len(model[s]):] = np.array(model[s], dtype=np.float32)
        np.testing.assert_array_equal(last[s], want)
        hist = rings.history("t_wall", s)
        assert len(hist) == len(model[s])


# ---- what the run state stores ----------------------------------------------------------


def _hello(st_: RunState, rank: int = 0) -> None:
    st_.apply(wire.Frame(wire.KIND_HELLO, {"identity": {
        "rank": rank, "local_rank": rank, "world_size": 4, "hostname": "n0",
        "ip": "10.0.0.1", "pid": 100 + rank, "job": "j"}}), 1.0)


def _row(fields: tuple[str, ...], values: dict[str, Any]) -> list[Any]:
    return [values.get(f) for f in fields]


@pytest.mark.parametrize("history", [True, False])
def test_a_batch_is_stored_as_its_rows_say(history: bool) -> None:
    """A batch's step and sample rows, Nones and non-finite numbers included, land in
    the windows and latest values as NaN where not measured, times relative to the
    slot's first; the comm figures of a step without a ``collectives`` map are the
    allreduce's; a map's are its own."""
    s = RunState()
    _hello(s)
    step = _row(STEP_FIELDS, {"step": 7, "t_wall": 1000.5, "step_s": 0.5, "data_wait_s": None,
                              "comm_s": math.inf, "comm_bytes": 10 ** 6, "comm_calls": 3,
                              "busbw_Bps": 2e9, "gap_s": math.nan})
    step2 = _row(STEP_FIELDS, {"step": 8, "t_wall": 1001.0, "step_s": 0.25, "comm_calls": 1,
                               "collectives": {"all_gather": [0.1, 5, 1, None]}})
    gpu = _row(GPU_FIELDS, {"t_wall": 1000.75, "util_pct": 90.0, "mem_used_bytes": 5,
                            "power_w": None, "temp_c": 60, "sm_clock_mhz": math.nan})
    host = _row(HOST_FIELDS, {"t_wall": 1000.75, "proc_cpu_pct": 120.0})
    mem = _row(MEM_FIELDS, {"t_wall": 1000.75, "device": "cuda:0", "used_bytes": 9,
                            "peak_bytes": None, "capacity_bytes": 100})
    hb = _row(HEARTBEAT_FIELDS, {"t_wall": 1000.75, "phase": "compute", "phase_s": 2.5,
                                 "step": 7})
    s.apply(wire.Frame(wire.KIND_BATCH, {
        "rank": 0, "seq": 1, "steps": [step, step2], "gpu": [gpu], "host": [host],
        "mem": [mem], "hb": [hb]}), 2.0, history)
    rs = s.rank_state(0)
    assert rs is not None and rs.slot is not None
    assert rs.last_step == 8 and rs.steps_seen == 2 and s.step_records == 2
    assert rs.mem_device == "cuda:0" and rs.hb == hb and rs.gpu == gpu
    assert rs.last_seq == 1
    latest = dict(zip(LATEST, s.latest[rs.slot].tolist(), strict=True))
    assert latest["gpu_util_pct"] == 90.0 and latest["gpu_temp_c"] == 60
    assert math.isnan(latest["gpu_power_w"]) and math.isnan(latest["gpu_sm_clock_mhz"])
    assert latest["host_proc_cpu_pct"] == 120.0 and math.isnan(latest["host_rss_bytes"])
    assert latest["mem_used_bytes"] == 9 and math.isnan(latest["mem_peak_bytes"])
    assert latest["phase_s"] == 2.5
    steps = {f: s.steps.history(f, rs.slot).tolist() for f in STEP_HISTORY}
    samples = {f: s.samples.history(f, rs.slot).tolist() for f in SAMPLE_HISTORY}
    if not history:
        assert all(v == [] for v in steps.values()) and all(v == [] for v in samples.values())
        assert rs.collectives is None
        return
    assert steps["step"] == [7, 8] and steps["t_wall"] == [1000.5, 1001.0]
    assert steps["step_s"] == [0.5, 0.25] and math.isnan(steps["data_wait_s"][0])
    assert math.isnan(steps["comm_s"][0]) and math.isnan(steps["gap_s"][0])
    assert steps["comm_bytes"][0] == 10 ** 6
    assert samples["t_wall"] == [1000.75] and samples["gpu_util_pct"] == [90.0]
    assert math.isnan(samples["gpu_power_w"][0]) and samples["mem_used_bytes"] == [9.0]
    assert rs.collectives is not None
    med = rs.collectives.medians()
    assert med["all_reduce"]["bytes"] == 10 ** 6 and med["all_reduce"]["s"] is None
    assert med["all_reduce"]["calls"] == 3 and med["all_reduce"]["busbw_Bps"] == 2e9
    assert med["all_gather"]["s"] == 0.1 and med["all_gather"]["busbw_Bps"] is None


def test_samples_of_unequal_tables_share_rows_by_position() -> None:
    """Two GPU samples and one host sample in a batch: two sample rows, the second
    without host figures; its time from the GPU sample."""
    s = RunState()
    _hello(s)
    g1 = _row(GPU_FIELDS, {"t_wall": 10.0, "util_pct": 1.0})
    g2 = _row(GPU_FIELDS, {"t_wall": 11.0, "util_pct": 2.0})
    h = _row(HOST_FIELDS, {"t_wall": 10.0, "proc_cpu_pct": 50.0})
    s.apply(wire.Frame(wire.KIND_BATCH, {"rank": 0, "gpu": [g1, g2], "host": [h]}), 2.0)
    rs = s.rank_state(0)
    assert rs is not None and rs.slot is not None
    assert s.samples.history("t_wall", rs.slot).tolist() == [10.0, 11.0]
    assert s.samples.history("gpu_util_pct", rs.slot).tolist() == [1.0, 2.0]
    cpu = s.samples.history("host_proc_cpu_pct", rs.slot).tolist()
    assert cpu[0] == 50.0 and math.isnan(cpu[1])


def test_a_refused_batch_stores_nothing() -> None:
    """A batch whose last table is malformed is refused whole: nothing of its steps or
    samples is kept, and its ``seq`` is not taken (sent again, it is applied)."""
    s = RunState()
    _hello(s)
    step = _row(STEP_FIELDS, {"step": 1, "t_wall": 5.0})
    bad = {"rank": 0, "seq": 1, "steps": [step], "hb": [[1.0, "x", 1.0, 1, 5]]}
    with pytest.raises(ProtocolError, match="'hb' row 0: 'stack' must be a string"):
        s.apply(wire.Frame(wire.KIND_BATCH, bad), 2.0)
    rs = s.rank_state(0)
    assert rs is not None and rs.slot is not None
    assert rs.last_seq is None and rs.steps_seen == 0
    assert s.steps.history("step", rs.slot).tolist() == []
    s.apply(wire.Frame(wire.KIND_BATCH, {"rank": 0, "seq": 1, "steps": [step]}), 3.0)
    assert s.steps.history("step", rs.slot).tolist() == [1.0] and rs.last_seq == 1
    s.apply(wire.Frame(wire.KIND_BATCH, {"rank": 0, "seq": 1, "steps": [step]}), 3.0)
    assert s.duplicate_frames == 1 and rs.steps_seen == 1
