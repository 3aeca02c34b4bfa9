"""The rtop terminal UI: header, findings first, then the ranks.

The app owns no socket and no file: a :class:`~rtop.tui.source.Source` runs in a worker
thread and posts snapshots; the screens only draw them. ``make_app`` is what the CLI,
the tests, the screenshot script and the benchmarks all call.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.widgets import Footer, Input, Static

from rtop.run.snapshot import FindingDict, Scaling, Snapshot
from rtop.tui.detail import RankScreen
from rtop.tui.findings import FindingDetail, FindingsList, evidence_text
from rtop.tui.header import JobHeader
from rtop.tui.messages import DetailReceived, SnapshotReceived, SourceStatus
from rtop.tui.model import SORT_KEYS, group_rows, parse_filter, rank_rows, sort_rows
from rtop.tui.ranks import COLUMNS, RanksHeader, RanksView
from rtop.tui.source import ReplaySource, Source
from rtop.tui.views import FabricScreen, HelpScreen, ScalingScreen

SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
SORT_ORDER = ["worst"] + [c.sort for c in COLUMNS]


def parse_goto(text: str) -> tuple[str, float] | None:
    """``step 1200`` / ``s1200`` → ("step", 1200); ``90``, ``5:30``, ``1:02:03`` → seconds."""
    t = text.strip().lower()
    m = re.fullmatch(r"(?:step|s)\s*(\d+)", t)
    if m:
        return "step", float(m.group(1))
    parts = t.split(":")
    if 1 <= len(parts) <= 3 and all(p.replace(".", "", 1).isdigit() for p in parts):
        secs = 0.0
        for p in parts:
            secs = secs * 60 + float(p)
        return "time", secs
    return None


class RtopApp(App[int]):
    """rtop: is the job healthy, and if not, which rank and why."""

    TITLE = "rtop"
    CSS = """
    #ok { height: 1; padding: 0 1; color: $success; }
    #status { height: 1; padding: 0 1; }
    #filter, #goto { dock: bottom; height: 3; }
    RanksHeader { height: 1; background: $boost; }
    .hidden { display: none; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("tab", "focus_next", "findings/ranks", show=False),
        Binding("s", "sort(1)", "sort"),
        Binding("S", "sort(-1)", "sort back", show=False),
        Binding("r", "reverse", "reverse"),
        Binding("w", "worst", "worst first", show=False),
        Binding("g", "group", "group by node"),
        Binding("slash", "filter", "filter"),
        Binding("f", "fabric", "fabric"),
        Binding("e", "scaling", "scaling"),
        Binding("escape", "clear", "clear", show=False),
        Binding("space", "pause", "pause/play", show=False),
        Binding("plus,equals_sign", "speed(1)", "faster", show=False),
        Binding("minus", "speed(-1)", "slower", show=False),
        Binding("left", "seek(-10)", "-10 s", show=False),
        Binding("right", "seek(10)", "+10 s", show=False),
        Binding("shift+left", "seek(-60)", "-60 s", show=False),
        Binding("shift+right", "seek(60)", "+60 s", show=False),
        Binding("colon", "goto", "go to", show=False),
    ]

    def __init__(self, source: Source, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source = source
        self.snapshot: Snapshot | None = None
        self.sort_key, self.reverse = "worst", False
        self.grouped = False
        self.fold_all = False
        self.unfolded: set[str] = set()
        self.filter_text = ""
        self.highlight: set[int] = set()
        self.snapshots_seen = 0
        self.last_scaling: Scaling | None = None
        self._stop = threading.Event()

    #: actions on the overview's table: off (and out of the footer) on other screens
    OVERVIEW_ACTIONS = frozenset({"sort", "reverse", "worst", "group", "filter", "fabric",
                                  "scaling", "goto"})

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The table's keys only act on the overview."""
        return not (action in self.OVERVIEW_ACTIONS and len(self.screen_stack) > 1)

    # ---- layout -----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        """Header, findings, the selected finding, the ranks."""
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
        """Start the source; the ranks have the focus."""
        self.title = f"rtop · {self.source.title}"
        self.query_one(RanksView).focus()
        self.query_one(RanksHeader).show(self.sort_key, self.reverse)
        self._run_source()

    @work(thread=True, exclusive=True, name="source")
    def _run_source(self) -> None:
        self.source.run(self.post_message, self._stop)

    def on_unmount(self) -> None:
        """Stop the source's thread."""
        self._stop.set()
        self.source.wake.set()

    # ---- data in ------------------------------------------------------------------------

    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        """Draw a new snapshot everywhere it shows."""
        if not self.screen_stack:  # shutting down
            return
        with contextlib.suppress(NoMatches):  # the widgets are gone: the app is closing
            self._draw(message)

    def _draw(self, message: SnapshotReceived) -> None:
        snap = message.snapshot
        ov = snap.get("overview") or {}
        if ov.get("scaling"):
            self.last_scaling = ov["scaling"]
        elif self.last_scaling is not None:  # the job ended: keep the last figures
            snap["overview"] = {**ov, "scaling": self.last_scaling}
        self.snapshot = snap
        self.snapshots_seen += 1
        self.query_one(JobHeader).show(snap)
        self._show_findings(snap.get("findings") or [])
        self._show_rows()
        screen = self.screen
        if hasattr(screen, "show_snapshot"):
            screen.show_snapshot(snap)

    def on_detail_received(self, message: DetailReceived) -> None:
        """Hand a rank's detail to its screen."""
        if not self.screen_stack:  # shutting down
            return
        screen = self.screen
        if isinstance(screen, RankScreen):
            screen.show_detail(message.detail)

    def on_source_status(self, message: SourceStatus) -> None:
        """Show what the source is doing (and errors, loudly)."""
        if not self.screen_stack:  # shutting down
            return
        try:
            header = self.query_one(JobHeader)
        except NoMatches:
            return
        header.source_text, header.source_error = message.text, message.error
        header.show(self.snapshot)
        if message.error:
            self.notify(message.text, severity="error", timeout=4)

    def _show_findings(self, findings: list[FindingDict]) -> None:
        lst = self.query_one(FindingsList)
        ok = self.query_one("#ok", Static)
        lst.show(findings)
        lst.set_class(not findings, "hidden")
        ok.set_class(bool(findings), "hidden")
        if not findings:
            n = len((self.snapshot or {}).get("ranks", {}).get("rank") or [])
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

    def _rows(self) -> list[Any]:
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
            return group_rows(rows, self.snapshot, self.unfolded, self.fold_all)
        return rows

    def _show_rows(self) -> None:
        self.query_one(RanksView).set_rows(self._rows())

    # ---- findings ---------------------------------------------------------------------

    def on_option_list_option_highlighted(self, event: FindingsList.OptionHighlighted) -> None:
        """Highlight the finding's ranks in the table."""
        f = self.query_one(FindingsList).selected
        self.highlight = set(f.get("ranks") or []) if f else set()
        self._show_finding_detail()
        self._show_rows()

    def on_option_list_option_selected(self, event: FindingsList.OptionSelected) -> None:
        """Enter on a finding: show its evidence and fix (enter again hides it)."""
        detail = self.query_one(FindingDetail)
        detail.set_class(not detail.has_class("hidden"), "hidden")
        self._show_finding_detail()

    # ---- ranks ------------------------------------------------------------------------

    def on_ranks_view_rank_chosen(self, event: RanksView.RankChosen) -> None:
        """Open a rank's detail."""
        ranks = list((self.snapshot or {}).get("ranks", {}).get("rank") or [])
        self.push_screen(RankScreen(event.rank, ranks), callback=lambda _: self.follow(None))
        self.follow(event.rank)

    def on_ranks_view_node_toggled(self, event: RanksView.NodeToggled) -> None:
        """Fold or unfold a node."""
        self.unfolded ^= {event.node}
        self._show_rows()

    def on_ranks_header_sort_clicked(self, event: RanksHeader.SortClicked) -> None:
        """Sort by the clicked column (again: reverse)."""
        if event.sort == self.sort_key:
            self.reverse = not self.reverse
        else:
            self.sort_key, self.reverse = event.sort, False
        self._resort()

    def follow(self, rank: int | None) -> None:
        """Ask the source for this rank's detail (None: stop)."""
        self.source.follow(rank)

    def on_screen_resume(self) -> None:
        """Back on the main screen: redraw with the latest snapshot."""
        self._show_rows()

    def _resort(self) -> None:
        self.query_one(RanksHeader).show(self.sort_key, self.reverse)
        self._show_rows()

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
        n = len((self.snapshot or {}).get("ranks", {}).get("rank") or [])
        self.fold_all, self.unfolded = n > 64, set()
        self._show_rows()

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

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Keep the filter; or go to a time/step."""
        event.input.add_class("hidden")
        self.query_one(RanksView).focus()
        if event.input.id == "goto":
            target = parse_goto(event.value)
            event.input.value = ""
            if target is None:
                self.notify("go to: a time like 90, 5:30 or 1:02:03, or 'step 1200'",
                            severity="warning")
            elif isinstance(self.source, ReplaySource):
                what, value = target
                if what == "step":
                    self.source.seek_step(int(value))
                else:
                    self.source.seek(value)

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
                return
        if self.filter_text:
            self.filter_text = ""
        self.highlight = set()
        self.query_one(FindingDetail).add_class("hidden")
        self.query_one(RanksView).focus()
        self._show_rows()

    def action_help(self) -> None:
        """Every key."""
        self.push_screen(HelpScreen())

    def action_fabric(self) -> None:
        """Bus bandwidth per node and rank."""
        screen = FabricScreen()
        self.push_screen(screen)
        if self.snapshot is not None:
            self.call_after_refresh(screen.show_snapshot, self.snapshot)

    def action_scaling(self) -> None:
        """Efficiency and the what-if."""
        screen = ScalingScreen()
        self.push_screen(screen)
        if self.snapshot is not None:
            self.call_after_refresh(screen.show_snapshot, self.snapshot)

    # ---- replay -------------------------------------------------------------------------

    def _replay(self) -> ReplaySource | None:
        if isinstance(self.source, ReplaySource):
            return self.source
        self.notify("live job: nothing to pause or seek (use `rtop replay RUN`)", timeout=2)
        return None

    def action_pause(self) -> None:
        """Pause or play."""
        src = self._replay()
        if src is not None:
            src.paused = not src.paused
            src.wake.set()

    def action_speed(self, delta: int) -> None:
        """Faster or slower."""
        src = self._replay()
        if src is not None:
            i = min(range(len(SPEEDS)), key=lambda k: abs(SPEEDS[k] - src.speed))
            src.speed = SPEEDS[max(0, min(len(SPEEDS) - 1, i + delta))]
            src.wake.set()

    def action_seek(self, seconds: float) -> None:
        """Jump back or forward."""
        src = self._replay()
        if src is not None:
            src.seek(max(0.0, src.position + seconds))

    def action_goto(self) -> None:
        """Open the go-to box."""
        if self._replay() is not None:
            box = self.query_one("#goto", Input)
            box.remove_class("hidden")
            box.focus()


def make_app(source: Source) -> RtopApp:
    """The app on a source (live hub, recording or fixed snapshots)."""
    return RtopApp(source)


def sort_keys() -> list[str]:
    """Every column the table sorts by."""
    return list(SORT_KEYS)
