"""The fleet view's data, without widgets: a view's fleet decoded, each cell's band, and
where each rank (or node, folded) sits on screen.

The map is laid out by node and local rank: a line holds one or more whole nodes side by
side, a node's ranks in local-rank order, so that a slow node is a bar, a slow rack
(consecutive nodes) a block of lines, and a slow local-rank position the same column of
every node. When the ranks do not fit the screen, each cell is a node instead (its worst
rank), eight nodes to a group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np

from rtop.analysis.viewport import HEAT, HEAT_BY_NAME, NOT_MEASURED, HeatFigure, decode
from rtop.run.snapshot import (
    STATUSES,
    FigureStats,
    JobTotals,
    Outlier,
    PageView,
    Snapshot,
)

#: Deviation bands (hundredths of the median, worse than it) and each one's glyph: the
#: shape reads without colour (``NO_COLOR``).
BAND_FROM: Final = (4, 8, 15, 25)
GLYPHS: Final = ("·", "░", "▒", "▓", "█")
#: What a cell shows when its rank is down (lost, failed), done (finished, exited,
#: ended), or did not measure the figure.
DOWN_GLYPH, DONE_GLYPH, NONE_GLYPH = "×", "-", " "
#: Band codes beyond the five: better than the median by at least the first band, down,
#: done, not measured (the widget styles each code).
BETTER, DOWN, DONE, NONE = 5, 6, 7, 8
#: Each code's glyph.
CODE_GLYPHS: Final = (*GLYPHS, GLYPHS[0], DOWN_GLYPH, DONE_GLYPH, NONE_GLYPH)
_DOWN_CODES: Final = tuple(i for i, s in enumerate(STATUSES) if s in ("lost", "failed"))
_ACTIVE_CODE: Final = STATUSES.index("active")

Fold = Literal["auto", "ranks", "nodes"]
#: Nodes of a folded line are grouped by this many (a space between groups).
GROUP: Final = 8
#: Columns a node may take unfolded (a wider node is folded).
MAX_PLACES: Final = 64


def bands(q: np.ndarray, status: np.ndarray) -> np.ndarray:
    """Each cell's code (0-4 the bands, then BETTER, DOWN, DONE, NONE) from its heat byte
    and its rank's status."""
    code = np.searchsorted(np.array(BAND_FROM), q.astype(np.int16), side="right")
    code = np.where(q <= -BAND_FROM[1], BETTER, code)
    code = np.where(q == NOT_MEASURED, NONE, code)
    code = np.where(np.isin(status, _DOWN_CODES), DOWN, code)
    done = (status != _ACTIVE_CODE) & ~np.isin(status, _DOWN_CODES)
    return np.where(done, DONE, code).astype(np.int8)


def fmt_dev(q: int | float | None, h: HeatFigure) -> str:
    """A deviation as the map measures it: ``+35%`` of a step, ``-3%`` of the median
    clock, ``+12 pt`` of headroom ("n/a" if not measured)."""
    if q is None or (isinstance(q, float) and math.isnan(q)) or q == NOT_MEASURED:
        return "n/a"
    v = float(q)
    if h.per == "points":
        return f"{v:+.0f} pt"
    return f"{v:+.0f}%"


@dataclass
class FleetData:
    """A view's fleet, decoded: per rank (in rank order) its rank, node, place, status
    and heat per figure; per node its worst and median heat; and the aggregates."""

    ranks: np.ndarray
    node_of: np.ndarray
    local: np.ndarray
    status: np.ndarray
    heat: np.ndarray  # figures x ranks
    node_worst: np.ndarray  # figures x nodes
    node_median: np.ndarray
    nodes: list[str]
    figures: list[str]
    stats: list[FigureStats]
    outliers: list[Outlier]
    job: JobTotals
    pages: dict[str, PageView]
    partial: bool

    @classmethod
    def of(cls, snap: Snapshot) -> FleetData | None:
        """The fleet of a view's snapshot (None if it has none, or one that does not
        hold together)."""
        fleet = snap.get("fleet")
        if fleet is None:
            return None
        try:
            a = decode(fleet)
        except (ValueError, KeyError, TypeError):
            return None
        return cls(a["order"], a["node_of"], a["local"], a["status"], a["heat"],
                   a["node_worst"], a["node_median"], list(fleet["nodes"]),
                   list(fleet["figures"]), list(fleet["stats"]), list(fleet["outliers"]),
                   fleet["job"], dict(fleet["pages"]), bool(fleet["partial"]))

    @property
    def n(self) -> int:
        """Ranks in the fleet."""
        return len(self.ranks)

    def figure(self, i: int) -> HeatFigure:
        """The i-th heat figure (the table's, if the hub sent one this UI does not know)."""
        return HEAT_BY_NAME.get(self.figures[i], HEAT[0]) if self.figures else HEAT[0]

    def rank_codes(self, fig: int) -> np.ndarray:
        """Each rank's cell code for figure ``fig``."""
        return bands(self.heat[fig], self.status)

    def node_codes(self, fig: int) -> np.ndarray:
        """Each node's cell code for figure ``fig``: its worst rank's band; DOWN if any
        of its ranks is down, DONE if none is active."""
        nn = len(self.nodes)
        down = np.zeros(nn, dtype=bool)
        active = np.zeros(nn, dtype=bool)
        if self.n:
            np.logical_or.at(down, self.node_of, np.isin(self.status, _DOWN_CODES))
            np.logical_or.at(active, self.node_of, self.status == _ACTIVE_CODE)
        code = bands(self.node_worst[fig], np.full(nn, _ACTIVE_CODE, dtype=np.uint8))
        code = np.where(~active, DONE, code)
        return np.where(down, DOWN, code).astype(np.int8)

    def node_ranks(self, node: int) -> np.ndarray:
        """The indices of a node's ranks, in local-rank order."""
        idx = np.flatnonzero(self.node_of == node)
        return idx[np.argsort(self.local[idx], kind="stable")]


@dataclass(frozen=True)
class Layout:
    """Where the cells sit: ``grid[line, x]`` is the item (a rank's index, or a node's
    when ``folded``) drawn at cell ``x`` of that line, -1 for a gap; ``at[item]`` is its
    (line, x); ``label[line]`` the lowest rank on the line."""

    folded: bool
    grid: np.ndarray
    at: np.ndarray  # items x 2
    label: list[int]
    per_line: int  # nodes a line holds
    places: int  # cells a node takes unfolded

    @property
    def lines(self) -> int:
        """Lines of the map."""
        return int(self.grid.shape[0])

    @property
    def width(self) -> int:
        """Cells of the widest line."""
        return int(self.grid.shape[1])


def _counts(most: int) -> list[int]:
    """How many nodes (or groups of them) a line may hold, up to ``most``: 1, 2, 4, then
    multiples of 4 (racks line up in columns)."""
    return [c for c in (1, 2, *range(4, most + 1, 4)) if c <= most]


def layout(data: FleetData, width: int, height: int, fold: Fold = "auto") -> Layout:
    """The map of ``data`` in ``width`` x ``height`` cells (after the line's label):
    every rank while they fit (``fold="ranks"``: always), else every node. A line holds
    1, 2, 4 or a multiple of 4 nodes (groups of nodes, folded): as few as fill the
    height."""
    nn = max(1, len(data.nodes))
    places = int(data.local.max()) + 1 if data.n else 1
    width, height = max(1, width), max(1, height)
    fit = (width + 1) // (places + 1)
    most = max(_counts(fit)) if fit >= 1 else 0
    ranks_fit = places <= MAX_PLACES and most > 0
    unfold = ranks_fit and (fold == "ranks" or (fold == "auto"
                                                and math.ceil(nn / most) <= height))
    first = _first_ranks(data, nn)
    if unfold:
        per_line = _fill(nn, most, height)
        lines = math.ceil(nn / per_line)
        grid = np.full((lines, per_line * (places + 1) - 1), -1, dtype=np.int64)
        line = data.node_of // per_line
        x = (data.node_of % per_line) * (places + 1) + data.local
        grid[line, x] = np.arange(data.n)
        return Layout(False, grid, np.stack([line, x], axis=1),
                      [int(first[i * per_line]) for i in range(lines)], per_line, places)
    fit = (width + 1) // (GROUP + 1)
    most_groups = max(_counts(fit)) if fit >= 1 else 0
    if most_groups:
        groups = _fill(math.ceil(nn / GROUP), most_groups, height)
        per_line = groups * GROUP
    else:
        groups, per_line = 0, max(1, width)
    lines = math.ceil(nn / per_line)
    nodes = np.arange(len(data.nodes))
    line, within = nodes // per_line, nodes % per_line
    x = within + (within // GROUP if groups else 0)
    span = per_line + (groups - 1 if groups else 0)
    grid = np.full((lines, span), -1, dtype=np.int64)
    grid[line, x] = nodes
    return Layout(True, grid, np.stack([line, x], axis=1),
                  [int(first[i * per_line]) for i in range(lines)], per_line, places)


def _fill(items: int, most: int, height: int) -> int:
    """The fewest per line (of :func:`_counts`, at most ``most``) whose lines fit
    ``height``; ``most`` when none does."""
    return next((c for c in _counts(most) if math.ceil(items / c) <= height), most)


def _first_ranks(data: FleetData, nn: int) -> np.ndarray:
    """Each node's lowest rank (-1 for a node of no rank)."""
    first = np.full(nn, np.iinfo(np.int64).max, dtype=np.int64)
    if data.n:
        np.minimum.at(first, data.node_of, data.ranks)
    return np.where(first == np.iinfo(np.int64).max, -1, first)
