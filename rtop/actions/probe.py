"""A link probe's result as text, for ``rtop probe``.

The result is what ``rtop probe --json`` prints (``rtop.analysis.links.assemble`` plus
the findings): ``{"ranks", "nodes", "matrix_Bps", "findings", "seconds", "nbytes",
"errors"}``, and ``"recheck"`` when links first found slow were measured again.
:func:`format_text` draws the matrix in GB/s grouped by node (``n/a``: not measured,
``!``: a slow link named by the finding), then the findings. Beyond
:data:`MAX_TABLE_RANKS` ranks the matrix is too wide for a terminal and the slowest
links are listed instead. Names come from the ranks: they are printed made safe
(:func:`rtop.fmt.safe_text`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rtop.fmt import NA, fmt_bytes, fmt_num, num, safe_text

#: Ranks up to which the whole matrix is printed.
MAX_TABLE_RANKS = 32
#: Links listed beyond that (the slowest).
MAX_LISTED = 20


def gbps(x: object) -> str:
    """Bytes per second as GB/s, three significant figures (``n/a`` when missing)."""
    return fmt_num(x, ".3g", 1e-9)


def format_text(result: Mapping[str, Any]) -> str:
    """The probe's matrix as a table grouped by node (GB/s; ``n/a`` not measured; ``!``
    a slow link), then its findings and the ranks that could not take part."""
    ranks = [r for r in result.get("ranks") or [] if isinstance(r, int)]
    nodes = [safe_text(str(x), 40) for x in result.get("nodes") or []]
    matrix: Sequence[Sequence[Any]] = result.get("matrix_Bps") or []
    findings = [f for f in result.get("findings") or [] if isinstance(f, Mapping)]
    n = len(ranks)
    if len(nodes) != n or len(matrix) != n:
        return "The probe's result is malformed: ranks, nodes and matrix do not match."
    slow = _slow_pairs(findings)
    cells = [[num(v) for v in row] for row in matrix]
    measured = sum(1 for i in range(n) for j in range(i + 1, n)
                   if j < len(cells[i]) and cells[i][j] is not None)
    lines = [f"Link probe: {n} rank{'s' if n != 1 else ''} on {len(set(nodes))} "
             f"node{'s' if len(set(nodes)) != 1 else ''}, {measured} of "
             f"{n * (n - 1) // 2} links measured, {fmt_bytes(result.get('nbytes'))} per "
             f"transfer, {fmt_num(result.get('seconds'), '.2f')} s "
             "(GB/s, the slower direction; n/a: not measured; !: slow)", ""]
    if n <= MAX_TABLE_RANKS:
        lines += _table(ranks, nodes, cells, slow)
    else:
        lines += _slowest(ranks, nodes, cells, slow)
    lines.append("")
    if findings:
        for f in findings:
            lines.append(f"{str(f.get('severity', '')).upper()} {f.get('kind')}: "
                         f"{safe_text(str(f.get('summary', '')), 2000)}")
            if f.get("fix"):
                lines.append(f"  fix: {safe_text(str(f['fix']), 2000)}")
    else:
        lines.append("No slow link: every link runs at least half the median of the "
                     "others of its kind." if measured else "No link was measured.")
    lines += _recheck_lines(result.get("recheck"))
    for e in result.get("errors") or []:
        if isinstance(e, Mapping):
            lines.append(f"rank {e.get('rank')}: {safe_text(str(e.get('error')), 300)}")
    return "\n".join(lines)


def _recheck_lines(recheck: object) -> list[str]:
    """What the re-measurement of the links first found slow made of them."""
    if not isinstance(recheck, Mapping):
        return []
    links, unmeasured = recheck.get("links"), recheck.get("unmeasured")
    n = len(links) if isinstance(links, list) else 0
    k = min(n, len(unmeasured)) if isinstance(unmeasured, list) else 0
    error = recheck.get("error")
    why = safe_text(str(error), 300) if error else "not measured"
    what = f"{n} link{'s' if n != 1 else ''} first measured slow"
    if error and (k == n or not isinstance(unmeasured, list)):  # nothing measured twice
        return [f"{what}, not re-measured: {why}"]
    confirmed = recheck.get("confirmed")
    if not isinstance(confirmed, int):
        return []
    m = n - k
    count = f"{m} " if k else ""
    line = (f"{what}, {count}re-measured ({fmt_num(recheck.get('seconds'), '.2f')} s): "
            f"{confirmed} still slow, {m - confirmed} healthy the second time (each "
            "direction's figure is the faster of the two measurements)")
    if k:
        stand = "its first figures stand" if k == 1 else "their first figures stand"
        line += f"; {k} not re-measured ({stand}): {why}"
    return [line + "."]


def _slow_pairs(findings: Sequence[Mapping[str, Any]]) -> set[tuple[int, int]]:
    out: set[tuple[int, int]] = set()
    for f in findings:
        ev = f.get("evidence")
        if f.get("kind") != "slow_link" or not isinstance(ev, Mapping):
            continue
        for link in ev.get("links") or []:
            if isinstance(link, list) and len(link) >= 2 \
                    and all(isinstance(x, int) for x in link[:2]):
                out.add((min(link[0], link[1]), max(link[0], link[1])))
    return out


def _cell(v: float | None, slow: bool) -> str:
    if v is None:
        return NA
    return gbps(v) + ("!" if slow else "")


def _table(ranks: list[int], nodes: list[str], cells: list[list[float | None]],
           slow: set[tuple[int, int]]) -> list[str]:
    n = len(ranks)
    width = max([len(NA) + 1, 6] + [len(_cell(v, True)) for row in cells for v in row
                                    if v is not None])
    label = max([4] + [len(x) for x in nodes])
    rank_w = max(4, *(len(str(r)) for r in ranks))
    head = f"{'node':<{label}} {'rank':>{rank_w}} " + " ".join(
        f"{r:>{width}}" for r in ranks)
    out = [head]
    for i in range(n):
        if i and nodes[i] != nodes[i - 1]:
            out.append("")
        row = []
        for j in range(n):
            v = cells[i][j] if j < len(cells[i]) else None
            pair = (min(ranks[i], ranks[j]), max(ranks[i], ranks[j]))
            row.append(f"{'·' if i == j else _cell(v, pair in slow):>{width}}")
        name = nodes[i] if i == 0 or nodes[i] != nodes[i - 1] else ""
        out.append(f"{name:<{label}} {ranks[i]:>{rank_w}} " + " ".join(row))
    return out


def _slowest(ranks: list[int], nodes: list[str], cells: list[list[float | None]],
             slow: set[tuple[int, int]]) -> list[str]:
    links = sorted(((v, i, j) for i in range(len(ranks)) for j in range(i + 1, len(ranks))
                    if j < len(cells[i]) and (v := cells[i][j]) is not None
                    and math.isfinite(v)), key=lambda x: x[0])
    out = [f"{len(ranks)} ranks: too many for a table; the {min(MAX_LISTED, len(links))} "
           "slowest links:"]
    for v, i, j in links[:MAX_LISTED]:
        pair = (min(ranks[i], ranks[j]), max(ranks[i], ranks[j]))
        out.append(f"  rank {ranks[i]} ({nodes[i]}) - rank {ranks[j]} ({nodes[j]}): "
                   f"{_cell(v, pair in slow)} GB/s")
    return out
