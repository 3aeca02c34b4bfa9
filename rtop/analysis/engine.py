"""Running the detectors over time: onset and clear, so findings do not flap.

:class:`Analyzer` is fed the run state at regular times (twice a second in the hub,
every half second of recorded time in a report). A finding starts after its condition
held ``onset_evals`` times in a row and ends ``clear_s`` after it last held. Its
``episodes`` are what a report lists: every finding that ever started, when, for how
long, on which ranks, with its worst evidence.

Each detector runs on its own (:class:`DetectorErrors`): one that raises costs its own
finding for that evaluation, logged once with its traceback, never the others' or the
cycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from rtop.analysis import detectors as d
from rtop.analysis import throughput
from rtop.analysis.config import AnalysisConfig
from rtop.analysis.hiccups import HiccupCounter
from rtop.analysis.kinds import KINDS, SEVERITY_ORDER
from rtop.analysis.window import Taking, TrendCache, take
from rtop.run.snapshot import EpisodeDict, FindingDict, Overview, Scaling, Severity
from rtop.run.state import RunState

log = logging.getLogger("rtop.analysis")
R = TypeVar("R")


class DetectorErrors:
    """Runs each detector on its own: one that raises returns ``default`` (its finding
    is skipped this time) and is logged once, with its traceback; ``counts`` says how
    often each has failed."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def run(self, name: str, fn: Callable[..., R], *args: Any, default: R,
            **kwargs: Any) -> R:
        """``fn(*args, **kwargs)``, or ``default`` if it raises."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            n = self.counts.get(name, 0)
            self.counts[name] = n + 1
            if n == 0:
                log.exception("rtop: the %s detector failed; it is skipped each time it "
                              "fails (logged once), the other detectors run on", name)
            return default


#: Where :func:`evaluate` counts failures when it is given nowhere else.
ERRORS = DetectorErrors()


def evaluate(state: RunState, cfg: AnalysisConfig, active: dict[str, set[int]] | None = None,
             now: float | None = None, overview: Overview | None = None,
             errors: DetectorErrors | None = None,
             cache: TrendCache | None = None,
             hiccups: HiccupCounter | None = None,
             taking: Taking | None = None) -> list[d.Finding]:
    """Every finding whose condition holds now (no onset/clear).

    ``overview``, when given, is filled with what a viewer shows whether or not anything
    is wrong: the fabric class and its expected bus bandwidth, the scaling figures
    (efficiency, breakdown, what-if for more ranks) and the throughput (samples/s,
    tokens/s, model TFLOPS and MFU: ``rtop.analysis.throughput``). A detector that raises costs its
    own finding only (counted and logged once in ``errors``). ``hiccups``, when given,
    counts the steps where a rank stood out but not for long enough to be named.
    ``taking``: the window, begun earlier and read a share of the ranks at a time (its
    time is the evaluation's: :meth:`Analyzer.begin`).
    """
    run = (errors or ERRORS).run
    w = (run("window", take, state, cfg, now, cache, default=None) if taking is None
         else run("window", taking.window, default=None))
    if w is None or w.n == 0:
        return []
    ctx = d.Context(w, cfg, active or {}, links=state.links)
    if overview is not None:
        cls = run("fabric_class", d.fabric_class, w, cfg, default="unknown")
        scaling = run("low_scaling_efficiency", d.low_scaling_efficiency, ctx, always=True,
                      default=None)
        overview["fabric"] = cls
        overview["expected_busbw_Bps"] = cfg.fabric_busbw.get(cls)
        overview["nodes"] = len(w.node)
        overview["scaling"] = cast(Scaling, scaling.evidence) if scaling is not None else None
        rates = run("throughput", throughput.of_window, w, default=None)
        if rates is not None:
            overview["throughput"] = rates
    out: list[d.Finding] = []
    for fn in (d.lost_rank, d.hung_rank):  # these exclude ranks from the comparisons
        f = run(fn.__name__, fn, ctx, default=None)
        if f is not None:
            out.append(f)
    if not ctx.excluded:
        # with a rank hung or gone the others wait in the collective: their step and
        # collective figures say nothing about data, compute or the fabric
        none: list[d.Finding] = []
        inputs = run("input_findings", d.input_findings, ctx, default=none)
        out += inputs
        starved = {r for f in inputs if f.kind == "starved_rank" for r in f.ranks}
        link = run("slow_link", d.slow_link, ctx, default=None)
        # a slow link explains low efficiency: one finding, the efficiency in its evidence
        efficiency = run("low_scaling_efficiency", d.low_scaling_efficiency, ctx,
                         always=link is not None, default=None)
        if link is not None and efficiency is not None:
            link.evidence["scaling"] = efficiency.evidence
            efficiency = None
        straggler = run("straggler", d.straggler, ctx, starved, default=None)
        for f1 in (straggler, link, efficiency):
            if f1 is not None:
                out.append(f1)
    for fn2 in (d.gpu_throttled, d.memory_wall, d.checkpoint_interval):
        f2 = run(fn2.__name__, fn2, ctx, default=None)
        if f2 is not None:
            out.append(f2)
    if hiccups is not None and ctx.hiccups:
        run("hiccups", hiccups.count, w.ranks, w.recent_t, ctx.hiccups, default=None)
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
        #: detectors that failed, and how often (each is logged once)
        self.errors = DetectorErrors()
        #: the slow part of a window kept between evaluations (the long memory fit)
        self.cache = TrendCache()
        #: each rank's transient steps (stood out, not for long enough to be named)
        self.hiccups = HiccupCounter()

    def begin(self, state: RunState, now: float | None = None) -> Taking:
        """An evaluation as of ``now`` begun: its window, to read a share of the ranks at
        a time (``Taking.step``) and to give to :meth:`update` once read."""
        return Taking(state, self.cfg, now, self.cache)

    def update(self, state: RunState, now: float | None = None,
               taking: Taking | None = None) -> list[EpisodeDict]:
        """Evaluate once; return the active findings, worst first. ``taking``: the
        evaluation's window, begun by :meth:`begin` (its time is the evaluation's)."""
        t = (state.now if now is None else now) if taking is None else taking.t
        t0 = time.perf_counter()
        overview: Overview = {}
        found = evaluate(state, self.cfg, {k: ep.ranks for k, ep in self.active.items()}, t,
                         overview, self.errors, self.cache, self.hiccups, taking)
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
            elif count + 1 >= (1 if KINDS[f.kind].persists else self.cfg.onset_evals):
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

    def withdraw(self, kind: str, ranks: set[int], since: float) -> list[EpisodeDict]:
        """Take back the findings of ``kind`` that started at or after ``since`` and named
        no rank but ``ranks`` (the run's own word says they were no fault: ranks lost as
        their command exited 0), active or ended, as if they never started; return the
        active findings, worst first."""
        gone = [ep for ep in self.episodes
                if ep.kind == kind and ep.since >= since and ep.ranks <= ranks]
        for ep in gone:
            self.episodes.remove(ep)
            if self.active.get(kind) is ep:
                del self.active[kind]
                self._streak.pop(kind, None)
        starts = {ep.since for ep in gone}
        self.onsets = [(t, f) for t, f in self.onsets
                       if not (f["kind"] == kind and f["since"] in starts)]
        return self.current()

    def current(self) -> list[EpisodeDict]:
        """The active findings, worst first, each with when it started."""
        return order([ep.to_dict() for ep in self.active.values()])

    def all_episodes(self) -> list[EpisodeDict]:
        """Every finding that ever started, worst first (active ones before ended)."""
        return order([ep.to_dict() for ep in self.episodes])
