"""The ranks table's columns: title, width, sort, when each is dropped on a narrow
terminal, and how each draws its cell for a rank and for a folded node.

After rank, node and status, the columns are the figures' (``collectors.figures``:
label, width, format, place and when dropped), each sorted by its figure's name.

The data/compute/comm shares of the step are a stacked bar whose glyphs differ too, so
it reads without colour (``NO_COLOR``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from rich.segment import Segment
from rich.style import Style

from collectors.figures import Figure, Format, figures
from rtop.fmt import NA, fixed, fmt_bytes, fmt_ms, fmt_pct, fmt_rate
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
    parts = [row.data_wait_s, row.compute_s if isinstance(row, RankRow) else None, row.comm_s]
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
    if r.mem_used_bytes is None:
        return NA, PLAIN
    return f"{fmt_bytes(r.mem_used_bytes)}/{fmt_bytes(r.mem_capacity_bytes)}".replace(
        " ", ""), PLAIN


def _free(r: RankRow) -> Cell:
    low = r.headroom_ratio is not None and r.headroom_ratio < 0.1
    return fmt_pct(r.headroom_ratio, 100), _LOW if low else PLAIN


def _power(r: RankRow) -> Cell:
    if r.gpu_power_w is None:
        return NA, PLAIN
    limit = r.gpu_power_limit_w
    return f"{r.gpu_power_w:.0f}/" + (f"{limit:.0f}W" if limit else "W"), PLAIN


def _clock(r: RankRow) -> Cell:
    if r.gpu_sm_clock_mhz is None:
        return NA, PLAIN
    top = r.gpu_sm_clock_max_mhz
    slow = bool(top) and r.gpu_sm_clock_mhz < 0.9 * (top or 0.0)
    return f"{r.gpu_sm_clock_mhz:.0f}/" + (f"{top:.0f}" if top else "?"), \
        _SLOW if slow else PLAIN


#: How a value of each format prints (``collectors.figures.Format``), and in what style.
FORMATS: dict[Format, tuple[Callable[[float | None], str], Style]] = {
    "ms": (fmt_ms, PLAIN), "rate": (fmt_rate, PLAIN), "pct": (fmt_pct, PLAIN),
    "bytes": (fmt_bytes, PLAIN), "num0": (lambda v: fixed(v, digits=0), PLAIN),
    "int": (lambda v: NA if v is None else f"{v:.0f}", DIM),  # a counter: dim
}
#: The cells drawn from several of a rank's figures (a node's line leaves them blank).
CELLS: dict[Format, Callable[[RankRow], Cell]] = {
    "memory": _memory, "free": _free, "power": _power, "clock": _clock}


def figure_column(f: Figure) -> Column:
    """The column a figure declares: its value printed in its format (a folded node's
    line shows the node's worst rank's, when the nodes keep one), or a cell the UI draws
    from several figures."""
    c = f.column
    assert c is not None, f.name
    if c.fmt == "bar":
        return BarColumn(title=c.label, width=c.width, sort=f.name, drop=c.drop)
    if c.fmt in CELLS:
        return TextColumn(title=c.label, width=c.width, sort=f.name, drop=c.drop,
                          rank=CELLS[c.fmt])
    fmt, style = FORMATS[c.fmt]
    value = attrgetter(f.name)
    if f.node is None:
        return TextColumn(title=c.label, width=c.width, sort=f.name, drop=c.drop,
                          rank=lambda r: (fmt(value(r)), style))
    return TextColumn(title=c.label, width=c.width, sort=f.name, drop=c.drop,
                      rank=lambda r: (fmt(value(r)), style),
                      node=lambda n: (fmt(value(n)), BOLD))


COLUMNS: tuple[Column, ...] = (
    TextColumn(title="rank", width=5, sort="rank", drop=0,
               rank=lambda r: (str(r.rank), BOLD),
               node=lambda n: (("▸" if n.folded else "▾") + f"{n.ranks:>3}", BOLD)),
    TextColumn(title="node", width=12, sort="node", drop=1, right=False,
               rank=lambda r: (r.node, DIM), node=lambda n: (n.node, BOLD)),
    TextColumn(title="status", width=10, sort="status", drop=0, right=False,
               rank=_status, node=_node_status),
    *(figure_column(f) for f in sorted((f for f in figures() if f.column is not None),
                                       key=lambda f: f.column.at if f.column else 0)),
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
