"""The shapes that travel from the hub to viewers, declared once for mypy to check.

A :class:`Snapshot` is what the hub pushes to a viewer (and what replay and the
screenshots build from a recording): the run, one column per figure over the ranks of
the current attempt, the nodes folded to their worst rank, the findings and the
overview of the diagnosis, and where it came from. It travels as a msgpack map, so
these are ``TypedDict``\\ s: the same plain dicts, with their keys and value types
declared. Every figure is ``None`` where it was not measured, never 0.

Column names carry their units, as the wire does (``collectors.schema``): ``_s``
seconds, ``_bytes`` bytes, ``_Bps`` bytes per second, ``_pct`` percent.
"""

# no ``from __future__ import annotations``: TypedDict must see ``NotRequired`` itself
import sys
from typing import Any, Literal, TypedDict, get_args

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired

Severity = Literal["critical", "warning", "info"]
#: Where a rank stands: active | finished (closed the probe) | exited (interpreter exit
#: without close) | failed (an uncaught exception) | lost (silent or gone without a
#: word) | ended (a later attempt replaced it).
Status = Literal["active", "finished", "exited", "failed", "lost", "ended"]

Num = float | None
Column = list[float | None]
#: Every status, in the order of their codes in a fleet view's ``status`` bytes.
STATUSES: tuple[Status, ...] = get_args(Status)


class RunInfo(TypedDict):
    """The run as a whole: which job, which attempt, how much the hub has taken in."""

    job: str  # the job's own id (Ray Train run id, torchrun run id or rendezvous)
    name: str  # the hub's name for the job (``rtop serve --job``)
    attempt: int | None  # the current attempt (worker group), from 0
    attempts: int
    world_size: int
    ranks_seen: int
    uptime_s: float
    frames: int
    step_records: int
    bad_frames: int
    hub: NotRequired[dict[str, Any]]  # version, address, pid and start time of the hub
    record: NotRequired[str]  # the recording's path, when the hub records
    #: how long the hub has not heard its ranks, while it does not (it pauses for its
    #: recorder, or is behind on what they sent): the figures lag, and no rank is taken
    #: for silent meanwhile (``rtop.run.state.KIND_INGEST``)
    deaf_s: NotRequired[float]


class RankColumns(TypedDict):
    """One list per figure, index ``i`` for the i-th rank of the current attempt (by rank).

    Step figures are medians over each rank's recent steps; ``gpu_*`` (NVML), ``host_*``
    (psutil) and ``mem_*`` (the training device) are the latest samples.
    """

    rank: list[int]
    node: list[str]
    local_rank: list[int]  # its index on its node (the launcher's local rank)
    status: list[Status]
    step: list[int]  # last step reported, -1 before the first
    last_seen_s: list[float]  # since the rank's last frame
    dropped: list[int]  # records the rank could not send
    rtop_cpu: Column  # share of a core the rank's collector uses
    offset_s: Column  # the rank's clock minus the hub's
    phase: list[str | None]  # what the training thread was doing at its last heartbeat
    mem_device: list[str | None]  # "cuda:N" or "cpu"
    # recent medians of the step records
    step_s: Column
    data_wait_s: Column
    compute_s: Column
    gpu_s: Column
    comm_s: Column
    comm_exposed_s: Column
    comm_bytes: Column
    busbw_Bps: Column
    samples: Column
    tokens: Column  # tokens per step (probe.step(tokens=...), a callback's input_ids)
    flops: Column  # model FLOPs of the rank's step (given, or counted once)
    gap_s: Column
    # statistics over each rank's whole rolling window of steps
    step_p50_s: Column
    step_p95_s: Column
    step_p99_s: Column
    data_wait_p50_s: Column
    data_wait_p95_s: Column
    data_wait_p99_s: Column
    comm_exposed_p50_s: Column
    comm_exposed_p95_s: Column
    comm_exposed_p99_s: Column
    # latest NVML sample
    gpu_util_pct: Column
    gpu_mem_util_pct: Column
    gpu_mem_used_bytes: Column
    gpu_mem_total_bytes: Column
    gpu_power_w: Column
    gpu_power_limit_w: Column
    gpu_temp_c: Column
    gpu_sm_clock_mhz: Column
    gpu_sm_clock_max_mhz: Column
    gpu_clock_event_reasons: Column
    gpu_pcie_tx_Bps: Column
    gpu_pcie_rx_Bps: Column
    gpu_nvlink_tx_Bps: Column
    gpu_nvlink_rx_Bps: Column
    # latest psutil sample
    host_proc_cpu_pct: Column
    host_loader_cpu_pct: Column
    host_loader_procs: Column
    host_rss_bytes: Column
    host_sys_mem_avail_bytes: Column
    host_sys_mem_total_bytes: Column
    host_cgroup_mem_limit_bytes: Column
    host_sys_cpu_pct: Column
    host_load_avg_1m: Column
    # latest memory sample of the training device
    mem_used_bytes: Column
    mem_reserved_bytes: Column
    mem_peak_bytes: Column
    mem_capacity_bytes: Column
    mem_param_bytes: Column
    mem_grad_bytes: Column
    mem_optim_bytes: Column
    mem_process_bytes: Column  # CUDA: all the process holds on the GPU (NVML)
    # how long the current phase had lasted at the last heartbeat
    phase_s: Column


class NodeColumns(TypedDict):
    """One list per figure, one entry per node: the node's worst rank (slowest step,
    longest wait, longest allreduce, lowest bus bandwidth)."""

    node: list[str]
    ranks: list[int]
    active: list[int]
    step_s: Column
    data_wait_s: Column
    comm_s: Column
    busbw_Bps: Column


class FindingDict(TypedDict):
    """What is wrong, where, why rtop thinks so, and what usually fixes it."""

    kind: str  # one of ``rtop.analysis.kinds.KINDS``
    ranks: list[int]
    severity: Severity
    summary: str
    evidence: dict[str, Any]  # the numbers behind it, unit-named; None where unmeasured
    fix: str
    impact: float  # share of the job's step time it costs, for ordering


class EpisodeDict(FindingDict):
    """A finding from its start to its end (or now), as reports list them."""

    since: float
    until: float
    duration_s: float
    active: bool


class WhatIf(TypedDict):
    """Scaling efficiency at another rank count, the same per-rank batch and fabric."""

    ranks: int
    comm_s: Num
    efficiency: Num


class Scaling(TypedDict):
    """Scaling figures: compute / (compute + allreduce), and what more ranks would give."""

    efficiency: Num  # compute / (compute + exposed allreduce)
    efficiency_no_overlap: Num  # compute / (compute + whole allreduce)
    compute_s: Num
    comm_s: Num
    comm_exposed_s: Num
    comm_bytes: Num
    busbw_Bps: Num
    what_if: list[WhatIf]


class Throughput(TypedDict):
    """The job's throughput over its ranks' recent steps, and its model FLOPs against
    its GPUs' peak (``rtop.analysis.throughput``); None where it cannot be known."""

    samples_per_s: Num  # summed over one rank per model replica (see ``ranks_counted``)
    tokens_per_s: Num  # the same ranks' tokens per second
    ranks_counted: int  # ranks whose samples count: the first stage's, one per TP group
    model_flops_per_s: Num  # every rank's model FLOPs per second, summed
    peak_flops_per_s: Num  # those ranks' GPUs' dense peak at ``dtype``, summed
    mfu: Num  # model_flops_per_s / peak_flops_per_s (0 to 1)
    dtype: str | None  # the precision the peak is read for
    dtype_assumed: bool  # no rank said its precision: bf16 assumed
    gpu: str | None  # the GPU model the peak is read for (the most common one)
    why_no_mfu: str | None  # why ``mfu`` is None (no FLOPs known, a GPU not in the table)


class Overview(TypedDict, total=False):
    """What the diagnosis shows whether or not anything is wrong (empty before its
    first evaluation, or where no diagnosis runs)."""

    fabric: str  # the fabric class the allreduce crosses: nvlink, pcie, ethernet, ...
    expected_busbw_Bps: Num  # what that class should give; None: not judged
    nodes: int
    scaling: Scaling | None
    throughput: Throughput


class ProbeLinks(TypedDict):
    """The latest link probe of the current attempt, as the run state keeps it
    (``RunState.set_links``): the measured links only, so that a 1,024-rank probe's
    12,000 links travel instead of its 1,048,576 cells."""

    t: float  # hub time the probe's result came in
    ranks: list[int]  # grouped by node, then by rank
    nodes: list[str]  # the node of each of ``ranks``
    links: list[list[float]]  # [i, j, Bps], i < j indexing ``ranks``: the slower direction
    busbw_Bps: Num  # the allreduce's bus bandwidth (best rank, recent median) just then
    seconds: Num  # how long the probe took (its slowest rank)
    nbytes: Num  # bytes per timed transfer
    errors: list[str]  # ranks that could not take part, and why


class LinksView(ProbeLinks):
    """A link probe as a viewer gets it: with the diagnosis' verdict on each link."""

    slow: list[list[int]]  # [i, j] of the links judged slow (``link_slow_fraction``)
    #: median link between nodes and within nodes; each link is judged against its own
    medians_Bps: dict[str, Num]  # {"inter_node": ..., "intra_node": ...}


class HubInfo(TypedDict):
    """Where a snapshot came from: the live hub's address and counters, or a recording."""

    address: str | None  # None in a replay
    counters: dict[str, int]
    record: str | None


class ReplayInfo(TypedDict):
    """Where a replay stands."""

    position_s: float
    duration_s: float | None
    speed: float
    paused: bool
    finished: bool
    warnings: list[str]


class FigureStats(TypedDict):
    """One figure of the fleet view over the fleet's active ranks: its distribution on
    its worse side (``p95`` is the 5th percentile of a figure where low is worse: the GPU
    clock, memory headroom), the worst value and whose it is."""

    figure: str
    n: int  # ranks that measured it
    p50: Num
    p95: Num
    p99: Num
    worst: Num
    worst_rank: int | None


class Outlier(TypedDict):
    """A rank far from the fleet's median: the figure it deviates most in, and by how
    much (worse than the median, as ``rtop.analysis.viewport.HEAT`` measures it)."""

    rank: int
    node: str
    figure: str
    dev: float


class JobTotals(TypedDict):
    """The job as a whole, over every rank (the header's figures)."""

    steps_per_s: Num  # 1 / the median rank's step time
    samples_per_s: Num  # every rank's samples per second, summed
    efficiency: Num  # median compute / (compute + exposed comm); the scaling's is better
    dropped: int  # records the collectors could not send, summed
    active: int
    lost: int  # lost or failed
    rtop_cpu: Num  # median share of a core a rank's collector uses


class PageView(TypedDict):
    """A page of the ranks table the viewer asked for: its ranks in the order asked
    (sorted, filtered), where it starts, and how many ranks the whole table holds."""

    ranks: list[int]
    offset: int
    total: int


class FleetView(TypedDict):
    """Every rank in a few bytes, and the fleet in aggregate (``rtop.analysis.viewport``).

    The arrays are little-endian bytes, one entry per rank in rank order (``order``):
    ``node_of`` (uint32, an index into ``nodes``, which are ordered by their lowest rank),
    ``local`` (uint16, its place on its node: its local rank), ``status`` (uint8, an index
    into ``STATUSES``); ``heat`` (int8, figure by figure in the order of ``figures``) is
    each rank's deviation from the fleet's median in hundredths, worse positive, clamped
    to +-120, -128 where not measured; ``node_worst`` and ``node_median`` (int8, figure by
    figure) are each node's worst and median of its ranks' heat.
    """

    v: int  # the view's version (``rtop.analysis.viewport.VERSION``)
    ranks: int  # ranks in the fleet (the current attempt)
    partial: bool  # the snapshot's ``ranks`` hold only the rows of the view
    order: bytes
    node_of: bytes
    nodes: list[str]
    local: bytes
    status: bytes
    figures: list[str]
    heat: bytes
    node_worst: bytes
    node_median: bytes
    stats: list[FigureStats]  # one per figure of ``figures``
    outliers: list[Outlier]  # the most deviant ranks, worst first
    job: JobTotals
    pages: dict[str, PageView]  # the pages asked for, by the viewer's names
    build_s: float  # seconds the fleet's arrays and this view took to build


class Snapshot(TypedDict):
    """What a viewer draws (see the module doc)."""

    t_hub: float
    run: RunInfo
    ranks: RankColumns
    nodes: NodeColumns
    build_s: float  # seconds the hub took to build the columns
    findings: list[EpisodeDict]  # active findings, worst first, since when
    analysis_s: float | None  # seconds the last diagnosis took; None: no diagnosis
    overview: Overview
    links: LinksView | None  # the latest link probe (``rtop probe``); None before one
    hub: HubInfo
    replay: NotRequired[ReplayInfo]
    #: only in the snapshot of a view (``{"what": "snapshot", "view": {...}}``): the fleet
    #: in aggregate, and ``ranks`` holds only the view's rows when it says ``partial``
    fleet: NotRequired[FleetView]


class CollectiveFigures(TypedDict):
    """One collective of a rank (``all_gather``, ``reduce_scatter``, ``all_reduce``,
    ...): medians over the recent steps in which it ran (``collectors.schema.
    COLLECTIVE_FIGURES``)."""

    s: float | None  # its in-flight time per step (union of its intervals)
    bytes: float | None  # bytes per step (nccl-tests size convention)
    calls: float | None  # calls per step
    busbw_Bps: float | None  # its bus bandwidth (nccl-tests factor for that collective)
    steps: int  # how many of the recent steps it ran in


class GroupFigures(TypedDict):
    """One process group a rank's collectives ran on (``collectors.groups``): what the
    rank said of it, and its collectives there (medians over the recent steps)."""

    desc: str | None  # the group's description (``group_desc``: "mesh_pp", ...)
    ranks: str | None  # its ranks, short ("0-7", "1,3", "0-1023:8")
    size: int | None
    rank: int | None  # this rank's place in it (a pipeline group's: its stage)
    ops: dict[str, CollectiveFigures]


class RankDetail(TypedDict):
    """One rank of the current attempt in full (``found`` is False if it is unknown)."""

    rank: int
    found: bool
    identity: NotRequired[dict[str, Any]]  # ``collectors.identity.Identity.to_wire()``
    status: NotRequired[Status]
    meta: NotRequired[dict[str, Any]]  # notes, device facts, an error it reported
    stack: NotRequired[str | None]  # the training thread's stack, when it was stuck
    events: NotRequired[list[list[Any]]]  # rows of ``collectors.schema.EVENT_FIELDS``
    offset_s: NotRequired[float | None]
    gpu: NotRequired[list[Any] | None]  # latest rows of the schema's tables
    host: NotRequired[list[Any] | None]
    mem: NotRequired[list[Any] | None]
    hb: NotRequired[list[Any] | None]
    summary: NotRequired[dict[str, float | None]]  # medians kept once its window is freed
    steps: NotRequired[dict[str, Column]]  # step history, one column per field
    samples: NotRequired[dict[str, Column]]  # sample history, one column per field
    #: statistics over its whole rolling window of steps (``data_wait_p95_s``,
    #: ``step_p99_s``, ...: the figures' distributions)
    stats: NotRequired[dict[str, float | None]]
    #: the step's collectives split by collective, over its recent steps (worst first)
    collectives: NotRequired[dict[str, CollectiveFigures]]
    #: the same by process group, where some ran outside the default group (worst first)
    groups: NotRequired[dict[str, GroupFigures]]
    #: steps where the rank stood out from its peers but not for long enough to be named
    #: (data wait, compute), counted over the run by the diagnosis
    hiccups: NotRequired[dict[str, int]]
