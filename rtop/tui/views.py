"""The fabric and scaling views and the help screen.

Names (nodes) go into the tables as :class:`~rich.text.Text`, never as a string: a
table parses a string cell as markup, and a node named ``[/]`` or
``[@click=app.quit]x`` must show as just that.
"""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Static

from rtop.fmt import NA, fmt_bytes, fmt_ms, fmt_pct, fmt_rate, num, safe_text
from rtop.run.snapshot import Snapshot
from rtop.tui.model import rank_rows


def ratio_bar(value: float | None, expected: float | None, width: int = 24) -> Text:
    """How much of the expected a value is, as a bar (red under half)."""
    if value is None or not expected:
        return Text(NA, "dim")
    r = max(0.0, value / expected)
    n = min(width, round(width * min(r, 1.0)))
    style = "red" if r < 0.5 else "yellow" if r < 0.8 else "green"
    return Text("█" * n + "·" * (width - n), style) + Text(f" {r:.0%}")


class FabricScreen(Screen[None]):
    """Bus bandwidth per node and per rank against what the fabric should give."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,f", "app.pop_screen", "back")]

    def compose(self) -> ComposeResult:
        """One scrolling page."""
        with VerticalScroll():
            yield Static("", id="fabric")
        yield Footer()

    def show_snapshot(self, snap: Snapshot) -> None:
        """Redraw."""
        ov = snap["overview"]
        expected = num(ov.get("expected_busbw_Bps"))
        out = Text()
        out.append("Fabric: ", "bold")
        out.append(safe_text(str(ov.get("fabric") or "unknown")), "bold cyan")
        out.append(f"  expected bus bandwidth {fmt_rate(expected)}  " if expected else
                   "  (no expected bandwidth for this fabric class)  ")
        out.append("busbw = bytes/t × 2(n−1)/n, from the rank that reaches the allreduce last\n",
                   "dim")
        nodes = snap["nodes"]
        t = Table(title="per node (worst rank)", expand=False, box=None, title_justify="left")
        for c in ("node", "ranks", "up", "busbw", "vs expected", "comm ms"):
            t.add_column(c, justify="right" if c not in ("node", "vs expected") else "left")
        for i, name in enumerate(nodes["node"]):
            bus = num(nodes["busbw_Bps"][i])
            t.add_row(Text(safe_text(str(name))), str(nodes["ranks"][i]),
                      str(nodes["active"][i]), fmt_rate(bus),
                      ratio_bar(bus, expected), fmt_ms(nodes["comm_s"][i]))
        rows = sorted((r for r in rank_rows(snap) if r.busbw is not None),
                      key=lambda r: r.busbw or 0.0)
        rt = Table(title=f"per rank, slowest first ({min(len(rows), 32)} of {len(rows)})",
                   box=None, title_justify="left")
        for c in ("rank", "node", "busbw", "vs expected", "comm ms", "exposed ms"):
            rt.add_column(c, justify="right" if c not in ("node", "vs expected") else "left")
        for r in rows[:32]:
            rt.add_row(str(r.rank), Text(r.node), fmt_rate(r.busbw), ratio_bar(r.busbw, expected),
                       fmt_ms(r.comm_s), fmt_ms(r.exposed_s))
        note = Text("\nPairwise probe matrix: not measured in this run "
                    "(the on-demand link probe fills it).", "dim")
        self.query_one("#fabric", Static).update(_group(out, t, rt, note))


class ScalingScreen(Screen[None]):
    """Efficiency now and what more ranks would give."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,e", "app.pop_screen", "back")]

    def compose(self) -> ComposeResult:
        """One page."""
        with VerticalScroll():
            yield Static("", id="scaling")
        yield Footer()

    def show_snapshot(self, snap: Snapshot) -> None:
        """Redraw."""
        sc = snap["overview"].get("scaling")
        out = Text()
        if sc is None:
            out.append("Scaling: not enough steps from two or more ranks yet.", "dim")
            self.query_one("#scaling", Static).update(out)
            return
        eff = num(sc["efficiency"])
        out.append("Scaling efficiency ", "bold")
        out.append(fmt_pct(eff, 100), "bold green" if (eff or 0) >= 0.6 else "bold yellow")
        out.append("  = compute / (compute + allreduce not hidden behind backward)\n")
        out.append(f"  compute {fmt_ms(sc['compute_s'])} ms · allreduce "
                   f"{fmt_ms(sc['comm_s'])} ms, of which exposed "
                   f"{fmt_ms(sc['comm_exposed_s'])} ms · {fmt_bytes(sc['comm_bytes'])} "
                   f"per step at {fmt_rate(sc['busbw_Bps'])} bus bandwidth\n"
                   f"  without any overlap: {fmt_pct(sc['efficiency_no_overlap'], 100)}\n",
                   "dim")
        out.append("\nWhat if: more ranks, the same per-rank batch and fabric, no overlap\n",
                   "bold")
        t = Table(box=None)
        for c in ("ranks", "allreduce ms", "efficiency", "throughput vs now"):
            t.add_column(c, justify="right")
        what = sc["what_if"]
        base = what[0] if what else None
        base_eff = num(base["efficiency"]) if base is not None else None
        for w in what:
            e = num(w["efficiency"])
            speed = ""
            if base is not None and e and base_eff:
                speed = f"{w['ranks'] * e / (base['ranks'] * base_eff):.2f}×"
            t.add_row(str(w["ranks"]), fmt_ms(w["comm_s"]), fmt_pct(e, 100), speed)
        lever = Text("\nLevers: a larger per-rank batch (more compute per byte), a faster "
                     "fabric (more busbw), better overlap (bucket_cap_mb, static_graph), "
                     "fewer bytes (bf16 gradient compression).", "dim")
        self.query_one("#scaling", Static).update(_group(out, t, lever))


def _group(*parts: RenderableType) -> Group:
    return Group(*parts)


class HelpScreen(ModalScreen[None]):
    """Every key."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 78; max-height: 90%; height: auto;
        background: $panel; border: round $accent; padding: 0 1; }
    """

    KEYS = (
        ("Everywhere", ""),
        ("?", "this help"), ("q", "quit (back, on a sub-screen)"), ("escape", "back / clear"),
        ("Overview", ""),
        ("tab", "switch between the findings and the ranks"),
        ("↑ ↓ pgup pgdn home end", "move"),
        ("enter", "findings: show its evidence and fix; ranks: open the rank (fold a node)"),
        ("s / S", "sort by the next / previous column (click a title too)"),
        ("r", "reverse the sort"), ("w", "worst first (the default)"),
        ("g", "group by node; enter folds or unfolds a node"),
        ("/", "filter: ranks (3, 0-7), a badge (starved), a status (lost), a node name"),
        ("f", "fabric view"), ("e", "scaling efficiency view"),
        ("Rank detail", ""), ("← → [ ]", "previous / next rank"),
        ("Replay", ""),
        ("space", "pause / play"), ("+ -", "faster / slower (¼× to 64×)"),
        ("← →", "back / forward 10 s"), ("shift+← shift+→", "back / forward 60 s"),
        (":", "go to a time (90, 5:30, 1:02:03) or a step (step 1200)"),
    )

    def compose(self) -> ComposeResult:
        """The key table."""
        t = Table(box=None, show_header=False)
        t.add_column(style="bold cyan", no_wrap=True)
        t.add_column()
        for k, v in self.KEYS:
            if not v:
                t.add_row(Text(k, "bold underline"), "")
            else:
                t.add_row(k, v)
        with VerticalScroll():
            yield Static(Text("rtop — keys", "bold"))
            yield Static(t)
        yield Footer()  # over the overview's: the keys that work here
