"""How long from a fault's onset to rtop naming it: real jobs, injected faults.

    python benchmarks/diagnosis_latency.py [--repeats N]

Each scenario is a real DDP job over gloo on CPU (the test suite's ``tests/scenarios.py``)
against a real hub with the default diagnosis settings (the hung rank with a 6 s
threshold instead of 30 s, to keep the run short). The fault starts at step 40 on one
rank; the latency is from the moment that rank wrote its fault mark to the first
snapshot poll (10 Hz) that showed the finding. Targets (issue 4): a starved rank or a
straggler within 3 s; a hung rank within 10 s past its threshold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rtop.analysis import AnalysisConfig
from rtop.workload import Faults
from tests.scenarios import run_scenario

START = 40
SCENARIOS = {
    # name: (kind, faults, world, thresholds, extra, target seconds)
    "starved rank": ("starved_rank", Faults(loader_sleep_s={1: 0.030}, start_step=START), 3,
                     None, {}, 3.0),
    "input bound": ("input_bound", Faults(all_loader_sleep_s=0.030, start_step=START), 2,
                    None, {}, 3.0),
    "straggler": ("straggler", Faults(extra_compute_s={1: 0.030}, start_step=START), 2,
                  None, {}, 3.0),
    "killed rank": ("lost_rank", Faults(die_at_step={1: START}, start_step=START), 3,
                    None, {}, 3.0),
    "hung rank (6 s threshold)": ("hung_rank", Faults(hang_at_step={1: START},
                                                      start_step=START), 3,
                                  AnalysisConfig(hung_min_s=6.0),
                                  {"probe_settings": {"stack_after_s": 2.0}}, 16.0),
}


def main() -> None:
    """Run each scenario ``--repeats`` times and print the latencies."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'scenario':<28}{'kind':<14}{'latencies (s)':<28}{'median':>8}{'target':>8}  verdict")
    for name, (kind, faults, world, cfg, extra, target) in SCENARIOS.items():
        lat = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                out = run_scenario(Path(tmp), faults, world=world, duration_s=40.0,
                                   thresholds=cfg, check=False, timeout_s=90,
                                   until=lambda o, k=kind: k in o.kinds, grace_s=0.5,
                                   **extra)
                lat.append(out.latency(kind) if kind in out.kinds else float("inf"))
        med = statistics.median(lat)
        shown = ", ".join(f"{x:.1f}" for x in lat)
        print(f"{name:<28}{kind:<14}{shown:<28}{med:>8.1f}{target:>8.1f}  "
              f"{'PASS' if med <= target else 'FAIL'}", flush=True)


if __name__ == "__main__":
    main()
