"""What a finding says: its summary and its fix, written from its evidence.

The detectors (:mod:`rtop.analysis.detectors`) decide a finding: its ranks (the one it
blames first), severity, evidence and impact. This module only words it, from the ranks
and the figures in the evidence, so a sentence never shows a number the evidence does
not hold. A figure that was not measured (``None`` or NaN) reads "n/a".

A kind's fix (:data:`rtop.analysis.kinds.KINDS`) may name ``{ranks}`` (as the summary
names them, in lower case), ``{node}`` (the node of the rank blamed first) and
``{optimum}`` (the optimal checkpoint interval, as a duration).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rtop.analysis.kinds import KINDS
from rtop.analysis.window import measured
from rtop.fmt import NA, fmt_num, fmt_ranks

Evidence = Mapping[str, Any]
GB = 1e9


def gb(x: object) -> str:
    """Bytes (or bytes per second) in GB, three significant figures."""
    return fmt_num(x, ".3g", 1 / GB)


def ms(x: float | None) -> str:
    """Seconds as milliseconds for a sentence."""
    if not measured(x):
        return NA
    return f"{x * 1e3:.0f} ms" if x >= 0.0095 else f"{x * 1e3:.1f} ms"


def duration(s: float | None) -> str:
    """Seconds as seconds, minutes or hours, whichever reads best."""
    if not measured(s):
        return NA
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def names(ranks: Sequence[int]) -> str:
    """"Rank 3", "Ranks 3 and 5", "Ranks 1, 2, 3, 4, 5 and others"."""
    if not ranks:
        return "The ranks"
    if len(ranks) == 1:
        return f"Rank {ranks[0]}"
    if len(ranks) == 2:
        return f"Ranks {ranks[0]} and {ranks[1]}"
    shown = ", ".join(str(r) for r in ranks[:5])
    return f"Ranks {shown}{' and others' if len(ranks) > 5 else ''}"


def _verb(ranks: Sequence[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _one_node(ev: Evidence) -> str | None:
    """The node a finding names whole, when it names exactly one node."""
    nodes = ev.get("whole_nodes")
    if ev.get("scope") == "node" and isinstance(nodes, Mapping) and len(nodes) == 1:
        return str(next(iter(nodes)))
    return None


def who(ranks: Sequence[int], ev: Evidence) -> str:
    """Who a finding names, as a sentence starts: "Rank 4", "Ranks 4 and 9", "Node
    node-00017 (its 8 ranks)", "3 nodes (24 ranks: node-a, node-b, node-c)", "84 ranks on
    61 nodes". Numbers past five ranks are counted, not listed."""
    nodes = ev.get("whole_nodes")
    n = len(ranks)
    if ev.get("scope") == "node" and isinstance(nodes, Mapping) and nodes:
        listed = list(nodes)
        count = ev.get("whole_node_count") or len(listed)
        if count == 1:
            return f"Node {listed[0]} (its {n} ranks)"
        shown = ", ".join(str(x) for x in listed[:3])
        return f"{count} nodes ({n} ranks: {shown}{' and others' if count > 3 else ''})"
    if n <= 5:
        return names(ranks)
    on = ev.get("node_count")
    if isinstance(on, int) and on > 0:
        return f"{n} ranks on {on} node{'s' if on != 1 else ''}"
    return f"{n} ranks"


def _one(ranks: Sequence[int], ev: Evidence) -> bool:
    """Whether the finding's subject reads as one (a rank, or a node)."""
    return len(ranks) == 1 or _one_node(ev) is not None


def _says(ranks: Sequence[int], ev: Evidence, one: str, many: str) -> str:
    return one if _one(ranks, ev) else many


def _cost(ev: Evidence) -> str:
    """What the finding costs the job, as a sentence ("" when not measured)."""
    cost = ev.get("cost")
    if not isinstance(cost, Mapping):
        return ""
    sec, share = cost.get("s_per_step"), cost.get("share")
    if not measured(sec) or sec <= 0:
        return ""
    of = f" ({share:.0%} of its throughput)" if measured(share) and share > 0 else ""
    return f" It costs the job about {ms(sec)} per step{of}."


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None unless both were measured and ``b`` is positive."""
    if measured(a) and measured(b) and b > 0:
        return a / b
    return None


def _first(ranks: Sequence[int], ev: Evidence) -> Mapping[str, Any]:
    """The evidence about the rank a finding blames first (empty if it has none)."""
    per_rank = ev.get("ranks")
    if ranks and isinstance(per_rank, Mapping):
        return per_rank.get(str(ranks[0])) or {}
    return {}


def _count(ev: Evidence, key: str, listed: str) -> int:
    """A count from the evidence, or the length of the (possibly cut) list it counts."""
    n = ev.get(key)
    return int(n) if isinstance(n, (int, float)) else len(ev.get(listed) or ())


# ---- the summaries, one per kind ------------------------------------------------------

def clock(t: float | None) -> str:
    """A hub time (seconds since the epoch) as this machine's clock time to the
    millisecond: "12:00:01.234"."""
    if not measured(t):
        return NA
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


#: How a lost rank's connection ended (``RankState.lost_how``), in words.
CONNECTION_END = {"reset": "connection reset", "eof": "connection closed",
                  "closed": "connection closed"}


def _followers(ranks: Sequence[int], ev: Evidence) -> str:
    """Who went after the ranks a lost_rank finding names, grouped by how: "ranks 0 and
    2 were torn down after it (SIGTERM)"; empty when nobody did."""
    them = _verb(ranks, "it", "them")
    per_rank = ev.get("followers")
    count = _count(ev, "lost_after_count", "lost_after_them")
    if not isinstance(per_rank, Mapping) or not per_rank:
        if not count:
            return ""
        return f"{count} more rank{'s' if count > 1 else ''} went after {them}"
    groups: dict[str, list[int]] = {}
    for r, f in per_rank.items():
        how = f.get("how") if isinstance(f, Mapping) else None
        groups.setdefault(str(how or "no goodbye"), []).append(int(r))
    parts = []
    for how, rs in groups.items():
        who = names(sorted(rs)).lower() if len(rs) <= 5 else f"{len(rs)} ranks"
        if how.startswith("SIG"):
            parts.append(f"{who} {_verb(rs, 'was', 'were')} torn down after {them} ({how})")
        elif how == "error":
            parts.append(f"{who} failed after {them} (an error)")
        elif how == "exit":
            parts.append(f"{who} exited after {them}")
        else:
            parts.append(f"{who} went after {them} ({how})")
    rest = count - len(per_rank)
    if rest > 0:
        parts.append(f"{rest} more went after {them}")
    return "; ".join(parts)


def _lost_rank(ranks: Sequence[int], ev: Evidence) -> str:
    r = _first(ranks, ev)
    last_step = r.get("last_step")
    step = ("no step reported" if not isinstance(last_step, int) or last_step < 0
            else f"last step {last_step}")
    then = _followers(ranks, ev)
    ended = CONNECTION_END.get(str(r.get("how")))
    if ended is None:  # silent past the timeout (or evidence without how)
        text = (f"{names(ranks)} stopped reporting ({step}, "
                f"{fmt_num(r.get('silent_s'), '.0f')} s ago): the process likely died or its "
                "node went away; the others will block in the next collective.")
        return f"{text} {then[0].upper()}{then[1:]}." if then else text
    said = f"{ended} at {clock(r.get('lost_at'))}, no goodbye, {step}"
    node = ev.get("whole_node")
    if node and len(ranks) > 5:
        text = (f"Node {node} died whole, its {len(ranks)} ranks ({fmt_ranks(ranks)}) "
                f"together ({said}): the node or its container likely went away")
    elif node:
        text = (f"{names(ranks)} died together, every rank of node {node} ({said}): the "
                "node or its container likely went away")
    else:
        text = f"{names(ranks)} died ({said})"
    if then:
        return f"{text}; {then}."
    return f"{text}{'; ' if node else ': '}the others will block in the next collective."


def _hung_rank(ranks: Sequence[int], ev: Evidence) -> str:
    r = _first(ranks, ev)
    peers = _count(ev, "peers_waiting_count", "peers_waiting_in_collective")
    waiting = f"; {peers} peers wait for it in the allreduce" if peers else ""
    return (f"{names(ranks)} {_verb(ranks, 'has', 'have')} been stuck in "
            f"{r.get('phase') or NA} for {fmt_num(r.get('phase_s'), '.0f')} s (a step takes "
            f"{ms(ev.get('median_step_s'))}){waiting}.")


def _input_bound(ranks: Sequence[int], ev: Evidence) -> str:
    who = "The rank waits" if ev.get("ranks") == 1 else "Every rank waits"
    stages = ev.get("stages")
    if ev.get("scope") == "stage" and isinstance(stages, list) and stages:
        which = ", ".join(str(s) for s in stages[:8])
        who = f"Every rank of pipeline stage{'s' if len(stages) > 1 else ''} {which} waits"
    return (f"{who} {ms(ev.get('data_wait_s_median'))} per step for data "
            f"({fmt_num(ev.get('data_wait_share_median'), '.0%')} of the step): the input "
            "pipeline, not any one rank, sets the pace.")


def _starved_rank(ranks: Sequence[int], ev: Evidence) -> str:
    r = _first(ranks, ev)
    wait, peers = r.get("data_wait_s"), r.get("peers_data_wait_s")
    times = _ratio(wait, peers)
    if times is not None and math.isfinite(times) and times < 100:
        ratio = f"{times:.0f}x its peers ({ms(peers)})"
    elif measured(peers):
        ratio = f"while its peers wait {ms(peers)}"
    else:
        ratio = "while its peers do not wait"
    comm, peer_comm = r.get("comm_s"), ev.get("peers_comm_s_median")
    then = (f"; the others then wait for it inside the allreduce ({ms(peer_comm)} vs "
            f"{ms(comm)})") if measured(peer_comm) and measured(comm) \
        and peer_comm > comm else ""
    if not _one(ranks, ev):
        ratio = ratio.replace("its peers", "their peers")
        return (f"{who(ranks, ev)} wait up to {ms(wait)} per step for data, {ratio}"
                f"{then.replace(' for it ', ' for them ')}.{_cost(ev)}")
    return (f"{who(ranks, ev)} waits {ms(wait)} per step for data, "
            f"{ratio}{then}.{_cost(ev)}")


def _clocks(c: Evidence) -> str:
    reasons = c.get("throttle_reasons") or []
    return (f"its GPU clocks are held at {fmt_num(c.get('sm_clock_mhz'), '.0f')} of "
            f"{fmt_num(c.get('sm_clock_max_mhz'), '.0f')} MHz"
            + (f" ({', '.join(reasons)})" if reasons else ""))


def _host_cpu_shared(c: Evidence) -> str:
    load = c.get("load_avg_1m")
    return (f"its host's CPUs are saturated ({fmt_num(c.get('host_cpu_pct'), '.0f')}%"
            + (f", load {load:.1f}" if measured(load) else "")
            + "): the processes there compete for cores")


#: How each cause of a straggler reads, from the slow rank's counters.
STRAGGLER_CAUSES: dict[str, Callable[[Evidence], str]] = {
    "clocks": _clocks,
    "power_cap": lambda c: (f"it runs at its power cap ({fmt_num(c.get('power_w'), '.0f')} of "
                            f"{fmt_num(c.get('power_limit_w'), '.0f')} W)"),
    "hot": lambda c: f"it is hot ({fmt_num(c.get('temp_c'), '.0f')} °C)",
    "gpu_model": lambda c: (f"it has a different GPU ({c.get('gpu') or NA}, the others "
                            f"{c.get('peers_gpu') or NA})"),
    "host_cpu": lambda c: (f"its host's CPUs are saturated "
                           f"({fmt_num(c.get('host_cpu_pct'), '.0f')}%)"),
    "host_cpu_shared": _host_cpu_shared,
}


def straggler_cause(causes: Sequence[str], counters: Evidence) -> str:
    """The causes a detector found for a straggler (``STRAGGLER_CAUSES``' names), worded
    from the slow rank's counters."""
    if not causes:
        return ("nothing in its own counters explains it: the work itself takes longer "
                "there (uneven inputs, a noisy neighbour, a failing part)")
    return "; ".join(STRAGGLER_CAUSES[c](counters) if c in STRAGGLER_CAUSES else c
                     for c in causes)


def _straggler(ranks: Sequence[int], ev: Evidence) -> str:
    r = _first(ranks, ev)
    comp, peers = r.get("compute_s"), r.get("peers_compute_s")
    cause = ev.get("cause") or straggler_cause(ev.get("causes") or (),
                                               ev.get("rank_counters") or {})
    ratio = _ratio(comp, peers)
    its = _says(ranks, ev, "its", "their")
    than = f"{ratio:.1f}x {its} peers ({ms(peers)})" if ratio is not None \
        else f"{its} peers {ms(peers)}"
    return (f"{who(ranks, ev)} {_says(ranks, ev, 'computes', 'compute up to')} {ms(comp)} "
            f"per step, {than}, and they wait for {_says(ranks, ev, 'it', 'them')} in the "
            f"allreduce; {cause}.{_cost(ev)}")


def _fleet_capped(ev: Evidence) -> str:
    """Most GPUs of the job under their max clock with a throttle reason: one fact."""
    reasons = ", ".join(x.replace("_", " ") for x in ev.get("reasons") or ()) or NA
    gpus, of = ev.get("gpus"), ev.get("of")
    every = "Every GPU" if gpus == of else f"{gpus} of {of} GPUs"
    if gpus == of and isinstance(of, int):
        every = f"Every GPU ({of:,} of {of:,})"
    return (f"{every} runs below its max clock: {fmt_num(ev.get('clock_ratio_median'), '.0%')} "
            f"at the median ({fmt_num(ev.get('sm_clock_mhz_median'), '.0f')} of "
            f"{fmt_num(ev.get('sm_clock_max_mhz'), '.0f')} MHz), held down by {reasons}: a "
            "fact about the whole job, not a fault of any rank")


def _gpu_throttled(ranks: Sequence[int], ev: Evidence) -> str:
    if ev.get("scope") == "job":
        return _fleet_capped(ev) + "."
    r = _first(ranks, ev)
    reasons = ", ".join(x.replace("_", " ") for x in r.get("reasons") or ()) or NA
    peers = r.get("peers_clock_ratio")
    than = f", its peers at {peers:.0%}" if measured(peers) and _one(ranks, ev) else ""
    fleet = ev.get("fleet")
    also = f" ({_fleet_capped(fleet)})" if isinstance(fleet, Mapping) else ""
    if _one(ranks, ev) and len(ranks) == 1:
        text = (f"{who(ranks, ev)}'s GPU runs at {fmt_num(r.get('sm_clock_mhz'), '.0f')} of "
                f"{fmt_num(r.get('sm_clock_max_mhz'), '.0f')} MHz{than}, held down by "
                f"{reasons}")
    else:
        text = (f"{who(ranks, ev)} run their GPUs at down to "
                f"{fmt_num(r.get('sm_clock_mhz'), '.0f')} of "
                f"{fmt_num(r.get('sm_clock_max_mhz'), '.0f')} MHz, held down by {reasons}")
    return f"{text}{also}.{_cost(ev)}"


def _probed_link(ranks: Sequence[int], ev: Evidence) -> str:
    """A link probe's verdict: a slow node, or slow links (``rtop.analysis.links``)."""
    slowest, median = ev.get("slowest_Bps"), ev.get("median_Bps")
    share = fmt_num(_ratio(slowest, median), ".0%")
    kind = {"inter_node": " between nodes", "intra_node": " within nodes"}.get(
        str(ev.get("link_kind")), "")
    count = _count(ev, "link_count", "links")
    nodes = ev.get("nodes") or []
    if nodes:
        through = ev.get("node_links")
        of = f"{count} of its {through}" if isinstance(through, int) else f"{count} of its"
        return (f"The link probe finds node {nodes[0]} slow: {of} measured links run "
                f"under {fmt_num(ev.get('threshold'), '.0%')} of the median link{kind}, "
                f"the slowest at {gb(slowest)} GB/s against {gb(median)} GB/s ({share}); "
                f"{names(ranks).lower()} on it {_verb(ranks, 'paces', 'pace')} every ring "
                f"{_verb(ranks, 'it is', 'they are')} in.")
    links = ev.get("links") or []
    first = links[0] if links else [NA, NA]
    return (f"The link probe finds {count} slow link{'s' if count != 1 else ''}{kind}, "
            f"not all through one node; the slowest, rank {first[0]} to rank {first[1]}, "
            f"runs at {gb(slowest)} GB/s against {gb(median)} GB/s ({share}) for the "
            "other links.")


def _slow_link(ranks: Sequence[int], ev: Evidence) -> str:
    if "slowest_Bps" in ev:
        return _probed_link(ranks, ev)
    best, expected = ev.get("busbw_best_Bps"), ev.get("expected_busbw_Bps")
    nodes = _count(ev, "node_count", "nodes")
    where = f"between {nodes} nodes" if nodes > 1 else "within the node"
    if ev.get("expected_from") == "probe":
        return (f"The allreduce runs at {gb(best)} GB/s bus bandwidth {where}, "
                f"{fmt_num(_ratio(best, expected), '.0%')} of the {gb(expected)} GB/s it "
                "reached when the link probe found every link healthy (median link "
                f"{gb(ev.get('probe_median_link_Bps'))} GB/s): a link has slowed since; "
                "probe again to find it.")
    return (f"The allreduce runs at {gb(best)} GB/s bus bandwidth {where}, "
            f"{fmt_num(_ratio(best, expected), '.0%')} of what {ev.get('fabric') or NA} should "
            f"give ({gb(expected)} GB/s); a slow link slows every rank of the "
            "ring alike.")


def _low_scaling_efficiency(ranks: Sequence[int], ev: Evidence) -> str:
    what_if = ev.get("what_if") or []
    last = what_if[-1] if what_if else {}
    more = f" (at {last['ranks']} ranks, {last['efficiency']:.0%})." \
        if measured(last.get("efficiency")) else "."
    return (f"Only {fmt_num(ev.get('efficiency'), '.0%')} of each step is compute: "
            f"{ms(ev.get('comm_exposed_s'))} of communication is not hidden behind "
            f"{ms(ev.get('compute_s'))} of compute{more}")


def _memory_wall(ranks: Sequence[int], ev: Evidence) -> str:
    r = _first(ranks, ev)
    used, cap, headroom = r.get("used_bytes"), r.get("capacity_bytes"), r.get("headroom_bytes")
    if measured(used) and measured(cap) and used >= cap:
        return (f"{names(ranks)} {_verb(ranks, 'uses', 'use up to')} {gb(used)} "
                f"GB, more than the {gb(cap)} GB {_verb(ranks, 'it has', 'each has')}"
                ": out of memory or about to be.")
    if measured(r.get("steps_to_oom")):
        return (f"{names(ranks)}'s memory grows {fmt_num(r.get('growth_Bps'), '.3g', 1e-6)} MB/s "
                f"and fills its {gb(cap)} GB in about "
                f"{fmt_num(r.get('steps_to_oom'), '.0f')} steps.")
    return (f"{names(ranks)} {_verb(ranks, 'has', 'have')} {gb(headroom)} GB of "
            f"{gb(cap)} GB left at its peak ({fmt_num(_ratio(headroom, cap), '.0%')}): "
            "the next larger batch or sequence will not fit.")


def _checkpoint_interval(ranks: Sequence[int], ev: Evidence) -> str:
    interval, opt = ev.get("interval_s"), ev.get("optimal_interval_s")
    if measured(interval) and measured(opt):
        how = "too often" if interval < opt else "too rarely"
    else:
        how = "off the optimum"
    n = ev.get("ranks")
    mtbf_h = _ratio(ev.get("gpu_mtbf_h"), n)  # as the detector computes it, unrounded
    if mtbf_h is None and measured(ev.get("job_mtbf_s")):
        mtbf_h = ev["job_mtbf_s"] / 3600
    return (f"Checkpoints take {fmt_num(ev.get('checkpoint_s'), '.1f')} s every "
            f"{fmt_num(interval, '.0f')} s: {how} for {NA if n is None else n} GPUs (job MTBF "
            f"{fmt_num(mtbf_h, '.0f')} h); every {duration(opt)} would cost "
            f"{fmt_num(ev.get('overhead_at_optimum'), '.1%')} of the run instead of "
            f"{fmt_num(ev.get('overhead_now'), '.1%')}.")


SUMMARIES: dict[str, Callable[[Sequence[int], Evidence], str]] = {
    "starved_rank": _starved_rank,
    "input_bound": _input_bound,
    "straggler": _straggler,
    "slow_link": _slow_link,
    "low_scaling_efficiency": _low_scaling_efficiency,
    "memory_wall": _memory_wall,
    "gpu_throttled": _gpu_throttled,
    "hung_rank": _hung_rank,
    "lost_rank": _lost_rank,
    "checkpoint_interval": _checkpoint_interval,
}


def summary(kind: str, ranks: Sequence[int], evidence: Evidence) -> str:
    """One or two sentences: who, what, the numbers (from ``evidence``)."""
    return SUMMARIES[kind](ranks, evidence)


def fix(kind: str, ranks: Sequence[int], evidence: Evidence) -> str:
    """The kind's usual fix, its ``{placeholders}`` filled from the finding."""
    return KINDS[kind].fix.format_map({
        "ranks": names(ranks).lower(),
        "node": _first(ranks, evidence).get("node") or NA,
        "optimum": duration(evidence.get("optimal_interval_s")),
    })
