"""The fabric and scaling views and the help screen.

Names (nodes) go into the tables as :class:`~rich.text.Text`, never as a string: a
table parses a string cell as markup, and a node named ``[/]`` or
``[@click=app.quit]x`` must show as just that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Static

from rtop.analysis.viewport import Page, ViewRequest
from rtop.fmt import (
    NA,
    fmt_bytes,
    fmt_duration,
    fmt_ms,
    fmt_num,
    fmt_pct,
    fmt_rate,
    num,
    safe_text,
)
from rtop.run.snapshot import LinksView, Snapshot
from rtop.tui.messages import ViewChanged
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

    def view_request(self) -> ViewRequest:
        """The slowest ranks by bus bandwidth (of a fleet too large to send whole)."""
        return ViewRequest(top=0, pages={"fabric": Page(sort="busbw_Bps", limit=32)})

    def on_screen_resume(self) -> None:
        """On top: ask for the slowest ranks."""
        self.post_message(ViewChanged())

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
        fleet = snap.get("fleet")
        page = fleet["pages"].get("fabric") if fleet is not None and fleet["partial"] \
            else None
        if page is not None:  # a large fleet: the hub's slowest ranks
            by_rank = {r.rank: r for r in rank_rows(snap)}
            rows = [by_rank[r] for r in page["ranks"] if r in by_rank
                    and by_rank[r].busbw_Bps is not None]
            of = page["total"]
        else:
            rows = sorted((r for r in rank_rows(snap) if r.busbw_Bps is not None),
                          key=lambda r: r.busbw_Bps or 0.0)
            of = len(rows)
        rt = Table(title=f"per rank, slowest first ({min(len(rows), 32)} of {of})",
                   box=None, title_justify="left")
        for c in ("rank", "node", "busbw", "vs expected", "comm ms", "exposed ms"):
            rt.add_column(c, justify="right" if c not in ("node", "vs expected") else "left")
        for r in rows[:32]:
            rt.add_row(str(r.rank), Text(r.node), fmt_rate(r.busbw_Bps),
                       ratio_bar(r.busbw_Bps, expected), fmt_ms(r.comm_s),
                       fmt_ms(r.comm_exposed_s))
        probe = snap.get("links")
        note = links_heatmap(probe, snap["t_hub"]) if probe else Text(
            "\nLink probe: no probe yet: press b to measure every link between ranks.", "dim")
        self.query_one("#fabric", Static).update(_group(out, t, rt, note))


#: The heatmap's bands: a link's share of the median link of its kind (between nodes,
#: within a node) -> glyph and colour, so that it reads without colour too.
HEAT_BANDS: tuple[tuple[float, str, str], ...] = (
    (0.9, "█", "green"), (0.7, "▓", "chartreuse3"), (0.5, "▒", "yellow"), (0.0, "░", "red"))
HEAT_SLOW = ("×", "bold red")  # judged slow by the diagnosis (link_slow_fraction)
HEAT_NONE = ("·", "dim")  # not measured
#: Ranks drawn one by one up to this; beyond, nodes (a cell: their slowest link).
HEAT_MAX_RANKS = 64
#: Nodes drawn at most (the ones with the slowest links, in their order).
HEAT_MAX_NODES = 64
HEAT_LISTED = 8  # slowest links listed under the heatmap


def _heat(bps: float | None, median: float | None, slow: bool) -> tuple[str, str]:
    if slow:
        return HEAT_SLOW
    if bps is None or not median:
        return HEAT_NONE
    share = bps / median
    return next((g, c) for lo, g, c in HEAT_BANDS if share >= lo)


def links_heatmap(probe: LinksView, t_hub: float) -> RenderableType:
    """The latest link probe as a heatmap grouped by node (one cell per pair of ranks,
    or per pair of nodes beyond :data:`HEAT_MAX_RANKS` ranks), a legend and its
    slowest links. Node names are drawn as text."""
    ranks, nodes = probe["ranks"], [safe_text(x, 24) for x in probe["nodes"]]
    medians = probe["medians_Bps"]
    slow = {(a, b) for a, b in probe["slow"]}
    cell: dict[tuple[int, int], float] = {}
    for i, j, v in probe["links"]:
        cell[(int(i), int(j))] = float(v)

    def median_of(i: int, j: int) -> float | None:
        return num(medians.get("inter_node" if nodes[i] != nodes[j] else "intra_node"))

    head = Text("\nLink probe", "bold")
    n_nodes = len(dict.fromkeys(nodes))
    head.append(f" {fmt_duration(max(0.0, t_hub - probe['t']))} ago: {len(ranks)} ranks on "
                f"{n_nodes} node{'s' if n_nodes != 1 else ''}, {len(cell)} links measured, "
                f"{fmt_bytes(probe['nbytes'])} per transfer, took "
                f"{fmt_num(probe['seconds'], '.2f')} s; median link between nodes "
                f"{fmt_rate(medians.get('inter_node'))}, within a node "
                f"{fmt_rate(medians.get('intra_node'))}\n")
    grid = Text()
    if len(ranks) <= HEAT_MAX_RANKS:
        label = max([4] + [len(x) for x in nodes])
        width = max(len(str(r)) for r in ranks) if ranks else 1
        for i, r in enumerate(ranks):
            first = i == 0 or nodes[i] != nodes[i - 1]
            grid.append(f"{nodes[i] if first else '':<{label}} {r:>{width}} ",
                        "bold" if first else "")
            for j in range(len(ranks)):
                if j and nodes[j] != nodes[j - 1]:
                    grid.append(" ")
                if i == j:
                    grid.append(" ")
                    continue
                key = (min(i, j), max(i, j))
                grid.append(*_heat(cell.get(key), median_of(i, j), key in slow))
            grid.append("\n")
    else:
        grid.append(_node_grid(ranks, nodes, cell, slow, median_of))
    legend = Text("rows and columns: the ranks in the order shown; each cell against the "
                  "median link of its kind: ")
    for lo, g, c in HEAT_BANDS:
        legend.append(g, c)
        legend.append(f" ≥{lo:.0%}  " if lo else " under 50%  ")
    legend.append(HEAT_SLOW[0], HEAT_SLOW[1])
    legend.append(" slow  ")
    legend.append(HEAT_NONE[0], HEAT_NONE[1])
    legend.append(" not measured\n")
    worst = sorted(cell.items(), key=lambda kv: kv[1] / (median_of(*kv[0]) or kv[1]))
    lt = Table(title="slowest links", box=None, title_justify="left")
    for c in ("rank", "node", "rank ", "node ", "bandwidth", "of median"):
        lt.add_column(c, justify="left" if c.startswith("node") else "right")
    for (i, j), v in worst[:HEAT_LISTED]:
        med = median_of(i, j)
        share = fmt_pct(v / med, 100) if med else NA
        lt.add_row(str(ranks[i]), Text(nodes[i]), str(ranks[j]), Text(nodes[j]), fmt_rate(v),
                   Text(share + (" slow" if (i, j) in slow else ""),
                        "bold red" if (i, j) in slow else ""))
    errors = Text("".join(f"{safe_text(e, 200)}\n" for e in probe["errors"][:8]), "yellow")
    return _group(head, grid, legend, lt, errors)


def _node_grid(ranks: list[int], nodes: list[str], cell: dict[tuple[int, int], float],
               slow: set[tuple[int, int]], median_of: Callable[[int, int], float | None]
               ) -> Text:
    """Nodes against nodes: a cell is the slowest measured link between them (on the
    diagonal, within the node)."""
    names = list(dict.fromkeys(nodes))
    index = {x: k for k, x in enumerate(names)}
    worst: dict[tuple[int, int], tuple[float, float, bool]] = {}  # share, Bps, any slow
    for (i, j), v in cell.items():
        a, b = sorted((index[nodes[i]], index[nodes[j]]))
        med = median_of(i, j)
        share = v / med if med else 1.0
        was = worst.get((a, b), (share, v, False))
        low = (share, v) if share <= was[0] else (was[0], was[1])
        worst[(a, b)] = (*low, was[2] or (i, j) in slow)
    lowest = {k: 1.0 for k in range(len(names))}
    for (a, b), (share, _, _) in worst.items():
        lowest[a], lowest[b] = min(lowest[a], share), min(lowest[b], share)
    shown = sorted(sorted(lowest, key=lambda k: lowest[k])[:HEAT_MAX_NODES])
    label = max([4] + [len(names[k]) for k in shown])
    out = Text(f"{len(shown)} of {len(names)} nodes (those with the slowest links); a cell "
               "is the slowest link between two nodes, the diagonal within the node\n", "dim")
    for a in shown:
        out.append(f"{names[a]:<{label}} ")
        for b in shown:
            got = worst.get((min(a, b), max(a, b)))
            g, c = HEAT_NONE if got is None else HEAT_SLOW if got[2] else next(
                (g, c) for lo, g, c in HEAT_BANDS if got[0] >= lo)
            out.append(g, c)
        out.append("\n")
    return out


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
        out.append("  = compute / (compute + communication not hidden behind compute)\n")
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
        ("v", "the fleet view (a job above RTOP_FLEET_ABOVE ranks opens on it)"),
        ("Fleet view", ""),
        ("← → ↑ ↓", "move over the map (nodes in lines, local ranks in columns)"),
        ("enter", "a rank: its detail; a folded node: its ranks"),
        ("n", "the ranks of the node under the cursor"),
        ("c / C", "colour by the next / previous figure (step, data wait, compute, "
                  "exposed comm, GPU clock, memory headroom)"),
        ("z", "fold: nodes when the ranks do not fit, always ranks, always nodes"),
        ("t", "the ranks table"),
        ("Live job", ""),
        ("p", "profile: torch.profiler over 5 steps on the highlighted ranks, else the "
              "rank under the cursor (these three need the control token)"),
        ("b", "probe: measure every link between the ranks (the job pauses); the "
              "heatmap is in the fabric view"),
        ("k", "stacks: every rank's Python stacks, identical ones grouped"),
        ("Rank detail", ""), ("← → [ ]", "previous / next rank"),
        ("Stacks", ""), ("↑ ↓", "choose a group of ranks"), ("a", "show rtop's own threads"),
        ("Replay", ""),
        ("space", "pause / play"), ("+ -", "faster / slower (¼× to 64×)"),
        ("← →", "back / forward 10 s (the fleet view's arrows move its cursor)"),
        ("shift+← shift+→", "back / forward 60 s"),
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
