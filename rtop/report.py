"""``rtop report RUN``: what each rank did over a whole recorded run.

Per rank (of each attempt): medians over the run of the step figures, GPU utilization
and memory where measured, peak memory and the headroom left, and the step's
collectives split by collective (``collectives``: per collective, the medians of its
per-step time, bytes, calls and bus bandwidth over the steps in which it ran, and how
many steps those were); then the findings. A
figure that was never measured is ``null`` in JSON (``n/a`` in text), never 0. Works on
a recording still being written: it reads up to the last whole frame.
"""

from __future__ import annotations

import json
import statistics
from array import array
from collections import defaultdict
from pathlib import Path
from typing import Any

from collectors import wire
from collectors.schema import COLLECTIVE_FIGURES, GPU_FIELDS, MEM_FIELDS, STEP_FIELDS
from rtop.analysis import AnalysisConfig, Monitor
from rtop.fmt import fixed, safe_text
from rtop.run.recording import ReadResult, replay
from rtop.run.state import RankState, RunState, step_split

#: Step fields summarised as medians over the run.
MEDIAN_STEP_FIELDS = ("step_s", "data_wait_s", "compute_s", "gpu_s", "comm_s",
                      "comm_exposed_s", "comm_bytes", "busbw_Bps", "samples")
_S = {f: i for i, f in enumerate(STEP_FIELDS)}
_G = {f: i for i, f in enumerate(GPU_FIELDS)}
_M = {f: i for i, f in enumerate(MEM_FIELDS)}


class _Acc:
    """Everything the report keeps of one rank: compact arrays, not rows."""

    def __init__(self) -> None:
        self.steps: dict[str, array[float]] = {f: array("d") for f in MEDIAN_STEP_FIELDS}
        self.gpu_util: array[float] = array("d")
        self.gpu_mem: array[float] = array("d")
        self.gpu_power: array[float] = array("d")
        self.gpu_clock: array[float] = array("d")
        self.gpu_total: float | None = None
        self.peak: float | None = None
        self.capacity: float | None = None
        self.static: tuple[Any, Any, Any] = (None, None, None)
        self.mem_device: str | None = None
        self.n_steps = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.checkpoints: list[float] = []
        #: per collective: its figures per step it ran in (COLLECTIVE_FIGURES order)
        self.collectives: dict[str, list[array[float]]] = {}

    def add_batch(self, p: dict[str, Any]) -> None:
        for row in p.get("steps") or []:
            self.n_steps += 1
            step = row[_S["step"]]
            if isinstance(step, int):
                self.first_step = step if self.first_step is None else self.first_step
                self.last_step = step
            for f in MEDIAN_STEP_FIELDS:
                v = row[_S[f]]
                if isinstance(v, (int, float)):
                    self.steps[f].append(float(v))
            for op, figures in (step_split(row) or {}).items():
                arrays = self.collectives.get(op)
                if arrays is None:
                    arrays = self.collectives[op] = [array("d") for _ in COLLECTIVE_FIGURES]
                for arr, v in zip(arrays, figures, strict=True):
                    arr.append(float("nan") if v is None else float(v))
        for row in p.get("gpu") or []:
            for arr, key in ((self.gpu_util, "util_pct"), (self.gpu_mem, "mem_used_bytes"),
                             (self.gpu_power, "power_w"), (self.gpu_clock, "sm_clock_mhz")):
                v = row[_G[key]]
                if isinstance(v, (int, float)):
                    arr.append(float(v))
            total = row[_G["mem_total_bytes"]]
            if isinstance(total, (int, float)):
                self.gpu_total = float(total)
        for row in p.get("mem") or []:
            peak, cap = row[_M["peak_bytes"]], row[_M["capacity_bytes"]]
            if isinstance(peak, (int, float)):
                self.peak = max(self.peak or 0.0, float(peak))
            if isinstance(cap, (int, float)):
                self.capacity = float(cap)
            self.mem_device = row[_M["device"]]
            self.static = (row[_M["param_bytes"]], row[_M["grad_bytes"]], row[_M["optim_bytes"]])
        for ev in p.get("events") or []:
            if len(ev) >= 3 and ev[1] == "checkpoint" and isinstance(ev[2], (int, float)):
                self.checkpoints.append(float(ev[2]))


def _median(values: array[float]) -> float | int | None:
    values = array("d", (v for v in values if v == v))  # NaN: not measured
    if not len(values):
        return None
    med = statistics.median(values)
    return int(med) if med.is_integer() and abs(med) < 2**53 else med


def _rank_entry(rs: RankState, acc: _Acc) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "rank": rs.rank,
        "attempt": rs.attempt,
        "node": rs.node,
        "ip": rs.identity.ip,
        "local_rank": rs.identity.local_rank,
        "status": rs.status,
        "steps": acc.n_steps,
        "first_step": acc.first_step,
        "last_step": acc.last_step,
    }
    for f in MEDIAN_STEP_FIELDS:
        entry[f] = _median(acc.steps[f])
    entry["samples_per_step"] = entry.pop("samples")
    entry["gpu_util_pct"] = _median(acc.gpu_util)
    entry["gpu_mem_used_bytes"] = max(acc.gpu_mem) if len(acc.gpu_mem) else None
    entry["gpu_mem_total_bytes"] = acc.gpu_total
    entry["gpu_power_w"] = _median(acc.gpu_power)
    entry["gpu_sm_clock_mhz"] = _median(acc.gpu_clock)
    entry["mem_device"] = acc.mem_device
    entry["peak_bytes"] = acc.peak
    entry["capacity_bytes"] = acc.capacity
    entry["headroom_bytes"] = (acc.capacity - acc.peak
                               if acc.capacity is not None and acc.peak is not None else None)
    entry["param_bytes"], entry["grad_bytes"], entry["optim_bytes"] = acc.static
    entry["checkpoints"] = len(acc.checkpoints)
    entry["checkpoint_s"] = statistics.median(acc.checkpoints) if acc.checkpoints else None
    entry["collectives"] = {
        op: {"s": _median(arrays[0]), "bytes": _median(arrays[1]),
             "calls": _median(arrays[2]), "busbw_Bps": _median(arrays[3]),
             "steps": len(arrays[0])}
        for op, arrays in sorted(acc.collectives.items(),
                                 key=lambda kv: -(_median(kv[1][0]) or 0.0))}
    entry["dropped_records"] = rs.dropped
    entry["clock_offset_s"] = rs.offset_s
    return entry


def build_report(path: str | Path, thresholds: AnalysisConfig | None = None
                 ) -> dict[str, Any]:
    """The report of a recording as a JSON-able dict (the contract's shape).

    The diagnosis runs over the recording as it ran live (every half second of the
    hub's time), so the findings are every finding that started during the run, worst
    first, with when it started and whether it was still active at the end.
    """
    accs: dict[int, _Acc] = defaultdict(_Acc)  # by id of RankState
    monitor = Monitor(RunState(), thresholds or AnalysisConfig.load())
    analyzer = monitor.analyzer
    assert analyzer is not None

    def on_frame(t_hub: float, frame: wire.Frame, st: RunState) -> None:
        if frame.kind == wire.KIND_BATCH:
            group = frame.payload.get("group")  # as the state keeps it (made safe)
            rs = st.rank_state(frame.payload["rank"], safe_text(group) if group else None)
            if rs is not None:
                accs[id(rs)].add_batch(frame.payload)
        monitor.advance(t_hub)

    res = ReadResult()
    state, res = replay(path, monitor.state, on_frame=on_frame, result=res)
    monitor.advance(state.now, force=True)
    attempts = []
    for att in state.attempts:
        ranks = [_rank_entry(rs, accs[id(rs)]) for rs in sorted(att.ranks.values(),
                                                                key=lambda r: r.rank)]
        attempts.append({"attempt": att.number, "group": att.group, "job": att.job,
                         "world_size": att.world_size, "ranks": ranks})
    findings = analyzer.all_episodes()
    current = attempts[-1]["ranks"] if attempts else []
    return {
        "run": {
            "path": str(path),
            "name": str(state.run_info.get("job") or ""),  # the hub's name for the job
            "job": attempts[-1]["job"] if attempts else "",  # the job's own id (Ray run id)
            "world_size": attempts[-1]["world_size"] if attempts else 0,
            "attempts": len(attempts),
            "frames": res.frames,
            "truncated": res.truncated,
            "warnings": res.warnings,
            "duration_s": (state.now - state.started) if state.started else 0.0,
            "hub": state.run_info.get("hub"),
        },
        "ranks": current,
        "previous_attempts": attempts[:-1],
        "findings": findings,
        "thresholds": analyzer.cfg.to_dict(),
    }


def _job_label(run: dict[str, Any]) -> str:
    """The job's name, with its own id beside it when the two differ (as in the UI)."""
    name, job_id = run.get("name") or "", run.get("job") or ""
    if name and job_id and name != job_id:
        return f"{name} ({job_id})"
    return name or job_id or "(unnamed)"


def format_text(report: dict[str, Any]) -> str:
    """The report for a terminal: findings first, worst first, then the ranks."""
    run = report["run"]
    out = [f"rtop report  {run['path']}",
           f"job {_job_label(run)}  world size {run['world_size']}  "
           f"attempts {run['attempts']}  {run['duration_s']:.0f} s recorded  "
           f"{run['frames']} frames"]
    out += [f"warning: {w}" for w in run["warnings"][:5]]
    out.append("")
    findings = report["findings"]
    if findings:
        out.append("Findings")
        for f in findings:
            ranks = ", ".join(str(r) for r in f.get("ranks", [])[:8])
            when = "still active at the end" if f.get("active") else \
                f"for {f.get('duration_s', 0):.0f} s"
            out.append(f"  [{f.get('severity', '?')}] {f['kind']} (ranks {ranks}; {when}): "
                       f"{f.get('summary', '')}")
            if f.get("fix"):
                out.append(f"      fix: {f['fix']}")
        out.append("")
    else:
        out.append("Findings: none")
        out.append("")
    head = (f"{'rank':>4} {'node':<14} {'steps':>6} {'step ms':>8} {'data ms':>8} "
            f"{'comp ms':>8} {'comm ms':>8} {'exp ms':>7} {'comm MB':>8} {'busbw GB/s':>10} "
            f"{'GPU %':>6} {'peak GB':>8} {'free GB':>8} {'status':>8}")
    out += [head, "-" * len(head)]
    for r in report["ranks"]:
        out.append(
            f"{r['rank']:>4} {r['node'][:14]:<14} {r['steps']:>6} "
            f"{fixed(r['step_s'], 1e3):>8} {fixed(r['data_wait_s'], 1e3):>8} "
            f"{fixed(r['compute_s'], 1e3):>8} {fixed(r['comm_s'], 1e3):>8} "
            f"{fixed(r['comm_exposed_s'], 1e3):>7} {fixed(r['comm_bytes'], 1e-6, 2):>8} "
            f"{fixed(r['busbw_Bps'], 1e-9, 3):>10} {fixed(r['gpu_util_pct'], 1, 0):>6} "
            f"{fixed(r['peak_bytes'], 1e-9, 2):>8} {fixed(r['headroom_bytes'], 1e-9, 2):>8} "
            f"{r['status']:>8}")
    return "\n".join(out)


def to_json(report: dict[str, Any]) -> str:
    """The report as JSON (NaN never appears: unmeasured is null)."""
    return json.dumps(report, indent=2, allow_nan=False, default=str)
