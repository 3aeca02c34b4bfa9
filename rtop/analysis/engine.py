"""Running the detectors over time: onset and clear, so findings do not flap.

:class:`Analyzer` is fed the run state at regular times (twice a second in the hub,
every half second of recorded time in a report). A finding starts after its condition
held ``onset_evals`` times in a row and ends ``clear_s`` after it last held. Its
``episodes`` are what a report lists: every finding that ever started, when, for how
long, on which ranks, with its worst evidence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypeVar, cast

from rtop.analysis import detectors as d
from rtop.analysis.config import AnalysisConfig
from rtop.analysis.kinds import SEVERITY_ORDER
from rtop.analysis.window import take
from rtop.run.snapshot import EpisodeDict, FindingDict, Overview, Scaling, Severity
from rtop.run.state import RunState


def evaluate(state: RunState, cfg: AnalysisConfig, active: dict[str, set[int]] | None = None,
             now: float | None = None, overview: Overview | None = None
             ) -> list[d.Finding]:
    """Every finding whose condition holds now (no onset/clear).

    ``overview``, when given, is filled with what a viewer shows whether or not anything
    is wrong: the fabric class and its expected bus bandwidth, and the scaling figures
    (efficiency, breakdown, what-if for more ranks).
    """
    w = take(state, cfg, now)
    if w.n == 0:
        return []
    ctx = d.Context(w, cfg, active or {})
    if overview is not None:
        cls = d.fabric_class(w, cfg)
        scaling = d.low_scaling_efficiency(ctx, always=True)
        overview["fabric"] = cls
        overview["expected_busbw_Bps"] = cfg.fabric_busbw.get(cls)
        overview["nodes"] = len(w.node)
        overview["scaling"] = cast(Scaling, scaling.evidence) if scaling is not None else None
    out: list[d.Finding] = []
    for fn in (d.lost_rank, d.hung_rank):  # these exclude ranks from the comparisons
        f = fn(ctx)
        if f is not None:
            out.append(f)
    if not ctx.excluded:
        # with a rank hung or gone the others wait in the collective: their step and
        # collective figures say nothing about data, compute or the fabric
        inputs = d.input_findings(ctx)
        out += inputs
        starved = {r for f in inputs if f.kind == "starved_rank" for r in f.ranks}
        link = d.slow_link(ctx)
        # a slow link explains low efficiency: one finding, the efficiency in its evidence
        efficiency = d.low_scaling_efficiency(ctx, always=link is not None)
        if link is not None and efficiency is not None:
            link.evidence["scaling"] = efficiency.evidence
            efficiency = None
        for f1 in (d.straggler(ctx, starved), link, efficiency):
            if f1 is not None:
                out.append(f1)
    for f2 in (d.gpu_throttled(ctx), d.memory_wall(ctx), d.checkpoint_interval(ctx)):
        if f2 is not None:
            out.append(f2)
    return out


F = TypeVar("F", FindingDict, EpisodeDict)


def order(findings: list[F]) -> list[F]:
    """Worst first: by severity, then by how much of the step time it costs."""
    return sorted(findings, key=lambda f: (-SEVERITY_ORDER.get(f["severity"], 0),
                                           -float(f.get("impact") or 0.0), f["kind"]))


@dataclass
class Episode:
    """One finding from its start to its end (or now)."""

    kind: str
    since: float
    last: float
    finding: FindingDict
    ranks: set[int] = field(default_factory=set)
    worst: Severity = "info"
    ended: float | None = None

    def to_dict(self) -> EpisodeDict:
        """The episode as the report lists it."""
        f = self.finding
        return EpisodeDict(
            kind=f["kind"], ranks=sorted(self.ranks), severity=self.worst,
            summary=f["summary"], evidence=f["evidence"], fix=f["fix"], impact=f["impact"],
            since=self.since, until=self.ended if self.ended else self.last,
            duration_s=round((self.ended or self.last) - self.since, 3),
            active=self.ended is None)


class Analyzer:
    """Onset/clear tracking over repeated evaluations (see module doc)."""

    def __init__(self, cfg: AnalysisConfig | None = None) -> None:
        self.cfg = cfg or AnalysisConfig.load()
        self._streak: dict[str, tuple[int, float]] = {}  # kind -> (count, first time)
        self.active: dict[str, Episode] = {}
        self.episodes: list[Episode] = []
        self.last_eval_s = 0.0
        self.onsets: list[tuple[float, EpisodeDict]] = []  # (time, finding), newest last
        #: fabric and scaling figures of the last evaluation (see :func:`evaluate`)
        self.overview: Overview = {}

    def update(self, state: RunState, now: float | None = None) -> list[EpisodeDict]:
        """Evaluate once; return the active findings, worst first."""
        t = state.now if now is None else now
        t0 = time.perf_counter()
        overview: Overview = {}
        found = evaluate(state, self.cfg, {k: ep.ranks for k, ep in self.active.items()}, t,
                         overview)
        self.overview = overview
        self.last_eval_s = time.perf_counter() - t0
        seen = set()
        for f in found:
            seen.add(f.kind)
            count, first = self._streak.get(f.kind, (0, t))
            self._streak[f.kind] = (count + 1, first)
            ep = self.active.get(f.kind)
            if ep is not None:
                ep.last, ep.finding = t, f.to_dict()
                ep.ranks = set(f.ranks)
                if SEVERITY_ORDER[f.severity] > SEVERITY_ORDER[ep.worst]:
                    ep.worst = f.severity
            elif count + 1 >= self.cfg.onset_evals:
                ep = Episode(f.kind, first, t, f.to_dict(), set(f.ranks), f.severity)
                self.active[f.kind] = ep
                self.episodes.append(ep)
                self.onsets.append((t, ep.to_dict()))
        for kind in list(self._streak):
            if kind not in seen:
                del self._streak[kind]
        for kind, ep in list(self.active.items()):
            if kind not in seen and t - ep.last > self.cfg.clear_s:
                ep.ended = t
                del self.active[kind]
        return self.current()

    def current(self) -> list[EpisodeDict]:
        """The active findings, worst first, each with when it started."""
        return order([ep.to_dict() for ep in self.active.values()])

    def all_episodes(self) -> list[EpisodeDict]:
        """Every finding that ever started, worst first (active ones before ended)."""
        return order([ep.to_dict() for ep in self.episodes])
