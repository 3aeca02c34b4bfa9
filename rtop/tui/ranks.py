"""The ranks table: one line per rank (or per folded node), drawn line by line.

Only the visible lines are built (Textual's line API), so a job of thousands of ranks
costs what a screenful costs. Columns (:mod:`rtop.tui.columns`) that do not fit the
terminal's width are dropped, least important first.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Static

from rtop.tui.columns import PLAIN, Column, fit_columns, row_segments
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

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows: list[RankRow | NodeRow] = []
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
            return Strip.blank(width, PLAIN)
        row = self.rows[i]
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
