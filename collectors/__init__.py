"""rtop's in-rank collectors: time every step's data wait, compute and allreduce, sample
the GPU (NVML) and the host (psutil), and stream it all to the rtop hub.

Usage (the public contract)::

    import collectors

    probe = collectors.start()          # rank/world/node from Ray Train, torch.distributed or env
    model = probe.watch(model)          # the DDP-wrapped model: times its gradient allreduce
    for batch in probe.iter(loader):    # times the wait for each batch
        with probe.step():              # one training step
            ...
    probe.close()

This package imports only the standard library, ``psutil`` and ``msgpack`` when
imported; ``torch``, ``ray`` and ``pynvml`` are used only if the training process has
them, and imported where they are used. It never imports ``rtop`` or ``textual``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from collectors import lastgasp, osexit
from collectors.config import ProbeConfig
from collectors.identity import Identity, detect
from collectors.probe import Probe

__version__ = "0.1.0"
__all__ = ["Identity", "NullProbe", "Probe", "ProbeConfig", "current", "start"]

log = logging.getLogger("collectors")
T = TypeVar("T")

_lock = threading.Lock()
_probe: Probe | NullProbe | None = None


class NullProbe:
    """What :func:`start` returns when rtop is disabled (``RTOP_DISABLE=1``): the same
    API, doing nothing."""

    identity: Identity | None = None

    def iter(self, iterable: Iterable[T]) -> Iterable[T]:
        """Return the iterable unchanged."""
        return iterable

    def step(self, tokens: int | None = None, flops: float | None = None
             ) -> contextlib.nullcontext[None]:
        """A context manager that does nothing."""
        return contextlib.nullcontext()

    def count_flops(self, model: Any, *inputs: Any, dtype: str | None = None,
                    **kwargs: Any) -> float | None:
        """Count nothing (rtop is off): None."""
        return None

    def checkpoint(self) -> contextlib.nullcontext[None]:
        """A context manager that does nothing."""
        return contextlib.nullcontext()

    def watch(self, model: T, optimizer: Any = None) -> T:
        """Return the model unchanged."""
        return model

    def stats(self) -> dict[str, int]:
        """No counters."""
        return {}

    def close(self, timeout: float | None = None) -> None:
        """Nothing to close."""


def start(
    *,
    hub: str | None = None,
    token: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    **settings: Any,
) -> Probe | NullProbe:
    """Start this process's probe (once; later calls return the same probe).

    The hub comes from ``hub``/``token``, else ``RTOP_HUB``/``RTOP_TOKEN``. Identity is
    detected (Ray Train, then ``torch.distributed``/torchrun, then a single process);
    ``rank``, ``world_size`` and ``local_rank`` override it. Other keyword arguments
    are :class:`ProbeConfig` fields. Never raises because of the hub.

    The probe closes at the interpreter's exit (``atexit``), says goodbye on a
    launcher's SIGTERM (:mod:`collectors.lastgasp`) and before ``os._exit(0)``
    (:mod:`collectors.osexit`), each within a small budget.
    """
    global _probe
    with _lock:
        if _probe is not None and not getattr(_probe, "closed", False):
            hook = on_start_again
            if hook is not None:
                with contextlib.suppress(Exception):  # never raise into the job
                    hook()
            return _probe
        config = ProbeConfig.from_env(hub=hub, token=token, **settings)
        if not config.enabled:
            _probe = NullProbe()
            return _probe
        identity = detect(rank=rank, world_size=world_size, local_rank=local_rank)
        probe = Probe(identity, config)
        atexit.register(probe.close, reason="exit")
        _install_excepthook()
        lastgasp.install(probe)  # a goodbye on a launcher's SIGTERM, if the job has no handler
        osexit.install(probe)  # and before os._exit(0), within osexit.GOODBYE_S
        _probe = probe
        return probe


def _install_excepthook() -> None:
    """Note an uncaught exception so the hub hears that the rank failed, and why."""
    previous = sys.excepthook
    if getattr(previous, "_rtop", False):
        return

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        p = _probe
        if isinstance(p, Probe) and not issubclass(tp, KeyboardInterrupt):
            p.exit_error = f"{tp.__name__}: {value}"[:500]
        previous(tp, value, tb)

    hook._rtop = True  # type: ignore[attr-defined]
    sys.excepthook = hook


#: Called when :func:`start` is called again while the probe runs: rtop run's automatic
#: instrumentation (:mod:`collectors.autoinstrument`) sets it, to stand aside for code
#: (a framework callback, the contract API) that times its own steps.
on_start_again: Callable[[], None] | None = None


def current() -> Probe | NullProbe | None:
    """The probe :func:`start` made in this process, if any."""
    return _probe


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) has no sender thread: start afresh if asked.
    global _probe
    _probe = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

