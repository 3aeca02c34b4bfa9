"""The ranks table: one line per rank (or per folded node), drawn line by line.

Only the visible lines are built (Textual's line API), so a job of thousands of ranks
costs what a screenful costs. Columns (:mod:`rtop.tui.columns`) that do not fit the
terminal's width are dropped, least important first.

The table may hold only a window of its lines (a page the hub sorted, of a fleet too
large to send whole: ``set_window``); scrolled beyond it, the lines wait for the next
snapshot, and the view says which lines it needs (:class:`RanksView.NeedRows`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Static

from rtop.tui.columns import DIM, PLAIN, Column, fit_columns, row_segments
from rtop.tui.model import NodeRow, RankRow

#: cells kept free on the right for the table's vertical scrollbar, so the header and the
#: rows choose the same columns whether or not a scrollbar shows
SCROLLBAR = 2
#: what a line is about: ("rank", 3) or ("node", "node-7")
RowKey = tuple[str, int | str]


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

    def _text(self) -> Text:
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
        Binding("up", "cursor(-1)", "up", show=False),
        Binding("down", "cursor(1)", "down", show=False),
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

    class NeedRows(Message):
        """The lines on screen (from ``top``, ``height`` of them) are outside the window
        the table holds."""

        def __init__(self, top: int, height: int) -> None:
            super().__init__()
            self.top, self.height = top, height

        def can_replace(self, message: Message) -> bool:
            """Only where the table stands now matters."""
            return isinstance(message, RanksView.NeedRows)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows: list[RankRow | NodeRow] = []
        self.base = 0  # the line of rows[0] (a window of a larger table)
        self.total = 0  # lines of the whole table
        self.cursor = 0
        self._key: RowKey | None = None  # what the cursor is on, kept across updates
        self.pinned = False  # until the user moves, the cursor stays on the top line
        self._cols: list[Column] = fit_columns(80 - SCROLLBAR)
        self._cols_width = 80 - SCROLLBAR

    @staticmethod
    def _key_of(row: RankRow | NodeRow) -> RowKey:
        return ("node", row.node) if isinstance(row, NodeRow) else ("rank", row.rank)

    def set_rows(self, rows: list[RankRow | NodeRow]) -> None:
        """New rows (a new snapshot, sort or filter); the cursor stays on its rank."""
        self.set_window(rows, 0, len(rows))

    def set_window(self, rows: list[RankRow | NodeRow], base: int, total: int) -> None:
        """Lines ``base`` to ``base + len(rows)`` of a table of ``total`` lines; the
        cursor stays on its rank if the window holds it, else on its line."""
        self.rows, self.base, self.total = rows, base, max(total, base + len(rows))
        if self.pinned and self._key is not None:
            for i, r in enumerate(rows):
                if self._key_of(r) == self._key:
                    self.cursor = base + i
                    break
        self.cursor = max(0, min(self.cursor, self.total - 1))
        cur = self.current
        self._key = self._key_of(cur) if cur is not None else self._key
        self.virtual_size = Size(0, self.total)  # lines fit the width: no sideways scrolling
        self.refresh()
        self._check_window()

    @property
    def current(self) -> RankRow | NodeRow | None:
        """The row under the cursor (None where the window does not reach)."""
        i = self.cursor - self.base
        return self.rows[i] if 0 <= i < len(self.rows) else None

    @property
    def paged(self) -> bool:
        """Whether the table holds only a window of its lines."""
        return self.total > len(self.rows)

    def _check_window(self) -> None:
        """Ask for the lines on screen when the window does not hold them all."""
        if not self.paged:
            return
        top, h = int(self.scroll_offset.y), max(1, self.size.height)
        last = min(self.total, top + h)
        if top < self.base or last > self.base + len(self.rows):
            self.post_message(self.NeedRows(top, h))

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        """Scrolled: the window may not hold the lines now on screen."""
        super().watch_scroll_y(old_value, new_value)
        self._check_window()

    def on_resize(self) -> None:
        """Columns depend on the width."""
        self.virtual_size = Size(0, self.total)
        self.refresh()
        self._check_window()

    def render_line(self, y: int) -> Strip:
        """Build only the line asked for."""
        i = self.scroll_offset.y + y
        width = self.scrollable_content_region.width
        if i >= self.total:
            return Strip.blank(width, PLAIN)
        if not 0 <= i - self.base < len(self.rows):  # beyond the window: coming
            strip = Strip([Segment("   …", DIM)]).crop_extend(0, width, PLAIN)
            return strip.apply_style(Style(underline=True)) if i == self.cursor else strip
        row = self.rows[i - self.base]
        cols_width = self.size.width - SCROLLBAR
        if cols_width != self._cols_width:  # the same columns as the header above
            self._cols, self._cols_width = fit_columns(cols_width), cols_width
        segs = row_segments(row, self._cols)
        strip = Strip(segs).crop_extend(0, width, PLAIN)
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
        if not self.total:
            return
        self.cursor = max(0, min(self.total - 1, self.cursor + delta))
        self.pinned = True
        cur = self.current
        self._key = self._key_of(cur) if cur is not None else None
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
        if 0 <= i - self.base < len(self.rows):
            again = i == self.cursor
            self.cursor = i
            self.pinned = True
            self._key = self._key_of(self.rows[i - self.base])
            self.refresh()
            if again or event.chain > 1:
                self.action_open()

    def on_focus(self) -> None:
        """The cursor shows as reversed only while focused."""
        self.refresh()

    def on_blur(self) -> None:
        """See :meth:`on_focus`."""
        self.refresh()
