"""Per-rank rolling windows in a few large arrays, reducible for all ranks at once.

A :class:`Rings` holds, for a fixed tuple of fields, float32 blocks of shape
``(rank slots, window, fields)``. Each rank owns a slot and writes rows at its own
position, wrapping around; appending one row is a single array store. Reading the last
``k`` rows of every rank is one fancy index per block, and their medians one sort.
Missing values are NaN. ``t_wall`` is stored relative to a base time per slot, the
slot's first (float32 keeps milliseconds over a day of training; one rank's clock,
however wrong, cannot cost the others theirs); ``history`` gives it back absolute.

Slots are allocated as ranks arrive (:meth:`Rings.ensure`), a block at a time: 64
slots, 64 more, then blocks doubling up to :data:`MAX_BLOCK` slots. A new block is
added, never copied into a larger array, so growing costs the new memory only and the
hub never stalls on a copy of the windows it already holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import numpy as np

#: The first block's slots, and the largest block's.
FIRST_BLOCK: Final = 64
MAX_BLOCK: Final = 1024


class Rings:
    """Bounded per-slot histories of ``fields`` (see module doc)."""

    def __init__(self, fields: Sequence[str], window: int, slots: int = FIRST_BLOCK
                 ) -> None:
        self.fields = tuple(fields)
        self.index = {f: i for i, f in enumerate(self.fields)}
        self.window = window
        self.blocks: list[np.ndarray] = []
        self.starts: list[int] = []  # the first slot of each block
        # per slot, kept as Python values (one append touches a few of them: cheaper than
        # numpy scalars); :attr:`pos`, :attr:`count` and :attr:`base` are their arrays
        self._pos: list[int] = []  # next write position
        self._count: list[int] = []  # rows written, at most ``window``
        self._base: list[float] = []  # its first t_wall, NaN before
        self._rows: list[np.ndarray] = []  # its ``(window, fields)`` view in its block
        self._counters: tuple[np.ndarray, np.ndarray] | None = None  # pos, count arrays
        self._bases: np.ndarray | None = None
        self._t = self.index.get("t_wall")
        self.ensure(slots, slots)

    @property
    def slots(self) -> int:
        """Number of rank slots allocated."""
        return len(self._pos)

    @property
    def pos(self) -> np.ndarray:
        """Next write position per slot (int64)."""
        return self._arrays()[0]

    @property
    def count(self) -> np.ndarray:
        """Rows written per slot, at most ``window`` (int64)."""
        return self._arrays()[1]

    @property
    def base(self) -> np.ndarray:
        """Per slot, the ``t_wall`` its stored ones are relative to (NaN before its
        first)."""
        if self._bases is None:
            self._bases = np.array(self._base, dtype=np.float64)
        return self._bases

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """:attr:`pos` and :attr:`count` as arrays, made again after appends (once per
        read of all slots, not once per append)."""
        if self._counters is None:
            self._counters = (np.array(self._pos, dtype=np.int64),
                              np.array(self._count, dtype=np.int64))
        return self._counters

    def ensure(self, slots: int, most: int | None = None) -> None:
        """Grow to at least ``slots`` slots, a block at a time (see the module doc; no
        block past ``most`` slots in all when that is enough), keeping the data."""
        while self.slots < slots:
            have = self.slots
            size = FIRST_BLOCK if have < 2 * FIRST_BLOCK else min(have, MAX_BLOCK)
            if most is not None:
                size = min(size, most - have)
            size = max(size, 1)
            block = np.full((size, self.window, len(self.fields)), np.nan, dtype=np.float32)
            self.blocks.append(block)
            self.starts.append(have)
            self._pos += [0] * size
            self._count += [0] * size
            self._base += [math.nan] * size
            self._rows += list(block)
            self._counters = self._bases = None

    def clear(self, slot: int) -> None:
        """Forget a slot's history (it is about to be reused)."""
        self._rows[slot][:] = np.nan
        self._pos[slot] = 0
        self._count[slot] = 0
        self._base[slot] = math.nan
        self._counters = self._bases = None

    def append(self, slot: int, row: Sequence[float | None]) -> None:
        """Append one row (``len(fields)`` numbers; None or NaN for missing). A list's
        ``t_wall`` is made relative to the slot's base in place."""
        t_at = self._t
        if t_at is not None:
            t = row[t_at]
            if t is not None and not math.isnan(t):
                base = self._base[slot]
                if math.isnan(base):
                    self._base[slot] = base = float(t)
                    self._bases = None
                if type(row) is not list:
                    row = list(row)
                row[t_at] = t - base
        p = self._pos[slot]
        self._rows[slot][p] = row  # None is NaN in a float array
        self._pos[slot] = p + 1 if p + 1 < self.window else 0
        if self._count[slot] < self.window:
            self._count[slot] += 1
        self._counters = None

    def last(self, slots: np.ndarray, k: int, fields: list[str] | None = None) -> np.ndarray:
        """The last ``k`` rows of each of ``slots``: ``(len(slots), k, fields)``, oldest
        first, NaN where a slot has fewer rows; only the named ``fields`` if given."""
        k = max(1, min(k, self.window))
        offsets = np.arange(-k, 0)
        idx = (self.pos[slots][:, None] + offsets[None, :]) % self.window
        cols = None if fields is None else np.array([self.index[f] for f in fields],
                                                   dtype=np.int64)
        if len(self.blocks) == 1 or not len(slots):
            values = self._gather(self.blocks[0], slots, idx, cols)
        else:
            # one gather per block, over that block's slots (grouped by a stable sort)
            which = np.searchsorted(np.array(self.starts), slots, side="right") - 1
            order = np.argsort(which, kind="stable")
            bounds = np.searchsorted(which[order], np.arange(len(self.blocks) + 1))
            values = np.empty((len(slots), k, len(self.fields) if cols is None
                               else len(cols)), dtype=np.float32)
            for b in range(len(self.blocks)):
                lo, hi = int(bounds[b]), int(bounds[b + 1])
                if lo == hi:
                    continue
                sel = order[lo:hi]
                values[sel] = self._gather(self.blocks[b], slots[sel] - self.starts[b],
                                           idx[sel], cols)
        short = self.count[slots][:, None] < -offsets[None, :]
        if short.any():
            values[short] = np.nan
        return values

    @staticmethod
    def _gather(block: np.ndarray, local: np.ndarray, idx: np.ndarray,
                cols: np.ndarray | None) -> np.ndarray:
        """Rows ``idx`` (``(n, k)`` positions) of the slots ``local`` of ``block``:
        ``(n, k, fields)``, only ``cols`` if given. Whole rows are taken by their flat
        index (a few contiguous floats each: one ``take``), then the columns: several
        times cheaper than indexing the three axes at once."""
        n, k = idx.shape
        window, width = block.shape[1], block.shape[2]
        flat = (local[:, None] * window + idx).ravel()
        rows: np.ndarray = block.reshape(-1, width).take(flat, axis=0)
        if cols is not None:
            rows = rows[:, cols]
        return rows.reshape(n, k, rows.shape[1])

    def stored(self, slots: np.ndarray, field: str) -> np.ndarray:
        """Every value of ``field`` each of ``slots`` holds, in storage order (not time
        order): ``(len(slots), window)`` float32, NaN where a slot has fewer rows. For a
        statistic the order does not change (a quantile): no index per row to compute."""
        j = self.index[field]
        out = np.empty((len(slots), self.window), dtype=np.float32)
        which = np.searchsorted(np.array(self.starts), slots, side="right") - 1
        for b in np.unique(which).tolist():
            sel = which == b
            out[sel] = self.blocks[b][slots[sel] - self.starts[b], :, j]
        return out

    def history(self, field: str, slot: int) -> np.ndarray:
        """Every stored value of ``field`` for one slot, oldest first (float64)."""
        n = self._count[slot]
        if not n:
            return np.empty(0)
        out = self.last(np.array([slot]), n)[0, :, self.index[field]].astype(np.float64)
        if field == "t_wall" and not math.isnan(self._base[slot]):
            out += self._base[slot]
        return out

    def bases(self, slots: np.ndarray) -> np.ndarray:
        """The base time of each of ``slots`` (what their ``t_wall`` is relative to;
        0 for a slot with none yet)."""
        out: np.ndarray = np.nan_to_num(self.base[slots], nan=0.0)
        return out

    def nbytes(self) -> int:
        """Memory held by the arrays."""
        return int(sum(b.nbytes for b in self.blocks) + 3 * 8 * self.slots)


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


def nanquantile_rows(values: np.ndarray, q: float) -> np.ndarray:
    """The ``q`` quantile (0 to 1) of each row of a ``(n, k)`` array, ignoring NaN:
    ``(n,)`` float64, NaN for a row with no value. Linear between the two nearest values,
    as ``np.nanquantile``'s default, from one sort and a gather."""
    out: np.ndarray = nanquantiles_rows(values, (q,))[:, 0]
    return out


def nanquantiles_rows(values: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Several quantiles of each row of a ``(n, k)`` array from one sort, ignoring NaN:
    ``(n, len(qs))`` float64 (see :func:`nanquantile_rows`)."""
    n, k = values.shape
    if n == 0 or k == 0:
        return np.full((n, len(qs)), np.nan)
    srt = np.sort(values, axis=1)  # NaN sorts last
    valid = (~np.isnan(srt)).sum(axis=1)
    top = np.maximum(valid - 1, 0)
    out = np.empty((n, len(qs)))
    for j, q in enumerate(qs):
        pos = top * q
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, top)
        a = np.take_along_axis(srt, lo[:, None], axis=1)[:, 0].astype(np.float64)
        b = np.take_along_axis(srt, hi[:, None], axis=1)[:, 0].astype(np.float64)
        out[:, j] = a + (b - a) * (pos - lo)
    out[valid == 0] = np.nan
    return out
