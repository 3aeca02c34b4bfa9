"""A malicious peer against the hub's ingest and the views (issue 12, findings 6 and 7).

Finding 6: one authenticated peer must not exhaust the hub's memory or stop the
analysis (a claimed world allocates nothing, the rank budget holds, one connection is
one rank, malformed frames are refused saying what, non-finite numbers are "not
measured", a failing detector costs its own finding). Finding 7: names a peer chooses
(hostnames, job names, notes, stacks) reach the hub's log, ``rtop status``, reports and
the UI; they must not retitle the terminal, crash a screen or attach an action.

Each test reproduces one attack, fed to ``RunState``/``Monitor`` as the hub feeds them
(or through a real hub and collector for the end-to-end ones). ``pytest -s`` prints the
memory figures of ``benchmarks/ingest_budget.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from rich.segment import Segment
from rich.text import Text

from collectors import wire
from collectors.schema import GPU_FIELDS, HEARTBEAT_FIELDS, STEP_FIELDS
from rtop.analysis import AnalysisConfig, Analyzer, Monitor, evaluate
from rtop.analysis import detectors as d
from rtop.fmt import REPLACEMENT, safe_text
from rtop.run.recording import read as read_recording
from rtop.run.state import RunState
from rtop.run.validate import MAX_ENTRIES, MAX_NAME, MAX_ROWS, ProtocolError
from rtop.tui.app import RtopApp, make_app
from rtop.tui.detail import RankScreen
from rtop.tui.ranks import RanksView
from rtop.tui.source import LiveSource, ReplaySource
from rtop.tui.views import FabricScreen

ROOT = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000.0
EVIL_HOST = "[@click=app.quit]evil[/]"  # markup that quits rtop when clicked, if parsed
CRASH_HOST = "node[/]b"  # a closing tag with nothing to close: a MarkupError, if parsed
EVIL_JOB = "\x1b]0;pwned\x07"  # OSC 0: retitles the terminal, if printed raw


# ---- frames ------------------------------------------------------------------------------


def ident(rank: int, world: int = 2, **over: Any) -> dict[str, Any]:
    out = {"rank": rank, "local_rank": rank, "world_size": world, "hostname": "node-a",
           "ip": "127.0.0.1", "pid": 1000 + rank, "attempt": 0, "job": "job",
           "group": "g0", "node_id": "", "source": "env"}
    out.update(over)
    return out


def hello(rank: int, world: int = 2, **over: Any) -> wire.Frame:
    return wire.Frame(wire.KIND_HELLO, {"role": "rank", "identity": ident(rank, world, **over)})


def step_rows(n: int = 30, t0: float = NOW, step_s: float = 0.1, **fig: Any) -> list[list]:
    rows = []
    for k in range(n):
        row = dict.fromkeys(STEP_FIELDS)
        row.update(step=k, t_wall=t0 + k * step_s, step_s=step_s, data_wait_s=0.001,
                   compute_s=0.07, comm_s=0.02, comm_exposed_s=0.01, comm_bytes=400e6,
                   comm_calls=16, algbw_Bps=20e9, busbw_Bps=30e9, samples=32, gap_s=0.0)
        row.update(fig)
        rows.append([row[f] for f in STEP_FIELDS])
    return rows


def gpu_row(t: float = NOW, **fig: Any) -> list[Any]:
    row: dict[str, Any] = dict.fromkeys(GPU_FIELDS)
    row.update(t_wall=t, util_pct=95.0, mem_used_bytes=70e9, mem_total_bytes=141e9,
               power_w=600.0, power_limit_w=700.0, temp_c=60, sm_clock_mhz=1980,
               sm_clock_max_mhz=1980, clock_event_reasons=0)
    row.update(fig)
    return [row[f] for f in GPU_FIELDS]


def hb_row(t: float = NOW, **fig: Any) -> list[Any]:
    row = {"t_wall": t, "phase": "compute", "phase_s": 0.01, "step": 0, "stack": None}
    row.update(fig)
    return [row[f] for f in HEARTBEAT_FIELDS]


def batch(rank: int, group: str = "g0", **tables: Any) -> wire.Frame:
    return wire.Frame(wire.KIND_BATCH, {"rank": rank, "group": group, "seq": 0,
                                        "t_wall": NOW, "dropped": 0, **tables})


def controls(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on (newlines aside)."""
    return [c for c in text if c != "\n" and unicodedata.category(c)[0] == "C"]


# ---- finding 6: memory ---------------------------------------------------------------------


def test_a_claimed_world_allocates_no_windows():
    """Before: one hello claiming 4,096 ranks allocated their windows at once (345 MB),
    and 2**20 would have needed 56 GiB of steps alone. Windows now come as ranks do."""
    st = RunState()
    before = st.nbytes()
    st.apply(hello(0, world=4096), NOW)
    assert st.nbytes() == before, "a claim of 4,096 ranks allocated windows"
    st.apply(hello(0, world=1 << 20, group="g1"), NOW)
    assert st.nbytes() == before, "a claim of 2**20 ranks allocated windows"
    # (a group beside a live one waits: issue 24, B2) its claim is held, nothing more
    assert st.pending["g1"].world_size == 1 << 20


def test_windows_grow_as_ranks_arrive_and_keep_their_data():
    st = RunState()
    st.apply(hello(0, world=4096), NOW)
    st.apply(batch(0, steps=step_rows(5)), NOW + 1)
    for r in range(1, 300):
        st.apply(hello(r, world=4096), NOW + 1)
    assert 300 <= st.steps.slots <= 512  # blocks as ranks came, nowhere near 4,096
    rs0 = st.rank_state(0)
    assert rs0 is not None and rs0.slot is not None
    assert st.steps.history("step", rs0.slot).tolist() == [0, 1, 2, 3, 4]
    assert st.steps.history("t_wall", rs0.slot)[-1] == pytest.approx(NOW + 0.4, abs=1e-3)


def test_the_rank_budget_is_enforced():
    """Before: no limit but the claimed world (2**20); 1,000 hellos added 123 MB."""
    st = RunState(max_ranks=4)
    for r in range(4):
        st.apply(hello(r, world=1000), NOW)
    with pytest.raises(ProtocolError, match="rank budget exhausted"):
        st.apply(hello(4, world=1000), NOW)
    assert sorted(st.current.ranks) == [0, 1, 2, 3] and st.steps.slots == 4
    # a new attempt takes the windows of the ended one (their summaries are kept),
    # once that one's ranks are gone (issue 24, B2: a restart, not a stray group)
    st.apply(batch(0, steps=step_rows(5)), NOW + 1)
    old = st.rank_state(0)
    for r in range(4):
        st.apply(wire.Frame("conn", {"event": "close", "rank": r, "group": "g0",
                                     "how": "reset"}), NOW + 1.5)
    for r in range(4):
        st.apply(hello(r, world=4, group="g1"), NOW + 2)
    assert old is not None and old.slot is None
    assert old.summary["step_s"] == pytest.approx(0.1)
    assert st.steps.slots == 4 and len(st.attempts) == 2


def test_one_connection_is_one_rank():
    """Before: one connection could introduce any number of ranks, and send for them."""
    mon = Monitor(RunState(), diagnose=False)
    rs0 = mon.apply(hello(0), NOW, peer=None)  # the connection's first hello
    assert rs0 is not None
    with pytest.raises(ProtocolError, match="one connection is one rank"):
        mon.apply(hello(1), NOW, peer=rs0)
    assert mon.state.rank_state(1) is None
    rs1 = mon.apply(hello(1), NOW, peer=None)  # rank 1 on a connection of its own
    with pytest.raises(ProtocolError, match="one connection is one rank"):
        mon.apply(batch(1, steps=step_rows(3)), NOW, peer=rs0)
    assert rs1 is not None and rs1.steps_seen == 0
    # the same rank saying hello again on its connection is no other rank
    assert mon.apply(hello(0), NOW, peer=rs0) is rs0
    assert mon.apply(batch(0, steps=step_rows(3)), NOW, peer=rs0) is rs0


def test_one_connection_is_one_rank_at_the_hub():
    """The hub passes each connection's rank (``peer``): a second hello for another rank
    on the same connection is refused, and the connection closed."""
    from rtop.hub.service import ThreadedHub
    from tests.rankclient import RankClient

    hub = ThreadedHub(job="one-rank").start()
    try:
        c = RankClient(hub.address, hub.token, rank=0, world=1000)
        assert c.recv().kind == wire.KIND_WELCOME
        c.send(wire.KIND_HELLO, {"role": "rank", "identity": ident(1, world=1000)})
        err = c.recv()
        assert err is not None and err.kind == wire.KIND_ERROR
        assert "one connection is one rank" in err.payload["message"]
        assert c.closed_by_hub()
        assert hub.call(lambda h: sorted(h.state.current.ranks)) == [0]
    finally:
        hub.stop()


def test_ingest_memory_figures():
    """RSS growth of a hub's state for one hello claiming 4,096 and 2**20 ranks, and for
    1,000 hellos on one connection (``-s`` prints them; before the fix: +341 MB, a
    56 GiB MemoryError, and +82 MB with every hello taken)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from ingest_budget import CASES, run_case
    finally:
        sys.path.pop(0)
    print()
    for name, case in CASES.items():
        r = run_case(ROOT, case["world"], case["hellos"], True, 8.0)
        assert "error" not in r, r
        print(f"  {name:<32} RSS +{r['rss_mb']:.1f} MB, taken {r['taken']}, refused "
              f"{r['refused']}, {r['slots']} slots")
        assert r["rss_mb"] < 24 and r["taken"] == 1 and r["slots"] <= 64


# ---- finding 6: values ---------------------------------------------------------------------


BAD_FRAMES = [
    ("group map", hello(0, group={"a": 1}), "'group' must be a string"),
    ("hostname number", hello(0, hostname=7), "'hostname' must be a string"),
    ("rank bool", hello(True), "'rank' must be an integer"),
    ("rank outside world", hello(5, world=4), "outside its world"),
    ("world zero", hello(0, world=0), "'world_size' must be an integer"),
    ("world too big", hello(0, world=(1 << 20) + 1), "'world_size' must be an integer"),
    ("no pid", wire.Frame("hello", {"identity": {k: v for k, v in ident(0).items()
                                                 if k != "pid"}}), "has no 'pid'"),
    ("identity list", wire.Frame("hello", {"identity": [0, 1]}), "identity map"),
    ("string figure", batch(0, steps=step_rows(1, compute_s="fast")),
     "'steps' row 0: 'compute_s' must be a number"),
    ("bool figure", batch(0, gpu=[gpu_row(util_pct=True)]), "'util_pct' must be a number"),
    ("row too long", batch(0, steps=[step_rows(1)[0] + [1]]), "malformed 'steps' rows: row 0"),
    ("row not a list", batch(0, host=[{"a": 1}]), "malformed 'host' rows: row 0"),
    ("too many rows", batch(0, hb=[hb_row()] * (MAX_ROWS + 1)), "rows in one batch"),
    ("phase map", batch(0, hb=[hb_row(phase={"x": 1})]), "'phase' must be a string"),
    ("stack bytes", batch(0, hb=[hb_row(stack=b"\x1b")]), "'stack' must be a string"),
    ("event kind", batch(0, events=[[NOW, 7, 1.0, 1]]), "'kind' must be a string"),
    ("meta list", batch(0, meta=[1, 2]), "'meta' must be a map"),
    ("meta too big", batch(0, meta={f"k{i}": i for i in range(MAX_ENTRIES + 1)}),
     "entries"),
    ("meta too deep", batch(0, meta={"a": {"b": {"c": {"d": {"e": 1}}}}}), "nested"),
    ("meta bytes", batch(0, meta={"a": b"x"}), "not a number, string"),
    ("notes not strings", batch(0, meta={"notes": [1]}), "meta.notes"),
    ("dropped negative", batch(0, dropped=-1), "'dropped' must be a non-negative"),
    ("cpu string", batch(0, cpu_s="1"), "'cpu_s' must be a number"),
    ("group of a batch", batch(0, group=["g0"]), "'group' must be a string"),
    ("rank string", wire.Frame("batch", {"rank": "0"}), "integer 'rank'"),
    ("bye error map", wire.Frame("bye", {"rank": 0, "group": "g0", "error": {}}),
     "'error' must be a string"),
    ("offset string", wire.Frame("offset", {"rank": 0, "group": "g0", "offset_s": "1"}),
     "'offset_s' must be a number"),
]


@pytest.mark.parametrize(("frame", "says"), [(f, s) for _, f, s in BAD_FRAMES],
                         ids=[n for n, _, _ in BAD_FRAMES])
def test_malformed_frames_are_refused_saying_what(frame, says):
    """Before: a map in ``group`` raised an uncaught TypeError; strings and booleans
    went into the windows as 'not measured' or crashed later, in a view."""
    st = RunState()
    st.apply(hello(0), NOW)
    rs = st.rank_state(0)
    before = (rs.steps_seen, dict(rs.meta), rs.hb, rs.dropped, len(st.current.ranks))
    with pytest.raises(ProtocolError, match=says):
        st.apply(frame, NOW + 1)
    assert (rs.steps_seen, dict(rs.meta), rs.hb, rs.dropped,
            len(st.current.ranks)) == before, "a refused frame changed the state"


def test_meta_cannot_grow_without_bound():
    st = RunState()
    st.apply(hello(0), NOW)
    for k in range(MAX_ENTRIES // 8):
        st.apply(batch(0, meta={f"k{k}_{i}": i for i in range(8)}), NOW)
    with pytest.raises(ProtocolError, match="meta would hold"):
        st.apply(batch(0, meta={"one_more": 1}), NOW)
    # a list is cut to its newest items, not refused
    st2 = RunState()
    st2.apply(hello(0), NOW)
    st2.apply(batch(0, meta={"notes": [f"note {i}" for i in range(500)]}), NOW)
    notes = st2.rank_state(0).meta["notes"]
    assert len(notes) == MAX_ENTRIES and notes[-1] == "note 499"


def test_non_finite_numbers_are_not_measured():
    """Before: an infinite clock-event mask broke the throttle detectors every cycle
    (``int(inf)``), which also stopped the recorder's clock frames and the hub's exit."""
    mon = Monitor(RunState(), AnalysisConfig(onset_evals=1))
    for r in (0, 1):
        mon.apply(hello(r), NOW)
    inf, nan = float("inf"), float("nan")
    mon.apply(batch(0, steps=step_rows(30, compute_s=inf, busbw_Bps=-inf),
                    gpu=[gpu_row(clock_event_reasons=inf, power_w=nan, temp_c=1e300)],
                    hb=[hb_row(phase_s=inf)], cpu_s=inf), NOW + 3)
    # throttled in two samples in a row (one sample is never a throttled GPU)
    mon.apply(batch(1, steps=step_rows(30), gpu=[
        gpu_row(NOW + k, sm_clock_mhz=1200, clock_event_reasons=1 << 3) for k in (1, 2)]),
              NOW + 3)
    rs0 = mon.state.rank_state(0)
    reasons = GPU_FIELDS.index("clock_event_reasons")
    assert rs0.gpu[reasons] is None and rs0.gpu[GPU_FIELDS.index("power_w")] is None
    assert rs0.gpu[GPU_FIELDS.index("temp_c")] is None  # beyond any measurement
    assert rs0.rtop_cpu is None and rs0.cpu_mark is None
    for k in range(3):
        ev = mon.advance(NOW + 3 + k * 0.5)
        assert ev is not None
    assert mon.analyzer.errors.counts == {}, mon.analyzer.errors.counts
    assert "gpu_throttled" in {f["kind"] for f in mon.findings}  # rank 1's, still found
    json.dumps(mon.snapshot(), allow_nan=False)  # a report or a viewer can take it


def test_a_hub_time_that_is_no_time_is_refused():
    st = RunState()
    with pytest.raises(ProtocolError, match="hub time"):
        st.apply(hello(0), float("inf"))
    assert st.now == 0.0 and st.current is None
    mon = Monitor(st)
    assert mon.advance(float("inf")) is None and mon.advance(float("nan")) is None


def test_one_ranks_clock_cannot_spoil_the_others():
    """Before: the windows kept t_wall in float32 relative to one base, the first value
    any rank sent; a rank whose first t_wall was 1e18 took every other rank's timing to
    a resolution of minutes, and the diagnosis with it."""
    st = RunState()
    for r in (0, 1):
        st.apply(hello(r), NOW)
    st.apply(batch(0, steps=step_rows(3, t0=1e18)), NOW)
    st.apply(batch(1, steps=step_rows(30)), NOW + 3)
    t = st.steps.history("t_wall", st.rank_state(1).slot)
    assert t[-1] - t[-2] == pytest.approx(0.1, abs=1e-3)
    assert t[-1] == pytest.approx(NOW + 2.9, abs=1e-3)


def test_a_failing_detector_costs_one_finding(monkeypatch, caplog):
    """Before: one detector raising lost every finding of the cycle, every cycle."""
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(d, "straggler", broken)
    st = RunState()
    for r in range(3):
        st.apply(hello(r, world=3), NOW)
        fig = {"data_wait_s": 0.05, "compute_s": 0.03} if r == 1 else {}
        st.apply(batch(r, steps=step_rows(30, **fig)), NOW + 3)
    analyzer = Analyzer(AnalysisConfig(onset_evals=1))
    with caplog.at_level(logging.ERROR, logger="rtop.analysis"):
        for k in range(3):
            found = analyzer.update(st, NOW + 3 + 0.5 * k)
    assert [f["kind"] for f in found] == ["starved_rank"]
    assert analyzer.errors.counts == {"straggler": 3}
    logged = [r for r in caplog.records if "straggler detector failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert evaluate(st, AnalysisConfig())  # evaluate() alone isolates them too


def test_the_diagnosis_never_stops_the_cycle(monkeypatch, caplog):
    """A failure outside any detector costs that evaluation only: ranks are still marked
    lost, the hub's housekeeping (recorder clock, linger exit) goes on."""
    mon = Monitor(RunState(lost_after_s=1.0))
    mon.apply(hello(0, world=1), NOW)
    monkeypatch.setattr(Analyzer, "update", lambda self, st, t=None: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="rtop.analysis"):
        evs = [mon.advance(NOW + 2 + k) for k in range(3)]
    assert all(ev is not None for ev in evs)
    assert [rs.rank for rs in evs[0].lost] == [0]
    assert mon.failures == 3
    assert len([r for r in caplog.records if "diagnosis failed" in r.getMessage()]) == 1


# ---- finding 7: names ----------------------------------------------------------------------


def hostile_state() -> Monitor:
    mon = Monitor(RunState(), AnalysisConfig())
    mon.apply(wire.Frame(wire.KIND_RUN, {"hub": {"started": NOW}, "job": EVIL_JOB}), NOW)
    mon.apply(hello(0, hostname=EVIL_HOST, job=EVIL_JOB, group="g\x1b[2J0"), NOW)
    mon.apply(hello(1, hostname=CRASH_HOST, job=EVIL_JOB, group="g\x1b[2J0"), NOW)
    for r in (0, 1):
        mon.apply(batch(r, group="g\x1b[2J0", steps=step_rows(30),
                        mem=[[NOW, "cuda:0\x1b[31m", 1e9, 1e9, 1e9, 8e9, 1e8, 1e8, 2e8,
                              None]],
                        hb=[hb_row(phase="compute\x1b]0;x\x07", stack="  File \"x\"\n"
                                   "\x1b]0;pwned\x07  boom()\n")],
                        meta={"notes": ["note\x1b]0;x\x07"],
                              "device": {"name": "H200\x1b[5m"}}), NOW + 3)
    mon.advance(NOW + 3, force=True)
    return mon


def test_names_are_made_safe_at_ingest():
    """Before: hostnames, job names, groups, phases, notes and stacks were kept as sent
    and reached the hub's log, ``rtop status``, reports and the UI raw."""
    mon = hostile_state()
    st = mon.state
    rs0 = st.rank_state(0, safe_text("g\x1b[2J0"))
    assert rs0 is not None and st.rank_state(0) is rs0  # found by its cleaned group too
    assert rs0.node == EVIL_HOST  # markup is text: kept as it is, drawn as text
    assert rs0.identity.job == f"{REPLACEMENT}]0;pwned{REPLACEMENT}"
    assert not controls(rs0.identity.group) and not controls(rs0.phase or "")
    assert rs0.stack == f"  File \"x\"\n{REPLACEMENT}]0;pwned{REPLACEMENT}  boom()\n"
    assert not controls(rs0.mem_device or "") and not controls(rs0.meta["notes"][0])
    assert not controls(rs0.meta["device"]["name"])
    snap = mon.snapshot()
    text = json.dumps(snap, ensure_ascii=False)
    assert "\x1b" not in text and "\x07" not in text
    assert snap["run"]["name"] == safe_text(EVIL_JOB)
    detail = json.dumps(st.rank_detail(0), ensure_ascii=False, default=str)
    assert "\x1b" not in detail and "\x07" not in detail
    long = RunState()
    rs = long.apply(hello(0, hostname="h" * 100_000, job="j" * 100_000), NOW)
    assert rs is not None and len(rs.node) == MAX_NAME and len(rs.identity.job) == MAX_NAME
    bye = long.apply(wire.Frame("bye", {"rank": 0, "group": "g0",
                                        "error": "Traceback\n\x1b[2J" + "x" * 10_000}), NOW)
    assert bye is not None and bye.status == "failed"
    assert bye.meta["error"].startswith(f"Traceback\n{REPLACEMENT}[2J")
    assert len(bye.meta["error"]) <= 4096


def test_status_and_report_print_no_control_characters(tmp_path):
    """``rtop status`` prints the hub's snapshot (rtop/cli.py's format_snapshot) and
    ``rtop report`` a recording: a name's escape sequence retitled the terminal."""
    from rtop.cli import format_snapshot
    from rtop.report import build_report, format_text, to_json

    out = format_snapshot(hostile_state().snapshot())
    assert not controls(out), controls(out)
    assert "pwned" in out and EVIL_HOST[:14] in out
    path = hostile_recording(tmp_path / "evil.rtop")
    report = build_report(path)
    text = format_text(report)
    assert not controls(text), controls(text)
    assert "pwned" in text and EVIL_HOST[:14] in text
    assert "\\u001b" not in to_json(report) and "\\u0007" not in to_json(report)


def test_a_recorded_clock_that_is_no_time_is_skipped(tmp_path):
    """A recording written before ranks were kept from forging the hub's frames may hold
    ``clock`` frames of inf or NaN time: ``rtop report --json`` failed on them. The
    reader keeps the last good time instead, and replay's span reads a finite end."""
    from rtop.report import build_report, to_json
    from rtop.tui.source import recording_span

    path = hostile_recording(tmp_path / "forged.rtop", seconds=5)
    with open(path, "ab") as f:
        for t in (float("inf"), float("nan"), -float("inf")):
            f.write(wire.encode(wire.KIND_CLOCK, {"t_hub": t}))
    times = [t for t, _frame in read_recording(path)]
    assert all(math.isfinite(t) for t in times) and max(times) == NOW + 0.25 * 19
    assert recording_span(path) == (NOW, NOW + 0.25 * 19)
    out = to_json(build_report(path))
    assert "Infinity" not in out and "NaN" not in out
    json.loads(out)


def hostile_recording(path: Path, seconds: int = 30) -> Path:
    """A recording that never went through a hub: a shared file, its names hostile."""
    frames = [wire.encode(wire.KIND_RUN, {"hub": {"version": "x\x1b]0;v\x07",
                                                  "address": "\x1b[2J", "started": NOW},
                                          "job": EVIL_JOB, "record": "\x1b]0;r\x07"})]
    for r, host in ((0, EVIL_HOST), (1, CRASH_HOST)):
        frames.append(wire.encode(wire.KIND_HELLO, {"role": "rank", "identity": ident(
            r, hostname=host, job=EVIL_JOB)}))
    for r in (0, 1):
        frames.append(wire.encode(wire.KIND_BATCH, {
            "rank": r, "group": "g0", "steps": step_rows(30, t0=NOW, step_s=0.01),
            "hb": [hb_row(stack="Traceback\n\x1b]0;pwned\x07\n")],
            "meta": {"notes": ["\x1b]0;note\x07"]}}))
    for k in range(1, seconds * 4):
        frames.append(wire.encode("clock", {"t_hub": NOW + 0.25 * k}))
    path.write_bytes(b"".join(frames))
    return path


def screen_lines(app: RtopApp) -> list[list[Segment]]:
    """The screen as the terminal would get it: one list of segments per line."""
    update = app.screen._compositor.render_full_update()
    return [[seg for strip in line for seg in strip] for line in update.strips]


def terminal_output(app: RtopApp) -> str:
    """What the app would write to the terminal for the whole screen."""
    return app.screen._compositor.render_full_update().render_segments(app.console)


def find_on_screen(app: RtopApp, needle: str) -> tuple[int, int] | None:
    for y, segs in enumerate(screen_lines(app)):
        line = "".join(s.text for s in segs)
        i = line.find(needle)
        if i >= 0:
            return Text(line[:i]).cell_len, y
    return None


def click_actions(app: RtopApp) -> list[Any]:
    """Actions attached to anything on the screen by markup (``@click`` meta)."""
    return [s.style.meta["@click"] for segs in screen_lines(app) for s in segs
            if s.style is not None and s.style.meta and "@click" in s.style.meta]


async def until(pilot, cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the UI"
        await pilot.pause(0.05)


async def check_hostile_screens(app: RtopApp, pilot, hosts: tuple[str, ...]) -> None:
    """Overview, fabric and a rank's detail with hostile names: nothing crashes, nothing
    is clickable, the names show as text, no escape sequence reaches the terminal."""
    title = app.title
    await until(pilot, lambda: len(app.query_one(RanksView).rows) == len(hosts))
    out = terminal_output(app)
    assert "\x1b]" not in out and "\x07" not in out  # no OSC: the title stays
    assert f"{REPLACEMENT}]0;pwned{REPLACEMENT}" in out  # the job, shown harmless
    assert not click_actions(app)
    await pilot.press("f")
    await until(pilot, lambda: isinstance(app.screen, FabricScreen))
    await until(pilot, lambda: find_on_screen(app, EVIL_HOST) is not None)
    for host in hosts:
        assert find_on_screen(app, host) is not None, host  # literally, not as markup
    assert not click_actions(app)
    out = terminal_output(app)
    assert "\x1b]" not in out and "\x07" not in out
    x, y = find_on_screen(app, "evil")
    await pilot.click(offset=(x + 1, y))
    await pilot.pause(0.3)
    assert app.is_running and isinstance(app.screen, FabricScreen)  # no app.quit
    await pilot.press("escape")
    await until(pilot, lambda: not isinstance(app.screen, FabricScreen))
    await pilot.press("enter")  # the rank under the cursor
    await until(pilot, lambda: isinstance(app.screen, RankScreen))
    await until(pilot, lambda: "node " in str(app.screen.query_one("#title").render()))
    shown = str(app.screen.query_one("#title").render())
    assert any(f"node {h}" in shown for h in hosts)
    assert not click_actions(app)
    out = terminal_output(app)
    assert "\x1b]" not in out and "\x07" not in out
    await pilot.press("escape")
    assert app.is_running and app.title == title


async def test_the_ui_is_safe_on_a_hostile_recording(tmp_path):
    """``rtop replay`` on a shared recording whose frames never went through a hub: a
    job name's OSC retitled the terminal, a node named ``[/]`` crashed the fabric view,
    and ``[@click=app.quit]`` quit rtop when clicked."""
    app = make_app(ReplaySource(hostile_recording(tmp_path / "evil.rtop"), paused=True))
    async with app.run_test(size=(160, 40)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        await check_hostile_screens(app, pilot, (EVIL_HOST, CRASH_HOST))
    assert app.return_value is None


RANK = """
import sys, time, collectors
probe = collectors.start(rank=0, world_size=1)
for _ in probe.iter(range(40)):
    with probe.step():
        time.sleep(0.01)
print("stepped", flush=True)
sys.stdin.read()  # until the test is done looking
probe.close()
"""


async def test_the_ui_and_status_are_safe_on_hostile_names_through_a_hub():
    """End to end: a rank started with ``collectors.start()`` whose node and job names
    are hostile (``RTOP_NODE``, ``RTOP_JOB``), a real hub, ``rtop status`` and the UI."""
    from rtop.hub.service import ThreadedHub

    hub = ThreadedHub(job="hostile-names").start()
    env = dict(os.environ, RTOP_HUB=hub.address, RTOP_TOKEN=hub.token, RTOP_NODE=EVIL_HOST,
               RTOP_JOB=EVIL_JOB, RTOP_AUTOHUB="0", PYTHONPATH=str(ROOT))
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "stepped"
        deadline = time.monotonic() + 15
        while hub.call(lambda h: h.state.step_records) < 40:
            assert time.monotonic() < deadline, "the rank's steps never reached the hub"
            time.sleep(0.1)
        status = subprocess.run([sys.executable, "-m", "rtop", "status", hub.address],
                                env=dict(env, RTOP_NODE=""), capture_output=True,
                                text=True, timeout=60, check=False)
        assert status.returncode == 0, status.stderr
        assert not controls(status.stdout), controls(status.stdout)
        assert EVIL_HOST[:14] in status.stdout and "pwned" in status.stdout
        app = make_app(LiveSource(hub.address, hub.token, rate_hz=10))
        async with app.run_test(size=(160, 40)) as pilot:
            await until(pilot, lambda: app.snapshots_seen > 0)
            await check_hostile_screens(app, pilot, (EVIL_HOST,))
        assert app.return_value is None
    finally:
        if rank.stdin is not None:
            rank.stdin.close()
        rank.wait(timeout=30)
        hub.stop()
