"""The per-worker function of the Ray Train restart test (tests/test_ray_restarts.py).

The contract's four lines and nothing more for rtop: the checkpoint goes through
``ray.train.report(..., checkpoint=...)`` with no ``probe.checkpoint()`` around it (and
``report`` is imported before the probe starts). Rank 1 raises once, in the first
attempt (a marker file says it did); Ray Train then restarts the worker group.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

#: Steps each rank runs (the dataset holds this many batches per rank).
STEPS = 20
#: A checkpoint is reported every this many steps.
CHECKPOINT_EVERY = 4
#: The step after which rank 1 fails, in the first attempt only.
FAIL_AFTER = 6
#: How long rank 1 waits before it fails: rank 0 waits for it in its next allreduce
#: meanwhile, and its sender (a flush every 0.5 s) sends the steps it made before Ray
#: kills it with the group. (Without the wait, 6 fast steps and the kill could all fall
#: within one flush interval: rank 0's steps were then lost with its process.)
FAIL_DELAY_S = 1.0
BATCH = 8
DIM = 8
#: Each batch of the "train" dataset takes this long to make (a slow data pipeline).
SLOW_S = 0.03


def slow_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The dataset's map step: a slow data pipeline (here, in this light module, so the
    Ray Data tasks that run it need not import the test module)."""
    time.sleep(SLOW_S)
    return batch


def train_loop(config: dict[str, Any]) -> None:
    """One rank: train on the "train" shard, checkpoint through ray.train.report."""
    import ray.train
    import ray.train.torch
    import torch
    from ray.train import Checkpoint, report  # before collectors.start(): still caught

    import collectors

    torch.set_num_threads(1)
    probe = collectors.start()
    rank = ray.train.get_context().get_world_rank()
    marker = Path(config["marker"])
    out = Path(config["out"])
    model = probe.watch(ray.train.torch.prepare_model(torch.nn.Linear(DIM, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    shard = ray.train.get_dataset_shard("train")
    step = 0
    for batch in probe.iter(shard.iter_torch_batches(batch_size=BATCH)):
        with probe.step():
            loss = (model(batch["x"]).squeeze(-1) - batch["y"]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        step += 1
        if rank == 1 and step == FAIL_AFTER and not marker.exists():
            marker.write_text("rank 1 failed once\n")
            time.sleep(FAIL_DELAY_S)
            raise RuntimeError("rank 1 fails in the first attempt")
        if step % CHECKPOINT_EVERY == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                report({"step": step, "loss": float(loss)},
                       checkpoint=Checkpoint.from_directory(d))
        if step >= STEPS:
            break
    from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils

    utils = get_train_fn_utils()
    result = {"rank": rank, "steps": step, "notes": list(probe.notes),
              "figures": dict(probe.figures),
              "checkpoints_timed": probe.raytrain.checkpoints if probe.raytrain else None,
              "wrapped_while_open": "report" in vars(utils),
              "group": probe.identity.group}
    probe.close()
    result["wrapped_after_close"] = "report" in vars(utils)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
