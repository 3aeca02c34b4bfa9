"""Prometheus exposition of a hub snapshot (``GET /metrics`` with the hub's view token:
the one token a scraper may hold, since it can never act on the job)."""

from __future__ import annotations

from typing import Any, cast

from rtop.run.snapshot import Snapshot

#: (metric name, snapshot column, help) — one gauge per rank.
GAUGES = (
    ("rtop_step_seconds", "step_s", "Median iteration time over recent steps"),
    ("rtop_data_wait_seconds", "data_wait_s", "Median time blocked in the data loader"),
    ("rtop_compute_seconds", "compute_s", "Median compute time per step"),
    ("rtop_comm_seconds", "comm_s", "Median allreduce time in flight per step"),
    ("rtop_comm_exposed_seconds", "comm_exposed_s", "Median allreduce time not overlapped"),
    ("rtop_busbw_bytes_per_second", "busbw_Bps", "Median allreduce bus bandwidth"),
    ("rtop_gpu_utilization_percent", "gpu_util_pct", "GPU utilization (NVML)"),
    ("rtop_gpu_memory_used_bytes", "gpu_mem_used_bytes", "GPU memory used (NVML)"),
    ("rtop_gpu_power_watts", "gpu_power_w", "GPU power draw (NVML)"),
    ("rtop_mem_peak_bytes", "mem_peak_bytes", "Peak memory of the training device"),
    ("rtop_mem_capacity_bytes", "mem_capacity_bytes", "Capacity of the training device"),
    ("rtop_last_step", "step", "Last step reported"),
    ("rtop_dropped_records", "dropped", "Records the rank could not send"),
)


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def prometheus_text(snap: Snapshot) -> str:
    """Prometheus text format (0.0.4) for the ranks of a snapshot."""
    cols = snap["ranks"]
    by_name = cast(dict[str, list[Any]], cols)  # the gauges name their columns
    ranks = cols["rank"]
    out: list[str] = []
    for name, col, text in GAUGES:
        values = by_name.get(col)
        if values is None:
            continue
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} gauge")
        for i, rank in enumerate(ranks):
            v = values[i]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append(f'{name}{{rank="{rank}",node="{_label(cols["node"][i])}"}} {v}')
    out.append("# HELP rtop_rank_up 1 if the rank is sending, 0 if lost or finished")
    out.append("# TYPE rtop_rank_up gauge")
    for i, rank in enumerate(ranks):
        up = 1 if cols["status"][i] == "active" else 0
        out.append(f'rtop_rank_up{{rank="{rank}",node="{_label(cols["node"][i])}"}} {up}')
    findings = snap.get("findings") or []
    out.append("# HELP rtop_findings Current findings by kind")
    out.append("# TYPE rtop_findings gauge")
    kinds: dict[str, int] = {}
    for f in findings:
        kinds[f.get("kind", "?")] = kinds.get(f.get("kind", "?"), 0) + 1
    for kind, n in sorted(kinds.items()):
        out.append(f'rtop_findings{{kind="{_label(kind)}"}} {n}')
    return "\n".join(out) + "\n"
