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
    Style(color="grey50"), Style(color="#afaf5f"), Style(color="#ffaf00"),
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
        #: the lines drawn, by line of the map, until a cell or the cursor changes
        self._lines: dict[int, list[Segment]] = {}
        self._want: tuple[int | None, str | None] = (None, None)  # (rank, node) to keep

    # ---- data in ------------------------------------------------------------------------

    def show(self, data: FleetData, figure: int, fold: Fold) -> None:
        """Draw ``data`` coloured by heat figure ``figure``, folded as ``fold`` says (a
        snapshot that changes no cell repaints nothing)."""
        keep = self.under()
        self.data, self.figure, self.fold = data, figure, fold
        lines = self._relayout(keep)
        if lines is None:
            self.refresh()
        else:  # only the lines whose cells (or cursor) changed
            for line in sorted(lines):
                self.refresh_lines(line)

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

    def _relayout(self, keep: tuple[int | None, str | None]) -> set[int] | None:
        """Lay the map out again if its shape changed, take the cells' new codes and put
        the cursor back; the lines that changed (None: all of them)."""
        d = self.data
        if d is None:
            return set()
        width = max(1, self.scrollable_content_region.width - self._label_width())
        height = max(1, self.scrollable_content_region.height)
        shape = (width, height, self.fold, hash(d.ranks.tobytes()),
                 hash(d.node_of.tobytes()), hash(d.local.tobytes()))
        changed = shape != self._shape or self.map is None
        if changed:
            self._shape = shape
            self.map = new = layout(d, width, height, self.fold)
            order = np.lexsort((new.at[:, 1], new.at[:, 0])) if len(new.at) else \
                np.zeros(0, np.int64)
            self._seq = order
            self._pos = np.empty(len(order), dtype=np.int64)
            self._pos[order] = np.arange(len(order))
            self.virtual_size = Size(new.width + self._label_width(), new.lines)
        m = self.map
        assert m is not None
        codes = d.node_codes(self.figure) if m.folded else d.rank_codes(self.figure)
        lines: set[int] = set()
        if changed or len(codes) != len(self.codes):
            self._lines.clear()
        else:
            diff = np.flatnonzero(codes != self.codes)
            lines = set(np.unique(m.at[diff, 0]).tolist()) if len(diff) else set()
            for line in lines:
                self._lines.pop(line, None)
        self.codes = codes
        before = self.cursor
        self._put_cursor(keep)
        if self.cursor != before:
            lines |= {self._forget(before), self._forget(self.cursor)} - {-1}
        return None if changed else lines

    def _forget(self, item: int) -> int:
        """Drop the cached line that holds ``item`` (the cursor came or went); that line
        (-1 if none)."""
        if self.map is not None and 0 <= item < len(self.map.at):
            line = int(self.map.at[item][0])
            self._lines.pop(line, None)
            return line
        return -1

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
            self._lines.clear()
            self.refresh()

    # ---- drawing ------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        """Build only the line asked for (kept until its cells change): its label, then
        runs of cells of one style."""
        width = self.scrollable_content_region.width
        m, line = self.map, self.scroll_offset.y + y
        if m is None or line >= m.lines:
            return Strip.blank(width, BLANK)
        segs = self._lines.get(line)
        if segs is None:
            segs = self._lines[line] = self._segments(m, line)
        return Strip(segs).crop_extend(0, width, BLANK)

    def _segments(self, m: Layout, line: int) -> list[Segment]:
        lw = self._label_width()
        label = m.label[line]
        segs = [Segment((str(label) if label >= 0 else "").rjust(lw - 1) + " ", LABEL)]
        row = m.grid[line]
        # a style per cell: its code, -1 for a gap, and the cursor apart (code + 100)
        style = np.where(row >= 0, self.codes[np.maximum(row, 0)].astype(np.int64), -1)
        if len(m.at) and int(m.at[self.cursor][0]) == line:
            style[int(m.at[self.cursor][1])] += 100
        cuts = np.flatnonzero(np.diff(style)) + 1
        for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(style)], strict=True):
            code = int(style[a])
            if code < 0:
                segs.append(Segment(" " * (b - a), BLANK))
                continue
            cur, code = code >= 100, code % 100
            st = CODE_STYLES[code]
            if cur:
                st = (CURSOR if self.has_focus else Style(underline=True)) + st
            segs.append(Segment(CODE_GLYPHS[code] * (b - a), st))
        return segs

    # ---- the cursor ---------------------------------------------------------------------

    def _moved(self, before: int) -> None:
        m = self.map
        if m is None or not len(m.at):
            return
        old_line = self._forget(before)
        line = self._forget(self.cursor)
        top, h = self.scroll_offset.y, self.scrollable_content_region.height
        if line < top:
            self.scroll_to(y=line, animate=False)
        elif line >= top + h:
            self.scroll_to(y=line - h + 1, animate=False)
        self._want = self.under()
        for changed in {old_line, line} - {-1}:  # (a scroll repaints the rest)
            self.refresh_lines(changed)
        rank, node = self._want
        if node is not None:
            self.post_message(self.Moved(rank, node))

    def action_move(self, dx: int, dy: int) -> None:
        """Move the cursor a cell sideways (along the reading order) or a line."""
        m = self.map
        if m is None or not len(m.at):
            return
        before = self.cursor
        if dx:
            i = int(self._pos[self.cursor]) + dx
            if 0 <= i < len(self._seq):
                self.cursor = int(self._seq[i])
        else:
            self._to_line(int(m.at[self.cursor][0]) + dy, int(m.at[self.cursor][1]))
        self._moved(before)

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
        before = self.cursor
        self._to_line(max(0, min(m.lines - 1, line)), int(m.at[self.cursor][1]))
        self._moved(before)

    def action_end(self, last: int) -> None:
        """The first (or last) cell."""
        if len(self._seq):
            before = self.cursor
            self.cursor = int(self._seq[-1 if last else 0])
            self._moved(before)

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
            before = self.cursor
            self.cursor = int(m.grid[line, x])
            self._moved(before)
            if again or event.chain > 1:
                self.action_open()

    def on_focus(self) -> None:
        """The cursor shows reversed only while focused."""
        self._forget(self.cursor)
        self.refresh()

    def on_blur(self) -> None:
        """See :meth:`on_focus`."""
        self._forget(self.cursor)
        self.refresh()
