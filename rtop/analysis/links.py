"""A link probe's answers made into a matrix, and which of its links are slow.

The ranks measure (``collectors.linkprobe``); :func:`assemble` puts their answers
together as an N×N matrix grouped by node; :func:`judge` decides, link by link, and
:func:`verdict` words the result as one ``slow_link`` finding, naming a node when every
slow link goes through it and the links otherwise.

**When a link is slow.** It runs under ``link_slow_fraction`` (half) of the median of
the *other* links of its kind: links between nodes are compared with links between
nodes, links within a node with links within a node (NVLink is ten times a network, and
neither says anything about the other). The median of the others, not of all: with four
nodes of which one is throttled, three of the six links between nodes are slow, and
the median of all six would be halfway between the slow and the healthy figure; for a
slow link the median of the other five is a healthy one (three of them are), for a
healthy link it is a slow one, and the healthy link is not under half of it. A kind
with one link has nothing to compare with and is not judged (two nodes of one rank
each: the probe cannot tell which end is slow).

**Measured twice.** A link is named slow only if it is slow twice. The hub re-measures
the links a probe found slow (:func:`recheck_pairs`, at most :data:`MAX_RECHECK_LINKS`,
slowest first) in a second, short probe a few steps later, and keeps for each direction
the faster of the two figures (:func:`merge_answers`): interference (another job's
traffic, a busy core) only ever slows a transfer, and is seldom there twice, while a
slow link is slow every time. The verdict is then made on the merged matrix. A link
re-measured faster raises the median the others are judged against, so one not slow
at first may be now: it is re-measured in turn (up to three passes). On a 2-core machine
(``benchmarks/probe_recheck.py``: four namespaces on a bridge, 1 MiB transfers) the
first measurement found a healthy link slow in 6 of 20 probes, 8 of 20 with two busy
loops on the cores; after re-measuring, none was named, while a node throttled to
80 Mbit/s was named in every probe.

**Which node.** When some node is an end of every slow link, that node is named, with
its ranks (a throttled node makes all of its links slow and no other). When two nodes
are (one slow link between two nodes), it cannot tell which, and names the link.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rtop.analysis import wording
from rtop.analysis.config import AnalysisConfig
from rtop.analysis.kinds import KINDS
from rtop.fmt import num
from rtop.run.snapshot import FindingDict, LinksView, ProbeLinks

#: Slow links listed one by one in a finding's evidence (the count is kept whole).
MAX_EVIDENCE_LINKS = 32
#: The two kinds of link, as the evidence and the snapshot name them.
INTER, INTRA = "inter_node", "intra_node"
#: Slow links a probe re-measures before naming them (the slowest first; a node whose
#: every link is slow has many, and the first of them already decide).
MAX_RECHECK_LINKS = 64


# ---- the matrix ------------------------------------------------------------------------

def assemble(ranks: Sequence[int], nodes: Sequence[str],
             answers: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The probe's result from the ranks' answers.

    ``ranks[i]`` runs on ``nodes[i]``; ``answers`` holds each rank's answer by rank
    (``{"links": [[peer, Bps], ...], "seconds", "nbytes"}``, ``Bps`` from ``peer`` to
    it, or ``{"error"}``). Returns ``{"ranks", "nodes", "matrix_Bps", "seconds",
    "nbytes", "errors"}``: the ranks ordered by node (the node of the lowest rank
    first), then by rank; ``matrix_Bps[i][j]`` the link between ``ranks[i]`` and
    ``ranks[j]``, the slower of its two directions (either, when only one was
    measured), symmetric, None where not measured (the diagonal too); ``errors``
    ``[{"rank", "error"}]`` for answers that are errors and ranks that did not answer.
    Answers are a rank's word: a peer that is not a rank, a figure that is not a
    positive number, are left out.
    """
    n = len(ranks)
    pos = {r: i for i, r in enumerate(ranks)}
    lowest: dict[str, int] = {}
    for r, node in zip(ranks, nodes, strict=True):
        lowest[node] = min(r, lowest.get(node, r))
    order = sorted(range(n), key=lambda i: (lowest[nodes[i]], ranks[i]))
    at = {old: new for new, old in enumerate(order)}
    inbound = np.full((n, n), np.nan)  # [receiver, sender], in the new order
    errors: list[dict[str, Any]] = []
    seconds: list[float] = []
    nbytes: int | None = None
    for r in ranks:
        ans = answers.get(r)
        if not isinstance(ans, Mapping):
            errors.append({"rank": r, "error": "no answer"})
            continue
        if ans.get("error"):
            errors.append({"rank": r, "error": str(ans["error"])[:300]})
            continue
        i = at[pos[r]]
        for item in ans.get("links") or ():
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                continue
            peer, bps = item
            v = num(bps)
            if type(peer) is not int or peer not in pos or peer == r or v is None or v <= 0:
                continue
            j = at[pos[peer]]
            inbound[i, j] = np.fmin(inbound[i, j], v)
        s = num(ans.get("seconds"))
        if s is not None:
            seconds.append(s)
        b = ans.get("nbytes")
        if type(b) is int:
            nbytes = b
    m = np.fmin(inbound, inbound.T)
    matrix = [[None if math.isnan(v) else float(f"{v:.4g}") for v in row]
              for row in m.tolist()]
    return {"ranks": [ranks[i] for i in order], "nodes": [nodes[i] for i in order],
            "matrix_Bps": matrix, "seconds": max(seconds) if seconds else None,
            "nbytes": nbytes, "errors": errors}


def merge_answers(first: Mapping[int, Mapping[str, Any]],
                  second: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Two probes' answers by rank as one (the probe and its re-measurement): for each
    rank and peer, the faster figure of the two (see "Measured twice" in the module doc);
    ``seconds`` added up. A rank's answer that is an error (or absent) in ``second``
    leaves its ``first`` answer as it was; one that is an error in ``first`` stays one."""
    out: dict[int, dict[str, Any]] = {}
    for r, ans in first.items():
        merged = dict(ans)
        again = second.get(r)
        if not ans.get("error") and isinstance(again, Mapping) and not again.get("error"):
            best: dict[Any, float] = {}
            for answer in (ans, again):
                for item in answer.get("links") or ():
                    if isinstance(item, (list, tuple)) and len(item) == 2:
                        v = num(item[1])
                        if v is not None and v > 0 and type(item[0]) is int:
                            best[item[0]] = max(v, best.get(item[0], 0.0))
            merged["links"] = [[peer, bps] for peer, bps in best.items()]
            s1, s2 = num(ans.get("seconds")), num(again.get("seconds"))
            if s1 is not None and s2 is not None:
                merged["seconds"] = s1 + s2
        out[r] = merged
    return out


def recheck_pairs(result: Mapping[str, Any], cfg: AnalysisConfig,
                  limit: int = MAX_RECHECK_LINKS) -> list[tuple[int, int]]:
    """The links of ``result`` (an :func:`assemble` result) judged slow, as rank pairs,
    the slowest against its reference first, at most ``limit``: what the hub
    re-measures before it names them."""
    jd = judge(result, cfg)
    ranks = jd.ranks
    return [(ranks[int(jd.i[k])], ranks[int(jd.j[k])]) for k in jd.slow_links()[:limit]]


def _links_of(result: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The measured links ``(i, j, Bps)``, ``i < j``, of a result (``matrix_Bps``) or of
    what the run state keeps (``links``)."""
    sparse = result.get("links")
    if isinstance(sparse, list):
        a = np.array(sparse, dtype=np.float64).reshape(-1, 3)
        return a[:, 0].astype(np.int64), a[:, 1].astype(np.int64), a[:, 2]
    rows = result.get("matrix_Bps") or []
    n = len(rows)
    m = np.array([[np.nan if v is None else v for v in row] for row in rows],
                 dtype=np.float64).reshape(n, n)
    m = np.fmin(m, m.T)
    iu, ju = np.triu_indices(n, 1)
    vals = m[iu, ju]
    keep = ~np.isnan(vals) & (vals > 0)
    return iu[keep], ju[keep], vals[keep]


# ---- the verdict -----------------------------------------------------------------------

def others_median(v: np.ndarray) -> np.ndarray:
    """For each value, the median of the others (NaN with fewer than two values)."""
    k = len(v)
    if k < 2:
        return np.full(k, np.nan)
    order = np.argsort(v, kind="stable")
    s = v[order]
    pos = np.empty(k, dtype=np.int64)
    pos[order] = np.arange(k)

    def nth(idx: int) -> np.ndarray:  # the idx-th smallest of the others, for each
        out: np.ndarray = np.where(idx < pos, s[idx], s[min(idx + 1, k - 1)])
        return out

    rest = k - 1
    if rest % 2:
        return nth(rest // 2)
    both: np.ndarray = (nth(rest // 2 - 1) + nth(rest // 2)) / 2
    return both


@dataclass
class Judgement:
    """Each measured link of a probe, judged (arrays over the links)."""

    ranks: list[int]
    nodes: list[str]
    i: np.ndarray  # index into ranks, i < j
    j: np.ndarray
    bps: np.ndarray
    inter: np.ndarray  # between two nodes (else within one)
    reference: np.ndarray  # the median of the other links of its kind
    slow: np.ndarray
    medians: dict[str, float | None]  # median link of each kind

    def slow_links(self) -> list[int]:
        """Indices of the slow links, slowest (against its reference) first."""
        idx = np.flatnonzero(self.slow)
        return sorted(idx.tolist(), key=lambda k: self.bps[k] / self.reference[k])


#: The last judgement (the result it judged, the threshold, the judgement, its verdict):
#: a probe's result stays the same between probes, while the diagnosis judges it twice
#: a second and every snapshot shows it (145,000 links, at 4,096 ranks, take 50 ms).
_LAST: list[tuple[Mapping[str, Any], float, Judgement,
                  tuple[list[int], dict[str, Any], float] | None]] = []


def judge(result: Mapping[str, Any], cfg: AnalysisConfig) -> Judgement:
    """Every measured link of ``result`` (an :func:`assemble` result, or the run
    state's :class:`~rtop.run.snapshot.ProbeLinks`) against the median of the other
    links of its kind (see the module doc)."""
    return _judged(result, cfg)[0]


def _judged(result: Mapping[str, Any], cfg: AnalysisConfig
            ) -> tuple[Judgement, tuple[list[int], dict[str, Any], float] | None]:
    """The judgement and the verdict of ``result``, the last one's again if it is the
    same object judged against the same threshold (results are not changed once
    made)."""
    if _LAST and _LAST[0][0] is result and _LAST[0][1] == cfg.link_slow_fraction:
        return _LAST[0][2], _LAST[0][3]
    jd = _judge(result, cfg)
    found = _verdict(jd, result, cfg)
    _LAST[:] = [(result, cfg.link_slow_fraction, jd, found)]
    return jd, found


def _judge(result: Mapping[str, Any], cfg: AnalysisConfig) -> Judgement:
    ranks = [int(r) for r in result.get("ranks") or []]
    nodes = [str(x) for x in result.get("nodes") or []]
    i, j, bps = _links_of(result)
    node_id = {name: k for k, name in enumerate(dict.fromkeys(nodes))}
    of = np.array([node_id[x] for x in nodes], dtype=np.int64)
    inter = of[i] != of[j] if len(i) else np.zeros(0, dtype=bool)
    reference = np.full(len(bps), np.nan)
    medians: dict[str, float | None] = {INTER: None, INTRA: None}
    for name, mask in ((INTER, inter), (INTRA, ~inter)):
        if mask.any():
            reference[mask] = others_median(bps[mask])
            medians[name] = float(np.median(bps[mask]))
    with np.errstate(invalid="ignore"):
        slow = bps < cfg.link_slow_fraction * reference  # NaN (nothing to compare): False
    return Judgement(ranks, nodes, i, j, bps, inter, reference, slow, medians)


def verdict(result: Mapping[str, Any], cfg: AnalysisConfig
            ) -> tuple[list[int], dict[str, Any], float] | None:
    """The ``slow_link`` finding a probe makes, as ``(ranks, evidence, impact)``, or
    None when every link is healthy (see the module doc for the node or the links)."""
    found = _judged(result, cfg)[1]
    if found is None:
        return None
    ranks, ev, impact = found
    return list(ranks), dict(ev), impact  # the caller may add to its evidence


def _verdict(jd: Judgement, result: Mapping[str, Any], cfg: AnalysisConfig
             ) -> tuple[list[int], dict[str, Any], float] | None:
    slow = jd.slow_links()
    if not slow:
        return None
    nodes, ranks = jd.nodes, jd.ranks
    common = set.intersection(*({nodes[jd.i[k]], nodes[jd.j[k]]} for k in slow))
    node = next(iter(common)) if len(common) == 1 else None
    if node is not None:
        blamed = sorted(r for r, x in zip(ranks, nodes, strict=True) if x == node)
        on = np.array([x == node for x in nodes], dtype=bool)
        touching = int((on[jd.i] | on[jd.j]).sum())
    else:
        blamed = sorted({ranks[jd.i[k]] for k in slow} | {ranks[jd.j[k]] for k in slow})
        touching = None
    k0 = slow[0]
    kinds = {INTER if jd.inter[k] else INTRA for k in slow}
    ev: dict[str, Any] = {
        "nodes": [node] if node is not None else [],
        "links": [[ranks[jd.i[k]], ranks[jd.j[k]], _round(jd.bps[k])]
                  for k in slow[:MAX_EVIDENCE_LINKS]],
        "link_count": len(slow),
        "slowest_Bps": _round(jd.bps[k0]),
        "median_Bps": _round(jd.reference[k0]),  # of the other links of its kind
        "link_kind": kinds.pop() if len(kinds) == 1 else "both",
        "medians_Bps": {k: _round(v) for k, v in jd.medians.items()},
        "threshold": cfg.link_slow_fraction,
        "node_links": touching,  # measured links through the node named
        "measured_links": len(jd.bps),
        "probe_t": num(result.get("t")),
    }
    return blamed, ev, float(1 - jd.bps[k0] / jd.reference[k0])


def slow_links(result: Mapping[str, Any], cfg: AnalysisConfig) -> list[FindingDict]:
    """The probe's ``slow_link`` finding (at most one), in the report's shape; [] when
    every link is healthy."""
    v = verdict(result, cfg)
    if v is None:
        return []
    ranks, ev, impact = v
    return [FindingDict(kind="slow_link", ranks=ranks, severity=KINDS["slow_link"].severity,
                        summary=wording.summary("slow_link", ranks, ev), evidence=ev,
                        fix=wording.fix("slow_link", ranks, ev), impact=round(impact, 4))]


def view(stored: ProbeLinks, cfg: AnalysisConfig) -> LinksView:
    """What a viewer gets of the run state's latest probe: its links and the verdict on
    each (``slow``: ``[i, j]`` pairs, and the median of each kind)."""
    jd = judge(stored, cfg)
    slow = [[int(jd.i[k]), int(jd.j[k])] for k in np.flatnonzero(jd.slow).tolist()]
    return LinksView(t=stored["t"], ranks=stored["ranks"], nodes=stored["nodes"],
                     links=stored["links"], busbw_Bps=stored["busbw_Bps"],
                     seconds=stored["seconds"], nbytes=stored["nbytes"],
                     errors=stored["errors"], slow=slow,
                     medians_Bps={k: _round(v) for k, v in jd.medians.items()})


def _round(x: float | None) -> float | None:
    v = num(x)
    return None if v is None else float(f"{v:.4g}")
