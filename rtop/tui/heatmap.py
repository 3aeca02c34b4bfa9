"""The fleet's heatmap: one cell per rank (or per node, folded), drawn line by line.

Only the lines on screen are built (Textual's line API: ``render_line`` returns a
``Strip``), each as a few segments (a run of cells of one band is one segment), so a
map of 16,384 ranks costs what a screenful costs. A cursor moves over the cells with the
arrow keys; ``enter`` opens what is under it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding, BindingType
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from rtop.tui.fleetmap import CODE_GLYPHS, FleetData, Fold, Layout, layout

#: Each cell code's style (``rtop.tui.fleetmap``: the five bands, better than the median,
#: down, done, not measured); without colour the glyphs still tell them apart.
CODE_STYLES: tuple[Style, ...] = (
    Style(color="grey50"), Style(color="#d7d75f"), Style(color="#ffaf00"),
    Style(color="#ff5f00", bold=True), Style(color="#ff2020", bold=True),
    Style(color="#5f87af"), Style(color="#ff2020", bold=True), Style(dim=True), Style())
CURSOR = Style(reverse=True, bold=True)
LABEL = Style(dim=True)
BLANK = Style()


class FleetMap(ScrollView, can_focus=True):
    """Every rank (or node) as a cell of its band; a cursor picks one."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "move(0, -1)", "up", show=False),
        Binding("down", "move(0, 1)", "down", show=False),
        Binding("left", "move(-1, 0)", "left", show=False),
        Binding("right", "move(1, 0)", "right", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home", "end(0)", "first", show=False),
        Binding("end", "end(1)", "last", show=False),
        Binding("enter", "open", "open"),
    ]
    DEFAULT_CSS = """
    FleetMap { height: 1fr; width: 1fr; scrollbar-size-vertical: 1; }
    """

    class Moved(Message):
        """The cursor moved: to ``rank`` (None on a folded node) of node ``node``."""

        def __init__(self, rank: int | None, node: str) -> None:
            super().__init__()
            self.rank, self.node = rank, node

    class Opened(Message):
        """``enter`` on a cell: a rank (open its detail) or a folded node (its ranks)."""

        def __init__(self, rank: int | None, node: str) -> None:
            super().__init__()
            self.rank, self.node = rank, node

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.data: FleetData | None = None
        self.figure = 0
        self.fold: Fold = "auto"
        self.map: Layout | None = None
        self.codes = np.zeros(0, dtype=np.int8)
        self.cursor = 0  # an item of the layout: a rank's index, or a node's when folded
        self._seq = np.zeros(0, dtype=np.int64)  # items in reading order
        self._pos = np.zeros(0, dtype=np.int64)  # each item's place in _seq
        self._shape: tuple[Any, ...] = ()  # what the layout was made for
        self._want: tuple[int | None, str | None] = (None, None)  # (rank, node) to keep

    # ---- data in ------------------------------------------------------------------------

    def show(self, data: FleetData, figure: int, fold: Fold) -> None:
        """Draw ``data`` coloured by heat figure ``figure``, folded as ``fold`` says."""
        keep = self.under()
        self.data, self.figure, self.fold = data, figure, fold
        self._relayout(keep)
        self.refresh()

    def under(self) -> tuple[int | None, str | None]:
        """(rank, node name) under the cursor; rank None on a folded node."""
        d, m = self.data, self.map
        if d is None or m is None or not d.n:
            return self._want
        if m.folded:
            return None, d.nodes[self.cursor] if self.cursor < len(d.nodes) else None
        if self.cursor >= d.n:
            return None, None
        return int(d.ranks[self.cursor]), d.nodes[int(d.node_of[self.cursor])]

    def _label_width(self) -> int:
        d = self.data
        top = int(d.ranks.max()) if d is not None and d.n else 0
        return len(str(top)) + 1

    def _relayout(self, keep: tuple[int | None, str | None]) -> None:
        d = self.data
        if d is None:
            return
        width = max(1, self.scrollable_content_region.width - self._label_width())
        height = max(1, self.scrollable_content_region.height)
        shape = (d.n, len(d.nodes), width, height, self.fold, d.ranks.tobytes()[-64:])
        if shape != self._shape or self.map is None:
            self._shape = shape
            self.map = m = layout(d, width, height, self.fold)
            order = np.lexsort((m.at[:, 1], m.at[:, 0])) if len(m.at) else \
                np.zeros(0, np.int64)
            self._seq = order
            self._pos = np.empty(len(order), dtype=np.int64)
            self._pos[order] = np.arange(len(order))
            self.virtual_size = Size(m.width + self._label_width(), m.lines)
        m = self.map
        self.codes = d.node_codes(self.figure) if m.folded else d.rank_codes(self.figure)
        self._put_cursor(keep)

    def _put_cursor(self, keep: tuple[int | None, str | None]) -> None:
        """Back on the rank (or node) the cursor was on, if it is still there."""
        d, m = self.data, self.map
        assert d is not None and m is not None
        rank, node = keep
        items = len(m.at)
        target = None
        if m.folded and node is not None and node in d.nodes:
            target = d.nodes.index(node)
        elif not m.folded and rank is not None:
            hit = np.flatnonzero(d.ranks == rank)
            target = int(hit[0]) if len(hit) else None
        if not m.folded and target is None and node is not None and node in d.nodes:
            members = d.node_ranks(d.nodes.index(node))
            target = int(members[0]) if len(members) else None
        if target is None:
            target = min(self.cursor, items - 1) if items else 0
        self.cursor = max(0, target)
        self._want = self.under()

    def on_resize(self) -> None:
        """The layout depends on the size."""
        if self.data is not None:
            self._relayout(self.under())
            self.refresh()

    # ---- drawing ------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        """Build only the line asked for: its label, then runs of cells of one style."""
        width = self.scrollable_content_region.width
        m, line = self.map, self.scroll_offset.y + y
        if m is None or line >= m.lines:
            return Strip.blank(width, BLANK)
        lw = self._label_width()
        label = m.label[line]
        segs = [Segment((str(label) if label >= 0 else "").rjust(lw - 1) + " ", LABEL)]
        row = m.grid[line]
        cur_line, cur_x = (int(v) for v in m.at[self.cursor]) if len(m.at) else (-1, -1)
        glyphs, styles = [], []
        for x, item in enumerate(row):
            if item < 0:
                glyphs.append(" ")
                styles.append(BLANK)
                continue
            code = int(self.codes[item])
            glyphs.append(CODE_GLYPHS[code])
            styles.append(CURSOR + CODE_STYLES[code] if (line, x) == (cur_line, cur_x)
                          and self.has_focus else
                          (Style(underline=True) + CODE_STYLES[code]
                           if (line, x) == (cur_line, cur_x) else CODE_STYLES[code]))
        start = 0
        for x in range(1, len(glyphs) + 1):
            if x == len(glyphs) or styles[x] != styles[start]:
                segs.append(Segment("".join(glyphs[start:x]), styles[start]))
                start = x
        return Strip(segs).crop_extend(0, width, BLANK)

    # ---- the cursor ---------------------------------------------------------------------

    def _moved(self) -> None:
        m = self.map
        if m is None or not len(m.at):
            return
        line = int(m.at[self.cursor][0])
        top, h = self.scroll_offset.y, self.scrollable_content_region.height
        if line < top:
            self.scroll_to(y=line, animate=False)
        elif line >= top + h:
            self.scroll_to(y=line - h + 1, animate=False)
        self._want = self.under()
        self.refresh()
        rank, node = self._want
        if node is not None:
            self.post_message(self.Moved(rank, node))

    def action_move(self, dx: int, dy: int) -> None:
        """Move the cursor a cell sideways (along the reading order) or a line."""
        m = self.map
        if m is None or not len(m.at):
            return
        if dx:
            i = int(self._pos[self.cursor]) + dx
            if 0 <= i < len(self._seq):
                self.cursor = int(self._seq[i])
        else:
            self._to_line(int(m.at[self.cursor][0]) + dy, int(m.at[self.cursor][1]))
        self._moved()

    def _to_line(self, line: int, x: int) -> None:
        """The cell of ``line`` nearest column ``x`` (the cursor stays off the map)."""
        m = self.map
        assert m is not None
        if not 0 <= line < m.lines:
            return
        xs = np.flatnonzero(m.grid[line] >= 0)
        if len(xs):
            self.cursor = int(m.grid[line, xs[np.argmin(np.abs(xs - x))]])

    def action_page(self, direction: int) -> None:
        """A screenful of lines up or down."""
        m = self.map
        if m is None or not len(m.at):
            return
        h = max(1, self.scrollable_content_region.height - 1)
        line = int(m.at[self.cursor][0]) + direction * h
        self._to_line(max(0, min(m.lines - 1, line)), int(m.at[self.cursor][1]))
        self._moved()

    def action_end(self, last: int) -> None:
        """The first (or last) cell."""
        if len(self._seq):
            self.cursor = int(self._seq[-1 if last else 0])
            self._moved()

    def action_open(self) -> None:
        """Open the rank (its detail) or the folded node (its ranks) under the cursor."""
        rank, node = self.under()
        if node is not None:
            self.post_message(self.Opened(rank, node))

    def on_click(self, event: Click) -> None:
        """A click puts the cursor on a cell; a second click (or a double) opens it."""
        m = self.map
        if m is None:
            return
        line, x = self.scroll_offset.y + event.y, event.x - self._label_width()
        if 0 <= line < m.lines and 0 <= x < m.width and m.grid[line, x] >= 0:
            again = int(m.grid[line, x]) == self.cursor
            self.cursor = int(m.grid[line, x])
            self._moved()
            if again or event.chain > 1:
                self.action_open()

    def on_focus(self) -> None:
        """The cursor shows reversed only while focused."""
        self.refresh()

    def on_blur(self) -> None:
        """See :meth:`on_focus`."""
        self.refresh()
