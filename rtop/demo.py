"""``rtop demo``: a real instrumented DDP job with an injected fault, and rtop's report.

The job runs as local processes (real DDP over gloo on CPU, a small MLP on synthetic
data); a hub on a thread of this process receives the ranks' streams and records the
run; at the end the recording's report is printed. (The terminal UI takes over the
live view once it exists.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rtop.hub.service import ThreadedHub
from rtop.report import build_report, format_text
from rtop.workload import Faults, WorkloadSpec, run_local

FAULTS = {
    "none": Faults(),
    "starved": Faults(loader_sleep_s={1: 0.040}),
    "straggler": Faults(extra_compute_s={1: 0.030}),
    "memory": Faults(mem_grow_bytes_per_step={1: 8 * 1024 * 1024}),
}


def run(fault: str = "starved", world_size: int = 3, steps: int = 80,
        record: str | None = None) -> int:
    """Run the demo job and print rtop's report of it; returns an exit code."""
    with tempfile.TemporaryDirectory(prefix="rtop-demo-") as tmp:
        path = Path(record) if record else Path(tmp) / "demo.rtop"
        hub = ThreadedHub(job=f"demo-{fault}", record=str(path)).start()
        spec = WorkloadSpec(world_size=world_size, steps=steps, batch=64, dim=256,
                            hidden=512, hub=hub.address, token=hub.token,
                            faults=FAULTS[fault])
        print(f"rtop demo: {world_size} ranks, real DDP over gloo on CPU, {steps} steps, "
              f"fault: {fault}{' on rank 1' if fault != 'none' else ''}; hub {hub.address}",
              flush=True)
        try:
            run_local(spec, timeout_s=600)
        finally:
            hub.stop()
        print(format_text(build_report(path)))
        if record:
            print(f"\nrecording kept at {path}")
    return 0
