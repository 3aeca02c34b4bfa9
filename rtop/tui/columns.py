"""The ranks table's columns: title, width, sort, when each is dropped on a narrow
terminal, and how each draws its cell for a rank and for a folded node.

The data/compute/comm shares of the step are a stacked bar whose glyphs differ too, so
it reads without colour (``NO_COLOR``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style

from rtop.fmt import NA, fmt_bytes, fmt_ms, fmt_pct, fmt_rate
from rtop.tui.model import NodeRow, RankRow

#: A cell's text and style.
Cell = tuple[str, Style]

PLAIN, DIM, BOLD = Style(), Style(dim=True), Style(bold=True)
BAR_GLYPHS = (("data", "▒", "yellow"), ("compute", "█", "green"), ("comm", "░", "blue"))
BADGE_STYLE = {badge: Style.parse(style) for badge, style in {
    "HUNG": "bold white on red", "LOST": "bold white on red", "FAILED": "bold white on red",
    "STARVED": "bold red", "MEMWALL": "bold magenta", "STRAGGLER": "bold yellow",
    "THROTTLED": "yellow", "EXITED": "dim", "done": "dim", "ended": "dim",
}.items()}
_LOW = Style.parse("bold magenta")
_SLOW = Style(color="yellow")


@dataclass(frozen=True, kw_only=True)
class Column:
    """A table column: its title, width, what it sorts by, and when it is dropped
    (higher ``drop`` goes first on a narrow terminal). Subclasses draw the cell."""

    title: str
    width: int
    sort: str
    drop: int
    right: bool = True

    def draw(self, row: RankRow | NodeRow) -> list[Segment]:  # pragma: no cover - abstract
        """This column's cell of ``row`` and the space after it."""
        raise NotImplementedError

    def pad(self, text: str, style: Style = PLAIN) -> Segment:
        """``text`` cut or padded to the column's width, and the space after it."""
        text = text if len(text) <= self.width else text[: self.width - 1] + "…"
        return Segment((text.rjust(self.width) if self.right else text.ljust(self.width))
                       + " ", style)


def _no_node_cell(row: NodeRow) -> Cell:
    return "", BOLD


@dataclass(frozen=True, kw_only=True)
class TextColumn(Column):
    """A column of one text per line: ``rank`` draws a rank's cell, ``node`` a folded
    node's (blank unless given)."""

    rank: Callable[[RankRow], Cell]
    node: Callable[[NodeRow], Cell] = _no_node_cell

    def draw(self, row: RankRow | NodeRow) -> list[Segment]:
        """This column's cell of ``row`` and the space after it."""
        text, style = self.node(row) if isinstance(row, NodeRow) else self.rank(row)
        return [self.pad(text, style)]


@dataclass(frozen=True, kw_only=True)
class BarColumn(Column):
    """The step as a stacked bar of data wait, compute and allreduce shares."""

    right: bool = False

    def draw(self, row: RankRow | NodeRow) -> list[Segment]:
        """The bar of ``row`` (a node's has no compute share) and the space after it."""
        return bar_segments(row, self.width)


def bar_segments(row: RankRow | NodeRow, width: int) -> list[Segment]:
    """The step as a stacked bar of data wait, compute and allreduce shares."""
    step = row.step_s
    parts = [row.data_s, row.compute_s if isinstance(row, RankRow) else None, row.comm_s]
    if not step or all(p is None for p in parts):
        return [Segment(NA.ljust(width) + " ", DIM)]
    segs: list[Segment] = []
    used = 0
    for (_, glyph, colour), v in zip(BAR_GLYPHS, parts, strict=True):
        n = round(width * min(1.0, max(0.0, (v or 0.0) / step)))
        n = min(n, width - used)
        if n:
            segs.append(Segment(glyph * n, Style(color=colour)))
            used += n
    segs.append(Segment("·" * (width - used) + " ", DIM))
    return segs


# ---- the cells ------------------------------------------------------------------------------


def _status(r: RankRow) -> Cell:
    label = r.badge or ("ok" if r.status == "active" else r.status)
    return label, BADGE_STYLE.get(r.badge, DIM)


def _node_status(n: NodeRow) -> Cell:
    if n.badge:
        return n.badge, BADGE_STYLE.get(n.badge, BOLD)
    return f"{n.active}/{n.ranks} up", BOLD


def _memory(r: RankRow) -> Cell:
    if r.mem_used is None:
        return NA, PLAIN
    return f"{fmt_bytes(r.mem_used)}/{fmt_bytes(r.mem_total)}".replace(" ", ""), PLAIN


def _free(r: RankRow) -> Cell:
    low = r.headroom is not None and r.headroom < 0.1
    return fmt_pct(r.headroom, 100), _LOW if low else PLAIN


def _power(r: RankRow) -> Cell:
    if r.power_w is None:
        return NA, PLAIN
    return f"{r.power_w:.0f}/" + (f"{r.power_limit_w:.0f}W" if r.power_limit_w else "W"), PLAIN


def _clock(r: RankRow) -> Cell:
    if r.clock_mhz is None:
        return NA, PLAIN
    top = r.clock_max_mhz
    slow = bool(top) and r.clock_mhz < 0.9 * (top or 0.0)
    return f"{r.clock_mhz:.0f}/" + (f"{top:.0f}" if top else "?"), _SLOW if slow else PLAIN


COLUMNS: tuple[Column, ...] = (
    TextColumn(title="rank", width=5, sort="rank", drop=0,
               rank=lambda r: (str(r.rank), BOLD),
               node=lambda n: (("▸" if n.folded else "▾") + f"{n.ranks:>3}", BOLD)),
    TextColumn(title="node", width=12, sort="node", drop=1, right=False,
               rank=lambda r: (r.node, DIM), node=lambda n: (n.node, BOLD)),
    TextColumn(title="status", width=10, sort="status", drop=0, right=False,
               rank=_status, node=_node_status),
    TextColumn(title="step", width=7, sort="step", drop=6,
               rank=lambda r: (NA if r.step is None else str(r.step), DIM)),
    TextColumn(title="step ms", width=8, sort="step ms", drop=0,
               rank=lambda r: (fmt_ms(r.step_s), PLAIN),
               node=lambda n: (fmt_ms(n.step_s), BOLD)),
    BarColumn(title="data▒ compute█ comm░", width=20, sort="data", drop=2),
    TextColumn(title="comm ms", width=8, sort="comm", drop=5,
               rank=lambda r: (fmt_ms(r.comm_s), PLAIN),
               node=lambda n: (fmt_ms(n.comm_s), BOLD)),
    TextColumn(title="busbw", width=10, sort="busbw", drop=3,
               rank=lambda r: (fmt_rate(r.busbw), PLAIN),
               node=lambda n: (fmt_rate(n.busbw), BOLD)),
    TextColumn(title="GPU", width=5, sort="GPU", drop=3,
               rank=lambda r: (fmt_pct(r.gpu_util), PLAIN)),
    TextColumn(title="memory", width=17, sort="memory", drop=4, rank=_memory),
    TextColumn(title="free", width=5, sort="free", drop=2, rank=_free),
    TextColumn(title="power", width=10, sort="power", drop=7, rank=_power),
    TextColumn(title="clock MHz", width=11, sort="clock", drop=8, rank=_clock),
)


def fit_columns(width: int) -> list[Column]:
    """The columns that fit ``width`` cells, dropping the least important first."""
    cols = list(COLUMNS)
    while sum(c.width + 1 for c in cols) > width and any(c.drop for c in cols):
        worst = max(cols, key=lambda c: c.drop)
        cols.remove(worst)
    return cols


def row_segments(row: RankRow | NodeRow, cols: list[Column]) -> list[Segment]:
    """One table line: each column draws its own cell."""
    return [seg for c in cols for seg in c.draw(row)]
