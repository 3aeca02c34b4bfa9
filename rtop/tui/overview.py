"""The overview, rtop's main screen: the job's header, the findings (and the selected
one's evidence and fix), the ranks table, and the filter and go-to boxes.

The screen owns how the table is sorted, filtered, grouped and highlighted, and the
keys that change it; the app hands it each snapshot (:meth:`OverviewScreen.show_snapshot`)
and it posts what only the app can do (open a rank, go to a time) as messages.

A fleet too large to send whole (a view's snapshot that says ``partial``) is sorted and
filtered by the hub: the screen asks for the page of the table on screen
(:meth:`OverviewScreen.view_request`) and draws the page it gets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from rtop.analysis.viewport import MAX_NODES, MAX_PAGE_ROWS, Page, ViewRequest
from rtop.run.snapshot import FindingDict, Snapshot
from rtop.tui.columns import COLUMNS
from rtop.tui.findings import FindingDetail, FindingsList, evidence_text
from rtop.tui.header import JobHeader
from rtop.tui.messages import ViewChanged
from rtop.tui.model import (
    NodeRow,
    RankRow,
    group_rows,
    parse_filter,
    rank_rows,
    sort_rows,
    view_node_rows,
)
from rtop.tui.ranks import RanksHeader, RanksView

#: What ``s`` steps through: worst first, then every column.
SORT_ORDER = ["worst"] + [c.sort for c in COLUMNS]
#: Grouping folds every node when a job has more ranks than this.
FOLD_ABOVE = 64


class OverviewScreen(Screen[None]):
    """Is the job healthy, and if not, which rank and why (a
    :class:`~rtop.tui.protocols.SnapshotView`)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "app.quit", "quit"),
        # the app's own key, here too so that the footer reads quit, help, then the table's
        Binding("question_mark", "app.help", "help"),
        Binding("tab", "app.focus_next", "findings/ranks", show=False),
        Binding("s", "sort(1)", "sort"),
        Binding("S", "sort(-1)", "sort back", show=False),
        Binding("r", "reverse", "reverse"),
        Binding("w", "worst", "worst first", show=False),
        Binding("g", "group", "group by node"),
        Binding("slash", "filter", "filter"),
        Binding("v", "fleet", "fleet view"),
        Binding("f", "fabric", "fabric"),
        Binding("e", "scaling", "scaling"),
        Binding("p", "act('profile')", "profile"),
        Binding("b", "act('probe')", "probe links"),
        Binding("k", "act('stacks')", "stacks"),
        Binding("escape", "clear", "clear", show=False),
        Binding("colon", "goto", "go to", show=False),
    ]
    DEFAULT_CSS = """
    OverviewScreen #ok { height: 1; padding: 0 1; color: $success; }
    OverviewScreen #filter, OverviewScreen #goto { dock: bottom; height: 3; }
    OverviewScreen RanksHeader { height: 1; background: $boost; }
    OverviewScreen .hidden { display: none; }
    """

    class GotoRequested(Message):
        """The go-to box was submitted with ``text`` (a time or a step)."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self) -> None:
        super().__init__()
        self.snapshot: Snapshot | None = None
        self.sort_key, self.reverse = "worst", False
        self.grouped = False
        self.fold_all = False
        self.unfolded: set[str] = set()
        self.filter_text = ""
        self.highlight: set[int] = set()
        self._source: tuple[str, bool] | None = None  # the source's last word
        self._drawn = False  # the widgets exist: draw at once (else on_mount draws)
        self.page_offset, self.page_limit = 0, 64  # the page of a large fleet asked for

    # ---- layout -----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        """Header, findings, the selected finding, the ranks, the boxes."""
        yield JobHeader()
        yield Static("", id="ok")
        yield FindingsList(id="findings", classes="hidden")
        yield FindingDetail("", id="finding", classes="hidden")
        yield RanksHeader()
        yield RanksView(id="ranks")
        yield Input(placeholder="filter: 3  0-7  starved  lost  node-name   (enter keeps, "
                                "escape clears)", id="filter", classes="hidden")
        yield Input(placeholder="go to: 90 · 5:30 · 1:02:03 · step 1200", id="goto",
                    classes="hidden")
        yield Footer()

    def on_mount(self) -> None:
        """The ranks have the focus; draw what came before the widgets existed."""
        self.query_one(RanksView).focus()
        self.query_one(RanksHeader).show(self.sort_key, self.reverse)
        self._drawn = True
        if self._source is not None:
            self.show_source(*self._source)
        if self.snapshot is not None:
            self.show_snapshot(self.snapshot)

    def on_screen_resume(self) -> None:
        """Back on the overview: redraw with the latest snapshot, ask for its page."""
        if self._drawn:
            self._show_rows()
        self.post_message(ViewChanged())

    def view_request(self) -> ViewRequest:
        """The table's lines on screen (a large fleet's page, or its nodes and those
        unfolded)."""
        if self.grouped:
            return ViewRequest(nodes=tuple(sorted(self.unfolded))[:MAX_NODES], top=0)
        first = tuple(sorted(self.highlight)) if self.sort_key == "worst" else ()
        return ViewRequest(top=0, pages={"table": Page(
            sort=self.sort_key, reverse=self.reverse, filter=self.filter_text,
            offset=self.page_offset, limit=self.page_limit, first=first)})

    def _view_changed(self) -> None:
        self.post_message(ViewChanged())

    def on_ranks_view_need_rows(self, event: RanksView.NeedRows) -> None:
        """Scrolled beyond the page the table holds: ask for the lines on screen."""
        event.stop()
        self.page_offset = max(0, event.top - event.height)
        self.page_limit = min(MAX_PAGE_ROWS, 3 * event.height)
        self._view_changed()

    # ---- data in ------------------------------------------------------------------------

    def show_snapshot(self, snap: Snapshot) -> None:
        """Draw a new snapshot: header, findings, rows."""
        large = self._ranks() > getattr(self.app, "fleet_above", 0)
        self.snapshot = snap
        if large != (self._ranks() > getattr(self.app, "fleet_above", 0)):
            self.refresh_bindings()
        if not self._drawn:
            return  # on_mount draws it
        self.query_one(JobHeader).show(snap)
        self._show_findings(snap["findings"])
        self._show_rows()

    def show_source(self, text: str, error: bool) -> None:
        """Say in the header what the source is doing (an error in red)."""
        self._source = text, error
        if not self._drawn:
            return  # on_mount says it
        header = self.query_one(JobHeader)
        header.source_text, header.source_error = text, error
        header.show(self.snapshot)

    def open_goto(self) -> None:
        """Open the go-to box."""
        box = self.query_one("#goto", Input)
        box.remove_class("hidden")
        box.focus()

    def _ranks(self) -> int:
        if self.snapshot is None:
            return 0
        fleet = self.snapshot.get("fleet")
        return fleet["ranks"] if fleet is not None else len(self.snapshot["ranks"]["rank"])

    def _show_findings(self, findings: Sequence[FindingDict]) -> None:
        lst = self.query_one(FindingsList)
        ok = self.query_one("#ok", Static)
        lst.show(findings)
        lst.set_class(not findings, "hidden")
        ok.set_class(bool(findings), "hidden")
        if not findings:
            n = self._ranks()
            ok.update(f"✓ no problems found across {n} rank{'s' if n != 1 else ''}"
                      if n else "waiting for ranks to report…")
            self.highlight = set()
            self.query_one(FindingDetail).add_class("hidden")
        self._show_finding_detail()

    def _show_finding_detail(self) -> None:
        detail = self.query_one(FindingDetail)
        if detail.has_class("hidden"):
            return
        f = self.query_one(FindingsList).selected
        if f is None:
            detail.add_class("hidden")
            return
        detail.update(evidence_text(f))

    def rows(self) -> list[RankRow | NodeRow]:
        """The table's lines: filtered, sorted, highlighted ranks first, grouped."""
        if self.snapshot is None:
            return []
        rows = rank_rows(self.snapshot, self.highlight)
        if self.filter_text:
            keep = parse_filter(self.filter_text)
            rows = [r for r in rows if keep(r)]
        rows = sort_rows(rows, self.sort_key, self.reverse)
        if self.highlight and self.sort_key == "worst":
            rows = [r for r in rows if r.highlighted] + [r for r in rows if not r.highlighted]
        if self.grouped:
            return group_rows(rows, self.unfolded, self.fold_all)
        lines: list[RankRow | NodeRow] = list(rows)
        return lines

    def _paged(self) -> bool:
        """Whether the snapshot holds only some ranks' rows (a large fleet's view)."""
        fleet = self.snapshot.get("fleet") if self.snapshot is not None else None
        return fleet is not None and fleet["partial"]

    def _show_rows(self) -> None:
        view = self.query_one(RanksView)
        if not self._paged():
            view.set_rows(self.rows())
            return
        snap = self.snapshot
        assert snap is not None and "fleet" in snap
        rows = rank_rows(snap, self.highlight)
        if self.grouped:
            view.set_rows(view_node_rows(snap, rows, self.unfolded, self.fold_all,
                                         self.filter_text))
            return
        page = snap["fleet"]["pages"].get("table")
        if page is None:  # a snapshot of another screen's view: keep what is shown
            return
        by_rank = {r.rank: r for r in rows}
        lines: list[RankRow | NodeRow] = [by_rank[r] for r in page["ranks"] if r in by_rank]
        view.set_window(lines, page["offset"], page["total"])

    # ---- findings ---------------------------------------------------------------------

    def on_option_list_option_highlighted(self, event: FindingsList.OptionHighlighted) -> None:
        """Highlight the finding's ranks in the table."""
        f = self.query_one(FindingsList).selected
        self.highlight = set(f["ranks"]) if f else set()
        self._show_finding_detail()
        self._show_rows()
        self._view_changed()

    def on_option_list_option_selected(self, event: FindingsList.OptionSelected) -> None:
        """Enter on a finding: show its evidence and fix (enter again hides it)."""
        detail = self.query_one(FindingDetail)
        detail.set_class(not detail.has_class("hidden"), "hidden")
        self._show_finding_detail()

    # ---- the table ----------------------------------------------------------------------

    def on_ranks_view_node_toggled(self, event: RanksView.NodeToggled) -> None:
        """Fold or unfold a node."""
        event.stop()
        self.unfolded ^= {event.node}
        self._show_rows()
        self._view_changed()

    def on_ranks_header_sort_clicked(self, event: RanksHeader.SortClicked) -> None:
        """Sort by the clicked column (again: reverse)."""
        event.stop()
        if event.sort == self.sort_key:
            self.reverse = not self.reverse
        else:
            self.sort_key, self.reverse = event.sort, False
        self._resort()

    def _resort(self) -> None:
        self.query_one(RanksHeader).show(self.sort_key, self.reverse)
        self._show_rows()
        self._view_changed()

    def action_sort(self, delta: int) -> None:
        """Next (or previous) sort column."""
        i = SORT_ORDER.index(self.sort_key) if self.sort_key in SORT_ORDER else 0
        self.sort_key, self.reverse = SORT_ORDER[(i + delta) % len(SORT_ORDER)], False
        self._resort()

    def action_reverse(self) -> None:
        """Reverse the sort."""
        self.reverse = not self.reverse
        self._resort()

    def action_worst(self) -> None:
        """Back to worst first."""
        self.sort_key, self.reverse = "worst", False
        self._resort()

    def action_group(self) -> None:
        """Group by node (folded when there are many ranks)."""
        self.grouped = not self.grouped
        self.fold_all, self.unfolded = self._ranks() > FOLD_ABOVE, set()
        self._show_rows()
        self._view_changed()

    # ---- what the app does -------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The fleet view's key shows for a job large enough to open on it."""
        if action == "fleet":
            return self._ranks() > getattr(self.app, "fleet_above", 0)
        return True

    async def action_fleet(self) -> None:
        """Open the fleet view (the app pushes it)."""
        await self.app.run_action("fleet")

    async def action_fabric(self) -> None:
        """Open the fabric view (the app pushes it)."""
        await self.app.run_action("fabric")

    async def action_scaling(self) -> None:
        """Open the scaling view (the app pushes it)."""
        await self.app.run_action("scaling")

    def chosen_ranks(self) -> list[int] | None:
        """The ranks an action is for: those a finding highlights, else the rank under
        the cursor, else None (every rank)."""
        if self.highlight:
            return sorted(self.highlight)
        with contextlib.suppress(NoMatches):
            row = self.query_one(RanksView).current
            rank = getattr(row, "rank", None)
            if isinstance(rank, int):
                return [rank]
        return None

    async def action_act(self, action: str) -> None:
        """Profile, probe or stacks (the app runs it)."""
        await self.app.run_action(f"act({action!r})")

    async def action_goto(self) -> None:
        """Open the go-to box, if the app's source can seek."""
        await self.app.run_action("goto")

    # ---- the boxes ----------------------------------------------------------------------

    def action_filter(self) -> None:
        """Open the filter box."""
        box = self.query_one("#filter", Input)
        box.remove_class("hidden")
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        """Filter as you type."""
        if event.input.id == "filter":
            self.filter_text = event.value
            self._show_rows()
            self._view_changed()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Keep the filter; or ask the app to go to a time or step."""
        event.stop()
        event.input.add_class("hidden")
        self.query_one(RanksView).focus()
        if event.input.id == "goto":
            event.input.value = ""
            self.post_message(self.GotoRequested(event.value))

    def action_clear(self) -> None:
        """Escape: close a box, drop the filter, or unselect the finding."""
        for box in self.query(Input):
            if not box.has_class("hidden"):
                box.add_class("hidden")
                if box.id == "filter":
                    box.value = ""
                    self.filter_text = ""
                self.query_one(RanksView).focus()
                self._show_rows()
                self._view_changed()
                return
        self.filter_text = ""
        self.highlight = set()
        self.query_one(FindingDetail).add_class("hidden")
        self.query_one(RanksView).focus()
        self._show_rows()
        self._view_changed()
