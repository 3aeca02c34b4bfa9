"""One run watched: its state, its diagnosis on one cadence, and the snapshot viewers get.

The live hub, a replay and ``rtop report`` all watch a run the same way: every frame
goes into the :class:`~rtop.run.state.RunState`, and every half second of the hub's
time the silent ranks are marked lost and the diagnosis runs once. A :class:`Monitor`
is that, written once; the three differ only in where frames and time come from (a
socket and the wall clock, or a recording and its ``clock`` frames).

Once the run's command has exited 0 (a ``job_exit`` frame, ``rtop run``'s word), a
``lost_rank`` finding that only the ranks its exit ended made is withdrawn at the next
evaluation (``Analyzer.withdraw``): those ranks finished, they were not lost.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from collectors import wire
from rtop.analysis import window
from rtop.analysis.config import AnalysisConfig
from rtop.analysis.engine import Analyzer
from rtop.analysis.links import view as links_view
from rtop.run.snapshot import (
    EpisodeDict,
    HubInfo,
    LinksView,
    Overview,
    RankDetail,
    ReplayInfo,
    Snapshot,
)
from rtop.run.state import JobExit, RankState, RunState

#: Seconds of the hub's time between two evaluations of the diagnosis (at least: see
#: :data:`EVAL_SHARE`).
EVAL_EVERY_S: Final = window.EVAL_EVERY_S
#: The share of a core the live hub's diagnosis may take on average: where one
#: evaluation costs more than this share of :data:`EVAL_EVERY_S` (thousands of ranks),
#: the next comes later, its interval the evaluations' CPU time over the share (the
#: lesser of the last two: ``Monitor.advance(share=...)``), up to
#: :data:`EVAL_MOST_EVERY_S`. At 1,024
#: ranks an evaluation costs ~10-20 ms and the interval stays 0.5 s; at 16,384 it is
#: about 1-2 s.
EVAL_SHARE: Final = 0.10
#: The longest the diagnosis waits between two evaluations, however dear they are.
EVAL_MOST_EVERY_S: Final = 5.0
#: With a share given (the live hub), a window of more ranks than this is read this many
#: ranks at a call of ``Monitor.advance`` (one a housekeeping pass, every 0.25 s), then
#: the long memory fit, then the detectors, a call each: no call stalls the hub's loop
#: for the whole evaluation (at 16,384 ranks, 6 calls of ~20-60 ms in place of one of
#: ~160 ms).
EVAL_PART_RANKS: Final = 4096

log = logging.getLogger("rtop.analysis")


@dataclass
class Evaluation:
    """What one evaluation changed: ranks newly lost, findings started and ended."""

    t: float
    lost: list[RankState] = field(default_factory=list)
    started: list[EpisodeDict] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)
    #: findings taken back: their ranks ended with the job (its command exited 0)
    withdrawn: list[str] = field(default_factory=list)


class Monitor:
    """A run's state and its diagnosis (see the module doc).

    ``config`` sets the diagnosis' thresholds; ``diagnose=False`` keeps the state only
    (a hub that shows figures without findings). ``state`` may be given to choose its
    window sizes.
    """

    def __init__(self, state: RunState | None = None, config: AnalysisConfig | None = None,
                 *, diagnose: bool = True) -> None:
        self.state = state if state is not None else RunState()
        self.analyzer = Analyzer(config) if diagnose else None
        self._next_eval = -math.inf
        #: seconds between two evaluations of the diagnosis (:data:`EVAL_EVERY_S`, more
        #: where they cost more than their share: ``advance(share=...)``)
        self.eval_every_s = EVAL_EVERY_S
        self._next_diagnosis = -math.inf
        self._costs: deque[float] = deque(maxlen=2)  # the last evaluations' CPU times
        #: an evaluation under way, read a share of the ranks at a call (with a share)
        self._taking: window.Taking | None = None
        self._taking_cpu = 0.0  # the CPU time it took so far
        #: ranks read at a call when a window is read in parts (:data:`EVAL_PART_RANKS`)
        self.part_ranks = EVAL_PART_RANKS
        self._findings: list[EpisodeDict] = []
        self.failures = 0  # evaluations that failed as a whole (logged once)
        self._withdrawn_for: JobExit | None = None  # the job exit already acted on

    # ---- frames and time ----------------------------------------------------------------

    def apply(self, frame: wire.Frame, t_hub: float, history: bool = True, *,
              peer: RankState | None = None) -> RankState | None:
        """One frame, received (or recorded) at hub time ``t_hub``; raises
        :class:`~rtop.run.state.ProtocolError` for a frame that breaks the protocol.
        ``peer``: the rank the frame's connection speaks for (see ``RunState.apply``)."""
        return self.state.apply(frame, t_hub, history, peer=peer)

    def advance(self, t: float, *, force: bool = False, diagnose: bool = True,
                share: float | None = None) -> Evaluation | None:
        """Time has come to ``t``: when an evaluation is due (every
        :data:`EVAL_EVERY_S`, or ``force``), mark silent ranks lost and run the
        diagnosis (unless ``diagnose`` is False); returns what changed, or None when
        nothing was due (or ``t`` is no time: inf, nan). Never raises: a detector that
        fails costs its own finding (``Analyzer.errors``), anything else this one
        evaluation (both logged once).

        ``share`` (the live hub's: :data:`EVAL_SHARE`): the share of a core the
        diagnosis may take on average. The diagnosis then runs every
        :attr:`eval_every_s`: :data:`EVAL_EVERY_S` while an evaluation costs less than
        ``share`` of it, else as long as its CPU time (the lesser of the last two) over
        ``share``, at most
        :data:`EVAL_MOST_EVERY_S`; silent ranks are still marked lost every
        :data:`EVAL_EVERY_S`. Without it (a replay, a report: their time is not the
        hub's) every evaluation diagnoses. With it, the window of more than
        :attr:`part_ranks` ranks is read that many at a call, the long memory fit at
        the next, the findings come at the call after that (each call does a part, due
        or not; the evaluation's time is when it began).
        """
        if not math.isfinite(t):
            return None
        if self._taking is not None:
            if force or share is None or not diagnose:
                self._taking = None  # one whole evaluation now instead
            else:
                done = self._go_on(self._taking, share)
                if done is not None:
                    return done
        if not force and self._next_eval - EVAL_EVERY_S <= t < self._next_eval:
            return None  # not due yet (a clock that went backwards is due at once)
        self._next_eval = t + EVAL_EVERY_S
        out = Evaluation(t, lost=self.state.tick(t))
        if self.analyzer is None or not diagnose or self._taking is not None:
            return out
        if not force and share is not None and \
                self._next_diagnosis - self.eval_every_s <= t < self._next_diagnosis:
            return out  # the diagnosis is not due yet: it costs more than its share
        cpu = time.thread_time()
        if not force and share is not None and len(self.state.active_ranks()) > \
                self.part_ranks:
            try:  # thousands of ranks: the first part now, the others at the next calls
                self._taking = self.analyzer.begin(self.state, t)
                self._taking.step(self.part_ranks)
            except Exception:
                self._taking = None
                self._failed()
            self._taking_cpu = time.thread_time() - cpu
            return out
        return self._diagnose(out, None, share, cpu)

    def _go_on(self, taking: window.Taking, share: float) -> Evaluation | None:
        """The next part of the evaluation under way: the next ranks' windows, or, once
        all are read, its findings (the evaluation, returned)."""
        cpu = time.thread_time()
        if not taking.complete:
            try:
                taking.step(self.part_ranks)
            except Exception:
                self._taking = None
                self._failed()
            self._taking_cpu += time.thread_time() - cpu
            return None
        self._taking = None
        return self._diagnose(Evaluation(taking.t), taking, share, cpu - self._taking_cpu)

    def _diagnose(self, out: Evaluation, taking: window.Taking | None, share: float | None,
                  cpu: float) -> Evaluation:
        """Run the diagnosis as of ``out.t`` (on ``taking``'s window when given) and say
        in ``out`` what it changed; ``cpu``: the thread's CPU time when it began (for
        the pace, with a ``share``)."""
        assert self.analyzer is not None
        before = set(self.analyzer.active)
        try:
            self._findings = self.analyzer.update(self.state, out.t, taking)
            out.withdrawn = self._withdraw_ended()
        except Exception:
            self._failed()
            return out
        finally:
            if share is not None:
                self._pace(time.thread_time() - cpu, share, out.t)
        out.started = [f for f in self._findings if f["kind"] not in before]
        out.cleared = [kind for kind in before if kind not in self.analyzer.active
                       and kind not in out.withdrawn]
        return out

    def _failed(self) -> None:
        """An evaluation failed as a whole: counted, logged once."""
        self.failures += 1
        if self.failures == 1:
            log.exception("rtop: the diagnosis failed; the findings stay as they were "
                          "until it works again (logged once)")

    def _pace(self, cost_s: float, share: float, t: float) -> None:
        """The next diagnosis' time, after one that took ``cost_s`` of CPU at ``t``
        (see :meth:`advance`): the cost taken is the lesser of the last two evaluations'
        (one dear evaluation, a first import or a collection, does not slow the next;
        a larger job does from its second evaluation on)."""
        self._costs.append(cost_s)
        cost = min(self._costs) if len(self._costs) > 1 else 0.0
        every = min(EVAL_MOST_EVERY_S, max(EVAL_EVERY_S, cost / max(share, 1e-9)))
        self.eval_every_s = every
        self._next_diagnosis = t + every

    def _withdraw_ended(self) -> list[str]:
        """Once per job exit: withdraw the ``lost_rank`` finding that only ranks the
        command's exit 0 ended made; the kinds withdrawn."""
        ended = self.state.job_exit
        if ended is None or ended is self._withdrawn_for or self.analyzer is None:
            return []
        self._withdrawn_for = ended
        if not ended.ended or ended.since is None:
            return []
        had = len(self.analyzer.episodes)
        self._findings = self.analyzer.withdraw("lost_rank", set(ended.ended), ended.since)
        return ["lost_rank"] if len(self.analyzer.episodes) < had else []

    # ---- what viewers see ---------------------------------------------------------------

    @property
    def findings(self) -> list[EpisodeDict]:
        """The active findings, worst first, as of the last evaluation."""
        return self._findings

    @property
    def overview(self) -> Overview:
        """Fabric and scaling figures of the last evaluation (empty before the first)."""
        return self.analyzer.overview if self.analyzer is not None else {}

    def snapshot(self, *, hub: HubInfo | None = None, replay: ReplayInfo | None = None,
                 recent: int | None = None) -> Snapshot:
        """What a viewer draws: the state's columns, the findings and the overview, and
        where they come from (a live hub's address and counters, or a replay)."""
        view = self.state.view(recent)
        snap = Snapshot(
            t_hub=view["t_hub"], run=view["run"], ranks=view["ranks"], nodes=view["nodes"],
            build_s=view["build_s"], findings=self._findings,
            analysis_s=self.analyzer.last_eval_s if self.analyzer is not None else None,
            overview=self.overview,
            links=self._links(),
            hub=hub if hub is not None else HubInfo(address=None, counters={}, record=None),
        )
        if replay is not None:
            snap["replay"] = replay
        return snap

    def _links(self) -> LinksView | None:
        """The latest link probe with the diagnosis' verdict on each link."""
        stored = self.state.links
        if stored is None:
            return None
        return links_view(stored, self.analyzer.cfg if self.analyzer is not None
                          else AnalysisConfig())

    def rank_detail(self, rank: int) -> RankDetail:
        """One rank of the current attempt in full (see ``RunState.rank_detail``), with
        the hiccups the diagnosis counted for it."""
        detail = self.state.rank_detail(rank)
        att = self.state.current
        if detail["found"] and self.analyzer is not None and att is not None:
            detail["hiccups"] = self.analyzer.hiccups.of(att.number, rank)
        return detail
