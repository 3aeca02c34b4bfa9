"""Hiccups: steps where a rank stood out from its peers but not for long enough to be a
fault.

A rank whose data wait (or compute) is above its peers' limit in one or two steps, a
file-system hiccup or a GC pause, is no starved rank and no straggler: the detectors
need the condition held (``persist_min_steps``, ``starved_min_fraction``). Those steps
are still worth knowing (a rank with a hiccup every minute has a flaky disk), so each
evaluation hands the detectors' per-step masks of transient steps here, and
:class:`HiccupCounter` counts each step once per rank over the run. The rank's detail
(the UI's detail pane, ``rtop report``) shows the counts; no finding is raised.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from rtop.run.state import RankState

#: What a hiccup can be: the detectors' names for their per-step masks.
HICCUP_KINDS: Final = ("data_wait", "compute")


class HiccupCounter:
    """Per rank (of each attempt), how many transient steps of each kind it had."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], dict[str, int]] = {}
        # per (attempt, rank, kind): the newest step time already counted
        self._seen: dict[tuple[int, int, str], float] = {}

    def count(self, ranks: list[RankState], step_t: np.ndarray,
              masks: dict[str, np.ndarray]) -> None:
        """Count the steps each mask marks (``(n, k)``, aligned with ``ranks`` and the
        recent steps' times ``step_t``), each step once."""
        for kind, mask in masks.items():
            if mask.shape != step_t.shape:
                continue
            for i in np.flatnonzero(mask.any(axis=1)).tolist():
                rs = ranks[i]
                key = (rs.attempt, rs.rank, kind)
                times = step_t[i][mask[i]]
                last = self._seen.get(key, -np.inf)
                new = int((times > last).sum())
                if new:
                    row = self._counts.setdefault((rs.attempt, rs.rank), {})
                    row[kind] = row.get(kind, 0) + new
                    self._seen[key] = float(times.max())

    def of(self, attempt: int, rank: int) -> dict[str, int]:
        """One rank's counts (every kind, 0 where none)."""
        row = self._counts.get((attempt, rank), {})
        return {k: row.get(k, 0) for k in HICCUP_KINDS}

    def total(self) -> int:
        """Every hiccup counted, every rank."""
        return sum(sum(row.values()) for row in self._counts.values())
