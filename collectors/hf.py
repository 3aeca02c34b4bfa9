"""Hugging Face: ``Trainer(..., callbacks=[RtopCallback()])`` instruments a
``transformers.Trainer`` job with no change to its training code.

Usage::

    from transformers import Trainer
    from collectors.hf import RtopCallback

    Trainer(model=model, args=args, train_dataset=ds, callbacks=[RtopCallback()]).train()

The hub comes from ``RTOP_HUB``/``RTOP_TOKEN`` (or ``RtopCallback(hub=..., token=...)``;
other keyword arguments are :class:`collectors.ProbeConfig` fields). Every hook runs in
each rank's own process, on its training thread.

What it measures, the same figures as the contract API (``collectors.start``,
``probe.iter``, ``probe.step``, ``probe.watch``):

* **Identity** (``on_train_begin``): the probe starts with ``args.process_index``,
  ``args.world_size`` and ``args.local_process_index``, as accelerate set them up.
* **Allreduce** (``on_train_begin``): a callback is handed the unwrapped model, so the
  callback finds the trainer that called it (the caller whose ``callback_handler`` holds
  this callback, a few frames up) and watches ``trainer.model_wrapped``, the
  ``DistributedDataParallel`` module. Without it, only the memory breakdown is counted
  and the allreduce is not measured (``None``), with a note.
* **Data wait**: the Trainer fetches all the micro-batches of an optimizer step in
  ``Trainer.get_batch_samples`` before ``on_step_begin``; that call also counts the
  step's tokens, which under DDP is a collective (``average_tokens_across_devices``). So
  the callback wraps this trainer's ``get_batch_samples`` (on the instance, undone at
  ``on_train_end``) to hand it the epoch's iterator through ``probe.iter``: exactly the
  time blocked in each ``next()`` is measured, not the token count's collective. Its
  peers' wait for a starved rank therefore shows partly there, between steps, rather
  than inside the step's allreduce.
* **Step** (``on_step_begin`` to ``on_step_end``): one optimizer step, that is every
  micro-batch of a gradient-accumulation cycle (forward and backward, the ``no_sync``
  ones and the last one that all-reduces), gradient clipping and the optimizer step;
  its tokens are the elements of the ``input_ids`` of the micro-batches
  ``get_batch_samples`` returned for it (padding included, as the Trainer's
  ``num_input_tokens_seen`` counts them).
  Logging, evaluation and checkpoints after ``on_step_end`` fall between steps.
* **Close** (``on_train_end``): the probe is closed if this callback started it. A run
  that raises ends without ``on_train_end``: the probe then closes at exit and the
  hub hears the error from the uncaught exception (``collectors.start``'s hook).

rtop never raises into the Trainer: each hook's own work is guarded (:data:`POINTS`).
An error turns the callback off for the rest of the run (it still closes the probe),
warns once and leaves a note that the rank sends to the hub.

This module imports ``transformers`` when imported; ``import collectors`` never does.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

from collectors import guard
from collectors.callbacks import CallbackHooks, Resume, callback_class, tokens_in
from collectors.probe import Probe

__all__ = ["POINTS", "RtopCallback"]

#: What a failure in this callback turns off.
FEATURE: Final = "the Hugging Face callback"

#: Where this callback runs rtop's code on the training thread (``collectors.guard``'s
#: shape): point -> (where it runs, the feature a failure there turns off).
POINTS: Final[dict[str, tuple[str, str]]] = {
    "hf.train_begin": ("RtopCallback.on_train_begin: starting the probe, watching the model, "
                       "timing the loader", FEATURE),
    "hf.batches": ("Trainer.get_batch_samples as RtopCallback wraps it: timing the loader",
                   FEATURE),
    "hf.step_begin": ("RtopCallback.on_step_begin: the step's entry", FEATURE),
    "hf.step_end": ("RtopCallback.on_step_end: the step's exit", FEATURE),
    "hf.train_end": ("RtopCallback.on_train_end: closing the probe", FEATURE),
}

guard.register(POINTS)

#: How many frames above a hook the trainer that called it is looked for.
MAX_FRAMES: Final = 16


class _HFHooks(CallbackHooks):
    """The hooks of :class:`RtopCallback`, apart from transformers' ``TrainerCallback``
    (the probe, the step and the guard are :class:`collectors.callbacks.CallbackHooks`'s)."""

    feature = FEATURE

    def _reset(self) -> None:
        super()._reset()
        self._trainer: Any = None  # the trainer whose get_batch_samples is wrapped
        self._wrapper: Any = None  # ... and the wrapper put there
        self._source: Any = None  # the epoch iterator last handed to get_batch_samples
        self._timed: Any = None  # ... and its timed iterator
        self._tokens: int | None = None  # the tokens of the step's batches, once counted

    # ---- transformers' hooks ------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start the probe, watch the (DDP-wrapped) model, time the loader."""
        self._off = False  # a new train() is a new run
        self._run("hf.train_begin", self._begin, args, kwargs)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An optimizer step starts (its first micro-batch)."""
        self._run("hf.step_begin", self._step_begin)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The optimizer step is done."""
        self._run("hf.step_end", self._step_end)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the probe (if this callback started it)."""
        probe = self._probe
        if probe is None:
            return
        try:
            self._finish(probe)
        except Exception as exc:  # guarded point "hf.train_end": never raise into the job
            self._failed("hf.train_end", exc)
            try:
                self._unwrap()
                if self._owned:
                    probe.close()
            except Exception:
                pass
        self._probe = None

    # ---- the work, each body guarded by _run ----------------------------------------

    def _begin(self, args: Any, kwargs: dict[str, Any]) -> None:
        probe = self._start_probe(int(args.process_index), int(args.world_size),
                                  int(args.local_process_index))
        if probe is None:  # RTOP_DISABLE=1: nothing to do
            return
        trainer = self._find_trainer()
        model = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        if model is None:
            model = kwargs.get("model")
            self._note("trainer", "Hugging Face: the trainer was not found from the callback: "
                                  "allreduce and data wait not measured")
        optimizer = kwargs.get("optimizer")
        probe.watch(model, getattr(optimizer, "optimizer", optimizer))
        if trainer is not None:
            self._wrap(trainer)
        self._note("how", "Hugging Face: steps timed from on_step_begin to on_step_end (one "
                          "optimizer step); data wait timed around each next() of "
                          "Trainer.get_batch_samples (RtopCallback)")

    def _find_trainer(self) -> Any:
        """The trainer that called this hook: the caller whose ``callback_handler``
        holds this callback (transformers hands a callback no trainer)."""
        frame: FrameType | None = sys._getframe(1)
        for _ in range(MAX_FRAMES):
            if frame is None:
                break
            obj = frame.f_locals.get("self")
            handler = getattr(obj, "callback_handler", None)
            if handler is not None and any(c is self for c in getattr(handler, "callbacks", ())):
                return obj
            frame = frame.f_back
        return None

    def _wrap(self, trainer: Any) -> None:
        original = getattr(trainer, "get_batch_samples", None)
        if original is None:
            self._note("batches", "Hugging Face: data wait not measured: this Trainer has no "
                                  "get_batch_samples")
            return

        def get_batch_samples(epoch_iterator: Any, *args: Any, **kwargs: Any) -> Any:
            got = original(self._timed_iterator(epoch_iterator), *args, **kwargs)
            self._count_tokens(got)
            return got

        trainer.get_batch_samples = get_batch_samples
        self._trainer, self._wrapper = trainer, get_batch_samples

    def _timed_iterator(self, it: Any) -> Any:
        """``it`` timed by the probe (the same timed iterator for every call with the
        same epoch iterator); ``it`` itself once the callback is off. Guarded point
        ``hf.batches``."""
        if self._off or self._probe is None:
            return it
        try:
            return self._time(self._probe, it)
        except Exception as exc:  # never raise into the job; the loader goes on untimed
            self._failed("hf.batches", exc)
            return it

    def _time(self, probe: Probe, it: Any) -> Any:
        if it is not self._source:
            self._source, self._timed = it, iter(probe.iter(Resume(it)))
        return self._timed

    def _count_tokens(self, got: Any) -> None:
        """The tokens of the micro-batches ``get_batch_samples`` returned (each one's
        ``input_ids`` elements), for the step about to begin; guarded point
        ``hf.batches``."""
        if self._off:
            return
        try:
            batches = got[0] if isinstance(got, tuple) and got else got
            counts = [tokens_in(b) for b in batches] if isinstance(batches, list) else []
            self._tokens = sum(c for c in counts if c is not None) \
                if counts and all(c is not None for c in counts) else None
        except Exception as exc:  # never raise into the job
            self._failed("hf.batches", exc)

    def _step_begin(self) -> None:
        tokens, self._tokens = self._tokens, None
        self._begin_step(tokens)  # a step still open never reached on_step_end

    def _step_end(self) -> None:
        self._end_step()

    def _finish(self, probe: Probe) -> None:
        self._end_step()
        self._unwrap()
        if self._owned:
            probe.close()

    def _unwrap(self) -> None:
        trainer, wrapper = self._trainer, self._wrapper
        self._trainer = self._wrapper = self._source = self._timed = None
        if trainer is not None and vars(trainer).get("get_batch_samples") is wrapper:
            del trainer.get_batch_samples  # the class's method again


def _callback_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as exc:
        raise ImportError("collectors.hf needs Hugging Face transformers: it cannot be "
                          f"imported ({exc}); pip install transformers") from exc
    base: type = TrainerCallback
    return base


if TYPE_CHECKING:
    from transformers import TrainerCallback as _TrainerCallback

    class RtopCallback(_HFHooks, _TrainerCallback):  # type: ignore[misc, unused-ignore]
        """rtop's Hugging Face callback (a ``transformers.TrainerCallback``)."""
else:
    RtopCallback = callback_class(
        _HFHooks, (_callback_base(),), __name__,
        "rtop's Hugging Face callback: ``Trainer(..., callbacks=[RtopCallback()])`` (see "
        "``collectors.hf``).")
