"""What the screens show, computed from a snapshot: plain functions, no widgets.

A snapshot is columnar (``snap["ranks"][field][i]``); here it becomes rows with their
badges (from the findings, as :mod:`rtop.analysis.kinds` names them), sort keys and the
job-level figures of the header. Missing values stay ``None`` (they print as
:data:`rtop.fmt.NA`), never zero.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, cast

from collectors.figures import BY_NAME, figures
from rtop.analysis.kinds import BADGE_WEIGHT, KINDS
from rtop.fmt import num, safe_text
from rtop.run.snapshot import FindingDict, RankDetail, Snapshot

#: Statuses that are not a finding's badge but still worth a word.
STATUS_BADGES: dict[str, str] = {"lost": "LOST", "failed": "FAILED", "exited": "EXITED",
                                 "finished": "done", "ended": "ended"}


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
    spaces or commas; a row matching any term passes."""
    terms = [t for t in text.replace(",", " ").split() if t]
    if not terms:
        return lambda r: True
    ranks: set[int] = set()
    spans: list[tuple[int, int]] = []
    words: list[str] = []
    for t in terms:
        if t.isdigit():
            ranks.add(int(t))
        elif "-" in t and all(p.isdigit() for p in t.split("-", 1)):
            a, b = (int(p) for p in t.split("-", 1))
            spans.append((min(a, b), max(a, b)))
        else:
            words.append(t.lower())

    def keep(r: RankRow) -> bool:
        if r.rank in ranks or any(a <= r.rank <= b for a, b in spans):
            return True
        return any(w in r.node.lower() or w in r.badge.lower() or w in r.status.lower()
                   for w in words)
    return keep


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
    """Steps/s (median rank), samples/s (all ranks), efficiency and rtop's own counts."""
    run, cols = snap["run"], snap["ranks"]
    status = cols["status"]
    steps = [v for v in (num(x) for x in cols["step_s"]) if v]
    rate = 1.0 / statistics.median(steps) if steps else None
    sps = 0.0
    any_samples = False
    for s, t in zip(cols["samples"], cols["step_s"], strict=False):
        ns, nt = num(s), num(t)
        if ns and nt:
            sps += ns / nt
            any_samples = True
    eff = None
    scaling = snap["overview"].get("scaling")
    if scaling is not None:
        eff = num(scaling["efficiency"])
    if eff is None:
        comp = [num(x) for x in cols["compute_s"]]
        expo = [num(x) for x in cols["comm_exposed_s"]]
        pairs = [(c, e) for c, e in zip(comp, expo, strict=False) if c and e is not None]
        if pairs:
            eff = statistics.median(c / (c + e) for c, e in pairs)
    dropped = sum(d for d in cols["dropped"] if isinstance(d, int))
    cpus = [v for v in (num(x) for x in cols["rtop_cpu"]) if v is not None]
    name, job_id = safe_text(run["name"] or ""), safe_text(run["job"] or "")
    return JobFigures(
        name or job_id or "(unnamed job)", run["world_size"] or 0, run["ranks_seen"] or 0,
        run["attempt"], run["attempts"] or 0, run["uptime_s"] or 0.0, rate,
        sps if any_samples else None, eff, dropped, run["bad_frames"] or 0,
        sum(s == "active" for s in status), sum(s in ("lost", "failed") for s in status),
        statistics.median(cpus) if cpus else None, job_id if name and name != job_id else "")


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
