"""A plain DDP training loop with nothing of rtop in it, for ``tests/test_rtop_run.py``:
one rank of ``torchrun --nproc-per-node N`` on gloo (CPU), a small MLP, SGD, a
DataLoader over a DistributedSampler; on rank ``--slow-rank`` each batch takes
``--slow-s`` to fetch (a starved rank)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random samples; on the slow rank fetching a batch takes ``slow_s``."""

    def __init__(self, n: int, slow_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 40, generator=g)
        self.y = torch.randn(n, 7, generator=g)
        self.slow_s = slow_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slow_s:
            time.sleep(self.slow_s)
        return self.x[indices], self.y[indices]  # the batch itself (see as_is)


def as_is(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The DataLoader's collate_fn: ``__getitems__`` already made the batch."""
    return batch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--slow-s", type=float, default=0.05)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 300), torch.nn.Tanh(),
        torch.nn.Linear(300, 7)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Samples(args.steps * args.batch * world,
                   args.slow_s if rank == args.slow_rank else 0.0)
    loader = torch.utils.data.DataLoader(
        data, batch_size=args.batch, collate_fn=as_is,
        sampler=torch.utils.data.DistributedSampler(data, shuffle=False))
    steps = 0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    print(f"rank {rank} done {steps} steps (LOCAL_RANK {os.environ.get('LOCAL_RANK')})",
          flush=True)
    del model, opt  # DDP before its process group (the reverse can abort at exit)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
