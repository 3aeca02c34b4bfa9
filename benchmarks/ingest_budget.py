"""What one authenticated peer's hellos cost the hub in memory (issue 12, finding 6).

Each case runs in a fresh Python process: a hub's run state and diagnosis
(``rtop.hub.service.hub_monitor`` with the hub's default config, as ``rtop serve``
makes them) take the frames a peer sends on one connection, the way the hub applies
them, and the process's resident memory is read before and after:

* one hello claiming a world of 4,096 ranks;
* one hello claiming 2**20 ranks (the most a hello may claim);
* 1,000 hellos for 1,000 different ranks on one connection (world 1,000). The hub
  passes the rank a connection already speaks for (``peer``): the first hello is
  taken and the other 999 are refused. ``--no-peer`` leaves ``peer`` out, as a hub
  that does not pass it would: then every hello is a new rank, held within the
  budget (``max_ranks``), and costs what a rank of a real job costs.

Prints one line per case: RSS growth in MB, hellos taken and refused, rank slots
allocated and the bytes of the windows. ``--src DIR`` runs the cases against another
checkout (for before/after figures: a copy of the tree from before the fix)::

    python benchmarks/ingest_budget.py
    python benchmarks/ingest_budget.py --src /tmp/before

Each case's process is capped at ``--cap-gb`` of address space (default 8): a case that
would take more reports numpy's MemoryError, which says how much it asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "hello claiming world 4096": {"world": 4096, "hellos": 1},
    "hello claiming world 2**20": {"world": 1 << 20, "hellos": 1},
    "1000 hellos on one connection": {"world": 1000, "hellos": 1000},
}

CHILD = r"""
import gc, inspect, json, resource, sys, time
import psutil
# a cap on the address space: a case that would take more fails with MemoryError (and
# says how much it wanted) instead of taking the machine down
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[4]), resource.RLIM_INFINITY))
from collectors import wire
from rtop.hub.server import HubConfig
from rtop.hub.service import hub_monitor
from rtop.run.validate import ProtocolError

world, hellos, use_peer = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
monitor = hub_monitor(HubConfig())
takes_peer = "peer" in inspect.signature(monitor.apply).parameters
proc = psutil.Process()
gc.collect()
before = proc.memory_info().rss
peer, taken, refused = None, 0, 0
t = time.time()
for r in range(hellos):
    ident = {"rank": r, "local_rank": r % 8, "world_size": world, "hostname": "node-a",
             "ip": "127.0.0.1", "pid": 1000 + r, "attempt": 0, "job": "job",
             "group": "g0", "node_id": "", "source": "env"}
    frame = wire.Frame(wire.KIND_HELLO, {"role": "rank", "identity": ident})
    try:
        if takes_peer and use_peer:
            rs = monitor.apply(frame, t, peer=peer)
        else:
            rs = monitor.apply(frame, t)
    except ProtocolError:
        refused += 1
        continue
    except MemoryError as exc:
        print(json.dumps({"error": f"MemoryError: {exc}"}))
        sys.exit(0)
    taken += 1
    peer = peer or rs  # the hub keeps the rank a connection introduced first
monitor.advance(t + 1.0, force=True)  # one diagnosis cycle over what was taken
gc.collect()
after = proc.memory_info().rss
st = monitor.state
print(json.dumps({"rss_mb": (after - before) / 1e6, "taken": taken, "refused": refused,
                  "slots": st.steps.slots, "windows_mb": st.nbytes() / 1e6,
                  "peer": takes_peer and use_peer}))
"""


def run_case(src: Path, world: int, hellos: int, peer: bool, cap_gb: float
             ) -> dict[str, object]:
    """One case in a fresh process, its figures as a dict."""
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-c", CHILD, str(world), str(hellos),
                          "1" if peer else "0", str(int(cap_gb * 2**30))], env=env,
                         cwd=src, capture_output=True,
                         text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise SystemExit(f"case failed:\n{out.stderr}")
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    """Run every case and print its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=ROOT, help="checkout to measure")
    ap.add_argument("--no-peer", action="store_true",
                    help="apply hellos without the connection's rank (peer)")
    ap.add_argument("--cap-gb", type=float, default=8.0,
                    help="address-space cap of each case's process (GiB)")
    args = ap.parse_args()
    print(f"ingest budget: {args.src}")
    for name, case in CASES.items():
        r = run_case(args.src, case["world"], case["hellos"], not args.no_peer,
                     args.cap_gb)
        if "error" in r:
            print(f"  {name:<32} {r['error']}")
            continue
        print(f"  {name:<32} RSS +{r['rss_mb']:7.1f} MB   taken {r['taken']:>4}  "
              f"refused {r['refused']:>4}  slots {r['slots']:>7}  windows "
              f"{r['windows_mb']:8.1f} MB" + ("" if r["peer"] else "  (no peer)"))


if __name__ == "__main__":
    main()
