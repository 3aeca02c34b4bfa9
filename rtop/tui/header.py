"""The header: which job, how big, how fast, how efficient, and rtop's own health."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from rtop.fmt import NA, fmt_duration, fmt_flops, fmt_pct, safe_text
from rtop.run.snapshot import Snapshot, Throughput
from rtop.tui.model import job_figures


def throughput_text(rates: Throughput) -> Text:
    """Tokens/s, model TFLOPS and MFU where known (nothing of what is not): the job's
    throughput beyond samples (``rtop.analysis.throughput``)."""
    text = Text()
    if rates["tokens_per_s"]:
        text.append(f" · {fmt_count(rates['tokens_per_s'])} tokens/s")
    if rates["model_flops_per_s"]:
        text.append(f" · {fmt_flops(rates['model_flops_per_s'])}")
        mfu = rates["mfu"]
        text.append(" · MFU ")
        if mfu is None:
            text.append(NA, "dim")
        else:
            text.append(f"{mfu:.0%}", "bold" if mfu >= 0.3 else "bold yellow")
            assumed = " (assumed)" if rates["dtype_assumed"] else ""
            text.append(f" of {rates['dtype']} peak{assumed}", "dim")
    return text


#: The hub not hearing its ranks for this long is said in the header (a moment of it,
#: a burst of data, is not).
DEAF_SHOWN_S = 1.0


def fmt_count(x: float) -> str:
    """A large rate, short: 950, 12.3k, 4.56M."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"


class JobHeader(Static):
    """Two lines about the job as a whole."""

    DEFAULT_CSS = """
    JobHeader { height: 2; background: $panel; padding: 0 1; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("rtop · waiting for the first snapshot…", **kwargs)
        self.source_text = ""
        self.source_error = False

    def show(self, snap: Snapshot | None) -> None:
        """Redraw from a snapshot (None: nothing received yet)."""
        line1 = Text(no_wrap=True, overflow="ellipsis")
        line1.append("rtop ", "bold")
        if snap is None:
            line1.append(safe_text(self.source_text, 300) or "connecting…",
                         "bold red" if self.source_error else "dim")
            self.update(line1, layout=False)
            return
        j = job_figures(snap)
        line1.append(j.job, "bold cyan")
        if j.job_id:
            line1.append(f" ({j.job_id[:24]})", "dim")
        rp = snap.get("replay")
        if rp is not None:
            state = "paused" if rp["paused"] else ("end of recording" if rp["finished"]
                                                   else f"playing {rp['speed']:g}×")
            line1.append(f"  replay {fmt_duration(rp['position_s'])}"
                         f"/{fmt_duration(rp['duration_s'])} {state}", "bold yellow")
        if self.source_text:
            line1.append(f"  {safe_text(self.source_text, 300)}",
                         "bold red" if self.source_error else "dim")
        deaf = snap["run"].get("deaf_s")
        if isinstance(deaf, (int, float)) and deaf >= DEAF_SHOWN_S:
            line1.append(f"  hub behind its ranks' data for {fmt_duration(deaf)}: figures "
                         f"lag, no rank judged silent", "bold yellow")
        line2 = Text(no_wrap=True, overflow="ellipsis")
        world = j.world or j.seen
        if j.active == 0 and j.seen and not j.lost:
            line2.append(f"{world} ranks, job ended", "bold")
        else:
            up = f"{j.active}/{world} running" + (f", {j.lost} lost" if j.lost else "")
            line2.append(f"ranks {up}", "bold red" if j.lost else "")
        if j.attempts > 1 or (isinstance(j.attempt, int) and j.attempt > 0):
            line2.append(f" · restarted: attempt {j.attempt}", "bold yellow")
        eff_style = "" if j.efficiency is None or j.efficiency >= 0.6 else "bold yellow"
        line2.append(" · efficiency ")
        line2.append(fmt_pct(j.efficiency, 100), eff_style)
        line2.append(f" · {f'{j.steps_per_s:.2f}' if j.steps_per_s else NA} steps/s")
        rates = snap["overview"].get("throughput")
        samples = j.samples_per_s
        if rates is not None and rates["samples_per_s"] is not None \
                and rates["ranks_counted"] < j.active:
            samples = rates["samples_per_s"]  # one rank per model replica (pipeline, TP)
        if samples:
            line2.append(f" · {samples:,.0f} samples/s")
        if rates is not None:
            line2.append_text(throughput_text(rates))
        line2.append(f" · up {fmt_duration(j.uptime_s)}")
        cost = f"{j.rtop_cpu:.1%} CPU/rank, " if j.rtop_cpu is not None else ""
        line2.append(f" · rtop {cost}{j.dropped} dropped",
                     "dim" if not j.dropped else "yellow")
        if j.bad_frames:
            line2.append(f", {j.bad_frames} bad frames", "yellow")
        spooled = ((snap.get("hub") or {}).get("counters") or {}).get("spool_records")
        if isinstance(spooled, int) and spooled > 0:  # kept on disk by ranks, taken in
            line2.append(f", {spooled} from spools", "dim")
        self.update(Text("\n").join([line1, line2]), layout=False)
