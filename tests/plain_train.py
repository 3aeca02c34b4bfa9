"""A plain training loop with nothing of rtop in it, for ``tests/test_rtop_run.py``: a
DataLoader whose dataset takes ``--slow-s`` per batch, a small MLP, SGD.

``--forever`` trains until interrupted, saying ``training`` on stdout once its first
steps are done; ``--exit-code N`` exits with N after training. ``--epochs``,
``--accumulate K`` (an optimizer step every K batches), ``--validate`` (a pass over a
validation loader under ``torch.no_grad()`` after each epoch) and ``--workers N``
(``--persistent``: persistent workers) make it look like more real loops.
``--own-steps-from K`` times its own steps from batch K on, as a framework callback that
starts late does: ``collectors.start()`` (under ``rtop run``, the probe already running;
``--own-steps-via current``: ``collectors.current()``, which tells no one) and
``with probe.step():`` around each later step.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch


class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random samples; fetching a batch (one ``__getitems__`` call) takes ``slow_s``."""

    def __init__(self, n: int, slow_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)
        self.slow_s = slow_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.slow_s)
        return self.x[indices], self.y[indices]  # the batch itself (see as_is)


def as_is(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The DataLoader's collate_fn: ``__getitems__`` already made the batch."""
    return batch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--slow-s", type=float, default=0.02)
    ap.add_argument("--forever", action="store_true")
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--persistent", action="store_true")
    ap.add_argument("--own-steps-from", type=int, default=-1)
    ap.add_argument("--own-steps-via", choices=["start", "current"], default="start")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(
        Slow(args.steps * args.batch, args.slow_s), batch_size=args.batch, collate_fn=as_is,
        num_workers=args.workers, persistent_workers=args.persistent)
    validation = torch.utils.data.DataLoader(Slow(4 * args.batch, args.slow_s),
                                             batch_size=args.batch, collate_fn=as_is)
    step = epoch = 0
    while args.forever or epoch < args.epochs:
        for x, y in loader:
            timer = contextlib.nullcontext()
            if 0 <= args.own_steps_from <= step:
                import collectors  # only with --own-steps-from: otherwise nothing of rtop

                probe = collectors.start() if args.own_steps_via == "start" \
                    else collectors.current()
                timer = probe.step()
            with timer:
                loss = torch.nn.functional.mse_loss(model(x), y) / args.accumulate
                loss.backward()
                step += 1
                if step % args.accumulate == 0:
                    opt.step()
                    opt.zero_grad()
            if args.forever and step == 5:
                print("training", flush=True)
        if args.validate:
            with torch.no_grad():
                for x, y in validation:
                    torch.nn.functional.mse_loss(model(x), y)
        epoch += 1
    print(f"done {step} steps", flush=True)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
