"""How often a link probe names a healthy link, before and after it re-measures the
links it first found slow; and that a truly slow node is still named.

    sudo python benchmarks/probe_recheck.py [--probes 12] [--throttled 3]

A real 4-rank gloo job on four network namespaces joined by a bridge
(``tests/test_linkprobe_netns.py``'s network), a real hub, and ``rtop probe --json``
(1 MiB a transfer) run over and over: on the healthy network, idle and with two
busy-looping processes competing for the cores, then with one node's link throttled to
80 Mbit/s by ``tbf``. For each probe: did the first measurement find a slow link (the
links the hub re-measured), and did the probe name one after re-measuring. On the
healthy network every named link is a false alarm. Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_linkprobe_netns import Job, network, throttle


def run(job: Job, probes: int) -> list[dict[str, Any]]:
    """``probes`` probes: per probe, links first found slow, whether one was named, and
    the re-measurement's seconds."""
    out = []
    for _ in range(probes):
        result = job.probe()
        recheck = result.get("recheck") or {}
        out.append({"first": len(recheck.get("links") or []),
                    "named": [f["ranks"] for f in result["findings"]],
                    "recheck_s": recheck.get("seconds"), "seconds": result.get("seconds")})
    return out


def summary(what: str, rows: list[dict[str, Any]]) -> str:
    first = sum(1 for r in rows if r["first"])
    named = sum(1 for r in rows if r["named"])
    costs = [r["recheck_s"] for r in rows if r["recheck_s"] is not None]
    cost = f", re-measuring took {statistics.median(costs):.2f} s (median)" if costs else ""
    return (f"{what}: {len(rows)} probes; the first measurement found a slow link in "
            f"{first}, the probe named one in {named}{cost}")


def main() -> None:
    """Run the probes and print what each phase named."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=12, help="per healthy phase")
    ap.add_argument("--throttled", type=int, default=3)
    ap.add_argument("--show", action="store_true",
                    help="end with one probe of the throttled node as text")
    args = ap.parse_args()
    with network(), tempfile.TemporaryDirectory() as tmp:
        job = Job(Path(tmp))
        try:
            if not job.training(beyond=5, timeout=120):
                raise SystemExit(f"the job never trained: {job.errors()}")
            idle = run(job, args.probes)
            print(summary("healthy, idle", idle), flush=True)
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(2)]
            try:
                loaded = run(job, args.probes)
            finally:
                for h in hogs:
                    h.kill()
            print(summary("healthy, 2 busy loops on the 2 cores", loaded), flush=True)
            throttle(2, True)
            try:
                slow = run(job, args.throttled)
            finally:
                throttle(2, False)
            print(summary("node-c throttled to 80 Mbit/s", slow), flush=True)
            right = sum(1 for r in slow if r["named"] == [[2]])
            print(f"node-c (rank 2) named alone in {right} of {len(slow)}")
            if args.show:  # what a user sees, node-c still throttled
                throttle(2, True)
                try:
                    done = job.rtop_probe()
                finally:
                    throttle(2, False)
                print(f"\n$ rtop probe --bytes 1048576\n{done.stderr}{done.stdout}")
        finally:
            failed = job.close()
        if failed:
            raise SystemExit("\n".join(failed))


if __name__ == "__main__":
    main()
