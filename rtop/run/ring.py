"""Per-rank rolling windows in one preallocated array, reducible for all ranks at once.

A :class:`Rings` holds, for a fixed tuple of fields, a float32 array of shape
``(rank slots, window, fields)``. Each rank owns a slot and writes rows at its own
position, wrapping around; appending one row is a single array store. Reading the last
``k`` rows of every rank is one fancy index, and their medians one sort. Missing values
are NaN. ``t_wall`` is stored relative to a base time (float32 keeps milliseconds over
a day of training); ``history`` gives it back absolute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class Rings:
    """Bounded per-slot histories of ``fields`` (see module doc)."""

    def __init__(self, fields: Sequence[str], window: int, slots: int = 64) -> None:
        self.fields = tuple(fields)
        self.index = {f: i for i, f in enumerate(self.fields)}
        self.window = window
        self.data = np.full((slots, window, len(self.fields)), np.nan, dtype=np.float32)
        self.pos = np.zeros(slots, dtype=np.int64)  # next write position per slot
        self.count = np.zeros(slots, dtype=np.int64)  # rows written, at most ``window``
        self._t = self.index.get("t_wall")
        self.base: float | None = None

    @property
    def slots(self) -> int:
        """Number of rank slots allocated."""
        return int(self.pos.shape[0])

    def ensure(self, slots: int) -> None:
        """Grow to at least ``slots`` slots (by a quarter at a time), keeping the data."""
        have = self.slots
        if slots <= have:
            return
        new = max(slots, have + max(64, have // 4))
        grown = np.full((new, self.window, len(self.fields)), np.nan, dtype=np.float32)
        grown[:have] = self.data
        self.data = grown
        self.pos = np.concatenate([self.pos, np.zeros(new - have, dtype=np.int64)])
        self.count = np.concatenate([self.count, np.zeros(new - have, dtype=np.int64)])

    def clear(self, slot: int) -> None:
        """Forget a slot's history (it is about to be reused)."""
        self.data[slot] = np.nan
        self.pos[slot] = 0
        self.count[slot] = 0

    def append(self, slot: int, row: list[float]) -> None:
        """Append one row (``len(fields)`` floats, NaN for missing)."""
        if self._t is not None:
            t = row[self._t]
            if not math.isnan(t):
                if self.base is None:
                    self.base = t
                row[self._t] = t - self.base
        p = int(self.pos[slot])
        self.data[slot, p] = row
        self.pos[slot] = (p + 1) % self.window
        if self.count[slot] < self.window:
            self.count[slot] += 1

    def last(self, slots: np.ndarray, k: int, fields: list[str] | None = None) -> np.ndarray:
        """The last ``k`` rows of each of ``slots``: ``(len(slots), k, fields)``, oldest
        first, NaN where a slot has fewer rows; only the named ``fields`` if given."""
        k = max(1, min(k, self.window))
        offsets = np.arange(-k, 0)
        idx = (self.pos[slots][:, None] + offsets[None, :]) % self.window
        if fields is None:
            values: np.ndarray = self.data[slots[:, None], idx]
        else:
            cols = np.array([self.index[f] for f in fields])
            values = self.data[slots[:, None, None], idx[:, :, None], cols[None, None, :]]
        short = self.count[slots][:, None] < -offsets[None, :]
        if short.any():
            values[short] = np.nan
        return values

    def history(self, field: str, slot: int) -> np.ndarray:
        """Every stored value of ``field`` for one slot, oldest first (float64)."""
        n = int(self.count[slot])
        if not n:
            return np.empty(0)
        out = self.last(np.array([slot]), n)[0, :, self.index[field]].astype(np.float64)
        if field == "t_wall" and self.base is not None:
            out += self.base
        return out

    def nbytes(self) -> int:
        """Memory held by the arrays."""
        return int(self.data.nbytes + self.pos.nbytes + self.count.nbytes)


def nanmedian_rows(values: np.ndarray) -> np.ndarray:
    """Median over axis 1 of a ``(n, k, f)`` array, ignoring NaN: ``(n, f)`` float64.

    One sort (NaN sorts last) and a gather: several times faster than ``np.nanmedian``
    on thousands of short windows.
    """
    n, k, f = values.shape
    if n == 0:
        return np.empty((0, f))
    srt = np.sort(values, axis=1)
    valid = (~np.isnan(srt)).sum(axis=1)  # (n, f)
    lo = np.clip((valid - 1) // 2, 0, k - 1)
    hi = np.clip(valid // 2, 0, k - 1)
    a = np.take_along_axis(srt, lo[:, None, :], axis=1)[:, 0, :].astype(np.float64)
    b = np.take_along_axis(srt, hi[:, None, :], axis=1)[:, 0, :].astype(np.float64)
    med = (a + b) / 2.0
    med[valid == 0] = np.nan
    return med
