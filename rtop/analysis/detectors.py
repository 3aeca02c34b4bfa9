"""The detectors: pure functions from a :class:`Window` to findings.

Each returns at most one :class:`Finding` of its kind, naming every rank it concerns. A
detector decides: which ranks, the severity (its kind's usual one, from
:data:`rtop.analysis.kinds.KINDS`, unless it finds it worse or milder), the evidence (the
numbers) and the impact. Every threshold it applies is a field of
:class:`AnalysisConfig`. The words, summary and fix, are written from the evidence by
:mod:`rtop.analysis.wording`. ``active`` holds the ranks of each kind's finding that is
already active; those are judged against thresholds eased by the kind's ``*_clear``
factor, so a finding does not flap.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from collectors.nvml import THROTTLE_REASONS, decode_reasons
from rtop.analysis import links as probe_links
from rtop.analysis import peers, roles, wording
from rtop.analysis.config import AnalysisConfig
from rtop.analysis.kinds import KINDS
from rtop.analysis.window import Window, measured
from rtop.run.snapshot import FindingDict, ProbeLinks, Severity
from rtop.run.state import PER_STEP_BEST_MIN_RANKS, RankState

# How much the evidence lists (sizes, not thresholds: a finding's counts are kept whole)
MAX_EVIDENCE_RANKS = 8  # ranks described one by one
MAX_EVIDENCE_LIST = 32  # ranks or nodes listed by name
MAX_EVIDENCE_FOLLOWERS = 64  # ranks lost after the first ones
WHAT_IF = (1, 2, 4)  # the scaling what-if, at these multiples of the job's ranks


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

    @classmethod
    def of(cls, kind: str, ranks: list[int], evidence: dict[str, Any], impact: float,
           severity: Severity | None = None) -> Finding:
        """A finding of ``kind`` (its usual severity unless given), worded from its
        evidence; ``ranks`` name the one it blames first first."""
        return cls(kind, ranks, severity or KINDS[kind].severity,
                   wording.summary(kind, ranks, evidence), evidence,
                   wording.fix(kind, ranks, evidence), float(impact))

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


def _nanmedian(a: np.ndarray) -> float:
    return float(np.nanmedian(a)) if a.size and not np.isnan(a).all() else math.nan


@dataclass
class Context:
    """What the detectors share within one evaluation."""

    w: Window
    cfg: AnalysisConfig
    active: dict[str, set[int]] = field(default_factory=dict)
    excluded: set[int] = field(default_factory=set)  # hung or lost: their figures are stale
    #: the latest link probe of the run (``RunState.links``); None before one
    links: ProbeLinks | None = None
    #: per kind of :data:`rtop.analysis.hiccups.HICCUP_KINDS`, ``(n, k)``: the recent
    #: steps where a rank stood out but was not named for it (a transient)
    hiccups: dict[str, np.ndarray] = field(default_factory=dict)

    def factor(self, kind: str, clear: float) -> float:
        """1.0, or the clear factor while a finding of ``kind`` is active."""
        return clear if self.active.get(kind) else 1.0

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

#: How a rank's connection ended without a goodbye: its order at the hub is known to the
#: millisecond (``RankState.lost_how``; "silent" ranks are known only to their batches).
CLOSED = ("reset", "eof", "closed")
#: Statuses of ranks that said goodbye and, after a rank was lost, count as its followers.
FOLLOWER_STATUSES = ("failed", "exited")


def follower_how(rs: RankState) -> str:
    """How a rank that went after the culprit ended, for the evidence: the signal that
    terminated it ("SIGTERM", its goodbye said so), "error", "exit" or "no goodbye"."""
    if rs.status == "lost":
        return "no goodbye"
    error = rs.meta.get("error")
    if rs.bye_reason == "signal" and isinstance(error, str) \
            and error.startswith("terminated by SIG"):
        return error.removeprefix("terminated by ").split()[0]
    return "error" if rs.status == "failed" else "exit"


def torn_down(rs: RankState) -> bool:
    """Whether the rank's goodbye says a signal terminated it (a launcher tore it down)."""
    return follower_how(rs).startswith("SIG")


def lost_rank(ctx: Context) -> Finding | None:
    """Ranks that stopped sending (silent past the hub's timeout, or gone without bye):
    the first to go is named, the ranks that went after it are its followers.

    A launcher (torchrun, ``mp.spawn``) tears the other ranks down milliseconds after one
    dies, so the order decides: the first connection to close without a goodbye is the
    culprit; ranks whose goodbye says a signal terminated them, or that failed or exited
    after it, and those lost after it, follow. (A goodbye of a signal handled at the hub
    up to ``lost_together_s`` before the loss follows it too: the launcher reacted to
    the death, and both reached the hub's loop together.) A node that goes away whole
    (every one of its ranks lost without a goodbye within ``lost_together_s``, the first
    of them the first of all) names all its ranks, as do ranks that went silent
    together.
    """
    w, cfg = ctx.w, ctx.cfg
    lost = [i for i in range(w.n) if w.status[i] == "lost"]
    if not lost:
        return None
    ctx.excluded.update(int(w.rank[i]) for i in lost)
    at = {i: (w.ranks[i].lost_at or w.ranks[i].last_seen) for i in lost}
    lost.sort(key=lambda i: (at[i], int(w.rank[i])))
    first = lost[0]
    t0 = at[first]
    together = [i for i in lost if at[i] <= t0 + cfg.lost_together_s]
    whole_node = None
    if w.ranks[first].lost_how in CLOSED:
        node = w.node_of[first]
        on_node = [i for i in range(w.n) if w.node_of[i] == node]
        if len(on_node) > 1 and set(on_node) <= set(together):
            whole_node = w.ranks[first].node
            culprits = [i for i in together if w.node_of[i] == node]
        else:
            culprits = [first]
    else:
        culprits = together
    culprits.sort(key=lambda i: int(w.rank[i]))  # gone together: their order is noise
    named = set(culprits)
    after = {i: at[i] for i in lost if i not in named}
    for i in range(w.n):
        rs = w.ranks[i]
        if w.status[i] not in FOLLOWER_STATUSES or rs.last_seen > t0 + cfg.lost_follow_s:
            continue
        if rs.last_seen >= t0:
            after[i] = rs.last_seen
        elif rs.last_seen >= t0 - cfg.lost_together_s and torn_down(rs):
            # a launcher's signal comes after the death it reacts to, but the goodbye it
            # caused can reach the hub's loop together with the dead rank's closed
            # connection and be handled first (seen: 0.2-1.5 ms before, under load)
            after[i] = t0
    followers = sorted(after, key=lambda i: (after[i], int(w.rank[i])))
    ev: dict[str, Any] = {str(w.rank[i]): {"node": w.ranks[i].node,
                                           "last_step": w.ranks[i].last_step,
                                           "silent_s": _f(w.t - w.ranks[i].last_seen),
                                           "last_phase": w.phase[i],
                                           "how": w.ranks[i].lost_how,
                                           "lost_at": round(at[i], 3)}
                          for i in culprits[:MAX_EVIDENCE_RANKS]}
    then = [int(w.rank[i]) for i in followers]
    return Finding.of("lost_rank", [int(w.rank[i]) for i in culprits], {
        "ranks": ev, "whole_node": whole_node,
        "lost_after_them": then[:MAX_EVIDENCE_FOLLOWERS], "lost_after_count": len(then),
        "followers": {str(w.rank[i]): {"node": w.ranks[i].node,
                                       "how": follower_how(w.ranks[i]),
                                       "after_s": _f(after[i] - t0)}
                      for i in followers[:MAX_EVIDENCE_FOLLOWERS]}},
        impact=1.0)  # the job stops: first, whatever else is wrong


def hung_rank(ctx: Context) -> Finding | None:
    """A rank stuck in one phase far longer than a step takes; peers waiting inside the
    collective for it are not culprits."""
    w, cfg = ctx.w, ctx.cfg
    med_step = _nanmedian(w.steps["step_s"])
    limit = max(cfg.hung_min_s,
                cfg.hung_step_multiple * (med_step if measured(med_step) else 0.0))
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
    waiting = [int(w.rank[i]) for i in peers_in_comm]
    ev: dict[str, Any] = {
        "threshold_s": _f(limit), "median_step_s": _f(med_step),
        "peers_waiting_in_collective": waiting[:MAX_EVIDENCE_LIST],
        "ranks": {str(w.rank[i]): {"phase": w.phase[i], "phase_s": _f(w.phase_age_s[i]),
                                   "last_step": w.ranks[i].last_step,
                                   "stack": w.ranks[i].stack}
                  for i in hung[:MAX_EVIDENCE_RANKS]},
        "peers_waiting_count": len(waiting),
    }
    return Finding.of("hung_rank", ranks, ev, impact=1.0)  # the job stops


# ---- input ---------------------------------------------------------------------------

def _cost(excess_s: float | None, step_s: float | None) -> dict[str, float | None]:
    """What a finding costs the job per step: seconds, and as a share of its step (the
    throughput it would gain back)."""
    share = excess_s / step_s if measured(excess_s) and measured(step_s) and step_s > 0 \
        else None
    return {"s_per_step": _f(excess_s), "share": _f(share)}


def _peer_group(w: Window, i: int) -> dict[str, Any]:
    """Whom rank ``i`` was compared with, for its evidence, when the ranks fall into
    peer classes (pipeline stages): ``{"peers": "pipeline stage 3", "stage": 3}``;
    nothing when every rank is every other's peer."""
    classes = w.classes
    if classes is None:
        return {}
    stage = int(classes[i])
    if stage == roles.NO_STAGE:
        return {"peers": "the ranks of no known pipeline stage", "stage": None}
    return {"peers": f"the ranks of pipeline stage {stage}", "stage": stage}


def _scope(w: Window, flagged: list[int]) -> tuple[str, dict[str, list[int]]]:
    """"node" when the flagged ranks are whole nodes (of two ranks or more), else
    "rank"; and those nodes with their ranks."""
    nodes = peers.whole_nodes(w.node_of, w.node, flagged)
    covered = sum(len(v) for v in nodes.values())
    return ("node" if nodes and covered == len(flagged) else "rank"), {
        node: [int(w.rank[i]) for i in idx] for node, idx in nodes.items()}


def _where(w: Window, flagged: list[int]) -> dict[str, Any]:
    """Where the flagged ranks are, for the evidence and the wording: how many, on how
    many nodes, and the nodes they fill whole."""
    scope, nodes = _scope(w, flagged)
    return {"scope": scope, "rank_count": len(flagged),
            "node_count": len({w.node_of[i] for i in flagged}),
            "whole_nodes": {k: v for k, v in list(nodes.items())[:MAX_EVIDENCE_LIST]},
            "whole_node_count": len(nodes)}


def input_findings(ctx: Context) -> list[Finding]:
    """``input_bound`` when (nearly) every rank waits for data, else ``starved_rank``:
    a rank whose wait stands out from its peers' (their median and spread) in most of
    its recent steps, the newest included."""
    w, cfg = ctx.w, ctx.cfg
    ok = ctx.judged()
    dw, st = w.steps["data_wait_s"], w.steps["step_s"]
    if not ok.any() or np.isnan(dw[ok]).all():
        return []
    rec_dw, rec_st = w.recent["data_wait_s"], w.recent["step_s"]
    valid = ~np.isnan(rec_dw)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = dw / st
        rec_share = rec_dw / rec_st
    waits = (rec_dw >= cfg.starved_min_wait_s) & (rec_share >= cfg.input_bound_share)
    waiting, _ = peers.persistent(waits, valid, cfg.persist_min_steps,
                                  cfg.input_bound_fraction, newest=False)
    waiting &= ok
    classes = w.classes  # pipeline stages: a stage whose every rank waits is input-bound
    bound = np.zeros(w.n, dtype=bool)
    everyone = np.ones(w.n, dtype=bool)
    for cls in ([everyone] if classes is None else [classes == c
                                                    for c in np.unique(classes).tolist()]):
        mine = ok & cls
        n_ok = int(mine.sum())
        n_waiting = int((waiting & mine).sum())
        # a job (or stage) of one rank is input-bound when it waits; of several, when
        # enough of those still running wait (>= 2): the last rank running as the others
        # say goodbye is not a job of one, so the finding does not shrink onto it
        if (n_ok >= 2 and n_waiting >= max(2, math.ceil(cfg.input_bound_fraction * n_ok))) \
                or (int(cls.sum()) == 1 and n_waiting):
            bound |= mine
    if bound.any():
        ranks = [int(r) for r in w.rank[bound]]
        med_share = _nanmedian(share[bound])
        med_wait = _nanmedian(dw[bound])
        ev_in: dict[str, Any] = {
            "data_wait_s_median": _f(med_wait), "data_wait_share_median": _f(med_share),
            "step_s_median": _f(_nanmedian(st[bound])),
            "ranks_waiting": int((waiting & bound).sum()),
            "ranks": int(bound.sum()), "scope": "job" if (bound == ok).all() else "stage",
            "cost": _cost(med_wait, _nanmedian(st[bound])),
            "loader_cpu_pct_median": _f(_nanmedian(w.latest["host_loader_cpu_pct"][bound]))}
        if classes is not None:
            ev_in["stages"] = sorted({int(c) for c in classes[bound].tolist() if c >= 0})
        return [Finding.of("input_bound", ranks, ev_in, impact=med_share)]
    center, spread = peers.baseline(dw, ok, classes)
    # a shift of the whole fleet (every rank waiting more, as an input-bound phase
    # begins) reaches the peers' newest steps before their medians: each rank is
    # judged against the higher of the two, so the ranks that report first are not
    # "starved" against peers whose medians have not caught up yet
    c_now, s_now = peers.baseline(peers.newest(rec_dw, valid), ok, classes)
    center, spread = np.fmax(center, c_now), np.fmax(spread, s_now)
    k = ctx.factors("starved_rank", cfg.starved_clear)
    limit = peers.limit_above(center, spread, cfg.starved_ratio, cfg.starved_z, 0.0) * k
    limit = np.maximum(limit, cfg.starved_min_wait_s * k)
    with np.errstate(invalid="ignore"):
        anomalous = (rec_dw >= limit[:, None]) & (rec_share >= (cfg.starved_min_share * k)[
            :, None])
    fraction = np.where(k < 1, cfg.starved_min_fraction * cfg.starved_clear,
                        cfg.starved_min_fraction)
    held, frac = peers.persistent(anomalous, valid, cfg.persist_min_steps, 0.0)
    # held in just the fewest steps, and shrinking: one stall the loader is catching up
    # from (a hiccup that spilled into the next step), until it holds one step more
    fewest = (anomalous & valid).sum(axis=1) <= cfg.persist_min_steps
    catching_up = fewest & peers.settling(rec_dw, valid, center, cfg.starved_steady)
    hit = ok & held & (frac >= fraction) & ~catching_up
    if classes is not None:  # a rank alone in its stage has no peers to stand out from
        hit &= ~np.isnan(center)
    ctx.hiccups["data_wait"] = anomalous & valid & (ok & ~hit)[:, None]
    flagged = sorted(np.flatnonzero(hit).tolist(), key=lambda i: -dw[i])
    if not flagged:
        return []
    ranks = [int(w.rank[i]) for i in flagged]
    comm = w.steps["comm_s"]
    rest = ok.copy()
    rest[flagged] = False
    peer_comm = _nanmedian(comm[rest])
    ev: dict[str, Any] = {"ranks": {str(w.rank[i]): {
        "node": w.ranks[i].node, **_peer_group(w, i),
        "data_wait_s": _f(dw[i]), "peers_data_wait_s": _f(center[i]),
        "peers_data_wait_spread_s": _f(spread[i]),
        "step_s": _f(st[i]), "data_wait_share": _f(share[i]), "comm_s": _f(comm[i]),
        "slow_step_fraction": _f(frac[i]),
        "loader_cpu_pct": _f(w.latest["host_loader_cpu_pct"][i]),
        "loader_procs": _f(w.latest["host_loader_procs"][i]),
        "host_cpu_pct": _f(w.latest["host_sys_cpu_pct"][i]),
    } for i in flagged[:MAX_EVIDENCE_RANKS]}, "peers_comm_s_median": _f(peer_comm),
        **_where(w, flagged)}
    i0 = flagged[0]
    ev["cost"] = _cost(dw[i0] - center[i0] if measured(center[i0]) else dw[i0], st[i0])
    return [Finding.of("starved_rank", ranks, ev, impact=ev["cost"]["share"] or share[i0])]


# ---- compute -------------------------------------------------------------------------

def _straggler_causes(w: Window, i: int, peers_mask: np.ndarray, cfg: AnalysisConfig
                      ) -> tuple[list[str], dict[str, Any]]:
    """What in rank ``i``'s own counters explains its slowness (names of
    ``wording.STRAGGLER_CAUSES``), and those counters."""
    lat = w.latest
    clock, clock_max = lat["gpu_sm_clock_mhz"][i], lat["gpu_sm_clock_max_mhz"][i]
    reasons_mask = lat["gpu_clock_event_reasons"][i]
    reasons = decode_reasons(int(reasons_mask)) if measured(reasons_mask) else []
    power, limit = lat["gpu_power_w"][i], lat["gpu_power_limit_w"][i]
    temp = lat["gpu_temp_c"][i]
    cpu = lat["host_sys_cpu_pct"][i]
    peer_cpu = _nanmedian(lat["host_sys_cpu_pct"][peers_mask])
    peer_clock = _nanmedian(lat["gpu_sm_clock_mhz"][peers_mask])
    peer_power = _nanmedian(lat["gpu_power_w"][peers_mask])
    peer_gpus = [n for j, n in enumerate(w.gpu_name) if n and peers_mask[j]]
    common = max(set(peer_gpus), key=peer_gpus.count) if peer_gpus else None
    ev = {"sm_clock_mhz": _f(clock), "sm_clock_max_mhz": _f(clock_max),
          "clock_event_reasons": reasons, "power_w": _f(power), "power_limit_w": _f(limit),
          "temp_c": _f(temp), "gpu": w.gpu_name[i],
          "host_cpu_pct": _f(cpu),
          "load_avg_1m": _f(lat["host_load_avg_1m"][i]),
          "throttle_reasons": [r for r in reasons if r in THROTTLE_REASONS],
          "peers_gpu": common, "peers_host_cpu_pct": _f(peer_cpu),
          "peers_sm_clock_mhz": _f(peer_clock)}
    causes = []
    # its clocks are low, and lower than its peers' (a power-capped fleet is not this
    # rank's cause)
    if measured(clock) and measured(clock_max) and clock < cfg.throttle_clock_ratio * clock_max \
            and not (measured(peer_clock) and clock >= peer_clock - cfg.throttle_peer_drop
                     * clock_max):
        causes.append("clocks")
    if measured(power) and measured(limit) and limit > 0 \
            and power >= cfg.cause_power_share * limit \
            and not (measured(peer_power) and peer_power >= cfg.cause_power_share * limit):
        causes.append("power_cap")
    if measured(temp) and temp >= cfg.cause_temp_c:
        causes.append("hot")
    if w.gpu_name[i] and common and w.gpu_name[i] != common:
        causes.append("gpu_model")
    if measured(cpu) and cpu >= cfg.cause_host_cpu_pct:
        alone = not measured(peer_cpu) or cpu > peer_cpu + cfg.cause_host_cpu_over_peers_pct
        causes.append("host_cpu" if alone else "host_cpu_shared")
    return causes, ev


def straggler(ctx: Context, starved: set[int]) -> Finding | None:
    """A rank slower in compute (not data) than the others: above its peers' median (by
    a ratio, an absolute excess, a share of its step, and their robust spread) in most
    of its recent steps, the newest included."""
    w, cfg = ctx.w, ctx.cfg
    ok = ctx.judged() & np.array([int(r) not in starved for r in w.rank], dtype=bool)
    comp = np.where(ok, w.steps["compute_s"], np.nan)
    step = w.steps["step_s"]
    if ok.sum() < 2 or np.isnan(comp).all():
        return None
    others, spread = peers.baseline(comp, ok, w.classes)
    k = ctx.factors("straggler", cfg.straggler_clear)
    excess = comp - others
    slow_at = peers.limit_above(others, spread, 1 + (cfg.straggler_ratio - 1) * k,
                                cfg.straggler_z * k, 0.0)
    slow_at = np.maximum(slow_at, others + cfg.straggler_min_excess_s * k)
    with np.errstate(invalid="ignore"):
        per_step = w.recent["compute_s"]
        valid = ~np.isnan(per_step)
        min_share = cfg.straggler_min_share * k

        def slow(comp_s: np.ndarray, step_s: np.ndarray, at: slice | np.ndarray
                 ) -> np.ndarray:
            """Which of these steps (of the ranks ``at``) were slow: compute above the
            limit, by a share of the step (when the step is known)."""
            out: np.ndarray = (comp_s >= slow_at[at, None]) & (
                np.isnan(step_s) | (comp_s - others[at, None] >= min_share[at, None] * step_s))
            return out
        slow_step = slow(per_step, w.recent["step_s"], slice(None))
        held, fraction = peers.persistent(slow_step, valid, cfg.persist_min_steps, 0.0,
                                          newest=False)
        hit = ok & held & (comp >= slow_at) \
            & (np.isnan(step) | (excess >= cfg.straggler_min_share * k * step)) \
            & (fraction >= cfg.straggler_min_fraction * k)
        cand = np.flatnonzero(hit)
        if cand.size:  # how long their slow steps lasted
            back = w.lookback(cand)
            back_comp, back_step = back[:, :, 0], back[:, :, 1]
            lasted = peers.slow_stretch_s(
                slow(back_comp, back_step, cand), ~np.isnan(back_comp),
                np.fmax(back_step, back_comp), cfg.straggler_break_steps)
            hit[cand] &= lasted >= cfg.straggler_min_s * k[cand]
    flagged = np.flatnonzero(hit).tolist()
    if len(flagged) > max(1, int(cfg.straggler_max_share * ok.sum())):
        return None  # most ranks "slow" is no straggler: the others are fast
    ctx.hiccups["compute"] = slow_step & valid & (ok & ~hit)[:, None]
    if not flagged:
        return None
    flagged.sort(key=lambda i: -(comp[i] - others[i]))
    ranks = [int(w.rank[i]) for i in flagged]
    peer_mask = ok.copy()
    peer_mask[flagged] = False
    i0 = flagged[0]
    causes, counters = _straggler_causes(w, i0, peer_mask, cfg)
    comm = w.steps["comm_s"]
    ev = {"ranks": {str(w.rank[i]): {"node": w.ranks[i].node, **_peer_group(w, i),
                                     "compute_s": _f(comp[i]),
                                     "peers_compute_s": _f(others[i]),
                                     "data_wait_s": _f(w.steps["data_wait_s"][i]),
                                     "comm_s": _f(comm[i]),
                                     "slow_step_fraction": _f(fraction[i])}
                    for i in flagged[:MAX_EVIDENCE_RANKS]},
          "peers_comm_s_median": _f(_nanmedian(comm[peer_mask])),
          "cause": wording.straggler_cause(causes, counters),
          "rank_counters": counters, "causes": causes, **_where(w, flagged),
          "cost": _cost(comp[i0] - others[i0], step[i0])}
    return Finding.of("straggler", ranks, ev, impact=ev["cost"]["share"] or 0.0)


def gpu_throttled(ctx: Context) -> Finding | None:
    """GPUs held below their max clock by a throttle reason NVML gives, and below their
    peers' clocks, in each of their last samples. Most of the fleet under its max clock
    with a throttle reason (every GPU at the power cap) is one fact about the job."""
    w, cfg = ctx.w, ctx.cfg
    lat = w.latest
    clock, mx, mask = lat["gpu_sm_clock_mhz"], lat["gpu_sm_clock_max_mhz"], \
        lat["gpu_clock_event_reasons"]
    reasons_of: dict[int, list[str]] = {}
    throttling = np.zeros(w.n, dtype=bool)
    # each distinct mask decoded once (thousands of GPUs share a few)
    decoded: dict[int, list[str]] = {}
    for i in np.flatnonzero(w.active & ~np.isnan(mask) & (mask != 0)).tolist():
        m = int(mask[i])
        rs = decoded.get(m)
        if rs is None:
            rs = decoded[m] = [r for r in decode_reasons(m) if r in THROTTLE_REASONS]
        if rs:
            reasons_of[i] = list(rs)
            throttling[i] = True
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = clock / mx
        hist = w.clock_history / mx[:, None]
    gpus = w.active & ~np.isnan(ratio)
    n_gpus = int(gpus.sum())
    if not n_gpus:
        return None
    fleet = _nanmedian(ratio[gpus])
    capped = gpus & throttling & (ratio < cfg.throttle_fleet_ratio)
    fact: dict[str, Any] | None = None
    if n_gpus >= 2 and capped.sum() >= cfg.throttle_fleet_fraction * n_gpus:
        counts: dict[str, int] = {}
        for i in np.flatnonzero(capped).tolist():
            for r in reasons_of.get(i, ()):
                counts[r] = counts.get(r, 0) + 1
        fact = {"gpus": int(capped.sum()), "of": n_gpus, "clock_ratio_median": _f(fleet),
                "sm_clock_mhz_median": _f(_nanmedian(clock[gpus])),
                "sm_clock_max_mhz": _f(_nanmedian(mx[gpus])),
                "reasons": sorted(counts, key=lambda r: -counts[r])}
    k = ctx.factors("gpu_throttled", cfg.throttle_clear)
    bar = cfg.throttle_clock_ratio
    if measured(fleet) and n_gpus >= 2:
        bar = min(bar, fleet - cfg.throttle_peer_drop)
    limit = bar * k
    with np.errstate(invalid="ignore"):
        samples = ~np.isnan(hist)
        low = np.where(samples, hist < limit[:, None], True)
        enough = samples.sum(axis=1) >= min(cfg.throttle_samples, hist.shape[1])
        slow = gpus & throttling & (ratio < limit) & low.all(axis=1) & enough
    flagged = [i for i in np.flatnonzero(slow).tolist()]
    if not flagged and fact is None:
        return None
    if not flagged:
        assert fact is not None
        ev_job = {**fact, "scope": "job", "cost": _cost(None, None)}
        return Finding.of("gpu_throttled", [int(r) for r in w.rank[gpus]], ev_job,
                          impact=0.0, severity="info")
    flagged.sort(key=lambda i: ratio[i])
    ranks = [int(w.rank[i]) for i in flagged]
    ev = {"ranks": {str(w.rank[i]): {
        "node": w.ranks[i].node, "sm_clock_mhz": _f(clock[i]), "sm_clock_max_mhz": _f(mx[i]),
        "reasons": reasons_of[i], "power_w": _f(lat["gpu_power_w"][i]),
        "power_limit_w": _f(lat["gpu_power_limit_w"][i]), "temp_c": _f(lat["gpu_temp_c"][i]),
        "peers_clock_ratio": _f(fleet),
    } for i in flagged[:MAX_EVIDENCE_RANKS]}, **_where(w, flagged), "fleet": fact}
    i0 = flagged[0]
    # a GPU at a share of its peers' clock computes about that much slower; the job
    # waits for it when it is the slowest
    slower = 1 - ratio[i0] / fleet if measured(fleet) and fleet > 0 else 1 - ratio[i0]
    comp = w.steps["compute_s"][i0]
    ev["cost"] = _cost(comp * slower if measured(comp) else None, w.steps["step_s"][i0])
    return Finding.of("gpu_throttled", ranks, ev, impact=ev["cost"]["share"] or slower)


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
    comm time): everyone else's include waiting for it. ``(comm_s, exposed_s, busbw)``.

    Step by step: in each recent step the last to arrive is the rank with the smallest
    comm time and the best bus bandwidth, and on a large fleet it is a different rank
    each step (a GC pause here, jitter there), so no rank's own median is pure transfer.
    Above ``PER_STEP_BEST_MIN_RANKS`` ranks the figures are the medians over the recent
    steps of each step's best (ranks aligned by recency: each rank's newest step, its one
    before, ...); on fewer, the last to arrive is mostly the same rank (the slowest), and
    its own medians are read."""
    comm = np.where(ok, w.steps["comm_s"], np.nan)
    if np.isnan(comm).all():
        return math.nan, math.nan, math.nan
    i = int(np.nanargmin(comm))
    best = (float(comm[i]), float(w.steps["comm_exposed_s"][i]),
            float(np.nanmax(np.where(ok, w.steps["busbw_Bps"], np.nan))))
    per_step = [w.recent.get(f) for f in ("comm_s", "comm_exposed_s", "busbw_Bps")]
    if ok.sum() <= PER_STEP_BEST_MIN_RANKS or any(
            x is None or x.shape[0] != len(ok) for x in per_step):
        return best
    rc, re_, rb = (np.where(ok[:, None], x, np.nan) for x in per_step if x is not None)
    have = ~np.isnan(rc).all(axis=0) & ~np.isnan(rb).all(axis=0)
    if not have.any():
        return best
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
        c = np.nanmin(rc[:, have], axis=0)
        e = np.nanmin(re_[:, have], axis=0)
        b = np.nanmax(rb[:, have], axis=0)
    return (float(np.nanmedian(c)), float(np.nanmedian(e)) if not np.isnan(e).all()
            else best[1], float(np.nanmedian(b)))


def slow_link(ctx: Context) -> Finding | None:
    """Bus bandwidth far below what the fabric should give; once a link probe has run,
    the probe's verdict (the slow node, or the slow links) and the allreduce against
    what it reached when the probe found every link healthy, not the nominal figure."""
    w, cfg = ctx.w, ctx.cfg
    probe = ctx.links
    if probe is not None:
        found = probe_links.verdict(probe, cfg)
        if found is not None:
            ranks, evidence, impact = found
            return Finding.of("slow_link", ranks, evidence, impact=impact)
    ok = ctx.judged() & (w.steps["comm_bytes"] >= cfg.slow_link_min_bytes)
    if w.world_size < 2 or ok.sum() < 2:
        return None
    cls = fabric_class(w, cfg)
    # measured beats nominal: a healthy fabric slower than its class's figure is no
    # slow link, and a link that slows after the probe still shows in the allreduce
    expected = probe["busbw_Bps"] if probe is not None else cfg.fabric_busbw.get(cls)
    if expected is None or not expected > 0:
        return None
    _, _, best = _true_comm(w, ok)
    k = ctx.factor("slow_link", cfg.slow_link_clear)
    if not measured(best) or best >= cfg.slow_link_ratio * k * expected:
        return None
    ranks = [int(r) for r in w.rank[ok]]
    med = _nanmedian(w.steps["busbw_Bps"][ok])
    ev = {"fabric": cls, "expected_busbw_Bps": _f(expected), "busbw_best_Bps": _f(best),
          "busbw_median_Bps": _f(med), "nodes": w.node[:MAX_EVIDENCE_LIST], "ranks": len(ranks),
          "comm_bytes": _f(_nanmedian(w.steps["comm_bytes"][ok])), "node_count": len(w.node)}
    if probe is not None:
        medians = probe_links.judge(probe, cfg).medians
        ev.update(expected_from="probe", probe_t=_f(probe["t"]),
                  probe_median_link_Bps=_f(medians[probe_links.INTER]
                                           if len(w.node) > 1 else medians[probe_links.INTRA]))
    return Finding.of("slow_link", ranks, ev, impact=1 - best / expected)


def low_scaling_efficiency(ctx: Context, always: bool = False) -> Finding | None:
    """compute / (compute + comm) below the threshold, with a what-if for more ranks
    (``always``: whatever the efficiency, for another finding's evidence)."""
    w, cfg = ctx.w, ctx.cfg
    ok = ctx.judged()
    if w.world_size < 2 or ok.sum() < 2:
        return None
    compute = _nanmedian(w.steps["compute_s"][ok])
    comm, exposed, busbw = _true_comm(w, ok)
    if not (measured(compute) and measured(exposed) and compute > 0):
        return None
    eff = compute / (compute + exposed)
    eff_full = compute / (compute + comm) if measured(comm) else math.nan
    k = ctx.factor("low_scaling_efficiency", cfg.efficiency_clear)
    if eff >= cfg.efficiency_min * k and not always:
        return None
    nbytes = _nanmedian(w.steps["comm_bytes"][ok])
    n = w.world_size
    whatif = []
    if measured(busbw) and busbw > 0 and measured(nbytes):
        # the step's own nccl-tests factor, F = busbw x comm_s / bytes: 2(n-1)/n for
        # DDP's allreduce, (n-1)/n for FSDP's all-gathers and reduce-scatters, a mix
        # for a mix; each of those grows with m as (m-1)/m (a broadcast's does not:
        # counted as if it did, a small overestimate)
        with np.errstate(divide="ignore", invalid="ignore"):
            rows = w.steps["busbw_Bps"][ok] * w.steps["comm_s"][ok] / w.steps["comm_bytes"][ok]
        factor = _nanmedian(np.where(np.isfinite(rows) & (rows > 0), rows, np.nan))
        if not measured(factor):
            factor = 2 * (n - 1) / n  # DDP's ring allreduce
        for m in (x * n for x in WHAT_IF):
            c = factor * ((m - 1) / m) / ((n - 1) / n) * nbytes / busbw
            whatif.append({"ranks": m, "comm_s": _f(c), "efficiency": _f(compute / (compute + c))})
    ev = {"efficiency": _f(eff), "efficiency_no_overlap": _f(eff_full), "compute_s": _f(compute),
          "comm_s": _f(comm), "comm_exposed_s": _f(exposed), "comm_bytes": _f(nbytes),
          "busbw_Bps": _f(busbw), "what_if": whatif}
    ranks = [int(r) for r in w.rank[ok]]
    return Finding.of("low_scaling_efficiency", ranks, ev, impact=1 - eff)


# ---- memory ---------------------------------------------------------------------------

def memory_wall(ctx: Context) -> Finding | None:
    """Headroom below the threshold, or memory growing towards the capacity."""
    w, cfg = ctx.w, ctx.cfg
    lat = w.latest
    cap, peak, used = lat["mem_capacity_bytes"], lat["mem_peak_bytes"], lat["mem_used_bytes"]
    kk = ctx.factors("memory_wall", cfg.memory_wall_clear)
    with np.errstate(invalid="ignore"):
        low_all = (cap - peak) < cfg.headroom_min * kk * cap
        trend_all = (w.mem_slope > 0) & (w.mem_growth >= cfg.mem_trend_min_growth * cap / kk) \
            & (w.mem_r2 >= cfg.mem_trend_min_r2 / kk)
        candidates = np.flatnonzero(w.active & (cap > 0) & (low_all | trend_all)).tolist()
    flagged = []
    for i in candidates:
        k = float(kk[i])
        headroom = cap[i] - peak[i] if measured(peak[i]) else math.nan
        low = bool(low_all[i])
        steps_left = math.inf
        slope = w.mem_slope[i]
        if trend_all[i]:
            rate = w.step_rate[i]
            secs = max(0.0, (cap[i] - used[i]) / slope)
            steps_left = secs * rate if measured(rate) and rate > 0 else math.inf
            if not math.isfinite(steps_left) and secs < cfg.oom_horizon_s:
                steps_left = secs  # unknown step rate: still finite
        creeping = steps_left < cfg.oom_horizon_steps * k
        if low or creeping:
            flagged.append((i, headroom, steps_left))
    if not flagged:
        return None
    flagged.sort(key=lambda x: (x[2], x[1] if measured(x[1]) else 0))
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
            "activations_and_other_bytes": _f(peak[i] - static) if measured(peak[i]) else None,
            "free_bytes": _f(headroom),
            "growth_Bps": _f(w.mem_slope[i]), "growth_r2": _f(w.mem_r2[i]),
            "steps_to_oom": _f(steps_left) if math.isfinite(steps_left) else None,
        }
    i0, h0, s0 = flagged[0]
    critical = s0 < cfg.oom_critical_steps or (measured(h0)
                                               and h0 < cfg.headroom_critical * cap[i0])
    # it costs no step time until it stops the job: ordered between the two
    return Finding.of("memory_wall", ranks, evidence, impact=0.5,
                      severity="critical" if critical else None)


# ---- checkpoints --------------------------------------------------------------------------

_EVENTS = attrgetter("events")


def checkpoint_interval(ctx: Context) -> Finding | None:
    """The run's checkpoint interval against Young/Daly's optimum sqrt(2 C MTBF)."""
    w, cfg = ctx.w, ctx.cfg
    best: list[list[Any]] = []
    events = list(map(_EVENTS, w.ranks))
    for i in np.flatnonzero(np.fromiter(map(len, events), dtype=np.int64,
                                        count=len(events)) >= 2).tolist():
        cps = [e for e in events[i] if len(e) >= 3 and e[1] == "checkpoint"
               and isinstance(e[0], (int, float)) and isinstance(e[2], (int, float))]
        if len(cps) > len(best):
            best = cps
    if len(best) < 2:  # an interval takes two checkpoints
        return None
    cost = float(np.median([e[2] for e in best]))
    starts = np.array([float(e[0]) for e in best])
    interval = float(np.median(np.diff(starts)))
    n = max(1, w.world_size)
    mtbf = cfg.gpu_mtbf_h * 3600.0 / n
    opt = math.sqrt(2 * cost * mtbf)
    if cost <= 0 or interval <= 0:
        return None
    tol = cfg.checkpoint_tolerance * ctx.factor("checkpoint_interval", cfg.checkpoint_clear)
    if opt / tol <= interval <= opt * tol:
        return None
    waste_now = cost / interval + interval / (2 * mtbf)
    waste_opt = math.sqrt(2 * cost / mtbf)
    ev = {"checkpoint_s": _f(cost), "interval_s": _f(interval), "ranks": n,
          "gpu_mtbf_h": cfg.gpu_mtbf_h, "job_mtbf_s": _f(mtbf), "optimal_interval_s": _f(opt),
          "overhead_now": _f(waste_now), "overhead_at_optimum": _f(waste_opt),
          "checkpoints_seen": len(best)}
    warning = waste_now > cfg.checkpoint_warning_ratio * waste_opt \
        and waste_now > cfg.checkpoint_warning_overhead
    return Finding.of("checkpoint_interval", [int(r) for r in w.rank], ev,
                      impact=waste_now - waste_opt, severity="warning" if warning else None)
