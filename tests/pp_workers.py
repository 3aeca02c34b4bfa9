"""A 2x2 job on gloo, spawned by ``tests/test_process_groups.py``: two pipeline stages of
two data-parallel ranks each (rank = stage * 2 + place).

Each step, stage 0 waits for its batch, computes, and broadcasts its activations to its
pipeline peer (the ``pipeline`` group of its place: ranks ``place`` and ``place + 2``);
stage 1 receives them and computes twice as long (its layers are the heavier ones); then
each stage all-reduces its gradients over its ``data_parallel`` group. From step
``slow_from`` on, rank ``slow_rank`` computes ``slow_factor`` times as long: a real
straggler within its stage. "Compute" is a sleep: on a 2-core machine four ranks'
matmuls would measure the scheduler, not the stages.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

#: Bytes of one step's activations (broadcast on the pipeline group) and gradients
#: (all-reduced on the data-parallel group), as float32 elements.
ACTIVATIONS = 1024
GRADIENTS = 4096
#: Seconds of compute per step: stage 0, stage 1.
COMPUTE_S = (0.06, 0.12)
#: Seconds stage 0 waits for each batch (stage 1 waits for none: it gets activations).
LOADER_S = 0.004


class Batches:
    """``n`` batches of 8 samples, each ready after ``wait_s``."""

    def __init__(self, n: int, wait_s: float) -> None:
        self.n, self.wait_s = n, wait_s

    def __iter__(self):
        for _ in range(self.n):
            if self.wait_s:
                time.sleep(self.wait_s)
            yield torch.zeros(8, 4)


def pipeline(rank: int, world: int, port: int, hub: str, token: str, steps: int,
             slow_rank: int, slow_from: int, slow_factor: float, pp_desc: str,
             out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dp = [dist.new_group([0, 1], group_desc="data_parallel"),
          dist.new_group([2, 3], group_desc="data_parallel")]
    pp = [dist.new_group([0, 2], group_desc=pp_desc),
          dist.new_group([1, 3], group_desc=pp_desc)]
    stage, place = divmod(rank, 2)
    import collectors

    probe = collectors.start(hub=hub, token=token)
    model = torch.nn.Linear(4, 4)
    probe.watch(model)  # every collective of the process is timed from here on
    flops = probe.count_flops(model, torch.zeros(8, 4))
    act = torch.zeros(ACTIVATIONS)
    grads = torch.zeros(GRADIENTS)
    compute = COMPUTE_S[stage]
    for i, _ in enumerate(probe.iter(Batches(steps, LOADER_S if stage == 0 else 0.0))):
        slow = slow_factor if rank == slow_rank and i >= slow_from else 1.0
        with probe.step(tokens=8 * 128):
            if stage == 0:
                time.sleep(compute * slow)
                dist.broadcast(act, src=place, group=pp[place])
            else:
                dist.broadcast(act, src=place, group=pp[place])
                time.sleep(compute * slow)
            dist.all_reduce(grads, group=dp[stage])
    names = {"dp": dp[stage].group_name, "pp": pp[place].group_name}
    probe.close()
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"groups": names, "flops": flops}, f)
