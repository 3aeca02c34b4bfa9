"""The two small objects a probe owns for the code that runs on its training thread.

:class:`Activity` is what the training thread is doing now (its phase and since when,
whether it is inside a step); the heartbeat sampler reads it from the sender thread.
:class:`CommTiming` is how the collectives are timed and what the current step has
collected so far; :mod:`collectors.commhook` and :mod:`collectors.ddptimer` write its
DDP part, :mod:`collectors.collectives` every other collective (FSDP's, a user's own),
the probe's step timer takes the step's figures at step exit, and the sender reads the
world size and byte count.

Both are plain slotted objects: the training thread's hot path reads and writes their
attributes directly (no method call, no lock: single attribute stores are atomic under
the GIL, and the sender thread only reads).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any


class Activity:
    """The training thread's current phase, for the heartbeat.

    Written on the training thread only (``probe.iter``, ``probe.step``,
    ``probe.checkpoint`` and the DDP hooks, which run on it during backward); read by
    the sender thread.
    """

    __slots__ = ("depth", "entered", "phase", "since", "thread_id")

    def __init__(self) -> None:
        #: ``"idle"``, ``"data"``, ``"compute"``, ``"comm"``, ``"checkpoint"``, ...
        self.phase = "idle"
        #: ``time.perf_counter()`` when the phase began.
        self.since = time.perf_counter()
        #: How many ``probe.step()`` contexts are open (nesting is allowed).
        self.depth = 0
        #: How many times a ``probe.step()`` context was entered, at any depth (so a
        #: step timer can tell that someone else entered one inside its own).
        self.entered = 0
        #: The training thread's ident, once known (whose stack a long phase sends).
        self.thread_id: int | None = None

    @property
    def in_step(self) -> bool:
        """Whether the training thread is inside ``probe.step()``."""
        return self.depth > 0

    def enter(self, phase: str, t: float) -> None:
        """The training thread starts ``phase`` at ``t`` (``time.perf_counter()``)."""
        self.phase = phase
        self.since = t


class CommTiming:
    """How the collectives are timed, and this step's figures so far.

    A DDP model's allreduce, one of two ways chosen by ``probe.watch``: rtop's comm hook
    (:meth:`use_hook`: ``buckets`` collects ``[launch, done, nbytes]`` entries during
    the step) or DDP's own timer (:meth:`use_ddp_timer`: ``ddp_logger`` is read at step
    exit). Every other collective (FSDP's all-gathers and reduce-scatters, a user's own
    ``dist.all_reduce``), once :meth:`use_direct` (``collectors.collectives``): ``calls``
    collects ``[op, launch, done, nbytes, group_size, count, group]`` entries and ``blocked``
    the intervals the caller spent blocked in them. None of these: collectives are not
    timed, and the step says so (``None``).
    """

    __slots__ = ("blocked", "buckets", "calls", "ddp_iteration", "ddp_logger", "ddp_model",
                 "ddp_ref", "direct_failed", "failed", "hook_codes", "nbytes", "on_failure",
                 "world")

    def __init__(self) -> None:
        #: This step's bucket entries while the comm hook times the allreduce, else None.
        self.buckets: list[Any] | None = None
        #: Ranks taking part in the collective (for bus bandwidth).
        self.world = 1
        #: Bytes one allreduce of DDP's timer moves (the gradients); the hook counts its own.
        self.nbytes = 0
        #: DDP's logger when its own timer times the allreduce, else None.
        self.ddp_logger: Any = None
        #: The last DDP iteration whose stamps were read (each step is read once).
        self.ddp_iteration: int | None = None
        #: A weak reference to the DDP model timed by its own timer, until released.
        self.ddp_model: Any = None
        #: True once timing failed (:meth:`fail`): collectives are not measured from then.
        self.failed = False
        #: Told ``(point, error)`` when timing fails (the probe's fault record).
        self.on_failure: Callable[[str, BaseException], Any] | None = None
        #: This step's direct collectives (``[op, launch, done, nbytes, group_size,
        #: count, group]``) while ``collectors.collectives`` times them, else None.
        self.calls: list[Any] | None = None
        #: This step's intervals ``(start, end)`` spent blocked in a direct collective
        #: (the call itself on CPU, ``Work.wait()``).
        self.blocked: list[Any] = []
        #: True once timing the direct collectives failed (:meth:`fail_direct`).
        self.direct_failed = False
        #: A weak reference to the watched DDP model, if any: a collective its comm hook
        #: launches is DDP's, timed by the hook or DDP's timer, not counted again.
        self.ddp_ref: Any = None
        #: ``(hooks list id, length, code objects)``: the DDP comm hooks' code, cached.
        self.hook_codes: tuple[int, int, frozenset[Any]] | None = None

    @property
    def measured(self) -> bool:
        """Whether the collectives are timed at all."""
        return self.ddp_measured or self.calls is not None

    @property
    def ddp_measured(self) -> bool:
        """Whether a DDP model's allreduce is timed (by the comm hook or DDP's timer)."""
        return self.buckets is not None or self.ddp_logger is not None

    def fail(self, point: str, error: BaseException) -> None:
        """Timing the collectives failed at ``point`` (``collectors.guard``): stop, and
        report the steps' collective figures as not measured from now on."""
        self.failed = True
        self.buckets = None
        self.ddp_logger = None
        self._report(point, error)

    def fail_direct(self, point: str, error: BaseException) -> None:
        """Timing the direct collectives failed at ``point`` (``collectors.guard``): stop,
        and report the steps' collective figures as not measured from now on."""
        self.direct_failed = True
        self.calls = None
        self._report(point, error)

    def _report(self, point: str, error: BaseException) -> None:
        callback = self.on_failure
        if callback is not None:
            with contextlib.suppress(Exception):  # the report must not break the job
                callback(point, error)

    def use_direct(self) -> None:
        """Every collective not launched by DDP is timed from now on
        (``collectors.collectives``)."""
        if self.calls is None and not self.direct_failed:
            self.calls = []
            self.blocked = []

    def stop_direct(self) -> None:
        """The direct collectives are no longer timed (the probe closed)."""
        self.calls = None

    def use_hook(self, world: int) -> None:
        """rtop's comm hook times each bucket from now on (``collectors.commhook``)."""
        self.world = world
        self.buckets = [] if not self.failed else None

    def use_ddp_timer(self, logger: Any, world: int, nbytes: int, model_ref: Any) -> None:
        """DDP's own timer times the allreduce from now on (``collectors.ddptimer``)."""
        self.world = world
        self.nbytes = nbytes
        self.ddp_iteration = None
        self.ddp_logger = logger if not self.failed else None
        self.ddp_model = model_ref
