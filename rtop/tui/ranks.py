"""The ranks table: one line per rank (or per folded node), drawn line by line.

Only the visible lines are built (Textual's line API), so a job of thousands of ranks
costs what a screenful costs. Columns that do not fit the terminal's width are dropped,
least important first; the data/compute/comm shares of the step are a stacked bar whose
glyphs differ too, so it reads without colour (``NO_COLOR``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding, BindingType
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Static

from rtop.tui.model import (
    NA,
    NodeRow,
    RankRow,
    fmt_bytes,
    fmt_ms,
    fmt_pct,
    fmt_rate,
)


@dataclass(frozen=True)
class Column:
    """A table column: its title, width, what it sorts by, and when it is dropped
    (higher ``drop`` goes first on a narrow terminal)."""

    title: str
    width: int
    sort: str
    drop: int
    right: bool = True


COLUMNS: tuple[Column, ...] = (
    Column("rank", 5, "rank", 0),
    Column("node", 12, "node", 1, right=False),
    Column("status", 10, "status", 0, right=False),
    Column("step", 7, "step", 6),
    Column("step ms", 8, "step ms", 0),
    Column("data▒ compute█ comm░", 20, "data", 2, right=False),
    Column("comm ms", 8, "comm", 5),
    Column("busbw", 10, "busbw", 3),
    Column("GPU", 5, "GPU", 3),
    Column("memory", 17, "memory", 4),
    Column("free", 5, "free", 2),
    Column("power", 10, "power", 7),
    Column("clock MHz", 11, "clock", 8),
)
BAR_GLYPHS = (("data", "▒", "yellow"), ("compute", "█", "green"), ("comm", "░", "blue"))
BADGE_STYLE = {
    "HUNG": "bold white on red", "LOST": "bold white on red", "FAILED": "bold white on red",
    "STARVED": "bold red", "MEMWALL": "bold magenta", "STRAGGLER": "bold yellow",
    "THROTTLED": "yellow", "EXITED": "dim", "done": "dim", "ended": "dim",
}


#: cells kept free on the right for the table's vertical scrollbar, so the header and the
#: rows choose the same columns whether or not a scrollbar shows
SCROLLBAR = 2


def fit_columns(width: int) -> list[Column]:
    """The columns that fit ``width`` cells, dropping the least important first."""
    cols = list(COLUMNS)
    while sum(c.width + 1 for c in cols) > width and any(c.drop for c in cols):
        worst = max(cols, key=lambda c: c.drop)
        cols.remove(worst)
    return cols


_PLAIN = Style()


def _cell(text: str, col: Column, style: Style | None = None) -> Segment:
    text = text if len(text) <= col.width else text[: col.width - 1] + "…"
    return Segment((text.rjust(col.width) if col.right else text.ljust(col.width)) + " ",
                   style or _PLAIN)


def bar_segments(row: RankRow | NodeRow, width: int) -> list[Segment]:
    """The step as a stacked bar of data wait, compute and allreduce shares."""
    step = row.step_s
    parts = [row.data_s, getattr(row, "compute_s", None), row.comm_s]
    if not step or all(p is None for p in parts):
        return [Segment(NA.ljust(width) + " ", Style(dim=True))]
    segs: list[Segment] = []
    used = 0
    for (_, glyph, colour), v in zip(BAR_GLYPHS, parts, strict=True):
        n = round(width * min(1.0, max(0.0, (v or 0.0) / step)))
        n = min(n, width - used)
        if n:
            segs.append(Segment(glyph * n, Style(color=colour)))
            used += n
    segs.append(Segment("·" * (width - used) + " ", Style(dim=True)))
    return segs


def row_segments(row: RankRow | NodeRow, cols: list[Column]) -> list[Segment]:
    """One table line."""
    segs: list[Segment] = []
    dim = Style(dim=True)
    for c in cols:
        t = c.title
        if isinstance(row, NodeRow):
            node_cells = {
                "rank": ("▸" if row.folded else "▾") + f"{row.ranks:>3}",
                "node": row.node, "status": row.badge or f"{row.active}/{row.ranks} up",
                "step ms": fmt_ms(row.step_s), "comm ms": fmt_ms(row.comm_s),
                "busbw": fmt_rate(row.busbw),
            }
            if c.title.startswith("data"):
                segs += bar_segments(row, c.width)
                continue
            style = Style(bold=True) if t != "status" or not row.badge else \
                Style.parse(BADGE_STYLE.get(row.badge, "bold"))
            segs.append(_cell(node_cells.get(t, ""), c, style))
            continue
        if t == "rank":
            segs.append(_cell(str(row.rank), c, Style(bold=True)))
        elif t == "node":
            segs.append(_cell(row.node, c, dim))
        elif t == "status":
            label = row.badge or ("ok" if row.status == "active" else row.status)
            style = Style.parse(BADGE_STYLE[row.badge]) if row.badge in BADGE_STYLE else dim
            segs.append(_cell(label, c, style))
        elif t == "step":
            segs.append(_cell(NA if row.step is None else str(row.step), c, dim))
        elif t == "step ms":
            segs.append(_cell(fmt_ms(row.step_s), c))
        elif t.startswith("data"):
            segs += bar_segments(row, c.width)
        elif t == "comm ms":
            segs.append(_cell(fmt_ms(row.comm_s), c))
        elif t == "busbw":
            segs.append(_cell(fmt_rate(row.busbw), c))
        elif t == "GPU":
            segs.append(_cell(fmt_pct(row.gpu_util), c))
        elif t == "memory":
            text = NA if row.mem_used is None else \
                f"{fmt_bytes(row.mem_used)}/{fmt_bytes(row.mem_total)}"
            segs.append(_cell(text.replace(" ", ""), c))
        elif t == "free":
            low = row.headroom is not None and row.headroom < 0.1
            segs.append(_cell(fmt_pct(row.headroom, 100), c,
                              Style.parse("bold magenta") if low else None))
        elif t == "power":
            text = NA if row.power_w is None else f"{row.power_w:.0f}/" + (
                f"{row.power_limit_w:.0f}W" if row.power_limit_w else "W")
            segs.append(_cell(text, c))
        elif t == "clock MHz":
            text = NA if row.clock_mhz is None else f"{row.clock_mhz:.0f}/" + (
                f"{row.clock_max_mhz:.0f}" if row.clock_max_mhz else "?")
            slow = row.clock_mhz is not None and row.clock_max_mhz and \
                row.clock_mhz < 0.9 * row.clock_max_mhz
            segs.append(_cell(text, c, Style(color="yellow") if slow else None))
    return segs


class RanksHeader(Static):
    """The table's column titles; click one to sort by it."""

    class SortClicked(Message):
        """A column title was clicked."""

        def __init__(self, sort: str) -> None:
            super().__init__()
            self.sort = sort

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("", **kwargs)
        self.sort_key, self.reverse = "worst", False

    def show(self, sort_key: str, reverse: bool) -> None:
        """Redraw with this sort indicated."""
        self.sort_key, self.reverse = sort_key, reverse
        self.refresh(layout=False)
        self.update(self._text())

    def _text(self) -> Any:
        from rich.text import Text

        text = Text(no_wrap=True, overflow="crop")
        for c in fit_columns((self.size.width or 80) - SCROLLBAR):
            title = c.title
            if c.sort == self.sort_key:
                title = ("▼" if not self.reverse else "▲") + title
            title = title[: c.width]
            text.append((title.rjust(c.width) if c.right else title.ljust(c.width)) + " ",
                        "bold underline" if c.sort == self.sort_key else "bold")
        return text

    def on_resize(self) -> None:
        """Columns depend on the width."""
        self.update(self._text())

    def on_click(self, event: Click) -> None:
        """Sort by the clicked column."""
        x = 0
        for c in fit_columns((self.size.width or 80) - SCROLLBAR):
            if x <= event.x < x + c.width + 1:
                self.post_message(self.SortClicked(c.sort))
                return
            x += c.width + 1


class RanksView(ScrollView, can_focus=True):
    """The ranks (and folded nodes), virtualized; a cursor picks one."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "cursor(-1)", "up", show=False),
        Binding("down,j", "cursor(1)", "down", show=False),
        Binding("pageup", "cursor(-20)", "page up", show=False),
        Binding("pagedown", "cursor(20)", "page down", show=False),
        Binding("home", "cursor(-1000000)", "first", show=False),
        Binding("end", "cursor(1000000)", "last", show=False),
        Binding("enter", "open", "details"),
    ]
    DEFAULT_CSS = """
    RanksView { height: 1fr; }
    """

    class RankChosen(Message):
        """Enter on a rank: open its detail."""

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    class NodeToggled(Message):
        """Enter on a node line: fold or unfold it."""

        def __init__(self, node: str) -> None:
            super().__init__()
            self.node = node

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows: list[RankRow | NodeRow] = []
        self.cursor = 0
        self._key: Any = None  # what the cursor is on, kept across updates
        self.pinned = False  # until the user moves, the cursor stays on the top line
        self._cols: list[Column] = fit_columns(80 - SCROLLBAR)
        self._cols_width = 80 - SCROLLBAR

    @staticmethod
    def _key_of(row: RankRow | NodeRow) -> Any:
        return ("node", row.node) if isinstance(row, NodeRow) else ("rank", row.rank)

    def set_rows(self, rows: list[RankRow | NodeRow]) -> None:
        """New rows (a new snapshot, sort or filter); the cursor stays on its rank."""
        self.rows = rows
        if self.pinned and self._key is not None:
            for i, r in enumerate(rows):
                if self._key_of(r) == self._key:
                    self.cursor = i
                    break
        self.cursor = max(0, min(self.cursor, len(rows) - 1))
        self._key = self._key_of(rows[self.cursor]) if rows else None
        self.virtual_size = Size(0, len(rows))  # lines fit the width: no sideways scrolling
        self.refresh()

    @property
    def current(self) -> RankRow | NodeRow | None:
        """The row under the cursor."""
        return self.rows[self.cursor] if 0 <= self.cursor < len(self.rows) else None

    def on_resize(self) -> None:
        """Columns depend on the width."""
        self.virtual_size = Size(0, len(self.rows))
        self.refresh()

    def render_line(self, y: int) -> Strip:
        """Build only the line asked for."""
        i = self.scroll_offset.y + y
        width = self.scrollable_content_region.width
        if i >= len(self.rows):
            return Strip.blank(width, _PLAIN)
        row = self.rows[i]
        cols_width = self.size.width - SCROLLBAR
        if cols_width != self._cols_width:  # the same columns as the header above
            self._cols, self._cols_width = fit_columns(cols_width), cols_width
        segs = row_segments(row, self._cols)
        strip = Strip(segs).crop_extend(0, width, _PLAIN)
        if i == self.cursor and self.has_focus:
            # a background, not reverse video: the bar keeps its colours under the cursor
            strip = strip.apply_style(Style(bold=True, bgcolor="#3b4261"))
        elif i == self.cursor:
            strip = strip.apply_style(Style(underline=True))
        elif isinstance(row, RankRow) and row.highlighted:
            strip = strip.apply_style(Style(bold=True, bgcolor="grey23"))
        elif isinstance(row, NodeRow):
            strip = strip.apply_style(Style(bgcolor="grey15"))
        return strip

    def action_cursor(self, delta: int) -> None:
        """Move the cursor, keeping it in view."""
        if not self.rows:
            return
        self.cursor = max(0, min(len(self.rows) - 1, self.cursor + delta))
        self.pinned = True
        self._key = self._key_of(self.rows[self.cursor])
        top, h = self.scroll_offset.y, self.size.height
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + h:
            self.scroll_to(y=self.cursor - h + 1, animate=False)
        self.refresh()

    def action_open(self) -> None:
        """Open the rank (or fold/unfold the node) under the cursor."""
        row = self.current
        if isinstance(row, NodeRow):
            self.post_message(self.NodeToggled(row.node))
        elif row is not None:
            self.post_message(self.RankChosen(row.rank))

    def on_click(self, event: Click) -> None:
        """Click picks a line; a second click (or a double click) opens it."""
        i = self.scroll_offset.y + event.y
        if 0 <= i < len(self.rows):
            again = i == self.cursor
            self.cursor = i
            self.pinned = True
            self._key = self._key_of(self.rows[i])
            self.refresh()
            if again or event.chain > 1:
                self.action_open()

    def on_focus(self) -> None:
        """The cursor shows as reversed only while focused."""
        self.refresh()

    def on_blur(self) -> None:
        """See :meth:`on_focus`."""
        self.refresh()
