"""A Hugging Face Trainer job for ``tests/test_hf.py``: a tiny GPT-2 initialised at random
(no download) on synthetic tokens.

``--mode starve``: one rank of a torchrun job (``python -m torch.distributed.run
--nproc-per-node 2 tests/hf_worker.py --mode starve ...``) on gloo with ``RtopCallback``,
the hub from ``RTOP_HUB``/``RTOP_TOKEN``, and rank 1's dataset sleeping in
``__getitem__``.

``--mode faults``: one process; a run without rtop, then one run per guarded point of
``collectors.hf.POINTS`` with an exception injected in that point's body; writes what
each saw to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SEQ, VOCAB = 32, 128
#: The body each guarded point runs (what the fault-injection replaces).
BODIES = {
    "hf.train_begin": "_begin",
    "hf.batches": "_time",
    "hf.step_begin": "_step_begin",
    "hf.step_end": "_step_end",
    "hf.train_end": "_finish",
}
PER_STEP = ("_time", "_step_begin", "_step_end")
FAULT_AT = 3  # the call of a per-step body that raises (from 0)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token sequences; on ``slow_rank`` each batch takes ``slow_s`` more (the
    DataLoader fetches a batch with one ``__getitems__`` call)."""

    def __init__(self, n: int, slow_rank: int | None = None, slow_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.slow_rank, self.slow_s = slow_rank, slow_s
        self.rank = int(os.environ.get("RANK", "0"))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        if self.slow_s and self.rank == self.slow_rank:
            time.sleep(self.slow_s)
        return [self[i] for i in indices]


def model() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB,
                                     n_positions=SEQ)
    return transformers.GPT2LMHeadModel(config)


def arguments(out: str, steps: int, batch: int, accumulate: int, ddp: bool) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=out, use_cpu=True, ddp_backend="gloo" if ddp else None, report_to=[],
        max_steps=steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0)


def starve(args: argparse.Namespace) -> None:
    import transformers

    import collectors
    from collectors.hf import RtopCallback

    per_step = args.batch * args.accumulate
    data = Tokens(per_step * args.steps_per_epoch * 2, slow_rank=1,
                  slow_s=args.slow_s / args.accumulate)
    trainer = transformers.Trainer(model=model(),
                                   args=arguments(args.out, args.steps, args.batch,
                                                  args.accumulate, ddp=True),
                                   train_dataset=data, callbacks=[RtopCallback()])
    trainer.train()
    probe = collectors.current()
    rank = trainer.args.process_index
    out = {"rank": rank, "global_step": trainer.state.global_step,
           "epoch": trainer.state.epoch, "notes": list(getattr(probe, "notes", [])),
           "ddp": type(trainer.model_wrapped).__name__,
           "restored": "get_batch_samples" not in vars(trainer)}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _faulty(original: Any, body: str, fired: list[int]) -> Any:
    """``original`` (a body of the callback) raising once: at its first call, or at call
    ``FAULT_AT`` (from 0) for the per-step ones."""
    calls = [0]

    def faulty(self: Any, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        if not fired and (body not in PER_STEP or calls[0] > FAULT_AT):
            fired.append(1)
            raise RuntimeError("injected fault")
        return original(self, *a, **k)

    return faulty


def faults(args: argparse.Namespace) -> None:
    import transformers

    import collectors
    from collectors import hf

    warnings = _Warnings()
    logging.getLogger("collectors").addHandler(warnings)

    def train(callbacks: list[Any]) -> tuple[Any, Any]:
        m = model()
        data = Tokens(args.batch * args.accumulate * args.steps_per_epoch)
        t = transformers.Trainer(model=m, args=arguments(args.out, args.steps, args.batch,
                                                         args.accumulate, ddp=False),
                                 train_dataset=data, callbacks=callbacks)
        t.train()
        return t, m

    _, plain = train([])
    reference = [p.detach().clone() for p in plain.parameters()]
    results: dict[str, Any] = {}
    for point in [*hf.POINTS, "none"]:
        body = BODIES.get(point)
        original = getattr(hf._HFHooks, body) if body else None
        fired: list[int] = []
        if body:
            setattr(hf._HFHooks, body, _faulty(original, body, fired))
        warnings.messages.clear()
        callback = hf.RtopCallback()
        try:
            t, m = train([callback])
        finally:
            if body:
                setattr(hf._HFHooks, body, original)
        probe = collectors.current()
        results[point] = {
            "fired": len(fired), "global_step": t.state.global_step,
            "same": all(torch.equal(a, b) for a, b in
                        zip(m.parameters(), reference, strict=True)),
            "isinstance": isinstance(callback, transformers.TrainerCallback),
            "restored": "get_batch_samples" not in vars(t),
            "notes": list(getattr(probe, "notes", [])),
            "off": sorted(getattr(getattr(probe, "faults", None), "off", {})),
            "closed": bool(getattr(probe, "_closed", False)),
            "steps": getattr(probe, "step_count", None),
            "warnings": list(warnings.messages),
        }
    Path(args.out, "faults.json").write_text(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["starve", "faults"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--steps-per-epoch", type=int, default=25)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--slow-s", type=float, default=0.05)
    args = ap.parse_args()
    torch.set_num_threads(1)
    (starve if args.mode == "starve" else faults)(args)


if __name__ == "__main__":
    main()
