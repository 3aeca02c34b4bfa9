"""``rtop demo``: a real instrumented DDP job with an injected fault, and what rtop saw.

For now the demo runs the job as local processes (gloo over loopback), receives the
ranks' frames with rtop's minimal receiver and prints per-rank medians. The terminal UI
replaces the printout once it exists.
"""

from __future__ import annotations

import statistics
from typing import Any

from rtop.listener import Listener
from rtop.workload import Faults, WorkloadSpec, run_local

FAULTS = {
    "none": Faults(),
    "starved": Faults(loader_sleep_s={1: 0.040}),
    "straggler": Faults(extra_compute_s={1: 0.030}),
    "memory": Faults(mem_grow_bytes_per_step={1: 8 * 1024 * 1024}),
}


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def summary_table(listener: Listener) -> str:
    """Per-rank medians of what the collectors measured, as a text table."""
    steps = listener.records("steps")
    gpu = listener.records("gpu")
    mem = listener.records("mem")
    head = (f"{'rank':>4} {'node':<12} {'steps':>5} {'step ms':>8} {'data ms':>8} "
            f"{'compute ms':>10} {'comm ms':>8} {'exposed ms':>10} {'comm MB':>8} "
            f"{'busbw MB/s':>10} {'GPU util':>8} {'peak MB':>8}")
    lines = [head, "-" * len(head)]
    for rank in sorted(steps):
        rows = steps[rank][3:] or steps[rank]
        node = listener.hellos.get(rank, {}).get("identity", {}).get("hostname", "?")
        peak = max((m["peak_bytes"] or 0 for m in mem.get(rank, [])), default=None)
        lines.append(
            f"{rank:>4} {node[:12]:<12} {len(steps[rank]):>5} "
            f"{_fmt(_med(rows, 'step_s'), 1e3):>8} {_fmt(_med(rows, 'data_wait_s'), 1e3):>8} "
            f"{_fmt(_med(rows, 'compute_s'), 1e3):>10} {_fmt(_med(rows, 'comm_s'), 1e3):>8} "
            f"{_fmt(_med(rows, 'comm_exposed_s'), 1e3):>10} "
            f"{_fmt(_med(rows, 'comm_bytes'), 1e-6, 2):>8} "
            f"{_fmt(_med(rows, 'busbw_Bps'), 1e-6, 0):>10} "
            f"{_fmt(_med(gpu.get(rank, []), 'util_pct'), 1, 0):>8} "
            f"{_fmt(peak, 1e-6, 0):>8}"
        )
    return "\n".join(lines)


def run(fault: str = "starved", world_size: int = 3, steps: int = 80) -> int:
    """Run the demo job and print what was measured; returns an exit code."""
    listener = Listener()
    spec = WorkloadSpec(world_size=world_size, steps=steps, batch=64, dim=256, hidden=512,
                        hub=listener.address, token=listener.token, faults=FAULTS[fault])
    print(f"rtop demo: {world_size} ranks, real DDP over gloo on CPU, {steps} steps, "
          f"fault: {fault} (rank 1)")
    try:
        run_local(spec, timeout_s=600)
        print(summary_table(listener))
    finally:
        listener.close()
    return 0
