"""Zero-code instrumentation: what ``rtop run`` turns on in every Python process of its
command, with no change to the training code.

``rtop run`` puts ``collectors/_autoload`` first on ``PYTHONPATH`` and sets
``RTOP_AUTO=1``; Python then runs ``collectors/_autoload/sitecustomize.py`` at start-up,
which waits, at no cost, until the process imports torch and then calls
:func:`install`. That only patches torch; nothing is started and no thread runs until
the process trains:

* The ``__next__`` of DataLoader's iterators (``_BaseDataLoaderIter``) goes through
  :meth:`Auto.fetch`, which times it with ``probe.iter``. The iterator itself is not
  wrapped: its type, its attributes and its lifetime stay as they were (``isinstance``
  checks, such as Lightning's when it saves its loop state, still hold).
* One global optimizer hook (``torch.optim.optimizer.register_optimizer_step_post_hook``)
  sees every optimizer's step (:meth:`Auto.optimizer_stepped`).
* ``DistributedDataParallel.__init__`` watches each DDP model once built
  (``probe.watch``: its allreduce); FSDP's ``fully_shard`` (FSDP2) and
  ``FullyShardedDataParallel`` (FSDP1) hand their modules to :meth:`Auto.sharded`, which
  watches the outermost sharded modules at the next step boundary (``probe.watch``
  accepts them; ``collectors.collectives`` times their collectives).

**When the probe starts** (``collectors.start()``: identity from torchrun's environment
or the initialised process group): at the first DDP or FSDP model built, the first
optimizer step, or the first batch fetched from a DataLoader with autograd on, if the
process group is initialised or the process shows no sign of being one rank of a larger
job (no ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` or ``MASTER_ADDR``, no Ray). torchrun's
launcher imports torch but does none of these, so it is never a rank, and neither is
any other process that does not train (a DataLoader worker, a helper script). The probe
closes at exit (``collectors.start``'s ``atexit``).

**What a step is.** A batch fetched from a DataLoader (with autograd on) begins a step
right after the fetch, whose wait is the step's data wait; the next optimizer step ends
it. With gradient accumulation each micro-batch is a step: a fetch while a step is
still open ends that step first (its collective is reported as 0 under ``no_sync``),
so no data wait is ever counted as compute. Without a DataLoader, a step runs from one
optimizer step to the next, and data wait is not measured. A loader iterated with
autograd off (``torch.no_grad()``: validation, inference) is passed through untimed.
Only the thread that trains (the one that started the probe) is instrumented.

**Standing aside.** A process whose code starts its own probe (the contract API, or a
Lightning or Hugging Face callback) first keeps it: the instrumentation stands aside, as
it does when the code calls ``collectors.start()`` later, once this module's probe runs
(a callback that starts after the model is built, or a loop that starts timing late: the
step a fetch just began is then left to the code), when it notices steps it did not
record, or a ``probe.step()`` entered inside one of its own (code that took the probe
with ``collectors.current()``: the step that held it is recorded once, then the code's).
``RTOP_DISABLE=1`` turns everything off.

**Never into the job.** Every place this module runs on the training thread is a
guarded point of :mod:`collectors.guard` (:data:`POINTS`): an error turns the automatic
instrumentation off for the rest of the run, with one warning and a note for the hub,
and the job goes on as without rtop (a loader's own exceptions still propagate, and an
iterator that raised can be resumed, as without rtop).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

import collectors
from collectors import guard
from collectors.probe import Probe

log = logging.getLogger("collectors")

__all__ = ["ENV", "POINTS", "Auto", "install", "installed", "sharding_imported"]

#: The environment variable that turns this on in a process (``rtop run`` sets it).
ENV: Final = "RTOP_AUTO"

#: What a failure here turns off.
FEATURE: Final = "automatic instrumentation (rtop run)"

#: Where this module runs rtop's code on the training thread (``collectors.guard``'s
#: shape): point -> (where it runs, the feature a failure there turns off).
POINTS: Final[dict[str, tuple[str, str]]] = {
    "auto.start": ("starting the probe as the process begins to train (rtop run)", FEATURE),
    "auto.fetch": ("a DataLoader's next() as rtop run times it: the step boundary there",
                   FEATURE),
    "auto.optimizer": ("rtop run's optimizer-step hook: the step boundary there", FEATURE),
    "auto.model": ("a DDP or FSDP model's construction, as rtop run watches it", FEATURE),
}

guard.register(POINTS)

#: Environment variables that say a process is one rank of a larger job whose process
#: group may not be initialised yet: its first batch does not start the probe.
RANK_ENV: Final = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")

#: The attribute of a DataLoader iterator that holds its timed iterator (``probe.iter``).
TIMED: Final = "_rtop_timed"

#: The note each probe started here sends to the hub (shown in the rank's detail).
NOTE: Final = ("rtop run: instrumented without code changes: a step begins after each "
               "batch fetched from a DataLoader (its wait is the data wait) and ends at "
               "the optimizer's step (or at the next fetch: a micro-batch)")


class _Resume:
    """Iterating it continues a DataLoader iterator where it is, one batch per ``next()``
    through the iterator's own ``__next__``; it holds the iterator weakly, so the timed
    iterator kept on it makes no reference cycle (an iterator dropped mid-epoch still
    shuts its workers down at once)."""

    __slots__ = ("_next", "_ref")

    def __init__(self, it: Any, next_: Callable[[Any], Any]) -> None:
        self._ref = weakref.ref(it)
        self._next = next_

    def __iter__(self) -> _Resume:
        return self

    def __next__(self) -> Any:
        it = self._ref()
        if it is None:
            raise StopIteration
        return self._next(it)


class Auto:
    """One process's automatic instrumentation (see the module's docstring).

    Its methods are called from torch's patched places, on whichever thread trains;
    ``start`` makes the probe (:func:`collectors.start`; tests pass their own).
    """

    def __init__(self, torch: Any, start: Callable[[], Any] | None = None) -> None:
        self._torch = torch
        self._start = start if start is not None else collectors.start
        #: The probe this instrumentation started and feeds (None before training).
        self.probe: Probe | None = None
        #: Off for the rest of the run: disabled, stood aside, or failed.
        self.off = False
        #: Whether a DataLoader feeds the steps (then a fetch begins each step).
        self.loader_steps = False
        self._thread: int | None = None  # the thread that trains
        self._fetch_thread: int | None = None  # the last to fetch with autograd on
        self._open: Any = None  # the step context entered and not yet exited
        # the probe's count of step enters after this instrumentation's last (or its
        # start): any other means that the code times steps of its own
        self._entered = 0
        self._takeover = False  # another thread called collectors.start(): stand aside
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._sharded: list[weakref.ref[Any]] = []  # FSDP modules not yet watched
        self._undo: list[Callable[[], None]] = []

    # ---- what torch's patched places call -------------------------------------------

    def fetch(self, it: Any, next_: Callable[[Any], Any]) -> Any:
        """``next(it)`` of a DataLoader's iterator ``it``, whose own ``__next__`` is
        ``next_``: end the open step, time the wait, begin the next step (guarded point
        ``auto.fetch``)."""
        if not self._torch.is_grad_enabled():
            return next_(it)  # validation, inference: not a training batch
        probe = self.probe
        me = threading.get_ident()
        if probe is None:
            self._fetch_thread = me
            if not self._may_start_on_fetch():
                return next_(it)
            probe = self._ensure("auto.fetch")
            if probe is None:
                return next_(it)
        elif me != self._thread:
            return next_(it)  # a prefetching thread: not the training thread
        try:
            self._boundary(probe)
            if self.off:
                return next_(it)
            timed = getattr(it, TIMED, None)
            if timed is None:
                timed = iter(probe.iter(_Resume(it, next_)))
                setattr(it, TIMED, timed)
            self.loader_steps = True
        except Exception as exc:  # guard point "auto.fetch": never raise into the job
            self._failed("auto.fetch", exc)
            return next_(it)
        try:
            item = next(timed)  # the loader's own exceptions are the job's: they propagate
        except BaseException:
            # the epoch's end (a persistent workers' iterator is reused), or an error the
            # job may catch and go on from: the next fetch resumes with a fresh timer
            with contextlib.suppress(Exception):
                delattr(it, TIMED)
            raise
        try:
            self._enter(probe)
        except Exception as exc:
            self._failed("auto.fetch", exc)
        return item

    def optimizer_stepped(self, optimizer: Any) -> None:
        """After any optimizer's ``step()``: the step ends (guarded point
        ``auto.optimizer``)."""
        if self.off:
            return
        probe = self.probe
        if probe is None:
            probe = self._ensure("auto.optimizer")
            if probe is None:
                return
        elif threading.get_ident() != self._thread:
            return
        try:
            if optimizer not in self._optimizers:
                self._optimizers.add(optimizer)
                probe.watch(None, optimizer)  # its state, for the memory breakdown
            self._boundary(probe)
            if not self.off and not self.loader_steps:
                self._enter(probe)  # no DataLoader: the next step begins now
        except Exception as exc:  # guard point "auto.optimizer": never raise into the job
            self._failed("auto.optimizer", exc)

    def model_built(self, model: Any) -> None:
        """A ``DistributedDataParallel`` model was built: watch it (guarded point
        ``auto.model``)."""
        probe = self._model_probe()
        if probe is None:
            return
        try:
            probe.watch(model)
        except Exception as exc:  # guard point "auto.model": never raise into the job
            self._failed("auto.model", exc)

    def sharded(self, module: Any) -> None:
        """``fully_shard`` or FSDP1 sharded ``module`` (or a list of modules): the
        outermost ones are watched at the next step boundary, once every inner one is
        sharded too (guarded point ``auto.model``)."""
        if self._model_probe() is None:
            return
        try:
            for m in module if isinstance(module, (list, tuple)) else [module]:
                self._sharded.append(weakref.ref(m))
        except Exception as exc:
            self._failed("auto.model", exc)

    def code_takes_over(self) -> None:
        """The code called ``collectors.start()`` while the probe this instrumentation
        started runs: a framework callback or the contract API times its own steps from
        now on. Stand aside; on the training thread, the step a fetch just began is
        dropped (its wait goes to the code's first step), elsewhere the next step
        boundary stands aside. Never raises."""
        if self.off or self.probe is None:
            return
        try:
            if threading.get_ident() != self._thread:
                self._takeover = True
                return
            if self._open is not None:
                self._open = None
                self.probe.drop_open_step()
            self._stand_aside("the code records steps of its own (the contract API or a "
                              "callback)")
        except Exception as exc:
            self._failed("auto.start", exc)

    # ---- steps ------------------------------------------------------------------------

    def _boundary(self, probe: Probe) -> None:
        """A step boundary: end the open step; watch models sharded since the last one."""
        if self._takeover or probe.activity.entered != self._entered:
            # a step entered by someone else (inside the one open here, or between)
            self._stand_aside("the code records steps of its own (the contract API or a "
                              "callback)")
            return
        if self._open is not None:
            self._exit()
        if self._sharded:
            self._watch_sharded(probe)

    def _enter(self, probe: Probe) -> None:
        step = probe.step()
        step.__enter__()
        self._open = step
        self._entered = probe.activity.entered

    def _exit(self) -> None:
        step, self._open = self._open, None
        if step is not None:
            step.__exit__(None, None, None)

    def _watch_sharded(self, probe: Probe) -> None:
        modules = [m for m in (r() for r in self._sharded) if m is not None]
        self._sharded = []
        inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
        for m in modules:
            if id(m) not in inner:
                probe.watch(m)

    # ---- starting, standing aside, failing ----------------------------------------------

    def _may_start_on_fetch(self) -> bool:
        """Whether a batch may start the probe: the process group is up, or nothing says
        this process is one rank of a larger job (else its rank is not known yet)."""
        dist = getattr(self._torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return True
        return not any(k in os.environ for k in RANK_ENV) and "ray" not in sys.modules

    def _model_probe(self) -> Probe | None:
        """The probe that watches a model, started now if need be; None when off."""
        if self.off:
            return None
        probe = self.probe or self._ensure("auto.model")
        return None if probe is None or self.off else probe

    def _ensure(self, point: str) -> Probe | None:
        """The probe, started now: the process begins to train (guarded point
        ``auto.start``). None when disabled or when the code has a probe of its own."""
        if self.off:
            return None
        try:
            before = collectors.current()
            if isinstance(before, Probe):
                self.off = True
                log.info("rtop: this process started its own probe: rtop run's automatic "
                         "instrumentation stands aside")
                return None
            probe = self._start()
            if not isinstance(probe, Probe):  # RTOP_DISABLE=1
                self.off = True
                return None
            self.probe = probe
            self._thread = threading.get_ident()
            self._entered = probe.activity.entered
            self.loader_steps = self._fetch_thread == self._thread
            probe.notes.append(NOTE)
            return probe
        except Exception as exc:  # guard point "auto.start": never raise into the job
            self._failed("auto.start", exc)
            return None

    def _stand_aside(self, why: str) -> None:
        self.off = True
        if self._open is not None:
            self._exit()
        note = f"rtop run: automatic step timing stands aside: {why}"
        log.info("rtop: %s", note)
        if self.probe is not None:
            self.probe.notes.append(note)

    def _failed(self, point: str, error: BaseException) -> None:
        """``point`` failed: off for the rest of the run (warned once, noted for the
        hub through the probe's faults); a step left open is ended. Never raises."""
        try:
            self.off = True
            guard.integration_failed(self.probe, point, error, FEATURE, "process")
            if self._open is not None:
                self._exit()
        except Exception:
            pass

    def _after_fork(self) -> None:
        """In a forked child: a training process's child (a DataLoader worker) is not a
        rank; a process that had not trained yet may have children that do."""
        if self.probe is not None:
            self.off = True
        self.probe = None
        self._open = None
        self._thread = self._fetch_thread = None

    # ---- patching torch ---------------------------------------------------------------

    def patch(self) -> None:
        """Patch torch's DataLoader, optimizers and DDP (and FSDP if already imported)."""
        iter_cls = importlib.import_module("torch.utils.data.dataloader")._BaseDataLoaderIter
        original_next = iter_cls.__next__
        auto = self

        @functools.wraps(original_next)
        def __next__(it: Any) -> Any:
            return original_next(it) if auto.off else auto.fetch(it, original_next)

        iter_cls.__next__ = __next__
        self._undo.append(lambda: setattr(iter_cls, "__next__", original_next))

        optim = importlib.import_module("torch.optim.optimizer")  # not an attribute
        handle = optim.register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: auto.optimizer_stepped(optimizer))
        self._undo.append(handle.remove)

        ddp_cls = importlib.import_module("torch.nn.parallel").DistributedDataParallel
        self._wrap_init(ddp_cls, self.model_built)
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is not None:
            self.patch_sharding(fsdp)

    def patch_sharding(self, fsdp: Any) -> None:
        """Patch ``torch.distributed.fsdp``'s ``fully_shard`` and
        ``FullyShardedDataParallel`` (once)."""
        if getattr(fsdp, "_rtop_patched", False):
            return
        fsdp._rtop_patched = True
        shard = getattr(fsdp, "fully_shard", None)
        if callable(shard):
            auto = self

            @functools.wraps(shard)
            def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
                out = shard(module, *args, **kwargs)
                auto.sharded(out)
                return out

            fsdp.fully_shard = fully_shard
            self._undo.append(lambda: setattr(fsdp, "fully_shard", shard))
        fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
        if isinstance(fsdp1, type):
            self._wrap_init(fsdp1, self.sharded)
        self._undo.append(lambda: delattr(fsdp, "_rtop_patched"))

    def _wrap_init(self, cls: Any, after: Callable[[Any], None]) -> None:
        original = cls.__init__

        @functools.wraps(original)
        def __init__(module: Any, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            after(module)

        cls.__init__ = __init__
        self._undo.append(lambda: setattr(cls, "__init__", original))

    def unpatch(self) -> None:
        """Undo :meth:`patch` (tests); the probe, if any, is left to its owner."""
        self.off = True
        while self._undo:
            self._undo.pop()()
        if collectors.on_start_again == self.code_takes_over:
            collectors.on_start_again = None


_installed: Auto | None = None
_lock = threading.Lock()


def install(torch: Any) -> Auto:
    """Patch ``torch`` (just imported) once in this process so that training starts
    and feeds a probe (see the module's docstring). Raises if this torch cannot be
    patched; ``collectors/_autoload/sitecustomize.py`` then warns once and the process
    runs as without rtop."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        auto = Auto(torch)
        try:
            auto.patch()
        except BaseException:
            auto.unpatch()
            raise
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=auto._after_fork)
        collectors.on_start_again = auto.code_takes_over
        _installed = auto
        return auto


def installed() -> Auto | None:
    """This process's instrumentation, once :func:`install` ran."""
    return _installed


def sharding_imported(fsdp: Any) -> None:
    """``torch.distributed.fsdp`` was just imported: patch it too."""
    auto = _installed
    if auto is not None and not auto.off:
        auto.patch_sharding(fsdp)
