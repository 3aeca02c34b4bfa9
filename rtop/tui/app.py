"""The rtop terminal UI: the overview first, the other screens on top of it.

The app owns no socket and no file: a :class:`~rtop.tui.source.Source` runs in a worker
thread and posts snapshots; the app hands each one to every screen on the stack that
shows snapshots (:mod:`rtop.tui.protocols`), pushes the screens, and drives a replay.
``make_app`` is what the CLI, the tests, the screenshot script and the benchmarks all
call.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Any, ClassVar

from textual import work
from textual.app import App
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.screen import Screen

from rtop.analysis.viewport import ViewRequest, viewport
from rtop.fmt import fmt_ranks, safe_text
from rtop.run.snapshot import Scaling, Snapshot
from rtop.tui.detail import RankScreen
from rtop.tui.fleet import FleetScreen
from rtop.tui.heatmap import FleetMap
from rtop.tui.messages import DetailReceived, SnapshotReceived, SourceStatus, ViewChanged
from rtop.tui.model import all_ranks
from rtop.tui.node_view import NodeScreen
from rtop.tui.overview import OverviewScreen
from rtop.tui.protocols import RankDetailView, SnapshotView
from rtop.tui.ranks import RanksView
from rtop.tui.source import LiveSource, ReplaySource, Source
from rtop.tui.views import FabricScreen, HelpScreen, ScalingScreen


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
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("question_mark", "help", "help"),
        Binding("space", "pause", "pause/play", show=False),
        Binding("plus,equals_sign", "speed(1)", "faster", show=False),
        Binding("minus", "speed(-1)", "slower", show=False),
        Binding("left", "seek(-10)", "-10 s", show=False),
        Binding("right", "seek(10)", "+10 s", show=False),
        Binding("shift+left", "seek(-60)", "-60 s", show=False),
        Binding("shift+right", "seek(60)", "+60 s", show=False),
    ]

    def __init__(self, source: Source, fleet_above: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source = source
        #: a job of more ranks than this opens on the fleet view (the table stays a key
        #: away); :func:`default_fleet_above` reads the setting
        self.fleet_above = fleet_above if fleet_above is not None else default_fleet_above()
        self.snapshot: Snapshot | None = None
        self.snapshots_seen = 0
        self.last_scaling: Scaling | None = None
        self._overview: OverviewScreen | None = None
        self._fleet_opened = False
        self._stop = threading.Event()

    def get_default_screen(self) -> OverviewScreen:
        """The overview is the screen at the bottom of the stack."""
        self._overview = OverviewScreen()
        return self._overview

    @property
    def overview(self) -> OverviewScreen:
        """The overview screen (the app must be running)."""
        assert self._overview is not None, "the app is not running"
        return self._overview

    def on_mount(self) -> None:
        """Start the source."""
        self.title = f"rtop · {safe_text(self.source.title)}"
        self._run_source()

    @work(thread=True, exclusive=True, name="source")
    def _run_source(self) -> None:
        self.source.run(self.post_message, self._stop)

    def on_unmount(self) -> None:
        """Stop the source's thread."""
        self._stop.set()
        self.source.wake.set()

    # ---- data in: to every screen that shows it ----------------------------------------

    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        """Hand a new snapshot to every screen that shows snapshots."""
        if not self.screen_stack:  # shutting down
            return
        snap = message.snapshot
        if "fleet" not in snap:  # a source that sent every row: the view is made here
            snap = viewport(snap, self.source.view)
        scaling = snap["overview"].get("scaling")
        if scaling is not None:
            self.last_scaling = scaling
        elif self.last_scaling is not None:  # the job ended: keep the last figures
            overview = snap["overview"].copy()
            overview["scaling"] = self.last_scaling
            snap["overview"] = overview
        self.snapshot = snap
        self.snapshots_seen += 1
        for screen in list(self.screen_stack):
            if isinstance(screen, SnapshotView):
                with contextlib.suppress(NoMatches):  # its widgets are gone: closing
                    screen.show_snapshot(snap)
        fleet = snap.get("fleet")
        world = max(snap["run"]["world_size"] or 0, fleet["ranks"] if fleet else 0)
        if not self._fleet_opened and world:
            self._fleet_opened = True  # once: after that, the user chooses
            if world > self.fleet_above and self.screen is self._overview:
                self._push_view(FleetScreen())

    def on_view_changed(self, message: ViewChanged) -> None:
        """A screen shows other rows: ask the source for the top screen's view."""
        self.want_view()

    def want_view(self) -> None:
        """Ask the source for the rows the screens show (each screen's
        ``view_request()``, the one on top first) and the followed rank's."""
        if not self.screen_stack:
            return
        views = []
        for screen in reversed(self.screen_stack):
            want = getattr(screen, "view_request", None)
            if callable(want):
                with contextlib.suppress(NoMatches):  # not composed yet, or closing
                    views.append(want())
        rank = self.source.detail_rank
        ranks = [*(r for v in views for r in v.ranks), *([rank] if rank is not None else [])]
        pages = {}
        for v in reversed(views):  # the top screen's page wins a name both use
            pages.update(v.pages)
        self.source.want(ViewRequest(
            ranks=tuple(dict.fromkeys(ranks)),
            nodes=tuple(dict.fromkeys(n for v in views for n in v.nodes)),
            top=max((v.top for v in views), default=0), pages=pages))

    def on_detail_received(self, message: DetailReceived) -> None:
        """Hand a rank's detail to the screens that show one."""
        if not self.screen_stack:  # shutting down
            return
        for screen in list(self.screen_stack):
            if isinstance(screen, RankDetailView):
                screen.show_detail(message.detail)

    def on_source_status(self, message: SourceStatus) -> None:
        """Show what the source is doing (and errors, loudly)."""
        if not self.screen_stack:  # shutting down
            return
        with contextlib.suppress(NoMatches):
            self.overview.show_source(message.text, message.error)
        if message.error:  # the text may quote a hub's or a file's words: never markup
            self.notify(message.text, severity="error", timeout=4, markup=False)

    # ---- screens ------------------------------------------------------------------------

    def _push_view(self, screen: Screen[Any]) -> None:
        """Push a screen; one that shows snapshots gets the latest at once."""
        self.push_screen(screen)
        if self.snapshot is not None and isinstance(screen, SnapshotView):
            # the latest when it runs: newer snapshots may have been shown by then
            self.call_after_refresh(self._show_latest, screen)

    def _show_latest(self, screen: SnapshotView) -> None:
        if self.snapshot is not None:
            with contextlib.suppress(NoMatches):  # closed already
                screen.show_snapshot(self.snapshot)

    def on_ranks_view_rank_chosen(self, event: RanksView.RankChosen) -> None:
        """Open a rank's detail, and ask the source for it until it closes."""
        self.open_rank(event.rank)

    def open_rank(self, rank: int) -> None:
        """Push a rank's detail screen, and follow that rank until it closes."""
        ranks = all_ranks(self.snapshot) if self.snapshot is not None else []
        self.push_screen(RankScreen(rank, ranks), callback=lambda _: self.follow(None))
        self.follow(rank)

    def on_fleet_map_opened(self, event: FleetMap.Opened) -> None:
        """Enter in the fleet view: a rank's detail, or a node's ranks."""
        if event.rank is not None:
            self.open_rank(event.rank)
        else:
            self._push_view(NodeScreen(event.node))

    def action_fleet(self) -> None:
        """The fleet view (above the table)."""
        if not isinstance(self.screen, FleetScreen):
            self._fleet_opened = True
            self._push_view(FleetScreen())

    def on_rank_screen_switched(self, event: RankScreen.Switched) -> None:
        """The rank screen moved to another rank: follow that one."""
        self.follow(event.rank)

    def follow(self, rank: int | None) -> None:
        """Ask the source for this rank's detail (None: stop)."""
        self.source.follow(rank)
        self.want_view()

    def action_help(self) -> None:
        """Every key."""
        self.push_screen(HelpScreen())

    def action_fabric(self) -> None:
        """Bus bandwidth per node and rank."""
        self._push_view(FabricScreen())

    def action_scaling(self) -> None:
        """Efficiency and the what-if."""
        self._push_view(ScalingScreen())

    # ---- acting on the job: profile, probe, stacks ----------------------------------------

    def action_act(self, action: str) -> None:
        """Profile the chosen ranks (``p``), probe every link (``b``) or show every
        rank's stacks (``k``) of a live job; the result opens in its own screen."""
        if not isinstance(self.source, LiveSource):
            self.notify(f"{action}: a recording cannot be acted on; attach to a running "
                        f"job (`rtop attach`)", severity="warning", timeout=4)
            return
        ranks = self.overview.chosen_ranks() if action == "profile" else None
        args: dict[str, Any] = {"steps": 5} if action == "profile" else {}
        who = f"ranks {fmt_ranks(ranks)}" if ranks else "every rank"
        what = {"profile": "capturing 5 steps with torch.profiler on",
                "probe": "measuring every link between the ranks (the job pauses) on",
                "stacks": "asking for the stacks of"}[action]
        self.notify(f"{what} {who} ...", timeout=4, markup=False)
        self._act(action, ranks, args)

    @work(thread=True, exclusive=False, name="act")
    def _act(self, action: str, ranks: list[int] | None, args: dict[str, Any]) -> None:
        from rtop.client import HubError

        assert isinstance(self.source, LiveSource)

        def started(p: dict[str, Any]) -> None:
            if p.get("recheck"):
                n = p.get("links")
                self.call_from_thread(
                    self.notify, f"probe: re-measuring the {n} slow link"
                    f"{'s' if n != 1 else ''} before naming {'them' if n != 1 else 'it'} ...",
                    timeout=4, markup=False)

        try:
            out = self.source.act(action, ranks, args, on_started=started)
        except (HubError, OSError) as exc:
            self.call_from_thread(self.notify, f"{action}: {exc}", severity="error",
                                  timeout=8, markup=False)
            return
        self.call_from_thread(self.show_action, action, out)

    def show_action(self, action: str, out: dict[str, Any]) -> None:
        """Show an action's answer from the hub in its screen."""
        from rtop.actions import action_result

        result = action_result(out)
        problems = len(result.get("missing") or []) + len(result.get("errors") or {})
        if result.get("cancelled"):
            self.notify(f"{action}: {result['cancelled']}", severity="error", timeout=8,
                        markup=False)
        elif problems:
            self.notify(f"{action}: {problems} rank(s) did not answer; see the result",
                        severity="warning", timeout=6)
        if action == "profile":
            from rtop.tui.profile_view import ProfileScreen

            self.push_screen(ProfileScreen(result))
        elif action == "stacks":
            from rtop.tui.stacks_view import StacksScreen

            self.push_screen(StacksScreen(result))
        elif not result.get("cancelled"):
            findings = result.get("findings") or []
            self.notify("; ".join(safe_text(str(f.get("summary"))) for f in findings)
                        if findings else "probe: every link is healthy",
                        severity="warning" if findings else "information", timeout=8,
                        markup=False)
            self._push_view(FabricScreen())

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
            src.toggle_pause()

    def action_speed(self, delta: int) -> None:
        """Faster or slower."""
        src = self._replay()
        if src is not None:
            src.faster(delta)

    def action_seek(self, seconds: float) -> None:
        """Jump back or forward."""
        src = self._replay()
        if src is not None:
            src.seek(max(0.0, src.position + seconds))

    def action_goto(self) -> None:
        """Open the go-to box (the fleet view's, else the overview's)."""
        if self._replay() is not None:
            target = self.screen if isinstance(self.screen, FleetScreen) else self.overview
            target.open_goto()

    def on_overview_screen_goto_requested(self, event: OverviewScreen.GotoRequested) -> None:
        """Go to the time or step typed in the go-to box."""
        target = parse_goto(event.text)
        if target is None:
            self.notify("go to: a time like 90, 5:30 or 1:02:03, or 'step 1200'",
                        severity="warning")
        elif isinstance(self.source, ReplaySource):
            what, value = target
            if what == "step":
                self.source.seek_step(int(value))
            else:
                self.source.seek(value)


#: A job of more ranks than this opens on the fleet view, unless ``RTOP_FLEET_ABOVE``
#: says otherwise.
FLEET_ABOVE = 64


def default_fleet_above() -> int:
    """``RTOP_FLEET_ABOVE`` (a number of ranks), else :data:`FLEET_ABOVE`; a value that
    is not a number is ignored, with a warning on stderr."""
    raw = os.environ.get("RTOP_FLEET_ABOVE", "").strip()
    if not raw:
        return FLEET_ABOVE
    try:
        return max(0, int(raw))
    except ValueError:
        import sys

        print(f"rtop: RTOP_FLEET_ABOVE={raw!r} is not a number of ranks; using "
              f"{FLEET_ABOVE}", file=sys.stderr)
        return FLEET_ABOVE


def make_app(source: Source, fleet_above: int | None = None) -> RtopApp:
    """The app on a source (live hub, recording or fixed snapshots); a job of more than
    ``fleet_above`` ranks (default :func:`default_fleet_above`) opens on the fleet view."""
    return RtopApp(source, fleet_above=fleet_above)
