"""The fleet view and the view a viewer asks the hub for (issue 29).

A simulated fleet (``rtop.fleetsim``: 256 ranks in nodes of 8, one node slowed by a
third from 30 s in) is written as a recording, replayed through the real state and
diagnosis, and shown by the real app under Pilot; the views are built by the same code
the hub runs (``rtop.analysis.viewport``) and, at the end, asked of a live hub.
"""

from __future__ import annotations

import io
import time
from typing import Any, cast

import numpy as np
import pytest
from rich.console import Console

from collectors import wire
from rtop.analysis.viewport import (
    HEAT,
    MAX_ROWS,
    SORTS,
    Fleet,
    Page,
    Viewports,
    ViewRequest,
    decode,
    viewport,
)
from rtop.client import HubClient
from rtop.fleetsim import FleetSpec, write_recording
from rtop.hub.service import ThreadedHub
from rtop.run.snapshot import Snapshot
from rtop.tui.app import RtopApp, make_app
from rtop.tui.detail import RankScreen
from rtop.tui.fleet import FleetScreen
from rtop.tui.fleetmap import BAND_FROM, DOWN, GLYPHS, FleetData
from rtop.tui.heatmap import FleetMap
from rtop.tui.model import parse_filter, rank_rows, sort_rows
from rtop.tui.node_view import NodeScreen
from rtop.tui.overview import OverviewScreen
from rtop.tui.ranks import RanksView
from rtop.tui.source import ReplaySource, StaticSource
from tests.rankclient import RankClient, step_row

RANKS = 256


@pytest.fixture(scope="module")
def slow_node(tmp_path_factory) -> tuple[Snapshot, list[int], str]:
    """A 256-rank run with a slow node, 58 s in (28 s after the node slowed): the full
    snapshot, the node's ranks and its name."""
    path = tmp_path_factory.mktemp("fleet") / "slow_node.rtop"
    truth = write_recording(path, FleetSpec(ranks=RANKS, seed=11, duration_s=60.0),
                            "slow_node")
    (fault,) = truth.faults
    snap, _ = ReplaySource(path).snapshot_at(58.0)
    return snap, fault.ranks, fault.nodes[0]


async def until(pilot, cond, timeout: float = 15.0) -> None:
    """Let the app run until ``cond()`` holds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the UI"
        await pilot.pause(0.05)


async def opened(pilot, app: RtopApp) -> FleetMap:
    """Wait for the fleet view and its first drawing; its map."""
    await until(pilot, lambda: isinstance(app.screen, FleetScreen))
    fmap = app.screen.query_one(FleetMap)
    await until(pilot, lambda: fmap.map is not None)
    await pilot.pause(0.3)  # the screen's other widgets painted
    return fmap


def screen_text(app: RtopApp) -> str:
    """What the terminal shows, as text."""
    w, h = app.size
    console = Console(width=w, height=h, file=io.StringIO(), record=True, color_system=None)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))
    return console.export_text()


def line_text(fmap: FleetMap, line: int) -> str:
    """One line of the map as drawn (scrolled to the top)."""
    return "".join(seg.text for seg in fmap.render_line(line))


# ---- the fleet view -------------------------------------------------------------------------


async def test_the_slow_node_is_the_shape_on_the_map(slow_node):
    snap, slow, node = slow_node
    app = make_app(StaticSource([snap]))
    async with app.run_test(size=(120, 40)) as pilot:
        fmap = await opened(pilot, app)
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        # it opens on the figure that stands out: a slow node computes longer
        assert HEAT[screen.figure].name == "compute_s"
        data = fmap.data
        assert data is not None and not fmap.map.folded and data.n == RANKS
        bands = fmap.codes
        is_slow = np.isin(data.ranks, slow)
        assert (bands[is_slow] >= 3).all(), bands[is_slow]  # ▓ or █: 12 % of a step or more
        assert (bands[~is_slow] <= 1).all()  # the healthy: within 6 %
        # ... and drawn as one bar: the node's line holds its glyphs, side by side
        line, xs = fmap.map.at[np.flatnonzero(is_slow)].T
        assert len(set(line.tolist())) == 1 and xs.max() - xs.min() == len(slow) - 1
        drawn = line_text(fmap, int(line[0]))
        label = len(str(int(data.ranks.max()))) + 1
        cells = drawn[label + xs.min():label + xs.max() + 1]
        assert set(cells) <= {GLYPHS[3], GLYPHS[4]}, drawn
        assert set(drawn[label:].replace(cells, "")) <= {GLYPHS[0], GLYPHS[1], " "}
        text = screen_text(app)
        assert node in text  # named among the outliers
        assert "straggler" in text


async def test_arrows_move_and_enter_reaches_the_node_then_the_rank(slow_node):
    snap, slow, node = slow_node
    app = make_app(StaticSource([snap], interval_s=0.2))
    async with app.run_test(size=(120, 40)) as pilot:
        fmap = await opened(pilot, app)
        data = fmap.data
        assert data is not None
        await pilot.press("home")
        assert fmap.under() == (int(data.ranks[0]), data.nodes[0])
        await pilot.press("right")
        assert fmap.under()[0] == int(data.ranks[1])
        await pilot.press("down")
        below = fmap.under()[0]
        assert below is not None and below == int(data.ranks[1]) + 8 * fmap.map.per_line
        # fold to nodes (z: auto -> ranks -> nodes), walk to the slow node, enter
        await pilot.press("z", "z")
        assert fmap.map.folded and fmap.under() == (None, data.nodes[below // 8])
        await pilot.press("home")
        target = data.nodes.index(node)
        line, x = (int(v) for v in fmap.map.at[target])
        await pilot.press(*["down"] * line)
        await pilot.press(*["right"] * int(np.count_nonzero(fmap.map.grid[line, :x] >= 0)))
        assert fmap.under() == (None, node)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, NodeScreen))
        table = app.screen.query_one(RanksView)
        await until(pilot, lambda: len(table.rows) == len(slow))
        assert sorted(r.rank for r in table.rows) == sorted(slow)
        assert table.rows[0].badge == "STRAGGLER"
        first = table.rows[0].rank
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, RankScreen))
        assert app.screen.rank == first and app.source.detail_rank == first
        await pilot.press("escape", "escape")
        await until(pilot, lambda: isinstance(app.screen, FleetScreen))
        # unfolded, enter on a rank opens its detail at once
        await pilot.press("z", "z")
        await pilot.press("home", "right")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, RankScreen))
        assert app.screen.rank == int(data.ranks[1])


async def test_the_figure_key_cycles_through_every_figure(slow_node):
    snap = slow_node[0]
    app = make_app(StaticSource([snap]))
    async with app.run_test(size=(120, 40)) as pilot:
        fmap = await opened(pilot, app)
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        start = screen.figure
        seen = []
        for _ in HEAT:
            await pilot.press("c")
            seen.append(screen.figure)
            assert fmap.figure == screen.figure
            legend = str(screen.query_one("#legend").render())
            assert HEAT[screen.figure].label in legend
        assert sorted(seen) == list(range(len(HEAT))) and seen[-1] == start
        await pilot.press("C")
        assert screen.figure == (start - 1) % len(HEAT)
        # on step time a synchronous fleet is flat: nothing stands out
        while HEAT[screen.figure].name != "step_s":
            await pilot.press("c")
        assert (fmap.codes <= 1).all()


async def test_no_color_at_80x24_keeps_the_glyphs_and_fits(slow_node, monkeypatch):
    snap, slow, node = slow_node
    monkeypatch.setenv("NO_COLOR", "1")
    app = make_app(StaticSource([snap]))
    assert app.no_color
    async with app.run_test(size=(80, 24)) as pilot:
        fmap = await opened(pilot, app)
        screen = app.screen
        await until(pilot, lambda: "outliers" in screen_text(app)
                    and "quit" in screen_text(app).splitlines()[-1])
        text = screen_text(app)
        lines = text.splitlines()
        assert len(lines) <= 24 and all(len(x) <= 80 for x in lines)
        legend = str(screen.query_one("#legend").render())
        for glyph in (*GLYPHS, "×"):
            assert glyph in legend, glyph
        for h in ("step", "data wait", "compute", "exp. comm", "GPU clock", "headroom"):
            assert h in text, h  # every distribution line is on screen
        assert "findings" in text and "outliers" in text
        assert "quit" in lines[-1]  # the footer, on the last line
        # the map fits its widget, and the slow node still stands out by its glyphs
        m, data = fmap.map, fmap.data
        assert m is not None and data is not None
        label = len(str(int(data.ranks.max()))) + 1
        assert m.width + label <= fmap.size.width
        items = [data.nodes.index(node)] if m.folded else \
            np.flatnonzero(np.isin(data.ranks, slow)).tolist()
        for item in items:
            line, x = (int(v) for v in m.at[item])
            assert line < fmap.size.height  # on screen without scrolling
            assert line_text(fmap, line)[label + x] in (GLYPHS[3], GLYPHS[4])
        assert app.screen.query_one("#dists").region.bottom <= 23  # above the footer


async def test_a_small_job_opens_on_the_table(tmp_path, monkeypatch):
    path = tmp_path / "four.rtop"
    write_recording(path, FleetSpec(ranks=4, per_node=2, seed=1, duration_s=12.0))
    snap, _ = ReplaySource(path).snapshot_at(10.0)
    app = make_app(StaticSource([snap]))
    async with app.run_test(size=(120, 32)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 1)
        await pilot.pause(0.3)
        assert isinstance(app.screen, OverviewScreen)
        assert not any(isinstance(s, FleetScreen) for s in app.screen_stack)
        assert len(app.query_one(RanksView).rows) == 4  # every row, sorted in the UI
    # and the setting moves the threshold both ways
    monkeypatch.setenv("RTOP_FLEET_ABOVE", "2")
    app = make_app(StaticSource([snap]))
    assert app.fleet_above == 2
    async with app.run_test(size=(120, 32)) as pilot:
        await opened(pilot, app)
        await pilot.press("t")
        await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
        await pilot.press("v")
        await until(pilot, lambda: isinstance(app.screen, FleetScreen))


async def test_the_setting_keeps_a_large_job_on_the_table(slow_node, monkeypatch):
    monkeypatch.setenv("RTOP_FLEET_ABOVE", "1000")
    app = make_app(StaticSource([slow_node[0]]))
    async with app.run_test(size=(120, 32)) as pilot:
        await until(pilot, lambda: app.snapshots_seen > 1)
        await pilot.pause(0.3)
        assert isinstance(app.screen, OverviewScreen)
        view = app.query_one(RanksView)
        await until(pilot, lambda: view.total == RANKS)
        assert view.paged and view.rows[0].badge == "STRAGGLER"


# ---- the view ------------------------------------------------------------------------------


def wire_size(snap: Snapshot) -> int:
    return len(wire.encode(wire.KIND_SNAPSHOT, snap))


def test_a_view_holds_the_rows_asked_for_and_the_aggregates(slow_node):
    snap, slow, node = slow_node
    req = ViewRequest(ranks=(3, 200), nodes=("node-00002",), top=5, whole_up_to=0,
                      pages={"table": Page(sort="compute_s", offset=10, limit=20)})
    view = viewport(snap, req)
    fleet = view["fleet"]
    assert fleet["partial"] and fleet["ranks"] == RANKS
    page = fleet["pages"]["table"]
    assert page["offset"] == 10 and page["total"] == RANKS and len(page["ranks"]) == 20
    outliers = [o["rank"] for o in fleet["outliers"]]
    assert len(outliers) == 5 and set(outliers) <= set(slow)
    wanted = {3, 200, *range(16, 24), *page["ranks"], *outliers}
    assert set(view["ranks"]["rank"]) == wanted  # those rows, and no other
    assert all(len(col) == len(wanted) for col in view["ranks"].values())
    # every rank in a few bytes, the nodes folded, the distributions over the fleet
    arrays = decode(fleet)
    assert arrays["order"].tolist() == snap["ranks"]["rank"]
    assert arrays["local"].tolist() == snap["ranks"]["local_rank"]
    at = fleet["nodes"].index(node)
    compute = fleet["figures"].index("compute_s")
    assert arrays["node_worst"][compute][at] >= BAND_FROM[2]
    assert arrays["node_median"][compute][at] >= BAND_FROM[2]
    others = np.delete(arrays["node_median"][compute], at)
    assert (others < BAND_FROM[0]).all()
    values = np.array([v for v in snap["ranks"]["compute_s"] if v is not None])
    stats = fleet["stats"][compute]
    assert stats["n"] == len(values)
    assert stats["p50"] == pytest.approx(float(np.median(values)))
    assert stats["p99"] == pytest.approx(float(np.percentile(values, 99)))
    assert stats["worst"] == pytest.approx(values.max())
    assert stats["worst_rank"] in slow
    assert wire_size(view) < wire_size(snap) / 3
    # a fleet small enough is sent whole
    assert not viewport(snap, ViewRequest(whole_up_to=RANKS))["fleet"]["partial"]


def test_the_hubs_pages_are_the_uis_order(slow_node):
    """Each sort key (both ways) and the filter page the table as the UI sorts the whole
    of it (``rtop.tui.model``)."""
    snap = slow_node[0]
    fleet = Fleet(snap)
    rows = rank_rows(snap)
    for key in SORTS:
        for reverse in (False, True):
            want = [r.rank for r in sort_rows(rows, key, reverse)]
            got = fleet.page(Page(sort=key, reverse=reverse, limit=RANKS))["ranks"]
            assert got == want, (key, reverse)
    for text in ("straggler", "node-0000", "3 10-12", "lost", "zzz"):
        keep = parse_filter(text)
        want = [r.rank for r in sort_rows([r for r in rows if keep(r)])]
        page = fleet.page(Page(filter=text, limit=RANKS))
        assert page["ranks"] == want and page["total"] == len(want), text


def tile(snap: Snapshot, times: int) -> Snapshot:
    """A fleet ``times`` as large, made of copies of a real one's rows (each copy its
    own ranks and nodes)."""
    cols = cast(dict[str, list[Any]], snap["ranks"])
    n = len(cols["rank"])
    out: dict[str, list[Any]] = {k: [] for k in cols}
    for t in range(times):
        for k, col in cols.items():
            if k == "rank":
                out[k] += [r + t * n for r in col]
            elif k == "node":
                out[k] += [f"{x}-{t:03d}" for x in col]
            else:
                out[k] += col
    big = cast(Snapshot, dict(snap))
    big["ranks"] = cast(Any, out)
    return big


def test_a_view_of_16384_ranks_is_under_a_megabyte(slow_node):
    big = tile(slow_node[0], 16384 // RANKS)
    assert len(big["ranks"]["rank"]) == 16384
    full = wire_size(big)
    # what a viewer asks at most: a table page, a node, some ranks, outliers
    req = ViewRequest(ranks=tuple(range(0, 16384, 64)), nodes=("node-00007-063",),
                      top=64, whole_up_to=0,
                      pages={"table": Page(limit=256), "fabric": Page(sort="busbw_Bps",
                                                                         limit=256)})
    view = viewport(big, req)
    size = wire_size(view)
    assert size <= 1_000_000, size
    assert full > 4 * size  # what every viewer got before
    assert len(view["ranks"]["rank"]) <= MAX_ROWS
    assert FleetData.of(view) is not None  # and it decodes
    # the worst a request can ask for still fits: every limit at its most
    greedy = ViewRequest.parse({"ranks": list(range(5000)), "nodes": [f"node-{i:05d}-000"
                                                                        for i in range(99)],
                                "top": 10_000, "whole_up_to": 0,
                                "pages": {str(i): {"limit": 10_000} for i in range(9)}})
    assert wire_size(viewport(big, greedy)) <= 1_000_000


def test_views_are_rebuilt_no_more_often_than_their_cost_allows(slow_node):
    """The hub's view cache: a cheap fleet is rebuilt every max_age_s; one that takes
    long to build (16,384 ranks) waits until its building is under ``share`` of the
    core, whatever the number of viewers; clear() (the job ended) rebuilds at once."""
    snap = slow_node[0]
    builds: list[float] = []

    def build(delay: float) -> Snapshot:
        builds.append(time.monotonic())
        time.sleep(delay)
        return snap

    views = Viewports(max_age_s=0.05, share=0.2)
    views.frame({}, lambda: build(0.0))
    assert views.age_s < 0.5  # 256 ranks: a few ms a build, near the floor
    t_end = time.monotonic() + 0.6
    while time.monotonic() < t_end:  # two viewers asking as fast as they can
        views.frame({"top": 3}, lambda: build(0.0))
        views.frame({}, lambda: build(0.0))
        time.sleep(0.005)
    gaps = np.diff(builds)
    assert len(builds) >= 2 and gaps.min() >= 0.05, builds  # rebuilt, never sooner
    slow = Viewports(max_age_s=0.05, share=0.2)
    builds.clear()
    slow.frame({}, lambda: build(0.1))
    assert slow.cost_s >= 0.1 and slow.age_s >= 0.5  # 0.1 s a build, at most 20 %
    t_end = time.monotonic() + 0.4
    while time.monotonic() < t_end:
        slow.frame({}, lambda: build(0.1))
        time.sleep(0.01)
    assert len(builds) == 1, builds  # still the first fleet
    slow.clear()
    slow.frame({}, lambda: build(0.0))
    assert len(builds) == 2


def test_a_malformed_view_is_read_as_far_as_it_makes_sense():
    assert ViewRequest.parse(None) == ViewRequest()
    assert ViewRequest.parse([1, 2]) == ViewRequest()
    req = ViewRequest.parse({"ranks": [1, "x", True, 2**40, 5], "nodes": ["a", 3],
                             "top": -4, "every": "yes",
                             "pages": {"t": {"sort": "nope", "limit": 10**9, "offset": -3,
                                             "filter": 7}, 5: {}}})
    assert req.ranks == (1, 5) and req.nodes == ("a",) and req.top == 0 and not req.every
    assert list(req.pages) == ["t"]
    page = req.pages["t"]
    assert page.sort == "worst" and page.limit == 256 and page.offset == 0 and \
        page.filter == ""
    assert ViewRequest.parse(req.to_wire()) == req


def test_a_lost_rank_is_a_cross_on_the_map(slow_node):
    snap = cast(Snapshot, dict(slow_node[0]))
    cols = dict(snap["ranks"])
    status = list(cols["status"])
    status[5] = "lost"
    cols["status"] = status
    snap["ranks"] = cast(Any, cols)
    data = FleetData.of(viewport(snap))
    assert data is not None
    assert data.rank_codes(0)[5] == DOWN and data.node_codes(0)[0] == DOWN


# ---- a live hub ---------------------------------------------------------------------------


def test_a_live_hub_answers_a_view(tmp_path):
    hub = ThreadedHub(job="views", token="t").start()
    ranks = []
    try:
        for r in range(4):
            rk = RankClient(hub.address, hub.token, r, world=4)
            assert rk.recv().kind == wire.KIND_WELCOME
            rk.batch(steps=[step_row(k, step_s=0.05 if r != 2 else 0.08) for k in range(6)])
            ranks.append(rk)
        with HubClient(hub.address, hub.token) as viewer:
            req = ViewRequest(ranks=(1,), top=1, whole_up_to=0,
                              pages={"table": Page(sort="step_s", limit=2)})
            deadline = time.monotonic() + 10
            while True:
                view = viewer.snapshot(req)
                if view["fleet"]["ranks"] == 4 and view["fleet"]["pages"]["table"][
                        "ranks"][:1] == [2]:
                    break
                assert time.monotonic() < deadline, view["fleet"]
                time.sleep(0.1)
            assert hub.hub is not None and hub.hub.viewports._fleet is not None  # the hub's
            assert view["fleet"]["partial"]
            assert set(view["ranks"]["rank"]) == {1, 2, *view["fleet"]["pages"]["table"][
                "ranks"]}
            # what a garbage view gets: the default view
            frame = hub.hub.viewports.frame({"ranks": "all", "pages": 3}, hub.hub.snapshot)
            assert "fleet" in wire.decode_body(frame[wire.HEADER_BYTES:]).payload
            # without a view: every rank, as every viewer got before (rtop status --json)
            full = viewer.snapshot()
            assert "fleet" not in full and sorted(full["ranks"]["rank"]) == [0, 1, 2, 3]
    finally:
        for rk in ranks:
            rk.close()
        hub.stop()
