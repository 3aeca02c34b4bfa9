"""Every rank's Python stacks, grouped by identical stack (``k``; ``rtop stacks``).

The groups are listed on the left, the smallest first (the rank that differs from the
rest leads), each with its ranks and the function its threads are in; the highlighted
group's stack is on the right, innermost frame first, as ``py-spy dump`` prints it.
Everything from a rank is drawn as :class:`~rich.text.Text`, never markup, cleaned of
control characters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from rtop.actions.stacks import MAIN, RTOP, Group, group, problems, short_path
from rtop.fmt import safe_text

#: The stack pane prints a frame on one line (py-spy's ``function (file:line)``) from
#: this width on, else the place goes on a line of its own.
ONE_LINE_WIDTH = 100
#: Process ids listed in a group's heading.
MAX_PIDS = 8


def group_label(g: Group, odd: bool) -> Text:
    """A group in the list: its ranks, then where its threads are (``odd``: a main
    thread's stack that not every rank shares, in bold yellow); a thread other than the
    main one is named before its function."""
    n = len(g.ranks)
    text = Text(no_wrap=True, overflow="ellipsis")
    style = "bold yellow" if odd else "bold" if g.kind == MAIN else "dim" \
        if g.kind == RTOP else ""
    text.append(f"{'rank' if n == 1 else 'ranks'} {g.ranges}", style)
    text.append(f" ({n})" if n > 1 else "", "dim")
    text.append("\n  ")
    names = [x for x in g.names if x]
    if g.kind != MAIN:
        text.append(safe_text(names[0] if names else "(unnamed)", 40) + " › ",
                    "dim" if g.kind == RTOP else "cyan")
    text.append(safe_text(g.innermost or "(no Python frame)", 200), "green")
    return text


def stack_text(g: Group, one_line: bool) -> Text:
    """A group's heading and stack, innermost frame first."""
    text = Text()
    text.append(safe_text(g.header(), 1024), "bold")
    pids = [(r, p) for r, p in sorted(g.pids.items()) if p is not None]
    if len(g.ranks) > 1 and pids:
        text.append("\npids " + ", ".join(f"{r}:{p}" for r, p in pids[:MAX_PIDS])
                    + (" …" if len(pids) > MAX_PIDS else ""), "dim")
    cut = max((int(t.get("truncated") or 0) for _, t in g.members), default=0)
    if cut:
        text.append(f"\n{cut} frames of a deep stack were not sent (the marker below)", "dim")
    text.append("\n")
    if not g.frames:
        text.append("\n    (no Python frame)", "dim")
    for f in reversed(g.frames):
        fn = safe_text(str(f.get("function")), 200)
        path = str(f.get("file") or "")
        line = f.get("line")
        where = safe_text(short_path(path), 400, keep_end=True) + \
            (f":{line}" if isinstance(line, int) and line else "")
        text.append("\n    ")
        text.append(fn, "green" if path else "dim")
        if path:
            text.append(f" ({where})" if one_line else f"\n        {where}", "cyan")
    return text


class StacksScreen(Screen[None]):
    """The result of ``rtop stacks`` (:func:`rtop.actions.stacks.assemble`): groups of
    identical stacks on the left, the highlighted one's stack on the right."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "back"),
        Binding("a", "toggle_all", "all threads"),
    ]
    DEFAULT_CSS = """
    StacksScreen #title { height: auto; max-height: 6; background: $panel; padding: 0 1; }
    StacksScreen #groups { width: 40%; min-width: 24; max-width: 48; height: 1fr; }
    StacksScreen #pane { width: 1fr; height: 1fr; padding: 0 1; }
    """

    def __init__(self, result: Mapping[str, Any]) -> None:
        super().__init__()
        self.result: Mapping[str, Any] = result
        #: Every thread, rtop's own included (else rtop's are folded).
        self.all_threads = False
        #: The groups listed, in order.
        self.groups: list[Group] = []
        self._shown = 0

    def compose(self) -> ComposeResult:
        """Title, the list of groups and the stack."""
        yield Static("", id="title")
        with Horizontal():
            yield OptionList(id="groups")
            with VerticalScroll(id="pane"):
                yield Static("", id="stack")
        yield Footer()

    def on_mount(self) -> None:
        """Group and draw."""
        self._regroup()
        self.query_one("#groups", OptionList).focus()

    def show_result(self, result: Mapping[str, Any]) -> None:
        """Draw another result (a fresh ``stacks`` answer)."""
        self.result = result
        self._regroup()

    def _regroup(self) -> None:
        groups = group(self.result, which="all" if self.all_threads else "user")
        self.groups = groups
        mains = [g for g in groups if g.kind == MAIN]
        most = max((len(g.ranks) for g in mains), default=0)
        odd = {id(g) for g in mains if len(g.ranks) < most}
        self._draw_title(groups)
        ol = self.query_one("#groups", OptionList)
        ol.set_options([Option(group_label(g, id(g) in odd), id=str(i))
                        for i, g in enumerate(groups)])
        keep = min(self._shown, len(groups) - 1) if groups else 0
        if groups:
            ol.highlighted = keep
        self._show(keep)

    def _draw_title(self, groups: list[Group]) -> None:
        ranks = self.result.get("ranks") or []
        mains = sum(1 for g in groups if g.kind == MAIN)
        title = Text()
        title.append("Python stacks", "bold cyan")
        title.append(f"  {len(ranks)} rank{'s' if len(ranks) != 1 else ''}, "
                     f"{mains} distinct main-thread stack{'s' if mains != 1 else ''}, "
                     "smallest group first")
        rtop_threads = sum(len(g.members) for g in group(self.result, which="all")
                           if g.kind == RTOP)
        if not self.all_threads and rtop_threads:
            title.append(f"  ({rtop_threads} rtop threads folded: a shows them)", "dim")
        for p in problems(self.result):
            title.append(f"\n{safe_text(p, 1024)}", "yellow")
        self.query_one("#title", Static).update(title)

    def _show(self, index: int) -> None:
        self._shown = index
        stack = self.query_one("#stack", Static)
        if not self.groups:
            stack.update(Text("No stacks: no rank answered.", "dim"))
            return
        g = self.groups[max(0, min(index, len(self.groups) - 1))]
        width = self.query_one("#pane").size.width or self.size.width
        stack.update(stack_text(g, width >= ONE_LINE_WIDTH))
        self.query_one("#pane", VerticalScroll).scroll_home(animate=False)

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        """Show the highlighted group's stack."""
        self._show(event.option_index)

    def on_resize(self, event: events.Resize) -> None:
        """One line per frame when wide enough, else two."""
        self.call_after_refresh(self._show, self._shown)

    def action_toggle_all(self) -> None:
        """Unfold or fold rtop's own threads."""
        self.all_threads = not self.all_threads
        self._regroup()

    def action_close(self) -> None:
        """Back to where the screen was opened."""
        self.dismiss(None)
