"""Diagnosis: pure functions from a window of run state to findings.

Each finding names its ``kind`` (starved_rank, input_bound, straggler, slow_link,
low_scaling_efficiency, memory_wall, gpu_throttled, hung_rank, lost_rank,
checkpoint_interval), the ``ranks`` concerned, a ``severity``, a one- or two-sentence
``summary``, the ``evidence`` (the numbers behind it) and the usual ``fix``. Thresholds
live in :class:`AnalysisConfig`.
"""

from __future__ import annotations

from typing import Any

from rtop.analysis.config import AnalysisConfig
from rtop.analysis.engine import ALL_KINDS, RANK_FAULTS, Analyzer, evaluate, order
from rtop.hub.state import RunState

__all__ = ["ALL_KINDS", "RANK_FAULTS", "AnalysisConfig", "Analyzer", "analyze_state",
           "evaluate", "order"]


def analyze_state(state: RunState) -> list[dict[str, Any]]:
    """The active findings of a live run state (an :class:`Analyzer` rides along on the
    state, so onset and clear work across calls)."""
    analyzer = getattr(state, "_analyzer", None)
    if analyzer is None:
        analyzer = Analyzer()
        state._analyzer = analyzer  # type: ignore[attr-defined]
    return analyzer.update(state)
