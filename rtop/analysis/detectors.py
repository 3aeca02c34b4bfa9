"""The detectors: pure functions from a :class:`Window` to findings.

Each returns at most one :class:`Finding` of its kind, naming every rank it concerns.
``active`` holds the ranks of the kind's finding that is already active; those ranks
are judged against the lower ``*_clear`` thresholds so a finding does not flap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collectors.nvml import THROTTLE_REASONS, decode_reasons
from rtop.analysis.config import AnalysisConfig
from rtop.analysis.window import Window
from rtop.run.snapshot import FindingDict, Severity

LOST_TOGETHER_S = 0.3  # ranks lost this close to the first one are named with it
MAX_EVIDENCE_RANKS = 8


@dataclass
class Finding:
    """What is wrong, where, why rtop thinks so, and what usually fixes it."""

    kind: str
    ranks: list[int]
    severity: Severity
    summary: str
    evidence: dict[str, Any]
    fix: str
    impact: float = 0.0  # share of the job's step time this costs, for ordering

    def to_dict(self) -> FindingDict:
        """The finding as the report's JSON and the snapshot carry it."""
        return FindingDict(kind=self.kind, ranks=self.ranks, severity=self.severity,
                           summary=self.summary, evidence=self.evidence, fix=self.fix,
                           impact=round(self.impact, 4))


def _f(x: Any) -> float | None:
    """A number for evidence: None for NaN/missing, rounded sensibly."""
    if x is None:
        return None
    v = float(x)
    if math.isnan(v) or math.isinf(v):
        return None
    return float(f"{v:.4g}")


def ms(x: float) -> str:
    """Seconds as milliseconds for a sentence."""
    return f"{x * 1e3:.0f} ms" if x >= 0.0095 else f"{x * 1e3:.1f} ms"


def _names(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"Rank {ranks[0]}"
    if len(ranks) == 2:
        return f"Ranks {ranks[0]} and {ranks[1]}"
    shown = ", ".join(str(r) for r in ranks[:5])
    return f"Ranks {shown}{' and others' if len(ranks) > 5 else ''}"


def _verb(ranks: list[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _nanmedian(a: np.ndarray) -> float:
    return float(np.nanmedian(a)) if a.size and not np.isnan(a).all() else math.nan


@dataclass
class Context:
    """What the detectors share within one evaluation."""

    w: Window
    cfg: AnalysisConfig
    active: dict[str, set[int]] = field(default_factory=dict)
    excluded: set[int] = field(default_factory=set)  # hung or lost: their figures are stale

    def factor(self, kind: str, rank: int, clear: float) -> float:
        """1.0, or the clear factor when ``rank`` is already flagged for ``kind``."""
        return clear if rank in self.active.get(kind, ()) else 1.0

    def factors(self, kind: str, clear: float) -> np.ndarray:
        """Per rank: the clear factor where already flagged for ``kind``, else 1.0."""
        flagged = self.active.get(kind)
        if not flagged:
            return np.ones(self.w.n)
        return np.where(np.isin(self.w.rank, list(flagged)), clear, 1.0)

    def judged(self) -> np.ndarray:
        """Mask of ranks whose step figures may be compared (active, not excluded)."""
        ok = self.w.active.copy()
        if self.excluded:
            ok &= ~np.isin(self.w.rank, list(self.excluded))
        return ok


# ---- lost and hung -------------------------------------------------------------------

def lost_rank(ctx: Context) -> Finding | None:
    """Ranks that stopped sending (silent past the hub's timeout, or gone without bye)."""
    w = ctx.w
    lost = [i for i in range(w.n) if w.status[i] == "lost"]
    if not lost:
        return None
    ctx.excluded.update(int(w.rank[i]) for i in lost)
    # The first to go is the culprit; ranks lost within a moment after it followed it
    # (a launcher killing the rest, a collective erroring out), and are evidence.
    at = {i: (w.ranks[i].lost_at or w.ranks[i].last_seen) for i in lost}
    first = min(at.values())
    followers = [i for i in lost if at[i] > first + LOST_TOGETHER_S]
    lost = [i for i in lost if at[i] <= first + LOST_TOGETHER_S]
    ranks = [int(w.rank[i]) for i in lost]
    ev: dict[str, Any] = {str(w.rank[i]): {"node": w.ranks[i].node,
                                           "last_step": w.ranks[i].last_step,
                                           "silent_s": _f(w.t - w.ranks[i].last_seen),
                                           "last_phase": w.phase[i]}
                          for i in lost[:MAX_EVIDENCE_RANKS]}
    i0 = lost[0]
    summary = (f"{_names(ranks)} stopped reporting (last step {w.ranks[i0].last_step}, "
               f"{w.t - w.ranks[i0].last_seen:.0f} s ago): the process likely died or its "
               f"node went away; the others will block in the next collective.")
    then = [int(w.rank[i]) for i in followers]
    if then:
        summary += f" {len(then)} more rank{'s' if len(then) > 1 else ''} went after it."
    return Finding("lost_rank", ranks, "critical", summary,
                   {"ranks": ev, "lost_after_them": then[:64]},
                   "Check the rank's log and the node's kernel log (OOM killer, Xid errors, "
                   "segfaults). With Ray Train, FailureConfig(max_failures=...) restarts the "
                   "worker group from the last checkpoint.", impact=1.0)


def hung_rank(ctx: Context) -> Finding | None:
    """A rank stuck in one phase far longer than a step takes; peers waiting inside the
    collective for it are not culprits."""
    w, cfg = ctx.w, ctx.cfg
    med_step = _nanmedian(w.steps["step_s"])
    limit = max(cfg.hung_min_s, cfg.hung_step_multiple * (med_step if med_step == med_step
                                                          else 0.0))
    peers_in_comm = [i for i in range(w.n) if w.phase[i] == "comm"]
    hung = []
    with np.errstate(invalid="ignore"):
        long_phase = np.flatnonzero(w.active & (w.phase_age_s > limit)).tolist()
    for i in long_phase:
        if int(w.rank[i]) in ctx.excluded:
            continue
        phase = w.phase[i]
        if phase in ("data", "compute", "checkpoint") or (
                phase == "idle" and peers_in_comm and i not in peers_in_comm):
            hung.append(i)
    if not hung:
        return None
    ranks = [int(w.rank[i]) for i in hung]
    ctx.excluded.update(ranks)
    i0 = hung[0]
    ev: dict[str, Any] = {
        "threshold_s": _f(limit), "median_step_s": _f(med_step),
        "peers_waiting_in_collective": [int(w.rank[i]) for i in peers_in_comm][:32],
        "ranks": {str(w.rank[i]): {"phase": w.phase[i], "phase_s": _f(w.phase_age_s[i]),
                                   "last_step": w.ranks[i].last_step,
                                   "stack": w.ranks[i].stack}
                  for i in hung[:MAX_EVIDENCE_RANKS]},
    }
    waiting = f"; {len(peers_in_comm)} peers wait for it in the allreduce" if peers_in_comm \
        else ""
    step_txt = ms(med_step) if not math.isnan(med_step) else "n/a"
    summary = (f"{_names(ranks)} {_verb(ranks, 'has', 'have')} been stuck in {w.phase[i0]} for "
               f"{w.phase_age_s[i0]:.0f} s (a step takes {step_txt}){waiting}.")
    return Finding("hung_rank", ranks, "critical", summary, ev,
                   "Read the stack in the evidence: it shows where the rank waits. Usual "
                   "causes: a data-loader worker deadlocked or a hung filesystem read, a "
                   "collective that only some ranks call, an exception swallowed on one "
                   "rank. py-spy dump --pid gives the native frames too.", impact=1.0)


# ---- input ---------------------------------------------------------------------------

def input_findings(ctx: Context) -> list[Finding]:
    """``input_bound`` when (nearly) every rank waits for data, else ``starved_rank``."""
    w, cfg = ctx.w, ctx.cfg
    ok = ctx.judged()
    dw, st = w.steps["data_wait_s"], w.steps["step_s"]
    if not ok.any() or np.isnan(dw[ok]).all():
        return []
    with np.errstate(invalid="ignore", divide="ignore"):
        share = dw / st
    waiting = ok & (dw >= cfg.starved_min_wait_s) & (share >= cfg.input_bound_share)
    n_ok = int(ok.sum())
    if (n_ok >= 2 and waiting.sum() >= max(2, math.ceil(cfg.input_bound_fraction * n_ok))) \
            or (n_ok == 1 and waiting.any()):
        ranks = [int(r) for r in w.rank[ok]]
        med_wait, med_share = _nanmedian(dw[ok]), _nanmedian(share[ok])
        ev_in: dict[str, Any] = {
            "data_wait_s_median": _f(med_wait), "data_wait_share_median": _f(med_share),
            "step_s_median": _f(_nanmedian(st[ok])), "ranks_waiting": int(waiting.sum()),
            "ranks": n_ok,
            "loader_cpu_pct_median": _f(_nanmedian(w.latest["host_loader_cpu_pct"][ok]))}
        who = "The rank waits" if n_ok == 1 else "Every rank waits"
        summary = (f"{who} {ms(med_wait)} per step for data ({med_share:.0%} of the step): "
                   "the input pipeline, not any one rank, sets the pace.")
        return [Finding("input_bound", ranks, "warning", summary, ev_in,
                        "Feed faster: more DataLoader workers (num_workers) and "
                        "prefetch_factor, or Ray Data prefetch_batches; cheaper decoding "
                        "and augmentation (or move it to the GPU); faster or local storage. "
                        "More GPUs will not help until the pipeline keeps up.",
                        impact=med_share)]
    others = w.others_median(np.where(ok, dw, np.nan))
    k = ctx.factors("starved_rank", cfg.starved_clear)
    base = np.where(np.isnan(others), 0.0, others)
    with np.errstate(invalid="ignore"):
        hit = ok & (dw >= np.maximum(cfg.starved_min_wait_s * k, cfg.starved_ratio * k * base)) \
            & (share >= cfg.starved_min_share * k)
    flagged = sorted(np.flatnonzero(hit).tolist(), key=lambda i: -dw[i])
    if not flagged:
        return []
    ranks = [int(w.rank[i]) for i in flagged]
    comm = w.steps["comm_s"]
    peer_comm = _nanmedian(np.delete(comm, flagged)[ok[np.setdiff1d(np.arange(w.n), flagged)]]) \
        if w.n > len(flagged) else math.nan
    ev: dict[str, Any] = {"ranks": {str(w.rank[i]): {
        "node": w.ranks[i].node, "data_wait_s": _f(dw[i]), "peers_data_wait_s": _f(others[i]),
        "step_s": _f(st[i]), "data_wait_share": _f(share[i]), "comm_s": _f(comm[i]),
        "loader_cpu_pct": _f(w.latest["host_loader_cpu_pct"][i]),
        "loader_procs": _f(w.latest["host_loader_procs"][i]),
        "host_cpu_pct": _f(w.latest["host_sys_cpu_pct"][i]),
    } for i in flagged[:MAX_EVIDENCE_RANKS]}, "peers_comm_s_median": _f(peer_comm)}
    i0 = flagged[0]
    times = dw[i0] / others[i0] if others[i0] and others[i0] == others[i0] and others[i0] > 0 \
        else math.inf
    ratio = f"{times:.0f}x its peers ({ms(others[i0])})" if math.isfinite(times) \
        and times < 100 else f"while its peers wait {ms(others[i0])}" \
        if others[i0] == others[i0] else "while its peers do not wait"
    then = (f"; the others then wait for it inside the allreduce ({ms(peer_comm)} vs "
            f"{ms(comm[i0])})") if peer_comm == peer_comm and comm[i0] == comm[i0] \
        and peer_comm > comm[i0] else ""
    summary = (f"{_names(ranks)} {_verb(ranks, 'waits', 'wait')} {ms(dw[i0])} per step for "
               f"data, {ratio}{then}.")
    node = w.ranks[i0].node
    return [Finding("starved_rank", ranks, "warning", summary, ev,
                    f"Give {_names(ranks).lower()}'s input more throughput: raise DataLoader "
                    "num_workers and prefetch_factor (Ray Data: prefetch_batches), cache or "
                    "move its shard to faster local storage, and check node "
                    f"{node}'s CPU and disk: its loader competes there.",
                    impact=float(share[i0]))]


# ---- compute -------------------------------------------------------------------------

def _straggler_cause(w: Window, i: int, peers: np.ndarray, cfg: AnalysisConfig
                     ) -> tuple[str, dict[str, Any]]:
    lat = w.latest
    clock, clock_max = lat["gpu_sm_clock_mhz"][i], lat["gpu_sm_clock_max_mhz"][i]
    reasons_mask = lat["gpu_clock_event_reasons"][i]
    reasons = decode_reasons(int(reasons_mask)) if reasons_mask == reasons_mask else []
    power, limit = lat["gpu_power_w"][i], lat["gpu_power_limit_w"][i]
    temp = lat["gpu_temp_c"][i]
    ev = {"sm_clock_mhz": _f(clock), "sm_clock_max_mhz": _f(clock_max),
          "clock_event_reasons": reasons, "power_w": _f(power), "power_limit_w": _f(limit),
          "temp_c": _f(temp), "gpu": w.gpu_name[i],
          "host_cpu_pct": _f(lat["host_sys_cpu_pct"][i]),
          "load_avg_1m": _f(lat["host_load_avg_1m"][i])}
    causes = []
    throttling = [r for r in reasons if r in THROTTLE_REASONS]
    if clock == clock and clock_max == clock_max and clock < cfg.throttle_clock_ratio * clock_max:
        causes.append(f"its GPU clocks are held at {clock:.0f} of {clock_max:.0f} MHz"
                      + (f" ({', '.join(throttling)})" if throttling else ""))
    if power == power and limit == limit and limit > 0 and power >= 0.95 * limit:
        causes.append(f"it runs at its power cap ({power:.0f} of {limit:.0f} W)")
    if temp == temp and temp >= 85:
        causes.append(f"it is hot ({temp:.0f} °C)")
    names = [n for j, n in enumerate(w.gpu_name) if n and peers[j]]
    if w.gpu_name[i] and names:
        common = max(set(names), key=names.count)
        if w.gpu_name[i] != common:
            causes.append(f"it has a different GPU ({w.gpu_name[i]}, the others {common})")
    cpu = lat["host_sys_cpu_pct"][i]
    peer_cpu = _nanmedian(lat["host_sys_cpu_pct"][peers])
    load = lat["host_load_avg_1m"][i]
    if cpu == cpu and cpu >= 90 and (peer_cpu != peer_cpu or cpu > peer_cpu + 20):
        causes.append(f"its host's CPUs are saturated ({cpu:.0f}%)")
    elif cpu == cpu and cpu >= 90:
        causes.append(f"its host's CPUs are saturated ({cpu:.0f}%"
                      + (f", load {load:.1f}" if load == load else "")
                      + "): the processes there compete for cores")
    if not causes:
        return ("nothing in its own counters explains it: the work itself takes longer "
                "there (uneven inputs, a noisy neighbour, a failing part)"), ev
    return "; ".join(causes), ev


def straggler(ctx: Context, starved: set[int]) -> Finding | None:
    """A rank slower in compute (not data) than the others."""
    w, cfg = ctx.w, ctx.cfg
    ok = ctx.judged() & np.array([int(r) not in starved for r in w.rank], dtype=bool)
    comp = np.where(ok, w.steps["compute_s"], np.nan)
    step = w.steps["step_s"]
    if ok.sum() < 2 or np.isnan(comp).all():
        return None
    others = w.others_median(comp)
    k = ctx.factors("straggler", cfg.straggler_clear)
    excess = comp - others
    with np.errstate(invalid="ignore"):
        slow_at = others * (1 + (cfg.straggler_ratio - 1) * k)
        hit = ok & (comp >= slow_at) \
            & (excess >= cfg.straggler_min_excess_s * k) \
            & (np.isnan(step) | (excess >= cfg.straggler_min_share * k * step))
        # slow in most of its recent steps, not in a burst that tipped the median: a
        # second of CPU contention slows some rank for ten-odd steps, a straggler stays
        per_step = w.recent_compute
        slow_step = (per_step >= slow_at[:, None]) \
            & (per_step - others[:, None] >= (cfg.straggler_min_excess_s * k)[:, None])
        valid = (~np.isnan(per_step)).sum(axis=1)
        fraction = np.where(valid > 0, slow_step.sum(axis=1) / np.maximum(valid, 1), 0.0)
        hit &= fraction >= cfg.straggler_min_fraction * k
    flagged = np.flatnonzero(hit).tolist()
    if not flagged or len(flagged) > max(1, ok.sum() // 2):
        return None  # over half "slow" is no straggler: the others are fast
    flagged.sort(key=lambda i: -(comp[i] - others[i]))
    ranks = [int(w.rank[i]) for i in flagged]
    peers = ok.copy()
    peers[flagged] = False
    cause, cause_ev = _straggler_cause(w, int(flagged[0]), peers, cfg)
    comm = w.steps["comm_s"]
    ev = {"ranks": {str(w.rank[i]): {"node": w.ranks[i].node, "compute_s": _f(comp[i]),
                                     "peers_compute_s": _f(others[i]),
                                     "data_wait_s": _f(w.steps["data_wait_s"][i]),
                                     "comm_s": _f(comm[i]),
                                     "slow_step_fraction": _f(fraction[i])}
                    for i in flagged[:MAX_EVIDENCE_RANKS]},
          "peers_comm_s_median": _f(_nanmedian(comm[peers])), "cause": cause,
          "rank_counters": cause_ev}
    i0 = flagged[0]
    summary = (f"{_names(ranks)} computes {ms(comp[i0])} per step, "
               f"{comp[i0] / others[i0]:.1f}x its peers ({ms(others[i0])}), and they wait for "
               f"it in the allreduce; {cause}.")
    step = w.steps["step_s"][i0]
    impact = (comp[i0] - others[i0]) / step if step == step and step > 0 else 0.0
    return Finding("straggler", ranks, "warning", summary, ev,
                   "If clocks or power are the cause: check cooling, the power cap and "
                   "nvidia-smi -q -d PERFORMANCE on that node. A different GPU model: keep "
                   "the job on identical GPUs. Host CPU: stop or pin what competes. Otherwise "
                   "look for uneven batch shapes, or drain the node and compare.",
                   impact=float(impact))


def gpu_throttled(ctx: Context) -> Finding | None:
    """GPUs running below max clock with a throttle reason NVML gives."""
    w, cfg = ctx.w, ctx.cfg
    lat = w.latest
    clock, mx, mask = lat["gpu_sm_clock_mhz"], lat["gpu_sm_clock_max_mhz"], \
        lat["gpu_clock_event_reasons"]
    k = ctx.factors("gpu_throttled", 1.05)
    with np.errstate(invalid="ignore"):
        slow = w.active & (clock < cfg.throttle_clock_ratio * k * mx) & ~np.isnan(mask)
    flagged = []
    for i in np.flatnonzero(slow).tolist():
        reasons = [r for r in decode_reasons(int(mask[i])) if r in THROTTLE_REASONS]
        if reasons:
            flagged.append((i, reasons))
    if not flagged:
        return None
    ranks = [int(w.rank[i]) for i, _ in flagged]
    ev = {"ranks": {str(w.rank[i]): {
        "node": w.ranks[i].node, "sm_clock_mhz": _f(clock[i]), "sm_clock_max_mhz": _f(mx[i]),
        "reasons": reasons, "power_w": _f(lat["gpu_power_w"][i]),
        "power_limit_w": _f(lat["gpu_power_limit_w"][i]), "temp_c": _f(lat["gpu_temp_c"][i]),
    } for i, reasons in flagged[:MAX_EVIDENCE_RANKS]}}
    i0, r0 = flagged[0]
    summary = (f"{_names(ranks)}'s GPU runs at {clock[i0]:.0f} of {mx[i0]:.0f} MHz, held down "
               f"by {', '.join(r.replace('_', ' ') for r in r0)}.")
    return Finding("gpu_throttled", ranks, "warning", summary, ev,
                   "Power cap: check the board's limit (nvidia-smi -q -d POWER) and the "
                   "node's power budget. Thermal: check fans, inlet temperature and airflow. "
                   "A throttled GPU makes its rank a straggler for the whole job.",
                   impact=float(1 - clock[i0] / mx[i0]))


# ---- fabric and scaling ----------------------------------------------------------------

def fabric_class(w: Window, cfg: AnalysisConfig) -> str:
    """The fabric the job's allreduce crosses: between nodes, NVLink, PCIe or loopback."""
    if len(w.node) > 1:
        return cfg.inter_node_fabric
    if any(name for name in w.gpu_name):
        return "nvlink" if np.nanmax(np.where(np.isnan(w.nvlink), 0, w.nvlink)) > 0 \
            else "pcie"
    return "loopback"


def _true_comm(w: Window, ok: np.ndarray) -> tuple[float, float, float]:
    """Collective figures of the rank that arrives last at the allreduce (the smallest
    comm time): everyone else's include waiting for it. ``(comm_s, exposed_s, busbw)``."""
    comm = np.where(ok, w.steps["comm_s"], np.nan)
    if np.isnan(comm).all():
        return math.nan, math.nan, math.nan
    i = int(np.nanargmin(comm))
    return float(comm[i]), float(w.steps["comm_exposed_s"][i]), float(np.nanmax(
        np.where(ok, w.steps["busbw_Bps"], np.nan)))


def slow_link(ctx: Context) -> Finding | None:
    """Bus bandwidth far below what the fabric should give."""
    w, cfg = ctx.w, ctx.cfg
    ok = ctx.judged() & (w.steps["comm_bytes"] >= cfg.slow_link_min_bytes)
    if w.world_size < 2 or ok.sum() < 2:
        return None
    cls = fabric_class(w, cfg)
    expected = cfg.fabric_busbw.get(cls)
    if expected is None:
        return None
    _, _, best = _true_comm(w, ok)
    k = 1.2 if ctx.active.get("slow_link") else 1.0
    if best != best or best >= cfg.slow_link_ratio * k * expected:
        return None
    ranks = [int(r) for r in w.rank[ok]]
    med = _nanmedian(w.steps["busbw_Bps"][ok])
    ev = {"fabric": cls, "expected_busbw_Bps": _f(expected), "busbw_best_Bps": _f(best),
          "busbw_median_Bps": _f(med), "nodes": w.node[:32], "ranks": len(ranks),
          "comm_bytes": _f(_nanmedian(w.steps["comm_bytes"][ok]))}
    where = f"between {len(w.node)} nodes" if len(w.node) > 1 else "within the node"
    summary = (f"The allreduce runs at {best / 1e9:.3g} GB/s bus bandwidth {where}, "
               f"{best / expected:.0%} of what {cls} should give ({expected / 1e9:.3g} GB/s); "
               "a slow link slows every rank of the ring alike.")
    return Finding("slow_link", ranks, "warning", summary, ev,
                   "Check the links and NICs between the nodes (ethtool, ibstat), that NCCL "
                   "uses the fast interface (NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME, "
                   "NCCL_IB_HCA), and keep the job's workers on well-connected nodes (a "
                   "STRICT_PACK placement group, fewer nodes).",
                   impact=float(1 - best / expected))


def low_scaling_efficiency(ctx: Context, always: bool = False) -> Finding | None:
    """compute / (compute + comm) below the threshold, with a what-if for more ranks
    (``always``: whatever the efficiency, for another finding's evidence)."""
    w, cfg = ctx.w, ctx.cfg
    ok = ctx.judged()
    if w.world_size < 2 or ok.sum() < 2:
        return None
    compute = _nanmedian(w.steps["compute_s"][ok])
    comm, exposed, busbw = _true_comm(w, ok)
    if not (compute == compute and exposed == exposed and compute > 0):
        return None
    eff = compute / (compute + exposed)
    eff_full = compute / (compute + comm) if comm == comm else math.nan
    k = 1.1 if ctx.active.get("low_scaling_efficiency") else 1.0
    if eff >= cfg.efficiency_min * k and not always:
        return None
    nbytes = _nanmedian(w.steps["comm_bytes"][ok])
    n = w.world_size
    whatif = []
    for m in (n, 2 * n, 4 * n):
        if busbw == busbw and busbw > 0 and nbytes == nbytes:
            c = 2 * (m - 1) / m * nbytes / busbw
            whatif.append({"ranks": m, "comm_s": _f(c), "efficiency": _f(compute / (compute + c))})
    ev = {"efficiency": _f(eff), "efficiency_no_overlap": _f(eff_full), "compute_s": _f(compute),
          "comm_s": _f(comm), "comm_exposed_s": _f(exposed), "comm_bytes": _f(nbytes),
          "busbw_Bps": _f(busbw), "what_if": whatif}
    summary = (f"Only {eff:.0%} of each step is compute: {ms(exposed)} of allreduce is not "
               f"hidden behind {ms(compute)} of compute"
               + (f" (at {4 * n} ranks, {whatif[-1]['efficiency']:.0%})." if whatif and
                  whatif[-1]["efficiency"] is not None else "."))
    ranks = [int(r) for r in w.rank[ok]]
    return Finding("low_scaling_efficiency", ranks, "info", summary, ev,
                   "More compute per byte: a larger per-rank batch (or gradient accumulation "
                   "with no_sync); a faster fabric; better overlap (bucket_cap_mb, "
                   "static_graph, FSDP/ZeRO prefetch); fewer bytes (bf16 gradients: "
                   "bf16_compress_hook).", impact=float(1 - eff))


# ---- memory ---------------------------------------------------------------------------

def memory_wall(ctx: Context) -> Finding | None:
    """Headroom below the threshold, or memory growing towards the capacity."""
    w, cfg = ctx.w, ctx.cfg
    lat = w.latest
    cap, peak, used = lat["mem_capacity_bytes"], lat["mem_peak_bytes"], lat["mem_used_bytes"]
    kk = ctx.factors("memory_wall", 1.3)
    with np.errstate(invalid="ignore"):
        low_all = (cap - peak) < cfg.headroom_min * kk * cap
        trend_all = (w.mem_slope > 0) & (w.mem_growth >= cfg.mem_trend_min_growth * cap / kk) \
            & (w.mem_r2 >= cfg.mem_trend_min_r2 / kk)
        candidates = np.flatnonzero(w.active & (cap > 0) & (low_all | trend_all)).tolist()
    flagged = []
    for i in candidates:
        k = float(kk[i])
        headroom = cap[i] - peak[i] if peak[i] == peak[i] else math.nan
        low = bool(low_all[i])
        steps_left = math.inf
        slope = w.mem_slope[i]
        if trend_all[i]:
            rate = w.step_rate[i]
            secs = max(0.0, (cap[i] - used[i]) / slope)
            steps_left = secs * rate if rate == rate and rate > 0 else math.inf
            if not math.isfinite(steps_left) and secs < 3600:
                steps_left = secs  # unknown step rate: still finite
        creeping = steps_left < cfg.oom_horizon_steps * k
        if low or creeping:
            flagged.append((i, headroom, steps_left))
    if not flagged:
        return None
    flagged.sort(key=lambda x: (x[2], x[1] if x[1] == x[1] else 0))
    ranks = [int(w.rank[i]) for i, _, _ in flagged]
    evidence: dict[str, Any] = {"ranks": {}}
    for i, headroom, steps_left in flagged[:MAX_EVIDENCE_RANKS]:
        params, grads, optim = (lat["mem_param_bytes"][i], lat["mem_grad_bytes"][i],
                                lat["mem_optim_bytes"][i])
        static = np.nansum([params, grads, optim])
        evidence["ranks"][str(w.rank[i])] = {
            "node": w.ranks[i].node, "device": w.ranks[i].mem_device,
            "capacity_bytes": _f(cap[i]), "peak_bytes": _f(peak[i]), "used_bytes": _f(used[i]),
            "headroom_bytes": _f(headroom), "param_bytes": _f(params), "grad_bytes": _f(grads),
            "optim_bytes": _f(optim),
            # on CUDA the rest of the peak is activations (and allocator slack); on a CPU
            # rank it is also the interpreter and libraries: "activations_and_other"
            "activations_and_other_bytes": _f(peak[i] - static) if peak[i] == peak[i] else None,
            "free_bytes": _f(headroom),
            "growth_Bps": _f(w.mem_slope[i]), "growth_r2": _f(w.mem_r2[i]),
            "steps_to_oom": _f(steps_left) if math.isfinite(steps_left) else None,
        }
    i0, h0, s0 = flagged[0]
    gb = 1e9
    if used[i0] == used[i0] and used[i0] >= cap[i0]:
        summary = (f"{_names(ranks)} {_verb(ranks, 'uses', 'use')} {used[i0] / gb:.3g} GB, "
                   "more than the "
                   f"{cap[i0] / gb:.3g} GB it has: it is out of memory or about to be.")
    elif math.isfinite(s0):
        summary = (f"{_names(ranks)}'s memory grows {w.mem_slope[i0] / 1e6:.3g} MB/s and fills "
                   f"its {cap[i0] / gb:.3g} GB in about {s0:.0f} steps.")
    else:
        summary = (f"{_names(ranks)} {_verb(ranks, 'has', 'have')} {h0 / gb:.3g} GB of "
                   f"{cap[i0] / gb:.3g} GB left at its "
                   f"peak ({h0 / cap[i0]:.0%}): the next larger batch or sequence will not fit.")
    severity: Severity = "critical" if (s0 < 500 or (h0 == h0 and h0 < 0.03 * cap[i0])) \
        else "warning"
    return Finding("memory_wall", ranks, severity, summary, evidence,
                   "Data parallelism adds throughput, never capacity: every rank holds the "
                   "whole model. Use activation checkpointing, a smaller per-rank batch "
                   "(with gradient accumulation), mixed precision, or shard the model "
                   "(FSDP/ZeRO; tensor or pipeline parallelism). If memory grows every "
                   "step, look for tensors kept across steps (losses summed without .item(), "
                   "growing caches, lists of outputs).", impact=0.5)


# ---- checkpoints --------------------------------------------------------------------------

def checkpoint_interval(ctx: Context) -> Finding | None:
    """The run's checkpoint interval against Young/Daly's optimum sqrt(2 C MTBF)."""
    w, cfg = ctx.w, ctx.cfg
    best: list[list[Any]] = []
    for r in w.ranks:
        if len(r.events) < 2:
            continue
        cps = [e for e in r.events if len(e) >= 3 and e[1] == "checkpoint"
               and isinstance(e[0], (int, float)) and isinstance(e[2], (int, float))]
        if len(cps) > len(best):
            best = cps
    if len(best) < 2:
        return None
    cost = float(np.median([e[2] for e in best]))
    starts = np.array([float(e[0]) for e in best])
    interval = float(np.median(np.diff(starts)))
    n = max(1, w.world_size)
    mtbf = cfg.gpu_mtbf_h * 3600.0 / n
    opt = math.sqrt(2 * cost * mtbf)
    if cost <= 0 or interval <= 0:
        return None
    tol = cfg.checkpoint_tolerance * (1.2 if ctx.active.get("checkpoint_interval") else 1.0)
    if opt / tol <= interval <= opt * tol:
        return None
    waste_now = cost / interval + interval / (2 * mtbf)
    waste_opt = math.sqrt(2 * cost / mtbf)
    ev = {"checkpoint_s": _f(cost), "interval_s": _f(interval), "ranks": n,
          "gpu_mtbf_h": cfg.gpu_mtbf_h, "job_mtbf_s": _f(mtbf), "optimal_interval_s": _f(opt),
          "overhead_now": _f(waste_now), "overhead_at_optimum": _f(waste_opt),
          "checkpoints_seen": len(best)}
    often = interval < opt
    summary = (f"Checkpoints take {cost:.1f} s every {interval:.0f} s: "
               f"{'too often' if often else 'too rarely'} for {n} GPUs (job MTBF "
               f"{mtbf / 3600:.0f} h); every {_dur(opt)} would cost {waste_opt:.1%} of the "
               f"run instead of {waste_now:.1%}.")
    severity: Severity = "warning" if waste_now > 2 * waste_opt and waste_now > 0.05 else "info"
    return Finding("checkpoint_interval", [int(r) for r in w.rank], severity, summary, ev,
                   f"Checkpoint about every {_dur(opt)} (Young/Daly: sqrt(2 x checkpoint "
                   "cost x job MTBF)); cheaper checkpoints (asynchronous, sharded) make "
                   "frequent ones affordable. MTBF falls as GPUs are added.",
                   impact=float(waste_now - waste_opt))


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
