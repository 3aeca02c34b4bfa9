"""What the screens show, computed from a snapshot: plain functions, no widgets.

A snapshot is columnar (``snap["ranks"][field][i]``); here it becomes rows with their
badges (from the findings, as :mod:`rtop.analysis.kinds` names them), sort keys and the
job-level figures of the header. Missing values stay ``None`` (they print as
:data:`rtop.fmt.NA`), never zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, cast

import numpy as np

from collectors.figures import BY_NAME, figures
from rtop.analysis.kinds import BADGE_WEIGHT
from rtop.analysis.viewport import STATUS_BADGES, FilterTerms, Fleet, badges_of, decode
from rtop.fmt import num, safe_text
from rtop.run.snapshot import FleetView, RankDetail, Snapshot


@dataclass(kw_only=True)
class RankRow:
    """One rank as the table shows it: its figures under their names in
    ``collectors.figures`` (and the snapshot), None where not measured."""

    rank: int
    node: str
    status: str
    badge: str  # "" when nothing is wrong
    step: int | None  # the last step reported (None before the first)
    phase: str | None
    highlighted: bool = False
    step_s: float | None = None
    data_wait_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    comm_exposed_s: float | None = None
    busbw_Bps: float | None = None
    gpu_util_pct: float | None = None
    gpu_power_w: float | None = None
    gpu_power_limit_w: float | None = None
    gpu_sm_clock_mhz: float | None = None
    gpu_sm_clock_max_mhz: float | None = None
    mem_used_bytes: float | None = None  # the training device's, else NVML's
    mem_peak_bytes: float | None = None  # the training device's, else what it uses
    mem_capacity_bytes: float | None = None  # the training device's, else NVML's total
    headroom_ratio: float | None = None  # share of the capacity left at the peak

    @property
    def severity(self) -> int:
        """How bad this rank looks: badge first, then status."""
        return BADGE_WEIGHT.get(self.badge, 0) * 10 + (
            5 if self.status in ("lost", "failed") else 0)


@dataclass(kw_only=True)
class NodeRow:
    """A node folded into one line: its worst figures (the figures' ``node``)."""

    node: str
    ranks: int
    active: int
    badge: str
    folded: bool
    members: list[RankRow] = field(default_factory=list)
    step_s: float | None = None
    data_wait_s: float | None = None
    comm_s: float | None = None
    busbw_Bps: float | None = None


#: The figures a rank's row reads from the snapshot's columns, by name.
ROW_FIGURES = tuple(f.name for f in fields(RankRow) if f.name in BY_NAME and f.default is None)
#: The figures a node's row folds its ranks' into, and how (its worst rank's).
NODE_FIGURES: tuple[tuple[str, Callable[[list[float]], float]], ...] = tuple(
    (f.name, max if f.node == "max" else min) for f in figures() if f.node is not None)


def _numbers(col: list[Any]) -> list[float | None]:
    """A snapshot's column as numbers (:func:`rtop.fmt.num`; a finite float as it is)."""
    return [x if type(x) is float and x - x == 0.0 else num(x) for x in col]


def rank_rows(snap: Snapshot, highlight: set[int] | None = None) -> list[RankRow]:
    """Every rank of a snapshot as a row, in rank order."""
    cols = snap["ranks"]
    badges = badges_of(snap["findings"])
    hl = highlight or set()
    named = cast(Mapping[str, list[Any]], cols)
    values = zip(*(_numbers(named[name]) for name in ROW_FIGURES), strict=True)
    gused, gtot = cols["gpu_mem_used_bytes"], cols["gpu_mem_total_bytes"]
    rows = []
    for i, (rank, figs) in enumerate(zip(cols["rank"], values, strict=True)):
        st = str(cols["status"][i] or "")
        badge = badges.get(rank, "") or (STATUS_BADGES.get(st, "") if st != "active" else "")
        step = cols["step"][i]
        row = RankRow(rank=int(rank), node=safe_text(str(cols["node"][i] or "?")), status=st,
                      badge=badge, step=step if step >= 0 else None, phase=cols["phase"][i],
                      highlighted=rank in hl, **dict(zip(ROW_FIGURES, figs, strict=True)))
        u = row.mem_used_bytes = row.mem_used_bytes or num(gused[i])
        c = row.mem_capacity_bytes = row.mem_capacity_bytes or num(gtot[i])
        p = row.mem_peak_bytes = row.mem_peak_bytes or u
        row.headroom_ratio = (c - p) / c if c and p is not None else None
        rows.append(row)
    return rows


#: Sortable columns: name -> key function (None sorts last): the rank's own, then one per
#: figure with a column (by the figure's name; a cell drawn from several figures sorts
#: by the one it shows most, see ``rtop.tui.columns``).
SORT_KEYS: dict[str, Callable[[RankRow], Any]] = {
    "worst": lambda r: (-r.severity, -(r.step_s or 0.0), r.rank),
    "rank": lambda r: r.rank,
    "node": lambda r: (r.node, r.rank),
    "status": lambda r: (r.badge, r.status),
    **{f.name: attrgetter("headroom_ratio" if f.column.fmt == "free" else f.name)
       for f in figures() if f.column is not None},
}
#: Columns whose natural "worst first" order is descending.
DESCENDING = {f.name for f in figures() if f.column is not None and f.column.desc}


def sort_rows(rows: list[RankRow], key: str = "worst", reverse: bool = False) -> list[RankRow]:
    """Rows sorted by a column; missing values last whatever the direction."""
    fn = SORT_KEYS.get(key, SORT_KEYS["worst"])
    if key == "worst":
        out = sorted(rows, key=fn)
        return out[::-1] if reverse else out
    have = [r for r in rows if fn(r) is not None]
    missing = [r for r in rows if fn(r) is None]
    desc = (key in DESCENDING) != reverse
    return sorted(have, key=fn, reverse=desc) + missing


def parse_filter(text: str) -> Callable[[RankRow], bool]:
    """A predicate from the filter box: rank numbers and ranges (``3``, ``0-7``), a
    badge or status (``starved``, ``lost``), or part of a node name. Terms separated by
    spaces or commas; a row matching any term passes (the hub's pages filter alike:
    :class:`rtop.analysis.viewport.FilterTerms`)."""
    terms = FilterTerms.parse(text)
    if terms.empty:
        return lambda r: True
    return lambda r: terms.keeps(r.rank, r.node, r.badge, r.status)


def group_rows(rows: list[RankRow], unfolded: set[str], fold_all: bool
               ) -> list[RankRow | NodeRow]:
    """Rows grouped under their node (nodes worst first); a folded node is one line."""
    by_node: dict[str, list[RankRow]] = {}
    for r in rows:
        by_node.setdefault(r.node, []).append(r)
    out: list[RankRow | NodeRow] = []
    groups = []
    for node, members in by_node.items():
        badge = max((m.badge for m in members if m.badge in BADGE_WEIGHT),
                    key=lambda b: BADGE_WEIGHT[b], default="")
        folded = (fold_all and node not in unfolded) or (not fold_all and node in unfolded)
        groups.append(NodeRow(
            node=node, ranks=len(members), active=sum(m.status == "active" for m in members),
            badge=badge, folded=folded, members=members,
            **{name: _worst([getattr(m, name) for m in members], pick)
               for name, pick in NODE_FIGURES}))
    groups.sort(key=lambda g: (-BADGE_WEIGHT.get(g.badge, 0), -(g.step_s or 0.0), g.node))
    for g in groups:
        out.append(g)
        if not g.folded:
            out.extend(g.members)
    return out


def view_node_rows(snap: Snapshot, members: list[RankRow], unfolded: set[str],
                   fold_all: bool, text: str = "") -> list[RankRow | NodeRow]:
    """A view's nodes grouped as :func:`group_rows` groups them, from the nodes' own
    columns (a view holds only some ranks' rows): every node a line (those whose name
    holds a word of ``text``, if any), an unfolded node's ranks that the view holds
    under it."""
    nodes = snap["nodes"]
    fleet = snap.get("fleet")
    node_badge: dict[str, str] = {}
    if fleet is not None:
        arrays = decode(fleet)
        order, node_of = arrays["order"], arrays["node_of"]
        for rank, badge in badges_of(snap["findings"]).items():
            hit = np.flatnonzero(order == rank)
            if len(hit) and badge in BADGE_WEIGHT:
                name = safe_text(str(fleet["nodes"][int(node_of[hit[0]])]))
                old = node_badge.get(name, "")
                if BADGE_WEIGHT[badge] > BADGE_WEIGHT.get(old, 0):
                    node_badge[name] = badge
    words = FilterTerms.parse(text).words
    by_node: dict[str, list[RankRow]] = {}
    for r in members:
        by_node.setdefault(r.node, []).append(r)
    named = cast(Mapping[str, list[Any]], nodes)
    groups = []
    for i, raw in enumerate(nodes["node"]):
        node = safe_text(str(raw or "?"))
        if words and not any(w in node.lower() for w in words):
            continue
        folded = (fold_all and node not in unfolded) or (not fold_all and node in unfolded)
        groups.append(NodeRow(node=node, ranks=int(nodes["ranks"][i]),
                              active=int(nodes["active"][i]), badge=node_badge.get(node, ""),
                              folded=folded, members=by_node.get(node, []),
                              **{name: num(named[name][i]) for name, _ in NODE_FIGURES}))
    groups.sort(key=lambda g: (-BADGE_WEIGHT.get(g.badge, 0), -(g.step_s or 0.0), g.node))
    out: list[RankRow | NodeRow] = []
    for g in groups:
        out.append(g)
        if not g.folded:
            out.extend(g.members)
    return out


def _worst(vals: list[float | None],
           pick: Callable[[list[float]], float] = max) -> float | None:
    have = [v for v in vals if v is not None]
    return pick(have) if have else None


@dataclass
class JobFigures:
    """The header's job-level figures."""

    job: str
    world: int
    seen: int
    attempt: int | None
    attempts: int
    uptime_s: float
    steps_per_s: float | None
    samples_per_s: float | None
    efficiency: float | None
    dropped: int
    bad_frames: int
    active: int
    lost: int
    rtop_cpu: float | None = None  # median share of a core the collectors use per rank
    job_id: str = ""  # the training job's own id (Ray run id, rendezvous) when named


def job_figures(snap: Snapshot) -> JobFigures:
    """Steps/s (median rank), samples/s (all ranks), efficiency and rtop's own counts:
    the fleet's totals (the hub's, in a view), the scaling's efficiency first."""
    run = snap["run"]
    fleet = snap.get("fleet")
    t = fleet["job"] if fleet is not None else Fleet(snap).job
    eff = None
    scaling = snap["overview"].get("scaling")
    if scaling is not None:
        eff = num(scaling["efficiency"])
    if eff is None:
        eff = num(t["efficiency"])
    name, job_id = safe_text(run["name"] or ""), safe_text(run["job"] or "")
    return JobFigures(
        name or job_id or "(unnamed job)", run["world_size"] or 0, run["ranks_seen"] or 0,
        run["attempt"], run["attempts"] or 0, run["uptime_s"] or 0.0, num(t["steps_per_s"]),
        num(t["samples_per_s"]), eff, int(t["dropped"] or 0), run["bad_frames"] or 0,
        int(t["active"] or 0), int(t["lost"] or 0), num(t["rtop_cpu"]),
        job_id if name and name != job_id else "")


def all_ranks(snap: Snapshot) -> list[int]:
    """Every rank of the fleet, in order (a view's rows may be only some of them)."""
    fleet = snap.get("fleet")
    if fleet is not None:
        return [int(r) for r in decode_order(fleet)]
    return [int(r) for r in snap["ranks"]["rank"]]


def decode_order(fleet: FleetView) -> list[int]:
    """A fleet view's ranks, in order."""
    return decode(fleet)["order"].tolist()


def memory_split(detail: RankDetail) -> dict[str, float] | None:
    """Parameters / gradients / optimizer / activations and other / free, in bytes, from
    a rank's latest memory sample (None if the rank reported no memory)."""
    mem = detail.get("mem")
    if not isinstance(mem, (list, tuple)):
        return None
    from collectors.schema import MEM_FIELDS

    m = dict(zip(MEM_FIELDS, mem, strict=False))
    cap, peak = num(m.get("capacity_bytes")), num(m.get("peak_bytes"))
    if not cap or peak is None:
        return None
    params, grads, optim = (num(m.get(k)) or 0.0 for k in
                            ("param_bytes", "grad_bytes", "optim_bytes"))
    other = max(0.0, peak - params - grads - optim)
    return {"parameters": params, "gradients": grads, "optimizer": optim,
            "activations": other, "free": max(0.0, cap - peak), "capacity": cap}


def growth_forecast(detail: RankDetail) -> tuple[float | None, float | None]:
    """(bytes per step, steps to the wall) from a rank's memory history: a least-squares
    slope of used memory against steps; None when memory is flat or unknown."""
    samples = detail.get("samples") or {}
    used = samples.get("mem_used_bytes") or []
    t = samples.get("t_wall") or []
    steps = detail.get("steps") or {}
    st, sw = steps.get("step") or [], steps.get("t_wall") or []
    split = memory_split(detail)
    pts = [(a, b) for a, b in zip(t, used, strict=False) if a is not None and b is not None]
    if len(pts) < 10 or len(st) < 2 or not split:
        return None, None
    pts = pts[-60:]
    n = len(pts)
    mt = sum(a for a, _ in pts) / n
    mu = sum(b for _, b in pts) / n
    var = sum((a - mt) ** 2 for a, _ in pts)
    if var <= 0:
        return None, None
    slope = sum((a - mt) * (b - mu) for a, b in pts) / var  # bytes/s
    span = (sw[-1] or 0) - (sw[0] or 0)
    first, last = st[0], st[-1]
    rate = (last - first) / span if span > 0 and last is not None and first is not None \
        else None
    if not rate or slope <= 0:
        return 0.0 if rate else None, None
    per_step = slope / rate
    free = split["free"]
    return per_step, (free / per_step if per_step > 0 and not math.isinf(free) else None)
