"""Every figure rtop shows, declared once: its name, where it is measured, what it means,
and where the application uses it.

The wire tables of :mod:`collectors.schema` say in which order a rank sends its fields;
this table says what each figure *is* to the application. Every list of figures the hub,
the diagnosis, the report, the Prometheus exposition, the terminal UI and the CLI keep is
derived from it, so a figure is added in one place (and measured where it is measured).

A :class:`Figure`'s ``name`` carries its unit (``_s`` seconds, ``_bytes`` bytes, ``_Bps``
bytes per second, ``_pct`` percent, ``_w`` watts, ``_c`` degrees Celsius, ``_mhz``
megahertz) and is the same everywhere: the snapshot's column (``RankColumns``), the rank
detail's histories, the report (unless ``report_key`` keeps an older public key), the
UI's row model. A sample table's field is named with its table's prefix (``util_pct`` of
the ``gpu`` table is ``gpu_util_pct``); a step's field keeps its own name.

What the application does with a figure:

* ``window``: kept in the rank's rolling window on the hub (its step or sample history:
  the rank detail's sparklines, the detectors' trends);
* ``snapshot``: a column of the snapshot's ranks. A step figure is its median over the
  rank's recent steps, or, with ``quantile``, that quantile of the step field ``of``
  over the rank's whole rolling window; a sample figure is the rank's latest sample; a
  ``rank`` figure is what the hub knows of the rank;
* ``diagnosis``: the diagnosis reads its recent median (``rtop.analysis.window``);
* ``report``: how ``rtop report`` sums it up over the run: the ``median`` of its values,
  their ``peak``, the ``last`` one measured, or, with ``quantile``, that quantile of
  ``of`` over every step of the run; under ``report_key`` where that public key differs;
* ``node``: the nodes' view keeps each node's worst rank's figure (its ``max`` or ``min``);
* ``prometheus``: the per-rank series it is exposed as (the names are public: never
  derived, never renamed): a gauge, a counter, or, with ``quantile``, one quantile of a
  Summary family (the distributions: :data:`QUANTILES` of a step field over the rank's
  rolling window, :func:`distribution`);
* ``column``: a column of the UI's ranks table; ``detail``: a line of the UI's rank
  detail (a sparkline when the figure has a history, else its value); ``text``: a
  column of the plain-text tables (``rtop status``, ``rtop report``).

``None`` means not measured everywhere, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from collectors.schema import TABLES

#: Where a figure is measured: one of the wire tables, or ``rank``: what the hub itself
#: knows of a rank (its identity, status, when it was last heard from, ...).
Table = Literal["rank", "steps", "gpu", "host", "mem", "hb"]
#: How ``rtop report`` sums a figure up over the run.
Summary = Literal["median", "peak", "last", "quantile"]
#: How a value prints, by name (``rtop.fmt``: ``ms`` milliseconds from seconds, ``rate``
#: GB/s or MB/s, ``pct``, ``bytes``, ``int``, ``num0`` no decimals), or, for a UI column,
#: a cell the UI draws from several figures (``bar``: the step's data / compute / comm
#: shares; ``memory``: used / capacity; ``free``: the share of the capacity left at the
#: peak; ``power``: draw / limit; ``clock``: clock / its maximum).
Format = Literal["ms", "rate", "pct", "bytes", "int", "num0",
                 "bar", "memory", "free", "power", "clock"]

#: The prefix of a table's fields in a figure's name.
PREFIX: Final[dict[str, str]] = {"rank": "", "steps": "", "gpu": "gpu_", "host": "host_",
                                 "mem": "mem_", "hb": ""}


@dataclass(frozen=True)
class Prom:
    """A per-rank Prometheus series (``rank`` and ``node`` labels; ``_total`` is added
    to a counter's name on output)."""

    name: str  # the exposed name, its unit last: public, never derived
    help: str
    scale: float = 1.0  # to the unit the name says (MHz → hertz)
    offset: float = 0.0  # added after scaling (the step counter from 0 → steps done)
    counter: bool = False
    #: a sample of the Summary family ``name``, labelled with this quantile (0 to 1)
    quantile: float | None = None


@dataclass(frozen=True)
class Column:
    """A column of the UI's ranks table (after rank, node and status)."""

    label: str
    width: int
    fmt: Format
    at: int  # where it stands: columns are laid out by ``at``, left to right
    drop: int = 0  # on a narrow terminal the highest ``drop`` goes first (0: never)
    desc: bool = False  # sorted high first (a high value is the worse)


@dataclass(frozen=True)
class Row:
    """A line of the UI's rank detail (in the table's order): a sparkline of the figure's
    history, or, for a statistic of the rank's window, its value and ``note``."""

    label: str
    fmt: Format
    note: str = ""


@dataclass(frozen=True)
class Text:
    """A column of the plain-text tables: value × ``scale`` with ``digits`` decimals."""

    label: str
    width: int
    scale: float = 1.0
    digits: int = 1
    status: bool = True  # in ``rtop status``'s table (from the snapshot)
    report: bool = True  # in ``rtop report``'s table (from the report)


@dataclass(frozen=True)
class Figure:
    """One figure (see the module doc)."""

    name: str
    table: Table
    doc: str
    field: str = ""  # its field in the wire table; "" : the name less the table's prefix
    of: str = ""  # a statistic of another step field: that field (with ``quantile``)
    quantile: float | None = None
    window: bool = False
    snapshot: bool = True
    diagnosis: bool = False
    report: Summary | None = None
    report_key: str = ""
    node: Literal["max", "min"] | None = None
    prometheus: tuple[Prom, ...] = ()
    column: Column | None = None
    detail: Row | None = None
    text: Text | None = None

    @property
    def source(self) -> str:
        """The wire field it is read from (``of`` for a statistic of another field)."""
        return self.of or self.field or self.name[len(PREFIX[self.table]):]

    @property
    def key(self) -> str:
        """Its key in ``rtop report``'s ranks."""
        return self.report_key or self.name


#: The quantiles a step figure's distribution is kept at (the median, p95, p99).
QUANTILES: Final = (0.5, 0.95, 0.99)


def distribution(of: str, label: str, what: str, summary: str, *, note: str = "",
                 keep: dict[float, tuple[Prom, Text]] | None = None
                 ) -> tuple[Figure, ...]:
    """The figures of a step field's distribution: one per :data:`QUANTILES` (``of``
    less ``_s``, then ``_p50_s``, ``_p95_s``, ``_p99_s``), each over the rank's rolling
    window of steps (the report: over the run), a quantile of the Prometheus Summary
    ``summary``, and one line of the rank detail (``label``) for the three; ``keep``
    adds, per quantile, a series and a text column that were public before."""
    base = of.removesuffix("_s")
    out = []
    for q in QUANTILES:
        pct = round(q * 100)
        kept = (keep or {}).get(q)
        prom = Prom(summary, f"Quantiles of {what} over the rank's rolling window of steps",
                    quantile=q)
        out.append(Figure(
            f"{base}_p{pct}_s", "steps",
            f"{pct}th percentile of {of} over the rank's rolling window of steps (the "
            f"report: over the run){': ' + note if note else ''}",
            of=of, quantile=q, report="quantile",
            prometheus=(kept[0], prom) if kept else (prom,),
            detail=Row(label, "ms", "ms, p50 · p95 · p99 over the rank's rolling window of "
                                    "steps"),
            text=kept[1] if kept else None))
    return tuple(out)


FIGURES: Final[tuple[Figure, ...]] = (
    # ---- what the hub knows of a rank -----------------------------------------------
    Figure("rank", "rank", "the rank's world rank"),
    Figure("node", "rank", "the node (hostname) it runs on"),
    Figure("local_rank", "rank", "its index among the ranks of its node (the launcher's "
           "local rank): the fleet view's column"),
    Figure("status", "rank", "active, finished, exited, failed, lost or ended"),
    Figure("last_seen_s", "rank", "seconds since the rank's last frame",
           prometheus=(Prom("rtop_last_seen_seconds", "Seconds since the rank's last frame"),)),
    Figure("dropped", "rank", "records the rank's collector could not send",
           prometheus=(Prom("rtop_dropped_records", "Records the rank's collector could not "
                            "send (rtop's own cost)", counter=True),)),
    Figure("rtop_cpu", "rank", "share of one core the rank's collector uses",
           prometheus=(Prom("rtop_collector_cpu_ratio", "Share of one core the rank's rtop "
                            "collector uses (CPU seconds per second)"),)),
    Figure("offset_s", "rank", "the rank's clock minus the hub's",
           prometheus=(Prom("rtop_clock_offset_seconds", "The rank's clock minus the hub's"),)),
    # ---- per step (collectors.schema.STEP_FIELDS) -----------------------------------
    Figure("step", "steps", "the rank's step counter, from 0; in the snapshot the last "
           "step reported (-1 before the first)", window=True,
           prometheus=(Prom("rtop_last_step", "Last step number reported (from 0; -1 before "
                            "one)"),
                       Prom("rtop_steps", "Steps the rank has completed (its step counter "
                            "+ 1)", offset=1.0, counter=True)),
           column=Column("step", 7, "int", at=10, drop=6, desc=True)),
    Figure("t_wall", "steps", "wall-clock start of the iteration (the rank's clock)",
           window=True, snapshot=False),
    Figure("step_s", "steps", "iteration time: gap_s + data_wait_s + the step body",
           window=True, diagnosis=True, report="median", node="max",
           prometheus=(Prom("rtop_step_seconds", "Median iteration time over recent steps"),),
           column=Column("step ms", 8, "ms", at=20, desc=True),
           detail=Row("step ms", "ms"), text=Text("step ms", 8, 1e3)),
    *distribution("step_s", "step", "the iteration time", "rtop_step_window_seconds"),
    Figure("data_wait_s", "steps", "time blocked in the loader's next() (None when no "
           "loader is wrapped)", window=True, diagnosis=True, report="median", node="max",
           prometheus=(Prom("rtop_data_wait_seconds",
                            "Median time blocked in the data loader per step"),),
           column=Column("data▒ compute█ comm░", 20, "bar", at=30, drop=2, desc=True),
           detail=Row("data ms", "ms"), text=Text("data ms", 8, 1e3)),
    *distribution(
        "data_wait_s", "data wait", "the time blocked in the data loader per step",
        "rtop_data_wait_window_seconds", note="the stalls a median hides",
        keep={0.95: (Prom("rtop_data_wait_p95_seconds", "95th percentile of the time "
                          "blocked in the data loader per step, over the rank's rolling "
                          "window of steps"), Text("data p95", 8, 1e3, status=False))}),
    Figure("compute_s", "steps", "step body minus the collective time it waited for",
           window=True, diagnosis=True, report="median",
           prometheus=(Prom("rtop_compute_seconds",
                            "Median compute time per step (outside collectives)"),),
           detail=Row("compute ms", "ms"), text=Text("comp ms", 8, 1e3)),
    Figure("gpu_s", "steps", "GPU time of the step body from CUDA events (None off CUDA)",
           window=True, report="median",
           prometheus=(Prom("rtop_gpu_seconds",
                            "Median GPU time of the step body (CUDA events)"),)),
    Figure("comm_s", "steps", "union of the step's in-flight collective intervals",
           window=True, diagnosis=True, report="median", node="max",
           prometheus=(Prom("rtop_comm_seconds", "Median collective time in flight per step"),),
           column=Column("comm ms", 8, "ms", at=40, drop=5, desc=True),
           detail=Row("allreduce", "ms"), text=Text("comm ms", 8, 1e3)),
    Figure("comm_exposed_s", "steps", "the part of comm_s the training thread waited for",
           window=True, diagnosis=True, report="median",
           prometheus=(Prom("rtop_comm_exposed_seconds",
                            "Median collective time per step not overlapped with compute"),),
           text=Text("exp ms", 7, 1e3, status=False)),
    *distribution("comm_exposed_s", "exp comm", "the collective time per step not "
                  "overlapped with compute", "rtop_comm_exposed_window_seconds"),
    Figure("comm_bytes", "steps", "bytes the step's collectives moved (nccl-tests size "
           "convention)", window=True, diagnosis=True, report="median",
           prometheus=(Prom("rtop_comm_bytes", "Median bytes moved by collectives per step"),),
           text=Text("comm MB", 8, 1e-6, 2, status=False)),
    Figure("comm_calls", "steps", "collectives launched during the step", snapshot=False),
    Figure("algbw_Bps", "steps", "comm_bytes / comm_s", snapshot=False),
    Figure("busbw_Bps", "steps", "the collectives' bus bandwidth (nccl-tests convention)",
           window=True, diagnosis=True, report="median", node="min",
           prometheus=(Prom("rtop_busbw_bytes_per_second",
                            "Median collective bus bandwidth (nccl-tests convention)"),),
           column=Column("busbw", 10, "rate", at=50, drop=3),
           text=Text("busbw GB/s", 10, 1e-9, 3)),
    Figure("samples", "steps", "samples in the batch, when the batch tells its size",
           window=True, diagnosis=True, report="median", report_key="samples_per_step",
           prometheus=(Prom("rtop_step_samples", "Median samples per step"),)),
    Figure("tokens", "steps", "tokens in the step's batch, when the loop says "
           "(probe.step(tokens=...)) or a callback finds input_ids", window=True,
           diagnosis=True, report="median", report_key="tokens_per_step",
           prometheus=(Prom("rtop_step_tokens", "Median tokens per step"),)),
    Figure("flops", "steps", "model FLOPs of the rank's step: given (probe.step(flops=...), "
           "RTOP_FLOPS_PER_STEP) or counted once (probe.count_flops)", window=True,
           diagnosis=True, report="median", report_key="flops_per_step",
           prometheus=(Prom("rtop_step_flops", "Median model FLOPs of the rank's step"),)),
    Figure("gap_s", "steps", "time between the previous step's end and this iteration's "
           "start", window=True,
           prometheus=(Prom("rtop_gap_seconds", "Median time between a step's end and the "
                            "next iteration's start"),)),
    # ---- NVML, about once a second (collectors.schema.GPU_FIELDS) -------------------
    Figure("gpu_util_pct", "gpu", "GPU utilization", window=True, report="median",
           prometheus=(Prom("rtop_gpu_utilization_percent", "GPU utilization (NVML)"),),
           column=Column("GPU", 5, "pct", at=60, drop=3),
           detail=Row("GPU util", "pct"), text=Text("GPU %", 6, 1, 0)),
    Figure("gpu_mem_util_pct", "gpu", "GPU memory controller utilization",
           prometheus=(Prom("rtop_gpu_memory_utilization_percent",
                            "GPU memory controller utilization (NVML)"),)),
    Figure("gpu_mem_used_bytes", "gpu", "GPU memory used, all processes", window=True,
           report="peak",
           prometheus=(Prom("rtop_gpu_memory_used_bytes", "GPU memory used (NVML)"),)),
    Figure("gpu_mem_total_bytes", "gpu", "GPU memory total", report="last",
           prometheus=(Prom("rtop_gpu_memory_total_bytes", "GPU memory total (NVML)"),)),
    Figure("gpu_power_w", "gpu", "GPU power draw", window=True, report="median",
           prometheus=(Prom("rtop_gpu_power_watts", "GPU power draw (NVML)"),),
           column=Column("power", 10, "power", at=90, drop=7, desc=True),
           detail=Row("power W", "num0")),
    Figure("gpu_power_limit_w", "gpu", "GPU power limit",
           prometheus=(Prom("rtop_gpu_power_limit_watts", "GPU power limit (NVML)"),)),
    Figure("gpu_temp_c", "gpu", "GPU temperature", window=True,
           prometheus=(Prom("rtop_gpu_temperature_celsius", "GPU temperature (NVML)"),)),
    Figure("gpu_sm_clock_mhz", "gpu", "SM clock", window=True, report="median",
           prometheus=(Prom("rtop_gpu_sm_clock_hertz", "GPU SM clock (NVML)", 1e6),),
           column=Column("clock MHz", 11, "clock", at=100, drop=8),
           detail=Row("clock MHz", "num0")),
    Figure("gpu_sm_clock_max_mhz", "gpu", "maximum SM clock",
           prometheus=(Prom("rtop_gpu_sm_clock_max_hertz", "GPU maximum SM clock (NVML)",
                            1e6),)),
    Figure("gpu_clock_event_reasons", "gpu", "NVML's clock event (throttle) reasons, a bit "
           "mask (collectors.nvml.decode_reasons)",
           prometheus=(Prom("rtop_gpu_clock_event_reasons",
                            "NVML clock event (throttle) reasons, as NVML's bit mask"),)),
    Figure("gpu_pcie_tx_Bps", "gpu", "PCIe transmit",
           prometheus=(Prom("rtop_gpu_pcie_tx_bytes_per_second", "PCIe transmit (NVML)"),)),
    Figure("gpu_pcie_rx_Bps", "gpu", "PCIe receive",
           prometheus=(Prom("rtop_gpu_pcie_rx_bytes_per_second", "PCIe receive (NVML)"),)),
    Figure("gpu_nvlink_tx_Bps", "gpu", "NVLink transmit",
           prometheus=(Prom("rtop_gpu_nvlink_tx_bytes_per_second", "NVLink transmit (NVML)"),)),
    Figure("gpu_nvlink_rx_Bps", "gpu", "NVLink receive",
           prometheus=(Prom("rtop_gpu_nvlink_rx_bytes_per_second", "NVLink receive (NVML)"),)),
    # ---- psutil, about once a second (collectors.schema.HOST_FIELDS) ----------------
    Figure("host_proc_cpu_pct", "host", "CPU of the rank's process (100 = one core)",
           window=True,
           prometheus=(Prom("rtop_host_process_cpu_percent",
                            "CPU of the rank's process (100 = one core)"),),
           detail=Row("host CPU", "pct")),
    Figure("host_loader_cpu_pct", "host", "CPU of its child processes (DataLoader workers) "
           "together", window=True,
           prometheus=(Prom("rtop_host_loader_cpu_percent",
                            "CPU of the rank's data-loader workers (100 = one core)"),)),
    Figure("host_loader_procs", "host", "how many child processes",
           prometheus=(Prom("rtop_host_loader_processes", "Data-loader worker processes"),)),
    Figure("host_rss_bytes", "host", "resident memory of the rank's process", window=True,
           prometheus=(Prom("rtop_host_rss_bytes", "Resident memory of the rank's process"),)),
    Figure("host_sys_mem_avail_bytes", "host", "host memory available",
           prometheus=(Prom("rtop_host_memory_available_bytes", "Host memory available"),)),
    Figure("host_sys_mem_total_bytes", "host", "host memory total",
           prometheus=(Prom("rtop_host_memory_total_bytes", "Host memory total"),)),
    Figure("host_cgroup_mem_limit_bytes", "host", "memory limit of the rank's cgroup (None "
           "when none applies)",
           prometheus=(Prom("rtop_host_cgroup_memory_limit_bytes",
                            "Memory limit of the rank's cgroup"),)),
    Figure("host_sys_cpu_pct", "host", "whole machine's CPU (100 = all cores busy)",
           prometheus=(Prom("rtop_host_cpu_percent", "Host CPU utilization"),)),
    Figure("host_load_avg_1m", "host", "host load average over one minute",
           prometheus=(Prom("rtop_host_load1", "Host load average over 1 minute"),)),
    # ---- the training device's memory (collectors.schema.MEM_FIELDS) ----------------
    Figure("mem_device", "mem", '"cuda:N" or "cpu"', field="device", report="last",
           report_key="mem_device"),
    Figure("mem_used_bytes", "mem", "CUDA: torch allocated; CPU: the process's RSS (the UI "
           "falls back on NVML's figure)", window=True,
           prometheus=(Prom("rtop_mem_used_bytes", "Memory allocated on the training "
                            "device"),),
           column=Column("memory", 17, "memory", at=70, drop=4, desc=True),
           detail=Row("memory", "bytes")),
    Figure("mem_reserved_bytes", "mem", "CUDA: torch reserved; CPU: None",
           prometheus=(Prom("rtop_mem_reserved_bytes",
                            "Memory reserved by the allocator on the training device"),)),
    Figure("mem_peak_bytes", "mem", "CUDA: peak reserved + what the process holds outside "
           "the allocator; CPU: peak RSS", window=True, report="peak",
           report_key="peak_bytes",
           prometheus=(Prom("rtop_mem_peak_bytes", "Peak memory of the training device"),),
           column=Column("free", 5, "free", at=80, drop=2),
           text=Text("peak GB", 8, 1e-9, 2, status=False)),
    Figure("mem_capacity_bytes", "mem", "CUDA: the device's total; CPU: min(machine RAM, "
           "cgroup limit)", report="last", report_key="capacity_bytes",
           prometheus=(Prom("rtop_mem_capacity_bytes", "Capacity of the training device"),)),
    Figure("mem_param_bytes", "mem", "parameters of the watched model(s)", report="last",
           report_key="param_bytes",
           prometheus=(Prom("rtop_mem_param_bytes", "Bytes of parameters"),)),
    Figure("mem_grad_bytes", "mem", "their gradients", report="last", report_key="grad_bytes",
           prometheus=(Prom("rtop_mem_grad_bytes", "Bytes of gradients"),)),
    Figure("mem_optim_bytes", "mem", "the watched optimizer's state", report="last",
           report_key="optim_bytes",
           prometheus=(Prom("rtop_mem_optim_bytes", "Bytes of optimizer state"),)),
    Figure("mem_process_bytes", "mem", "CUDA: all the process holds on the GPU, per NVML",
           prometheus=(Prom("rtop_mem_process_bytes",
                            "All the process holds on the GPU (NVML)"),)),
    # ---- heartbeats (collectors.schema.HEARTBEAT_FIELDS) ----------------------------
    Figure("phase", "hb", "what the training thread was doing at its last heartbeat"),
    Figure("phase_s", "hb", "how long the current phase had lasted at the last heartbeat",
           prometheus=(Prom("rtop_phase_seconds",
                            "How long the current phase had lasted at the last heartbeat"),)),
)

#: Figures by name.
BY_NAME: Final[dict[str, Figure]] = {f.name: f for f in FIGURES}


def figures(table: Table | None = None) -> tuple[Figure, ...]:
    """The figures of ``table`` (all if None), in the table's order."""
    return tuple(f for f in FIGURES if table is None or f.table == table)


def window_fields(table: str) -> tuple[str, ...]:
    """The fields of a wire table kept in the ranks' rolling windows, in wire order."""
    kept = {f.source for f in FIGURES if f.table == table and f.window and not f.of}
    return tuple(name for name in TABLES[table] if name in kept)


def _check() -> None:
    """Every figure reads a field its table has, and names are unique."""
    assert len(BY_NAME) == len(FIGURES), "two figures of one name"
    for f in FIGURES:
        if f.table != "rank":
            assert f.source in TABLES[f.table], (f.name, f.source)
        assert f.name.startswith(PREFIX[f.table]) or f.field, f.name
        # a step figure's snapshot column is its median over the window's recent steps,
        # or a quantile of a field the window keeps
        assert f.table != "steps" or f.window or f.of or not f.snapshot, f.name
        assert (f.quantile is not None) == bool(f.of), f.name
        assert f.report != "quantile" or f.of, f.name
        assert not f.of or (f.table == "steps" and not f.window
                            and f.of in window_fields("steps")), f.name
        # a Summary's quantile is the figure's own
        assert all(p.quantile in (None, f.quantile) and not (p.quantile and p.counter)
                   for p in f.prometheus), f.name


_check()
