"""How often rtop's diagnosis is right: precision, recall, false alarms and latency on
simulated fleets, beside a naive baseline, written to ``docs/diagnosis.md``.

Every scenario of :func:`rtop.fleetsim.scenarios` (a healthy fleet and each fault) at
1,024 ranks for ``--seeds`` seeds, and a subset at 64 and 4,096 ranks, is written as a
recording through the real wire format (:func:`rtop.fleetsim.write_recording`) and
replayed once through the diagnosis exactly as ``rtop report`` runs it (every half
second of hub time, :mod:`rtop.fleetscore`). In the same replay a **naive baseline**
judges every moment too: the fixed thresholds rtop used before issue 26, applied to each
rank's latest sample (its last step, its last GPU sample) against the others' median,
with no persistence and no peer spread. It differs from rtop only in the kinds the
issue changed (starved_rank, input_bound, straggler, gpu_throttled, memory_wall); for
every other kind (lost_rank, hung_rank, slow_link, ...) it repeats rtop's finding.

    python benchmarks/diagnosis_accuracy.py                   # the full matrix (make accuracy)
    python benchmarks/diagnosis_accuracy.py --quick           # 64 and 256 ranks, 1 seed
    python benchmarks/diagnosis_accuracy.py --scales 1024 --seeds 5 --jobs 2

Runs ``--jobs`` processes side by side (each scenario's recording is written to a
temporary directory and removed once scored). The targets of issue 26 are checked and
printed; the script exits 1 when one is missed (``--no-fail`` to write the page anyway).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from collectors.nvml import THROTTLE_REASONS, decode_reasons  # noqa: E402
from rtop.analysis.config import AnalysisConfig  # noqa: E402
from rtop.analysis.window import take  # noqa: E402
from rtop.fleetscore import named_with, score  # noqa: E402
from rtop.fleetsim import LEAK_S, FleetSpec, scenarios, write_recording  # noqa: E402

#: The fleet runs InfiniBand between nodes (the user's setting ``inter_node_fabric``).
CFG = AnalysisConfig(inter_node_fabric="infiniband")
#: Seconds of each simulated run (faults start a quarter in, at least 30 s); a fast leak
#: runs on until its memory wall (about 105 s), a slow one's (about 450 s) is forecast
#: (``fleetsim.LEAK_RUN_ON_S``).
DURATION_S = 120.0
#: The scenarios run at the small and large scales (every one runs at 1,024).
SUBSET = ("healthy", "starved", "slow_node", "throttled", "lost_node", "two_faults")
#: Kinds the naive baseline judges itself; it repeats rtop's finding for the others.
NAIVE_KINDS = frozenset({"starved_rank", "input_bound", "straggler", "gpu_throttled",
                         "memory_wall"})

# The fixed thresholds rtop used before issue 26 (rtop/analysis/config.py at e223356).
NAIVE = {"starved_ratio": 3.0, "starved_min_wait_s": 0.005, "starved_min_share": 0.15,
         "straggler_ratio": 1.3, "straggler_min_excess_s": 0.005,
         "straggler_min_share": 0.10, "straggler_max_share": 0.5,
         "throttle_clock_ratio": 0.9, "headroom_min": 0.10, "input_bound_share": 0.5}


def _last(values: np.ndarray) -> np.ndarray:
    """Each row's last measured value (NaN where none)."""
    ok = ~np.isnan(values)
    idx = np.where(ok.any(axis=1), values.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1), 0)
    out = values[np.arange(len(values)), idx]
    out[~ok.any(axis=1)] = np.nan
    return out


def naive(state: Any, t: float, ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The naive baseline's findings at ``t`` (see the module doc)."""
    out = [f for f in ours if f["kind"] not in NAIVE_KINDS]
    w = take(state, CFG, t)
    if w.n == 0:
        return out
    rank, act = w.rank, w.active
    step = _last(w.recent["step_s"])
    data = _last(w.recent["data_wait_s"])
    comp = _last(w.recent["compute_s"])
    with np.errstate(invalid="ignore"):
        starving = act & (data >= NAIVE["starved_min_wait_s"]) \
            & (data >= NAIVE["starved_min_share"] * step)
        if starving.sum() > NAIVE["input_bound_share"] * act.sum():
            out.append({"kind": "input_bound", "ranks": rank[act].tolist()})
        else:
            starved = starving & (data >= NAIVE["starved_ratio"] * w.others_median(data))
            if starved.any():
                out.append({"kind": "starved_rank", "ranks": rank[starved].tolist()})
        excess = comp - w.others_median(comp)
        slow = act & (comp >= NAIVE["straggler_ratio"] * w.others_median(comp)) \
            & (excess >= NAIVE["straggler_min_excess_s"]) \
            & (excess >= NAIVE["straggler_min_share"] * step)
        if slow.any() and slow.sum() <= NAIVE["straggler_max_share"] * act.sum():
            out.append({"kind": "straggler", "ranks": rank[slow].tolist()})
        lat = w.latest
        clock, mx, mask = (lat["gpu_sm_clock_mhz"], lat["gpu_sm_clock_max_mhz"],
                           lat["gpu_clock_event_reasons"])
        low = act & (clock < NAIVE["throttle_clock_ratio"] * mx) & ~np.isnan(mask)
        throttled = [int(rank[i]) for i in np.flatnonzero(low)
                     if any(r in THROTTLE_REASONS for r in decode_reasons(int(mask[i])))]
        if throttled:
            out.append({"kind": "gpu_throttled", "ranks": throttled})
        cap, peak = lat["mem_capacity_bytes"], lat["mem_peak_bytes"]
        wall = act & ((cap - peak) < NAIVE["headroom_min"] * cap)
        if wall.any():
            out.append({"kind": "memory_wall", "ranks": rank[wall].tolist()})
    return out


def run_one(ranks: int, scenario: str, seed: int, tmp: str) -> dict[str, Any]:
    """Simulate, replay and score one run; its scores for rtop and the baseline."""
    spec = FleetSpec(ranks=ranks, seed=seed, duration_s=DURATION_S)
    path = Path(tmp) / f"{ranks}-{scenario}-{seed}.rtop"
    t0 = time.perf_counter()
    truth = write_recording(path, spec, scenario)
    t1 = time.perf_counter()
    judged = named_with(path, CFG, {"naive": naive})
    t2 = time.perf_counter()
    size = path.stat().st_size
    path.unlink()
    out: dict[str, Any] = {"ranks": ranks, "scenario": scenario, "seed": seed,
                           "write_s": t1 - t0, "replay_s": t2 - t1, "bytes": size,
                           "steps": truth.steps, "step_s": truth.step_s_median}
    for who, found in judged.items():
        s = score(truth, found)
        out[who] = asdict(s)
        out[who + "_eval_ms"] = [x * 1e3 for x in found.eval_s]
        out[who + "_facts"] = sorted(found.facts)
    return out


# ---- the page -----------------------------------------------------------------------


def _ratio(a: int, b: int) -> str:
    return "n/a" if b == 0 else f"{a / b:.3f}"


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _kinds(results: list[dict[str, Any]], who: str) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for r in results:
        for part, prefix in (("by_kind", ""), ("by_kind_nodes", "n_")):
            for kind, row in r[who][part].items():
                t = table.setdefault(kind, {"tp": 0, "fp": 0, "fn": 0, "n_tp": 0, "n_fp": 0,
                                            "n_fn": 0})
                for k, v in row.items():
                    t[prefix + k] += v
    return table


def _latencies(results: list[dict[str, Any]], who: str) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for r in results:
        for lat in r[who]["latencies"]:
            row = out.setdefault(lat["fault"], {"s": [], "steps": [], "missed": [],
                                                "before_wall": []})
            if lat["seconds"] is None:
                row["missed"].append(1.0)
                continue
            row["s"].append(lat["seconds"])
            row["steps"].append(lat["steps"])
            if lat["before_wall_s"] is not None:
                row["before_wall"].append(lat["before_wall_s"])
    return out


def _false_per_khours(results: list[dict[str, Any]], who: str) -> tuple[int, float, float]:
    healthy = [r for r in results if r["scenario"] == "healthy"]
    fp = sum(r[who]["fp_ranks"] for r in healthy)
    hours = sum(r[who]["rank_hours"] for r in healthy)
    return fp, hours, (fp / hours * 1000.0 if hours else math.nan)


def check_targets(results: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """Issue 26's targets, each with whether rtop met it and the measure."""
    checks: list[tuple[str, bool, str]] = []
    healthy = [r for r in results if r["scenario"] == "healthy"]
    worst = max((r["rtop"]["fp_ranks"] for r in healthy), default=0)
    checks.append(("0 false rank faults on every healthy seed", worst == 0,
                   f"{len(healthy)} healthy runs, most false rank faults in one: {worst}"))
    kinds = _kinds(results, "rtop")
    tp = sum(k["tp"] for k in kinds.values())
    fp = sum(k["fp"] for k in kinds.values())
    fn = sum(k["fn"] for k in kinds.values())
    p = tp / (tp + fp) if tp + fp else 1.0
    rc = tp / (tp + fn) if tp + fn else 1.0
    checks.append(("precision ≥ 0.99 (ranks, every kind together)", p >= 0.99,
                   f"{p:.4f} ({tp} right, {fp} false)"))
    checks.append(("recall ≥ 0.99 (ranks, every kind together)", rc >= 0.99,
                   f"{rc:.4f} ({tp} of {tp + fn})"))
    lats = _latencies(results, "rtop")
    for fault in ("starved", "straggler", "throttled"):
        row = lats.get(fault)
        if not row:
            continue
        bad = [(s, st) for s, st in zip(row["s"], row["steps"], strict=True)
               if s > 2.0 and st > 3.0]
        checks.append((f"{fault} named within 3 steps or 2 s of onset (the longer)",
                       not bad and not row["missed"],
                       f"worst {max(row['s']):.1f} s / {max(row['steps']):.1f} steps, "
                       f"{len(row['missed'])} missed of {len(row['s']) + len(row['missed'])}"))
    for fault, need in (("leak_slow", 60.0), ("leak_fast", None)):
        row = lats.get(fault)
        if not row:
            continue
        steps = [r["step_s"] for r in results if r["scenario"] == fault]
        need_s = need if need is not None else 10 * max(steps)
        least = min(row["before_wall"]) if row["before_wall"] else None
        ok = least is not None and least >= need_s and not row["missed"]
        what = "60 s" if need is not None else "10 steps"
        checks.append((f"{fault.replace('_', ' ')}: the wall named at least {what} before",
                       ok, f"least {_fmt(least)} s before the wall"))
    return checks


def write_page(results: list[dict[str, Any]], path: Path, args: argparse.Namespace,
               checks: list[tuple[str, bool, str]], wall_s: float) -> None:
    """docs/diagnosis.md from the results."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    scales = sorted({r["ranks"] for r in results})
    run_min = sum(r["write_s"] + r["replay_s"] for r in results) / 60.0
    made_at: dict[str, int] = {}
    for r in results:
        made_at[r.get("commit", "?")[:7]] = made_at.get(r.get("commit", "?")[:7], 0) + 1
    since = []
    for c in made_at:
        log = subprocess.run(["git", "log", "--oneline", f"{c}..HEAD", "--", "rtop/analysis",
                              "rtop/run", "rtop/fleetsim.py", "rtop/fleetscore.py"],
                             cwd=ROOT, capture_output=True, text=True).stdout.strip()
        if log:
            since.append(f"since `{c}`: " + "; ".join(
                f"`{line[:7]}` {line[8:90]}" for line in log.splitlines()))
    lines = [
        "# How often rtop's diagnosis is right",
        "",
        f"Written by `make accuracy` (`benchmarks/diagnosis_accuracy.py`) at commit "
        f"`{commit}` on {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} "
        f"cores: {len(results)} simulated runs, {run_min:.0f} min of simulation and replay. "
        "Every figure below is measured in those runs (each run's scores are in "
        "[diagnosis-runs.jsonl](diagnosis-runs.jsonl)); nothing is typed in by hand. Runs "
        f"made at {', '.join(f'`{c}` ({n})' for c, n in made_at.items())}"
        + (f"; changes to the diagnosis, the run state or the simulator {', '.join(since)}"
           if since else "") + ".",
        "",
        "**How.** `rtop.fleetsim` simulates a fleet in nodes of 8 GPUs (~1 s steps) with a "
        "real fleet's noise: a per-GPU speed spread (1.5 %), per-step jitter (2 %), "
        "file-system hiccups of 100–300 ms on random ranks (some spilling into a second "
        "step), GC pauses, rank 0's logging and a 3 s evaluation every 100 steps, a "
        "synchronized 6 s checkpoint every 150 steps, every GPU power-capped (~92 % of its "
        "max clock with the SW power-cap reason), warm nodes, NCCL jitter and spikes, clock "
        "offsets between ranks. Each run is written as a recording through the real wire "
        "format and replayed through the diagnosis exactly as `rtop report` runs it (every "
        "half second of hub time). Faults start a quarter into the run (at least 30 s). A "
        "rank named by a finding of its fault's kind is right; any other rank named by a "
        "rank-fault kind is a false alarm. A node is named when every rank of it is in one "
        "finding. Job facts (every GPU power-capped, every rank waiting for data) are not "
        "rank faults. Latency is from the fault's onset (for a fault that acts on steps, "
        "the start of the first step it acts on; for a GPU's clock, a leak or a lost rank, "
        "the moment it begins) to the first evaluation that names it (for a node, its last "
        "rank), in seconds and in the run's median steps; it includes the collectors' "
        "half-second batching and the hub's half-second evaluation cadence.",
        "",
        "**The naive baseline** is rtop's diagnosis before issue 26: its fixed thresholds "
        "(starved: data wait ≥ 3× the others' median, ≥ 5 ms and ≥ 15 % of the step; "
        "straggler: compute ≥ 1.3× the others' median, excess ≥ 10 % of the step; throttled: "
        "SM clock < 90 % of max with a throttle reason; memory: headroom < 10 %) on each "
        "rank's latest sample, judged in the same replay. For the kinds issue 26 did not "
        "change (lost, hung, slow link) it repeats rtop's finding.",
        "",
        "## Targets",
        "",
        "| target | met | measured |",
        "|---|---|---|",
        *[f"| {name} | {'yes' if ok else '**no**'} | {what} |" for name, ok, what in checks],
        "",
        "## False alarms on healthy fleets",
        "",
        "| ranks | healthy runs | rank-hours | rtop: false rank faults | per 1,000 rank-hours "
        "| naive: false rank faults | per 1,000 rank-hours |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in scales:
        sub = [r for r in results if r["ranks"] == n]
        fp, hours, rate = _false_per_khours(sub, "rtop")
        nfp, _, nrate = _false_per_khours(sub, "naive")
        runs = len([r for r in sub if r["scenario"] == "healthy"])
        lines.append(f"| {n:,} | {runs} | {hours:.1f} | {fp} | {rate:.2f} | {nfp} | "
                     f"{nrate:.1f} |")
    facts = sorted({f for r in results if r["scenario"] == "healthy" for f in r["rtop_facts"]})
    lines += ["", f"Job facts rtop stated on healthy fleets (not faults): "
              f"{', '.join(facts) or 'none'}.", ""]
    for n in scales:
        sub = [r for r in results if r["ranks"] == n]
        seeds = sorted({r["seed"] for r in sub})
        lines += [f"## {n:,} ranks ({len({r['scenario'] for r in sub})} scenarios × "
                  f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''})", "",
                  "Per finding kind, over every run at this scale (ranks; nodes where a fault "
                  "strikes a whole node):", "",
                  "| kind | rtop precision | rtop recall | nodes P / R | naive precision "
                  "| naive recall | naive nodes P / R |",
                  "|---|---|---|---|---|---|---|"]
        ours, theirs = _kinds(sub, "rtop"), _kinds(sub, "naive")
        for kind in sorted(set(ours) | set(theirs)):
            a = ours.get(kind, {"tp": 0, "fp": 0, "fn": 0, "n_tp": 0, "n_fp": 0, "n_fn": 0})
            b = theirs.get(kind, {"tp": 0, "fp": 0, "fn": 0, "n_tp": 0, "n_fp": 0,
                                  "n_fn": 0})

            def nodes(x: dict[str, int]) -> str:
                if not x["n_tp"] + x["n_fp"] + x["n_fn"]:
                    return "—"
                return (f"{_ratio(x['n_tp'], x['n_tp'] + x['n_fp'])} / "
                        f"{_ratio(x['n_tp'], x['n_tp'] + x['n_fn'])}")

            lines.append(
                f"| {kind} | {_ratio(a['tp'], a['tp'] + a['fp'])} ({a['fp']} false) | "
                f"{_ratio(a['tp'], a['tp'] + a['fn'])} | {nodes(a)} | "
                f"{_ratio(b['tp'], b['tp'] + b['fp'])} ({b['fp']} false) | "
                f"{_ratio(b['tp'], b['tp'] + b['fn'])} | {nodes(b)} |")
        lines += ["", "Detection latency per fault (from onset; median / p95):", "",
                  "| fault | rtop s | rtop steps | naive s | naive steps | missed (rtop / naive) "
                  "| named before the wall, least (rtop / naive) |",
                  "|---|---|---|---|---|---|---|"]
        la, lb = _latencies(sub, "rtop"), _latencies(sub, "naive")
        for fault in sorted(set(la) | set(lb)):
            a_, b_ = la.get(fault), lb.get(fault)

            def med_p95(row: dict[str, list[float]] | None, key: str) -> str:
                if not row or not row[key]:
                    return "—"
                return f"{statistics.median(row[key]):.1f} / {_pct(row[key], 95):.1f}"

            def missed(row: dict[str, list[float]] | None) -> str:
                if not row:
                    return "—"
                return f"{len(row['missed'])} of {len(row['missed']) + len(row['s'])}"

            def wall(row: dict[str, list[float]] | None) -> str:
                return _fmt(min(row["before_wall"]) if row and row["before_wall"] else None,
                            ".0f")

            lines.append(f"| {fault} | {med_p95(a_, 's')} | {med_p95(a_, 'steps')} | "
                         f"{med_p95(b_, 's')} | {med_p95(b_, 'steps')} | "
                         f"{missed(a_)} / {missed(b_)} | {wall(a_)} s / {wall(b_)} s |")
        ev = [x for r in sub for x in r["rtop_eval_ms"]]
        lines += ["", f"One evaluation of the diagnosis at {n:,} ranks: median "
                  f"{statistics.median(ev):.1f} ms, p95 {_pct(ev, 95):.1f} ms "
                  f"({len(ev):,} evaluations; budget: the hub's 500 ms cadence; "
                  "`benchmarks/analysis_speed.py` measures it alone).", ""]
        wrong = [(r["scenario"], r["seed"], r["rtop"]["false_rank_faults"],
                  r["rtop"]["false_job_facts"]) for r in sub
                 if r["rtop"]["false_rank_faults"] or r["rtop"]["false_job_facts"]]
        if wrong:
            lines += ["rtop's false alarms at this scale (scenario, seed, kind and rank):", ""]
            lines += [f"- {s} seed {seed}: {', '.join(f'{k} rank {r}' for k, r in f[:8])}"
                      f"{' …' if len(f) > 8 else ''}{' ' + ', '.join(j) if j else ''}"
                      for s, seed, f, j in wrong]
            lines.append("")
    lines += ["## Scenarios", "",
              "| scenario | faults |", "|---|---|",
              *[f"| {name} | {', '.join(f'{f.kind} (size {f.size})' if f.size else f.kind for f in sc.faults) or 'none'} |"  # noqa: E501
                for name, sc in scenarios(FleetSpec(ranks=1024, seed=0)).items()],
              "", f"Leaks fill their GPU in about {LEAK_S['leak_fast']:.0f} s (fast) and "
              f"{LEAK_S['leak_slow']:.0f} s (slow) from onset.", ""]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[1024, 64, 4096])
    ap.add_argument("--seeds", type=int, default=5, help="seeds at 1,024 ranks and fewer")
    ap.add_argument("--large-seeds", type=int, default=1, help="seeds above 1,024 ranks")
    ap.add_argument("--scenarios", nargs="+", default=None,
                    help="only these scenarios (default: every one at 1,024, a subset above "
                    "and below)")
    ap.add_argument("--seed-from", type=int, default=1,
                    help="the first seed (to share a matrix among processes)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "diagnosis.md")
    ap.add_argument("--quick", action="store_true", help="64 and 256 ranks, 1 seed")
    ap.add_argument("--no-fail", action="store_true")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "diagnosis-runs.jsonl",
                    help="each run's scores, one JSON line each, written as they finish")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs --results already holds for this commit; run the rest")
    ap.add_argument("--page-only", action="store_true",
                    help="run nothing: write the page from the runs kept (--merge, --resume)")
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="another process's --results file to keep too (the page says at which "
                    "commits its runs were made, and what changed in the diagnosis since)")
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    tasks: list[tuple[int, str, int]] = []
    names = list(scenarios(FleetSpec(ranks=64)))
    if args.quick:
        tasks = [(n, s, 1) for n in (64, 256) for s in names]
    else:
        for n in args.scales:
            main_scale = n == 1024 or len(args.scales) == 1
            seeds = args.seeds if n <= 1024 else args.large_seeds
            for seed in range(args.seed_from, seeds + 1):
                tasks += [(n, s, seed) for s in names if (main_scale or s in SUBSET)
                          and (args.scenarios is None or s in args.scenarios)]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    results: list[dict[str, Any]] = []
    sources = [(f, False) for f in args.merge]  # another process's runs: any commit
    if args.resume and args.results.exists():
        sources.append((args.results, True))  # our own: this commit's only
    for path, own in sources:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            key = (r["ranks"], r["scenario"], r["seed"])
            if (not own or r.get("commit") == commit) and key in tasks:
                results.append(r)
                tasks.remove(key)
    if sources:
        print(f"{len(results)} runs kept", flush=True)
    if args.page_only:
        tasks = []
    if not args.resume:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text("")
    # the largest first, so the pool ends on small ones
    tasks.sort(key=lambda x: -x[0] * (4 if x[1] == "leak_slow" else 1))
    kept = len(results)
    print(f"{len(tasks)} runs on {args.jobs} processes", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rtop-accuracy-") as tmp, \
            concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futs = {pool.submit(run_one, n, s, seed, tmp): (n, s, seed) for n, s, seed in tasks}
        for fut in concurrent.futures.as_completed(futs):
            r = fut.result()
            r["commit"] = commit
            results.append(r)
            with args.results.open("a") as out:  # the baseline's thousands of false
                # alarms are counted (fp_ranks), not listed; a tenth of the timings kept
                kept_r = {k: v for k, v in r.items() if not k.endswith("_eval_ms")}
                kept_r["naive"] = {**r["naive"], "false_rank_faults": []}
                kept_r["rtop_eval_ms"] = r["rtop_eval_ms"][::10]
                out.write(json.dumps(kept_r) + "\n")
            lat = [(x["fault"], _fmt(x["seconds"])) for x in r["rtop"]["latencies"]]
            print(f"[{len(results)}/{len(tasks) + kept}] {r['ranks']:>5} {r['scenario']:<12} "
                  f"seed {r['seed']}: rtop fp {r['rtop']['fp_ranks']} fn "
                  f"{r['rtop']['fn_ranks']} lat {lat} | naive fp {r['naive']['fp_ranks']} "
                  f"fn {r['naive']['fn_ranks']}  ({r['write_s']:.0f}+{r['replay_s']:.0f} s)",
                  flush=True)
    wall_s = time.perf_counter() - t0
    with args.results.open("w") as out:  # every run this page is made of, merged ones too
        for r in results:
            r = {k: v for k, v in r.items() if k != "naive_eval_ms"}
            r["naive"] = {**r["naive"], "false_rank_faults": []}
            r["rtop_eval_ms"] = r["rtop_eval_ms"][::10] if len(r["rtop_eval_ms"]) > 100 \
                else r["rtop_eval_ms"]
            out.write(json.dumps(r) + "\n")
    checks = check_targets([r for r in results if r["ranks"] == 1024] or results)
    for name, ok, what in checks:
        print(f"{'PASS' if ok else 'MISS'}  {name}: {what}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_page(sorted(results, key=lambda r: (r["ranks"], r["scenario"], r["seed"])),
               args.out, args, checks, wall_s)
    print(f"wrote {args.out}")
    return 0 if args.no_fail or all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
