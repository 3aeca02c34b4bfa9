"""Counting a model's FLOPs once, with torch's own FLOP counter, for model TFLOPS and MFU.

:func:`count_step` runs one forward pass of the model under
``torch.utils.flop_counter.FlopCounterMode`` and ``torch.no_grad()`` and takes a training
step's model FLOPs as three times the forward's: the backward pass computes the gradients
of the activations and of the weights, each as costly as the forward (the convention of
the MFU literature, PaLM's appendix B; recomputation is not counted: that is hardware
FLOPs, not model FLOPs). Counting the backward itself would need a real backward, and on
a DDP or FSDP model a backward launches collectives that the other ranks would have to
join.

The pass runs in eval mode (each module's mode is put back after: a batch norm's running
statistics are not touched) on the model's own module (a ``DistributedDataParallel``'s
``.module``: its forward launches no collective; an FSDP model's forward all-gathers its
parameters, so every rank must call this together there, as with any of its forwards).
What it costs: one forward pass of the batch given, slowed by the counter's dispatch
(every operator goes through a Python ``TorchDispatchMode``), once;
``tests/test_throughput.py`` measures it beside a plain forward. Nothing of it runs on
the training thread's per-step path.

``dtype``, the precision the GPU's peak is read for: as given, else the autocast's when
autocast is on at the call (the loop's own ``torch.autocast``), else the parameters' when
they are 16-bit, else None (the hub then assumes bf16 and says so).

Only ``torch`` is imported, lazily, when a count is asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

#: torch dtypes by the names MFU is measured against (``collectors.config.DTYPES``).
NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
         "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}
#: A training step's model FLOPs per forward FLOP (forward + backward = 1 + 2).
STEP_PER_FORWARD = 3.0


@dataclass(frozen=True)
class Counted:
    """One count: the model FLOPs of a step, its forward's, the precision, and what
    counting cost (seconds, once)."""

    per_step: float
    forward: float
    dtype: str | None
    seconds: float

    def to_meta(self) -> dict[str, Any]:
        """As the rank's meta carries it to the hub (``"flops"``)."""
        return {"per_step": self.per_step, "forward": self.forward, "dtype": self.dtype,
                "source": "counted", "count_s": round(self.seconds, 4)}


def unwrapped(model: Any) -> Any:
    """The module whose forward launches no collective: a DDP wrapper's ``.module``."""
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel
    return model.module if isinstance(model, ddp) else model


def precision(model: Any, given: str | None) -> str | None:
    """The precision of the model's math (see the module doc)."""
    import torch

    if given is not None:
        return given
    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device):
                return NAMES.get(str(torch.get_autocast_dtype(device)).removeprefix("torch."))
        except Exception:  # an older torch: no per-device autocast query
            continue
    try:
        p = next(iter(model.parameters()))
    except Exception:
        return None
    name = NAMES.get(str(p.dtype).removeprefix("torch."))
    return name if name in ("bf16", "fp16", "fp8") else None


def count_step(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any],
               dtype: str | None = None) -> Counted:
    """Count a training step's model FLOPs from one forward pass (module doc); raises
    when the model cannot run on ``inputs`` or torch has no FLOP counter."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    module = unwrapped(model)
    t0 = time.perf_counter()
    counter = FlopCounterMode(display=False)
    # in eval mode, so the pass changes nothing of the model (a batch norm's running
    # statistics); each module's own mode is put back after
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
        with torch.no_grad(), counter:
            module(*inputs, **kwargs)
    finally:
        for m, training in modes:
            m.training = training
    forward = float(counter.get_total_flops())
    if forward <= 0:
        raise ValueError("the FLOP counter counted no FLOPs in the model's forward pass")
    return Counted(STEP_PER_FORWARD * forward, forward, precision(module, dtype),
                   time.perf_counter() - t0)
