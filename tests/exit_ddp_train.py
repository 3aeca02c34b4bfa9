"""A plain DDP training loop, nothing of rtop in it, that ends the way many real scripts
do: ``os._exit(CODE)`` right after training, skipping Python's and NCCL's teardown (for
``tests/test_job_exit.py``). One rank of ``torchrun --nproc-per-node N`` on gloo (CPU).

``--exit-code N`` is the code every rank exits with; ``--raw-exit`` calls the
``os._exit`` taken before any probe started (``from os import _exit``: no goodbye can
precede it); ``--kill-rank R`` instead has rank R SIGKILL itself after training (the
others then wait for it in a barrier until torchrun tears them down).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from os import _exit as raw_exit  # taken before rtop run's probe starts

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--raw-exit", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(args.steps * 32 * world, 20),
                                          torch.randn(args.steps * 32 * world, 5))
    loader = torch.utils.data.DataLoader(
        data, batch_size=32, sampler=torch.utils.data.DistributedSampler(data, shuffle=False))
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    print(f"rank {rank} trained", flush=True)
    if rank == args.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    if args.kill_rank >= 0:
        dist.barrier()  # waits for the killed rank until torchrun ends it
    if args.raw_exit:
        raw_exit(args.exit_code)
    os._exit(args.exit_code)  # no teardown: no destroy_process_group, no atexit


if __name__ == "__main__":
    main()
