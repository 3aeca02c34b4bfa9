"""Columnar ring buffers: bounded per-rank histories that numpy can reduce at once.

A :class:`Rings` holds, for a fixed set of fields, a 2-D array per field of shape
``(rank slots, window)``. Each rank owns one slot (a row) and writes its values at its
own position, wrapping around. Reading the last ``k`` values of every rank is one
fancy-index per field, so medians over 4,096 ranks are a single ``nanmedian`` call.
Missing values are NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Rings:
    """Per-slot ring buffers for ``fields`` (float32, except ``t_wall``: float64)."""

    def __init__(self, fields: Sequence[str], window: int, slots: int = 64) -> None:
        self.fields = tuple(fields)
        self.window = window
        self._dtypes = {f: (np.float64 if f in ("t_wall", "step") else np.float32)
                        for f in self.fields}
        self.cols: dict[str, np.ndarray] = {
            f: np.full((slots, window), np.nan, dtype=self._dtypes[f]) for f in self.fields
        }
        self.pos = np.zeros(slots, dtype=np.int64)  # next write position per slot
        self.count = np.zeros(slots, dtype=np.int64)  # values written (saturates at window)

    @property
    def slots(self) -> int:
        """Number of rank slots currently allocated."""
        return int(self.pos.shape[0])

    def ensure(self, slots: int) -> None:
        """Grow to at least ``slots`` slots (doubling), keeping what is stored."""
        have = self.slots
        if slots <= have:
            return
        new = max(slots, have * 2)
        for f, col in self.cols.items():
            grown = np.full((new, self.window), np.nan, dtype=col.dtype)
            grown[:have] = col
            self.cols[f] = grown
        self.pos = np.concatenate([self.pos, np.zeros(new - have, dtype=np.int64)])
        self.count = np.concatenate([self.count, np.zeros(new - have, dtype=np.int64)])

    def clear(self, slot: int) -> None:
        """Forget a slot's history (the slot is about to be reused)."""
        for col in self.cols.values():
            col[slot] = np.nan
        self.pos[slot] = 0
        self.count[slot] = 0

    def append_rows(self, slot: int, rows: np.ndarray) -> None:
        """Append rows (``n x len(fields)``, NaN for missing) to one slot's history."""
        n = rows.shape[0]
        if n == 0:
            return
        if n > self.window:
            rows = rows[-self.window:]
            n = self.window
        start = int(self.pos[slot])
        idx = (start + np.arange(n)) % self.window
        for j, f in enumerate(self.fields):
            self.cols[f][slot, idx] = rows[:, j]
        self.pos[slot] = (start + n) % self.window
        self.count[slot] = min(int(self.count[slot]) + n, self.window)

    def last(self, field: str, slots: np.ndarray, k: int) -> np.ndarray:
        """The last ``k`` values of ``field`` for each of ``slots`` (``len(slots) x k``,
        oldest first; NaN where a slot has fewer than ``k``)."""
        k = max(1, min(k, self.window))
        offsets = np.arange(-k, 0)
        idx = (self.pos[slots][:, None] + offsets[None, :]) % self.window
        values = np.take_along_axis(self.cols[field][slots], idx, axis=1)
        short = self.count[slots][:, None] < (-offsets[None, :])
        if short.any():
            values = values.astype(np.float64, copy=True)
            values[short] = np.nan
        return values

    def history(self, field: str, slot: int) -> np.ndarray:
        """All stored values of ``field`` for one slot, oldest first."""
        n = int(self.count[slot])
        return self.last(field, np.array([slot]), n)[0] if n else np.empty(0)

    def nbytes(self) -> int:
        """Memory held by the arrays."""
        return sum(col.nbytes for col in self.cols.values()) + self.pos.nbytes * 2
