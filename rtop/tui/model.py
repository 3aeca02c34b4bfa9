"""What the screens show, computed from a snapshot: plain functions, no widgets.

A snapshot is columnar (``snap["ranks"][field][i]``); here it becomes rows with their
badges (from the findings), sort keys and the job-level figures of the header. Missing
values stay ``None`` and print as ``N/A``-style dashes, never as zero.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

#: Finding kind -> the badge its ranks wear, most serious first.
BADGES: dict[str, str] = {
    "hung_rank": "HUNG", "lost_rank": "LOST", "memory_wall": "MEMWALL",
    "starved_rank": "STARVED", "straggler": "STRAGGLER", "gpu_throttled": "THROTTLED",
}
_BADGE_WEIGHT = {b: len(BADGES) - i for i, b in enumerate(BADGES.values())}
#: Statuses that are not a finding's badge but still worth a word.
STATUS_BADGES = {"lost": "LOST", "failed": "FAILED", "exited": "EXITED",
                 "finished": "done", "ended": "ended"}

NA = "–"


def num(x: Any) -> float | None:
    """A number or None (NaN, missing and non-numbers are None)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if x != x else float(x)


def fmt_ms(x: Any, width: int = 0) -> str:
    """Seconds as milliseconds, 3 significant figures."""
    v = num(x)
    if v is None:
        return NA
    ms = v * 1e3
    s = f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"
    return s.rjust(width) if width else s


def fmt_bytes(x: Any) -> str:
    """Bytes with a binary-ish unit people read at a glance (GB, MB)."""
    v = num(x)
    if v is None:
        return NA
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.3g} {unit}"
    return f"{v:.0f} B"


def fmt_rate(x: Any) -> str:
    """Bytes per second as GB/s (or MB/s when small)."""
    v = num(x)
    if v is None:
        return NA
    return f"{v / 1e9:.3g} GB/s" if v >= 1e9 else f"{v / 1e6:.3g} MB/s"


def fmt_pct(x: Any, scale: float = 1.0) -> str:
    """A percentage (``scale`` 100 for a fraction)."""
    v = num(x)
    return NA if v is None else f"{v * scale:.0f}%"


def fmt_duration(seconds: Any) -> str:
    """h:mm:ss or m:ss."""
    v = num(seconds)
    if v is None:
        return NA
    s = int(v)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else \
        f"{s // 60}:{s % 60:02d}"


@dataclass
class RankRow:
    """One rank as the table shows it."""

    rank: int
    node: str
    status: str
    badge: str  # "" when nothing is wrong
    step: int | None
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
        return _BADGE_WEIGHT.get(self.badge, 0) * 10 + (
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


def badges_of(findings: list[dict[str, Any]]) -> dict[int, str]:
    """Rank -> the most serious badge any finding gives it."""
    out: dict[int, str] = {}
    for f in findings:
        badge = BADGES.get(f.get("kind", ""))
        if badge is None:
            continue
        for r in f.get("ranks") or []:
            if r not in out or _BADGE_WEIGHT[badge] > _BADGE_WEIGHT[out[r]]:
                out[r] = badge
    return out


def rank_rows(snap: dict[str, Any], highlight: set[int] | None = None) -> list[RankRow]:
    """Every rank of a snapshot as a row, in rank order."""
    cols = snap.get("ranks") or {}
    n = len(cols.get("rank") or [])
    badges = badges_of(snap.get("findings") or [])
    hl = highlight or set()

    def col(name: str) -> list[Any]:
        c = cols.get(name)
        return c if c is not None and len(c) == n else [None] * n

    rank, node, status, step = col("rank"), col("node"), col("status"), col("step")
    step_s, data, comp, comm = col("step_s"), col("data_wait_s"), col("compute_s"), col("comm_s")
    expo, bus, util = col("comm_exposed_s"), col("busbw_Bps"), col("gpu_util_pct")
    used, cap, peak = col("mem_used_bytes"), col("mem_capacity_bytes"), col("mem_peak_bytes")
    gused, gtot = col("gpu_mem_used_bytes"), col("gpu_mem_total_bytes")
    pw, pwl = col("gpu_power_w"), col("gpu_power_limit_w")
    clk, clkm, phase = col("gpu_sm_clock_mhz"), col("gpu_sm_clock_max_mhz"), col("phase")
    rows = []
    for i in range(n):
        u, c = num(used[i]) or num(gused[i]), num(cap[i]) or num(gtot[i])
        p = num(peak[i]) or u
        head = (c - p) / c if c and p is not None else None
        st = str(status[i] or "")
        badge = badges.get(rank[i], "") or (STATUS_BADGES.get(st, "") if st != "active" else "")
        rows.append(RankRow(
            int(rank[i]), str(node[i] or "?"), st, badge, step[i], num(step_s[i]),
            num(data[i]), num(comp[i]), num(comm[i]), num(expo[i]), num(bus[i]),
            num(util[i]), u, c, head, num(pw[i]), num(pwl[i]), num(clk[i]), num(clkm[i]),
            phase[i], rank[i] in hl))
    return rows


#: Sortable columns: name -> key function (None sorts last).
SORT_KEYS: dict[str, Any] = {
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


def parse_filter(text: str) -> Any:
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


def group_rows(rows: list[RankRow], snap: dict[str, Any], unfolded: set[str],
               fold_all: bool) -> list[RankRow | NodeRow]:
    """Rows grouped under their node (nodes worst first); a folded node is one line."""
    by_node: dict[str, list[RankRow]] = {}
    for r in rows:
        by_node.setdefault(r.node, []).append(r)
    out: list[RankRow | NodeRow] = []
    groups = []
    for node, members in by_node.items():
        def worst(vals: list[float | None], fn: Any = max) -> float | None:
            have = [v for v in vals if v is not None]
            return fn(have) if have else None
        badge = max((m.badge for m in members if m.badge in _BADGE_WEIGHT),
                    key=lambda b: _BADGE_WEIGHT[b], default="")
        folded = (fold_all and node not in unfolded) or (not fold_all and node in unfolded)
        groups.append(NodeRow(node, len(members), sum(m.status == "active" for m in members),
                              worst([m.step_s for m in members]),
                              worst([m.data_s for m in members]),
                              worst([m.comm_s for m in members]),
                              worst([m.busbw for m in members], min), badge, folded, members))
    groups.sort(key=lambda g: (-_BADGE_WEIGHT.get(g.badge, 0), -(g.step_s or 0.0), g.node))
    for g in groups:
        out.append(g)
        if not g.folded:
            out.extend(g.members)
    return out


@dataclass
class JobFigures:
    """The header's job-level figures."""

    job: str
    world: int
    seen: int
    attempt: Any
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


def job_figures(snap: dict[str, Any]) -> JobFigures:
    """Steps/s (median rank), samples/s (all ranks), efficiency and rtop's own counts."""
    run, cols = snap.get("run") or {}, snap.get("ranks") or {}
    status = cols.get("status") or []
    steps = [v for v in (num(x) for x in cols.get("step_s") or []) if v]
    samples = cols.get("samples") or []
    rate = 1.0 / statistics.median(steps) if steps else None
    sps = 0.0
    any_samples = False
    for s, t in zip(samples, cols.get("step_s") or [], strict=False):
        if num(s) and num(t):
            sps += s / t
            any_samples = True
    eff = None
    scaling = (snap.get("overview") or {}).get("scaling")
    if isinstance(scaling, dict):
        eff = num(scaling.get("efficiency"))
    if eff is None:
        comp = [num(x) for x in cols.get("compute_s") or []]
        expo = [num(x) for x in cols.get("comm_exposed_s") or []]
        pairs = [(c, e) for c, e in zip(comp, expo, strict=False) if c and e is not None]
        if pairs:
            eff = statistics.median(c / (c + e) for c, e in pairs)
    dropped = sum(int(d) for d in cols.get("dropped") or [] if isinstance(d, int))
    cpus = [v for v in (num(x) for x in cols.get("rtop_cpu") or []) if v is not None]
    name, job_id = str(run.get("name") or ""), str(run.get("job") or "")
    return JobFigures(
        name or job_id or "(unnamed job)", int(run.get("world_size") or 0),
        int(run.get("ranks_seen") or 0), run.get("attempt"), int(run.get("attempts") or 0),
        float(run.get("uptime_s") or 0.0), rate, sps if any_samples else None, eff, dropped,
        int(run.get("bad_frames") or 0), sum(s == "active" for s in status),
        sum(s in ("lost", "failed") for s in status),
        statistics.median(cpus) if cpus else None, job_id if name and name != job_id else "")


def memory_split(detail: dict[str, Any]) -> dict[str, float] | None:
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


def growth_forecast(detail: dict[str, Any]) -> tuple[float | None, float | None]:
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
    rate = (st[-1] - st[0]) / span if span > 0 and st[-1] is not None and st[0] is not None \
        else None
    if not rate or slope <= 0:
        return 0.0 if rate else None, None
    per_step = slope / rate
    free = split["free"]
    return per_step, (free / per_step if per_step > 0 and not math.isinf(free) else None)
