"""A fleet of training ranks, simulated: what the ranks of a real synchronous data-parallel
job would send rtop, with a real fleet's noise and chosen faults, in the real wire format.

The tests and ``benchmarks/diagnosis_accuracy.py`` share it: a :class:`FleetSpec` (how
many ranks, in nodes of 8, how long a step takes, how long the run lasts, a seed) and a
:class:`Scenario` (the faults, none for a healthy fleet) make the same frames every time;
:func:`write_recording` writes them as a recording through :class:`rtop.hub.recorder.
Recorder` (what ``rtop report`` and ``rtop replay`` read), :func:`frames` yields them to
play into a hub or a run state, and :class:`Truth` says what was wrong, where and from
when, for scoring the diagnosis.

**How a step is made.** Every rank starts step ``s`` together (synchronous training). A
rank waits ``data_wait`` for its batch and computes for ``compute``; the allreduce can
finish only once the last rank arrives, so each rank's collective time is its wait for
the slowest plus the allreduce itself (``comm_s``; the part not hidden behind backward is
``comm_exposed_s``), and the step takes as long for everyone. A straggler thus shows the
largest ``compute_s`` and the smallest ``comm_s``, its peers the opposite
(``DESIGN.md``). Batches go out every 0.5 s per rank (its flush timer's phase is its
own), with a GPU, host, memory and heartbeat sample once a second.

**The noise of a healthy fleet** (:class:`Noise`): GPUs a little faster or slower than
each other (a fixed spread), jitter on every step, rare file-system hiccups of 100-300 ms
in one rank's data loading (sometimes over two steps), garbage-collector pauses, rank 0's
extra work (logging each step, an evaluation now and then), checkpoints every rank
writes together, every GPU power-capped (SM clock ~92 % of its maximum with the driver's
``sw_power_cap`` reason, as H100s run under load), warm nodes (a few degrees hotter, a
little slower), NCCL jitter with rare spikes, and rank clocks a few tens of ms apart.

**Pipeline stages** (``FleetSpec.stages``): the ranks split into that many contiguous
blocks, one per stage (the data-parallel group of a stage: its block; the pipeline
group of a rank: the ranks at its place in every block), each stage's step made of its
own work (``stage_compute``: the last stage computes the loss head, longer; ``stage_data``:
the first stage loads the batches, the others wait little), so that ranks of different
stages are not peers. The ranks say their groups in their ``meta`` as a real collector
does (``collectors.groups``: a ``mesh_pp`` group, their place in it their stage, and a
``mesh_dp`` group), unless ``announce_stages`` is off (a fleet the diagnosis cannot tell
apart), and each step's allreduce is split by group (``groups``: on the stage's data-
parallel group).

**The faults** (:data:`FAULTS`): a starved rank, a compute straggler, a slow node, a
thermally throttled GPU, a memory leak (slow and fast), a hang, a lost rank, a lost node,
a fail-slow that comes and goes, an input-bound job (every rank waits for data), a slow
NIC on one node, and any two at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np

from collectors import wire
from collectors.schema import GPU_FIELDS, HEARTBEAT_FIELDS, HOST_FIELDS, MEM_FIELDS, STEP_FIELDS

#: Seconds between a rank's batches (collectors' default flush interval).
FLUSH_S: Final = 0.5
#: Seconds between a rank's samples (GPU, host, memory, heartbeat).
SAMPLE_S: Final = 1.0
#: The hub time a simulated run starts at (a fixed date: recordings are reproducible).
T0: Final = 1_800_000_000.0
#: NVML clock-event reason bits (collectors.nvml.CLOCK_EVENT_REASONS).
SW_POWER_CAP: Final = 0x004
HW_SLOWDOWN: Final = 0x008
SW_THERMAL: Final = 0x020
HW_THERMAL: Final = 0x040
#: The GPU the fleet runs on.
GPU_NAME: Final = "NVIDIA H100 80GB HBM3"
CAPACITY_BYTES: Final = 85_899_345_920  # 80 GiB
SM_CLOCK_MAX_MHZ: Final = 1980.0
POWER_LIMIT_W: Final = 700.0

_STEP = {f: i for i, f in enumerate(STEP_FIELDS)}


@dataclass(frozen=True)
class Noise:
    """A healthy fleet's noise (see the module doc); ``Noise.none()`` turns it all off."""

    speed_spread: float = 0.015  # sigma of each GPU's fixed speed (1 = the fleet's)
    step_jitter: float = 0.02  # sigma of each step's compute (lognormal)
    data_wait_s: float = 0.002  # a healthy rank's wait for its batch (median)
    data_jitter: float = 0.5  # sigma of that wait (lognormal)
    hiccup_p: float = 2e-4  # per rank and step: a file-system hiccup in its loading ...
    hiccup_s: tuple[float, float] = (0.1, 0.3)  # ... this long ...
    hiccup_two_steps_p: float = 0.3  # ... spilling into the next step this often
    gc_p: float = 1e-3  # per rank and step: a garbage-collector pause ...
    gc_s: tuple[float, float] = (0.03, 0.12)  # ... this long
    rank0_extra: float = 0.015  # rank 0's logging: this share more compute every step
    eval_every: int = 100  # rank 0 evaluates every this many steps ...
    eval_s: float = 3.0  # ... for this long (the others wait in the next allreduce)
    checkpoint_every: int = 150  # every rank writes a checkpoint every this many steps ...
    checkpoint_s: float = 6.0  # ... for this long
    power_capped: bool = True  # every GPU at the power cap
    power_cap_clock: float = 0.92  # ... its SM clock this share of the maximum ...
    power_cap_spread: float = 0.01  # ... give or take this (sigma, per sample)
    warm_nodes: float = 0.05  # this share of the nodes run warmer ...
    warm_c: float = 6.0  # ... by this many degrees ...
    warm_slower: float = 0.01  # ... and this much slower
    comm_jitter: float = 0.05  # sigma of the allreduce's time (lognormal)
    comm_spike_p: float = 0.005  # per step: the allreduce takes ...
    comm_spike: float = 2.0  # ... this many times as long
    clock_offset_s: float = 0.03  # sigma of each rank's clock against the hub's
    mem_jitter_bytes: float = 50e6  # sigma of the device memory's samples

    @classmethod
    def none(cls) -> Noise:
        """No noise at all: every rank the same, every step the same."""
        return cls(speed_spread=0.0, step_jitter=0.0, data_jitter=0.0, hiccup_p=0.0,
                   gc_p=0.0, rank0_extra=0.0, eval_every=0, checkpoint_every=0,
                   power_capped=False, warm_nodes=0.0, comm_jitter=0.0, comm_spike_p=0.0,
                   clock_offset_s=0.0, mem_jitter_bytes=0.0)


@dataclass(frozen=True)
class FleetSpec:
    """The job: ``ranks`` in nodes of ``per_node``, a step of about ``step_s`` (its
    compute; the allreduce adds ``comm_s``, mostly hidden), for ``duration_s``."""

    ranks: int = 1024
    per_node: int = 8
    step_s: float = 1.0
    comm_s: float = 0.12  # the allreduce of one step (busbw ~ 40 GB/s for 2.5 GB) ...
    overlap: float = 0.75  # ... this share of it hidden behind backward
    comm_bytes: float = 2.5e9  # gradient bytes all-reduced per step
    duration_s: float = 120.0
    seed: int = 0
    noise: Noise = field(default_factory=Noise)
    job: str = "fleet-job"
    stages: int = 1  # pipeline stages (see the module doc); 1: plain data parallelism
    #: per stage: its compute, as a share of ``step_s`` (default: 1, ..., the last 1.4)
    stage_compute: tuple[float, ...] = ()
    #: per stage: its data wait, as a multiple of the noise's (default: the first 8x,
    #: the others 0.5x)
    stage_data: tuple[float, ...] = ()
    announce_stages: bool = True  # the ranks say their process groups in their meta

    def __post_init__(self) -> None:
        if self.stages < 1 or self.ranks % self.stages:
            raise ValueError(f"{self.stages} pipeline stages do not split {self.ranks} ranks "
                             "evenly")
        for name in ("stage_compute", "stage_data"):
            given = getattr(self, name)
            if given and len(given) != self.stages:
                raise ValueError(f"{name} gives {len(given)} stages, not {self.stages}")

    def stage_of(self, rank: int) -> int:
        """A rank's pipeline stage (0 with one stage)."""
        return rank // (self.ranks // self.stages)

    def stage_factors(self) -> tuple[np.ndarray, np.ndarray]:
        """Per stage: its compute factor and its data-wait factor (module doc)."""
        k = self.stages
        compute = self.stage_compute or (1.0,) * (k - 1) + ((1.4,) if k > 1 else (1.0,))
        data = self.stage_data or ((8.0,) + (0.5,) * (k - 1) if k > 1 else (1.0,))
        return np.array(compute, dtype=float), np.array(data, dtype=float)

    def groups_of(self, rank: int) -> list[dict[str, Any]]:
        """The process groups a rank says it is in (``collectors.groups``' shape)."""
        if self.stages == 1:
            return []
        dp = self.ranks // self.stages
        stage, place = divmod(rank, dp)
        return [{"name": "0", "desc": "default_pg", "size": self.ranks, "rank": rank,
                 "ranks": f"0-{self.ranks - 1}", "world": True},
                {"name": f"pp{place}", "desc": "mesh_pp", "size": self.stages, "rank": stage,
                 "ranks": f"{place}-{place + (self.stages - 1) * dp}:{dp}"
                 if self.stages > 2 else f"{place},{place + dp}"},
                {"name": f"dp{stage}", "desc": "mesh_dp", "size": dp, "rank": place,
                 "ranks": f"{stage * dp}-{stage * dp + dp - 1}"}]

    @property
    def nodes(self) -> int:
        """Nodes of the job."""
        return math.ceil(self.ranks / self.per_node)

    def node_of(self, rank: int) -> int:
        """The node a rank runs on."""
        return rank // self.per_node

    def node_name(self, node: int) -> str:
        """A node's host name."""
        return f"node-{node:05d}"

    def ranks_of(self, node: int) -> list[int]:
        """The ranks of one node."""
        return list(range(node * self.per_node, min(self.ranks, (node + 1) * self.per_node)))


#: The faults a scenario can inject, and the findings that name each correctly (the
#: first one is the one expected; the others are right too: a thermally throttled GPU is
#: also a straggler).
FAULTS: Final[dict[str, tuple[str, ...]]] = {
    "starved": ("starved_rank",),
    "straggler": ("straggler",),
    "slow_node": ("straggler",),
    "throttled": ("gpu_throttled", "straggler"),
    "leak_slow": ("memory_wall",),
    "leak_fast": ("memory_wall",),
    "hang": ("hung_rank",),
    "lost_rank": ("lost_rank",),
    "lost_node": ("lost_rank",),
    "fail_slow": ("straggler",),
    "input_bound": ("input_bound",),
    "slow_nic": ("slow_link", "low_scaling_efficiency"),
}
#: Faults that act on steps (a step's data wait, compute or allreduce, or a step that
#: never ends): their onset is the start of the first step they act on. The others act
#: at once (a throttled GPU's clock, a leak, a lost rank's connection).
STEP_FAULTS: Final = frozenset({"starved", "straggler", "slow_node", "fail_slow",
                                "input_bound", "slow_nic", "hang"})
#: Faults of the whole job, named once as a fact about it (not rank faults).
JOB_FAULTS: Final = frozenset({"input_bound", "slow_nic"})


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (a key of :data:`FAULTS`) on ``ranks`` (or every rank of
    ``node``), from ``start_s`` into the run, until ``end_s`` (None: to the end), of
    ``size`` (its own unit: extra seconds of data wait, a compute factor, bytes a step)."""

    kind: str
    start_s: float
    ranks: tuple[int, ...] = ()
    node: int | None = None
    size: float | None = None
    end_s: float | None = None
    #: a fault that comes and goes: on for ``period_s``, off for ``period_s``, ...
    period_s: float | None = None

    def targets(self, spec: FleetSpec) -> list[int]:
        """The ranks it strikes."""
        if self.node is not None:
            return spec.ranks_of(self.node)
        return list(self.ranks)

    def on(self, t: float) -> bool:
        """Whether it acts at ``t`` seconds into the run."""
        if t < self.start_s or (self.end_s is not None and t >= self.end_s):
            return False
        if self.period_s:
            return int((t - self.start_s) // self.period_s) % 2 == 0
        return True


@dataclass(frozen=True)
class Scenario:
    """A named set of faults (none: a healthy fleet)."""

    name: str
    faults: tuple[Fault, ...] = ()


@dataclass
class TruthFault:
    """One fault as it happened: its kind, the findings that name it rightly, where it
    struck (ranks and nodes), when (hub time), and for a leak when the memory wall was
    (or would have been) hit."""

    fault: str
    kinds: tuple[str, ...]
    ranks: list[int]
    nodes: list[str]
    onset: float
    job_level: bool
    wall: float | None = None
    periods: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Truth:
    """What a simulated run held: the faults, the run's span and its step time."""

    spec: FleetSpec
    scenario: str
    faults: list[TruthFault]
    t_start: float
    t_end: float
    steps: int
    step_s_median: float
    frames: int = 0
    #: the healthy noise's file-system hiccups: (rank, hub time its step began, seconds)
    hiccups: list[tuple[int, float, float]] = field(default_factory=list)

    @property
    def rank_hours(self) -> float:
        """Rank-hours the run covered."""
        return self.spec.ranks * (self.t_end - self.t_start) / 3600.0


def scenarios(spec: FleetSpec) -> dict[str, Scenario]:
    """Every scenario of the issue for a fleet of this size, its faults placed by the
    seed (which rank, which node) after a warm-up of a quarter of the run."""
    rng = np.random.default_rng(spec.seed + 7919)
    n, nodes = spec.ranks, spec.nodes
    start = max(30.0, spec.duration_s * 0.25)
    r1, r2 = (int(x) for x in rng.choice(np.arange(1, n), size=2, replace=False))
    node = int(rng.integers(1, nodes)) if nodes > 1 else 0
    other = next(x for x in range(1, n) if spec.node_of(x) != spec.node_of(r1)) \
        if nodes > 1 else r2
    return {s.name: s for s in (
        Scenario("healthy"),
        Scenario("starved", (Fault("starved", start, (r1,), size=0.45 * spec.step_s),)),
        Scenario("straggler", (Fault("straggler", start, (r1,), size=1.35),)),
        Scenario("slow_node", (Fault("slow_node", start, node=node, size=1.35),)),
        Scenario("throttled", (Fault("throttled", start, (r1,), size=1.35),)),
        Scenario("leak_slow", (Fault("leak_slow", start, (r1,)),)),
        Scenario("leak_fast", (Fault("leak_fast", start, (r1,)),)),
        Scenario("hang", (Fault("hang", start, (r1,)),)),
        Scenario("lost_rank", (Fault("lost_rank", start, (r1,)),)),
        Scenario("lost_node", (Fault("lost_node", start, node=node),)),
        Scenario("fail_slow", (Fault("fail_slow", start, (r1,), size=1.5,
                                     period_s=max(10.0, 10 * spec.step_s)),)),
        Scenario("input_bound", (Fault("input_bound", start, size=0.5 * spec.step_s),)),
        Scenario("slow_nic", (Fault("slow_nic", start, node=node, size=6.0),)),
        Scenario("two_faults", (Fault("starved", start, (r1,), size=0.45 * spec.step_s),
                                Fault("throttled", start + 10.0, (other,), size=1.35))),
    )}


#: How long a leak takes to fill its device from its onset, per kind: a fast one in
#: about a minute (~300 MB a step), a slow one in about seven (~50 MB a step).
LEAK_S: Final = {"leak_fast": 75.0, "leak_slow": 420.0}


#: A run whose leak hits the wall at most this long after its end runs on until it does
#: (the rank fails there); a wall further away is only forecast (``TruthFault.wall``).
LEAK_RUN_ON_S: Final = 60.0


def leak_rate(fault: Fault) -> float:
    """Bytes a second a leak adds (``size``, else what fills the device in
    :data:`LEAK_S`)."""
    if fault.size is not None:
        return float(fault.size)
    return (CAPACITY_BYTES * 0.97 - 59e9) / LEAK_S[fault.kind]


class _Fleet:
    """The state of the simulation as it steps."""

    def __init__(self, spec: FleetSpec, scenario: Scenario) -> None:
        self.spec, self.scenario = spec, scenario
        nz = spec.noise
        self.rng = np.random.default_rng(spec.seed)
        n = spec.ranks
        self.n = n
        self.speed = 1.0 + nz.speed_spread * np.clip(self.rng.standard_normal(n), -3, 3)
        compute_k, data_k = spec.stage_factors()
        stage = np.arange(n) // (n // spec.stages)
        self.stage_compute, self.stage_data = compute_k[stage], data_k[stage]
        self.node_of = np.arange(n) // spec.per_node
        warm_nodes = self.rng.random(spec.nodes) < nz.warm_nodes
        self.warm = warm_nodes[self.node_of]
        self.speed *= np.where(self.warm, 1.0 + nz.warm_slower, 1.0)
        self.offset = nz.clock_offset_s * self.rng.standard_normal(n)
        self.flush_phase = self.rng.random(n) * FLUSH_S
        self.sample_phase = self.rng.random(n) * SAMPLE_S
        self.mem_base = 58e9 + 1.5e9 * self.rng.random(n)
        self.temp_base = 62.0 + 4.0 * self.rng.random(n) + np.where(self.warm, nz.warm_c, 0.0)
        self.hiccup_next = np.zeros(n)  # a hiccup's spill into the next step (seconds)
        #: every file-system hiccup: (rank, seconds into the run its step began, seconds)
        self.hiccups: list[tuple[int, float, float]] = []
        #: the leaks: (fault, its ranks, bytes a second)
        self.leaks: list[tuple[Fault, list[int], float]] = []
        self.faults = scenario.faults

    def _active(self, kind: str, t: float) -> list[tuple[Fault, list[int]]]:
        return [(f, f.targets(self.spec)) for f in self.faults if f.kind == kind and f.on(t)]

    def step(self, s: int, t: float) -> dict[str, np.ndarray]:
        """One step's per-rank figures, the step starting ``t`` seconds into the run."""
        spec, nz, rng, n = self.spec, self.spec.noise, self.rng, self.n
        compute = spec.step_s * self.speed * self.stage_compute
        if nz.step_jitter:
            compute = compute * np.exp(nz.step_jitter * rng.standard_normal(n))
        if nz.rank0_extra:
            compute[0] *= 1.0 + nz.rank0_extra
        if nz.eval_every and s > 0 and s % nz.eval_every == 0:
            compute[0] += nz.eval_s
        if nz.gc_p:
            gc = rng.random(n) < nz.gc_p
            compute = compute + np.where(gc, rng.uniform(*nz.gc_s, n), 0.0)
        data = nz.data_wait_s * self.stage_data * (
            np.exp(nz.data_jitter * rng.standard_normal(n)) if nz.data_jitter else np.ones(n))
        data += self.hiccup_next
        self.hiccup_next = np.zeros(n)
        if nz.hiccup_p:
            hic = rng.random(n) < nz.hiccup_p
            size = rng.uniform(*nz.hiccup_s, n)
            data = data + np.where(hic, size, 0.0)
            self.hiccups += [(int(r), t, float(size[r])) for r in np.flatnonzero(hic)]
            spill = hic & (rng.random(n) < nz.hiccup_two_steps_p)
            self.hiccup_next = np.where(spill, size * rng.uniform(0.3, 0.8, n), 0.0)
        for f, rs in self._active("starved", t):
            data[rs] += f.size or 0.4 * spec.step_s
        for f, _ in self._active("input_bound", t):
            data += f.size or 0.5 * spec.step_s
        for kind in ("straggler", "slow_node", "throttled", "fail_slow"):
            for f, rs in self._active(kind, t):
                compute[rs] *= f.size or 1.35
        comm = spec.comm_s * (math.exp(nz.comm_jitter * float(rng.standard_normal()))
                              if nz.comm_jitter else 1.0)
        if nz.comm_spike_p and rng.random() < nz.comm_spike_p:
            comm *= nz.comm_spike
        for f, _ in self._active("slow_nic", t):
            comm *= f.size or 6.0
        arrive = data + compute
        last = float(arrive.max())
        hidden = spec.overlap * comm
        tail = comm - min(hidden, float(np.min(compute)) * 0.5)
        step = last + tail
        wait = last - arrive
        comm_s = wait + comm
        exposed = wait + tail
        return {"data": data, "compute": compute, "comm_s": comm_s, "exposed": exposed,
                "step": np.full(n, step), "comm_true": np.full(n, comm)}


def _row(fields: tuple[str, ...], values: dict[str, Any]) -> list[Any]:
    return [values.get(f) for f in fields]


def _identity(spec: FleetSpec, rank: int) -> dict[str, Any]:
    node = spec.node_of(rank)
    return {"rank": rank, "local_rank": rank % spec.per_node, "world_size": spec.ranks,
            "hostname": spec.node_name(node), "ip": f"10.{node // 256 % 256}.{node % 256}.1",
            "pid": 10_000 + rank, "attempt": 0, "job": spec.job, "group": f"{spec.job}#0",
            "node_id": f"n{node}", "source": "torch"}


def frames(spec: FleetSpec, scenario: Scenario | str = "healthy"
           ) -> Iterator[tuple[float, str, dict[str, Any]]]:
    """``(t_hub, kind, payload)`` of every frame the hub would receive (and write) in a
    simulated run, in hub-time order; :func:`truth` says what the run held."""
    yield from _Run(spec, scenario).frames()


def truth(spec: FleetSpec, scenario: Scenario | str = "healthy") -> Truth:
    """What a simulated run holds (without making its frames)."""
    run = _Run(spec, scenario)
    for _ in run.frames():
        pass
    return run.truth


class _Run:
    """One simulated run: its frames and its truth."""

    def __init__(self, spec: FleetSpec, scenario: Scenario | str) -> None:
        self.spec = spec
        self.scenario = scenarios(spec)[scenario] if isinstance(scenario, str) else scenario
        for f in self.scenario.faults:
            if f.kind not in FAULTS:
                raise ValueError(f"unknown fault {f.kind!r} (one of {', '.join(FAULTS)})")
        self.truth = Truth(spec, self.scenario.name, [], T0, T0, 0, spec.step_s)

    def frames(self) -> Iterator[tuple[float, str, dict[str, Any]]]:
        spec, nz = self.spec, self.spec.noise
        fleet = _Fleet(spec, self.scenario)
        n = spec.ranks
        group = f"{spec.job}#0"
        t0 = T0
        for r in range(n):
            yield t0, wire.KIND_HELLO, {
                "role": "rank", "identity": _identity(spec, r),
                "clock": {"t_wall": t0 + float(fleet.offset[r])},
                "collector": {"version": "sim", "python": "3.11", "torch": "2.13"}}
            yield t0, "offset", {"rank": r, "group": group,
                                 "offset_s": float(fleet.offset[r]), "rtt_s": 0.0002}
        # the steps, made ahead (their times decide which batch carries each)
        events: list[list[list[Any]]] = [[] for _ in range(n)]
        hang = next((f for f in self.scenario.faults if f.kind == "hang"), None)
        gone_at: dict[int, float] = {}  # rank -> seconds into the run it went away
        teardown_at: float | None = None
        for f in self.scenario.faults:
            if f.kind in ("lost_rank", "lost_node"):
                for r in f.targets(spec):
                    gone_at[r] = f.start_s
                teardown_at = f.start_s + 2.0
        leaks = [(f, f.targets(spec)) for f in self.scenario.faults
                 if f.kind in ("leak_slow", "leak_fast")]
        fleet.leaks = [(f, rs, leak_rate(f)) for f, rs in leaks]
        # the first leaking rank to fill its device (97 %: the allocator fails there)
        oom_at: float | None = min((f.start_s + (CAPACITY_BYTES * 0.97 - float(
            fleet.mem_base[r])) / rate for f, rs, rate in fleet.leaks for r in rs),
            default=None)
        t = 0.0
        s = 0
        step_times: list[float] = []
        # per rank: the steps made, with their end times, not yet sent
        steps: list[tuple[float, int, dict[str, np.ndarray]]] = []
        if oom_at is not None and oom_at > spec.duration_s + LEAK_RUN_ON_S:
            oom_at = None  # the wall lies well past the run: the run ends before it
        end = spec.duration_s if oom_at is None else max(spec.duration_s, oom_at + 1.0)
        gap = 0.001
        while t < end:
            if hang is not None and t >= hang.start_s:
                break
            if teardown_at is not None and t >= min(gone_at.values()):
                break
            if oom_at is not None and t >= oom_at:
                break
            fig = fleet.step(s, t)
            fig["gap"] = np.full(n, gap)
            gap = 0.001
            dur = float(fig["step"][0])
            steps.append((t, s, fig))
            step_times.append(dur)
            t += dur
            s += 1
            if nz.checkpoint_every and s % nz.checkpoint_every == 0:
                for r in range(n):
                    events[r].append([T0 + t + float(fleet.offset[r]), "checkpoint",
                                      nz.checkpoint_s, s - 1])
                t += nz.checkpoint_s
                gap = nz.checkpoint_s
        last_step_end = t
        self.truth.steps = s
        self.truth.step_s_median = float(np.median(step_times)) if step_times else spec.step_s
        self.truth.hiccups = [(r, T0 + at, size) for r, at, size in fleet.hiccups]
        if hang is not None:
            run_end = max(end, hang.start_s + 60.0)
        elif teardown_at is not None:
            run_end = teardown_at + 3.0
        elif oom_at is not None:
            run_end = oom_at + 2.0
        else:
            run_end = end
        self._truth_faults(leaks, oom_at, fleet, [t0 for t0, _, _ in steps])
        self.truth.t_end = T0 + run_end
        # batches, per flush tick, ranks in their flush phase's order
        order = np.argsort(fleet.flush_phase, kind="stable")
        sent = [0] * n  # steps sent per rank
        seq = [0] * n
        last_sample = [-1.0] * n
        ended: set[int] = set()
        k = 0
        stack = ('  File "train.py", line 88, in train_loop\n'
                 '    loss = model(batch).sum()\n')
        while True:
            tick = k * FLUSH_S
            if tick > run_end:
                break
            for r in order.tolist():
                if r in ended:
                    continue
                at = tick + float(fleet.flush_phase[r])
                if at > run_end:
                    continue
                if r in gone_at and at >= gone_at[r]:
                    # its process (for a lost node, its node's) died: the kernel closes
                    # every socket of the dead at once, and the hub sees them together
                    gone = [q for q in sorted(gone_at)
                            if gone_at[q] == gone_at[r] and q not in ended]
                    for i, q in enumerate(gone):
                        ended.add(q)
                        yield T0 + at + 0.001 * i, "conn", {
                            "event": "close", "rank": q, "group": group, "clean": False,
                            "how": "reset"}
                    continue
                if teardown_at is not None and at >= teardown_at + 0.5 * (r % 3):
                    ended.add(r)
                    yield T0 + at, wire.KIND_BYE, {
                        "rank": r, "group": group, "dropped": 0, "reason": "signal",
                        "error": "terminated by SIGTERM"}
                    continue
                if oom_at is not None and at >= oom_at:
                    ended.add(r)
                    leaking = any(r in rs for _, rs in leaks)
                    yield T0 + at, wire.KIND_BYE, {
                        "rank": r, "group": group, "dropped": 0,
                        "reason": "exit" if leaking else "signal",
                        "error": ("CUDA out of memory. Tried to allocate 2.00 GiB"
                                  if leaking else "terminated by SIGTERM")}
                    continue
                payload: dict[str, Any] = {"rank": r, "group": group, "t_wall":
                                           T0 + at + float(fleet.offset[r]), "dropped": 0,
                                           "cpu_s": 0.002 * (k + 1)}
                rows = []
                while sent[r] < len(steps):
                    st, num, fig = steps[sent[r]]
                    if st + float(fig["step"][r]) > at:
                        break
                    rows.append(self._step_row(st, num, fig, r, fleet))
                    sent[r] += 1
                if rows:
                    payload["steps"] = rows
                if events[r] and events[r][0][0] - T0 <= at:
                    payload["events"] = [events[r].pop(0)]
                if at - last_sample[r] >= SAMPLE_S - 1e-9:
                    last_sample[r] = at
                    self._samples(payload, r, at, fleet, last_step_end, hang, stack,
                                  sent[r])
                if seq[r] == 0:
                    payload["meta"] = {"device": {"name": GPU_NAME, "nvlink_links": 18,
                                                  "index": r % spec.per_node}}
                    if spec.stages > 1 and spec.announce_stages:
                        payload["meta"]["groups"] = spec.groups_of(r)
                if len(payload) <= 5 and "meta" not in payload:
                    continue
                seq[r] += 1
                payload["seq"] = seq[r]
                yield T0 + at, wire.KIND_BATCH, payload
            k += 1
        for r in range(n):
            if r not in ended:
                yield T0 + run_end + 0.01, wire.KIND_BYE, {
                    "rank": r, "group": group, "dropped": 0, "reason": "closed",
                    "error": None}

    def _step_row(self, t: float, num: int, fig: dict[str, np.ndarray], r: int,
                  fleet: _Fleet) -> list[Any]:
        spec = self.spec
        n = spec.ranks
        step = float(fig["step"][r])
        comm_s = float(fig["comm_s"][r])
        busbw = spec.comm_bytes * 2 * (n - 1) / n / comm_s if n > 1 and comm_s > 0 else None
        compute = float(fig["compute"][r])
        exposed = float(fig["exposed"][r])
        groups = None
        if spec.stages > 1:  # the allreduce runs on the stage's data-parallel group
            dp = n // spec.stages
            groups = {f"dp{spec.stage_of(r)}": {"all_reduce": [
                comm_s, int(spec.comm_bytes), 25,
                spec.comm_bytes * 2 * (dp - 1) / dp / comm_s if dp > 1 and comm_s > 0
                else None]}}
        return _row(STEP_FIELDS, {
            "step": num, "t_wall": T0 + t + float(fleet.offset[r]), "step_s": step,
            "data_wait_s": float(fig["data"][r]), "compute_s": compute,
            "gpu_s": compute + exposed, "comm_s": comm_s, "comm_exposed_s": exposed,
            "comm_bytes": int(spec.comm_bytes) if n > 1 else None,
            "comm_calls": 25 if n > 1 else None,
            "algbw_Bps": spec.comm_bytes / comm_s if n > 1 and comm_s > 0 else None,
            "busbw_Bps": busbw, "samples": 32, "gap_s": float(fig["gap"][r]),
            "groups": groups})

    def _samples(self, payload: dict[str, Any], r: int, at: float, fleet: _Fleet,
                 last_step_end: float, hang: Fault | None, stack: str, done: int) -> None:
        spec, nz, rng = self.spec, self.spec.noise, fleet.rng
        wall = T0 + at + float(fleet.offset[r])
        throttled = [f for f, rs in fleet._active("throttled", at) if r in rs]
        if throttled:
            clock = SM_CLOCK_MAX_MHZ * 0.70 * (1 + 0.005 * float(rng.standard_normal()))
            reasons = HW_THERMAL | SW_THERMAL | (SW_POWER_CAP if nz.power_capped else 0)
            temp = 91.0 + float(rng.random())
        elif nz.power_capped:
            clock = SM_CLOCK_MAX_MHZ * (nz.power_cap_clock + nz.power_cap_spread * float(
                np.clip(rng.standard_normal(), -3, 3)))
            clock *= 1.0 - (nz.warm_slower if fleet.warm[r] else 0.0)
            reasons = SW_POWER_CAP
            temp = float(fleet.temp_base[r]) + float(rng.random())
        else:
            clock, reasons = SM_CLOCK_MAX_MHZ, 0
            temp = float(fleet.temp_base[r]) + float(rng.random())
        power = POWER_LIMIT_W * (0.99 if nz.power_capped else 0.85) \
            + 3 * float(rng.standard_normal())
        leaked = sum(rate * max(0.0, at - f.start_s) for f, rs, rate in fleet.leaks
                     if r in rs)
        mem = fleet.mem_base[r] + leaked + nz.mem_jitter_bytes * float(
            rng.standard_normal())
        mem = min(mem, CAPACITY_BYTES * 0.99)
        payload["gpu"] = [_row(GPU_FIELDS, {
            "t_wall": wall, "util_pct": 97.0, "mem_util_pct": 40.0,
            "mem_used_bytes": int(mem + 4e9), "mem_total_bytes": CAPACITY_BYTES,
            "power_w": min(power, POWER_LIMIT_W), "power_limit_w": POWER_LIMIT_W,
            "temp_c": temp, "sm_clock_mhz": round(clock), "sm_clock_max_mhz": SM_CLOCK_MAX_MHZ,
            "clock_event_reasons": reasons, "pcie_tx_Bps": 1e9, "pcie_rx_Bps": 1e9,
            "nvlink_tx_Bps": 50e9, "nvlink_rx_Bps": 50e9})]
        payload["host"] = [_row(HOST_FIELDS, {
            "t_wall": wall, "proc_cpu_pct": 110.0, "loader_cpu_pct": 240.0,
            "loader_procs": 4, "rss_bytes": 24e9, "sys_mem_avail_bytes": 1.2e12,
            "sys_mem_total_bytes": 2.0e12, "cgroup_mem_limit_bytes": None,
            "sys_cpu_pct": 35.0, "load_avg_1m": 40.0})]
        payload["mem"] = [_row(MEM_FIELDS, {
            "t_wall": wall, "device": f"cuda:{r % spec.per_node}", "used_bytes": int(mem),
            "reserved_bytes": int(mem + 2e9), "peak_bytes": int(mem + 3.5e9),
            "capacity_bytes": CAPACITY_BYTES, "param_bytes": int(1.25e9),
            "grad_bytes": int(1.25e9), "optim_bytes": int(10e9),
            "process_bytes": int(mem + 5e9)})]
        if hang is not None and at >= last_step_end:
            stuck = at - last_step_end
            mine = r in hang.targets(spec)
            phase = "compute" if mine else "comm"
            payload["hb"] = [_row(HEARTBEAT_FIELDS, {
                "t_wall": wall, "phase": phase, "phase_s": stuck,
                "step": done - 1, "stack": stack if mine and stuck > 10 else None})]
        else:
            payload["hb"] = [_row(HEARTBEAT_FIELDS, {
                "t_wall": wall, "phase": "compute", "phase_s": 0.2, "step": done - 1,
                "stack": None})]

    def _truth_faults(self, leaks: list[tuple[Fault, list[int]]], oom_at: float | None,
                      fleet: _Fleet, step_starts: list[float]) -> None:
        spec = self.spec
        for f in self.scenario.faults:
            rs = f.targets(spec)
            if f.kind in JOB_FAULTS and f.kind != "slow_nic":
                rs = list(range(spec.ranks))
            nodes = sorted({spec.node_name(spec.node_of(r)) for r in rs})
            wall = None
            if f.kind in ("leak_slow", "leak_fast"):
                wall = T0 + min(f.start_s + (CAPACITY_BYTES * 0.97 - float(
                    fleet.mem_base[r])) / leak_rate(f) for r in rs)
            periods = []
            if f.period_s:
                a = f.start_s
                while a < spec.duration_s:
                    periods.append((T0 + a, T0 + a + f.period_s))
                    a += 2 * f.period_s
            # a fault that acts on steps first shows in the first step that starts once it
            # is on (a step under way when it begins is not touched): its onset
            onset = f.start_s
            if f.kind in STEP_FAULTS:
                onset = next((t for t in step_starts if t >= f.start_s), f.start_s)
            self.truth.faults.append(TruthFault(
                f.kind, FAULTS[f.kind], sorted(rs), nodes, T0 + onset,
                f.kind in JOB_FAULTS, wall, periods))


def write_recording(path: str | Path, spec: FleetSpec,
                    scenario: Scenario | str = "healthy") -> Truth:
    """Write a simulated run as a recording (what a hub would have written); returns its
    :class:`Truth`."""
    from rtop.hub.recorder import Recorder

    run = _Run(spec, scenario)
    info = {"hub": {"version": "sim", "address": "simulated", "pid": 0, "started": T0},
            "job": spec.job, "simulated": {"ranks": spec.ranks, "seed": spec.seed,
                                           "scenario": run.scenario.name}}
    rec = Recorder(path, info)
    count = 0
    try:
        for t_hub, kind, payload in run.frames():
            rec.raw(wire.encode(kind, payload), t_hub)
            count += 1
        rec.clock(run.truth.t_end + 1.0, force=True)
    finally:
        rec.close()
    run.truth.frames = count
    return run.truth


def with_noise(spec: FleetSpec, **changes: Any) -> FleetSpec:
    """``spec`` with some of its noise changed."""
    return replace(spec, noise=replace(spec.noise, **changes))
