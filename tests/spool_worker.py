"""Ranks for the spool tests (``tests/test_spool.py``).

:func:`train` is a real 2-rank DDP job on gloo (spawned by torch.multiprocessing): it
trains ``n_before`` steps with its hub up, says so and waits for ``go`` (the test kills
the hub meanwhile), trains ``n_after`` more steps with no hub, closes its probe (the
unsent records go to the spool) and reports what the probe counted. Run as a script, it
is one plain process that takes ``N`` steps and exits without closing its probe (the
interpreter-exit path).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any


def train(rank: int, world: int, port: int, hub: str, token: str, n_before: int,
          n_after: int, go: Any, out: Any) -> None:
    """One rank of the job (see the module doc)."""
    import torch
    import torch.distributed as dist

    import collectors

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    probe = collectors.start(hub=hub, token=token, close_timeout_s=1.0)
    probe.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)

    def steps(n: int, model: Any, opt: Any) -> None:
        for _ in range(n):
            with probe.step():
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()

    steps(n_before, model, opt)
    out.put(("paused", rank))
    if not go.wait(300):
        raise RuntimeError("no go from the test")
    steps(n_after, model, opt)
    t0 = time.perf_counter()
    probe.close()
    close_s = time.perf_counter() - t0
    spool = probe.sender.connection.spool
    out.put(("done", rank, probe.stats(), dataclasses.asdict(spool) if spool else None,
             close_s))
    del model, opt
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """``python tests/spool_worker.py RANK WORLD STEPS``: a plain process, closed at exit."""
    import collectors

    rank, world, n = (int(a) for a in sys.argv[1:4])
    probe = collectors.start(rank=rank, world_size=world, close_timeout_s=0.5)
    for _ in range(n):
        with probe.step():
            time.sleep(0.0005)
    # no probe.close(): the interpreter's exit flushes (and spools) what is left


if __name__ == "__main__":
    main()
