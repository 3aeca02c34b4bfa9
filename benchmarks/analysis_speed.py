"""How long one pass of the diagnosis takes at thousands of ranks (targets, issue 26: 100 ms
at 4,096 ranks, 400 ms at 16,384: the hub runs one every 0.5 s).

Builds the hub's own RunState for ``--ranks`` ranks (8 per node) through ``apply()``,
with a full window of step records and 1 Hz GPU/host/memory/heartbeat samples, one
starved rank and one straggler among them, then times ``Analyzer.update`` (what the
hub runs twice a second, each pass half a second of hub time after the last, so the
long memory fit is refitted a slice per pass as in the hub) and, beside it,
``RunState.snapshot``. The median and the worst pass are printed against the target.

    python benchmarks/analysis_speed.py [--ranks 4096] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors import wire
from collectors.schema import GPU_FIELDS, HEARTBEAT_FIELDS, HOST_FIELDS, MEM_FIELDS, STEP_FIELDS
from rtop.analysis import AnalysisConfig, Analyzer
from rtop.run.state import RunState


def row(fields: tuple[str, ...], **values: object) -> list[object]:
    return [values.get(f) for f in fields]


def build(ranks: int, steps: int, samples: int) -> RunState:
    rng = np.random.default_rng(1)
    st = RunState()
    t0 = time.time()
    for r in range(ranks):
        ident = {"rank": r, "local_rank": r % 8, "world_size": ranks,
                 "hostname": f"node-{r // 8:04d}", "ip": "10.0.0.1", "pid": 1000 + r,
                 "attempt": 0, "job": "bench", "group": "g", "node_id": "", "source": "env"}
        st.apply(wire.Frame("hello", {"identity": ident, "token": "x"}), t0)
    for r in range(ranks):
        wait = 0.2 if r == 17 else 0.001
        compute = 0.4 if r == 33 else 0.3
        step_rows = [row(STEP_FIELDS, step=k, t_wall=t0 + 0.5 * k, step_s=0.5,
                         data_wait_s=wait + rng.normal(0, 1e-4),
                         compute_s=compute + rng.normal(0, 1e-3),
                         comm_s=0.1, comm_exposed_s=0.05, comm_bytes=4e8, comm_calls=16,
                         algbw_Bps=2e10, busbw_Bps=3.9e10, samples=32, gap_s=0.0)
                     for k in range(steps)]
        gpu = [row(GPU_FIELDS, t_wall=t0 + k, util_pct=97.0, mem_used_bytes=9e10,
                   mem_total_bytes=1.4e11, power_w=650.0, power_limit_w=700.0, temp_c=60,
                   sm_clock_mhz=1980, sm_clock_max_mhz=1980, clock_event_reasons=0)
               for k in range(samples)]
        host = [row(HOST_FIELDS, t_wall=t0 + k, proc_cpu_pct=100.0, loader_cpu_pct=300.0,
                    loader_procs=8, rss_bytes=2e10, sys_mem_avail_bytes=5e11,
                    sys_mem_total_bytes=1e12, sys_cpu_pct=30.0, load_avg_1m=20.0)
                for k in range(samples)]
        mem = [row(MEM_FIELDS, t_wall=t0 + k, device="cuda:0", used_bytes=8e10, reserved_bytes=9e10,
                   peak_bytes=9e10, capacity_bytes=1.4e11, param_bytes=1.6e10, grad_bytes=1.6e10,
                   optim_bytes=6.4e10) for k in range(samples)]
        hb = [row(HEARTBEAT_FIELDS, t_wall=t0 + samples, phase="compute", phase_s=0.1,
                  step=steps - 1, stack=None)]
        st.apply(wire.Frame("batch", {"rank": r, "group": "g", "steps": step_rows, "gpu": gpu,
                                      "host": host, "mem": mem, "hb": hb}), t0 + samples)
    return st


#: The issue's targets for one pass, by ranks (ms).
TARGET_MS = {4096: 100, 16384: 400}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    st = build(args.ranks, steps=40, samples=130)
    analyzer = Analyzer(AnalysisConfig())
    now = st.now
    found = analyzer.update(st, now)
    times, snaps = [], []
    for k in range(args.repeat):
        t = time.perf_counter()
        found = analyzer.update(st, now + 0.5 * (k + 1))
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        st.view()
        snaps.append(time.perf_counter() - t)
    target = TARGET_MS.get(args.ranks)
    print(f"diagnosis of {args.ranks} ranks: median {statistics.median(times) * 1e3:.1f} ms, "
          f"max {max(times) * 1e3:.1f} ms"
          + (f"  (target <= {target} ms: {'met' if max(times) * 1e3 <= target else 'NOT met'})"
             if target else ""))
    print(f"snapshot of {args.ranks} ranks: median {statistics.median(snaps) * 1e3:.1f} ms")
    print("findings:", [(f["kind"], f["ranks"][:4]) for f in found])


if __name__ == "__main__":
    main()
