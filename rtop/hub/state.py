"""The run's state as the hub holds it: ranks, attempts, bounded windows, snapshots.

The same :class:`RunState` is fed by the live hub and by a recording being replayed:
both call :meth:`RunState.apply` with each frame and the hub's time when it arrived.
Windows are bounded (by steps and by samples, per rank); a rank that stops sending is
marked lost; a Ray Train worker-group restart (a new ``group`` in the identity) starts a
new attempt and the previous attempt's ranks are kept, ended, for its history.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collectors import wire
from collectors.identity import Identity
from collectors.schema import GPU_FIELDS, HEARTBEAT_FIELDS, HOST_FIELDS, MEM_FIELDS, STEP_FIELDS
from rtop.hub.ring import Rings

#: Step fields kept per rank in the rolling window.
STEP_HISTORY = ("step", "t_wall", "step_s", "data_wait_s", "compute_s", "gpu_s", "comm_s",
                "comm_exposed_s", "comm_bytes", "busbw_Bps", "samples", "gap_s")
#: Sample fields kept per rank (about one value a second); the rest is latest-only.
SAMPLE_HISTORY = ("t_wall", "gpu_util_pct", "gpu_mem_used_bytes", "gpu_power_w",
                  "gpu_temp_c", "gpu_sm_clock_mhz", "proc_cpu_pct", "loader_cpu_pct",
                  "rss_bytes", "mem_used_bytes", "mem_peak_bytes")

_STEP_IDX = [STEP_FIELDS.index(f) for f in STEP_HISTORY]
_GPU = {f: i for i, f in enumerate(GPU_FIELDS)}
_HOST = {f: i for i, f in enumerate(HOST_FIELDS)}
_MEM = {f: i for i, f in enumerate(MEM_FIELDS)}
_HB = {f: i for i, f in enumerate(HEARTBEAT_FIELDS)}


class ProtocolError(ValueError):
    """A frame is well-formed msgpack but not what the protocol says it should hold."""


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _rows_to_array(rows: Any, width: int, pick: list[int]) -> np.ndarray:
    """Rows of a batch table to a float array (NaN for missing), rejecting bad shapes."""
    if not isinstance(rows, list):
        raise ProtocolError("a batch table is not a list of rows")
    out = np.empty((len(rows), len(pick)), dtype=np.float64)
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != width:
            raise ProtocolError(f"a row has {len(row) if isinstance(row, list) else '?'} "
                                f"values, expected {width}")
        out[i] = [_num(row[j]) for j in pick]
    return out


@dataclass
class RankState:
    """One rank of one attempt."""

    identity: Identity
    attempt: int
    slot: int
    status: str = "active"  # active | finished | lost | ended (a later attempt replaced it)
    first_seen: float = 0.0
    last_seen: float = 0.0
    connected: bool = True
    offset_s: float | None = None  # rank clock minus hub clock
    rtt_s: float | None = None
    dropped: int = 0
    steps_seen: int = 0
    last_step: int = -1
    meta: dict[str, Any] = field(default_factory=dict)
    gpu: list[Any] | None = None
    host: list[Any] | None = None
    mem: list[Any] | None = None
    hb: list[Any] | None = None
    stack: str | None = None
    stack_t: float | None = None
    events: deque[list[Any]] = field(default_factory=lambda: deque(maxlen=64))
    collector: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """World rank."""
        return self.identity.rank

    @property
    def node(self) -> str:
        """Node (hostname) the rank runs on."""
        return self.identity.hostname


@dataclass
class Attempt:
    """One worker group: a Ray Train restart or torchrun restart starts a new one."""

    number: int
    group: str
    job: str
    world_size: int
    started: float
    ranks: dict[int, RankState] = field(default_factory=dict)


class RunState:
    """Everything the hub knows about the run; bounded in memory.

    ``window_steps`` step records and ``window_samples`` GPU/host/memory samples are
    kept per rank; ``lost_after_s`` of silence marks a rank lost; ``keep_attempts``
    attempts are kept (the oldest is forgotten beyond that).
    """

    def __init__(self, *, window_steps: int = 1200, window_samples: int = 600,
                 lost_after_s: float = 10.0, keep_attempts: int = 3,
                 recent_steps: int = 20) -> None:
        self.steps = Rings(STEP_HISTORY, window_steps)
        self.samples = Rings(SAMPLE_HISTORY, window_samples)
        self.lost_after_s = lost_after_s
        self.keep_attempts = keep_attempts
        self.recent_steps = recent_steps
        self.attempts: list[Attempt] = []
        self._by_group: dict[str, Attempt] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.started: float | None = None
        self.now = 0.0
        self.run_info: dict[str, Any] = {}
        self.frames = 0
        self.step_records = 0
        self.bad_frames = 0

    # ---- attempts and ranks -------------------------------------------------------

    @property
    def current(self) -> Attempt | None:
        """The latest attempt."""
        return self.attempts[-1] if self.attempts else None

    def _slot(self) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._next_slot
            self._next_slot += 1
            self.steps.ensure(slot + 1)
            self.samples.ensure(slot + 1)
        self.steps.clear(slot)
        self.samples.clear(slot)
        return slot

    def _attempt_for(self, ident: Identity, t_hub: float) -> Attempt:
        group = ident.group or f"{ident.job}#{ident.attempt}"
        att = self._by_group.get(group)
        if att is not None:
            return att
        number = max((a.number for a in self.attempts), default=-1) + 1
        att = Attempt(number, group, ident.job, ident.world_size, t_hub)
        for old in self.attempts:
            for rs in old.ranks.values():
                if rs.status == "active":
                    rs.status = "ended"
        self.attempts.append(att)
        self._by_group[group] = att
        while len(self.attempts) > self.keep_attempts:
            gone = self.attempts.pop(0)
            del self._by_group[gone.group]
            self._free_slots += [rs.slot for rs in gone.ranks.values()]
        return att

    def rank_state(self, rank: int, group: str | None = None) -> RankState | None:
        """The state of a rank in the given group's attempt (default: the current one)."""
        att = self._by_group.get(group) if group else self.current
        if att is None:
            att = self.current
        return att.ranks.get(rank) if att is not None else None

    def active_ranks(self) -> list[RankState]:
        """The ranks of the current attempt."""
        att = self.current
        return list(att.ranks.values()) if att is not None else []

    # ---- frames -------------------------------------------------------------------

    def apply(self, frame: wire.Frame, t_hub: float) -> RankState | None:
        """Apply one frame received (or replayed) at hub time ``t_hub``.

        Returns the rank the frame belongs to, if any. Raises :class:`ProtocolError` for
        a frame whose content breaks the protocol; the state is then unchanged.
        """
        self.now = max(self.now, t_hub)
        if self.started is None:
            self.started = t_hub
        self.frames += 1
        kind, p = frame.kind, frame.payload
        if kind == wire.KIND_BATCH:
            rs = self._rank_of(p)
            self.on_batch(rs, p, t_hub)
            return rs
        if kind == wire.KIND_HELLO:
            return self.on_hello(p, t_hub)
        if kind == wire.KIND_BYE:
            rs = self._rank_of(p)
            rs.status, rs.connected, rs.last_seen = "finished", False, t_hub
            rs.dropped = int(p.get("dropped") or rs.dropped)
            return rs
        if kind == "offset":
            rs = self._rank_of(p)
            rs.offset_s, rs.rtt_s = p.get("offset_s"), p.get("rtt_s")
            return rs
        if kind == "conn" and p.get("event") == "close":
            rs = self._rank_of(p)
            self.on_disconnect(rs, t_hub)
            return rs
        if kind == wire.KIND_RUN:
            self.run_info = dict(p)
        return None  # clock frames and unknown kinds only move time forward

    def _rank_of(self, p: dict[str, Any]) -> RankState:
        rank = p.get("rank")
        if not isinstance(rank, int):
            raise ProtocolError("frame without an integer 'rank'")
        rs = self.rank_state(rank, p.get("group"))
        if rs is None:
            raise ProtocolError(f"frame for rank {rank} before its hello")
        return rs

    def on_hello(self, p: dict[str, Any], t_hub: float) -> RankState:
        """A rank introduced itself: find or make its state in the right attempt."""
        raw = p.get("identity")
        if not isinstance(raw, dict):
            raise ProtocolError("hello without an identity map")
        try:
            ident = Identity.from_wire(raw)
        except TypeError as exc:
            raise ProtocolError(f"hello identity incomplete: {exc}") from None
        if not isinstance(ident.rank, int) or not isinstance(ident.world_size, int) \
                or ident.rank < 0 or ident.world_size < 1:
            raise ProtocolError("hello identity has no valid rank / world_size")
        att = self._attempt_for(ident, t_hub)
        rs = att.ranks.get(ident.rank)
        if rs is None:
            rs = RankState(ident, att.number, self._slot(), first_seen=t_hub)
            att.ranks[ident.rank] = rs
        rs.identity = ident
        rs.status, rs.connected, rs.last_seen = "active", True, t_hub
        if isinstance(p.get("collector"), dict):
            rs.collector = p["collector"]
        att.world_size = max(att.world_size, ident.world_size)
        return rs

    def on_batch(self, rs: RankState, p: dict[str, Any], t_hub: float) -> None:
        """Records from a rank."""
        steps = p.get("steps")
        if steps:
            arr = _rows_to_array(steps, len(STEP_FIELDS), _STEP_IDX)
            self.steps.append_rows(rs.slot, arr)
            rs.steps_seen += len(steps)
            self.step_records += len(steps)
            last = arr[-1, 0]
            if not math.isnan(last):
                rs.last_step = int(last)
        gpu, host, mem = p.get("gpu"), p.get("host"), p.get("mem")
        for name, rows, width in (("gpu", gpu, len(GPU_FIELDS)), ("host", host, len(HOST_FIELDS)),
                                  ("mem", mem, len(MEM_FIELDS))):
            if rows:
                if not isinstance(rows, list) or not all(
                        isinstance(r, list) and len(r) == width for r in rows):
                    raise ProtocolError(f"malformed '{name}' rows")
                setattr(rs, name, rows[-1])
        if gpu or host or mem:
            self._append_samples(rs, gpu or [], host or [], mem or [])
        for hb in p.get("hb") or []:
            if not isinstance(hb, list) or len(hb) != len(HEARTBEAT_FIELDS):
                raise ProtocolError("malformed heartbeat row")
            rs.hb = hb
            if hb[_HB["stack"]]:
                rs.stack, rs.stack_t = str(hb[_HB["stack"]]), t_hub
        for ev in p.get("events") or []:
            rs.events.append(ev)
        if isinstance(p.get("meta"), dict):
            rs.meta.update(p["meta"])
        dropped = p.get("dropped")
        if isinstance(dropped, int):
            rs.dropped = dropped
        rs.last_seen = t_hub
        if rs.status == "lost":
            rs.status = "active"
        rs.connected = True

    def _append_samples(self, rs: RankState, gpu: list[Any], host: list[Any],
                        mem: list[Any]) -> None:
        n = max(len(gpu), len(host), len(mem))
        rows = np.full((n, len(SAMPLE_HISTORY)), np.nan)
        for i in range(n):
            g = gpu[i] if i < len(gpu) else None
            h = host[i] if i < len(host) else None
            m = mem[i] if i < len(mem) else None
            src = g or h or m
            rows[i, 0] = _num(src[0]) if src else math.nan
            if g:
                rows[i, 1:6] = [_num(g[_GPU[k]]) for k in (
                    "util_pct", "mem_used_bytes", "power_w", "temp_c", "sm_clock_mhz")]
            if h:
                rows[i, 6:9] = [_num(h[_HOST[k]]) for k in (
                    "proc_cpu_pct", "loader_cpu_pct", "rss_bytes")]
            if m:
                rows[i, 9:11] = [_num(m[_MEM["used_bytes"]]), _num(m[_MEM["peak_bytes"]])]
        self.samples.append_rows(rs.slot, rows)

    def on_disconnect(self, rs: RankState, t_hub: float) -> None:
        """The rank's connection closed; without a bye it is lost until it reconnects."""
        rs.connected = False
        if rs.status == "active":
            rs.status = "lost"
            rs.last_seen = min(rs.last_seen, t_hub)

    def tick(self, t_hub: float) -> list[RankState]:
        """Mark silent ranks lost; returns the ranks newly marked."""
        self.now = max(self.now, t_hub)
        newly = []
        for rs in self.active_ranks():
            if rs.status == "active" and t_hub - rs.last_seen > self.lost_after_s:
                rs.status = "lost"
                newly.append(rs)
        return newly

    # ---- views ------------------------------------------------------------------------

    def snapshot(self, recent: int | None = None) -> dict[str, Any]:
        """A columnar summary of the current attempt (msgpack-able, viewer-ready).

        Step figures are medians over each rank's last ``recent`` steps; samples are
        the latest. Missing values are None.
        """
        t0 = time.perf_counter()
        k = recent or self.recent_steps
        ranks = sorted(self.active_ranks(), key=lambda r: r.rank)
        slots = np.array([r.slot for r in ranks], dtype=np.int64)
        cols: dict[str, list[Any]] = {
            "rank": [r.rank for r in ranks],
            "node": [r.node for r in ranks],
            "status": [r.status for r in ranks],
            "step": [r.last_step for r in ranks],
            "last_seen_s": [round(self.now - r.last_seen, 3) for r in ranks],
            "dropped": [r.dropped for r in ranks],
            "offset_s": [r.offset_s for r in ranks],
        }
        if len(ranks):
            for f in ("step_s", "data_wait_s", "compute_s", "gpu_s", "comm_s",
                      "comm_exposed_s", "comm_bytes", "busbw_Bps", "samples", "gap_s"):
                cols[f] = _nan_to_none(_nanmedian_rows(self.steps.last(f, slots, k)))
        for name, idx in (("gpu", _GPU), ("host", _HOST), ("mem", _MEM)):
            for f, i in idx.items():
                if f != "t_wall":  # latest sample, e.g. gpu_util_pct, host_rss_bytes
                    cols[f"{name}_{f}"] = [(getattr(r, name) or [None] * len(idx))[i]
                                           for r in ranks]
        cols["phase"] = [r.hb[_HB["phase"]] if r.hb else None for r in ranks]
        cols["phase_s"] = [r.hb[_HB["phase_s"]] if r.hb else None for r in ranks]
        att = self.current
        nodes: dict[str, list[int]] = {}
        for i, r in enumerate(ranks):
            nodes.setdefault(r.node, []).append(i)
        node_cols: dict[str, list[Any]] = {"node": list(nodes), "ranks": [],
                                           "active": [], "step_s": [], "data_wait_s": [],
                                           "comm_s": [], "busbw_Bps": []}
        for members in nodes.values():
            node_cols["ranks"].append(len(members))
            node_cols["active"].append(sum(1 for i in members if ranks[i].status == "active"))
            for f, agg in (("step_s", max), ("data_wait_s", max), ("comm_s", max),
                           ("busbw_Bps", min)):
                vals = [v for v in (cols.get(f, [None] * len(ranks))[i] for i in members)
                        if v is not None]
                node_cols[f].append(agg(vals) if vals else None)
        snap = {
            "t_hub": self.now,
            "run": {
                "job": att.job if att else "",
                "attempt": att.number if att else None,
                "attempts": len(self.attempts),
                "world_size": att.world_size if att else 0,
                "ranks_seen": len(ranks),
                "uptime_s": (self.now - self.started) if self.started else 0.0,
                "frames": self.frames,
                "step_records": self.step_records,
                "bad_frames": self.bad_frames,
                **{k: v for k, v in self.run_info.items() if k in ("hub", "record")},
            },
            "ranks": cols,
            # per node: the worst rank's figure (slowest step, longest wait, lowest busbw)
            "nodes": node_cols,
        }
        snap["build_s"] = time.perf_counter() - t0
        return snap

    def nbytes(self) -> int:
        """Bytes held in the windows."""
        return self.steps.nbytes() + self.samples.nbytes()


def _nanmedian_rows(a: np.ndarray) -> np.ndarray:
    if a.size == 0:
        return np.full(a.shape[0], np.nan)
    valid = ~np.isnan(a)
    out = np.full(a.shape[0], np.nan)
    has = valid.any(axis=1)
    if has.any():
        out[has] = np.nanmedian(a[has], axis=1)
    return out


def _nan_to_none(a: np.ndarray) -> list[float | None]:
    return [None if math.isnan(x) else float(x) for x in a.tolist()]

