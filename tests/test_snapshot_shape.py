"""The snapshot that reaches viewers has exactly the keys ``rtop/run/snapshot.py``
declares: the columns are generated from the table of figures (``collectors.figures``),
the declaration is written by hand, and mypy only checks the code against the
declaration. These tests check the declaration against the table and against what is
really built, from a recording and from a live hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from collectors import wire
from collectors.figures import FIGURES, PREFIX
from collectors.schema import TABLES
from rtop.analysis import AnalysisConfig, Monitor
from rtop.analysis.viewport import Page, ViewRequest
from rtop.client import HubClient
from rtop.hub.service import ThreadedHub
from rtop.run import snapshot as shape
from rtop.run.recording import read
from tests.rankclient import RankClient, gpu_row, hb_row, step_row

FIXTURES = Path(__file__).parent / "fixtures"


def keys(td: Any) -> set[str]:
    return set(td.__required_keys__) | set(td.__optional_keys__)


def test_the_declared_snapshot_is_the_table_of_figures():
    """Every figure the table says a snapshot carries is a declared column, and every
    declared column a figure of the table; the nodes' columns are the figures a node
    keeps its worst rank's of."""
    assert keys(shape.RankColumns) == {f.name for f in FIGURES if f.snapshot}
    assert keys(shape.NodeColumns) == {"node", "ranks", "active"} | {
        f.name for f in FIGURES if f.node is not None}


def test_every_wire_field_is_a_figure():
    """Each field a rank sends is declared once (besides the samples' time stamps, the
    steps' collectives and groups maps, heartbeat and event details), under its table's
    prefix."""
    declared = {(f.table, f.source) for f in FIGURES}
    for table in ("steps", "gpu", "host", "mem"):
        fields = [x for x in TABLES[table] if x not in ("collectives", "groups")
                  and (table == "steps" or x != "t_wall")]
        missing = [x for x in fields if (table, x) not in declared]
        assert not missing, (table, missing)
    for f in FIGURES:
        assert f.name.startswith(PREFIX[f.table]) or f.field, f.name


def test_every_use_of_a_figure_finds_it():
    """What each view takes from the table is there: Prometheus series and the UI read
    snapshot columns, the rank detail reads histories the hub keeps, the report has a key
    for each figure it sums up."""
    from dataclasses import fields

    from rtop.hub.metrics import RANK_COUNTERS, RANK_GAUGES, RANK_SUMMARIES
    from rtop.report import build_report
    from rtop.run.state import SAMPLE_HISTORY, STEP_HISTORY, WINDOW_STATS
    from rtop.tui.model import NodeRow, RankRow

    columns = keys(shape.RankColumns)
    summaries = tuple(s for _, quantiles in RANK_SUMMARIES.values() for _, s in quantiles)
    assert {s.column for s in RANK_GAUGES + RANK_COUNTERS + summaries} <= columns
    assert {s.name for s in RANK_GAUGES + RANK_COUNTERS + summaries} == {
        p.name for f in FIGURES for p in f.prometheus}
    row, node = {f.name for f in fields(RankRow)}, {f.name for f in fields(NodeRow)}
    for f in FIGURES:
        if f.column is not None:
            assert f.snapshot and f.name in row, f.name
        if f.node is not None:
            assert f.name in row and f.name in node, f.name
        if f.detail is not None:  # a history's sparkline, or a statistic of the window
            assert f.name in STEP_HISTORY + SAMPLE_HISTORY or f in WINDOW_STATS, f.name
    entry = build_report(FIXTURES / "starved.rtop", find_spools=False)["ranks"][0]
    assert {f.key for f in FIGURES if f.report is not None} <= set(entry)


def check_snapshot(snap: dict[str, Any]) -> None:
    assert set(snap) - {"replay", "fleet"} == keys(shape.Snapshot) - {"replay", "fleet"}
    assert shape.RunInfo.__required_keys__ <= set(snap["run"]) <= keys(shape.RunInfo)
    assert set(snap["ranks"]) == keys(shape.RankColumns), \
        set(snap["ranks"]) ^ keys(shape.RankColumns)
    n = len(snap["ranks"]["rank"])
    assert n > 0 and all(len(col) == n for col in snap["ranks"].values())
    assert set(snap["nodes"]) == keys(shape.NodeColumns)
    assert set(snap["hub"]) == keys(shape.HubInfo)
    assert set(snap["overview"]) <= keys(shape.Overview)
    for f in snap["findings"]:
        assert set(f) == keys(shape.EpisodeDict), f
    scaling = snap["overview"].get("scaling")
    if scaling is not None:
        assert set(scaling) == keys(shape.Scaling)
        for w in scaling["what_if"]:
            assert set(w) == keys(shape.WhatIf)


def check_view(snap: dict[str, Any]) -> None:
    """A view's snapshot: the declared snapshot, and its fleet view as declared."""
    check_snapshot(snap)
    fleet = snap["fleet"]
    assert set(fleet) == keys(shape.FleetView)
    assert set(fleet["job"]) == keys(shape.JobTotals)
    for s in fleet["stats"]:
        assert set(s) == keys(shape.FigureStats)
    for o in fleet["outliers"]:
        assert set(o) == keys(shape.Outlier)
    for p in fleet["pages"].values():
        assert set(p) == keys(shape.PageView)


def test_a_replayed_run_builds_the_declared_snapshot():
    monitor = Monitor(config=AnalysisConfig())
    for t, frame in read(FIXTURES / "starved.rtop"):
        monitor.apply(frame, t)
        monitor.advance(t)
        if monitor.findings:  # the run while its finding is active
            break
    snap = monitor.snapshot(replay=shape.ReplayInfo(
        position_s=1.0, duration_s=2.0, speed=1.0, paused=False, finished=True, warnings=[]))
    check_snapshot(dict(snap))
    assert set(snap["replay"]) == keys(shape.ReplayInfo)
    assert [f["kind"] for f in snap["findings"]] == ["starved_rank"]
    assert snap["overview"]["scaling"] is not None
    detail = monitor.rank_detail(snap["ranks"]["rank"][0])
    assert detail["found"] and set(detail) == keys(shape.RankDetail)
    assert set(monitor.rank_detail(999)) == shape.RankDetail.__required_keys__


def test_a_live_hub_sends_the_declared_snapshot(tmp_path):
    hub = ThreadedHub(job="shape", record=str(tmp_path / "run.rtop"), token="t").start()
    try:
        rank = RankClient(hub.address, hub.token, 0, world=1)
        assert rank.recv().kind == wire.KIND_WELCOME
        rank.batch(steps=[step_row(k) for k in range(3)], gpu=[gpu_row()], hb=[hb_row()])
        with HubClient(hub.address, hub.token) as viewer:
            snap: dict[str, Any] = dict(viewer.snapshot())
            for _ in range(100):
                if snap["ranks"]["step"] == [2]:
                    break
                snap = dict(viewer.snapshot())
            assert snap["ranks"]["step"] == [2]
            check_snapshot(snap)
            assert snap["hub"]["address"] == hub.address
            assert snap["ranks"]["gpu_util_pct"] == [95.0]
            view = ViewRequest(pages={"table": Page(limit=10)}, whole_up_to=0)
            check_view(dict(viewer.snapshot(view)))
            detail = dict(viewer.rank(0))
            assert set(detail) == keys(shape.RankDetail)
        rank.close()
    finally:
        hub.stop()
