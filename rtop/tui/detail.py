"""One rank in full: its recent history as sparklines, its memory split and forecast,
its stack when it is stuck, its checkpoints."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Sparkline, Static

from collectors.figures import figures
from rtop.analysis.throughput import rank_rates
from rtop.fmt import NA, fmt_bytes, fmt_flops, fmt_ms, fmt_rate, num, safe_text
from rtop.run.snapshot import Column, RankDetail, Snapshot
from rtop.tui.columns import FORMATS
from rtop.tui.model import all_ranks, growth_forecast, memory_split, rank_rows

#: One line of the rank detail: (title, history, fields, how to print a value, note).
Line = tuple[str, str, tuple[str, ...], Callable[[float], str], str]


def _lines() -> tuple[Line, ...]:
    out: list[Line] = []
    for f in figures():
        if f.detail is None:
            continue
        src = ("steps" if f.table == "steps" else "samples") if f.window else ""
        if not src and out and not out[-1][1] and out[-1][0] == f.detail.label:
            title, _, names, fmt, note = out[-1]  # the next quantile of a distribution
            out[-1] = (title, "", (*names, f.name), fmt, note)
            continue
        out.append((f.detail.label, src, (f.name,), FORMATS[f.detail.fmt][0], f.detail.note))
    return tuple(out)


#: One line per figure with a ``detail`` (``collectors.figures``), in the table's order:
#: a sparkline of the rank's recent "steps" or "samples", or, with no history (""),
#: statistics of its window (``RankDetail.stats``: the quantiles of one distribution on
#: one line), with their note
SERIES: tuple[Line, ...] = _lines()


#: Recent steps the rank detail's throughput is the median of.
RECENT = 20


def fmt_phase(seconds: object) -> str:
    """How long a phase has lasted: ms under a second, else seconds."""
    v = num(seconds)
    if v is None:
        return NA
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.1f} s"


MEM_PARTS = (("parameters", "█", "cyan"), ("gradients", "▓", "blue"),
             ("optimizer", "▒", "magenta"), ("activations+other", "░", "yellow"),
             ("free", "·", "green"))


def memory_bar(split: dict[str, float], width: int = 60) -> Text:
    """Parameters / gradients / optimizer / activations / free as one bar and a legend."""
    cap = split["capacity"] or 1.0
    text = Text()
    used = 0
    for name, glyph, colour in MEM_PARTS:
        n = min(width - used, round(width * split[name.split("+")[0]] / cap))
        text.append(glyph * n, colour)
        used += n
    text.append(" " * (width - used))
    text.append(f"  {fmt_bytes(cap)}\n")
    for name, glyph, colour in MEM_PARTS:
        text.append(f"{glyph} ", colour)
        text.append(f"{name} {fmt_bytes(split[name.split('+')[0]])}  ")
    return text


def memory_legend(detail: RankDetail) -> Text:
    """Which memory figure is which, for the rank's device (the headroom's basis)."""
    from collectors.schema import MEM_FIELDS

    mem = detail.get("mem")
    m = dict(zip(MEM_FIELDS, mem, strict=False)) if isinstance(mem, (list, tuple)) else {}
    text = Text("\n")
    if str(m.get("device") or "").startswith("cuda"):
        process, reserved = num(m.get("process_bytes")), num(m.get("reserved_bytes"))
        text.append("Figures: used = the allocator's allocated; peak = the allocator's peak "
                    "reserve", "dim")
        if process is not None and reserved is not None:
            text.append(f" + {fmt_bytes(max(0.0, process - reserved))} held outside it "
                        f"(CUDA context, NCCL buffers: NVML counts {fmt_bytes(process)} for "
                        f"this process, the allocator reserves {fmt_bytes(reserved)})", "dim")
        else:
            text.append(" only: NVML could not say what the process holds outside it (CUDA "
                        "context, NCCL buffers), so the headroom may be overstated", "yellow")
        text.append("; capacity = the device's total.", "dim")
    else:
        text.append("Figures: used = the process's resident memory; peak = its high-water "
                    "mark; capacity = the machine's memory or the cgroup's limit, whichever "
                    "is smaller.", "dim")
    return text


def collective_split(detail: RankDetail) -> Text:
    """The rank's collectives one by one (median per step over its recent steps in
    which each ran): time, bytes, calls, bus bandwidth. Empty when it ran allreduces
    only (a DDP job: the "allreduce" series above is theirs) or none."""
    split = detail.get("collectives") or {}
    text = Text()
    if set(split) <= {"all_reduce"}:
        return text
    text.append("Collectives", "bold")
    text.append(" (median per step, over the recent steps each ran in)\n", "dim")
    for op, f in list(split.items())[:16]:
        calls = num(f.get("calls"))
        text.append(f"  {safe_text(op, 64):<15}", "bold")
        text.append(f"{fmt_ms(f.get('s')):>7} ms {fmt_bytes(f.get('bytes')):>9}  "
                    f"{NA if calls is None else f'{calls:g}':>4} calls  busbw "
                    f"{fmt_rate(f.get('busbw_Bps')):>11}  ({f.get('steps', 0)} steps)\n")
    return text


def group_split(detail: RankDetail) -> Text:
    """The rank's collectives per process group (median per step over its recent steps
    in which each ran): empty when every one ran on the default group."""
    groups = detail.get("groups") or {}
    text = Text()
    if not groups:
        return text
    text.append("Collectives per process group", "bold")
    text.append(" (median per step, over the recent steps each ran in)\n", "dim")
    for name, g in list(groups.items())[:8]:
        place = f", its rank {g['rank']} of {g['size']}" if g["rank"] is not None \
            and g["size"] is not None else ""
        text.append(f"  {safe_text(g['desc'] or 'group', 48)}", "bold")
        text.append(safe_text(f" ({name}: ranks {g['ranks'] or '?'}{place})", 160) + "\n",
                    "dim")
        for op, f in list(g["ops"].items())[:8]:
            text.append(f"    {safe_text(op, 64):<15}{fmt_ms(f.get('s')):>7} ms "
                        f"{fmt_bytes(f.get('bytes')):>9}  busbw "
                        f"{fmt_rate(f.get('busbw_Bps')):>11}  ({f.get('steps', 0)} steps)\n")
    return text


def throughput_line(detail: RankDetail) -> Text:
    """The rank's samples/s, tokens/s, model TFLOPS and MFU over its recent steps (their
    medians); empty when none is known."""
    steps = detail.get("steps") or {}

    def median(field: str) -> float | None:
        vals = [v for v in (num(x) for x in (steps.get(field) or [])[-RECENT:]) if v is not None]
        return statistics.median(vals) if vals else None

    meta = detail.get("meta") or {}
    device = meta.get("device")
    gpu = device.get("name") if isinstance(device, dict) else None
    r = rank_rates(median("step_s"), median("samples"), median("tokens"), median("flops"),
                   gpu if isinstance(gpu, str) else None, meta)
    parts = []
    if r["samples_per_s"] is not None:
        parts.append(f"{r['samples_per_s']:,.1f} samples/s")
    if r["tokens_per_s"] is not None:
        parts.append(f"{r['tokens_per_s']:,.0f} tokens/s")
    if r["model_flops_per_s"] is not None:
        parts.append(f"{fmt_flops(r['model_flops_per_s'])} (model)")
        parts.append(f"MFU {r['mfu']:.1%} of the {r['mfu_dtype']} peak"
                     if r["mfu"] is not None else f"MFU {NA} (GPU not in the table)")
    if not parts:
        return Text()
    text = Text("Throughput ", "bold")
    text.append(" · ".join(parts))
    text.append(f"  (medians of its last {RECENT} steps)\n", "dim")
    return text


def hiccup_line(detail: RankDetail) -> Text:
    """The rank's hiccups: steps where it stood out from its peers, too briefly to be a
    fault (empty when it had none)."""
    counts = detail.get("hiccups") or {}
    parts = [f"{n} in {what.replace('_', ' ')}" for what, n in counts.items() if n]
    if not parts:
        return Text()
    return Text(f"Hiccups: {', '.join(parts)} (steps that stood out from its peers, too "
                "briefly to be a fault)\n", "dim")


def collector_notes(detail: RankDetail) -> Text:
    """The rank's collector notes: what is measured and how, and what rtop turned off
    after an error (in yellow)."""
    meta = detail.get("meta") or {}
    notes = [n for n in meta.get("notes") or [] if isinstance(n, str)]
    device = meta.get("device")
    text = Text()
    if isinstance(device, dict) and device.get("name"):
        text.append("\nGPU ", "bold")
        text.append(safe_text(f"{device.get('name')}  {device.get('uuid') or ''}"))
        if device.get("mig"):
            text.append("  (a MIG instance)")
        window = device.get("pcie_window")
        if window == "20ms":
            text.append("\n  PCIe figures are 20 ms snapshots (this driver has no PCIe byte "
                        "counters): read them as noisy.", "dim")
        elif window == "interval":
            text.append("\n  PCIe figures are averaged over each sampling interval.", "dim")
    elif isinstance(meta.get("device_reason"), str):
        text.append(f"\nGPU not measured: {safe_text(meta['device_reason'], 1024)}", "yellow")
    if notes:
        text.append("\nCollector notes\n", "bold")
        for note in notes[-8:]:
            style = "yellow" if note.startswith("rtop turned off") else "dim"
            text.append(f"  {safe_text(note, 1024)}\n", style)
    return text


class Series(Horizontal):
    """A label with the median and latest value, and a sparkline."""

    DEFAULT_CSS = """
    Series { height: 1; }
    Series > Static { width: 42; }
    Series > Sparkline { width: 1fr; }
    """

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.title = title

    def compose(self) -> ComposeResult:
        """Label and sparkline."""
        yield Static(self.title)
        yield Sparkline([])

    def show(self, values: Column, fmt: Callable[[float], str]) -> None:
        """Redraw with these values (None gaps dropped)."""
        vals = [v for v in (num(x) for x in values) if v is not None][-240:]
        label = Text(f"{self.title:<11}", "bold")
        if vals:
            label.append(f"{fmt(vals[-1]):>9} now {fmt(statistics.median(vals)):>9} median")
        else:
            label.append(" not measured", "dim")
        self.query_one(Static).update(label)
        spark = self.query_one(Sparkline)
        spark.data = vals
        spark.display = bool(vals)


class Value(Static):
    """A label with one value and what it is: a statistic of the rank's window."""

    DEFAULT_CSS = """
    Value { height: 1; }
    """

    def __init__(self, title: str, note: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.title, self.note = title, note

    def show(self, values: list[float | None], fmt: Callable[[float], str]) -> None:
        """Redraw with these values (a statistic, or the quantiles of a distribution)."""
        label = Text(f"{self.title:<11}", "bold")
        vs = [num(v) for v in values]
        if all(v is None for v in vs):
            label.append(" not measured", "dim")
        else:
            label.append(f"{' · '.join(NA if v is None else fmt(v) for v in vs):>9} ")
            label.append(self.note, "dim")
        self.update(label)


class RankScreen(Screen[None]):
    """Everything about one rank (a :class:`~rtop.tui.protocols.SnapshotView` and a
    :class:`~rtop.tui.protocols.RankDetailView`)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "back", "back"),
        Binding("left,[", "other(-1)", "previous rank"),
        Binding("right,]", "other(1)", "next rank"),
    ]
    DEFAULT_CSS = """
    RankScreen #title { height: 2; background: $panel; padding: 0 1; }
    RankScreen #series { height: auto; padding: 0 1; }
    RankScreen #memory, RankScreen #stack, RankScreen #events { height: auto; padding: 0 1;
        margin-top: 1; }
    """

    class Switched(Message):
        """The screen moved to another rank: its detail is wanted now."""

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    def __init__(self, rank: int, ranks: list[int]) -> None:
        super().__init__()
        self.rank, self.ranks = rank, ranks
        self.snapshot: Snapshot | None = None
        self._pending: RankDetail | None = None

    def on_mount(self) -> None:
        """Draw a detail that arrived before the widgets existed."""
        if self._pending is not None:
            self.call_after_refresh(self.show_detail, self._pending)

    def compose(self) -> ComposeResult:
        """Title, series, memory, stack, events."""
        yield Static(Text(f"rank {self.rank}"), id="title")
        with VerticalScroll():
            with VerticalScroll(id="series"):
                for title, src, _, _, note in SERIES:
                    yield Series(title) if src else Value(title, note)
            yield Static("", id="memory")
            yield Static("", id="stack")
            yield Static("", id="events")
        yield Footer()

    def show_snapshot(self, snap: Snapshot) -> None:
        """Keep the list of ranks (for previous/next) and the rank's badge fresh."""
        self.snapshot = snap
        self.ranks = all_ranks(snap) or self.ranks

    def show_detail(self, detail: RankDetail) -> None:
        """Redraw from the rank's detail."""
        d = detail
        if d["rank"] != self.rank:
            return
        if not self.query("#title"):  # not composed yet: draw once mounted
            self._pending = d
            return
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(f"rank {self.rank}", "bold cyan")
        if not d["found"]:
            title.append("  not in the current attempt", "yellow")
            self.query_one("#title", Static).update(title)
            return
        ident = d.get("identity") or {}
        rows = rank_rows(self.snapshot) if self.snapshot is not None else []
        row = next((r for r in rows if r.rank == self.rank), None)
        badge = row.badge if row else ""
        # names as text (never markup), and safe even from a hub that did not clean them
        title.append(safe_text(
            f"  node {ident.get('hostname') or '?'} ({ident.get('ip') or '?'})"
            f"  pid {ident.get('pid', '?')}  local rank {ident.get('local_rank', '?')}"
            f"  {ident.get('source', '')}  {d.get('status')}", 1024))
        if badge:
            title.append(f"  {badge}", "bold red")
        hb = d.get("hb")
        if isinstance(hb, (list, tuple)) and len(hb) >= 3 and hb[1]:
            title.append(f"\nnow: {safe_text(str(hb[1]), 64)} for {fmt_phase(hb[2])}")
        self.query_one("#title", Static).update(title)
        history = {"steps": d.get("steps") or {}, "samples": d.get("samples") or {}}
        stats = d.get("stats") or {}
        lines = self.query_one("#series").children
        for widget, (_, src, names, fmt, _) in zip(lines, SERIES, strict=True):
            if isinstance(widget, Series):
                widget.show(history[src].get(names[0]) or [], fmt)
            elif isinstance(widget, Value):
                widget.show([stats.get(n) for n in names], fmt)
        mem = Text()
        split = memory_split(d)
        if split:
            mem.append("Memory at the peak\n", "bold")
            mem.append_text(memory_bar(split, max(20, min(80, self.size.width - 20))))
            wall = self._wall_evidence()
            per_step, steps_left = growth_forecast(d)
            if wall and wall.get("steps_to_oom") is not None:
                mem.append(f"\nMemory wall: growing {fmt_bytes(wall.get('growth_Bps'))}/s, "
                           f"full in about {wall['steps_to_oom']:,.0f} steps.", "bold magenta")
            elif wall:
                mem.append(f"\nMemory wall: {fmt_bytes(wall.get('headroom_bytes'))} left at "
                           "the peak.", "bold magenta")
            elif per_step is not None and per_step > 0 and steps_left is not None \
                    and steps_left > 100_000:
                mem.append(f"\nMemory is about flat (+{fmt_bytes(per_step)} per step "
                           "recently): no wall in sight.", "green")
            elif per_step is not None and per_step > 0 and steps_left is not None:
                mem.append(f"\nRecent trend: +{fmt_bytes(per_step)} per step (full in "
                           f"{steps_left:,.0f} steps at that rate; not a sustained growth).",
                           "dim")
            elif per_step is not None:
                mem.append("\nMemory is flat: no wall ahead at this batch size.", "green")
            mem.append_text(memory_legend(d))
        else:
            mem.append("Memory: not reported yet", "dim")
        self.query_one("#memory", Static).update(mem)
        stack = d.get("stack")
        st = Text()
        if stack:
            st.append("Python stack of the main thread (it has been in one phase too long)\n",
                      "bold red")
            st.append(safe_text(str(stack), 20000, multiline=True, keep_end=True).rstrip())
        self.query_one("#stack", Static).update(st)
        events = d.get("events") or []
        ev = throughput_line(d)
        ev.append_text(collective_split(d))
        ev.append_text(group_split(d))
        if events:
            ev.append("Events\n", "bold")
            for e in events[-8:]:
                ev.append(f"  {e}\n", "dim")
        ev.append_text(hiccup_line(d))
        ev.append_text(collector_notes(d))
        self.query_one("#events", Static).update(ev)

    def action_back(self) -> None:
        """Back to the overview (the app stops asking for this rank's detail)."""
        self.dismiss(None)

    def _wall_evidence(self) -> dict[str, Any] | None:
        for f in self.snapshot["findings"] if self.snapshot is not None else []:
            if f["kind"] == "memory_wall":
                ev = f["evidence"].get("ranks") or {}
                got = ev.get(str(self.rank))
                return got if isinstance(got, dict) else None
        return None

    def action_other(self, delta: int) -> None:
        """Show the previous or next rank."""
        if not self.ranks:
            return
        ranks = sorted(self.ranks)
        i = ranks.index(self.rank) if self.rank in ranks else 0
        self.rank = ranks[(i + delta) % len(ranks)]
        self.query_one("#title", Static).update(Text(f"rank {self.rank} …"))
        self.post_message(self.Switched(self.rank))
