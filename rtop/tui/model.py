"""What the screens show, computed from a snapshot: plain functions, no widgets.

A snapshot is columnar (``snap["ranks"][field][i]``); here it becomes rows with their
badges (from the findings, as :mod:`rtop.analysis.kinds` names them), sort keys and the
job-level figures of the header. Missing values stay ``None`` (they print as
:data:`rtop.fmt.NA`), never zero.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtop.analysis.kinds import BADGE_WEIGHT, KINDS
from rtop.fmt import num, safe_text
from rtop.run.snapshot import FindingDict, RankDetail, Snapshot

#: Statuses that are not a finding's badge but still worth a word.
STATUS_BADGES: dict[str, str] = {"lost": "LOST", "failed": "FAILED", "exited": "EXITED",
                                 "finished": "done", "ended": "ended"}


@dataclass
class RankRow:
    """One rank as the table shows it."""

    rank: int
    node: str
    status: str
    badge: str  # "" when nothing is wrong
    step: int | None  # the last step reported (None before the first)
    step_s: float | None
    data_s: float | None
    compute_s: float | None
    comm_s: float | None
    exposed_s: float | None
    busbw: float | None
    gpu_util: float | None
    mem_used: float | None
    mem_total: float | None
    headroom: float | None  # fraction of capacity left at the peak
    power_w: float | None
    power_limit_w: float | None
    clock_mhz: float | None
    clock_max_mhz: float | None
    phase: str | None
    highlighted: bool = False

    @property
    def severity(self) -> int:
        """How bad this rank looks: badge first, then status."""
        return BADGE_WEIGHT.get(self.badge, 0) * 10 + (
            5 if self.status in ("lost", "failed") else 0)


@dataclass
class NodeRow:
    """A node folded into one line: its worst figures."""

    node: str
    ranks: int
    active: int
    step_s: float | None
    data_s: float | None
    comm_s: float | None
    busbw: float | None
    badge: str
    folded: bool
    members: list[RankRow] = field(default_factory=list)


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


def rank_rows(snap: Snapshot, highlight: set[int] | None = None) -> list[RankRow]:
    """Every rank of a snapshot as a row, in rank order."""
    cols = snap["ranks"]
    badges = badges_of(snap["findings"])
    hl = highlight or set()
    used, cap, peak = cols["mem_used_bytes"], cols["mem_capacity_bytes"], cols["mem_peak_bytes"]
    gused, gtot = cols["gpu_mem_used_bytes"], cols["gpu_mem_total_bytes"]
    rows = []
    for i, rank in enumerate(cols["rank"]):
        u, c = num(used[i]) or num(gused[i]), num(cap[i]) or num(gtot[i])
        p = num(peak[i]) or u
        head = (c - p) / c if c and p is not None else None
        st = str(cols["status"][i] or "")
        badge = badges.get(rank, "") or (STATUS_BADGES.get(st, "") if st != "active" else "")
        step = cols["step"][i]
        rows.append(RankRow(
            int(rank), safe_text(str(cols["node"][i] or "?")), st, badge,
            step if step >= 0 else None,
            num(cols["step_s"][i]), num(cols["data_wait_s"][i]), num(cols["compute_s"][i]),
            num(cols["comm_s"][i]), num(cols["comm_exposed_s"][i]),
            num(cols["busbw_Bps"][i]), num(cols["gpu_util_pct"][i]), u, c, head,
            num(cols["gpu_power_w"][i]), num(cols["gpu_power_limit_w"][i]),
            num(cols["gpu_sm_clock_mhz"][i]), num(cols["gpu_sm_clock_max_mhz"][i]),
            cols["phase"][i], rank in hl))
    return rows


#: Sortable columns: name -> key function (None sorts last).
SORT_KEYS: dict[str, Callable[[RankRow], Any]] = {
    "worst": lambda r: (-r.severity, -(r.step_s or 0.0), r.rank),
    "rank": lambda r: r.rank,
    "node": lambda r: (r.node, r.rank),
    "step": lambda r: r.step if r.step is not None else -1,
    "step ms": lambda r: r.step_s,
    "data": lambda r: r.data_s,
    "compute": lambda r: r.compute_s,
    "comm": lambda r: r.comm_s,
    "busbw": lambda r: r.busbw,
    "GPU": lambda r: r.gpu_util,
    "memory": lambda r: r.mem_used,
    "free": lambda r: r.headroom,
    "power": lambda r: r.power_w,
    "clock": lambda r: r.clock_mhz,
    "status": lambda r: (r.badge, r.status),
}
#: Columns whose natural "worst first" order is descending.
DESCENDING = {"step ms", "data", "compute", "comm", "memory", "power", "step"}


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
        groups.append(NodeRow(node, len(members), sum(m.status == "active" for m in members),
                              _worst([m.step_s for m in members]),
                              _worst([m.data_s for m in members]),
                              _worst([m.comm_s for m in members]),
                              _worst([m.busbw for m in members], min), badge, folded, members))
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
