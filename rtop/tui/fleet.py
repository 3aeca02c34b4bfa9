"""The fleet view, the first screen of a large job: every rank on one screen, outliers
first.

A heatmap of the fleet (:class:`~rtop.tui.heatmap.FleetMap`) laid out by node (lines) and
local rank (columns), coloured and shaped by the chosen figure's deviation from the
fleet's median; beside it the costliest findings and the top outlier ranks; under it
what the cursor is on, and one line of distribution per figure (p50, p95, p99, the worst
and its rank). The data is the hub's view (``snap["fleet"]``): one byte per rank and
figure, so a fleet of 16,384 ranks costs what a screenful does.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from rtop.analysis.viewport import (
    HEAT,
    NOT_MEASURED,
    OUTLIER_FROM,
    TOP_K,
    HeatFigure,
    ViewRequest,
)
from rtop.fmt import NA, fmt_ms, fmt_pct, fmt_ranks, num, safe_text
from rtop.run.snapshot import FigureStats, Snapshot
from rtop.tui.findings import SEVERITY_STYLE
from rtop.tui.fleetmap import BAND_FROM, DOWN_GLYPH, GLYPHS, FleetData, Fold, fmt_dev
from rtop.tui.header import JobHeader
from rtop.tui.heatmap import CODE_STYLES, FleetMap
from rtop.tui.messages import ViewChanged
from rtop.tui.model import RankRow, rank_rows
from rtop.tui.overview import OverviewScreen

#: What ``z`` steps through: fold when the ranks do not fit, every rank, every node.
FOLDS: tuple[Fold, ...] = ("auto", "ranks", "nodes")
#: How each unit of a figure prints.
UNIT_FMT = {"ms": lambda v: NA if v is None else f"{fmt_ms(v)}ms",
            "mhz": lambda v: NA if v is None else f"{v:.0f}MHz",
            "pct": lambda v: fmt_pct(v, 100)}
SHORT = {"step_s": "step", "data_wait_s": "data wait", "compute_s": "compute",
         "comm_exposed_s": "exp. comm", "gpu_sm_clock_mhz": "GPU clock",
         "headroom_ratio": "headroom"}


def fmt_value(h: HeatFigure, v: float | None) -> str:
    """A figure's value in its unit."""
    return UNIT_FMT[h.unit](v)


def per_what(h: HeatFigure) -> str:
    """What a deviation of ``h`` is a share of."""
    return {"step": "of the median step", "own": "of the median",
            "points": "points of capacity"}[h.per]


class FleetScreen(Screen[None]):
    """The whole fleet at a glance (a :class:`~rtop.tui.protocols.SnapshotView`)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "app.quit", "quit"),
        Binding("question_mark", "app.help", "help"),
        Binding("c", "figure(1)", "figure"),
        Binding("C", "figure(-1)", "figure back", show=False),
        Binding("z", "fold", "fold"),
        Binding("n", "node", "node's ranks"),
        Binding("t", "table", "table"),
        Binding("f", "app.fabric", "fabric"),
        Binding("e", "app.scaling", "scaling", show=False),
        Binding("b", "app.act('probe')", "probe links", show=False),
        Binding("k", "app.act('stacks')", "stacks", show=False),
        Binding("colon", "app.goto", "go to", show=False),
        Binding("escape", "close_goto", "close", show=False),
    ]
    DEFAULT_CSS = """
    FleetScreen #legend { height: 1; padding: 0 1; }
    FleetScreen #body { height: 1fr; }
    FleetScreen #side { width: 32; padding: 0 0 0 1; }
    FleetScreen #where { height: 1; padding: 0 1; background: $boost; }
    FleetScreen #dists { height: 7; padding: 0 1; }
    FleetScreen Static { text-wrap: nowrap; text-overflow: ellipsis; }
    FleetScreen #goto { dock: bottom; height: 3; }
    FleetScreen .hidden { display: none; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.snapshot: Snapshot | None = None
        self.data: FleetData | None = None
        self.figure = 0
        self._picked = False  # the figure was chosen (by the first outlier, or a key)
        self.fold: Fold = "auto"
        self._rows: dict[int, RankRow] = {}  # the rows the snapshot holds, by rank
        self._texts: dict[str, Text] = {}  # what each text widget shows
        self._asked: ViewRequest | None = None  # the view last asked for
        self._drawn = False

    def compose(self) -> ComposeResult:
        """Header, legend, the map beside the findings and outliers, the cursor's line,
        the distributions."""
        yield JobHeader()
        yield Static("", id="legend")
        with Horizontal(id="body"):
            yield FleetMap(id="map")
            yield Static("", id="side")
        yield Static("", id="where")
        yield Static("", id="dists")
        yield Input(placeholder="go to: 90 · 5:30 · 1:02:03 · step 1200", id="goto",
                    classes="hidden")
        yield Footer()

    def open_goto(self) -> None:
        """Open the go-to box (a replay's)."""
        box = self.query_one("#goto", Input)
        box.remove_class("hidden")
        box.focus()

    def action_close_goto(self) -> None:
        """Escape: close the go-to box."""
        box = self.query_one("#goto", Input)
        box.value = ""
        box.add_class("hidden")
        self.query_one(FleetMap).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Ask the app to go to the time or step typed."""
        event.stop()
        self.action_close_goto()
        self.post_message(OverviewScreen.GotoRequested(event.value))

    def on_mount(self) -> None:
        """The map has the focus; draw what came before the widgets existed."""
        self.query_one(FleetMap).focus()
        self._drawn = True
        if self.snapshot is not None:
            self.show_snapshot(self.snapshot)

    def _side_width(self) -> int:
        return 40 if self.size.width >= 120 else 32

    def on_resize(self) -> None:
        """A wider side panel when there is room."""
        self.query_one("#side").styles.width = self._side_width()
        self._show_text()

    def on_screen_resume(self) -> None:
        """Back here: ask for this screen's rows again."""
        self._ask(again=True)

    # ---- data in ------------------------------------------------------------------------

    def show_snapshot(self, snap: Snapshot) -> None:
        """Draw a new snapshot (a view's: ``snap["fleet"]``)."""
        self.snapshot = snap
        if not self._drawn:
            return
        self.query_one(JobHeader).show(snap)
        data = FleetData.of(snap)
        if data is None:
            return
        self.data = data
        self._rows = {r.rank: r for r in rank_rows(snap)}
        if not self._picked and data.outliers:  # open on the figure that stands out
            self._picked = True
            worst = data.outliers[0]["figure"]
            self.figure = data.figures.index(worst) if worst in data.figures else 0
        self.figure %= max(1, len(data.figures))
        self.query_one(FleetMap).show(data, self.figure, self.fold)
        self._show_text()
        self._ask()

    def _ask(self, again: bool = False) -> None:
        """Ask the app for this screen's view if it changed (the cursor's node)."""
        want = self.view_request()
        if again or want != self._asked:
            self._asked = want
            self.post_message(ViewChanged())

    def view_request(self) -> ViewRequest:
        """The rows this screen shows: the cursor's node's ranks, and the outliers."""
        _, node = self.query_one(FleetMap).under() if self._drawn else (None, None)
        return ViewRequest(nodes=(node,) if node else (), top=TOP_K)

    def heat(self) -> HeatFigure:
        """The figure the map shows."""
        return self.data.figure(self.figure) if self.data is not None else HEAT[0]

    # ---- text -----------------------------------------------------------------------------

    def _show_text(self) -> None:
        d = self.data
        if d is None:
            return
        h = self.heat()
        self._put("#legend", self._legend(h, d))
        self._put("#side", self._side(d, h))
        self._put("#where", self._where(d, h))
        self._put("#dists", self._dists(d))

    def _put(self, widget: str, text: Text) -> None:
        """Update a text that changed (an unchanged one is not painted again)."""
        if self._texts.get(widget) != text:
            self._texts[widget] = text
            self.query_one(widget, Static).update(text)

    def _legend(self, h: HeatFigure, d: FleetData) -> Text:
        """The figure, the glyphs' bands, and (room permitting) what a cell is."""
        m = self.query_one(FleetMap).map
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f" {h.label} ", "bold reverse")
        t.append(" ")
        lo = 0
        for i, g in enumerate(GLYPHS):
            hi = BAND_FROM[i] if i < len(BAND_FROM) else None
            t.append(g, CODE_STYLES[i])
            t.append(f"<{hi} " if lo == 0 else (f"{lo}-{hi} " if hi else f"≥{lo}"))
            lo = hi or lo
        t.append("%" if h.per != "points" else " pt")
        t.append(" worse ", "dim")
        t.append(DOWN_GLYPH, CODE_STYLES[6])
        t.append("down", "dim")
        what = (f"  {len(d.nodes)} nodes, a cell each (its worst rank)"
                if m is not None and m.folded else f"  {d.n} ranks: node × local rank")
        if len(t) + len(what) <= self.size.width - 2:
            t.append(what, "dim")
        return t

    def _side(self, d: FleetData, h: HeatFigure) -> Text:
        snap = self.snapshot
        findings = snap["findings"] if snap is not None else []
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append("findings, costliest first\n", "bold underline")
        if not findings:
            t.append("✓ none\n", "green")
        for f in findings[:3]:
            glyph, style = SEVERITY_STYLE.get(f["severity"], ("?", ""))
            t.append(f"{glyph} ", style)
            t.append(f"{f['kind']} ", "bold")
            ranks = f["ranks"]
            t.append(("every rank" if ranks and len(ranks) >= d.n else
                      fmt_ranks(ranks)[:40] or "the job") + "\n", "dim")
        if len(findings) > 3:
            t.append(f"  +{len(findings) - 3} more (t: table)\n", "dim")
        t.append("outliers\n", "bold underline")
        if not d.outliers:
            t.append(f"none {OUTLIER_FROM:.0%} worse than the median\n", "dim")
        room = self._side_width() - 1
        names = {x: i for i, x in enumerate(d.nodes)}
        for o in d.outliers:
            of = next((x for x in HEAT if x.name == o["figure"]), h)
            t.append(f"{o['rank']:>5} ", "bold")
            t.append(f"{SHORT.get(o['figure'], o['figure']):<9} {fmt_dev(o['dev'] * 100, of):>6}")
            left = room - 22
            node = safe_text(o["node"], 60)
            if left >= 6:
                t.append(" " + (node if len(node) <= left else
                                f"node #{names.get(o['node'], '?')}"), "dim")
            t.append("\n")
        return t

    def _where(self, d: FleetData, h: HeatFigure) -> Text:
        fmap = self.query_one(FleetMap)
        rank, node = fmap.under()
        t = Text(no_wrap=True, overflow="ellipsis")
        if node is None:
            return t
        ni = d.nodes.index(node)
        members = d.node_ranks(ni)
        fig = self.figure
        worst, med = int(d.node_worst[fig][ni]), int(d.node_median[fig][ni])
        if rank is None:
            t.append(safe_text(node, 40), "bold")
            t.append(f"  ranks {fmt_ranks(d.ranks[members].tolist())}  ")
            t.append(f"{h.label}: median {fmt_dev(med, h)}, worst {fmt_dev(worst, h)} "
                     f"{per_what(h)}")
            t.append("  enter: its ranks", "dim")
            return t
        i = int(np.flatnonzero(d.ranks == rank)[0])
        q = int(d.heat[fig][i])
        row = self._rows.get(rank)
        value = getattr(row, h.name, None) if row is not None else None
        t.append(f"rank {rank}", "bold")
        t.append(f"  {safe_text(node, 40)} local {int(d.local[i])}  ")
        t.append(f"{h.label} {fmt_value(h, value) if row is not None else '…'} ")
        t.append(f"({fmt_dev(q, h)} {per_what(h)})" if q != NOT_MEASURED else "(n/a)",
                 "bold" if q >= BAND_FROM[1] else "")
        if row is not None and row.badge:
            t.append(f"  {row.badge}", "bold yellow")
        t.append("  enter: detail · n: node", "dim")
        return t

    def _dists(self, d: FleetData) -> Text:
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f"{'':11}{'p50':>9}{'p95':>9}{'p99':>9}{'worst':>9}{'rank':>7}", "bold")
        t.append("  p95, p99: the worse side (low for clock, headroom)", "dim")
        for i, s in enumerate(d.stats):
            h = d.figure(i)
            mark = "▸" if i == self.figure else " "
            t.append("\n")
            t.append(f"{mark}{SHORT.get(h.name, h.label):<10}",
                     "bold reverse" if i == self.figure else "bold")
            t.append(self._stat_line(h, s))
        return t

    @staticmethod
    def _stat_line(h: HeatFigure, s: FigureStats) -> str:
        if not s["n"]:
            return f"{'not measured':>36}"
        vals = "".join(f"{fmt_value(h, num(s[k])):>9}" for k in ("p50", "p95", "p99", "worst"))
        return vals + f"{s['worst_rank'] if s['worst_rank'] is not None else NA:>7}"

    # ---- keys ---------------------------------------------------------------------------

    def action_figure(self, delta: int) -> None:
        """Colour the map by the next (or previous) figure."""
        self._picked = True
        n = len(self.data.figures) if self.data is not None else len(HEAT)
        self.figure = (self.figure + delta) % max(1, n)
        self._redraw()

    def action_fold(self) -> None:
        """Fold by node when the ranks do not fit (auto), always show ranks, always
        nodes."""
        self.fold = FOLDS[(FOLDS.index(self.fold) + 1) % len(FOLDS)]
        self._redraw()
        self.notify(f"fleet map: {self.fold}", timeout=1.5)

    def _redraw(self) -> None:
        if self.data is not None:
            self.query_one(FleetMap).show(self.data, self.figure, self.fold)
            self._show_text()

    def action_table(self) -> None:
        """Back to the ranks table (the screen under this one)."""
        self.app.pop_screen()

    def action_node(self) -> None:
        """The cursor's node's ranks."""
        _, node = self.query_one(FleetMap).under()
        if node is not None:
            self.post_message(FleetMap.Opened(None, node))

    def on_fleet_map_moved(self, event: FleetMap.Moved) -> None:
        """Say what the cursor is on, and ask for its node's rows."""
        if self.data is not None:
            self._put("#where", self._where(self.data, self.heat()))
        self._ask()
