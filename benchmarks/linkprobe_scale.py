"""What a link probe costs the job as it grows: a flat probe of N real gloo ranks on
loopback, timed, and from its time per round, what 64 ranks (flat) and 1,024 ranks (128
nodes of 8, by node) would take.

    python benchmarks/linkprobe_scale.py [--ranks 8] [--repeats 3]

Each repeat is a real job (``tests/test_linkprobe.py``'s ranks: DDP over gloo, the probe
at step 2) with ``rtop probe``'s defaults: 16 MiB a transfer, 2 warm-ups and 3 timed
each way. The probe's time is the slowest rank's, from the start of the probe to its
end; the rounds are what :func:`collectors.linkprobe.plan` makes of the ranks. On a
shared 2-core machine every rank competes for the same cores, so the figure is an upper
bound for one host; the 64- and 1,024-rank figures are computed, not measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectors.linkprobe import plan
from rtop.analysis.links import assemble
from tests.test_linkprobe import run_job

#: ``rtop probe``'s defaults: 16 MiB a transfer, 3 timed each way.
SPEC = {"nbytes": 16 << 20, "reps": 3, "timeout_s": 30.0, "steps": 5, "probe_at": 2}


def one_probe(world: int) -> tuple[float, float]:
    """One job of ``world`` ranks: (seconds the probe took, median link in bytes/s)."""
    _, at_end, _ = run_job(world, {**SPEC, "nodes": ["host"] * world}, timeout=240.0)
    if sorted(at_end) != list(range(world)):
        raise SystemExit(f"only ranks {sorted(at_end)} of {world} finished")
    answers = {r: e["answers"][0] for r, e in at_end.items()}
    errors = {r: a["error"] for r, a in answers.items() if "error" in a}
    if errors:
        raise SystemExit(f"the probe failed: {errors}")
    matrix = assemble(list(range(world)), ["host"] * world, answers)["matrix_Bps"]
    links = [v for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j]
    if any(v is None for v in links):
        raise SystemExit("a link was not measured")
    return max(e["probe_s"] for e in at_end.values()), statistics.median(links)


def main() -> None:
    """Run the repeats and print the figures the README quotes."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rounds = len(plan(["host"] * args.ranks))
    took, links = [], []
    for i in range(args.repeats):
        s, bw = one_probe(args.ranks)
        took.append(s)
        links.append(bw)
        print(f"repeat {i + 1}: {s:.2f} s, median link {bw / 1e9:.2f} GB/s", flush=True)
    per_round = statistics.median(took) / rounds
    print(f"\nlink probe, {args.ranks} gloo ranks on loopback, 16 MiB x (2 warm-up + 3) "
          f"each way, median of {args.repeats}: {statistics.median(took):.2f} s for "
          f"{rounds} rounds ({min(took):.2f}-{max(took):.2f} s), "
          f"{per_round * 1e3:.0f} ms a round; median link "
          f"{statistics.median(links) / 1e9:.2f} GB/s")
    print(f"computed from the time per round: 64 ranks flat (63 rounds) ~{63 * per_round:.1f}"
          f" s; 1,024 ranks, 128 nodes x 8 (134 rounds) ~{134 * per_round:.1f} s")


if __name__ == "__main__":
    main()
