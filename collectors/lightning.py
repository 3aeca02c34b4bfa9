"""Lightning: ``Trainer(callbacks=[RtopCallback()])`` instruments a Lightning job with no
change to its training code.

Usage::

    from lightning.pytorch import Trainer          # or: from pytorch_lightning import Trainer
    from collectors.lightning import RtopCallback

    Trainer(accelerator="gpu", devices=8, strategy="ddp", callbacks=[RtopCallback()])

The hub comes from ``RTOP_HUB``/``RTOP_TOKEN`` (or ``RtopCallback(hub=..., token=...)``;
other keyword arguments are :class:`collectors.ProbeConfig` fields). Every hook runs in
each rank's own process, on its training thread.

What it measures, the same figures as the contract API (``collectors.start``, ``probe.iter``,
``probe.step``, ``probe.watch``):

* **Identity** (``setup``, stage ``fit``): the probe starts with the rank, world size and
  local rank the strategy set up (``trainer.global_rank``, ``world_size``, ``local_rank``).
* **Allreduce** (``on_fit_start``): ``probe.watch`` on ``trainer.strategy.model``, the
  DDP-wrapped module (with its first optimizer, for the memory breakdown).
* **Data wait** (``on_train_epoch_start``): the time blocked in the fit loop's fetch of
  each batch. Lightning fetches a batch (``next()`` on its data fetcher) between
  ``on_train_batch_end`` and the next ``on_train_batch_start``, but that gap also holds
  Lightning's own work: a broadcast of its SIGTERM flag every step under DDP, moving the
  batch to the device, validation, logging. So the gap is not data wait. The callback
  wraps the loader the fit loop's data fetcher iterates (the ``CombinedLoader`` over your
  train dataloaders, re-iterated every epoch) with ``probe.iter``, so exactly the time
  blocked in its ``next()`` is measured, including the one-batch prefetch of a loader
  without a length. A Lightning whose fit loop has no such fetcher, or a
  ``training_step`` that takes ``dataloader_iter`` (it fetches inside the step), leaves
  data wait not measured (``None``), with a note.
* **Step** (``on_train_batch_start`` to ``on_train_batch_end``): forward, backward and the
  optimizer step of one batch, with its tokens when the batch is a mapping with
  ``input_ids`` (their elements; samples come from the loader's batches). With gradient
  accumulation each batch is a step; the batches that do not synchronise report their
  allreduce as 0, as ``no_sync`` does.
* **Close** (``on_fit_end``, ``teardown``, ``on_exception``): the probe is closed if this
  callback started it; an exception is sent to the hub as the rank's error.

rtop never raises into Lightning: each hook's own work is guarded (:data:`POINTS`). An
error turns the callback off for the rest of the run (it still closes the probe), warns
once and leaves a note that the rank sends to the hub.

This module imports Lightning when imported (``lightning.pytorch``, or
``pytorch_lightning``: whichever the process already imported, else whichever is
installed); ``import collectors`` never imports it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Final

from collectors import guard
from collectors.callbacks import CallbackHooks, Resume, callback_class, tokens_in
from collectors.probe import Probe, TimedIterable, untimed

__all__ = ["POINTS", "RtopCallback"]

#: What a failure in this callback turns off.
FEATURE: Final = "the Lightning callback"

#: Where this callback runs rtop's code on the training thread (``collectors.guard``'s
#: shape): point -> (where it runs, the feature a failure there turns off).
POINTS: Final[dict[str, tuple[str, str]]] = {
    "lightning.setup": ("RtopCallback.setup: starting the probe", FEATURE),
    "lightning.fit_start": ("RtopCallback.on_fit_start: watching the DDP model", FEATURE),
    "lightning.epoch_start": ("RtopCallback.on_train_epoch_start: timing the train loader",
                              FEATURE),
    "lightning.batch_start": ("RtopCallback.on_train_batch_start: the step's entry", FEATURE),
    "lightning.batch_end": ("RtopCallback.on_train_batch_end: the step's exit", FEATURE),
    "lightning.close": ("RtopCallback.on_fit_end, teardown or on_exception: closing the probe",
                        FEATURE),
}

guard.register(POINTS)

#: The packages that provide Lightning's ``Callback``, preferred first.
PACKAGES: Final = ("lightning.pytorch", "pytorch_lightning")

def _stage_is_fit(stage: Any) -> bool:
    return str(getattr(stage, "value", stage)) == "fit"


class _LightningHooks(CallbackHooks):
    """The hooks of :class:`RtopCallback`, apart from Lightning's ``Callback`` base (the
    probe, the step and the guard are :class:`collectors.callbacks.CallbackHooks`'s;
    ddp_spawn pickles the trainer and its callbacks, and nothing of a run travels)."""

    feature = FEATURE

    def _reset(self) -> None:
        super()._reset()
        self._fetcher: Any = None  # the fit loop's data fetcher, once its loader is timed

    # ---- Lightning's hooks --------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: Any) -> None:
        """Start the probe when fitting starts (the process group is up by then)."""
        if _stage_is_fit(stage):
            self._off = False  # a new fit is a new run
            self._run("lightning.setup", self._start, trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Watch the DDP-wrapped model (the strategy has wrapped it by now)."""
        self._run("lightning.fit_start", self._watch, trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Time the fit loop's fetch of each batch (see the module doc)."""
        self._run("lightning.epoch_start", self._time_loader, trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                             *args: Any) -> None:
        """A step starts (with its batch's tokens, when it has ``input_ids``)."""
        self._run("lightning.batch_start", self._batch_start, batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int, *args: Any) -> None:
        """The step ends (after the optimizer step)."""
        self._run("lightning.batch_end", self._batch_end)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the probe (if this callback started it)."""
        self._close(None)

    def teardown(self, trainer: Any, pl_module: Any, stage: Any) -> None:
        """Close the probe, if ``on_fit_end`` did not."""
        if _stage_is_fit(stage):
            self._close(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """The fit failed: close the probe with the error, so the hub shows why."""
        self._close(exception)

    # ---- the work, each body guarded by _run ----------------------------------------

    def _start(self, trainer: Any) -> None:
        if self._probe is not None and not self._probe.closed:
            return
        self._start_probe(int(trainer.global_rank), int(trainer.world_size),
                          int(trainer.local_rank))

    def _watch(self, trainer: Any) -> None:
        if self._probe is None:
            self._start(trainer)
        probe = self._probe
        if probe is None:
            return
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        probe.watch(trainer.strategy.model, optimizers[0] if optimizers else None)
        self._note("how", "Lightning: steps timed from on_train_batch_start to "
                          "on_train_batch_end; data wait timed around the fit loop's fetch "
                          "of each batch (RtopCallback)")

    def _time_loader(self, trainer: Any) -> None:
        probe = self._probe
        if probe is None:
            return
        fetcher = getattr(getattr(trainer, "fit_loop", None), "_data_fetcher", None)
        if fetcher is None or not hasattr(fetcher, "_combined_loader") \
                or not hasattr(fetcher, "iterator"):
            self._note("fetcher", "Lightning: data wait not measured: this version's fit loop "
                                  "has no data fetcher rtop knows how to time")
            return
        if type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
            self._note("fetcher", "Lightning: data wait not measured: training_step takes "
                                  "dataloader_iter and fetches inside the step")
            return
        loader = fetcher._combined_loader
        if loader is None or isinstance(loader, TimedIterable):
            return  # timed already: every iterator made from it since is timed
        fetcher._combined_loader = probe.iter(loader)  # each later epoch's iter() is timed
        if fetcher.iterator is not None:
            # this epoch's iterator was made from the loader before any hook ran
            fetcher.iterator = iter(probe.iter(Resume(fetcher.iterator)))
        self._fetcher = fetcher

    def _batch_start(self, batch: Any) -> None:
        # a batch the module skipped never reached on_train_batch_end: _begin_step ends it
        self._begin_step(tokens_in(batch))

    def _batch_end(self) -> None:
        self._end_step()

    # ---- closing ---------------------------------------------------------------------

    def _close(self, error: BaseException | None) -> None:
        """Close the probe (guarded point ``lightning.close``); runs even when the
        callback is off, so the hub hears why."""
        probe = self._probe
        if probe is None:
            return
        try:
            self._finish(probe, error)
        except Exception as exc:  # guarded point: never raise into the job
            self._failed("lightning.close", exc)
            try:
                if self._owned:
                    probe.close()
            except Exception:
                pass
        self._probe = None

    def _finish(self, probe: Probe, error: BaseException | None) -> None:
        self._end_step(error)
        fetcher, self._fetcher = self._fetcher, None
        loader = getattr(fetcher, "_combined_loader", None)
        if isinstance(loader, TimedIterable):  # the loader as the fit loop made it
            fetcher._combined_loader = untimed(loader)
        if self._owned:
            if error is not None and not isinstance(error, KeyboardInterrupt):
                probe.exit_error = f"{type(error).__name__}: {error}"[:500]
            probe.close()


def _callback_bases() -> tuple[type, ...]:
    """Lightning's ``Callback`` class(es): of the package(s) this process imported, else
    of the first one installed."""
    loaded = [sys.modules[name].Callback for name in PACKAGES
              if name in sys.modules and hasattr(sys.modules[name], "Callback")]
    if loaded:
        return tuple(dict.fromkeys(loaded))
    import importlib

    for name in PACKAGES:
        try:
            return (importlib.import_module(name).Callback,)
        except ImportError:
            continue
    raise ImportError(
        "collectors.lightning needs Lightning: neither lightning.pytorch nor "
        "pytorch_lightning can be imported (pip install lightning)")


if TYPE_CHECKING:
    from lightning.pytorch import Callback as _Callback

    class RtopCallback(_LightningHooks, _Callback):  # type: ignore[misc, unused-ignore]
        """rtop's Lightning callback (a Lightning ``Callback``)."""
else:
    RtopCallback = callback_class(
        _LightningHooks, _callback_bases(), __name__,
        "rtop's Lightning callback: ``Trainer(callbacks=[RtopCallback()])`` (see "
        "``collectors.lightning``).")
