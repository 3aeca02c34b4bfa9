"""The analysis' view of the run: one array per figure, one entry per rank.

:func:`take` reads a :class:`~rtop.run.state.RunState` once and returns a
:class:`Window` of plain numpy arrays, so the detectors are pure functions of numbers
and cost little even at thousands of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeGuard

import numpy as np

from collectors.figures import figures
from rtop.analysis import roles
from rtop.analysis.config import AnalysisConfig
from rtop.run.ring import nanmedian_rows
from rtop.run.state import LATEST, RankState, RunState

_LATEST = {f: i for i, f in enumerate(LATEST)}
#: How often the diagnosis runs (``rtop.analysis.monitor.EVAL_EVERY_S``, which imports
#: this module): the long memory fit is refitted a slice per evaluation.
EVAL_EVERY_S = 0.5
#: The step figures the diagnosis reads (the figures' ``diagnosis``), in wire order.
_STEP_FIGURES = tuple(f.name for f in figures("steps") if f.diagnosis)


def measured(x: float | None) -> TypeGuard[float]:
    """Whether a figure was measured: not None and not NaN (how the window and the
    evidence say "not measured")."""
    return x is not None and not math.isnan(x)


@dataclass
class Window:
    """Per-rank arrays (index ``i`` is ``ranks[i]``), NaN where not measured."""

    t: float
    ranks: list[RankState]
    rank: np.ndarray
    node: list[str]
    node_of: np.ndarray  # node index per rank
    status: list[str]
    active: np.ndarray  # status == "active"
    world_size: int
    steps: dict[str, np.ndarray]  # recent medians: step_s, data_wait_s, ... (_STEP_FIGURES)
    n_recent: np.ndarray  # steps the medians are taken over
    #: (n, k): each recent step's figures (the same ones), NaN where a step is not among
    #: the recent ones; oldest first
    recent: dict[str, np.ndarray]
    #: (n, k): when each of those steps ended (the rank's wall clock, relative to its
    #: slot's base: comparable within a rank only), NaN where not among the recent ones
    recent_t: np.ndarray
    step_rate: np.ndarray  # steps per second, recent
    latest: dict[str, np.ndarray]  # latest samples: gpu_util_pct, mem_peak_bytes, ...
    phase: list[str | None]
    phase_age_s: np.ndarray  # how long the current phase has lasted, now
    mem_slope: np.ndarray  # bytes per second the device's used memory grows, fitted
    mem_growth: np.ndarray  # growth over the fit, bytes
    mem_r2: np.ndarray  # straightness of the fit
    gpu_name: list[str | None]
    nvlink: np.ndarray  # active NVLink links per rank's GPU (0 when none, NaN unknown)
    #: (n, m): the SM clock of each rank's last ``throttle_samples`` GPU samples, oldest
    #: first (NaN where missing)
    clock_history: np.ndarray
    #: per rank, its peer class: its pipeline stage, or ``roles.NO_STAGE`` (ranks are
    #: compared with the peers of their own class: ``rtop.analysis.roles``)
    peer_class: np.ndarray | None = None
    #: per rank, whether its samples count in the job's throughput (one per replica)
    counted: np.ndarray | None = None

    @property
    def classes(self) -> np.ndarray | None:
        """The peer classes when the ranks fall into more than one, else None (every
        rank is every other's peer)."""
        c = self.peer_class
        if c is None or len(c) == 0 or (c == c[0]).all():
            return None
        return c

    @property
    def n(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    def others_median(self, values: np.ndarray) -> np.ndarray:
        """For each rank, the median of the *other* ranks' values (NaN-aware).

        With two ranks the median of all would be half the culprit's own figure, which
        hides it; the others' median does not.
        """
        n = len(values)
        if n < 2:
            return np.full(n, np.nan)
        if np.isnan(values).all():
            return np.full(n, np.nan)
        if n > 64:  # leaving one of many out barely moves the median
            return np.full(n, float(np.nanmedian(values)))
        out = np.empty(n)
        for i in range(n):
            rest = np.delete(values, i)
            out[i] = np.nan if np.isnan(rest).all() else float(np.nanmedian(rest))
        return out


def _recent_medians(state: RunState, ranks: list[RankState], slots: np.ndarray,
                    cfg: AnalysisConfig
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Medians over each rank's steps of the last ``recent_s`` seconds (at least
    ``recent_min_steps``, at most ``recent_max_steps``), their count, step rate, the
    figures of each of those steps (``(n, k, figures)`` in ``_STEP_FIGURES``' order,
    NaN where dropped) and their end times (``(n, k)``)."""
    rings = state.steps
    k = cfg.recent_max_steps
    names = ["t_wall", *_STEP_FIGURES]
    last = rings.last(slots, k, names)  # (n, k, f) float32
    t = last[:, :, 0].astype(np.float64)
    newest = np.nanmax(np.where(np.isnan(t), -np.inf, t), axis=1)
    old = t < (newest[:, None] - cfg.recent_s)
    keep_always = np.zeros(k, dtype=bool)
    keep_always[-cfg.recent_min_steps:] = True
    drop = old & ~keep_always[None, :]
    # a rank's warm-up steps are no measure of it (NaN until it has warmed up)
    base = rings.bases(slots)  # the ring stores t_wall relative to each slot's base
    warm = np.array([np.nan if rs.warm_wall is None else rs.warm_wall for rs in ranks]) - base
    drop |= ~(t >= warm[:, None])
    last[drop] = np.nan
    med = nanmedian_rows(last)
    valid = ~np.isnan(last[:, :, 1])
    count = valid.sum(axis=1)
    span = np.nanmax(np.where(valid, t, -np.inf), axis=1) - np.nanmin(
        np.where(valid, t, np.inf), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where((count > 1) & (span > 0), (count - 1) / span, np.nan)
    times = np.where(valid, t, np.nan)
    return med, count, rate, last[:, :, 1:].astype(np.float64), times


def _mem_trend(state: RunState, ranks: list[RankState], slots: np.ndarray, cfg: AnalysisConfig,
               n_samples: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least-squares growth of device memory used over the last ``n_samples`` samples
    (default ``mem_trend_samples``), per rank."""
    n_samples = n_samples or cfg.mem_trend_samples
    last = state.samples.last(slots, n_samples, ["t_wall", "mem_used_bytes"]
                              ).astype(np.float64)
    t, y = last[:, :, 0], last[:, :, 1]
    # only samples after the rank warmed up (NaN until then: no trend yet)
    base = state.samples.bases(slots)  # the ring stores t_wall relative to each slot's base
    warm = np.array([np.nan if rs.warm_wall is None else rs.warm_wall for rs in ranks]) - base
    ok = ~(np.isnan(t) | np.isnan(y)) & (t >= warm[:, None])
    cnt = ok.sum(axis=1)
    tt = np.where(ok, t, 0.0)
    yy = np.where(ok, y, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        tm = tt.sum(axis=1) / cnt
        ym = yy.sum(axis=1) / cnt
        dt = np.where(ok, t - tm[:, None], 0.0)
        dy = np.where(ok, y - ym[:, None], 0.0)
        sxx = (dt * dt).sum(axis=1)
        sxy = (dt * dy).sum(axis=1)
        syy = (dy * dy).sum(axis=1)
        slope = sxy / sxx
        r2 = (sxy * sxy) / (sxx * syy)
        span = np.where(ok, t, -np.inf).max(axis=1) - np.where(ok, t, np.inf).min(axis=1)
        # sustained growth, not a warm-up: the newer half must keep growing (mem_trend_newer_ratio)
        half = n_samples // 2
        tn, yn, okn = t[:, half:], y[:, half:], ok[:, half:]
        cn = okn.sum(axis=1)
        tmn = np.where(okn, tn, 0.0).sum(axis=1) / cn
        ymn = np.where(okn, yn, 0.0).sum(axis=1) / cn
        dtn = np.where(okn, tn - tmn[:, None], 0.0)
        dyn = np.where(okn, yn - ymn[:, None], 0.0)
        slope_new = (dtn * dyn).sum(axis=1) / (dtn * dtn).sum(axis=1)
    bad = (cnt < cfg.mem_trend_min_samples) | ~(slope_new >= cfg.mem_trend_newer_ratio * slope)
    slope[bad] = np.nan
    r2[bad] = np.nan
    return slope, slope * span, r2


@dataclass
class TrendCache:
    """The long memory fit (``mem_trend_long_samples`` samples per rank, ~1 s apart: the
    dearest part of a window at thousands of ranks), kept between evaluations and
    refitted a slice of the ranks at a time, so that every rank is refitted within
    ``mem_trend_long_every_s`` of hub time and no evaluation pays for all of them. A new
    set of ranks is fitted whole. The analyzer owns one
    (:class:`rtop.analysis.engine.Analyzer`)."""

    t: float = -math.inf
    slots: np.ndarray | None = None
    fit: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    turn: int = 0
    #: the ranks' roles (pipeline stage, tensor-parallel rank), read once per meta
    role_cache: roles.RoleCache = field(default_factory=roles.RoleCache)

    def long_fit(self, state: RunState, ranks: list[RankState], slots: np.ndarray,
                 cfg: AnalysisConfig, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The long fit of ``ranks`` as of about ``t``."""
        if self.fit is None or self.slots is None or t < self.t \
                or not np.array_equal(self.slots, slots):
            self.fit = _mem_trend(state, ranks, slots, cfg, cfg.mem_trend_long_samples)
            self.t, self.slots, self.turn = t, slots.copy(), 0
            return self.fit
        if t - self.t < EVAL_EVERY_S:
            return self.fit
        parts = max(1, round(cfg.mem_trend_long_every_s / EVAL_EVERY_S))
        self.turn = (self.turn + 1) % parts
        idx = np.arange(self.turn, len(ranks), parts)
        if len(idx):
            part = _mem_trend(state, [ranks[i] for i in idx.tolist()], slots[idx], cfg,
                              cfg.mem_trend_long_samples)
            for whole, new in zip(self.fit, part, strict=True):
                whole[idx] = new
        self.t = t
        return self.fit


def take(state: RunState, cfg: AnalysisConfig, now: float | None = None,
         cache: TrendCache | None = None) -> Window:
    """Read the current attempt's ranks out of the run state (``cache``: the long memory
    fit of an earlier evaluation, reused while fresh)."""
    t = state.now if now is None else now
    ranks = sorted(state.active_ranks(), key=lambda r: r.rank)
    n = len(ranks)
    slots = np.array([r.slot if r.slot is not None else 0 for r in ranks], dtype=np.int64)
    names: dict[str, int] = {}
    node_of = np.array([names.setdefault(r.node, len(names)) for r in ranks], dtype=np.int64)
    k_steps = max(1, min(cfg.recent_max_steps, state.steps.window))
    if n:
        med, count, rate, per_step, step_t = _recent_medians(state, ranks, slots, cfg)
        latest = state.latest[slots]
        slope, growth, r2 = _mem_trend(state, ranks, slots, cfg)
        # a slow leak grows too little over the short fit to tell from noise: where the
        # short fit shows no trend, the long one (over mem_trend_long_samples) is taken
        cap = latest[:, _LATEST["mem_capacity_bytes"]]
        with np.errstate(invalid="ignore"):
            short_ok = (slope > 0) & (growth >= cfg.mem_trend_min_growth * cap) \
                & (r2 >= cfg.mem_trend_min_r2)
        if cfg.mem_trend_long_samples > cfg.mem_trend_samples and not short_ok.all():
            s2, g2, q2 = (cache or TrendCache()).long_fit(state, ranks, slots, cfg, t)
            slope = np.where(short_ok, slope, s2)
            growth = np.where(short_ok, growth, g2)
            r2 = np.where(short_ok, r2, q2)
        clocks = state.samples.last(slots, max(1, cfg.throttle_samples),
                                    ["gpu_sm_clock_mhz"])[:, :, 0].astype(np.float64)
    else:
        med = np.empty((0, len(_STEP_FIGURES) + 1))
        count = rate = slope = growth = r2 = np.empty(0)
        per_step = np.empty((0, k_steps, len(_STEP_FIGURES)))
        step_t = np.empty((0, k_steps))
        latest = np.empty((0, len(LATEST)))
        clocks = np.empty((0, max(1, cfg.throttle_samples)))
    gone = np.array([r.slot is None for r in ranks], dtype=bool)
    if gone.any():
        med[gone] = np.nan
        per_step[gone] = np.nan
        step_t[gone] = np.nan
        latest[gone] = np.nan
        clocks[gone] = np.nan
    steps = {f: med[:, j + 1] for j, f in enumerate(_STEP_FIGURES)}
    recent = {f: per_step[:, :, j] for j, f in enumerate(_STEP_FIGURES)}
    lat = {f: latest[:, i] for f, i in _LATEST.items()}
    # how long each rank has been in its phase: as of its last heartbeat, plus since then
    last_seen = np.array([r.last_seen for r in ranks])
    phase_age = (latest[:, _LATEST["phase_s"]] if n else np.empty(0)) + np.maximum(
        0.0, t - last_seen)
    dev = [r.meta.get("device") if isinstance(r.meta.get("device"), dict) else None
           for r in ranks]
    metas = [r.meta for r in ranks]
    key = (state.meta_version, slots.tobytes(), np.array([r.rank for r in ranks]).tobytes())
    classes, tensor_rank = (cache.role_cache.of(metas, key) if cache is not None
                            else roles.roles_of(metas))
    att = state.current
    return Window(
        t=t, ranks=ranks, rank=np.array([r.rank for r in ranks], dtype=np.int64),
        node=list(names), node_of=node_of, status=[r.status for r in ranks],
        active=np.array([r.status == "active" for r in ranks], dtype=bool),
        world_size=att.world_size if att else 0, steps=steps, n_recent=count,
        recent=recent, recent_t=step_t, clock_history=clocks,
        step_rate=rate, latest=lat, phase=[r.phase for r in ranks], phase_age_s=phase_age,
        mem_slope=slope, mem_growth=growth, mem_r2=r2,
        gpu_name=[d.get("name") if d else None for d in dev],
        nvlink=np.array([float(d["nvlink_links"]) if d and isinstance(
            d.get("nvlink_links"), (int, float)) else np.nan for d in dev]),
        peer_class=classes, counted=roles.counted_from(classes, tensor_rank),
    )
