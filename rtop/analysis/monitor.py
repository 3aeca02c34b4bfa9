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

#: Seconds of the hub's time between two evaluations of the diagnosis.
EVAL_EVERY_S: Final = window.EVAL_EVERY_S

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

    def advance(self, t: float, *, force: bool = False, diagnose: bool = True
                ) -> Evaluation | None:
        """Time has come to ``t``: when an evaluation is due (every
        :data:`EVAL_EVERY_S`, or ``force``), mark silent ranks lost and run the
        diagnosis (unless ``diagnose`` is False); returns what changed, or None when
        nothing was due (or ``t`` is no time: inf, nan). Never raises: a detector that
        fails costs its own finding (``Analyzer.errors``), anything else this one
        evaluation (both logged once).
        """
        if not math.isfinite(t):
            return None
        if not force and self._next_eval - EVAL_EVERY_S <= t < self._next_eval:
            return None  # not due yet (a clock that went backwards is due at once)
        self._next_eval = t + EVAL_EVERY_S
        out = Evaluation(t, lost=self.state.tick(t))
        if self.analyzer is None or not diagnose:
            return out
        before = set(self.analyzer.active)
        try:
            self._findings = self.analyzer.update(self.state, t)
            out.withdrawn = self._withdraw_ended()
        except Exception:
            self.failures += 1
            if self.failures == 1:
                log.exception("rtop: the diagnosis failed; the findings stay as they were "
                              "until it works again (logged once)")
            return out
        out.started = [f for f in self._findings if f["kind"] not in before]
        out.cleared = [kind for kind in before if kind not in self.analyzer.active
                       and kind not in out.withdrawn]
        return out

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
