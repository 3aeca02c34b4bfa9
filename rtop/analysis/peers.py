"""Judging a rank against its peers and over time: what the detectors share so that a
fleet of thousands of noisy ranks yields faults, not noise (``STYLE.md``: compare a rank
with the median and MAD of its peers, require persistence, name a shared condition
once).

* :func:`baseline`: for each rank, the median of the *other* ranks' figure and their
  robust spread (1.4826 x the median absolute deviation: the standard deviation, for
  normal noise, that one outlier cannot inflate). With two ranks the median of all of
  them would be half the culprit's own figure; the others' median is not. Given peer
  classes (``rtop.analysis.roles``: the pipeline stages), the other ranks are those of
  the rank's own class: stage 3 is not slow for computing more than stage 0.
* :func:`persistent`: whether a rank's condition held in enough of its recent steps
  (and in the newest): one file-system hiccup or garbage-collector pause is a step, a
  starved rank or a straggler is every step.
* :func:`whole_nodes`: which nodes a set of ranks covers entirely, so a finding names
  the node ("node-00017, its 8 ranks") rather than its ranks one by one.
"""

from __future__ import annotations

import numpy as np

#: 1.4826 x MAD estimates the standard deviation of normal noise.
MAD_SIGMA = 1.4826
#: Above this many ranks, leaving one out barely moves the median or the MAD: one
#: fleet-wide figure serves every rank.
LEAVE_ONE_OUT_MAX = 64


def baseline(values: np.ndarray, ok: np.ndarray, classes: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: the median of the other judged ranks' ``values`` (``ok``) and their
    robust spread (``MAD_SIGMA`` x MAD), the others being those of the rank's own peer
    class when ``classes`` are given. NaN where fewer than one other rank has a figure;
    the spread is 0 with fewer than three."""
    if classes is None:
        return _baseline(values, ok)
    center = np.full(len(values), np.nan)
    spread = np.full(len(values), np.nan)
    for c in np.unique(classes).tolist():
        mine = classes == c
        center[mine], spread[mine] = _baseline(values[mine], ok[mine])
    return center, spread


def _baseline(values: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = len(values)
    center = np.full(n, np.nan)
    spread = np.full(n, np.nan)
    judged = np.where(ok, values, np.nan)
    have = ~np.isnan(judged)
    if have.sum() < 1 or n < 2:
        return center, spread
    if n > LEAVE_ONE_OUT_MAX:
        vals = judged[have]
        med = float(np.median(vals))
        mad = float(np.median(np.abs(vals - med))) if len(vals) >= 3 else 0.0
        center[:] = med
        spread[:] = MAD_SIGMA * mad
        return center, spread
    for i in range(n):
        rest = np.delete(judged, i)
        rest = rest[~np.isnan(rest)]
        if not len(rest):
            continue
        med = float(np.median(rest))
        center[i] = med
        spread[i] = MAD_SIGMA * float(np.median(np.abs(rest - med))) if len(rest) >= 3 \
            else 0.0
    return center, spread


def newest(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per rank: its newest valid value of ``values`` (``(n, k)``, oldest first); NaN
    where it has none."""
    n, k = values.shape
    if n == 0 or k == 0:
        return np.full(n, np.nan)
    last = k - 1 - np.argmax(valid[:, ::-1], axis=1)
    out: np.ndarray = np.where(valid.any(axis=1), values[np.arange(n), last], np.nan)
    return out


def persistent(anomalous: np.ndarray, valid: np.ndarray, min_steps: int, fraction: float,
               newest: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: whether its condition (``anomalous``, ``(n, k)`` over its recent steps,
    oldest first) held in at least ``min_steps`` and ``fraction`` of its ``valid`` steps
    (and, with ``newest``, in its newest one), and the share of them it held in."""
    held = (anomalous & valid).sum(axis=1)
    count = valid.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(count > 0, held / np.maximum(count, 1), 0.0)
    need = np.maximum(min_steps, np.ceil(fraction * count - 1e-9))
    ok = (count > 0) & (held >= need)
    if newest and anomalous.shape[1]:
        # the newest valid step of each rank
        last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
        ok &= anomalous[np.arange(len(last)), last]
    return ok, share


def slow_stretch_s(slow: np.ndarray, valid: np.ndarray, seconds: np.ndarray,
                   break_steps: int) -> np.ndarray:
    """Per rank: how long its slow steps (``slow``, ``(n, L)``, oldest first) last
    together, counted back from its newest step to where ``break_steps`` valid steps in
    a row were not slow (a step now and then at its peers' pace does not end a
    straggler's stretch; a run of them does: what came before was another episode, a
    checkpoint's contention, say). ``seconds``: each step's duration."""
    n, k = slow.shape
    if n == 0 or k == 0:
        return np.zeros(n)
    fast = valid & ~slow
    b = max(1, break_steps)
    run = fast.copy()  # run[:, j]: steps j-b+1 .. j were all valid and not slow
    for d in range(1, b):
        run[:, d:] &= fast[:, :-d]
        run[:, :d] = False
    cols = np.arange(k)
    last_break = np.where(run, cols[None, :], -1).max(axis=1)
    after = cols[None, :] > last_break[:, None]
    lasted: np.ndarray = np.where(slow & valid & after, np.nan_to_num(seconds),
                                  0.0).sum(axis=1)
    return lasted


def settling(values: np.ndarray, valid: np.ndarray, center: np.ndarray,
             ratio: float) -> np.ndarray:
    """Per rank: whether its excess over ``center`` shrank from its second newest valid
    step to its newest below ``ratio`` of what it was: a queue catching up after one
    stall (a file-system hiccup that spilled into the next step), not a steady excess."""
    n, k = values.shape
    if k < 2 or n == 0:
        return np.zeros(n, dtype=bool)
    rows = np.arange(n)
    newest = k - 1 - np.argmax(valid[:, ::-1], axis=1)
    earlier = valid.copy()
    earlier[rows, newest] = False
    has_prev = earlier.any(axis=1) & valid.any(axis=1)
    prev = k - 1 - np.argmax(earlier[:, ::-1], axis=1)
    c = np.where(np.isnan(center), 0.0, center)
    now_x = values[rows, newest] - c
    prev_x = values[rows, prev] - c
    with np.errstate(invalid="ignore"):
        shrank: np.ndarray = has_prev & (prev_x > 0) & (now_x < ratio * prev_x)
    return shrank


def whole_nodes(node_of: np.ndarray, node_names: list[str], flagged: list[int],
                min_ranks: int = 2) -> dict[str, list[int]]:
    """The nodes (by name) whose every rank, at least ``min_ranks`` of them, is among
    ``flagged`` (indices into the window), each with those indices."""
    if not flagged:
        return {}
    counts = np.bincount(node_of, minlength=len(node_names))
    hit = np.bincount(node_of[np.array(flagged)], minlength=len(node_names))
    whole = np.flatnonzero((hit == counts) & (counts >= min_ranks)).tolist()
    mine = set(flagged)
    return {node_names[j]: [i for i in np.flatnonzero(node_of == j).tolist() if i in mine]
            for j in whole}


def limit_above(center: np.ndarray, spread: np.ndarray, ratio: float | np.ndarray,
                z: float | np.ndarray, floor: float) -> np.ndarray:
    """Where a high figure starts to stand out from its peers: at least ``ratio`` times
    their median, ``z`` robust spreads above it, and ``floor``."""
    c = np.where(np.isnan(center), 0.0, center)
    s = np.where(np.isnan(spread), 0.0, spread)
    return np.maximum(np.maximum(ratio * c, c + z * s), floor)
