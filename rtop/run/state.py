"""The run's state as the hub holds it: ranks, attempts, bounded windows, snapshots.

The same :class:`RunState` is fed by the live hub and by a recording being replayed:
both call :meth:`RunState.apply` with each frame and the hub's time when it arrived.
Windows are bounded (by steps and by samples, per rank); a rank that stops sending is
marked lost; a Ray Train worker-group restart (a new ``group`` in the identity) starts a
new attempt and the previous attempt's ranks are kept, ended, for its history (their
windows are given up only when the new attempt needs the room).

Nothing a peer sends is trusted: every frame is checked before anything of it is kept
(:mod:`rtop.run.validate`: :class:`ProtocolError` says what is wrong, and nothing of
that frame is applied), and what is kept is bounded:

* windows are allocated as ranks arrive (the arrays grow in steps of at least 64 rank
  slots), never from a claimed world size, and at most ``max_ranks`` ranks hold one at
  a time (all attempts together; ended attempts give theirs up first); a hello beyond
  that is refused. The hub passes ``peer``, the rank a connection already speaks for:
  one connection is one rank, and a frame for any other rank is refused.
"""

from __future__ import annotations

import math
import statistics
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Final, TypedDict, cast

import numpy as np

from collectors import wire
from collectors.figures import FIGURES, PREFIX, window_fields
from collectors.identity import Identity
from collectors.schema import (
    COLLECTIVE_FIGURES,
    GPU_FIELDS,
    HEARTBEAT_FIELDS,
    HOST_FIELDS,
    MEM_FIELDS,
    STEP_FIELDS,
)
from rtop.fmt import safe_text
from rtop.run.ring import FIRST_BLOCK, Rings, nanmedian_rows, nanquantiles_rows
from rtop.run.snapshot import (
    CollectiveFigures,
    GroupFigures,
    NodeColumns,
    ProbeLinks,
    RankColumns,
    RankDetail,
    RunInfo,
    Status,
)
from rtop.run.validate import (
    MAX_ENTRIES,
    MAX_ERROR,
    MAX_MAGNITUDE,
    MAX_NAME,
    MAX_NOTE,
    MAX_OPS,
    MAX_WORD,
    MAX_WORLD,
    ProtocolError,
    check_count,
    check_number,
    check_opt_text,
    check_rows,
    check_text,
    clean_identity,
    clean_meta,
    clean_value,
    described,
)

#: Step fields kept per rank in the rolling window (the figures' ``window``, in wire order).
STEP_HISTORY = window_fields("steps")
#: Sample fields kept per rank (about one value a second); the rest is latest-only.
SAMPLE_HISTORY = ("t_wall", *(PREFIX[t] + f for t in ("gpu", "host", "mem")
                              for f in window_fields(t)))
#: Step fields whose recent medians a snapshot carries (its ``step`` column is the last
#: step reported).
SNAPSHOT_STEP_FIELDS = tuple(f.name for f in FIGURES if f.table == "steps" and f.snapshot
                             and not f.of and f.name != "step")
#: Figures that are a statistic of a step field over each rank's whole rolling window (the
#: figures' ``of`` and ``quantile``: the data wait's, the step's and the exposed comm's
#: p50, p95 and p99).
WINDOW_STATS = tuple(f for f in FIGURES if f.of)
#: The step fields :data:`WINDOW_STATS` are statistics of, each with the quantiles taken
#: of it and their columns in :attr:`RunState.stats` (one sort per field and rank).
STATS_OF: Final = tuple(
    (of, tuple(f.quantile for f in WINDOW_STATS if f.of == of and f.quantile is not None),
     tuple(j for j, f in enumerate(WINDOW_STATS) if f.of == of and f.quantile is not None))
    for of in dict.fromkeys(f.of for f in WINDOW_STATS))
#: Rank-steps a snapshot reads at most for :data:`WINDOW_STATS`, per field it reads
#: (:data:`STATS_OF`): beyond it (more than about 100 ranks with full windows of 1,200
#: steps) each snapshot refreshes a share of the ranks in turn, each at most
#: ``ceil(ranks × window / budget)`` snapshots old (at 2 snapshots a second: 19 s at
#: 4,096 ranks, 75 s at 16,384). A rank's detail computes its own afresh.
STATS_BUDGET: Final = 1 << 17
#: Step figures a node's line takes from its worst rank, and how (larger or smaller).
NODE_WORST = tuple((f.name, np.fmax if f.node == "max" else np.fmin)
                   for f in FIGURES if f.node is not None)

_STEP_PICK = [STEP_FIELDS.index(f) for f in STEP_HISTORY]
_GPU = {f: i for i, f in enumerate(GPU_FIELDS)}
_HOST = {f: i for i, f in enumerate(HOST_FIELDS)}
_MEM = {f: i for i, f in enumerate(MEM_FIELDS)}
_HB = {f: i for i, f in enumerate(HEARTBEAT_FIELDS)}
_GPU_HIST = [_GPU[k] for k in window_fields("gpu")]
_HOST_HIST = [_HOST[k] for k in window_fields("host")]
_MEM_HIST = [_MEM[k] for k in window_fields("mem")]


def _values(indices: Sequence[int]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """The values of a row at ``indices``, as a tuple (``itemgetter``, a tuple even
    for one index)."""
    if len(indices) == 1:
        j = indices[0]
        return lambda row: (row[j],)
    return cast(Callable[[list[Any]], tuple[Any, ...]], itemgetter(*indices))


# What on_batch stores of a checked row, picked in C (None is NaN in the windows)
_STEP_VALUES = _values(_STEP_PICK)
_GPU_VALUES, _HOST_VALUES, _MEM_VALUES = (_values(h) for h in (_GPU_HIST, _HOST_HIST,
                                                                 _MEM_HIST))
_NO_GPU, _NO_HOST, _NO_MEM = ((None,) * len(h) for h in (_GPU_HIST, _HOST_HIST, _MEM_HIST))
_N_GPU, _N_HOST = len(GPU_FIELDS) - 1, len(HOST_FIELDS) - 1
_M_DEVICE, _HB_STACK, _HB_PHASE_S = _MEM["device"], _HB["stack"], _HB["phase_s"]
#: Latest-sample columns (numbers only) kept per slot for snapshots.
LATEST = tuple([f"gpu_{f}" for f in GPU_FIELDS[1:]] + [f"host_{f}" for f in HOST_FIELDS[1:]]
               + [f"mem_{f}" for f in MEM_FIELDS[2:]] + ["phase_s"])
_NAN = float("nan")
#: A frame the hub writes (never a rank: the hub refuses it from one) when a link probe
#: has finished: its result, ``rtop.analysis.links.assemble``'s shape
#: (``{"ranks", "nodes", "matrix_Bps", ...}``), so a replay shows the probe too.
KIND_LINKS: Final = "links"
#: How a rank's connection can end without a goodbye (a ``conn`` close frame's ``how``).
LOST_HOW: Final = ("reset", "eof", "closed")
#: Above this many ranks the rank that arrives last at the allreduce (whose collective
#: time is pure transfer) is a different one each step (a GC pause here, jitter there),
#: so no rank's own median is pure: the transfer is read step by step (each recent
#: step's best rank), not from the best rank's median.
PER_STEP_BEST_MIN_RANKS: Final = 64
#: A frame the hub writes (never a rank: the hub refuses it from one) when the command
#: whose ranks it watches has exited (``rtop run`` tells its own hub):
#: ``{"code": int, "exited_at": hub time}``, the code as a shell reports it.
KIND_JOB_EXIT: Final = "job_exit"
#: A frame the hub writes (never a rank) when it stops hearing its ranks, and again
#: when it hears them again: ``{"paused": bool}``, and ``"since"`` (hub time) when it
#: learns after the fact that it did not hear them (its loop was held up). The hub stops
#: reading its ranks while the recorder's process is far behind (``rtop.hub.recorder``)
#: and does not hear them while it is behind on what they sent. A rank is not silent for
#: time the hub did not hear it: the hub's deaf spans are taken out of its silence
#: (:meth:`RunState.tick`), live and in a replay alike.
KIND_INGEST: Final = "ingest"
#: The hub's deaf spans kept (the oldest forgotten first; a rank's silence is seconds).
MAX_DEAF_SPANS: Final = 256
#: Ranks of the current attempt lost at most this long before their command exited 0
#: ended with the job: their processes finished (``os._exit(0)`` skips the goodbye), the
#: launcher noticed, and its exit reached ``rtop run`` (torchrun looks every 0.1 s, 5 s
#: in older releases).
JOB_EXIT_WINDOW_S: Final = 10.0
#: The ``bye_reason`` of a rank the hub marked ended by its command's exit 0 (it said
#: no goodbye of its own).
JOB_EXIT_REASON: Final = "job_exit"
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


# ---- what the state holds at most -------------------------------------------------------

#: The most ranks whose windows a run state holds at once, unless told otherwise
#: (about 84 kB each with the default windows: 1.4 GB at the limit).
MAX_RANKS: Final = 16384
#: Recent steps whose per-collective figures a rank keeps (for its detail).
COLLECTIVE_STEPS: Final = 64
#: The most (process group, collective) pairs a rank keeps figures of.
MAX_GROUP_OPS: Final = 64
#: Between a group's name and a collective's in a rank's group window (a control
#: character: never in a name the validation made safe).
GROUP_SEP: Final = "\x1f"
#: Groups at most that may wait at once beside the current attempt (see
#: :meth:`RunState.on_hello`); a hello for one more is refused.
MAX_PENDING: Final = 4
#: Groups that waited and left without taking over, kept for the report.
MAX_STRAYS: Final = 8

_S_COLL: Final = STEP_FIELDS.index("collectives")
_S_GROUPS: Final = STEP_FIELDS.index("groups")
_S_COMM: Final = tuple(STEP_FIELDS.index(f) for f in ("comm_s", "comm_bytes", "comm_calls",
                                                       "busbw_Bps"))
_S_CALLS: Final = _S_COMM[2]
_COMM_VALUES = _values(_S_COMM)
_WIDTH: Final = len(COLLECTIVE_FIGURES)


def step_split(row: list[Any]) -> dict[str, list[float | int | None]] | None:
    """A checked step row's per-collective figures: its ``collectives`` map, or, when
    it has none, its own comm figures as the allreduce's (the step's collectives were
    all allreduces: a DDP model's, or an older collector's); None when it ran none."""
    split = row[_S_COLL]
    if split is not None:
        return split  # type: ignore[no-any-return]
    calls = row[_S_COMM[2]]
    if isinstance(calls, int) and calls > 0:
        return {"all_reduce": [row[j] for j in _S_COMM]}
    return None


class CollectiveWindow:
    """One rank's per-collective figures over its last ``keep`` steps: per collective
    a flat ring of ``len(COLLECTIVE_FIGURES)`` floats a step (NaN: not measured)."""

    __slots__ = ("keep", "most", "rings")

    def __init__(self, keep: int = COLLECTIVE_STEPS, most: int = MAX_OPS) -> None:
        self.keep = keep
        self.most = most  # collectives kept at most (the first ones seen)
        #: op -> [ring, next slot, steps held]
        self.rings: dict[str, list[Any]] = {}

    def add(self, split: dict[str, list[float | int | None]]) -> None:
        """One step's figures (:func:`step_split`)."""
        for op, figures in split.items():
            self.add_one(op, figures)

    def add_one(self, op: str, figures: Sequence[float | int | None]) -> None:
        """One step's figures of one collective (``COLLECTIVE_FIGURES``)."""
        entry = self.rings.get(op)
        if entry is None:
            if len(self.rings) >= self.most:
                return
            entry = self.rings[op] = [array("d", [_NAN]) * (self.keep * _WIDTH), 0, 0]
        at = entry[1]
        # figures are checked to be COLLECTIVE_FIGURES long (validate.clean_split)
        entry[0][at * _WIDTH:(at + 1) * _WIDTH] = array("d", cast(Sequence[float], figures)) \
            if None not in figures else array("d", [_NAN if v is None else v
                                                    for v in figures])
        entry[1] = at + 1 if at + 1 < self.keep else 0
        if entry[2] < self.keep:
            entry[2] += 1

    def medians(self) -> dict[str, CollectiveFigures]:
        """Per collective, the median of each figure over the steps held in which it
        ran, most time first."""
        width = len(COLLECTIVE_FIGURES)
        out: list[tuple[float, str, CollectiveFigures]] = []
        for op, (ring, _, n) in self.rings.items():
            med: list[float | None] = []
            for k in range(width):
                vals = [v for v in ring[k:n * width:width] if not math.isnan(v)]
                med.append(statistics.median(vals) if vals else None)
            out.append((-(med[0] or 0.0), op, CollectiveFigures(
                s=med[0], bytes=med[1], calls=med[2], busbw_Bps=med[3], steps=n)))
        return {op: figures for _, op, figures in sorted(out)}


def _num(x: Any) -> float:
    """A checked row's number (see :func:`check_rows`) for an array: None is NaN."""
    out: float = _NAN if x is None else x
    return out


@dataclass
class JobExit:
    """The command's exit, as its ``job_exit`` frame said (see :data:`KIND_JOB_EXIT`)."""

    code: int
    exited_at: float  # hub time the command exited
    #: ranks of the current attempt its exit 0 ended (lost without a goodbye just before)
    ended: list[int] = field(default_factory=list)
    #: the earliest of their losses (hub time): a lost-rank finding they alone made
    #: started at or after it
    since: float | None = None


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
    #: the ``seq`` of the last batch applied from this rank process (a batch at or below
    #: it, sent again after a reconnect or found again in a spool, is not applied twice)
    last_seq: int | None = None
    events: deque[list[Any]] = field(default_factory=lambda: deque(maxlen=64))
    collector: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, float | None] = field(default_factory=dict)  # once the window is freed
    lost_at: float | None = None  # hub time it was marked lost
    #: how it was lost: "reset" (connection reset), "eof" (connection closed), "closed"
    #: (closed, how not known: an older recording) or "silent" (nothing for the timeout)
    lost_how: str | None = None
    #: the reason its goodbye gave ("closed", "exit", "signal"), None before one;
    #: :data:`JOB_EXIT_REASON` when it said none and its command's exit 0 ended it
    bye_reason: str | None = None
    #: the rank's wall time when it warmed up (its WARMUP_STEPS-th step, or WARMUP_S after
    #: its first for slow steps): the first steps are slow (allocations, caches, loader
    #: workers starting) and memory grows meanwhile, neither of which is a finding
    warm_wall: float | None = None
    first_wall: float | None = None  # wall time of its first step
    #: the collector's own CPU use, as a share of one core (from its sender thread's CPU
    #: time between batches at least a second apart)
    rtop_cpu: float | None = None
    cpu_mark: tuple[float, float] | None = None  # (cpu_s, t_hub) of the last estimate
    #: its recent steps split by collective (made at its first step that ran one)
    collectives: CollectiveWindow | None = None
    #: its recent steps split by process group and collective (``group GROUP_SEP op``),
    #: made at its first step that ran a collective outside the default group
    groups: CollectiveWindow | None = None

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
    attempts are kept (the oldest is forgotten beyond that); at most ``max_ranks``
    ranks have windows at a time (a hello beyond that is refused).
    """

    def __init__(self, *, window_steps: int = 1200, window_samples: int = 600,
                 lost_after_s: float = 10.0, keep_attempts: int = 3,
                 recent_steps: int = 20, max_ranks: int = MAX_RANKS) -> None:
        self.max_ranks = max_ranks
        first = min(FIRST_BLOCK, max_ranks)  # the first block of rank slots
        self.steps = Rings(STEP_HISTORY, window_steps, first)
        self.samples = Rings(SAMPLE_HISTORY, window_samples, first)
        self.latest = np.full((self.steps.slots, len(LATEST)), np.nan)
        #: per slot, the :data:`WINDOW_STATS` as of its last refresh (see :meth:`view`)
        self.stats = np.full((self.steps.slots, len(WINDOW_STATS)), np.nan)
        self._stats_turn = 0
        self._latest_idx = {f: i for i, f in enumerate(LATEST)}
        #: the column of each latest-sample figure in :attr:`latest`
        self.latest_index = self._latest_idx
        self.lost_after_s = lost_after_s
        self.keep_attempts = keep_attempts
        self.recent_steps = recent_steps
        self.attempts: list[Attempt] = []
        #: groups that said hello while another attempt ran, waiting to take over
        #: (:meth:`_takes_over`), by group; their ranks hold windows meanwhile
        self.pending: dict[str, Attempt] = {}
        #: groups that waited and ended without taking over (a second job, a stray)
        self.strays: deque[Attempt] = deque(maxlen=MAX_STRAYS)
        self._by_group: dict[str, Attempt] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.started: float | None = None
        self.now = 0.0
        self.run_info: dict[str, Any] = {}
        self.frames = 0
        self.step_records = 0
        self.bad_frames = 0
        #: batches not applied because their rank process's batch of that ``seq`` was
        self.duplicate_frames = 0
        self._links: ProbeLinks | None = None
        self._links_attempt: int | None = None
        #: the command's exit, once a ``job_exit`` frame said it (:meth:`on_job_exit`)
        self.job_exit: JobExit | None = None
        #: grows with every rank's meta update (what the analysis reads of the metas, a
        #: rank's process groups, is read again only then)
        self.meta_version = 0
        #: since when (hub time) the hub does not hear its ranks (None: it does; an
        #: ``ingest`` frame says: :data:`KIND_INGEST`)
        self.deaf_since: float | None = None
        #: the hub's past deaf spans, ``(from, to)`` in hub time, oldest first
        self.deaf_spans: deque[tuple[float, float]] = deque(maxlen=MAX_DEAF_SPANS)

    # ---- attempts, ranks, slots -----------------------------------------------------

    @property
    def current(self) -> Attempt | None:
        """The latest attempt."""
        return self.attempts[-1] if self.attempts else None

    def _grow(self, slots: int, most: int | None = None) -> None:
        self.steps.ensure(slots, most)
        self.samples.ensure(slots, most)
        have = self.latest.shape[0]
        if self.steps.slots > have:
            grown = np.full((self.steps.slots, len(LATEST)), np.nan)
            grown[:have] = self.latest
            self.latest = grown
            stats = np.full((self.steps.slots, len(WINDOW_STATS)), np.nan)
            stats[:have] = self.stats
            self.stats = stats

    def _slot(self, att: Attempt) -> int:
        """A free rank slot for a new rank of ``att``: a freed one, else a new one (the
        arrays grow in steps as ranks arrive, never past what the ranks of ``att`` yet
        to come could need), else the windows of ended attempts' ranks given up; at
        ``max_ranks`` slots with none to give up, the rank is refused."""
        if not self._free_slots:
            self._reclaim(force=self._next_slot >= self.max_ranks)
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self._next_slot < self.max_ranks:
            slot = self._next_slot
            self._next_slot += 1
            to_come = max(1, att.world_size - len(att.ranks))
            self._grow(slot + 1, min(self.max_ranks, slot + to_come))
        else:
            raise ProtocolError(
                f"rank budget exhausted: the hub holds the windows of {self.max_ranks} "
                "ranks, its limit, and no ended attempt has any left to give up")
        self.steps.clear(slot)
        self.samples.clear(slot)
        self.latest[slot] = np.nan
        self.stats[slot] = np.nan
        return slot

    def _room(self, new_attempt: bool) -> bool:
        """Whether one more rank can have a slot (see :meth:`_slot`)."""
        if self._free_slots or self._next_slot < self.max_ranks:
            return True
        return any(rs.slot is not None for att in self._spent(new_attempt)
                   for rs in att.ranks.values())

    def _spent(self, new_attempt: bool = True) -> list[Attempt]:
        """Attempts whose windows may be given up for a new rank: the ended ones, and,
        for a rank of a new group, the current one once none of its ranks is live (the
        new group takes over from it)."""
        cur = self.current
        if new_attempt and cur is not None and not self._live(cur):
            return list(self.attempts)
        return self.attempts[:-1]

    def _reclaim(self, force: bool = False) -> None:
        """Free the windows of ended attempts' ranks once the current attempt needs more
        room than its world size allows for (or, ``force``, at the hub's limit); a short
        summary of each is kept."""
        cur = self.current
        if not force and (cur is None or self._next_slot < self._slot_budget(cur)):
            return
        for att in (self._spent() if force else self.attempts[:-1]):
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

    @staticmethod
    def group_of(ident: Identity) -> str:
        """The worker group a rank belongs to: its identity's ``group``, else its job and
        attempt (an attempt is one group's ranks)."""
        return ident.group or f"{ident.job}#{ident.attempt}"

    def _attempt_for(self, ident: Identity, t_hub: float) -> Attempt:
        """The attempt of ``ident``'s group; a group not seen yet waits (``pending``)
        until :meth:`_settle` finds it takes over."""
        group = self.group_of(ident)
        att = self._by_group.get(group)
        if att is not None:
            return att
        if len(self.pending) >= MAX_PENDING:
            raise ProtocolError(
                f"{MAX_PENDING} groups already wait beside the running attempt; rank "
                f"{ident.rank} of group {group!r} (job {ident.job!r}) refused")
        att = Attempt(-1, group, ident.job, ident.world_size, t_hub)  # numbered once current
        self.pending[group] = att
        self._by_group[group] = att
        # no room is made for the claimed world size: windows come as ranks do (_slot)
        return att

    def is_current(self, rs: RankState) -> bool:
        """Whether ``rs`` is a rank of the current attempt."""
        cur = self.current
        return cur is not None and cur.ranks.get(rs.rank) is rs

    @staticmethod
    def _live(att: Attempt) -> list[RankState]:
        return [rs for rs in att.ranks.values() if rs.status == "active" and rs.connected]

    def _takes_over(self, att: Attempt) -> bool:
        """Whether a waiting group is the job's new attempt, not a stray.

        A new worker group takes over when the running one is over (none of its ranks
        is active and connected: it ended, failed or was torn down), or when it is whole
        (every rank of its world size connected) and either the running one is going
        (a rank of it failed, left or was lost: a restart after a failure, same job) or
        is smaller than it. So one stray hello, even as rank 0 of a world of 1, neither
        hides a running job nor makes its ranks look lost.
        """
        cur = self.current
        if cur is None:
            return True
        live = self._live(cur)
        if not live:
            return True
        if len(self._live(att)) < att.world_size:
            return False
        going = len(live) < len(cur.ranks) or len(cur.ranks) < cur.world_size
        return (going and att.job == cur.job) or att.world_size > len(live)

    def _settle(self, t_hub: float) -> None:
        """Let a waiting group take over, and end the waiting groups whose ranks are
        all gone (kept as strays for the report, their windows given up)."""
        for att in list(self.pending.values()):
            if att.group in self.pending and self._takes_over(att):
                self._promote(att)
        for att in list(self.pending.values()):
            if not self._live(att):
                del self.pending[att.group]
                self._by_group.pop(att.group, None)
                for rs in att.ranks.values():
                    if rs.slot is not None:
                        rs.summary = self._summarise(rs)
                        self._free_slots.append(rs.slot)
                        rs.slot = None
                self.strays.append(att)

    def _promote(self, att: Attempt) -> None:
        """A waiting group becomes the current attempt (the next number)."""
        del self.pending[att.group]
        att.number = max((a.number for a in self.attempts), default=-1) + 1
        for rs in att.ranks.values():
            rs.attempt = att.number
        for old in self.attempts:
            for rs in old.ranks.values():
                # still running, or gone without a word (Ray Train tears the group down,
                # killing its ranks; lost_at/lost_how still say when and how): the new
                # attempt replaced them. A rank that said it failed, exited or finished
                # keeps its word.
                if rs.status in ("active", "lost"):
                    rs.status = "ended"
        self.attempts.append(att)
        while len(self.attempts) > self.keep_attempts:
            gone = self.attempts.pop(0)
            del self._by_group[gone.group]
            self._free_slots += [rs.slot for rs in gone.ranks.values() if rs.slot is not None]

    @staticmethod
    def _slot_budget(att: Attempt) -> int:
        """Slots kept before ended attempts' windows are given up: the world size, a
        quarter more, and 64 (never more than ``max_ranks`` are held: see _slot)."""
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

    def apply(self, frame: wire.Frame, t_hub: float, history: bool = True, *,
              peer: RankState | None = None) -> RankState | None:
        """Apply one frame received (or replayed) at hub time ``t_hub``.

        Returns the rank the frame belongs to, if any. Raises :class:`ProtocolError` for
        a frame whose content breaks the protocol; nothing of it is applied then.
        ``history=False`` keeps the ranks' state and latest values but not the rolling
        windows: a replay seeking far ahead skips what newer frames would push out of
        the windows anyway. ``peer`` is the rank the connection the frame came on has
        introduced (the hub's; None before its hello, and for a recording): one
        connection is one rank, so a hello or a frame for another rank is refused.
        """
        if not -MAX_MAGNITUDE <= t_hub <= MAX_MAGNITUDE:
            raise ProtocolError(f"a frame at hub time {t_hub!r}")
        if t_hub > self.now:
            self.now = t_hub
        if self.started is None and t_hub > 0:
            self.started = t_hub
        self.frames += 1
        kind, p = frame.kind, frame.payload
        if kind == wire.KIND_BATCH:  # the most frames by far
            rs = self._rank_of(p, peer)
            seq = p.get("seq")
            if type(seq) is int and seq > 0:  # see is_duplicate
                if rs.last_seq is not None and seq <= rs.last_seq:
                    self.duplicate_frames += 1
                    return rs
                self.on_batch(rs, p, t_hub, history)
                rs.last_seq = seq
            else:
                self.on_batch(rs, p, t_hub, history)
        elif kind == wire.KIND_HELLO:
            rs = self.on_hello(p, t_hub, peer=peer)
        elif kind in (wire.KIND_BYE, "offset") or (
                kind == "conn" and p.get("event") == "close"):
            rs = self._rank_of(p, peer)
            if kind == wire.KIND_BYE:
                self.on_bye(rs, p, t_hub)
            elif kind == "offset":
                offset = check_number("offset: 'offset_s'", p.get("offset_s"))
                rtt = check_number("offset: 'rtt_s'", p.get("rtt_s"))
                rs.offset_s, rs.rtt_s = offset, rtt
            else:
                how = p.get("how")
                self.on_disconnect(rs, t_hub, how if how in LOST_HOW else "closed")
        else:
            rs = None
            if kind == wire.KIND_RUN:
                self.run_info = clean_value("run", dict(p))
            elif kind == KIND_LINKS:
                if peer is not None:
                    raise ProtocolError("a rank may not send a link probe's result")
                self.set_links(p, t_hub)
            elif kind == KIND_JOB_EXIT:
                if peer is not None:
                    raise ProtocolError("a rank may not say how its command exited")
                self.on_job_exit(p, t_hub)
            elif kind == KIND_INGEST:
                if peer is not None:
                    raise ProtocolError("a rank may not say when the hub reads")
                self.on_ingest(p, t_hub)
            # clock frames and unknown kinds only move time forward
        return rs

    def is_duplicate(self, frame: wire.Frame, rs: RankState | None) -> bool:
        """Whether ``frame`` is a batch that rank ``rs``'s process already delivered (a
        rank sends again what its hub had not acknowledged when a connection broke):
        :meth:`apply` does not apply it, and a hub does not record it again. A batch
        without a ``seq`` of 1 or more (a collector counts from 1) is never one."""
        seq = frame.payload.get("seq") if frame.kind == wire.KIND_BATCH else None
        return (rs is not None and type(seq) is int and seq > 0 and rs.last_seq is not None
                and seq <= rs.last_seq)

    def _rank_of(self, p: dict[str, Any], peer: RankState | None = None) -> RankState:
        rank = p.get("rank")
        if type(rank) is not int:
            raise ProtocolError(f"frame without an integer 'rank' (got {described(rank)})")
        group = p.get("group")
        if group is not None and not isinstance(group, str):
            raise ProtocolError(f"'group' must be a string, got {described(group)}")
        if group and not (len(group) <= MAX_NAME and group.isprintable()):
            group = safe_text(group, MAX_NAME)  # else already safe: as it is
        rs = self.rank_state(rank, group or None)
        if rs is None:
            raise ProtocolError(f"frame for rank {rank} before its hello")
        if peer is not None and rs is not peer:
            raise ProtocolError(f"one connection is one rank: this connection speaks for "
                                f"rank {peer.rank}, not rank {rank}")
        return rs

    def on_hello(self, p: dict[str, Any], t_hub: float, *, peer: RankState | None = None
                 ) -> RankState:
        """A rank introduced itself: find or make its state in the right attempt.

        Refused (:class:`ProtocolError`) when its identity is malformed, when the
        connection already speaks for another rank (``peer``), and when the hub holds
        as many ranks as it may (``max_ranks``).
        """
        ident = clean_identity(p.get("identity"))
        collector = clean_value("collector", p["collector"]) \
            if isinstance(p.get("collector"), dict) else None
        group = self.group_of(ident)
        if peer is not None and (peer.rank != ident.rank
                                 or self.group_of(peer.identity) != group):
            raise ProtocolError(f"one connection is one rank: this connection speaks for "
                                f"rank {peer.rank}, not rank {ident.rank} of group {group!r}")
        att = self._by_group.get(group)
        rs = att.ranks.get(ident.rank) if att is not None else None
        if rs is None:
            if not self._room(new_attempt=att is None):
                raise ProtocolError(
                    f"rank budget exhausted: the hub holds the windows of {self.max_ranks} "
                    f"ranks, its limit; rank {ident.rank} of {ident.world_size} "
                    f"(job {ident.job!r}) refused")
            att = self._attempt_for(ident, t_hub)
            rs = RankState(ident, att.number, self._slot(att), first_seen=t_hub)
            att.ranks[ident.rank] = rs
        assert att is not None
        if (rs.identity.pid, rs.identity.hostname) != (ident.pid, ident.hostname):
            rs.last_seq = None  # another process in this rank's place counts afresh
        rs.identity = ident
        rs.status, rs.connected, rs.last_seen = "active", True, t_hub
        rs.lost_at = rs.lost_how = rs.bye_reason = None
        if collector is not None:
            rs.collector = collector
        att.world_size = max(att.world_size, ident.world_size)
        if att.number < 0:
            self._settle(t_hub)
        return rs

    def on_bye(self, rs: RankState, p: dict[str, Any], t_hub: float) -> None:
        """The rank said goodbye: finished, exited, or failed with an error."""
        reason = check_opt_text("bye: 'reason'", p.get("reason"), MAX_WORD)
        error = check_opt_text("bye: 'error'", p.get("error"), MAX_ERROR, multiline=True)
        dropped = check_count("bye: 'dropped'", p.get("dropped"))
        rs.status = "failed" if error else ("exited" if reason == "exit" else "finished")
        rs.connected, rs.last_seen = False, t_hub
        rs.bye_reason = reason
        if error:
            rs.meta["error"] = error
        if dropped is not None:
            rs.dropped = dropped
        if self.pending:
            self._settle(t_hub)

    def on_batch(self, rs: RankState, p: dict[str, Any], t_hub: float,
                 history: bool = True) -> None:
        """Records from a rank (all of it checked before anything is stored)."""
        get = p.get
        # a table absent or empty has no rows to check
        steps = check_rows("steps", x) if (x := get("steps")) else []
        gpu = check_rows("gpu", x) if (x := get("gpu")) else []
        host = check_rows("host", x) if (x := get("host")) else []
        mem = check_rows("mem", x) if (x := get("mem")) else []
        hbs = check_rows("hb", x) if (x := get("hb")) else []
        events = check_rows("events", x) if (x := get("events")) else []
        meta = clean_meta(p["meta"]) if get("meta") is not None else None
        if meta is not None:
            p["meta"] = meta
            grown = len(rs.meta.keys() | meta.keys())
            if grown > MAX_ENTRIES:
                raise ProtocolError(f"meta would hold {grown} entries (at most "
                                    f"{MAX_ENTRIES})")
        dropped = check_count("batch: 'dropped'", get("dropped"))
        cpu = check_number("batch: 'cpu_s'", get("cpu_s"))
        slot = rs.slot
        if steps:
            if slot is not None and history:
                self._steps(rs, slot, steps)
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
                dev = mem[-1][_M_DEVICE]
                rs.mem_device = dev if isinstance(dev, str) else None
            if slot is not None:
                self._samples(slot, gpu, host, mem, history)
        if hbs:
            for hb in hbs:
                if hb[_HB_STACK]:
                    rs.stack, rs.stack_t = hb[_HB_STACK], t_hub
            rs.hb = hbs[-1]
            if slot is not None:
                self.latest[slot, -1] = _num(hbs[-1][_HB_PHASE_S])
        if events:
            rs.events.extend(events)
        if meta is not None:
            rs.meta.update(meta)
            self.meta_version += 1
        if dropped is not None:
            rs.dropped = dropped
        if cpu is not None:
            mark = rs.cpu_mark
            if mark is None or cpu < mark[0]:
                rs.cpu_mark = (float(cpu), t_hub)
            elif t_hub - mark[1] >= 1.0:
                rs.rtop_cpu = (cpu - mark[0]) / (t_hub - mark[1])
                rs.cpu_mark = (float(cpu), t_hub)
        rs.last_seen = t_hub
        if rs.status == "lost":
            rs.status, rs.lost_at, rs.lost_how = "active", None, None
        rs.connected = True

    def _steps(self, rs: RankState, slot: int, steps: list[list[Any]]) -> None:
        """Checked step rows into the rank's windows: its step window, and its figures
        by collective and by process group."""
        append = self.steps.append
        for row in steps:
            append(slot, [*_STEP_VALUES(row)])
            split = row[_S_COLL]
            if split is not None:
                if rs.collectives is None:
                    rs.collectives = CollectiveWindow()
                rs.collectives.add(split)
            else:  # all allreduces (see step_split): the step's own comm figures
                calls = row[_S_CALLS]
                if isinstance(calls, int) and calls > 0:
                    if rs.collectives is None:
                        rs.collectives = CollectiveWindow()
                    rs.collectives.add_one("all_reduce", _COMM_VALUES(row))
            by_group = row[_S_GROUPS]
            if by_group:
                if rs.groups is None:
                    rs.groups = CollectiveWindow(most=MAX_GROUP_OPS)
                rs.groups.add({f"{g}{GROUP_SEP}{op}": figures
                               for g, ops in by_group.items()
                               for op, figures in ops.items()})

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
        latest = self.latest[slot]  # None is NaN in a float array
        if gpu and host and mem:  # the usual: one store
            latest[:-1] = gpu[-1][1:] + host[-1][1:] + mem[-1][2:]
        else:
            if gpu:
                latest[:_N_GPU] = gpu[-1][1:]
            if host:
                latest[_N_GPU:_N_GPU + _N_HOST] = host[-1][1:]
            if mem:
                latest[_N_GPU + _N_HOST:-1] = mem[-1][2:]
        if not history:
            return
        append = self.samples.append
        n_gpu, n_host, n_mem = len(gpu), len(host), len(mem)
        for i in range(max(n_gpu, n_host, n_mem)):
            g = gpu[i] if i < n_gpu else None
            h = host[i] if i < n_host else None
            m = mem[i] if i < n_mem else None
            src = g or h or m
            append(slot, [src[0] if src else None,
                          *(_GPU_VALUES(g) if g else _NO_GPU),
                          *(_HOST_VALUES(h) if h else _NO_HOST),
                          *(_MEM_VALUES(m) if m else _NO_MEM)])

    def on_disconnect(self, rs: RankState, t_hub: float, how: str = "closed") -> None:
        """The rank's connection closed (``how``: "reset", "eof" or "closed", see
        :data:`LOST_HOW`); without a bye it is lost until it reconnects."""
        rs.connected = False
        if rs.status == "active":
            rs.status = "lost"
            rs.lost_at = t_hub
            rs.lost_how = how
            rs.last_seen = min(rs.last_seen, t_hub)
            ended = self.job_exit
            if ended is not None and ended.code == 0 and self.is_current(rs):
                self._ended_by_exit(rs, ended)  # closing after its command exited 0
        if self.pending:
            self._settle(t_hub)

    def on_job_exit(self, p: dict[str, Any], t_hub: float) -> None:
        """The command whose ranks these are exited (a ``job_exit`` frame, the hub's
        word). With code 0, ranks of the current attempt lost without a goodbye at most
        :data:`JOB_EXIT_WINDOW_S` before it (or later) ended with the job: their status
        becomes "exited" and their ``bye_reason`` :data:`JOB_EXIT_REASON` (``lost_at``
        and ``lost_how`` still say when and how they went). Any other code changes
        nothing: a crash is still a crash."""
        code = p.get("code")
        if type(code) is not int:
            raise ProtocolError(f"job_exit without an integer 'code' (got {described(code)})")
        at = check_number("job_exit: 'exited_at'", p.get("exited_at"))
        ended = JobExit(code, float(at) if at is not None else t_hub)
        self.job_exit = ended
        if code != 0:
            return
        for rs in self.active_ranks():
            lost_at = rs.lost_at if rs.lost_at is not None else rs.last_seen
            if rs.status == "lost" and lost_at >= ended.exited_at - JOB_EXIT_WINDOW_S:
                self._ended_by_exit(rs, ended)

    @staticmethod
    def _ended_by_exit(rs: RankState, ended: JobExit) -> None:
        rs.status, rs.bye_reason = "exited", JOB_EXIT_REASON
        ended.ended.append(rs.rank)
        lost_at = rs.lost_at if rs.lost_at is not None else rs.last_seen
        ended.since = lost_at if ended.since is None else min(ended.since, lost_at)

    @property
    def deaf(self) -> bool:
        """The hub does not hear its ranks now."""
        return self.deaf_since is not None

    def on_ingest(self, p: dict[str, Any], t_hub: float) -> None:
        """The hub stopped hearing its ranks (``paused``), or hears them again (and did
        not since ``since``, if said) (see :data:`KIND_INGEST`)."""
        paused = p.get("paused")
        if type(paused) is not bool:
            raise ProtocolError(f"ingest without a true or false 'paused' (got "
                                f"{described(paused)})")
        since = check_number("ingest: 'since'", p.get("since"))
        last = self.deaf_spans[-1][1] if self.deaf_spans else -math.inf
        if paused:
            if self.deaf_since is None:
                self.deaf_since = max(t_hub, last)
            return
        start = self.deaf_since if self.deaf_since is not None else since
        self.deaf_since = None
        if start is not None and min(max(start, last), t_hub) < t_hub:
            self.deaf_spans.append((min(max(start, last), t_hub), t_hub))

    def deaf_within(self, since: np.ndarray, b: float) -> np.ndarray:
        """Seconds from each of the hub times ``since`` to ``b`` that the hub did not hear
        its ranks (zeros when it always heard)."""
        total = np.zeros(len(since))
        if not len(since) or (not self.deaf_spans and self.deaf_since is None):
            return total
        first = float(np.nanmin(since)) if not np.isnan(since).all() else -math.inf
        spans = [sp for sp in self.deaf_spans if sp[1] > first]
        if self.deaf_since is not None:
            spans.append((self.deaf_since, b))
        for start, end in spans:
            total += np.maximum(0.0, np.minimum(end, b) - np.maximum(start, since))
        return total

    def _silent(self, rs: RankState, t_hub: float) -> float | None:
        """When an active rank became silent (``lost_after_s`` heard without a frame
        from it, the hub's deaf spans not counted), if it is by ``t_hub``."""
        if rs.status != "active" or t_hub - rs.last_seen <= self.lost_after_s:
            return None
        deaf = float(self.deaf_within(np.array([rs.last_seen]), t_hub)[0]) \
            if self.deaf_spans else 0.0
        if t_hub - rs.last_seen - deaf <= self.lost_after_s:
            return None
        return rs.last_seen + self.lost_after_s + deaf

    def tick(self, t_hub: float) -> list[RankState]:
        """Mark silent ranks lost; returns the ranks newly marked. A rank is silent once
        ``lost_after_s`` passed since its last frame, the time the hub did not hear its
        ranks not counted (:data:`KIND_INGEST`); none is while it does not."""
        self.now = max(self.now, t_hub)
        newly: list[RankState] = []
        if self.deaf:
            return newly
        for rs in self.active_ranks():
            if (at := self._silent(rs, t_hub)) is not None:
                rs.status, rs.lost_at, rs.lost_how = "lost", at, "silent"
                newly.append(rs)
        for att in list(self.pending.values()):
            for rs in att.ranks.values():
                if (at := self._silent(rs, t_hub)) is not None:
                    rs.status, rs.lost_at, rs.lost_how = "lost", at, "silent"
        if self.pending:
            self._settle(t_hub)
        return newly

    # ---- the link probe -----------------------------------------------------------

    def set_links(self, result: dict[str, Any], t: float) -> None:
        """Keep a finished link probe's result (``rtop.analysis.links.assemble``'s
        ``{"ranks", "nodes", "matrix_Bps", "seconds", "nbytes", "errors"}``, from the
        hub or a recording), as of hub time ``t``, in place of the previous one; with it
        the allreduce's bus bandwidth just then (the best rank's recent median), which
        the ``slow_link`` detector judges the allreduce against from then on.

        Checked like any frame (:class:`ProtocolError`, nothing kept): ranks distinct
        integers in range, at most ``max_ranks``; a node name (made safe) per rank; a
        square matrix of numbers or None, as wide as the ranks (a negative or
        non-finite figure is "not measured"). Only measured links are kept, as
        ``[i, j, Bps]`` with ``i < j`` and the slower of the two directions.
        """
        if not isinstance(result, dict):
            raise ProtocolError(f"a link probe's result must be a map, got {described(result)}")
        ranks, nodes, matrix = result.get("ranks"), result.get("nodes"), \
            result.get("matrix_Bps")
        if not isinstance(ranks, list) or not all(
                type(r) is int and 0 <= r < MAX_WORLD for r in ranks):
            raise ProtocolError("links: 'ranks' must be a list of rank numbers")
        n = len(ranks)
        if n > self.max_ranks or len(set(ranks)) != n:
            raise ProtocolError(f"links: {n} ranks, distinct and at most {self.max_ranks}")
        if not isinstance(nodes, list) or len(nodes) != n:
            raise ProtocolError("links: 'nodes' must name the node of each rank")
        names = [check_text("links: a node", x, MAX_NAME) for x in nodes]
        if not isinstance(matrix, list) or len(matrix) != n:
            raise ProtocolError(f"links: 'matrix_Bps' must have {n} rows")
        m = np.full((n, n), np.nan)
        for i, row in enumerate(matrix):
            if not isinstance(row, list) or len(row) != n:
                raise ProtocolError(f"links: 'matrix_Bps' row {i} must have {n} values")
            if not all(v is None or type(v) in (int, float) for v in row):
                raise ProtocolError(f"links: 'matrix_Bps' row {i} holds a value that is "
                                    "not a number")
            m[i] = [_NAN if v is None else v for v in row]
        with np.errstate(invalid="ignore"):
            m[~np.isfinite(m) | (m < 0) | (m > MAX_MAGNITUDE)] = np.nan
        both = np.fmin(m, m.T)  # the slower direction where both were measured
        iu, ju = np.triu_indices(n, 1)
        vals = both[iu, ju]
        keep = ~np.isnan(vals)
        links = [[int(i), int(j), float(v)] for i, j, v in
                 zip(iu[keep].tolist(), ju[keep].tolist(), vals[keep].tolist(), strict=True)]
        errors = result.get("errors")
        err_list = [safe_text(_error_line(e), MAX_NOTE) for e in errors[:MAX_ENTRIES]] \
            if isinstance(errors, list) else []
        self._links = ProbeLinks(
            t=float(t), ranks=list(ranks), nodes=names, links=links,
            busbw_Bps=self._busbw_now(),
            seconds=check_number("links: 'seconds'", result.get("seconds")),
            nbytes=check_number("links: 'nbytes'", result.get("nbytes")),
            errors=err_list)
        self._links_attempt = self.current.number if self.current else None

    @property
    def links(self) -> ProbeLinks | None:
        """The latest link probe, if it was of the current attempt (else None: a new
        worker group is new ranks, perhaps on other nodes)."""
        cur = self.current
        if self._links is None or (cur.number if cur else None) != self._links_attempt:
            return None
        return self._links

    def _busbw_now(self) -> float | None:
        """The allreduce's bus bandwidth now, as the diagnosis reads it (``slow_link``):
        the best rank's recent median (the last to arrive, whose time is pure transfer);
        above :data:`PER_STEP_BEST_MIN_RANKS` ranks, each recent step's best, the median
        over those steps."""
        ranks = [r for r in self.active_ranks() if r.status == "active" and r.slot is not None]
        if not ranks:
            return None
        if len(ranks) <= PER_STEP_BEST_MIN_RANKS:
            med, _ = self.window(ranks, self.recent_steps)
            col = med[:, self.steps.index["busbw_Bps"]]
            return None if np.isnan(col).all() else float(np.nanmax(col))
        slots = np.array([r.slot for r in ranks], dtype=np.int64)
        per_step = self.steps.last(slots, self.recent_steps, ["busbw_Bps"])[:, :, 0].astype(
            np.float64)
        have = ~np.isnan(per_step).all(axis=0)
        if not have.any():
            return None
        return float(np.nanmedian(np.nanmax(per_step[:, have], axis=0)))

    # ---- views ------------------------------------------------------------------------

    def window(self, ranks: list[RankState], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Medians of the last ``k`` steps ``(n, len(STEP_HISTORY))`` and the latest
        samples ``(n, len(LATEST))`` of ``ranks`` (NaN where missing)."""
        return self._window(*self._slots(ranks), k)

    @staticmethod
    def _slots(ranks: list[RankState]) -> tuple[np.ndarray, np.ndarray]:
        """Each rank's slot (0 where its window is gone), and whether it is gone."""
        slots = np.array([r.slot if r.slot is not None else 0 for r in ranks], dtype=np.int64)
        return slots, np.array([r.slot is None for r in ranks], dtype=bool)

    def _window(self, slots: np.ndarray, gone: np.ndarray, k: int
                ) -> tuple[np.ndarray, np.ndarray]:
        med = nanmedian_rows(self.steps.last(slots, k)) if len(slots) else \
            np.empty((0, len(STEP_HISTORY)))
        latest = self.latest[slots] if len(slots) else np.empty((0, len(LATEST)))
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
        slots, gone = self._slots(ranks)
        med, latest = self._window(slots, gone, k)
        now = self.now
        cols: dict[str, list[Any]] = {
            "rank": [r.rank for r in ranks],
            "node": [r.node for r in ranks],
            "local_rank": [r.identity.local_rank for r in ranks],
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
        stats = self._stats(slots, gone)
        for j, stat in enumerate(WINDOW_STATS):
            cols[stat.name] = column(stats[:, j])
        att = self.current
        run = RunInfo(
            job=att.job if att else "",
            # the hub's name for the job (a recording's run header is a peer's word too)
            name=safe_text(str(self.run_info.get("job") or ""), MAX_NAME),
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
            run["record"] = safe_text(self.run_info["record"], 4096)
        if self.deaf_since is not None:
            run["deaf_s"] = max(0.0, now - self.deaf_since)
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
        for f, worst in NODE_WORST:
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
            "collectives": rs.collectives.medians() if rs.collectives is not None else {},
            "groups": group_figures(rs),
        }
        if rs.slot is not None:
            detail["steps"] = {f: column(self.steps.history(f, rs.slot))
                               for f in self.steps.fields}
            detail["samples"] = {f: column(self.samples.history(f, rs.slot))
                                 for f in self.samples.fields}
            now = self._window_stats(np.array([rs.slot]))[0]
            detail["stats"] = {f.name: None if math.isnan(v) else float(v)
                               for f, v in zip(WINDOW_STATS, now.tolist(), strict=True)}
        return detail

    def _window_stats(self, slots: np.ndarray) -> np.ndarray:
        """The :data:`WINDOW_STATS` of ``slots`` over their whole rolling windows, now:
        ``(len(slots), len(WINDOW_STATS))``, NaN where a slot has no value."""
        out = np.full((len(slots), len(WINDOW_STATS)), np.nan)
        if len(slots):
            for of, qs, cols in STATS_OF:
                out[:, cols] = nanquantiles_rows(self.steps.stored(slots, of), qs)
        return out

    def _stats(self, slots: np.ndarray, gone: np.ndarray) -> np.ndarray:
        """The :data:`WINDOW_STATS` of the ranks in ``slots`` (NaN where ``gone``): each
        call refreshes them all, or, past :data:`STATS_BUDGET`, the next share of them."""
        held = slots[~gone]
        if WINDOW_STATS and len(held):
            parts = max(1, -(-len(held) * self.steps.window // STATS_BUDGET))
            self._stats_turn = (self._stats_turn + 1) % parts
            fresh = held[self._stats_turn::parts]
            self.stats[fresh] = self._window_stats(fresh)
        out: np.ndarray = self.stats[slots]
        out[gone] = np.nan
        return out

    def nbytes(self) -> int:
        """Bytes held in the windows."""
        return (self.steps.nbytes() + self.samples.nbytes() + int(self.latest.nbytes)
                + int(self.stats.nbytes))


def group_figures(rs: RankState) -> dict[str, GroupFigures]:
    """A rank's collectives per process group (its recent steps' medians), each group
    described as the rank's meta says (``collectors.groups``): the groups whose
    collectives took the most time first; empty when every collective of its recent
    steps ran on the default group."""
    if rs.groups is None:
        return {}
    described = {d.get("name"): d for d in rs.meta.get("groups") or []
                 if isinstance(d, dict)}
    out: dict[str, GroupFigures] = {}
    for key, figures in rs.groups.medians().items():
        name, _, op = key.partition(GROUP_SEP)
        entry = out.get(name)
        if entry is None:
            d = described.get(name) or {}
            entry = out[name] = GroupFigures(
                desc=_text_or_none(d.get("desc")), ranks=_text_or_none(d.get("ranks")),
                size=_int_or_none(d.get("size")), rank=_int_or_none(d.get("rank")),
                ops={})
        entry["ops"][op] = figures
    return dict(sorted(out.items(), key=lambda kv: -sum(
        f["s"] or 0.0 for f in kv[1]["ops"].values())))


def _text_or_none(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def _int_or_none(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _error_line(e: Any) -> str:
    """An entry of a probe's ``errors`` as one line: ``{"rank", "error"}`` or text."""
    if isinstance(e, dict):
        return f"rank {e.get('rank')}: {e.get('error')}"
    return str(e)


def column(a: np.ndarray) -> list[float | None]:
    """A float column as a list, NaN as None."""
    nan = np.isnan(a)
    if not nan.any():
        return a.tolist()  # type: ignore[no-any-return]
    if nan.all():
        return [None] * len(a)
    return [None if m else v for v, m in zip(a.tolist(), nan.tolist(), strict=True)]
