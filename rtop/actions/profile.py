"""What ``rtop profile`` and the UI's ``p`` make of the ranks' profiler captures.

Each rank answers with :class:`collectors.profiler.ProfileCapture`'s dict;
:func:`assemble` turns the answers into the result that ``rtop profile --json`` prints::

    {"dir": DIR,
     "traces": [{"rank": R, "path": FILE}, ...],
     "summary": {"ranks": [{"rank": R, "steps": [first, last], "timeline": "cpu" | "gpu",
                            "steps_asked": K, "trace_bytes": N, "note": "why fewer steps",
                            "top_ops": [{"name": "aten::addmm", "self_s": 0.0012,
                                         "calls": 15}, ...],
                            "compute_s": ..., "comm_s": ..., "overlap_s": ...,
                            "idle_s": ..., "wall_s": ...}, ...]},
     "errors": {"R": "what went wrong"},      # keyed by the rank as a string, as JSON keeps it
     "missing": [ranks that did not answer in time]}

``compute_s + comm_s - overlap_s + idle_s == wall_s``: compute that ran while a
collective was in flight counts in both (see :mod:`collectors.profiler`).
:func:`format_text` prints it for the CLI; :func:`split_parts` is the split bar that
the text and the UI both draw. Everything in an answer comes from a rank and is treated
as untrusted: names and paths are cleaned (:func:`rtop.fmt.safe_text`) and cut, figures
that are not finite non-negative numbers are ``None`` (printed ``n/a``), lists are
bounded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rtop.actions import MAX_ERROR, answer_problems
from rtop.fmt import NA, fmt_ms, fmt_ranks, num, safe_text

#: Bounds on what one rank's answer may bring.
MAX_OPS = 50
MAX_NAME = 200
MAX_PATH = 1024
MAX_NOTE = 300
#: The time figures of a rank's summary, in seconds.
FIGURES = ("compute_s", "comm_s", "overlap_s", "idle_s", "wall_s")
#: The split bar's parts: (label, glyph, colour).
PARTS = (("compute", "█", "green"), ("compute + comm", "▓", "cyan"),
         ("comm", "▒", "magenta"), ("idle", "·", "bright_black"))


def _seconds(x: object) -> float | None:
    v = num(x)
    return v if v is not None and v >= 0 else None


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _op(o: object) -> dict[str, Any] | None:
    if not isinstance(o, Mapping) or not isinstance(o.get("name"), str):
        return None
    return {"name": safe_text(o["name"], MAX_NAME), "self_s": _seconds(o.get("self_s")),
            "calls": _int(o.get("calls"))}


def _steps(x: object) -> list[int] | None:
    if isinstance(x, (list, tuple)) and len(x) == 2:
        a, b = _int(x[0]), _int(x[1])
        if a is not None and b is not None:
            return [a, b]
    return None


def assemble(answers: Mapping[int, Any], out_dir: str, missing: Iterable[int],
             errors: Mapping[int, str] | None = None) -> dict[str, Any]:
    """The result of ``rtop profile`` from each rank's answer (by rank), the traces'
    directory, the ranks that did not answer in time and the ranks whose action failed
    before it could answer (``errors``, e.g. from the control channel).

    A rank whose answer carries an ``error`` is listed under ``errors`` only; the others
    under ``traces`` (when they name a trace) and ``summary``. Ranks are sorted.
    """
    errs = {int(r): safe_text(str(m), MAX_ERROR) for r, m in (errors or {}).items()}
    traces: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    for r in sorted(answers):
        a = answers[r]
        if not isinstance(a, Mapping):
            errs.setdefault(r, "the answer is not a mapping")
            continue
        if a.get("error"):
            errs.setdefault(r, safe_text(str(a["error"]), MAX_ERROR))
            continue
        path = a.get("trace")
        if isinstance(path, str) and path:
            traces.append({"rank": r, "path": safe_text(path, MAX_PATH)})
        raw = a.get("top_ops")
        ops = [o for o in (_op(x) for x in (raw if isinstance(raw, list) else [])[:MAX_OPS])
               if o is not None]
        timeline = a.get("timeline")
        note = a.get("note")
        ranks.append({"rank": r, "steps": _steps(a.get("steps")),
                      "timeline": timeline if timeline in ("cpu", "gpu") else None,
                      "steps_asked": _int(a.get("steps_asked")),
                      "trace_bytes": _int(a.get("trace_bytes")),
                      "note": safe_text(note, MAX_NOTE) if isinstance(note, str) else None,
                      "top_ops": ops, **{k: _seconds(a.get(k)) for k in FIGURES}})
    return {"dir": safe_text(out_dir, MAX_PATH), "traces": traces, "summary": {"ranks": ranks},
            "errors": {str(r): errs[r] for r in sorted(errs)},
            "missing": sorted({int(m) for m in missing} - set(answers))}


def split_parts(rank: Mapping[str, Any]) -> list[tuple[str, float]] | None:
    """A rank's wall time as disjoint parts: compute alone, compute while a collective
    was in flight, communication alone, idle (seconds; :data:`PARTS` order). None when
    a figure is missing."""
    compute, comm, idle = (num(rank.get(k)) for k in ("compute_s", "comm_s", "idle_s"))
    overlap = num(rank.get("overlap_s")) or 0.0
    if compute is None or comm is None or idle is None:
        return None
    overlap = min(overlap, compute, comm)
    return [("compute", compute - overlap), ("compute + comm", overlap),
            ("comm", comm - overlap), ("idle", idle)]


def bar_cells(parts: list[tuple[str, float]], width: int) -> list[int]:
    """How many of ``width`` cells each part gets (largest remainders; all add up)."""
    total = sum(v for _, v in parts)
    if total <= 0:
        return [0] * len(parts)
    exact = [width * v / total for _, v in parts]
    cells = [int(x) for x in exact]
    for i in sorted(range(len(parts)), key=lambda i: cells[i] - exact[i])[:width - sum(cells)]:
        cells[i] += 1
    return cells


def _pct(part: float | None, wall: float | None) -> str:
    return f"{part / wall:4.0%}" if part is not None and wall else "   " + NA


def _steps_text(steps: object) -> str:
    s = _steps(steps)
    return NA if s is None else str(s[0]) if s[0] == s[1] else f"{s[0]}-{s[1]}"


def problems(result: Mapping[str, Any]) -> list[str]:
    """Lines on the ranks that did not answer and the ranks that failed."""
    return answer_problems(result)


def open_hint(out_dir: str) -> str:
    """How to open the traces."""
    return (f"open with: tensorboard --logdir {out_dir}  (torch-tb-profiler), HTA's "
            "TraceAnalysis(trace_dir=..., include_last_profiler_step=True), or Perfetto")


def format_text(result: Mapping[str, Any], *, bar_width: int = 40) -> str:
    """The result as text for the CLI: per rank the compute / comm / idle split with
    percentages of the captured steps' wall time, the top operators by self time and
    the trace's path; then how to open the traces, errors and missing ranks."""
    ranks = result.get("summary", {}).get("ranks") or []
    out_dir = safe_text(str(result.get("dir") or ""), MAX_PATH)
    paths = {t.get("rank"): t.get("path") for t in result.get("traces") or []}
    lines = [f"Profile of {len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
             + (f" ({fmt_ranks(r['rank'] for r in ranks)})" if ranks else "")
             + f": traces in {out_dir}", f"  {open_hint(out_dir)}"]
    lines += [f"  {p}" for p in problems(result)]
    for x in ranks:
        wall = num(x.get("wall_s"))
        where = "GPU" if x.get("timeline") == "gpu" else "CPU"
        lines += ["", f"rank {x['rank']} · steps {_steps_text(x.get('steps'))} · "
                      f"{fmt_ms(wall)} ms over the steps ({where} timeline)"]
        if x.get("note"):
            lines.append(f"  note: {safe_text(str(x['note']), MAX_NOTE)}")
        overlap = num(x.get("overlap_s"))
        for label, key in (("compute", "compute_s"), ("comm", "comm_s"), ("idle", "idle_s")):
            v = num(x.get(key))
            note = ""
            if key == "comm_s" and overlap:
                note = f"  ({fmt_ms(overlap)} ms of it while compute ran)"
            lines.append(f"  {label:<8} {fmt_ms(v):>8} ms  {_pct(v, wall)}{note}")
        parts = split_parts(x)
        if parts is not None:
            cells = bar_cells(parts, bar_width)
            bar = "".join(g * n for (_, g, _), n in zip(PARTS, cells, strict=True))
            legend = "  ".join(f"{g} {label}" for label, g, _ in PARTS)
            lines.append(f"  {bar}  {legend}")
        ops = x.get("top_ops") or []
        if ops:
            lines.append(f"  top operators by self {where} time:")
            lines.append(f"  {'self ms':>9} {'calls':>7}  operator")
            for o in ops:
                calls = o.get("calls")
                lines.append(f"  {fmt_ms(o.get('self_s')):>9} "
                             f"{calls if calls is not None else NA:>7}  "
                             f"{safe_text(str(o.get('name')), MAX_NAME)}")
        path = paths.get(x["rank"])
        lines.append(f"  trace: {safe_text(str(path), MAX_PATH)}" if path
                     else "  trace: none written")
    return "\n".join(lines) + "\n"
