"""The terminal UI driven by Pilot: on recorded runs (replayed through the real state
and diagnosis) and on a live hub over real sockets."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from textual.widgets._footer import FooterKey

from collectors import wire
from rtop.fmt import NA
from rtop.hub.service import ThreadedHub
from rtop.tui.app import RtopApp, make_app, parse_goto
from rtop.tui.columns import COLUMNS
from rtop.tui.detail import RankScreen
from rtop.tui.findings import FindingDetail, FindingsList
from rtop.tui.fleet import FleetScreen
from rtop.tui.logs import logs_to_file
from rtop.tui.model import NodeRow, RankRow
from rtop.tui.node_view import NodeScreen
from rtop.tui.overview import OverviewScreen
from rtop.tui.protocols import RankDetailView, SnapshotView
from rtop.tui.ranks import RanksView, fit_columns
from rtop.tui.source import LiveSource, ReplaySource, StaticSource
from rtop.tui.views import FabricScreen, HelpScreen, ScalingScreen
from tests.rankclient import RankClient, gpu_row, hb_row, identity, step_row

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_source(name: str, at: float, ranks: tuple[int, ...] = (0, 1, 2)) -> StaticSource:
    """A recorded run's snapshot ``at`` seconds in, as a fixed source."""
    snap, details = ReplaySource(FIXTURES / f"{name}.rtop").snapshot_at(at, ranks)
    return StaticSource([snap], details, title=name)


async def until(pilot, cond, timeout: float = 10.0) -> None:
    """Let the app run until ``cond()`` holds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the UI"
        await pilot.pause(0.05)


def rows(app: RtopApp) -> list:
    return app.query_one(RanksView).rows


async def test_starved_run_names_the_rank_first():
    app = make_app(fixture_source("starved", 22.0))
    async with app.run_test(size=(120, 32)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        findings = app.query_one(FindingsList).findings
        assert [f["kind"] for f in findings] == ["starved_rank"]
        first = rows(app)[0]
        assert isinstance(first, RankRow) and first.rank == 1 and first.badge == "STARVED"
        assert [r.badge for r in rows(app)[1:]] == ["", ""] or \
            all(r.badge in ("", "done") for r in rows(app)[1:])


async def test_selecting_a_finding_shows_evidence_and_highlights_its_ranks():
    app = make_app(fixture_source("starved", 22.0))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        app.query_one(FindingsList).focus()
        await pilot.press("down", "enter")
        await pilot.pause()
        detail = app.query_one(FindingDetail)
        assert not detail.has_class("hidden")
        text = str(detail.render())
        assert "Fix:" in text and "num_workers" in text and "data_wait_s" in text
        assert app.overview.highlight == {1}
        assert [r.rank for r in rows(app) if r.highlighted] == [1]
        await pilot.press("escape")
        assert app.overview.highlight == set() and detail.has_class("hidden")


async def test_sorting_by_columns_and_reversing():
    app = make_app(fixture_source("starved", 22.0))
    async with app.run_test(size=(120, 32)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        await pilot.press("s")  # worst -> rank
        assert app.overview.sort_key == "rank"
        assert [r.rank for r in rows(app)] == [0, 1, 2]
        await pilot.press("r")
        assert [r.rank for r in rows(app)] == [2, 1, 0]
        for _ in range(4):  # rank -> node -> status -> step -> step ms
            await pilot.press("s")
        assert app.overview.sort_key == "step_s"
        steps = [r.step_s for r in rows(app)]
        assert steps == sorted(steps, reverse=True)
        await pilot.press("w")
        assert app.overview.sort_key == "worst" and rows(app)[0].rank == 1


async def test_opening_a_rank_and_moving_between_ranks():
    app = make_app(fixture_source("starved", 22.0))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        await pilot.press("down", "enter")  # the second line
        second = rows(app)[1].rank
        await until(pilot, lambda: isinstance(app.screen, RankScreen))
        screen = app.screen
        assert screen.rank == second and app.source.detail_rank == second
        await until(pilot, lambda: "med" in str(screen.query_one("#title").render())
                    or "pid" in str(screen.query_one("#title").render()))
        assert "pid" in str(screen.query_one("#title").render())
        await pilot.press("right")
        assert screen.rank == (second + 1) % 3 and app.source.detail_rank == screen.rank
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, RankScreen))
        assert app.source.detail_rank is None


async def test_hung_rank_stack_shows_in_its_detail():
    """A rank stuck in a phase: its Python stack is in the detail screen."""
    hub = ThreadedHub(job="tui-hung").start()
    try:
        client = RankClient(hub.address, hub.token, rank=0, world=1)
        client.batch(steps=[step_row(i) for i in range(5)],
                     hb=[hb_row("compute", 45.0, 5,
                                'File "train.py", line 42, in step\n    loss.backward()')])
        app = make_app(LiveSource(hub.address, hub.token, rate_hz=10))
        async with app.run_test(size=(100, 40)) as pilot:
            await until(pilot, lambda: app.snapshots_seen > 0 and rows(app))
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, RankScreen))
            stack = app.screen.query_one("#stack")
            await until(pilot, lambda: "loss.backward()" in str(stack.render()))
        client.close()
    finally:
        hub.stop()


async def test_filter_group_and_fold():
    app = make_app(fixture_source("starved", 22.0))
    async with app.run_test(size=(120, 32)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        await pilot.press("slash", "0", "-", "1")
        assert sorted(r.rank for r in rows(app)) == [0, 1]
        await pilot.press("enter")
        assert app.overview.filter_text == "0-1"
        await pilot.press("escape")  # clears the filter
        assert app.overview.filter_text == "" and len(rows(app)) == 3
        await pilot.press("slash", *"starved", "enter")
        assert [r.rank for r in rows(app)] == [1]
        await pilot.press("escape", "g")
        node = rows(app)[0]
        assert isinstance(node, NodeRow) and node.ranks == 3 and not node.folded
        assert len(rows(app)) == 4
        await pilot.press("enter")  # fold the node
        assert len(rows(app)) == 1 and rows(app)[0].folded


async def test_views_and_help_open_and_close():
    app = make_app(fixture_source("starved", 22.0))
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        for key, cls, word in (("f", FabricScreen, "loopback"), ("e", ScalingScreen, "What if"),
                               ("question_mark", HelpScreen, "filter")):
            await pilot.press(key)
            await until(pilot, lambda cls=cls: isinstance(app.screen, cls))
            await pilot.pause(0.6)  # a snapshot reaches the view
            text = app.export_screenshot().replace("&#160;", " ")
            assert word in text, key
            await pilot.press("escape")
            await until(pilot, lambda cls=cls: not isinstance(app.screen, cls))


async def test_help_covers_the_overview_keys():
    """Under the help, the overview's keys neither act nor show in the footer."""
    app = make_app(fixture_source("starved", 22.0))
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.press("s", "g")
        assert app.overview.sort_key == "worst" and not app.overview.grouped
        await pilot.pause(0.2)
        shown = [key.description for key in app.screen.query(FooterKey)]
        assert "close" in shown and "group by node" not in shown, shown
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("s")
        assert app.overview.sort_key != "worst"


async def test_replay_controls():
    src = ReplaySource(FIXTURES / "starved.rtop", paused=True)
    app = make_app(src)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        assert src.paused and src.position < 1.0
        await pilot.press("space")
        assert not src.paused
        await pilot.press("plus", "plus")
        assert src.speed == 4.0
        await pilot.press("minus")
        assert src.speed == 2.0
        await pilot.press("space")  # pause
        await pilot.pause(0.6)
        before = src.position
        await pilot.press("right")  # +10 s
        await until(pilot, lambda: src.position >= before + 9.9)
        assert src.position < before + 10.5
        await pilot.press("left")
        await until(pilot, lambda: src.position < before + 0.5)
        await pilot.press("colon", *"step 60", "enter")
        await until(pilot, lambda: max(r.step or 0 for r in rows(app)) >= 60)
        await pilot.press("colon", *"0:20", "enter")
        await until(pilot, lambda: abs(src.position - 20.0) < 0.3)
        await until(pilot, lambda: app.snapshot["replay"]["position_s"] >= 19.7)
        assert [f["kind"] for f in app.snapshot["findings"]] == ["starved_rank"]


def test_goto_parsing():
    assert parse_goto("step 1200") == ("step", 1200.0)
    assert parse_goto("s7") == ("step", 7.0)
    assert parse_goto("90") == ("time", 90.0)
    assert parse_goto("5:30") == ("time", 330.0)
    assert parse_goto("1:02:03") == ("time", 3723.0)
    assert parse_goto("soon") is None


async def test_live_hub_ranks_appear_and_a_vanished_hub_is_reported():
    hub = ThreadedHub(job="tui-live").start()
    clients = []
    try:
        for r in range(4):
            c = RankClient(hub.address, hub.token, rank=r, world=4)
            c.batch(steps=[step_row(i, step_s=0.05 + 0.01 * r) for i in range(10)],
                    gpu=[gpu_row(90.0 - r)])
            clients.append(c)
        app = make_app(LiveSource(hub.address, hub.token, rate_hz=10))
        async with app.run_test(size=(160, 30)) as pilot:
            await until(pilot, lambda: len(rows(app)) == 4)
            by_rank = {r.rank: r for r in rows(app)}
            assert by_rank[3].step_s == pytest.approx(0.08, rel=0.01)
            assert by_rank[0].gpu_util_pct == pytest.approx(90.0)
            seen = app.snapshots_seen
            await until(pilot, lambda: app.snapshots_seen >= seen + 3)  # keeps updating
            hub.stop()
            header = app.query_one("JobHeader")
            await until(pilot, lambda: header.source_error, timeout=15)
            assert "retrying" in header.source_text
    finally:
        for c in clients:
            c.close()
        hub.stop()


async def test_small_terminal_and_no_color(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = make_app(fixture_source("starved", 22.0))
    assert app.no_color
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 0)
        view = app.query_one(RanksView)
        assert sum(c.width + 1 for c in view._cols) <= 80
        titles = [c.title for c in view._cols]
        assert titles[:3] == ["rank", "node", "status"] and "step ms" in titles
        line = "".join(seg.text for seg in view.render_line(0))
        assert "STARVED" in line and "▒" in line  # readable without colour


def test_column_fitting_keeps_the_essentials():
    for width in (60, 80, 120, 200):
        cols = fit_columns(width)
        assert {"rank", "status", "step ms"} <= {c.title for c in cols}
        assert sum(c.width + 1 for c in cols) <= max(width, 60)


async def test_a_thousand_ranks_fold_by_node():
    """1,024 ranks over 128 nodes: the app opens on the fleet view; its table (t) holds
    them all, a page at a time sorted by the source's view, and folds them per node."""
    from rtop.analysis import Monitor

    mon = Monitor(diagnose=False)
    t0 = time.time()
    for r in range(1024):
        ident = identity(r, world=1024, host=f"node-{r // 8:03d}")
        mon.apply(wire.Frame("hello", {"identity": ident, "token": "x"}), t0)
        mon.apply(wire.Frame("batch", {"rank": r, "group": "g0", "steps": [
            step_row(k, step_s=0.5 if r != 77 else 0.9) for k in range(5)]}), t0 + 1)
    snap = mon.snapshot()
    snap["findings"] = [{"kind": "straggler", "ranks": [77], "severity": "warning",
                         "summary": "Rank 77 computes 0.9 s per step", "evidence": {},
                         "fix": "", "impact": 0.4}]
    app = make_app(StaticSource([snap]))
    async with app.run_test(size=(140, 40)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, FleetScreen))
        await pilot.press("t")
        view = app.query_one(RanksView)
        await until(pilot, lambda: view.total == 1024 and bool(view.rows))
        assert view.paged and len(view.rows) < 1024 and view.rows[0].rank == 77
        await pilot.press("end")
        assert view.cursor == 1023
        await until(pilot, lambda: view.current is not None)  # the last page came
        assert view.current.rank == 1023
        await pilot.press("g")
        await until(pilot, lambda: len(rows(app)) == 128)
        assert all(r.folded for r in rows(app))
        assert rows(app)[0].node == "node-009" and rows(app)[0].badge == "STRAGGLER"


def test_every_column_draws_a_missing_figure_as_na_within_its_width():
    blank = RankRow(rank=7, node="node-a", status="active", badge="", step=None, phase=None)
    node = NodeRow(node="node-a", ranks=8, active=8, badge="", folded=True)
    for col in COLUMNS:
        for row in (blank, node):
            text = "".join(seg.text for seg in col.draw(row))
            assert len(text) == col.width + 1, (col.title, text)
        if col.title not in ("rank", "node", "status"):
            assert NA in "".join(seg.text for seg in col.draw(blank)), col.title
    assert len(NA) <= min(c.width for c in COLUMNS)


def test_screens_say_what_they_show():
    for screen in (OverviewScreen(), RankScreen(0, [0]), FabricScreen(), ScalingScreen(),
                   FleetScreen(), NodeScreen("node-a")):
        assert isinstance(screen, SnapshotView), screen
    assert isinstance(RankScreen(0, [0]), RankDetailView)
    assert not isinstance(HelpScreen(), SnapshotView)


def test_replay_speed_and_pause_wake_the_player():
    src = ReplaySource(FIXTURES / "starved.rtop")
    assert src.speed == 1.0 and not src.paused
    src.wake.clear()
    assert src.toggle_pause() and src.paused and src.wake.is_set()
    assert src.faster(2) == 4.0 and src.faster(-10) == 0.25 and src.faster(100) == 64.0
    src.set_speed(3.0)
    assert src.faster(1) == 4.0  # from the nearest step


def test_a_view_inside_another_keeps_the_outer_log_file(tmp_path):
    import logging

    log = logging.getLogger("rtop.test_tui")
    with logs_to_file(tmp_path / "outer.log") as outer:
        with logs_to_file() as inner:
            log.warning("inside both")
        assert inner == outer == tmp_path / "outer.log"
    assert "inside both" in (tmp_path / "outer.log").read_text()
