"""Ranks of a real gloo DDP job for the lost-culprit tests (tests/test_lost_culprit.py).

:func:`train` is the spawned function (``torch.multiprocessing``) and, through
``main()``, the script torchrun runs. Each rank reports to the hub with the real
collectors, appends every step it finishes to ``<out>/steps-rank<R>`` (one ``os.write``
a step, so a rank killed at any moment leaves whole lines) and writes its pid first.
A rank named in ``kill_at`` SIGKILLs itself in a checkpoint every rank takes before
that step, after writing the time to ``<out>/killed-rank<R>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

STEP_S = 0.05  # each step's "compute": a sleep, so the ranks wait in Python, not in C
#: The "checkpoint" every rank takes at the step where a rank dies (0.1 s into it): the
#: others are still in it when the launcher's SIGTERM comes, not in a collective that
#: fails first because a peer is gone (both happen; the tests want the launcher's path).
PAUSE_S = 1.0


def _note(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def train(rank: int, world: int, port: int, hub: str, token: str, out: str,
          opts: dict[str, Any]) -> None:
    """One rank: DDP over gloo, a sleep per step, until ``opts["steps"]`` or death."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outdir = Path(out)
    _note(outdir / f"pid-rank{rank}", str(os.getpid()))
    nodes = opts.get("nodes")
    if nodes:
        os.environ["RTOP_NODE"] = nodes[rank]
    if opts.get("own_handler"):
        def handler(signum: int, frame: Any) -> None:
            _note(outdir / f"handler-rank{rank}", "ran")
            sys.exit(0)

        signal.signal(signal.SIGTERM, handler)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    import collectors
    from collectors import lastgasp

    probe = collectors.start(hub=hub, token=token, rank=rank, world_size=world,
                             local_rank=rank, flush_interval_s=0.2)
    _note(outdir / f"lastgasp-rank{rank}", json.dumps(lastgasp.installed()))
    torch.manual_seed(0)
    model = probe.watch(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(16, 32), torch.randn(16, 8)) for _ in range(4)]
    kill_at = {int(k): v for k, v in opts.get("kill_at", {}).items()}
    steps_file = outdir / f"steps-rank{rank}"

    def loader() -> Any:
        for i in range(int(opts.get("steps", 10_000))):
            yield batches[i % len(batches)]

    for i, (x, y) in enumerate(probe.iter(loader())):
        if i in kill_at.values():  # every rank saves a checkpoint; the victim dies in it
            with probe.checkpoint():
                if kill_at.get(rank) == i:
                    time.sleep(0.1)
                    _note(outdir / f"killed-rank{rank}", repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(PAUSE_S)
        with probe.step():
            time.sleep(STEP_S)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        _note(steps_file, f"{i}\n")
    probe.close()
    dist.destroy_process_group()


def main() -> None:
    """torchrun's entry: ``lost_workers.py HUB TOKEN OUT OPTS_JSON``."""
    hub, token, out, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, hub, token, out, opts)


if __name__ == "__main__":
    main()
