"""The frames a run's state is made of: what a replay that jumps applies instead of
every frame before the jump (:mod:`rtop.run.seek`).

A rank's state at a moment depends on few of the frames it sent: its last ``hello``
(who it is), its last clock ``offset``, how it ended (a ``bye``, its connection's
``close``) unless a later hello brought it back, and of its batches the last one (its
last step and ``seq``, its counters, when it was last heard from), the last with
samples (its latest GPU, host and memory figures), the last with a ``meta``, the last
with ``events``, the last with a stack in a heartbeat, and the first with steps (when it
started: its warm-up). Of the run: its ``run`` frame, the last ``job_exit`` and link
probe (``links``). Applied in their order to a fresh state, these give every rank's
state as it was, but for its rolling windows (a jump rebuilds them from the frames of
the last seconds), its counts of steps and frames received, and the diagnosis'
history.

:class:`Facets` keeps them from frames given in any order: each frame comes with its
place in the recording (an ``order`` key), and the latest (the earliest, for the first
steps) is kept.
"""

from __future__ import annotations

from typing import Any, Final

from collectors import wire
from rtop.run.state import KIND_INGEST, KIND_JOB_EXIT, KIND_LINKS

#: Ranks (by group and rank) a :class:`Facets` keeps at most.
MAX_KEYS: Final = 1 << 16

_SAMPLES = ("gpu", "host", "mem", "hb")
Entry = tuple[Any, float, wire.Frame]  # (order, t_hub, frame)
Key = tuple[Any, Any]


def name(v: Any) -> Any:
    """A group or rank as a dict key (a forged one as its clipped repr)."""
    return v if v is None or type(v) in (str, int) else repr(v)[:64]


def key_of(frame: wire.Frame) -> Key | None:
    """The rank (``(group, rank)``) a frame is about, if any."""
    p = frame.payload
    if frame.kind == wire.KIND_HELLO:
        ident = p.get("identity")
        return (name(ident.get("group")), name(ident.get("rank"))) \
            if isinstance(ident, dict) else None
    if frame.kind in (wire.KIND_BATCH, "offset", wire.KIND_BYE, "conn"):
        return name(p.get("group")), name(p.get("rank"))
    return None


def has_stack(p: dict[str, Any]) -> bool:
    """Whether a batch's heartbeats hold a stack."""
    rows = p.get("hb")
    return isinstance(rows, list) and any(
        isinstance(r, list) and len(r) > 4 and r[4] is not None for r in rows)


class Facets:
    """The frames that make a run's state (see the module doc)."""

    def __init__(self) -> None:
        self.ranks: dict[Key, dict[str, Entry]] = {}
        self._run: dict[str, Entry] = {}
        #: ranks not kept because :data:`MAX_KEYS` were
        self.overflow = 0

    def _put(self, facets: dict[str, Entry], facet: str, entry: Entry,
             first: bool = False) -> None:
        old = facets.get(facet)
        if old is None or (entry[0] < old[0] if first else entry[0] > old[0]):
            facets[facet] = entry

    def _of(self, key: Key) -> dict[str, Entry] | None:
        facets = self.ranks.get(key)
        if facets is None:
            if len(self.ranks) >= MAX_KEYS:
                self.overflow += 1
                return None
            facets = self.ranks[key] = {}
        return facets

    def see(self, order: Any, t_hub: float, frame: wire.Frame) -> None:
        """A frame of the run, at its place ``order`` (comparable with every other
        frame's) and hub time ``t_hub``."""
        kind, p = frame.kind, frame.payload
        if kind in (wire.KIND_RUN, KIND_JOB_EXIT, KIND_LINKS, KIND_INGEST):
            self._put(self._run, kind, (order, t_hub, frame))
            return
        if kind == "conn" and p.get("event") != "close":
            return
        key = key_of(frame)
        facets = self._of(key) if key is not None else None
        if facets is None:
            return
        entry = (order, t_hub, frame)
        if kind == wire.KIND_BATCH:
            self._put(facets, "batch", entry)
            if any(k in p for k in _SAMPLES):
                self._put(facets, "samples", entry)
            if "meta" in p:
                self._put(facets, "meta", entry)
            if "events" in p:
                self._put(facets, "events", entry)
            if has_stack(p):
                self._put(facets, "stack", entry)
            if p.get("steps"):
                self._put(facets, "first", entry, first=True)
        elif kind == wire.KIND_HELLO:
            self._put(facets, "hello", entry)
        else:
            self._put(facets, "offset" if kind == "offset" else "end", entry)

    def has(self, key: Key, facet: str) -> bool:
        """Whether a rank's ``facet`` (``batch``, ``samples``, ``offset``, ...) is kept."""
        return facet in self.ranks.get(key, {})

    def frames(self) -> list[tuple[float, wire.Frame]]:
        """``(t_hub, frame)`` of every frame kept, each once, in the recording's order;
        a rank's end is left out when a later hello brought it back."""
        seen: dict[Any, Entry] = {}
        for e in self._run.values():
            seen[e[0]] = e
        for facets in self.ranks.values():
            hello, end = facets.get("hello"), facets.get("end")
            for facet, e in facets.items():
                if facet == "end" and hello is not None and end is not None \
                        and hello[0] > end[0]:
                    continue
                seen[e[0]] = e
        return [(t, f) for _, t, f in sorted(seen.values(), key=lambda e: e[0])]
