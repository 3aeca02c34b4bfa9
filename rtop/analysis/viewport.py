"""What a viewer of a large fleet is sent: the fleet in aggregate, and only the rows it
looks at.

A full snapshot (:meth:`rtop.analysis.Monitor.snapshot`) carries every rank's row: about
450 kB at 1,024 ranks and 7 MB at 16,384, twice a second to every viewer. A viewer asks
for a *view* instead (``{"what": "snapshot", "view": {...}}``, :class:`ViewRequest`: the
ranks and nodes it shows, the pages of the ranks table it scrolls through, how many
outliers) and gets the same :class:`~rtop.run.snapshot.Snapshot` whose ``ranks`` hold
only those rows, with ``fleet`` (:class:`~rtop.run.snapshot.FleetView`): every rank's
node, local rank and status, one byte per rank and :data:`HEAT` figure (its deviation
from the fleet's median), each node's worst and median deviation, each figure's
distribution (p50, p95, p99, the worst and its rank), the top outliers, the job's totals,
and the table's pages, sorted and filtered here as the UI would (``rtop.tui.model``).

The same function serves the hub and every local source (a replay, fixed snapshots, an
older hub that answers with the full snapshot): the UI always draws a view. A fleet of
at most ``whole_up_to`` ranks (:data:`WHOLE_UP_TO`) gets every row, so a small job's
table sorts and filters in the UI as it always has. :class:`Viewports` is the hub's
cache: the fleet's arrays are built once per full snapshot, whatever the viewers ask.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

import numpy as np

from collectors import wire
from collectors.figures import figures
from rtop.analysis.kinds import BADGE_WEIGHT, KINDS
from rtop.run.snapshot import (
    STATUSES,
    FigureStats,
    FindingDict,
    FleetView,
    JobTotals,
    Outlier,
    PageView,
    RankColumns,
    Snapshot,
)

#: The fleet view's version (``FleetView.v``): bumped when its meaning changes.
VERSION: Final = 1


@dataclass(frozen=True)
class HeatFigure:
    """A figure the fleet view colours ranks by: how far each rank is from the fleet's
    median, worse positive. ``per``: the deviation as a share of the fleet's median step
    time (``step``: a time figure, so that a 2 ms wait that doubles does not outshine a
    compute 10 % slower), of the figure's own median (``own``), or in points of a share
    (``points``: memory headroom, already a share of the device)."""

    name: str  # a snapshot column (``collectors.figures``), or ``headroom_ratio``
    label: str
    low_is_worse: bool = False
    per: Literal["step", "own", "points"] = "step"
    unit: Literal["ms", "mhz", "pct"] = "ms"


#: The figures of the fleet view, in the order its key cycles through them.
HEAT: Final[tuple[HeatFigure, ...]] = (
    HeatFigure("step_s", "step"),
    HeatFigure("data_wait_s", "data wait"),
    HeatFigure("compute_s", "compute"),
    HeatFigure("comm_exposed_s", "exposed comm"),
    HeatFigure("gpu_sm_clock_mhz", "GPU clock", low_is_worse=True, per="own", unit="mhz"),
    HeatFigure("headroom_ratio", "mem headroom", low_is_worse=True, per="points", unit="pct"),
)
HEAT_BY_NAME: Final[dict[str, HeatFigure]] = {h.name: h for h in HEAT}
#: A heat byte where the rank did not measure the figure (else its deviation in
#: hundredths, clamped to +-HEAT_CLAMP).
NOT_MEASURED: Final = -128
HEAT_CLAMP: Final = 120
#: Deviations (worse than the median) from which a rank is an outlier at all (the fleet
#: view's first band: a healthy fleet's noise stays under it).
OUTLIER_FROM: Final = 0.04

#: A fleet of at most this many ranks gets every row (unless the view says otherwise).
WHOLE_UP_TO: Final = 128
#: Outliers sent unless the view says how many.
TOP_K: Final = 12
#: The most a view may ask for: ranks named, nodes, pages, rows per page, outliers, and
#: rows in all (what keeps a view's snapshot under a megabyte at any fleet size).
MAX_RANKS: Final = 512
MAX_NODES: Final = 32
MAX_PAGES: Final = 4
MAX_PAGE_ROWS: Final = 256
MAX_TOP: Final = 64
MAX_ROWS: Final = 1024
MAX_FILTER: Final = 200

#: The statuses that make a rank's badge when no finding names it (``rtop.tui.model``).
STATUS_BADGES: Final[dict[str, str]] = {"lost": "LOST", "failed": "FAILED",
                                        "exited": "EXITED", "finished": "done",
                                        "ended": "ended"}
_CODE: Final[dict[str, int]] = {s: i for i, s in enumerate(STATUSES)}
_ACTIVE: Final = _CODE["active"]
_DOWN: Final = (_CODE["lost"], _CODE["failed"])

#: What the ranks table sorts by: the rank's own keys, then one per figure with a column.
SORTS: Final = ("worst", "rank", "node", "status",
                *(f.name for f in figures() if f.column is not None))
#: The table's columns whose "worst first" is high first.
DESCENDING: Final = frozenset(f.name for f in figures() if f.column is not None
                              and f.column.desc)
#: A column's figure drawn from others: the memory cell's fall back on NVML's, and the
#: free memory cell sorts by the headroom.
_SORT_SOURCE: Final = {f.name: "headroom_ratio" for f in figures()
                       if f.column is not None and f.column.fmt == "free"}


# ---- what a viewer asks for ---------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    """A page of the ranks table: sorted by ``sort`` (one of :data:`SORTS`; ``reverse``
    turns it round), only the ranks that pass ``filter`` (the UI's filter box: rank
    numbers and ranges, a badge, a status, part of a node's name), ``first`` (the
    highlighted ranks) ahead, ``limit`` rows from ``offset``."""

    sort: str = "worst"
    reverse: bool = False
    filter: str = ""
    offset: int = 0
    limit: int = 64
    first: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """As a view request carries it."""
        return {"sort": self.sort, "reverse": self.reverse, "filter": self.filter,
                "offset": self.offset, "limit": self.limit, "first": list(self.first)}


@dataclass(frozen=True)
class ViewRequest:
    """What a viewer shows: these ``ranks``, every rank of these ``nodes``, the ``top``
    outliers, the table's ``pages`` (by the viewer's names), or ``every`` rank. A fleet
    of at most ``whole_up_to`` ranks is sent whole. Whatever is asked, a view holds at
    most :data:`MAX_ROWS` rows (pages first, then nodes, ranks and outliers)."""

    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    top: int = TOP_K
    pages: Mapping[str, Page] = field(default_factory=dict)
    every: bool = False
    whole_up_to: int = WHOLE_UP_TO

    def to_wire(self) -> dict[str, Any]:
        """The request's ``view`` as msgpack carries it."""
        return {"v": VERSION, "ranks": list(self.ranks), "nodes": list(self.nodes),
                "top": self.top, "pages": {k: p.to_wire() for k, p in self.pages.items()},
                "every": self.every, "whole_up_to": self.whole_up_to}

    @classmethod
    def parse(cls, obj: object) -> ViewRequest:
        """A view from what a viewer sent: what is malformed is left out, what is too
        much is cut to the limits (never an error: a view only chooses what to send)."""
        if not isinstance(obj, Mapping):
            return cls()
        pages: dict[str, Page] = {}
        raw = obj.get("pages")
        if isinstance(raw, Mapping):
            for name, p in list(raw.items())[:MAX_PAGES]:
                if isinstance(name, str) and isinstance(p, Mapping):
                    pages[name[:32]] = _page(p)
        return cls(ranks=tuple(_ints(obj.get("ranks"), MAX_RANKS)),
                   nodes=tuple(x[:256] for x in _list(obj.get("nodes"), MAX_NODES)
                               if isinstance(x, str)),
                   top=_int(obj.get("top"), TOP_K, 0, MAX_TOP), pages=pages,
                   every=obj.get("every") is True,
                   whole_up_to=_int(obj.get("whole_up_to"), WHOLE_UP_TO, 0, MAX_ROWS))


def _list(x: object, most: int) -> list[Any]:
    return list(x[:most]) if isinstance(x, (list, tuple)) else []


def _int(x: object, default: int, lo: int, hi: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        return default
    return max(lo, min(hi, x))


def _ints(x: object, most: int) -> list[int]:
    return [v for v in _list(x, most) if isinstance(v, int) and not isinstance(v, bool)
            and -(1 << 31) <= v < (1 << 31)]


def _page(p: Mapping[Any, Any]) -> Page:
    sort = p.get("sort")
    text = p.get("filter")
    return Page(sort=sort if sort in SORTS else "worst", reverse=p.get("reverse") is True,
                filter=text[:MAX_FILTER] if isinstance(text, str) else "",
                offset=_int(p.get("offset"), 0, 0, 1 << 31),
                limit=_int(p.get("limit"), 64, 0, MAX_PAGE_ROWS),
                first=tuple(_ints(p.get("first"), MAX_RANKS)))


# ---- the filter box ------------------------------------------------------------------------


@dataclass(frozen=True)
class FilterTerms:
    """The filter box's terms: rank numbers, ranges (``0-7``) and words (a badge, a
    status, part of a node's name); a rank passes if it matches any."""

    ranks: frozenset[int]
    spans: tuple[tuple[int, int], ...]
    words: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> FilterTerms:
        """Terms separated by spaces or commas."""
        ranks: set[int] = set()
        spans: list[tuple[int, int]] = []
        words: list[str] = []
        for t in text.replace(",", " ").split():
            if t.isdigit():
                ranks.add(int(t))
            elif "-" in t and all(p.isdigit() for p in t.split("-", 1)):
                a, b = (int(p) for p in t.split("-", 1))
                spans.append((min(a, b), max(a, b)))
            else:
                words.append(t.lower())
        return cls(frozenset(ranks), tuple(spans), tuple(words))

    @property
    def empty(self) -> bool:
        """No term: everything passes."""
        return not (self.ranks or self.spans or self.words)

    def keeps(self, rank: int, node: str, badge: str, status: str) -> bool:
        """Whether a rank with these passes."""
        if rank in self.ranks or any(a <= rank <= b for a, b in self.spans):
            return True
        return any(w in node.lower() or w in badge.lower() or w in status.lower()
                   for w in self.words)


def badges_of(findings: Sequence[FindingDict]) -> dict[int, str]:
    """Rank -> the most serious badge any finding gives it."""
    out: dict[int, str] = {}
    for f in findings:
        kind = KINDS.get(f["kind"])
        badge = kind.badge if kind is not None else ""
        if not badge:
            continue
        for r in f["ranks"]:
            if r not in out or BADGE_WEIGHT[badge] > BADGE_WEIGHT[out[r]]:
                out[r] = badge
    return out


# ---- the fleet's arrays ------------------------------------------------------------------------


def floats(col: Sequence[Any] | None, n: int) -> np.ndarray:
    """A snapshot column as float64, NaN where None (or not a number)."""
    if col is None or len(col) != n:
        return np.full(n, np.nan)
    try:
        return np.array(col, dtype=np.float64)
    except (TypeError, ValueError):
        return np.array([float(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
                         else np.nan for v in col], dtype=np.float64)


def _or(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a or b`` element by element (a missing or zero ``a`` falls back on ``b``)."""
    return np.where(np.isnan(a) | (a == 0), b, a)


def _places(node_of: np.ndarray, local: Sequence[Any] | None, n: int) -> np.ndarray:
    """Each rank's place on its node: its local rank where every rank has one and they
    are distinct on each node, else its order among the node's ranks."""
    if local is not None and len(local) == n and n:
        vals = floats(local, n)
        if np.isfinite(vals).all() and vals.min() >= 0 and vals.max() < 4096:
            loc = vals.astype(np.int64)
            if len(np.unique(node_of * 4096 + loc)) == n:
                return loc
    out = np.zeros(n, dtype=np.int64)
    if n:
        order = np.argsort(node_of, kind="stable")
        sorted_nodes = node_of[order]
        starts = np.r_[0, np.flatnonzero(np.diff(sorted_nodes)) + 1]
        pos = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
        out[order] = pos
    return out


def _quantize(dev: np.ndarray) -> np.ndarray:
    q = np.clip(np.rint(np.nan_to_num(dev, nan=0.0) * 100), -HEAT_CLAMP, HEAT_CLAMP)
    return np.where(np.isnan(dev), NOT_MEASURED, q).astype(np.int8)


def _node_median(q: np.ndarray, node_of: np.ndarray, nodes: int) -> np.ndarray:
    """Each node's median heat over its ranks that measured it (NOT_MEASURED if none)."""
    out = np.full(nodes, NOT_MEASURED, dtype=np.int8)
    if not len(q):
        return out
    missing = q == NOT_MEASURED
    key = np.where(missing, 1000, q.astype(np.int64))  # the missing sort last in a node
    order = np.lexsort((key, node_of))
    counts = np.bincount(node_of, minlength=nodes)
    measured = np.bincount(node_of, weights=~missing, minlength=nodes).astype(np.int64)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    have = measured > 0
    lo = starts + np.maximum(measured - 1, 0) // 2
    hi = starts + measured // 2
    vals = key[order]
    mid = np.rint((vals[np.minimum(lo, len(q) - 1)] + vals[np.minimum(hi, len(q) - 1)]) / 2)
    out[have] = mid[have].astype(np.int8)
    return out


class Fleet:
    """One full snapshot's fleet as arrays, built once and shared by every view of it:
    ranks, nodes, places, statuses, the heat figures' values and deviations."""

    def __init__(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        self.snap = snap
        cols = cast(Mapping[str, Sequence[Any]], snap["ranks"])
        rank_col = cols.get("rank") or []
        n = self.n = len(rank_col)
        self.rank = np.array(rank_col, dtype=np.int64) if n else np.zeros(0, np.int64)
        names: dict[str, int] = {}
        node_col = cols.get("node") or [""] * n
        self.node_of = np.fromiter((names.setdefault(str(x), len(names)) for x in node_col),
                                   dtype=np.int64, count=n)
        self.nodes = list(names)
        self.local = _places(self.node_of, cols.get("local_rank"), n)
        status = cols.get("status") or ["active"] * n
        self.status_col = [str(s) for s in status]
        self.status = np.fromiter((_CODE.get(s, _CODE["lost"]) for s in self.status_col),
                                  dtype=np.uint8, count=n)
        self.active = self.status == _ACTIVE
        self._cols = cols
        self._values: dict[str, np.ndarray] = {}
        self._badges: tuple[np.ndarray, list[str]] | None = None
        self.badges = badges_of(snap["findings"])
        med_step = self._median("step_s")
        self.dev = np.full((len(HEAT), n), np.nan)
        for i, h in enumerate(HEAT):
            self.dev[i] = self._deviation(h, med_step)
        self.heat = _quantize(self.dev)
        nn = len(self.nodes)
        self.node_worst = np.full((len(HEAT), nn), NOT_MEASURED, dtype=np.int8)
        self.node_median = np.full((len(HEAT), nn), NOT_MEASURED, dtype=np.int8)
        for i in range(len(HEAT)):
            if n:
                worst = np.full(nn, NOT_MEASURED, dtype=np.int16)
                np.maximum.at(worst, self.node_of, self.heat[i].astype(np.int16))
                self.node_worst[i] = worst.astype(np.int8)
            self.node_median[i] = _node_median(self.heat[i], self.node_of, nn)
        self.stats = [self._stats(h) for h in HEAT]
        self.job = self._job()
        score = np.where(self.active[None, :] & np.isfinite(self.dev), self.dev, -np.inf)
        self.score = score.max(axis=0) if len(HEAT) and n else np.full(n, -np.inf)
        self.worst_figure = score.argmax(axis=0) if n else np.zeros(0, np.int64)
        self.fleet_bytes = {
            "order": self.rank.astype("<i4").tobytes(),
            "node_of": self.node_of.astype("<u4").tobytes(),
            "local": np.minimum(self.local, 65535).astype("<u2").tobytes(),
            "status": self.status.tobytes(),
            "heat": self.heat.tobytes(),
            "node_worst": self.node_worst.tobytes(),
            "node_median": self.node_median.tobytes(),
        }
        self.build_s = time.perf_counter() - t0

    # ---- figures ----------------------------------------------------------------------

    def values(self, name: str) -> np.ndarray:
        """A figure's column as floats (NaN: not measured), with the UI's fallbacks:
        the training device's memory, else NVML's; ``headroom_ratio`` derived."""
        if name not in self._values:
            n, cols = self.n, self._cols
            if name == "mem_used_bytes":
                v = _or(floats(cols.get(name), n), floats(cols.get("gpu_mem_used_bytes"), n))
            elif name == "mem_capacity_bytes":
                v = _or(floats(cols.get(name), n), floats(cols.get("gpu_mem_total_bytes"), n))
            elif name == "mem_peak_bytes":
                v = _or(floats(cols.get(name), n), self.values("mem_used_bytes"))
            elif name == "headroom_ratio":
                cap, peak = self.values("mem_capacity_bytes"), self.values("mem_peak_bytes")
                with np.errstate(invalid="ignore", divide="ignore"):
                    v = np.where((cap > 0) & np.isfinite(peak), (cap - peak) / cap, np.nan)
            elif name == "step":
                v = floats(cols.get(name), n)
                v[v < 0] = np.nan  # -1: no step yet
            else:
                v = floats(cols.get(name), n)
            self._values[name] = v
        return self._values[name]

    def _median(self, name: str) -> float:
        v = self.values(name)[self.active]
        v = v[np.isfinite(v)]
        return float(np.median(v)) if len(v) else math.nan

    def _deviation(self, h: HeatFigure, med_step: float) -> np.ndarray:
        v = self.values(h.name)
        med = self._median(h.name)
        if math.isnan(med):
            return np.full(self.n, np.nan)
        if h.per == "points":
            dev = v - med
        else:
            scale = med_step if h.per == "step" and med_step > 0 else med
            if not scale > 0:
                return np.where(np.isfinite(v), 0.0, np.nan)
            dev = (v - med) / scale
        return -dev if h.low_is_worse else dev

    def _stats(self, h: HeatFigure) -> FigureStats:
        v = self.values(h.name)
        ok = self.active & np.isfinite(v)
        vals = v[ok]
        if not len(vals):
            return FigureStats(figure=h.name, n=0, p50=None, p95=None, p99=None, worst=None,
                               worst_rank=None)
        p50, p95, p99 = (float(x) for x in np.percentile(
            vals, [50, 5, 1] if h.low_is_worse else [50, 95, 99]))
        i = int(np.argmin(vals) if h.low_is_worse else np.argmax(vals))
        return FigureStats(figure=h.name, n=len(vals), p50=p50, p95=p95, p99=p99,
                           worst=float(vals[i]), worst_rank=int(self.rank[ok][i]))

    def _job(self) -> JobTotals:
        n = self.n
        step = self.values("step_s")
        good = step[np.isfinite(step) & (step > 0)]
        samples = self.values("samples")
        per = (samples != 0) & np.isfinite(samples) & (step > 0) & np.isfinite(step)
        comp, expo = self.values("compute_s"), self.values("comm_exposed_s")
        pair = np.isfinite(comp) & (comp != 0) & np.isfinite(expo)
        with np.errstate(invalid="ignore", divide="ignore"):
            eff = comp[pair] / (comp[pair] + expo[pair])
        cpu = self.values("rtop_cpu")
        cpu = cpu[np.isfinite(cpu)]
        dropped = self._cols.get("dropped") or []
        return JobTotals(
            steps_per_s=1.0 / float(np.median(good)) if len(good) else None,
            samples_per_s=float(np.sum(samples[per] / step[per])) if per.any() else None,
            efficiency=float(np.median(eff)) if len(eff) else None,
            dropped=sum(d for d in dropped if type(d) is int),
            active=int(self.active.sum()),
            lost=int(np.isin(self.status, _DOWN).sum()) if n else 0,
            rtop_cpu=float(np.median(cpu)) if len(cpu) else None)

    # ---- the table ----------------------------------------------------------------------

    def badge(self, i: int) -> str:
        """The badge of the i-th rank: its finding's, else its status's."""
        codes, names = self._badge_codes()
        return names[int(codes[i])]

    def _badge_codes(self) -> tuple[np.ndarray, list[str]]:
        """Each rank's badge as an index into the distinct badges (``""`` first); made
        once per fleet: the few ranks a finding or their status names."""
        if self._badges is None:
            names = [""]
            codes = np.zeros(self.n, dtype=np.int64)
            named = np.isin(self.rank, np.array(list(self.badges), dtype=np.int64))
            for i in np.flatnonzero(named | ~self.active):
                st = self.status_col[i]
                b = self.badges.get(int(self.rank[i]), "") or (
                    STATUS_BADGES.get(st, "") if st != "active" else "")
                if b not in names:
                    names.append(b)
                codes[i] = names.index(b)
            self._badges = codes, names
        return self._badges

    def page(self, p: Page) -> PageView:
        """A page of the ranks table, as the UI sorts and filters the whole table."""
        idx = self._sorted(p.sort, p.reverse)
        terms = FilterTerms.parse(p.filter)
        if not terms.empty:
            idx = idx[self._passes(terms)[idx]]
        if p.first:
            lead = np.isin(self.rank[idx], np.array(p.first, dtype=np.int64))
            idx = np.r_[idx[lead], idx[~lead]]
        total = len(idx)
        offset = min(p.offset, total)
        return PageView(ranks=self.rank[idx[offset:offset + p.limit]].tolist(), offset=offset,
                        total=total)

    def _passes(self, terms: FilterTerms) -> np.ndarray:
        keep = np.isin(self.rank, np.array(sorted(terms.ranks), dtype=np.int64))
        for a, b in terms.spans:
            keep |= (self.rank >= a) & (self.rank <= b)
        if terms.words:
            def hits(names: Sequence[str]) -> np.ndarray:
                return np.array([any(w in x.lower() for w in terms.words) for x in names],
                                dtype=bool)
            if self.nodes:
                keep |= hits(self.nodes)[self.node_of]
            keep |= hits(STATUSES)[self.status]
            codes, names = self._badge_codes()
            keep |= hits(names)[codes]
        return keep

    def _sorted(self, key: str, reverse: bool) -> np.ndarray:
        """Rank indices in the table's order (``rtop.tui.model.sort_rows``)."""
        rank = self.rank
        if key == "worst":
            codes, names = self._badge_codes()
            weight = np.array([BADGE_WEIGHT.get(b, 0) for b in names])[codes]
            weight = weight * 10 + np.where(np.isin(self.status, _DOWN), 5, 0)
            step = np.nan_to_num(self.values("step_s"), nan=0.0)
            idx = np.lexsort((rank, -step, -weight))
            return idx[::-1] if reverse else idx
        if key == "status":  # (badge, status) as strings; reversed, ties keep their order
            codes, names = self._badge_codes()
            badge_at = np.argsort(np.argsort(np.array(names, dtype=object)))
            status_at = np.argsort(np.argsort(np.array(STATUSES, dtype=object)))
            by_badge, by_status = badge_at[codes], status_at[self.status]
            sign = -1 if reverse else 1
            return np.lexsort((np.arange(self.n), sign * by_status, sign * by_badge))
        if key == "rank":
            idx = np.argsort(rank, kind="stable")
            return idx[::-1] if reverse else idx
        if key == "node":
            node_at = np.argsort(np.argsort(np.array(self.nodes, dtype=object)))
            idx = np.lexsort((rank, node_at[self.node_of])) if self.n else \
                np.zeros(0, np.int64)
            return idx[::-1] if reverse else idx
        v = self.values(_SORT_SOURCE.get(key, key))
        have = np.flatnonzero(np.isfinite(v))
        desc = (key in DESCENDING) != reverse
        order = have[np.argsort(-v[have] if desc else v[have], kind="stable")]
        out: np.ndarray = np.concatenate([order, np.flatnonzero(~np.isfinite(v))])
        return out

    # ---- a view ----------------------------------------------------------------------------

    def outliers(self, k: int) -> list[Outlier]:
        """The ``k`` active ranks furthest from the median in any heat figure, worst
        first (none that deviates less than :data:`OUTLIER_FROM`)."""
        if not k or not self.n:
            return []
        cand = np.flatnonzero(self.score >= OUTLIER_FROM)
        cand = cand[np.lexsort((self.rank[cand], -self.score[cand]))][:k]
        return [Outlier(rank=int(self.rank[i]), node=self.nodes[self.node_of[i]],
                        figure=HEAT[self.worst_figure[i]].name,
                        dev=round(float(self.score[i]), 4)) for i in cand]

    def view(self, req: ViewRequest) -> Snapshot:
        """The snapshot of a view: the full snapshot's everything but its rows, the
        fleet view, and the rows the view shows (every row, for a small fleet or
        ``every``)."""
        t0 = time.perf_counter()
        pages = {name: self.page(p) for name, p in req.pages.items()}
        outliers = self.outliers(req.top)
        whole = req.every or self.n <= req.whole_up_to
        snap = cast(Snapshot, dict(self.snap))
        if not whole:
            want: dict[int, None] = {}
            for pv in pages.values():
                want.update(dict.fromkeys(pv["ranks"]))
            if req.nodes:
                names = {x: i for i, x in enumerate(self.nodes)}
                asked = [names[x] for x in req.nodes if x in names]
                want.update(dict.fromkeys(self.rank[np.isin(self.node_of, asked)].tolist()))
            want.update(dict.fromkeys(req.ranks))
            want.update(dict.fromkeys(o["rank"] for o in outliers))
            rows = np.flatnonzero(np.isin(self.rank, np.array(list(want)[:MAX_ROWS],
                                                               dtype=np.int64)))
            cols = cast(Mapping[str, list[Any]], self.snap["ranks"])
            snap["ranks"] = cast(RankColumns, {k: [col[i] for i in rows]
                                               for k, col in cols.items()})
        fleet = FleetView(
            v=VERSION, ranks=self.n, partial=not whole, nodes=self.nodes,
            figures=[h.name for h in HEAT], stats=self.stats, outliers=outliers,
            job=self.job, pages=pages, build_s=self.build_s + time.perf_counter() - t0,
            order=self.fleet_bytes["order"], node_of=self.fleet_bytes["node_of"],
            local=self.fleet_bytes["local"], status=self.fleet_bytes["status"],
            heat=self.fleet_bytes["heat"], node_worst=self.fleet_bytes["node_worst"],
            node_median=self.fleet_bytes["node_median"])
        snap["fleet"] = fleet
        return snap


def viewport(snap: Snapshot, view: ViewRequest | None = None) -> Snapshot:
    """The snapshot of ``view`` (every row of a small fleet, see the module doc) from a
    full snapshot; a snapshot that is a view already is returned as it is."""
    if "fleet" in snap:
        return snap
    return Fleet(snap).view(view or ViewRequest())


class Viewports:
    """The hub's views: the fleet's arrays built once per full snapshot, each viewer's
    view encoded from them. A fleet is rebuilt at most every ``max_age_s``, and no more
    often than keeps its building under ``share`` of the hub's core: at 16,384 ranks a
    build takes a few hundred milliseconds, so the views there are refreshed every second
    or so, whatever the number of viewers, rather than taking the core from the ranks."""

    def __init__(self, max_age_s: float = 0.2, share: float = 0.2) -> None:
        self.max_age_s = max_age_s
        self.share = share
        #: seconds the last build took (full snapshot and the fleet's arrays)
        self.cost_s = 0.0
        self._fleet: Fleet | None = None
        self._at = -math.inf

    @property
    def age_s(self) -> float:
        """How old a fleet may get before the next request rebuilds it."""
        return max(self.max_age_s, self.cost_s / self.share)

    def fleet(self, build: Callable[[], Snapshot]) -> Fleet:
        """The fleet of a recent full snapshot (``build`` makes a new one)."""
        now = time.monotonic()
        if self._fleet is None or now - self._at >= self.age_s:
            t0 = time.perf_counter()
            self._fleet = Fleet(build())
            self.cost_s = time.perf_counter() - t0
            self._at = time.monotonic()
        return self._fleet

    def clear(self) -> None:
        """Forget the fleet (a new job, or none): the next request builds one."""
        self._fleet, self._at = None, -math.inf

    def frame(self, request: object, build: Callable[[], Snapshot]) -> bytes:
        """The snapshot frame of the view a viewer asked for (see :meth:`ViewRequest.
        parse`)."""
        return wire.encode(wire.KIND_SNAPSHOT,
                           self.fleet(build).view(ViewRequest.parse(request)))


def decode(fleet: FleetView) -> dict[str, np.ndarray]:
    """A fleet view's byte arrays as numpy arrays (``heat``, ``node_worst`` and
    ``node_median`` shaped figures x ranks or nodes); raises ``ValueError`` when their
    lengths do not agree."""
    n, f, nn = fleet["ranks"], len(fleet["figures"]), len(fleet["nodes"])
    out: dict[str, np.ndarray] = {
        "order": np.frombuffer(fleet["order"], dtype="<i4").astype(np.int64),
        "node_of": np.frombuffer(fleet["node_of"], dtype="<u4").astype(np.int64),
        "local": np.frombuffer(fleet["local"], dtype="<u2").astype(np.int64),
        "status": np.frombuffer(fleet["status"], dtype=np.uint8),
        "heat": np.frombuffer(fleet["heat"], dtype=np.int8).reshape(f, -1),
        "node_worst": np.frombuffer(fleet["node_worst"], dtype=np.int8).reshape(f, -1),
        "node_median": np.frombuffer(fleet["node_median"], dtype=np.int8).reshape(f, -1),
    }
    if any(len(out[k]) != n for k in ("order", "node_of", "local", "status")) \
            or out["heat"].shape[1] != n or out["node_worst"].shape[1] != nn \
            or out["node_median"].shape[1] != nn \
            or (n and int(out["node_of"].max()) >= nn):
        raise ValueError("the fleet view's arrays do not agree in length")
    return out
