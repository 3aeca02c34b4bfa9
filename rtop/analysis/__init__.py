"""Diagnosis: pure functions from a window of run state to findings.

Each finding names its ``kind`` (see :mod:`rtop.analysis.kinds`: starved_rank,
input_bound, straggler, slow_link, low_scaling_efficiency, memory_wall, gpu_throttled,
hung_rank, lost_rank, checkpoint_interval), the ``ranks`` concerned, a ``severity``, a
one- or two-sentence ``summary``, the ``evidence`` (the numbers behind it) and the usual
``fix``. The detectors (:mod:`~rtop.analysis.detectors`) decide, with every threshold a
field of :class:`AnalysisConfig`; :mod:`~rtop.analysis.wording` writes the summary and
fix from the evidence; :class:`Monitor` runs the diagnosis over a run on the cadence the
live hub, replay and reports share.
"""

from __future__ import annotations

from rtop.analysis.config import AnalysisConfig
from rtop.analysis.engine import Analyzer, evaluate, order
from rtop.analysis.kinds import ALL_KINDS, KINDS, RANK_FAULTS
from rtop.analysis.monitor import Monitor

__all__ = ["ALL_KINDS", "KINDS", "RANK_FAULTS", "AnalysisConfig", "Analyzer", "Monitor",
           "evaluate", "order"]
