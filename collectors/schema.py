"""The records a rank sends, declared as tables of field names that carry their units.

Each record travels as a msgpack array whose items follow the order of its table here,
so a step record costs a few dozen bytes on the wire. ``None`` means *not measured*
(no GPU, no DDP model watched, no loader wrapped) and is never replaced by zero.

Seconds unless the name says otherwise: ``_s`` seconds, ``_bytes`` bytes, ``_Bps``
bytes per second, ``_pct`` percent (0-100), ``_w`` watts, ``_c`` degrees Celsius,
``_mhz`` megahertz. ``t_wall`` is the rank's own ``time.time()``; the hub corrects it
with the clock offset it estimates per rank.
"""

from __future__ import annotations

from typing import Final

#: One record per training step (``with probe.step():``).
STEP_FIELDS: Final = (
    "step",  # the rank's step counter, from 0
    "t_wall",  # wall-clock start of the iteration (start of the wait for its batch)
    "step_s",  # iteration time: gap_s + data_wait_s + the step body
    "data_wait_s",  # blocked in the loader's next(); None when no loader is wrapped
    "compute_s",  # step body minus the collective time the body waited for
    "gpu_s",  # GPU time of the step body from CUDA events; None off CUDA
    "comm_s",  # union of in-flight collective intervals (every collective: DDP's
    #            buckets, FSDP's, a user's own); None when not measured
    "comm_exposed_s",  # part of comm_s the training thread waited for (not overlapped)
    "comm_bytes",  # bytes the step's collectives moved (nccl-tests size convention)
    "comm_calls",  # collectives (DDP buckets, other calls) launched during the step
    "algbw_Bps",  # comm_bytes / comm_s
    "busbw_Bps",  # sum of each collective's bytes x its nccl-tests factor / comm_s
    #               (2(n-1)/n for an allreduce: algbw * 2(n-1)/n)
    "samples",  # samples in the batch, when the batch tells its size
    "gap_s",  # time between the previous step's end and this iteration's start
    "collectives",  # the comm figures split by collective: {op: COLLECTIVE_FIGURES}
    #                 (see COLLECTIVE_OPS); None when the step's collectives were all
    #                 allreduces (a DDP model's, an older collector's): comm_s,
    #                 comm_bytes, comm_calls and busbw_Bps are then the allreduce's
    "tokens",  # tokens in the step's batch, when the loop or a callback says
    #            (probe.step(tokens=...)); None otherwise
    "flops",  # the model FLOPs of this rank's step: given (probe.step(flops=...), the
    #           flops_per_step setting) or counted once (probe.count_flops); None otherwise
    "groups",  # the comm figures split by process group, then by collective:
    #            {group: {op: COLLECTIVE_FIGURES}}, ``group`` the name torch gives the
    #            ProcessGroup (the rank's meta describes each: its ranks, its desc); None
    #            when every collective of the step ran on the default (world) group
)

#: What the ``collectives`` field of a step holds per collective, in this order.
COLLECTIVE_FIGURES: Final = (
    "s",  # union of that collective's in-flight intervals in the step
    "bytes",  # bytes it moved (nccl-tests size convention)
    "calls",  # how many were launched
    "busbw_Bps",  # bytes x its nccl-tests factor / s; None for one rank or no bytes
)

#: The collectives a step's ``collectives`` field names (``collectors.collectives``).
COLLECTIVE_OPS: Final = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                         "broadcast", "reduce", "gather", "scatter", "barrier")

#: NVML sample of the rank's own GPU, about once a second.
GPU_FIELDS: Final = (
    "t_wall",
    "util_pct",
    "mem_util_pct",
    "mem_used_bytes",
    "mem_total_bytes",
    "power_w",
    "power_limit_w",
    "temp_c",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "clock_event_reasons",  # NVML bit mask; decode with collectors.nvml.decode_reasons
    "pcie_tx_Bps",
    "pcie_rx_Bps",
    "nvlink_tx_Bps",
    "nvlink_rx_Bps",
)

#: psutil sample of the rank's process and its host, about once a second.
HOST_FIELDS: Final = (
    "t_wall",
    "proc_cpu_pct",  # this process; 100 = one core busy
    "loader_cpu_pct",  # child processes (DataLoader workers) together
    "loader_procs",  # how many child processes
    "rss_bytes",
    "sys_mem_avail_bytes",
    "sys_mem_total_bytes",
    "cgroup_mem_limit_bytes",  # None when no cgroup limit applies
    "sys_cpu_pct",  # whole machine, 100 = all cores busy
    "load_avg_1m",
)

#: Memory of the rank's training device, about once a second.
MEM_FIELDS: Final = (
    "t_wall",
    "device",  # "cuda:N" or "cpu"
    "used_bytes",  # CUDA: torch allocated; CPU: process RSS
    "reserved_bytes",  # CUDA: torch reserved; CPU: None
    "peak_bytes",  # CUDA: peak reserved + what the process holds outside the allocator
    #                (process_bytes - reserved_bytes: context, NCCL), so headroom =
    #                capacity - peak is not overstated; CPU: peak RSS
    "capacity_bytes",  # CUDA: device total; CPU: min(machine RAM, cgroup limit)
    "param_bytes",  # parameters of the watched model(s)
    "grad_bytes",  # what their gradients take (parameters that require grad)
    "optim_bytes",  # tensors held in the watched optimizer's state
    "process_bytes",  # CUDA: all the process holds on the GPU, per NVML (allocator,
    #                   CUDA context, NCCL buffers); None when NVML cannot tell; CPU: None
)

#: Heartbeat, about once a second: what the training thread is doing right now.
HEARTBEAT_FIELDS: Final = (
    "t_wall",
    "phase",  # one of PHASES
    "phase_s",  # how long the current phase has lasted
    "step",  # last completed step, -1 before the first
    "stack",  # the training thread's Python stack when phase_s is long, else None
)

#: One-off events with a duration (a checkpoint being written, ...).
EVENT_FIELDS: Final = (
    "t_wall",  # start
    "kind",  # "checkpoint", ...
    "duration_s",
    "step",  # last completed step when it started
)

PHASES: Final = ("idle", "data", "compute", "comm", "checkpoint")

#: Fields added to a table after the first recordings were made. A table only grows at
#: its end: a row from an older collector stops before these and reads them as None.
ADDED_FIELDS: Final = {
    "mem": ("process_bytes",),
    "steps": ("collectives", "tokens", "flops", "groups"),
}

#: Record tables by the key they travel under in a batch frame.
TABLES: Final = {
    "steps": STEP_FIELDS,
    "gpu": GPU_FIELDS,
    "host": HOST_FIELDS,
    "mem": MEM_FIELDS,
    "hb": HEARTBEAT_FIELDS,
    "events": EVENT_FIELDS,
}
