"""The analysis' view of the run: one array per figure, one entry per rank.

:func:`take` reads a :class:`~rtop.run.state.RunState` once and returns a
:class:`Window` of plain numpy arrays, so the detectors are pure functions of numbers
and cost little even at thousands of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter, is_
from typing import Any, TypeGuard

import numpy as np

from collectors.figures import figures
from collectors.schema import HEARTBEAT_FIELDS
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
    #: ``lookback(idx)``: for the ranks at indices ``idx``, ``(m, L, 2)``: the
    #: :data:`LOOKBACK_FIGURES` of their last ``straggler_lookback_steps`` steps (of the
    #: last ``straggler_lookback_s`` seconds, warm), oldest first, NaN where none: a
    #: longer look-back than ``recent``'s, for how long a straggler's slow steps have
    #: lasted when its steps are too fast for ``recent`` to hold 1.5 s. Read when asked,
    #: for the few ranks that need it (a window of thousands of ranks does not read it)
    lookback: Callable[[np.ndarray], np.ndarray]
    #: per rank, its peer class: its pipeline stage, or ``roles.NO_STAGE`` (ranks are
    #: compared with the peers of their own class: ``rtop.analysis.roles``)
    peer_class: np.ndarray | None = None
    #: per rank, whether its samples count in the job's throughput (one per replica)
    counted: np.ndarray | None = None
    #: per rank, the precision its meta says its FLOPs are in (``throughput.said_dtype``;
    #: None: not read, the throughput reads it)
    said_dtype: list[str | None] | None = None

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


def _warm_walls(ranks: list[RankState]) -> np.ndarray:
    """Each rank's ``warm_wall`` (NaN where it has not warmed up)."""
    return np.array(list(map(_WARM, ranks)), dtype=np.float64)  # None is NaN


_WARM = attrgetter("warm_wall")


def _recent_medians(state: RunState, ranks: list[RankState], slots: np.ndarray,
                    cfg: AnalysisConfig, warm_wall: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Medians over each rank's steps of the last ``recent_s`` seconds (at least
    ``recent_min_steps``, at most ``recent_max_steps``), their count, step rate, the
    figures of each of those steps (``(n, k, figures)`` in ``_STEP_FIGURES``' order,
    NaN where dropped) and their end times (``(n, k)``). ``warm_wall``: the ranks'
    (:func:`_warm_walls`), when the caller has them."""
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
    warm = (_warm_walls(ranks) if warm_wall is None else warm_wall) - base
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


#: the figures of the straggler's look-back (:attr:`Window.lookback`)
LOOKBACK_FIGURES = ("compute_s", "step_s")


def _lookback(state: RunState, slots: np.ndarray, cfg: AnalysisConfig,
              warm_wall: np.ndarray) -> np.ndarray:
    """``(n, L, 2)``: each rank's last ``straggler_lookback_steps`` steps'
    :data:`LOOKBACK_FIGURES`, oldest first; NaN for warm-up steps and those that ended
    more than ``straggler_lookback_s`` before the rank's newest."""
    k = max(1, min(cfg.straggler_lookback_steps, state.steps.window))
    last = state.steps.last(slots, k, ["t_wall", *LOOKBACK_FIGURES])
    t = last[:, :, 0].astype(np.float64)
    newest = np.nanmax(np.where(np.isnan(t), -np.inf, t), axis=1)
    warm = warm_wall - state.steps.bases(slots)
    drop = ~(t >= warm[:, None]) | (t < newest[:, None] - cfg.straggler_lookback_s)
    out = last[:, :, 1:].astype(np.float64)
    out[drop] = np.nan
    return out


def _mem_trend(state: RunState, ranks: list[RankState], slots: np.ndarray, cfg: AnalysisConfig,
               n_samples: int | None = None, warm_wall: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least-squares growth of device memory used over the last ``n_samples`` samples
    (default ``mem_trend_samples``), per rank (``warm_wall``: the ranks', when the caller
    has them)."""
    n_samples = n_samples or cfg.mem_trend_samples
    last = state.samples.last(slots, n_samples, ["t_wall", "mem_used_bytes"]
                              ).astype(np.float64)
    t, y = last[:, :, 0], last[:, :, 1]
    # only samples after the rank warmed up (NaN until then: no trend yet)
    base = state.samples.bases(slots)  # the ring stores t_wall relative to each slot's base
    warm = (_warm_walls(ranks) if warm_wall is None else warm_wall) - base
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


class Members:
    """What a window needs of the ranks that changes only when they do: their order
    (by rank), numbers and nodes, and what their meta says (their GPUs); kept by the
    analyzer between evaluations (:attr:`TrendCache.members`), so that an evaluation
    reads only what moves (status, last seen, phase) rank by rank."""

    def __init__(self, ranks: list[RankState]) -> None:
        self.given = ranks  # as the state listed them: compared by identity
        self.ranks = sorted(ranks, key=_RANK)
        self.rank = np.array(list(map(_RANK, self.ranks)), dtype=np.int64)
        names: dict[str, int] = {}
        self.node_of = np.array([names.setdefault(r.node, len(names)) for r in self.ranks],
                                dtype=np.int64)
        self.node = list(names)
        self.meta_version = -1
        self.metas: list[dict[str, Any]] = []
        self.gpu_name: list[str | None] = []
        self.said_dtype: list[str | None] = []
        self.nvlink = np.empty(0)

    def same(self, ranks: list[RankState]) -> bool:
        """Whether ``ranks`` are the ranks these were made of (the same objects)."""
        return len(ranks) == len(self.given) and all(map(is_, ranks, self.given))

    def read_meta(self, version: int) -> None:
        """Read the ranks' meta again if it changed (``version``: the state's
        ``meta_version``)."""
        if version == self.meta_version and len(self.metas) == len(self.ranks):
            return
        self.meta_version = version
        self.metas = [r.meta for r in self.ranks]
        dev = [m.get("device") if isinstance(m.get("device"), dict) else None
               for m in self.metas]
        self.gpu_name = [d.get("name") if d else None for d in dev]
        from rtop.analysis.throughput import said_dtype  # it imports this module

        self.said_dtype = [said_dtype(m) for m in self.metas]
        self.nvlink = np.array([float(d["nvlink_links"]) if d and isinstance(
            d.get("nvlink_links"), (int, float)) else np.nan for d in dev])


_RANK = attrgetter("rank")
_SLOT = attrgetter("slot")
_STATUS = attrgetter("status")
_LAST_SEEN = attrgetter("last_seen")
_HB_OF = attrgetter("hb")
_HB_PHASE = HEARTBEAT_FIELDS.index("phase")


@dataclass
class TrendCache:
    """The long memory fit (``mem_trend_long_samples`` samples per rank, ~1 s apart: the
    dearest part of a window at thousands of ranks), kept between evaluations by slot
    and refitted a slice of the ranks at a time, so that every rank is refitted within
    ``mem_trend_long_every_s`` of hub time and no evaluation pays for all of them. Ranks
    new to it (a rank that arrives, a slot another rank took) are fitted at once, at
    most :attr:`new_most` at an evaluation (NaN until then: thousands of ranks that
    arrive together cost a few evaluations a share each, not one all of them). The
    analyzer owns one (:class:`rtop.analysis.engine.Analyzer`)."""

    t: float = -math.inf
    turn: int = 0
    #: the fit (slope, growth, r2) by slot, and the rank each slot's fit is of
    by_slot: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    owner: list[RankState | None] = field(default_factory=list)
    #: ranks never fitted yet, fitted at most this many at an evaluation
    new_most: int = 2048
    #: the ranks and slots of the last call, and the positions among them not fitted yet
    seen: tuple[list[RankState], np.ndarray] | None = None
    unfitted: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    #: the ranks' roles (pipeline stage, tensor-parallel rank), read once per meta
    role_cache: roles.RoleCache = field(default_factory=roles.RoleCache)
    #: who the ranks are, read once per set of ranks (and per meta)
    members: Members | None = None

    def long_fit(self, state: RunState, ranks: list[RankState], slots: np.ndarray,
                 cfg: AnalysisConfig, t: float, warm_wall: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The long fit of ``ranks`` as of about ``t`` (``warm_wall``: theirs, when the
        caller has them)."""
        if warm_wall is None:
            warm_wall = _warm_walls(ranks)
        n = len(ranks)
        size = max(state.samples.slots, int(slots.max()) + 1 if n else 0)
        if self.by_slot is None or t < self.t:  # the first call, or a clock gone back
            self.by_slot = (np.full(size, np.nan), np.full(size, np.nan),
                            np.full(size, np.nan))
            self.owner, self.seen, self.t = [None] * size, None, -math.inf
        assert self.by_slot is not None
        if len(self.owner) < size:
            more = size - len(self.owner)
            a, b, c = (np.concatenate([x, np.full(more, np.nan)]) for x in self.by_slot)
            self.by_slot = (a, b, c)
            self.owner += [None] * more
        seen = self.seen
        if seen is None or seen[0] is not ranks or not np.array_equal(seen[1], slots):
            owner = self.owner
            self.unfitted = np.array([i for i, (s, r) in enumerate(zip(
                slots.tolist(), ranks, strict=True)) if owner[s] is not r], dtype=np.int64)
            self.seen = (ranks, slots.copy())
        fit = self.unfitted[:self.new_most]
        self.unfitted = self.unfitted[self.new_most:]
        if t - self.t >= EVAL_EVERY_S:
            parts = max(1, round(cfg.mem_trend_long_every_s / EVAL_EVERY_S))
            self.turn = (self.turn + 1) % parts
            turn = np.arange(self.turn, n, parts)
            fit = np.union1d(fit, turn)
            if len(self.unfitted):
                self.unfitted = np.setdiff1d(self.unfitted, turn)
            self.t = t
        if len(fit):
            part = _mem_trend(state, [ranks[i] for i in fit.tolist()], slots[fit], cfg,
                              cfg.mem_trend_long_samples, warm_wall[fit])
            for whole, new in zip(self.by_slot, part, strict=True):
                whole[slots[fit]] = new
            for i in fit.tolist():
                self.owner[int(slots[i])] = ranks[i]
        slope, growth, r2 = (x[slots] for x in self.by_slot)
        if len(self.unfitted):
            for x in (slope, growth, r2):
                x[self.unfitted] = np.nan
        return slope, growth, r2


def take(state: RunState, cfg: AnalysisConfig, now: float | None = None,
         cache: TrendCache | None = None) -> Window:
    """Read the current attempt's ranks out of the run state (``cache``: the long memory
    fit of an earlier evaluation, reused while fresh, and who the ranks are)."""
    return Taking(state, cfg, now, cache).window()


class Taking:
    """A window being taken, a share of the ranks at a time: :meth:`step` reads the
    next ranks' windows (their recent medians, memory trends and clocks: the dear part),
    then, once all are, the long memory fit; :meth:`window` the rest and puts it
    together. The live hub takes a window of
    thousands of ranks over several turns of its loop, so that none stalls it
    (``rtop.analysis.monitor``); :func:`take` takes it at once. Who the ranks are is
    read when it begins."""

    def __init__(self, state: RunState, cfg: AnalysisConfig, now: float | None = None,
                 cache: TrendCache | None = None) -> None:
        self.state, self.cfg, self.cache = state, cfg, cache
        self.t = state.now if now is None else now
        given = state.active_ranks()
        members = cache.members if cache is not None else None
        if members is None or not members.same(given):
            members = Members(given)
            if cache is not None:
                cache.members = members
        members.read_meta(state.meta_version)
        self.members = members
        self.ranks = members.ranks
        slot_of = list(map(_SLOT, self.ranks))
        self.gone = np.array([s is None for s in slot_of], dtype=bool)
        self.slots = np.array([0 if s is None else s for s in slot_of] if self.gone.any()
                              else slot_of, dtype=np.int64)
        self.warm = _warm_walls(self.ranks)
        self.done = 0  # ranks read so far (the first ``done``)
        #: what is read of each rank (medians, counts, rates, recent steps and their
        #: times, the short memory trend, clocks), filled a part at a time
        self._cols: list[np.ndarray] = []
        #: the memory trends, the long fit taken where the short one shows none (read
        #: once every rank is: a part of its own)
        self._trend: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def n(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def complete(self) -> bool:
        """Whether everything is read (:meth:`window` only puts it together)."""
        return self.done >= self.n and (self._trend is not None or not self.n)

    def step(self, most: int | None = None) -> None:
        """Read the next part: the windows of the next ``most`` ranks (default: all that
        are left), or once all are read the long memory fit (see :class:`TrendCache`)."""
        a = self.done
        if a >= self.n:
            if self._trend is None and self.n:
                self._trend = self._trends()
            return
        b = self.n if most is None else min(self.n, a + max(1, most))
        ranks, slots, warm, cfg = self.ranks[a:b], self.slots[a:b], self.warm[a:b], self.cfg
        part = (*_recent_medians(self.state, ranks, slots, cfg, warm),
                *_mem_trend(self.state, ranks, slots, cfg, None, warm),
                self.state.samples.last(slots, max(1, cfg.throttle_samples),
                                        ["gpu_sm_clock_mhz"])[:, :, 0].astype(np.float64))
        if not self._cols:
            self._cols = [np.empty((self.n, *x.shape[1:]), dtype=x.dtype) for x in part]
        for whole, x in zip(self._cols, part, strict=True):
            whole[a:b] = x
        self.done = b

    def _trends(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The memory trends (slope, growth, r2) and the latest samples: a slow leak
        grows too little over the short fit to tell from noise: where the short fit
        shows no trend, the long one (over mem_trend_long_samples) is taken."""
        cfg, slots = self.cfg, self.slots
        slope, growth, r2 = self._cols[5:8]
        latest = self.state.latest[slots]
        cap = latest[:, _LATEST["mem_capacity_bytes"]]
        with np.errstate(invalid="ignore"):
            short_ok = (slope > 0) & (growth >= cfg.mem_trend_min_growth * cap) \
                & (r2 >= cfg.mem_trend_min_r2)
        if cfg.mem_trend_long_samples > cfg.mem_trend_samples and not short_ok.all():
            s2, g2, q2 = (self.cache or TrendCache()).long_fit(
                self.state, self.ranks, slots, cfg, self.t, self.warm)
            slope = np.where(short_ok, slope, s2)
            growth = np.where(short_ok, growth, g2)
            r2 = np.where(short_ok, r2, q2)
        return slope, growth, r2, latest

    def _lookback(self, idx: np.ndarray) -> np.ndarray:
        """:attr:`Window.lookback` of the ranks at ``idx`` (NaN for those gone)."""
        idx = np.asarray(idx, dtype=np.int64)
        back = _lookback(self.state, self.slots[idx], self.cfg, self.warm[idx])
        back[self.gone[idx]] = np.nan
        return back

    def window(self) -> Window:
        """The window (what is not read yet is read now)."""
        while not self.complete:
            self.step()
        state, cfg, cache, t = self.state, self.cfg, self.cache, self.t
        members, ranks, slots, gone = self.members, self.ranks, self.slots, self.gone
        n = self.n
        k_steps = max(1, min(cfg.recent_max_steps, state.steps.window))
        if n:
            med, count, rate, per_step, step_t = self._cols[:5]
            clocks = self._cols[8]
            assert self._trend is not None
            slope, growth, r2, latest = self._trend
        else:
            med = np.empty((0, len(_STEP_FIGURES) + 1))
            count = rate = slope = growth = r2 = np.empty(0)
            per_step = np.empty((0, k_steps, len(_STEP_FIGURES)))
            step_t = np.empty((0, k_steps))
            latest = np.empty((0, len(LATEST)))
            clocks = np.empty((0, max(1, cfg.throttle_samples)))
        if gone.any():
            med[gone] = np.nan
            per_step[gone] = np.nan
            step_t[gone] = np.nan
            latest[gone] = np.nan
            clocks[gone] = np.nan
        steps = {f: med[:, j + 1] for j, f in enumerate(_STEP_FIGURES)}
        recent = {f: per_step[:, :, j] for j, f in enumerate(_STEP_FIGURES)}
        lat = {f: latest[:, i] for f, i in _LATEST.items()}
        # how long each rank has been in its phase: as of its last heartbeat, plus since
        last_seen = np.fromiter(map(_LAST_SEEN, ranks), dtype=np.float64, count=n)
        # (the hub's deaf time not counted: a rank is not stuck for what it was not heard)
        phase_age = (latest[:, _LATEST["phase_s"]] if n else np.empty(0)) + np.maximum(
            0.0, t - last_seen - state.deaf_within(last_seen, t))
        status = list(map(_STATUS, ranks))
        key = (state.meta_version, slots.tobytes(), members.rank.tobytes())
        classes, tensor_rank = (cache.role_cache.of(members.metas, key) if cache is not None
                                else roles.roles_of(members.metas))
        att = state.current
        return Window(
            t=t, ranks=ranks, rank=members.rank.copy(),
            node=list(members.node), node_of=members.node_of.copy(), status=status,
            active=np.array([s == "active" for s in status], dtype=bool),
            world_size=att.world_size if att else 0, steps=steps, n_recent=count,
            recent=recent, recent_t=step_t, clock_history=clocks,
            lookback=self._lookback,
            step_rate=rate, latest=lat,
            phase=[None if not hb else str(hb[_HB_PHASE]) for hb in map(_HB_OF, ranks)],
            phase_age_s=phase_age, mem_slope=slope, mem_growth=growth, mem_r2=r2,
            gpu_name=list(members.gpu_name), nvlink=members.nvlink.copy(),
            peer_class=classes, counted=roles.counted_from(classes, tensor_rank),
            said_dtype=list(members.said_dtype),
        )
