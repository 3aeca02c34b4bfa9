"""The run's state as the hub holds it: ranks, attempts, bounded windows, snapshots.

The same :class:`RunState` is fed by the live hub and by a recording being replayed:
both call :meth:`RunState.apply` with each frame and the hub's time when it arrived.
Windows are bounded (by steps and by samples, per rank); a rank that stops sending is
marked lost; a Ray Train worker-group restart (a new ``group`` in the identity) starts a
new attempt and the previous attempt's ranks are kept, ended, for its history (their
windows are given up only when the new attempt needs the room).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import numpy as np

from collectors import wire
from collectors.identity import Identity
from collectors.schema import (
    ADDED_FIELDS,
    GPU_FIELDS,
    HEARTBEAT_FIELDS,
    HOST_FIELDS,
    MEM_FIELDS,
    STEP_FIELDS,
)
from rtop.run.ring import Rings, nanmedian_rows
from rtop.run.snapshot import NodeColumns, RankColumns, RankDetail, RunInfo, Status

#: Step fields kept per rank in the rolling window.
STEP_HISTORY = ("step", "t_wall", "step_s", "data_wait_s", "compute_s", "gpu_s", "comm_s",
                "comm_exposed_s", "comm_bytes", "busbw_Bps", "samples", "gap_s")
#: Sample fields kept per rank (about one value a second); the rest is latest-only.
SAMPLE_HISTORY = ("t_wall", "gpu_util_pct", "gpu_mem_used_bytes", "gpu_power_w",
                  "gpu_temp_c", "gpu_sm_clock_mhz", "host_proc_cpu_pct",
                  "host_loader_cpu_pct", "host_rss_bytes", "mem_used_bytes", "mem_peak_bytes")
#: Step fields whose recent medians a snapshot carries.
SNAPSHOT_STEP_FIELDS = ("step_s", "data_wait_s", "compute_s", "gpu_s", "comm_s",
                        "comm_exposed_s", "comm_bytes", "busbw_Bps", "samples", "gap_s")

_STEP_PICK = [STEP_FIELDS.index(f) for f in STEP_HISTORY]
_GPU = {f: i for i, f in enumerate(GPU_FIELDS)}
_HOST = {f: i for i, f in enumerate(HOST_FIELDS)}
_MEM = {f: i for i, f in enumerate(MEM_FIELDS)}
_HB = {f: i for i, f in enumerate(HEARTBEAT_FIELDS)}
_GPU_HIST = [_GPU[k] for k in ("util_pct", "mem_used_bytes", "power_w", "temp_c",
                               "sm_clock_mhz")]
_HOST_HIST = [_HOST[k] for k in ("proc_cpu_pct", "loader_cpu_pct", "rss_bytes")]
_MEM_HIST = [_MEM[k] for k in ("used_bytes", "peak_bytes")]
#: Latest-sample columns (numbers only) kept per slot for snapshots.
LATEST = tuple([f"gpu_{f}" for f in GPU_FIELDS[1:]] + [f"host_{f}" for f in HOST_FIELDS[1:]]
               + [f"mem_{f}" for f in MEM_FIELDS[2:]] + ["phase_s"])
_NAN = float("nan")
#: A rank is warm after this many steps (see ``RankState.warm_wall``) ...
WARMUP_STEPS = 20
#: ... or, for slow steps, after at least 3 steps and this many seconds.
WARMUP_S = 30.0


class RunView(TypedDict):
    """The run state's part of a snapshot (see :meth:`RunState.view`)."""

    t_hub: float
    run: RunInfo
    ranks: RankColumns
    nodes: NodeColumns
    build_s: float


class ProtocolError(ValueError):
    """A frame is well-formed msgpack but not what the protocol says it should hold."""


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else _NAN


def _check_rows(name: str, rows: Any, width: int) -> list[list[Any]]:
    """Rows of a table, each ``width`` long; rows from an older collector, shorter by
    the table's ``ADDED_FIELDS``, are padded with None (not measured)."""
    oldest = width - len(ADDED_FIELDS.get(name, ()))
    if not isinstance(rows, list) or not all(
            isinstance(r, list) and oldest <= len(r) <= width for r in rows):
        raise ProtocolError(f"malformed '{name}' rows (expected lists of {width} values)")
    if oldest < width:
        for r in rows:
            if len(r) < width:
                r.extend([None] * (width - len(r)))
    return rows


@dataclass
class RankState:
    """One rank of one attempt."""

    identity: Identity
    attempt: int
    slot: int | None
    #: active | finished (closed the probe) | exited (interpreter exit without close) |
    #: failed (an uncaught exception) | lost (silent or gone without a word) | ended (a
    #: later attempt replaced it)
    status: Status = "active"
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
    mem_device: str | None = None
    stack: str | None = None
    stack_t: float | None = None
    events: deque[list[Any]] = field(default_factory=lambda: deque(maxlen=64))
    collector: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, float | None] = field(default_factory=dict)  # once the window is freed
    lost_at: float | None = None  # hub time it was marked lost
    #: the rank's wall time when it warmed up (its WARMUP_STEPS-th step, or WARMUP_S after
    #: its first for slow steps): the first steps are slow (allocations, caches, loader
    #: workers starting) and memory grows meanwhile, neither of which is a finding
    warm_wall: float | None = None
    first_wall: float | None = None  # wall time of its first step
    #: the collector's own CPU use, as a share of one core (from its sender thread's CPU
    #: time between batches at least a second apart)
    rtop_cpu: float | None = None
    cpu_mark: tuple[float, float] | None = None  # (cpu_s, t_hub) of the last estimate

    @property
    def rank(self) -> int:
        """World rank."""
        return self.identity.rank

    @property
    def node(self) -> str:
        """Node (hostname) the rank runs on."""
        return self.identity.hostname

    @property
    def phase(self) -> str | None:
        """What the rank was doing at its last heartbeat."""
        return str(self.hb[_HB["phase"]]) if self.hb else None


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
        self.latest = np.full((self.steps.slots, len(LATEST)), np.nan)
        self._latest_idx = {f: i for i, f in enumerate(LATEST)}
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

    # ---- attempts, ranks, slots -----------------------------------------------------

    @property
    def current(self) -> Attempt | None:
        """The latest attempt."""
        return self.attempts[-1] if self.attempts else None

    def _grow(self, slots: int) -> None:
        self.steps.ensure(slots)
        self.samples.ensure(slots)
        have = self.latest.shape[0]
        if self.steps.slots > have:
            grown = np.full((self.steps.slots, len(LATEST)), np.nan)
            grown[:have] = self.latest
            self.latest = grown

    def _slot(self) -> int:
        if not self._free_slots:
            self._reclaim()
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._next_slot
            self._next_slot += 1
            self._grow(slot + 1)
        self.steps.clear(slot)
        self.samples.clear(slot)
        self.latest[slot] = np.nan
        return slot

    def _reclaim(self) -> None:
        """Free the windows of ended attempts' ranks once the current attempt needs more
        room than its world size allows for; a short summary of each is kept."""
        cur = self.current
        if cur is None or self._next_slot < self._slot_budget(cur):
            return
        for att in self.attempts[:-1]:
            for rs in att.ranks.values():
                if rs.slot is not None:
                    rs.summary = self._summarise(rs)
                    self._free_slots.append(rs.slot)
                    rs.slot = None

    def _summarise(self, rs: RankState) -> dict[str, float | None]:
        if rs.slot is None:
            return rs.summary
        med = nanmedian_rows(self.steps.last(np.array([rs.slot]), self.steps.window))[0]
        return {f: (None if math.isnan(v) else float(v))
                for f, v in zip(self.steps.fields, med.tolist(), strict=True)}

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
            self._free_slots += [rs.slot for rs in gone.ranks.values() if rs.slot is not None]
        # room for the new world at once (not rank by rank), within the slot budget
        self._grow(min(self._next_slot + ident.world_size, self._slot_budget(att)))
        return att

    @staticmethod
    def _slot_budget(att: Attempt) -> int:
        """Slots the hub allows itself: the world size, a quarter more, and 64."""
        return int(att.world_size * 1.25) + 64

    def rank_state(self, rank: int, group: str | None = None) -> RankState | None:
        """The state of a rank in the given group's attempt (default: the current one)."""
        att = self._by_group.get(group) if group else None
        if att is None:
            att = self.current
        return att.ranks.get(rank) if att is not None else None

    def active_ranks(self) -> list[RankState]:
        """The ranks of the current attempt."""
        att = self.current
        return list(att.ranks.values()) if att is not None else []

    # ---- frames ---------------------------------------------------------------------

    def apply(self, frame: wire.Frame, t_hub: float, history: bool = True
              ) -> RankState | None:
        """Apply one frame received (or replayed) at hub time ``t_hub``.

        Returns the rank the frame belongs to, if any. Raises :class:`ProtocolError` for
        a frame whose content breaks the protocol. ``history=False`` keeps the ranks'
        state and latest values but not the rolling windows: a replay seeking far ahead
        skips what newer frames would push out of the windows anyway.
        """
        if t_hub > self.now:
            self.now = t_hub
        if self.started is None and t_hub > 0:
            self.started = t_hub
        self.frames += 1
        kind, p = frame.kind, frame.payload
        if kind == wire.KIND_BATCH:
            rs = self._rank_of(p)
            self.on_batch(rs, p, t_hub, history)
            return rs
        if kind == wire.KIND_HELLO:
            return self.on_hello(p, t_hub)
        if kind == wire.KIND_BYE:
            rs = self._rank_of(p)
            reason, error = p.get("reason"), p.get("error")
            rs.status = "failed" if error else ("exited" if reason == "exit" else "finished")
            rs.connected, rs.last_seen = False, t_hub
            if isinstance(error, str):
                rs.meta["error"] = error
            if isinstance(p.get("dropped"), int):
                rs.dropped = p["dropped"]
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
        group = p.get("group")
        rs = self.rank_state(rank, group if isinstance(group, str) else None)
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
                or not 0 <= ident.rank < 1 << 20 or not 1 <= ident.world_size <= 1 << 20 \
                or not isinstance(ident.hostname, str):
            raise ProtocolError("hello identity has no valid rank / world_size / hostname")
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

    def on_batch(self, rs: RankState, p: dict[str, Any], t_hub: float,
                 history: bool = True) -> None:
        """Records from a rank (validated before anything is stored)."""
        steps = _check_rows("steps", p.get("steps") or [], len(STEP_FIELDS))
        gpu = _check_rows("gpu", p.get("gpu") or [], len(GPU_FIELDS))
        host = _check_rows("host", p.get("host") or [], len(HOST_FIELDS))
        mem = _check_rows("mem", p.get("mem") or [], len(MEM_FIELDS))
        hbs = _check_rows("hb", p.get("hb") or [], len(HEARTBEAT_FIELDS))
        slot = rs.slot
        if slot is not None and history:
            for row in steps:
                self.steps.append(slot, [_num(row[j]) for j in _STEP_PICK])
        if steps:
            if rs.warm_wall is None:
                self._warm_up(rs, steps)
            rs.steps_seen += len(steps)
            self.step_records += len(steps)
            last = steps[-1][0]
            if isinstance(last, int):
                rs.last_step = last
        if gpu or host or mem:
            if gpu:
                rs.gpu = gpu[-1]
            if host:
                rs.host = host[-1]
            if mem:
                rs.mem = mem[-1]
                dev = mem[-1][_MEM["device"]]
                rs.mem_device = dev if isinstance(dev, str) else None
            if slot is not None:
                self._samples(slot, gpu, host, mem, history)
        for hb in hbs:
            rs.hb = hb
            if hb[_HB["stack"]]:
                rs.stack, rs.stack_t = str(hb[_HB["stack"]]), t_hub
        if hbs and slot is not None:
            self.latest[slot, -1] = _num(hbs[-1][_HB["phase_s"]])
        events = p.get("events")
        if isinstance(events, list):
            rs.events.extend(e for e in events if isinstance(e, list))
        if isinstance(p.get("meta"), dict):
            rs.meta.update(p["meta"])
        dropped = p.get("dropped")
        if isinstance(dropped, int):
            rs.dropped = dropped
        cpu = p.get("cpu_s")
        if isinstance(cpu, (int, float)) and not isinstance(cpu, bool):
            mark = rs.cpu_mark
            if mark is None or cpu < mark[0]:
                rs.cpu_mark = (float(cpu), t_hub)
            elif t_hub - mark[1] >= 1.0:
                rs.rtop_cpu = (cpu - mark[0]) / (t_hub - mark[1])
                rs.cpu_mark = (float(cpu), t_hub)
        rs.last_seen = t_hub
        if rs.status == "lost":
            rs.status, rs.lost_at = "active", None
        rs.connected = True

    @staticmethod
    def _warm_up(rs: RankState, steps: list[list[Any]]) -> None:
        """Note when the rank warmed up, if one of these steps is where it did."""
        for k, row in enumerate(steps):
            t = row[1]
            if not isinstance(t, (int, float)) or isinstance(t, bool):
                continue
            if rs.first_wall is None:
                rs.first_wall = float(t)
            n = rs.steps_seen + k + 1
            if n >= WARMUP_STEPS or (n >= 3 and t - rs.first_wall >= WARMUP_S):
                rs.warm_wall = float(t)
                return

    def _samples(self, slot: int, gpu: list[list[Any]], host: list[list[Any]],
                 mem: list[list[Any]], history: bool = True) -> None:
        latest = self.latest[slot]
        n_gpu, n_host = len(GPU_FIELDS) - 1, len(HOST_FIELDS) - 1
        if gpu:
            latest[:n_gpu] = [_num(v) for v in gpu[-1][1:]]
        if host:
            latest[n_gpu:n_gpu + n_host] = [_num(v) for v in host[-1][1:]]
        if mem:
            latest[n_gpu + n_host:-1] = [_num(v) for v in mem[-1][2:]]
        if not history:
            return
        for i in range(max(len(gpu), len(host), len(mem))):
            g = gpu[i] if i < len(gpu) else None
            h = host[i] if i < len(host) else None
            m = mem[i] if i < len(mem) else None
            src = g or h or m
            row = [_num(src[0]) if src else _NAN]
            row += [_num(g[j]) for j in _GPU_HIST] if g else [_NAN] * len(_GPU_HIST)
            row += [_num(h[j]) for j in _HOST_HIST] if h else [_NAN] * len(_HOST_HIST)
            row += [_num(m[j]) for j in _MEM_HIST] if m else [_NAN] * len(_MEM_HIST)
            self.samples.append(slot, row)

    def on_disconnect(self, rs: RankState, t_hub: float) -> None:
        """The rank's connection closed; without a bye it is lost until it reconnects."""
        rs.connected = False
        if rs.status == "active":
            rs.status = "lost"
            rs.lost_at = t_hub
            rs.last_seen = min(rs.last_seen, t_hub)

    def tick(self, t_hub: float) -> list[RankState]:
        """Mark silent ranks lost; returns the ranks newly marked."""
        self.now = max(self.now, t_hub)
        newly = []
        for rs in self.active_ranks():
            if rs.status == "active" and t_hub - rs.last_seen > self.lost_after_s:
                rs.status = "lost"
                rs.lost_at = rs.last_seen + self.lost_after_s
                newly.append(rs)
        return newly

    # ---- views ------------------------------------------------------------------------

    def window(self, ranks: list[RankState], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Medians of the last ``k`` steps ``(n, len(STEP_HISTORY))`` and the latest
        samples ``(n, len(LATEST))`` of ``ranks`` (NaN where missing)."""
        slots = np.array([r.slot if r.slot is not None else 0 for r in ranks], dtype=np.int64)
        med = nanmedian_rows(self.steps.last(slots, k)) if len(ranks) else \
            np.empty((0, len(STEP_HISTORY)))
        latest = self.latest[slots] if len(ranks) else np.empty((0, len(LATEST)))
        gone = np.array([r.slot is None for r in ranks], dtype=bool)
        if gone.any():
            med[gone] = np.nan
            latest[gone] = np.nan
        return med, latest

    def view(self, recent: int | None = None) -> RunView:
        """The current attempt as columns (msgpack-able, viewer-ready): the run, one
        column per figure over its ranks, and its nodes folded to their worst rank.

        Step figures are medians over each rank's last ``recent`` steps; samples are
        the latest. Missing values are None. What a viewer gets adds the diagnosis to
        this (``rtop.analysis.monitor.Monitor.snapshot``).
        """
        t0 = time.perf_counter()
        k = recent or self.recent_steps
        ranks = sorted(self.active_ranks(), key=lambda r: r.rank)
        med, latest = self.window(ranks, k)
        now = self.now
        cols: dict[str, list[Any]] = {
            "rank": [r.rank for r in ranks],
            "node": [r.node for r in ranks],
            "status": [r.status for r in ranks],
            "step": [r.last_step for r in ranks],
            "last_seen_s": [round(now - r.last_seen, 3) for r in ranks],
            "dropped": [r.dropped for r in ranks],
            "rtop_cpu": [r.rtop_cpu for r in ranks],
            "offset_s": [r.offset_s for r in ranks],
            "phase": [r.phase for r in ranks],
            "mem_device": [r.mem_device for r in ranks],
        }
        for f in SNAPSHOT_STEP_FIELDS:
            cols[f] = column(med[:, self.steps.index[f]])
        for j, f in enumerate(LATEST):
            cols[f] = column(latest[:, j])
        att = self.current
        run = RunInfo(
            job=att.job if att else "",
            name=str(self.run_info.get("job") or ""),  # the hub's name for the job
            attempt=att.number if att else None,
            attempts=len(self.attempts),
            world_size=att.world_size if att else 0,
            ranks_seen=len(ranks),
            uptime_s=(now - self.started) if self.started else 0.0,
            frames=self.frames,
            step_records=self.step_records,
            bad_frames=self.bad_frames,
        )
        if isinstance(self.run_info.get("hub"), dict):
            run["hub"] = self.run_info["hub"]
        if isinstance(self.run_info.get("record"), str):
            run["record"] = self.run_info["record"]
        return RunView(t_hub=now, run=run, ranks=cast(RankColumns, cols),
                       # per node: the worst rank's figure (slowest step, longest wait, ...)
                       nodes=self._nodes(ranks, med), build_s=time.perf_counter() - t0)

    def _nodes(self, ranks: list[RankState], med: np.ndarray) -> NodeColumns:
        names: dict[str, int] = {}
        node_of = np.array([names.setdefault(r.node, len(names)) for r in ranks],
                           dtype=np.int64)
        n = len(names)
        out: dict[str, list[Any]] = {"node": list(names)}
        out["ranks"] = np.bincount(node_of, minlength=n).tolist() if n else []
        active = np.array([r.status == "active" for r in ranks], dtype=np.int64)
        out["active"] = np.bincount(node_of, weights=active, minlength=n).astype(int).tolist() \
            if n else []
        for f, worst in (("step_s", np.fmax), ("data_wait_s", np.fmax), ("comm_s", np.fmax),
                         ("busbw_Bps", np.fmin)):
            agg = np.full(n, np.nan)
            if n:
                worst.at(agg, node_of, med[:, self.steps.index[f]])
            out[f] = column(agg)
        return cast(NodeColumns, out)

    def rank_detail(self, rank: int) -> RankDetail:
        """One rank of the current attempt in full: step and sample histories, stack,
        events, identity and static memory figures (``found`` is False if unknown)."""
        rs = self.rank_state(rank)
        if rs is None:
            return {"rank": rank, "found": False}
        detail: RankDetail = {
            "rank": rank, "found": True, "identity": rs.identity.to_wire(),
            "status": rs.status, "meta": rs.meta, "stack": rs.stack,
            "events": list(rs.events), "offset_s": rs.offset_s, "gpu": rs.gpu,
            "host": rs.host, "mem": rs.mem, "hb": rs.hb, "summary": rs.summary,
        }
        if rs.slot is not None:
            detail["steps"] = {f: column(self.steps.history(f, rs.slot))
                               for f in self.steps.fields}
            detail["samples"] = {f: column(self.samples.history(f, rs.slot))
                                 for f in self.samples.fields}
        return detail

    def nbytes(self) -> int:
        """Bytes held in the windows."""
        return self.steps.nbytes() + self.samples.nbytes() + int(self.latest.nbytes)


def column(a: np.ndarray) -> list[float | None]:
    """A float column as a list, NaN as None."""
    nan = np.isnan(a)
    if not nan.any():
        return a.tolist()  # type: ignore[no-any-return]
    if nan.all():
        return [None] * len(a)
    return [None if m else v for v, m in zip(a.tolist(), nan.tolist(), strict=True)]
