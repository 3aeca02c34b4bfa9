"""How right the diagnosis is on a simulated fleet: precision, recall, false alarms and
latency, from a recording of :mod:`rtop.fleetsim` and the :class:`~rtop.fleetsim.Truth`
it was made with.

:func:`named` replays the recording the way ``rtop report`` does (every half second of
hub time, the same :class:`~rtop.analysis.monitor.Monitor`) and notes, for every finding
kind, when each rank (and each node, when all its ranks are in the finding) was first
named, and when a job-level finding first appeared. :func:`score` holds that against the
truth:

* a rank fault is right when a finding of one of its fault's kinds (``fleetsim.FAULTS``)
  names the rank; every other rank named by a rank-fault kind is a false alarm (a
  rank fault, on a fleet that had none there);
* the same for nodes: a node is named when every rank of it is in one finding;
* a job-level fault (input bound, a slow NIC) is found when a finding of its kinds
  appears at all; a job-level finding is never a rank fault;
* latency: from the fault's onset to the first time its rank (for a node, its last rank;
  for a job, the finding) was named, in seconds and in steps of the run; for a memory
  leak, also how long before the wall it was named.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtop.analysis.config import AnalysisConfig
from rtop.analysis.kinds import KINDS, RANK_FAULTS
from rtop.fleetsim import FAULTS, JOB_FAULTS, Truth

#: Finding kinds that are facts about the whole job (the others blame ranks or nodes).
JOB_KINDS = frozenset(set(KINDS) - set(RANK_FAULTS))
#: The job-level kinds expected of a simulated job fault (input bound, a slow link):
#: one where the run had no such fault is a false alarm. (``low_scaling_efficiency``,
#: also right for a slow NIC, is not counted: any slow rank lowers the scaling.)
JOB_FAULT_KINDS = frozenset(FAULTS[f][0] for f in JOB_FAULTS)


@dataclass
class Named:
    """When each finding first named each rank, node and job (hub time)."""

    ranks: dict[tuple[str, int], float] = field(default_factory=dict)
    nodes: dict[tuple[str, str], float] = field(default_factory=dict)
    jobs: dict[str, float] = field(default_factory=dict)
    #: findings whose ``scope`` said "job" though their kind blames ranks (e.g. every GPU
    #: power-capped): facts, not rank faults
    facts: dict[str, float] = field(default_factory=dict)
    evaluations: int = 0
    eval_s: list[float] = field(default_factory=list)


def named(path: str | Path, cfg: AnalysisConfig | None = None,
          findings: Callable[[Any, float], list[dict[str, Any]]] | None = None) -> Named:
    """Replay a recording through rtop's diagnosis (or ``findings(state, t)``, another
    detector to compare, called every half second of hub time) and note when each rank,
    node and job was first named, by kind."""
    if findings is None:
        return named_with(path, cfg)["rtop"]
    rule = findings
    return named_with(path, cfg, {"other": lambda state, t, _ours: rule(state, t)},
                      ours=False)["other"]


#: Another detector to hold beside rtop's: ``(state, t, rtop_findings)`` to findings
#: (``rtop_findings`` is empty when rtop's diagnosis is not run in the same replay).
Detector = Callable[[Any, float, list[dict[str, Any]]], list[dict[str, Any]]]


def named_with(path: str | Path, cfg: AnalysisConfig | None = None,
               others: dict[str, Detector] | None = None, *, ours: bool = True
               ) -> dict[str, Named]:
    """One replay of a recording, every half second of hub time judged by rtop's
    diagnosis (key ``"rtop"``, unless ``ours`` is False) and by each of ``others`` (by
    their keys, each given rtop's findings of the same moment): what each named, when."""
    import time

    from collectors import wire
    from rtop.analysis.monitor import EVAL_EVERY_S, Monitor
    from rtop.run.recording import read
    from rtop.run.state import RunState
    from rtop.run.validate import ProtocolError

    monitor = Monitor(RunState(), cfg or AnalysisConfig())
    analyzer = monitor.analyzer
    assert analyzer is not None
    judges: dict[str, Named] = {}
    if ours:
        judges["rtop"] = Named()
    for key in others or {}:
        judges[key] = Named()
    node_ranks: dict[str, set[int]] = {}
    next_eval = -math.inf

    def note(out: Named, kind: str, ranks: Iterable[int], scope: str | None,
             t: float) -> None:
        if kind in JOB_KINDS:
            out.jobs.setdefault(kind, t)
            return
        if scope == "job":
            out.facts.setdefault(kind, t)
            return
        ranks = list(ranks)
        for r in ranks:
            out.ranks.setdefault((kind, r), t)
        mine = set(ranks)
        for node, members in node_ranks.items():
            if members and members <= mine:
                out.nodes.setdefault((kind, node), t)

    for t_hub, frame in read(path):
        try:
            monitor.state.apply(frame, t_hub)
        except ProtocolError:
            continue
        if frame.kind == wire.KIND_HELLO:
            ident = frame.payload.get("identity") or {}
            node_ranks.setdefault(str(ident.get("hostname")), set()).add(int(ident["rank"]))
        if t_hub < next_eval:
            continue
        next_eval = t_hub + EVAL_EVERY_S
        mine: list[dict[str, Any]] = []
        if ours:
            t0 = time.perf_counter()
            mine = [dict(f) for f in analyzer.update(monitor.state, t_hub)]
            judges["rtop"].eval_s.append(time.perf_counter() - t0)
        for key, out in judges.items():
            out.evaluations += 1
            if key == "rtop":
                current = mine
            else:
                t0 = time.perf_counter()
                current = (others or {})[key](monitor.state, t_hub, mine)
                out.eval_s.append(time.perf_counter() - t0)
            for f in current:
                note(out, str(f["kind"]), f["ranks"], (f.get("evidence") or {}).get("scope"),
                     t_hub)
    return judges


@dataclass
class Latency:
    """One fault's detection: seconds and steps from onset (None: never named)."""

    fault: str
    seconds: float | None
    steps: float | None
    before_wall_s: float | None = None


@dataclass
class Score:
    """One run's score (see the module doc)."""

    scenario: str
    ranks: int
    rank_hours: float
    tp_ranks: int = 0
    fp_ranks: int = 0
    fn_ranks: int = 0
    tp_nodes: int = 0
    fp_nodes: int = 0
    fn_nodes: int = 0
    job_found: int = 0
    job_missed: int = 0
    false_rank_faults: list[tuple[str, int]] = field(default_factory=list)
    #: job-level findings of a kind that names a job fault (input bound, a slow link)
    #: where the run had no such fault
    false_job_facts: list[str] = field(default_factory=list)
    latencies: list[Latency] = field(default_factory=list)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the same for nodes (a node is named when every rank of it is in one finding)
    by_kind_nodes: dict[str, dict[str, int]] = field(default_factory=dict)

    def _kind(self, kind: str, what: str, nodes: bool = False) -> None:
        table = self.by_kind_nodes if nodes else self.by_kind
        row = table.setdefault(kind, {"tp": 0, "fp": 0, "fn": 0})
        row[what] += 1


def score(truth: Truth, found: Named) -> Score:
    """Hold what was named against what was true (see the module doc)."""
    spec = truth.spec
    out = Score(truth.scenario, spec.ranks, truth.rank_hours)
    right: dict[int, set[str]] = {}  # rank -> kinds that name it rightly
    right_nodes: dict[str, set[str]] = {}
    for tf in truth.faults:
        if tf.job_level:
            continue
        for r in tf.ranks:
            right.setdefault(r, set()).update(tf.kinds)
        if tf.fault in ("slow_node", "lost_node"):
            for node in tf.nodes:
                right_nodes.setdefault(node, set()).update(tf.kinds)
    step = truth.step_s_median or spec.step_s
    for tf in truth.faults:
        if tf.job_level:
            times = [found.jobs[k] for k in tf.kinds if k in found.jobs and found.jobs[k]
                     >= tf.onset]
            t = min(times) if times else None
            if t is None:
                out.job_missed += 1
                out._kind(tf.kinds[0], "fn")
            else:
                out.job_found += 1
                out._kind(tf.kinds[0], "tp")
            out.latencies.append(_latency(tf.fault, tf.onset, t, step))
            continue
        firsts = []
        for r in tf.ranks:
            times = [found.ranks[(k, r)] for k in tf.kinds if (k, r) in found.ranks]
            if times:
                out.tp_ranks += 1
                out._kind(tf.kinds[0], "tp")
                firsts.append(min(times))
            else:
                out.fn_ranks += 1
                out._kind(tf.kinds[0], "fn")
        if tf.fault in ("slow_node", "lost_node"):
            for node in tf.nodes:
                if any((k, node) in found.nodes for k in tf.kinds):
                    out.tp_nodes += 1
                    out._kind(tf.kinds[0], "tp", nodes=True)
                else:
                    out.fn_nodes += 1
                    out._kind(tf.kinds[0], "fn", nodes=True)
        t = max(firsts) if firsts and len(firsts) == len(tf.ranks) else None
        lat = _latency(tf.fault, tf.onset, t, step)
        if tf.wall is not None and t is not None:
            lat.before_wall_s = tf.wall - t
        out.latencies.append(lat)
    for (kind, r), _t in sorted(found.ranks.items()):
        if kind not in right.get(r, set()):
            out.fp_ranks += 1
            out.false_rank_faults.append((kind, r))
            out._kind(kind, "fp")
    true_job_kinds = {k for tf in truth.faults for k in tf.kinds}
    for kind in sorted(found.jobs):
        if kind in JOB_FAULT_KINDS and kind not in true_job_kinds:
            out.false_job_facts.append(kind)
            out._kind(kind, "fp")
    for (kind, node), _t in found.nodes.items():
        if kind not in right_nodes.get(node, set()) and len(
                [1 for tf in truth.faults if node in tf.nodes and kind in tf.kinds]) == 0:
            out.fp_nodes += 1
            out._kind(kind, "fp", nodes=True)
    return out


def _latency(fault: str, onset: float, t: float | None, step: float) -> Latency:
    if t is None:
        return Latency(fault, None, None)
    s = max(0.0, t - onset)
    return Latency(fault, s, s / step if step > 0 else None)
