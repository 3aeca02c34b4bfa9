"""The result of a profiler capture (``p``): per rank, the compute / comm / idle split as
a bar, the top operators by self time and the trace's path.

Operator names and paths come from the ranks: they go into the page as
:class:`~rich.text.Text` (never markup), so ``[@click=app.quit]`` shows as just that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from rtop.actions.profile import (
    MAX_NAME,
    MAX_PATH,
    PARTS,
    bar_cells,
    open_hint,
    problems,
    split_parts,
)
from rtop.fmt import NA, fmt_ms, num, safe_text


def split_bar(rank: Mapping[str, Any], width: int = 48) -> Text:
    """Compute alone / compute + comm / comm alone / idle as one coloured bar."""
    parts = split_parts(rank)
    if parts is None:
        return Text(NA, "dim")
    text = Text()
    for (_, glyph, colour), n in zip(PARTS, bar_cells(parts, width), strict=True):
        text.append(glyph * n, colour)
    return text


def _legend(rank: Mapping[str, Any]) -> Text:
    wall = num(rank.get("wall_s"))
    text = Text()
    for label, glyph, colour in PARTS:
        text.append(f"{glyph} ", colour)
        text.append(f"{label}  ")
    text.append("\n")
    for label, key in (("compute", "compute_s"), ("comm", "comm_s"), ("idle", "idle_s")):
        v = num(rank.get(key))
        share = f" ({v / wall:.0%})" if v is not None and wall else ""
        text.append(f"{label} {fmt_ms(v)} ms{share}   ", "bold" if label == "comm" else "")
    overlap = num(rank.get("overlap_s"))
    if overlap:
        text.append(f"comm while compute ran {fmt_ms(overlap)} ms", "dim")
    return text


def rank_section(rank: Mapping[str, Any], path: str | None) -> RenderableType:
    """One rank: title, bar and legend, top operators, trace path."""
    where = "GPU" if rank.get("timeline") == "gpu" else "CPU"
    steps = rank.get("steps")
    title = Text()
    title.append(f"rank {rank.get('rank')}", "bold cyan")
    if isinstance(steps, list) and len(steps) == 2:
        title.append(f"  steps {steps[0]}-{steps[1]}")
    title.append(f"  {fmt_ms(rank.get('wall_s'))} ms over the steps ({where} timeline)", "dim")
    t = Table(box=None, title=f"top operators by self {where} time", title_justify="left")
    t.add_column("self ms", justify="right")
    t.add_column("calls", justify="right")
    t.add_column("operator")
    for o in rank.get("top_ops") or []:
        calls = o.get("calls")
        t.add_row(fmt_ms(o.get("self_s")), str(calls) if calls is not None else NA,
                  Text(safe_text(str(o.get("name")), MAX_NAME)))
    trace = Text("trace: ", "dim")
    trace.append(safe_text(str(path), MAX_PATH) if path else "none written")
    return Group(title, split_bar(rank), _legend(rank), t, trace, Text(""))


class ProfileScreen(Screen[None]):
    """The per-rank summary of a capture, as :func:`rtop.actions.profile.assemble`
    makes it; escape closes."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "dismiss", "back")]
    DEFAULT_CSS = """
    ProfileScreen #head { height: auto; background: $panel; padding: 0 1; }
    ProfileScreen .rank { height: auto; padding: 0 1; }
    """

    def __init__(self, result: Mapping[str, Any]) -> None:
        super().__init__()
        self.result = result

    def compose(self) -> ComposeResult:
        """Head (directory, how to open, problems), then one section per rank."""
        r = self.result
        ranks = (r.get("summary") or {}).get("ranks") or []
        out_dir = safe_text(str(r.get("dir") or ""), MAX_PATH)
        head = Text()
        head.append(f"Profile of {len(ranks)} rank{'s' if len(ranks) != 1 else ''}", "bold")
        head.append(f"  traces in {out_dir}\n")
        head.append(open_hint(out_dir), "dim")
        for line in problems(r):
            head.append(f"\n{line}", "yellow")
        yield Static(head, id="head")
        paths = {t.get("rank"): t.get("path") for t in r.get("traces") or []}
        with VerticalScroll():
            if not ranks:
                yield Static(Text("No rank answered with a profile.", "dim"), classes="rank")
            for x in ranks:
                yield Static(rank_section(x, paths.get(x.get("rank"))), classes="rank")
        yield Footer()
