"""``rtop report RUN``: what each rank did over a whole recorded run.

Per rank (of each attempt): medians over the run of the step figures (and the
distributions of the step time, the data wait and the exposed comm: their p50, p95 and
p99 over the run, ``step_p99_s``, ``data_wait_p95_s``, ...), GPU utilization and memory where
measured, peak memory and the headroom left, and the step's collectives split by
collective (``collectives``: per collective, the medians of its
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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from collectors import wire
from collectors.figures import Figure, figures
from collectors.raytrain import RAY_DATA_FIELDS
from collectors.schema import COLLECTIVE_FIGURES, STEP_FIELDS, TABLES
from rtop.analysis import AnalysisConfig, Monitor, roles
from rtop.analysis.throughput import job_throughput, rank_rates
from rtop.fmt import fixed, fmt_bytes, fmt_flops, fmt_ms, fmt_rate, safe_text
from rtop.run.recording import ReadResult, replay
from rtop.run.ring import nanquantile_rows
from rtop.run.spool import (
    SpoolError,
    SpoolTally,
    batch_records,
    read_header,
    read_spool,
    spool_files,
    spool_key,
)
from rtop.run.state import MAX_GROUP_OPS, Attempt, RankState, RunState, step_split
from rtop.run.validate import ProtocolError

#: The figures a rank's entry sums up over the run (the figures' ``report``): medians,
#: peaks and last values, under their report keys, in the table's order.
REPORTED = tuple(f for f in figures() if f.report is not None)
#: Per wire table: the reported figures read from its rows, with their fields' index (a
#: quantile is taken of its ``of`` figure's values).
_READ = {table: [(f, fields.index(f.source)) for f in REPORTED
                 if f.table == table and f.report != "quantile"]
         for table, fields in TABLES.items()}
#: The columns of the text table (the figures' ``text``), then free GB and status.
TEXT_COLUMNS = tuple((f.key, f.text) for f in REPORTED if f.text is not None and f.text.report)
#: The distributions (the figures' ``of``): per step field, its quantile figures; the
#: field is itself reported by its median, whose values the quantiles are taken of.
DISTRIBUTIONS: dict[str, list[Figure]] = {
    of: [f for f in REPORTED if f.report == "quantile" and f.of == of]
    for of in dict.fromkeys(f.of for f in REPORTED if f.report == "quantile")}
assert all(of in {f.name for f in REPORTED if f.report == "median"} for of in DISTRIBUTIONS)
_S = {f: i for i, f in enumerate(STEP_FIELDS)}


class _Acc:
    """Everything the report keeps of one rank: compact arrays, not rows."""

    def __init__(self) -> None:
        #: per reported figure: its values (medians; the quantiles are read from their
        #: ``of`` figure's: one array per field), its largest (peaks), its last
        self.values: dict[str, array[float]] = {
            f.name: array("d") for f in REPORTED if f.report == "median"}
        self.peak: dict[str, float] = {}
        self.last: dict[str, Any] = {}
        self.n_steps = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.checkpoints: list[float] = []
        #: records that came from a spool, and records the rank's spool left out
        self.spooled = 0
        self.spool_dropped = 0
        #: per collective: its figures per step it ran in (COLLECTIVE_FIGURES order)
        self.collectives: dict[str, list[array[float]]] = {}
        #: the same per (process group, collective), where a step split them by group
        self.groups: dict[tuple[str, str], list[array[float]]] = {}

    def add_batch(self, p: dict[str, Any]) -> None:
        for table, read in _READ.items():
            for row in p.get(table) or ():
                for f, j in read:
                    v = row[j]
                    if v is None:
                        continue
                    if f.report == "median":
                        if isinstance(v, (int, float)):
                            self.values[f.name].append(float(v))
                    elif f.report == "peak":
                        if isinstance(v, (int, float)):
                            self.peak[f.name] = max(self.peak.get(f.name, float(v)), float(v))
                    else:
                        self.last[f.name] = v
        for row in p.get("steps") or []:
            self.n_steps += 1
            step = row[_S["step"]]
            if isinstance(step, int):
                self.first_step = step if self.first_step is None else self.first_step
                self.last_step = step
            for op, split in (step_split(row) or {}).items():
                arrays = self.collectives.get(op)
                if arrays is None:
                    arrays = self.collectives[op] = [array("d") for _ in COLLECTIVE_FIGURES]
                _append(arrays, split)
            for group, ops in (row[_S["groups"]] or {}).items():
                for op, split in ops.items():
                    garrays = self.groups.get((group, op))
                    if garrays is None:
                        if len(self.groups) >= MAX_GROUP_OPS:
                            continue
                        garrays = self.groups[(group, op)] = [array("d")
                                                              for _ in COLLECTIVE_FIGURES]
                    _append(garrays, split)
        for ev in p.get("events") or []:
            if len(ev) >= 3 and ev[1] == "checkpoint" and isinstance(ev[2], (int, float)):
                self.checkpoints.append(float(ev[2]))


def _append(arrays: list[array[float]], split: list[Any]) -> None:
    for arr, v in zip(arrays, split, strict=True):
        arr.append(float("nan") if v is None else float(v))


def _op_medians(arrays: list[array[float]]) -> dict[str, Any]:
    return {"s": _median(arrays[0]), "bytes": _median(arrays[1]),
            "calls": _median(arrays[2]), "busbw_Bps": _median(arrays[3]),
            "steps": len(arrays[0])}


def _median(values: array[float]) -> float | int | None:
    values = array("d", (v for v in values if v == v))  # NaN: not measured
    if not len(values):
        return None
    med = statistics.median(values)
    return int(med) if med.is_integer() and abs(med) < 2**53 else med


def _summary(f: Figure, acc: _Acc) -> Any:
    """A reported figure over the run (None: never measured)."""
    if f.report == "median":
        return _median(acc.values[f.name])
    if f.report == "peak":
        return acc.peak.get(f.name)
    if f.report == "quantile" and f.quantile is not None:
        values = np.frombuffer(acc.values[f.of], dtype=np.float64)
        q = nanquantile_rows(values[None, :], f.quantile)[0] if len(values) else np.nan
        return None if np.isnan(q) else float(q)
    return acc.last.get(f.name)


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
    for f in REPORTED:
        entry[f.key] = _summary(f, acc)
    peak, capacity = entry["peak_bytes"], entry["capacity_bytes"]
    entry["headroom_bytes"] = (capacity - peak
                               if capacity is not None and peak is not None else None)
    entry["checkpoints"] = len(acc.checkpoints)
    entry["checkpoint_s"] = statistics.median(acc.checkpoints) if acc.checkpoints else None
    entry["collectives"] = {
        op: _op_medians(arrays)
        for op, arrays in sorted(acc.collectives.items(),
                                 key=lambda kv: -(_median(kv[1][0]) or 0.0))}
    # per process group (collectors.groups), where some ran outside the default group
    described = {d.get("name"): d for d in rs.meta.get("groups") or [] if isinstance(d, dict)}
    groups: dict[str, dict[str, Any]] = {}
    for (group, op), arrays in sorted(acc.groups.items(),
                                      key=lambda kv: -(_median(kv[1][0]) or 0.0)):
        if group not in groups:
            d = described.get(group) or {}
            groups[group] = {k: d.get(k) for k in ("desc", "ranks", "size", "rank")}
            groups[group]["collectives"] = {}
        groups[group]["collectives"][op] = _op_medians(arrays)
    entry["groups"] = groups
    entry["pipeline_stage"] = roles.stage_of(rs.meta)
    device = rs.meta.get("device")
    gpu = device.get("name") if isinstance(device, dict) else None
    entry.update(rank_rates(entry["step_s"], entry["samples_per_step"],
                            entry["tokens_per_step"], entry["flops_per_step"],
                            gpu if isinstance(gpu, str) else None, rs.meta))
    entry["dropped_records"] = rs.dropped
    entry["spooled_records"] = acc.spooled
    entry["spool_dropped_records"] = acc.spool_dropped
    entry["clock_offset_s"] = rs.offset_s
    # Ray Data's own blocked time beside the probe's data wait (collectors.raytrain)
    entry["ray_data"] = _ray_data(rs.meta)
    error = rs.meta.get("error")  # what the rank said failed it (its goodbye)
    entry["error"] = error if isinstance(error, str) else None
    notes = rs.meta.get("notes")
    entry["notes"] = [n for n in notes if isinstance(n, str)] if isinstance(notes, list) \
        else []
    return entry


def build_report(path: str | Path, thresholds: AnalysisConfig | None = None, *,
                 spools: Iterable[str | Path] = (), find_spools: bool = True,
                 spool_dir: Path | None = None) -> dict[str, Any]:
    """The report of a recording as a JSON-able dict (the contract's shape).

    Records that ranks spooled because no hub took them at their end
    (:mod:`collectors.spool`) are merged in: those a hub recorded, the spools given
    (``spools``), and, with ``find_spools``, those in ``spool_dir`` (default: the
    runtime directory) written by a rank process of this recording; never a spool
    whose id the recording already holds. ``run.spools`` lists them, and
    ``spooled_records`` / ``spool_dropped_records`` (per rank too) count them.

    The diagnosis runs over the recording as it ran live (every half second of the
    hub's time), so the findings are every finding that started during the run, worst
    first, with when it started and whether it was still active at the end.
    """
    accs: dict[int, _Acc] = defaultdict(_Acc)  # by id of RankState
    monitor = Monitor(RunState(), thresholds or AnalysisConfig.load())
    analyzer = monitor.analyzer
    assert analyzer is not None

    tally = SpoolTally()

    def on_frame(t_hub: float, frame: wire.Frame, st: RunState) -> None:
        if frame.kind == wire.KIND_BATCH:
            group = frame.payload.get("group")  # as the state keeps it (made safe)
            rs = st.rank_state(frame.payload["rank"], safe_text(group) if group else None)
            if rs is not None:
                accs[id(rs)].add_batch(frame.payload)
                if tally.current is not None:
                    accs[id(rs)].spooled += batch_records(frame.payload)
        else:
            rs = tally.see(frame, st)
            if rs is not None and tally.current is not None:
                dropped = tally.current.get("dropped_records")
                if isinstance(dropped, int) and dropped > 0:
                    accs[id(rs)].spool_dropped += dropped
        monitor.advance(t_hub)

    res = ReadResult()
    state, res = replay(path, monitor.state, on_frame=on_frame, result=res)
    _merge_spools(state, tally, on_frame, res, list(spools),
                  spool_dir if find_spools else False)
    monitor.advance(state.now, force=True)
    attempts = []
    for att in state.attempts:
        ranks = [_rank_entry(rs, accs[id(rs)]) for rs in sorted(att.ranks.values(),
                                                                key=lambda r: r.rank)]
        for entry in ranks:  # steps that stood out but not for long enough to be named
            entry["hiccups"] = analyzer.hiccups.of(att.number, entry["rank"])
        attempts.append({"attempt": att.number, "group": att.group, "job": att.job,
                         "world_size": att.world_size,
                         "ended": _attempt_end(att, att is not state.attempts[-1]),
                         "steps": sum(r["steps"] for r in ranks), "ranks": ranks})
    findings = analyzer.all_episodes()
    current = attempts[-1]["ranks"] if attempts else []
    last = sorted(state.attempts[-1].ranks.values(), key=lambda r: r.rank) \
        if state.attempts else []
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
            # the hub closed it (an end mark); if not, where it ends, in words
            "closed": res.closed,
            "cut": res.cut(),
            "end_byte": res.end_byte,
            "end_t_hub": res.last_t_hub,
            "duration_s": (state.now - state.started) if state.started else 0.0,
            "hub": state.run_info.get("hub"),
            # records ranks spooled when no hub took them (recorded by a hub, or merged)
            "spools": tally.spools,
            "spooled_records": sum(int(s.get("records") or 0) for s in tally.spools
                                   if s.get("source") in ("recording", "merged")),
            "spool_dropped_records": sum(int(s.get("dropped_records") or 0)
                                         for s in tally.spools
                                         if s.get("source") in ("recording", "merged")),
        },
        "ranks": current,
        # the job's throughput over the run (the current attempt's ranks' medians):
        # samples and tokens per second over one rank per model replica, model FLOP/s
        # and MFU against the GPUs' peak (rtop.analysis.throughput)
        "throughput": _job_throughput(last, current),
        # the process groups the current attempt's collectives ran on, each with its
        # member ranks and the medians of their per-rank figures per collective
        "process_groups": _process_groups(current),
        # every attempt (worker group: a Ray Train or torchrun restart starts one),
        # oldest first, each with its ranks and how it ended; the last one's ranks are
        # "ranks" above, the others "previous_attempts"
        "attempts": attempts,
        "previous_attempts": attempts[:-1],
        # worker groups that said hello beside the running attempt and never took over
        # (another job on this hub, or a stray rank): who, not what they sent
        "other_groups": [{"group": att.group, "job": att.job, "world_size": att.world_size,
                          "ranks": sorted(att.ranks), "hosts": sorted(
                              {rs.node for rs in att.ranks.values()}),
                          "first_seen": att.started}
                         for att in [*state.strays, *state.pending.values()]],
        "findings": findings,
        "thresholds": analyzer.cfg.to_dict(),
    }


def _job_throughput(states: list[RankState], entries: list[dict[str, Any]]
                    ) -> dict[str, Any]:
    """The job's throughput from its ranks' run medians (``Throughput``'s shape)."""
    def column(key: str) -> np.ndarray:
        return np.array([np.nan if e.get(key) is None else float(e[key]) for e in entries],
                        dtype=np.float64)

    metas = [rs.meta for rs in states]
    classes = roles.peer_classes(metas)
    gpus = [d.get("name") if isinstance(d := m.get("device"), dict)
            and isinstance(d.get("name"), str) else None for m in metas]
    return dict(job_throughput(column("step_s"), column("samples_per_step"),
                               column("tokens_per_step"), column("flops_per_step"), gpus,
                               metas, roles.counted(metas, classes),
                               np.ones(len(entries), dtype=bool)))


def _process_groups(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every process group the ranks' collectives ran on (outside the default one): what
    its members said of it, its members, and per collective the median over its members
    of their per-step medians (time, bytes, bus bandwidth)."""
    out: dict[str, dict[str, Any]] = {}
    figures: dict[tuple[str, str], dict[str, list[float]]] = {}
    for e in entries:
        for name, g in (e.get("groups") or {}).items():
            group = out.setdefault(name, {"desc": g.get("desc"), "ranks": g.get("ranks"),
                                          "size": g.get("size"), "members": [],
                                          "collectives": {}})
            group["members"].append(e["rank"])
            for op, f in g["collectives"].items():
                seen = figures.setdefault((name, op), {"s": [], "bytes": [], "busbw_Bps": []})
                for k, values in seen.items():
                    if f.get(k) is not None:
                        values.append(float(f[k]))
    for (name, op), seen in figures.items():
        out[name]["collectives"][op] = {k: statistics.median(v) if v else None
                                        for k, v in seen.items()}
    return out


def _attempt_end(att: Attempt, replaced: bool) -> str:
    """How an attempt ended: ``replaced`` (a later attempt started: a restart), else
    from its ranks' word: ``failed`` (one failed), ``running`` (one still active),
    ``lost`` (one gone without a word), ``exited`` (one's interpreter exited without
    closing), ``finished`` (all closed their probes)."""
    if replaced:
        return "replaced"
    statuses = {rs.status for rs in att.ranks.values()}
    for status, said in (("failed", "failed"), ("active", "running"), ("lost", "lost"),
                         ("exited", "exited")):
        if status in statuses:
            return said
    return "finished"


def _ray_data(meta: dict[str, Any]) -> dict[str, Any] | None:
    """A rank's Ray Data cross-check (``collectors.raytrain``), as it sent it, when its
    figures are numbers; else None (not measured)."""
    figures = meta.get("ray_data")
    if not isinstance(figures, dict):
        return None
    keep = {k: figures.get(k) for k in RAY_DATA_FIELDS}
    numbers = [keep[k] for k in RAY_DATA_FIELDS if k != "agree"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        return None
    keep["agree"] = keep["agree"] if isinstance(keep["agree"], bool) else None
    return keep


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
    out += _throughput_lines(report.get("throughput"))
    out += [f"warning: {w}" for w in run["warnings"][:5]]
    out += _spool_lines(run)
    if run.get("cut"):
        out.append(f"note: {run['cut']}")
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
    head = " ".join([f"{'rank':>4} {'node':<14} {'steps':>6}",
                     *(f"{t.label:>{t.width}}" for _, t in TEXT_COLUMNS),
                     f"{'free GB':>8} {'status':>8}"])
    out += [head, "-" * len(head)]
    for r in report["ranks"]:
        out.append(" ".join([
            f"{r['rank']:>4} {r['node'][:14]:<14} {r['steps']:>6}",
            *(f"{fixed(r[key], t.scale, t.digits):>{t.width}}" for key, t in TEXT_COLUMNS),
            f"{fixed(r['headroom_bytes'], 1e-9, 2):>8} {r['status']:>8}"]))
    out += _distribution_lines(report["ranks"])
    out += _group_lines(report.get("process_groups") or {})
    out += _attempt_lines(report) + _ray_data_lines(report["ranks"])
    return "\n".join(out)


def _throughput_lines(t: dict[str, Any] | None) -> list[str]:
    """The job's throughput in one line (nothing when nothing of it was measured)."""
    if not t or all(t.get(k) is None for k in ("samples_per_s", "tokens_per_s",
                                               "model_flops_per_s")):
        return []
    parts = []
    if t.get("samples_per_s") is not None:
        parts.append(f"{t['samples_per_s']:,.1f} samples/s")
    if t.get("tokens_per_s") is not None:
        parts.append(f"{t['tokens_per_s']:,.0f} tokens/s")
    if t.get("model_flops_per_s") is not None:
        parts.append(f"{fmt_flops(t['model_flops_per_s'])} (model)")
    mfu = t.get("mfu")
    if mfu is not None:
        assumed = ", assumed" if t.get("dtype_assumed") else ""
        parts.append(f"MFU {mfu:.1%} of {t.get('gpu')}'s dense {t.get('dtype')} "
                     f"peak{assumed}")
    else:
        parts.append(f"MFU n/a ({t.get('why_no_mfu')})")
    return [f"throughput over the run: {' · '.join(parts)} (samples and tokens: "
            f"{t.get('ranks_counted')} rank(s), one per model replica)"]


def _group_lines(groups: dict[str, dict[str, Any]]) -> list[str]:
    """Communication per process group: each group's collectives (their members'
    medians); nothing when every collective ran on the default group."""
    if not groups:
        return []
    out = ["", "Communication per process group (median over its member ranks of their "
               "per-step medians)"]
    for name, g in list(groups.items())[:32]:
        what = safe_text(str(g.get("desc") or "group"), 64)
        out.append(f"  {what} (name {safe_text(name, 64)}, ranks "
                   f"{safe_text(str(g.get('ranks') or '?'), 80)}; seen from "
                   f"{len(g['members'])} member(s))")
        for op, f in g["collectives"].items():
            out.append(f"    {safe_text(op, 32):<15} {fmt_ms(f.get('s')):>8} ms "
                       f"{fmt_bytes(f.get('bytes')):>10}  busbw {fmt_rate(f.get('busbw_Bps'))}")
    return out


def _distribution_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """Each rank's distributions over the run, p50 / p95 / p99 in ms (the figures'
    ``of``: step time, data wait, exposed comm); nothing when no rank measured any."""
    if not any(r.get(f.key) is not None for r in ranks for fs in DISTRIBUTIONS.values()
               for f in fs):
        return []
    width = 23
    labels = [fs[0].detail.label if fs[0].detail is not None else of
              for of, fs in DISTRIBUTIONS.items()]
    head = " ".join([f"{'rank':>4}", *(f"{label:>{width}}" for label in labels)])
    out = ["", "Distributions over the run (ms: p50 / p95 / p99)", head, "-" * len(head)]
    for r in ranks:
        cells = [" / ".join(fmt_ms(r.get(f.key)) for f in fs)
                 for fs in DISTRIBUTIONS.values()]
        out.append(" ".join([f"{r['rank']:>4}", *(f"{c:>{width}}" for c in cells)]))
    return out


def _attempt_lines(report: dict[str, Any]) -> list[str]:
    """One line per attempt, when a restart made more than one."""
    attempts = report.get("attempts") or []
    if len(attempts) < 2:
        return []
    out = ["", "Attempts (a restart starts a new worker group)"]
    for a in attempts:
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(
            _count(r["status"] for r in a["ranks"]).items()))
        out.append(f"  attempt {a['attempt']}: {len(a['ranks'])} ranks ({statuses}), "
                   f"{a['steps']} steps, {a['ended']}")
    return out


def _count(items: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def _ray_data_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """Ray Data's blocked time beside the probe's data wait, per rank that has both."""
    have = [r for r in ranks if r.get("ray_data")]
    if not have:
        return []
    out = ["", "Ray Data cross-check (Ray Data's time blocked in the iterator, its set-up "
               "included, against the probe's data wait)"]
    for r in have:
        d = r["ray_data"]
        verdict = {True: "agree", False: "DISAGREE"}.get(d["agree"], "n/a")
        out.append(f"  rank {r['rank']}: Ray Data {d['blocked_s'] + d['init_s']:.3f} s "
                   f"(set-up {d['init_s']:.3f} s), probe {d['probe_data_wait_s']:.3f} s "
                   f"over {d['batches']} batches, {d['passes']} "
                   f"pass{'' if d['passes'] == 1 else 'es'}: {verdict}")
    return out


def to_json(report: dict[str, Any]) -> str:
    """The report as JSON (NaN never appears: unmeasured is null)."""
    return json.dumps(report, indent=2, allow_nan=False, default=str)


def _merge_spools(state: RunState, tally: SpoolTally,
                  on_frame: Callable[[float, wire.Frame, RunState], None],
                  res: ReadResult, given: list[str | Path],
                  directory: Path | Literal[False] | None) -> None:
    """Apply the spools that belong to this recording and are not in it (see
    :func:`build_report`) after its last frame, noting each in ``tally.spools`` and
    any damage in ``res.warnings``. A spool given that cannot be read is a warning;
    nothing else of the report is lost."""
    paths: list[tuple[Path, bool]] = [(Path(p), True) for p in given]
    if directory is not False:
        for p in spool_files(directory, ingested=True):
            header = read_header(p)
            if header is not None and spool_key(header) in tally.ranks:
                paths.append((p, False))
    seen: set[str] = set()
    for path, explicit in paths:
        try:
            spool = read_spool(path)
        except SpoolError as exc:
            if explicit:
                res.warnings.append(f"spool {path}: {exc}")
            continue
        if spool.id in seen:
            continue
        seen.add(spool.id)
        recorded = spool.id in tally.ids
        if spool.error and (explicit or not recorded):
            res.warnings.append(f"spool {path} is damaged: {spool.error}; " + (
                "the recording holds it already" if recorded else
                f"its {spool.records} records before the damage are merged"))
        if recorded:
            tally.spools.append({**spool.summary(), "source": "already recorded"})
            continue
        summary = {**spool.summary(), "source": "merged"}
        tally.spools.append(summary)
        tally.current = summary
        peer = None
        t = state.now
        for _, frame in spool.frames:
            try:
                rs = state.apply(frame, t, peer=peer)
            except ProtocolError as exc:
                res.warnings.append(f"spool {path}: a {frame.kind[:20]} frame skipped: {exc}")
                if frame.kind == wire.KIND_HELLO:
                    break
                continue
            if frame.kind == wire.KIND_HELLO:
                peer = rs
            on_frame(t, frame, state)
        tally.current = None


def _spool_lines(run: dict[str, Any]) -> list[str]:
    """What came from spools (ranks that could not reach a hub at their end)."""
    used = [s for s in run.get("spools") or [] if s.get("source") in ("recording", "merged")]
    if not used:
        return []
    ranks = sorted({s.get("rank") for s in used if isinstance(s.get("rank"), int)})
    merged = sum(1 for s in used if s.get("source") == "merged")
    line = (f"spooled: {run.get('spooled_records', 0)} records came from {len(used)} "
            f"spool file{'s' if len(used) != 1 else ''} (rank{'s' if len(ranks) != 1 else ''} "
            f"{', '.join(str(r) for r in ranks[:8])}{' …' if len(ranks) > 8 else ''}: no hub "
            f"took them at the end; {merged} merged by this report)")
    out = [line]
    if run.get("spool_dropped_records"):
        out.append(f"spooled: {run['spool_dropped_records']} records did not fit the "
                   "spools' bound and were dropped (counted in the ranks' dropped records)")
    damaged = [s for s in used if s.get("error")]
    out += [f"spooled: {s.get('path')} is damaged: {s.get('error')}" for s in damaged[:5]]
    return out

