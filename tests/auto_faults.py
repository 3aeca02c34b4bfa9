"""A training job for ``tests/test_rtop_run.py`` that injects an exception at one of
``collectors.autoinstrument``'s guarded points (``--fault POINT``) while it runs under
``rtop run``: one rank of gloo DDP (world 1), a DataLoader, SGD. ``--bare`` runs the
same job without touching rtop (the reference). Writes the final parameters and what
the probe noted to ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

#: The call of a per-step body that raises (from 1).
FAULT_AT = 3


def inject(point: str) -> None:
    """Make ``point``'s body raise once, at its FAULT_AT-th call."""
    from collectors import autoinstrument
    from collectors.probe import Probe

    auto = autoinstrument.installed()
    assert auto is not None, "not running under rtop run"
    calls = {"n": 0}

    def boom() -> None:
        raise RuntimeError(f"injected into {point}")

    def nth(original: Any, only_from: str | None = None) -> Any:
        def body(*args: Any, **kwargs: Any) -> Any:
            if only_from is None or sys._getframe(1).f_code.co_name == only_from:
                calls["n"] += 1
                if calls["n"] == FAULT_AT:
                    boom()
            return original(*args, **kwargs)
        return body

    if point == "auto.start":
        auto._start = lambda: boom()  # type: ignore[method-assign, func-returns-value]
    elif point == "auto.fetch":
        auto._enter = nth(auto._enter)  # type: ignore[method-assign]
    elif point == "auto.optimizer":
        auto._boundary = nth(auto._boundary, "optimizer_stepped")  # type: ignore[method-assign]
    elif point == "auto.model":
        def watch(self: Probe, model: Any, optimizer: Any = None) -> Any:
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                boom()
            return model
        Probe.watch = watch  # type: ignore[method-assign]
    elif point != "none":
        raise SystemExit(f"unknown point {point}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", default="none")
    ap.add_argument("--bare", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.bare:
        inject(args.fault)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port)})
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(args.steps * 4, 8, generator=g),
                                          torch.randn(args.steps * 4, 2, generator=g))
    steps = 0
    for x, y in torch.utils.data.DataLoader(data, batch_size=4):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    out: dict[str, Any] = {"steps": steps, "params": params}
    if not args.bare:
        import collectors
        from collectors import autoinstrument

        probe = collectors.current()
        auto = autoinstrument.installed()
        out["notes"] = list(getattr(probe, "notes", []))
        out["recorded"] = getattr(probe, "step_count", None)
        out["off"] = auto.off if auto is not None else None
    del model, opt
    dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
