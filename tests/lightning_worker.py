"""A Lightning job for ``tests/test_lightning.py``, run as a script: Lightning's ``ddp``
strategy on CPU re-runs this very script (same argv, ``LOCAL_RANK`` and friends in the
environment) for the other ranks, so the training code lives here, not in the test.

``--mode starve``: a ``devices``-rank DDP job (gloo) with ``RtopCallback``, the hub from
``RTOP_HUB``/``RTOP_TOKEN``, and rank 1's dataset sleeping in ``__getitem__``.

``--mode faults``: one process; a fit without rtop, then one fit per guarded point of
``collectors.lightning.POINTS`` with an exception injected in that point's body; writes
what each saw to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DIM, HIDDEN, LAYERS = 256, 512, 3
#: The body each guarded point runs (what the fault-injection replaces).
BODIES = {
    "lightning.setup": "_start",
    "lightning.fit_start": "_watch",
    "lightning.epoch_start": "_time_loader",
    "lightning.batch_start": "_batch_start",
    "lightning.batch_end": "_batch_end",
    "lightning.close": "_finish",
}
FAULT_AT = 3  # the call of a per-batch body that raises (from 0)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Synthetic regression data; on ``slow_rank`` each batch takes ``slow_s`` more (the
    DataLoader fetches a batch with one ``__getitems__`` call)."""

    def __init__(self, n: int, slow_rank: int | None = None, slow_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.randn(n, DIM, generator=g)
        self.slow_rank, self.slow_s = slow_rank, slow_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.slow_s and _rank() == self.slow_rank:
            time.sleep(self.slow_s)
        return [self[i] for i in indices]


def module_class(pl: Any) -> type:
    class Net(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = []
            d = DIM
            for _ in range(LAYERS):
                layers += [torch.nn.Linear(d, HIDDEN), torch.nn.ReLU()]
                d = HIDDEN
            layers.append(torch.nn.Linear(d, DIM))
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Net


def trainer(pl: Any, callbacks: list[Any], **kw: Any) -> Any:
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=callbacks, **kw)


def starve(pl: Any, args: argparse.Namespace) -> None:
    from collectors.lightning import RtopCallback

    torch.manual_seed(0)
    per_rank = args.batch * args.steps_per_epoch
    data = Data(per_rank * args.devices, slow_rank=1, slow_s=args.slow_s)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    t = trainer(pl, [RtopCallback()], devices=args.devices, strategy="ddp",
                max_steps=args.steps, accumulate_grad_batches=args.accumulate)
    t.fit(module_class(pl)(), loader)
    import collectors

    probe = collectors.current()
    out = {"rank": t.global_rank, "global_step": t.global_step,
           "epochs": t.current_epoch, "notes": list(getattr(probe, "notes", []))}
    Path(args.out, f"rank{t.global_rank}.json").write_text(json.dumps(out))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _faulty(original: Any, body: str, fired: list[int]) -> Any:
    """``original`` (a body of the callback) raising once: at its first call, or at call
    ``FAULT_AT`` (from 0) for the per-batch ones."""
    calls = [0]

    def faulty(self: Any, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        per_batch = body in ("_batch_start", "_batch_end")
        if not fired and (not per_batch or calls[0] > FAULT_AT):
            fired.append(1)
            raise RuntimeError("injected fault")
        return original(self, *a, **k)

    return faulty


def faults(pl: Any, args: argparse.Namespace) -> None:
    import collectors
    from collectors import lightning as rl

    warnings = _Warnings()
    logging.getLogger("collectors").addHandler(warnings)
    net_cls = module_class(pl)
    loader_args = {"batch_size": args.batch}

    def fit(callbacks: list[Any]) -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = net_cls()
        data = Data(args.batch * args.steps_per_epoch)
        t = trainer(pl, callbacks, devices=1, max_steps=args.steps)
        t.fit(model, torch.utils.data.DataLoader(data, **loader_args))
        return t, model

    _, plain = fit([])
    reference = [p.detach().clone() for p in plain.parameters()]
    results: dict[str, Any] = {}
    for point in [*rl.POINTS, "none"]:
        body = BODIES.get(point)
        original = getattr(rl._LightningHooks, body) if body else None
        fired: list[int] = []
        if body:
            setattr(rl._LightningHooks, body, _faulty(original, body, fired))
        warnings.messages.clear()
        callback = rl.RtopCallback()
        try:
            t, model = fit([callback])
        finally:
            if body:
                setattr(rl._LightningHooks, body, original)
        probe = collectors.current()
        results[point] = {
            "fired": len(fired), "global_step": t.global_step,
            "same": all(torch.equal(a, b) for a, b in
                        zip(model.parameters(), reference, strict=True)),
            "isinstance": isinstance(callback, pl.Callback),
            "notes": list(getattr(probe, "notes", [])),
            "off": sorted(getattr(getattr(probe, "faults", None), "off", {})),
            "closed": bool(getattr(probe, "_closed", False)),
            "steps": getattr(probe, "step_count", None),
            "warnings": list(warnings.messages),
        }
    results["job_raises"] = _job_raises(pl, net_cls, args)
    Path(args.out, "faults.json").write_text(json.dumps(results))


def _job_raises(pl: Any, net_cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The job's own error at step ``FAULT_AT``: it reaches the caller unchanged, and the
    callback closes the probe with it."""
    import collectors
    from collectors.lightning import RtopCallback

    class Failing(net_cls):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == FAULT_AT:
                raise ValueError("the job's own error")
            return super().training_step(batch, batch_idx)

    t = trainer(pl, [RtopCallback()], devices=1, max_steps=args.steps)
    caught = ""
    try:
        t.fit(Failing(), torch.utils.data.DataLoader(Data(args.batch * args.steps_per_epoch),
                                                     batch_size=args.batch))
    except ValueError as exc:
        caught = str(exc)
    probe = collectors.current()
    return {"caught": caught, "closed": bool(getattr(probe, "_closed", False)),
            "exit_error": getattr(probe, "exit_error", None),
            "steps": getattr(probe, "step_count", None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["starve", "faults"], required=True)
    ap.add_argument("--package", default="lightning.pytorch")
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--steps-per-epoch", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--slow-s", type=float, default=0.05)
    ap.add_argument("--accumulate", type=int, default=1)
    args = ap.parse_args()
    pl = importlib.import_module(args.package)
    torch.set_num_threads(1)
    (starve if args.mode == "starve" else faults)(pl, args)


if __name__ == "__main__":
    main()
