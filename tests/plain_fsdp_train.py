"""A plain FSDP2 training loop with nothing of rtop in it, for ``tests/test_rtop_run.py``:
one rank of ``torchrun --nproc-per-node N`` on gloo (CPU), ``fully_shard`` on each
linear layer and on the root, SGD, a DataLoader over a DistributedSampler. Prints the
model's parameter bytes (rank 0)."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    world = dist.get_world_size()
    data = torch.utils.data.TensorDataset(torch.randn(args.steps * 32 * world, 32),
                                          torch.randn(args.steps * 32 * world, 4))
    loader = torch.utils.data.DataLoader(
        data, batch_size=32, sampler=torch.utils.data.DistributedSampler(data))
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"param_bytes {nbytes}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
