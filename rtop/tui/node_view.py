"""One node's ranks: the ranks table filtered to the node (from the fleet view)."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Footer, Static

from rtop.analysis.viewport import ViewRequest
from rtop.fmt import fmt_ranks, safe_text
from rtop.run.snapshot import Snapshot
from rtop.tui.fleetmap import FleetData
from rtop.tui.header import JobHeader
from rtop.tui.messages import ViewChanged
from rtop.tui.model import rank_rows, sort_rows
from rtop.tui.overview import SORT_ORDER
from rtop.tui.ranks import RanksHeader, RanksView


class NodeScreen(Screen[None]):
    """The ranks of one node, worst first (a :class:`~rtop.tui.protocols.SnapshotView`);
    ``enter`` opens a rank's detail."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "app.pop_screen", "back"),
        Binding("s", "sort(1)", "sort"),
        Binding("r", "reverse", "reverse"),
    ]
    DEFAULT_CSS = """
    NodeScreen #title { height: 1; padding: 0 1; background: $panel; }
    NodeScreen RanksHeader { height: 1; background: $boost; }
    """

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node
        self.snapshot: Snapshot | None = None
        self.sort_key, self.reverse = "worst", False
        self._drawn = False

    def compose(self) -> ComposeResult:
        """The job's header, the node's title, its ranks."""
        yield JobHeader()
        yield Static("", id="title")
        yield RanksHeader()
        yield RanksView(id="ranks")
        yield Footer()

    def on_mount(self) -> None:
        """The ranks have the focus."""
        self.query_one(RanksView).focus()
        self.query_one(RanksHeader).show(self.sort_key, self.reverse)
        self._drawn = True
        self.post_message(ViewChanged())
        if self.snapshot is not None:
            self.show_snapshot(self.snapshot)

    def on_screen_resume(self) -> None:
        """Back here (from a rank's detail): ask for the node's rows again."""
        self.post_message(ViewChanged())

    def view_request(self) -> ViewRequest:
        """Every rank of the node."""
        return ViewRequest(nodes=(self.node,), top=0)

    def show_snapshot(self, snap: Snapshot) -> None:
        """Draw the node's ranks from a new snapshot."""
        self.snapshot = snap
        if not self._drawn:
            return
        self.query_one(JobHeader).show(snap)
        rows = [r for r in rank_rows(snap) if r.node == safe_text(self.node)]
        self.query_one(RanksView).set_rows(list(sort_rows(rows, self.sort_key, self.reverse)))
        data = FleetData.of(snap)
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(f"node {safe_text(self.node, 60)}", "bold")
        if data is not None and self.node in data.nodes:
            members = data.node_ranks(data.nodes.index(self.node))
            title.append(f"  ranks {fmt_ranks(data.ranks[members].tolist())}"
                         f"  ({len(rows)} of {len(members)} shown)", "dim")
        title.append("   enter: a rank's detail · escape: back", "dim")
        self.query_one("#title", Static).update(title)

    def action_sort(self, delta: int) -> None:
        """Next sort column."""
        i = SORT_ORDER.index(self.sort_key) if self.sort_key in SORT_ORDER else 0
        self.sort_key, self.reverse = SORT_ORDER[(i + delta) % len(SORT_ORDER)], False
        self._resort()

    def action_reverse(self) -> None:
        """Reverse the sort."""
        self.reverse = not self.reverse
        self._resort()

    def _resort(self) -> None:
        self.query_one(RanksHeader).show(self.sort_key, self.reverse)
        if self.snapshot is not None:
            self.show_snapshot(self.snapshot)

    def on_ranks_header_sort_clicked(self, event: RanksHeader.SortClicked) -> None:
        """Sort by the clicked column (again: reverse)."""
        event.stop()
        if event.sort == self.sort_key:
            self.reverse = not self.reverse
        else:
            self.sort_key, self.reverse = event.sort, False
        self._resort()
