"""The probe: what the training loop calls. Its hot-path methods only take timestamps
and append a tuple to a bounded buffer; everything else happens on the sender thread.

What the probe hands over to other code, all documented attributes of :class:`Probe`:
``records`` and ``events`` (bounded buffers the sender thread empties), ``activity``
(the training thread's phase, :class:`collectors.handover.Activity`), ``comm`` (how
the collectives are timed, :class:`collectors.handover.CommTiming`, written by
:mod:`collectors.commhook`, :mod:`collectors.ddptimer` and
:mod:`collectors.collectives`) and ``cuda`` (the CUDA
event pool once steps are timed on the GPU), ``figures`` (what an integration measured,
sent with the notes: :mod:`collectors.raytrain`'s Ray Data cross-check) and
``raytrain`` (Ray Train's and Ray Data's hooks). Nothing outside this module writes a
probe's own fields.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from collectors import collectives, ddptimer
from collectors.config import ProbeConfig
from collectors.cuda_events import CAPTURES, EventPool
from collectors.guard import Faults
from collectors.handover import Activity, CommTiming
from collectors.identity import Identity
from collectors.memory import MemorySampler
from collectors.steps import RawStep

if TYPE_CHECKING:
    from collectors.raytrain import RayTrainHooks
    from collectors.sender import Sender

log = logging.getLogger("collectors")

T = TypeVar("T")

__all__ = ["Probe", "RawStep", "TimedIterable", "batch_size"]


def batch_size(batch: Any, _depth: int = 0) -> int | None:
    """The number of samples in a batch, when its first tensor-like member says so."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        try:
            return int(shape[0]) if len(shape) else None
        except (TypeError, ValueError):
            return None
    if _depth < 2:
        if isinstance(batch, (list, tuple)) and batch:
            return batch_size(batch[0], _depth + 1)
        if isinstance(batch, dict) and batch:
            return batch_size(next(iter(batch.values())), _depth + 1)
    return None


def sharded_kind(model: Any) -> str | None:
    """``"FSDP2"`` for a ``fully_shard`` module, ``"FSDP1"`` for a
    ``FullyShardedDataParallel`` one, else None (looked up only where torch has them)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    fsdp2 = getattr(fsdp, "FSDPModule", None)
    if fsdp2 is not None and isinstance(model, fsdp2):
        return "FSDP2"
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp1 is not None and isinstance(model, fsdp1):
        return "FSDP1"
    return None


class TimedIterable(Generic[T]):
    """Wraps a loader; iterating it times each wait in ``next()`` (``probe.iter``).

    ``len()`` and attribute access pass through to the wrapped loader.
    """

    def __init__(self, probe: Probe, iterable: Iterable[T]) -> None:
        self._probe = probe
        self._iterable = iterable
        #: Time blocked in ``next()`` over all passes (the call that ended each pass
        #: included), and the batches it yielded.
        self.wait_s = 0.0
        self.batches = 0

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterable, name)

    def __iter__(self) -> Iterator[T]:
        probe = self._probe
        it = iter(self._iterable)
        if probe._iter_off:
            yield from it
            return
        act = probe.activity
        clock = time.perf_counter
        try:
            act.thread_id = threading.get_ident()
        except Exception as exc:  # guard point "iter": never raise into the job
            probe.fault("iter", exc)
            yield from it
            return
        while True:
            try:
                t0 = clock()
                act.phase, act.since = "data", t0
            except Exception as exc:
                probe.fault("iter", exc)
                yield from it
                return
            try:
                item = next(it)  # the loader's own exceptions are the job's: they propagate
            except StopIteration:
                t1 = clock()
                self.wait_s += t1 - t0
                act.phase, act.since = "idle", t1
                return
            try:
                t1 = clock()
                self.wait_s += t1 - t0
                self.batches += 1
                if probe._wait_t0 is None:
                    probe._wait_t0 = t0
                    probe._wait_s = t1 - t0
                else:
                    probe._wait_s = (probe._wait_s or 0.0) + (t1 - t0)
                n = batch_size(item)
                if n is not None:
                    probe._samples = (probe._samples or 0) + n
                act.phase, act.since = "idle", t1
            except Exception as exc:
                probe.fault("iter", exc)
                yield item
                yield from it
                return
            yield item


def untimed(loader: TimedIterable[T]) -> Iterable[T]:
    """The loader a :class:`TimedIterable` wraps (what ``probe.iter`` was given)."""
    return loader._iterable


class _StepTimer:
    """The context manager ``probe.step()`` returns; re-entering it nests harmlessly."""

    __slots__ = ("_a", "_c", "_p")

    def __init__(self, probe: Probe) -> None:
        self._p = probe
        self._a = probe.activity
        self._c = probe.comm

    def __enter__(self) -> Probe:
        p = self._p
        a = self._a
        try:
            a.depth += 1
            a.entered += 1
            if a.depth == 1:
                t = time.perf_counter()
                p._t_enter = t
                a.phase, a.since = "compute", t
                if a.thread_id is None:
                    a.thread_id = threading.get_ident()
                cuda = p.cuda
                if cuda is not None:
                    stream = cuda.stream()
                    cuda.step_stream = stream  # the stream whose waits are exposed comm
                    p._cuda_start = cuda.record(stream)
                if p.device_wanted:
                    p._answer_device()
        except Exception as exc:  # guard point "step.enter": never raise into the job
            p.fault("step.enter", exc)
        return p

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        p = self._p
        a = self._a
        try:
            a.depth -= 1
            if a.depth > 0:
                return False
            if a.depth < 0:  # exit without enter: ignore rather than break the job
                a.depth = 0
                return False
            t = time.perf_counter()
            cuda_pair = None
            cuda = p.cuda
            start = p._cuda_start
            if start is not None:
                p._cuda_start = None
                end = cuda.record() if cuda is not None else None
                if end is not None:
                    cuda_pair = (start, end)
                elif cuda is not None:
                    cuda.release(start)
            comm = self._c
            buckets: list[Any] | tuple[int, ...] | None = comm.buckets
            if buckets is not None:
                comm.buckets = []
            elif comm.ddp_logger is not None:
                buckets = ddptimer.read(comm)
            calls = comm.calls
            direct: tuple[list[Any], list[Any], bool] | tuple[()] | None = None
            if calls is not None:  # every other collective (collectors.collectives)
                comm.calls = []
                blocked = comm.blocked
                comm.blocked = []
                direct = (calls, blocked, not comm.failed)
            elif comm.direct_failed:
                direct = ()
            t_start = p._wait_t0 if p._wait_t0 is not None else p._t_enter
            gap = t_start - p._prev_exit if p._prev_exit is not None else None
            record: RawStep = (
                p._step, t_start, p._wait_s, p._t_enter, t, p._samples, buckets, gap,
                cuda_pair, direct, p._given,
            )
            if len(p.records) < p._capacity:
                p.records.append(record)
            else:
                p.dropped_buffer += 1
            p._wait_t0 = p._wait_s = p._samples = p._given = None
            p._prev_exit = t
            p._step += 1
            a.phase, a.since = "idle", t
        except Exception as error:  # guard point "step.exit": never raise into the job
            p.fault("step.exit", error)
        if p._armed:  # a hub's action (profile, probe) waits for a step boundary
            p._boundary()
        return False


class _NoStep:
    """What ``probe.step()`` returns once step timing is off: does nothing."""

    __slots__ = ("_p",)

    def __init__(self, probe: Probe) -> None:
        self._p = probe

    def __enter__(self) -> Probe:
        return self._p

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


class _PhaseTimer:
    """Context manager for a named one-off phase such as a checkpoint."""

    def __init__(self, probe: Probe, kind: str) -> None:
        self._p = probe
        self._kind = kind
        self._t0 = 0.0

    def __enter__(self) -> Probe:
        self._t0 = time.perf_counter()
        self._p.activity.enter(self._kind, self._t0)
        return self._p

    def __exit__(self, *exc: object) -> Literal[False]:
        p = self._p
        t = time.perf_counter()
        if len(p.events) < p._capacity:
            p.events.append((self._t0, self._kind, t - self._t0, p._step - 1))
        p.activity.enter("idle", t)
        return False


class Probe:
    """One rank's collector. Make it with :func:`collectors.start`.

    The training thread calls :meth:`iter`, :meth:`step`, :meth:`watch` and
    :meth:`checkpoint`; a daemon sender thread samples GPU, host and memory, resolves
    CUDA events and ships batched frames to the hub. Nothing here raises into the
    training loop because of the hub: unreachable, slow or gone, records are dropped
    and counted (``stats()``) and the sender reconnects with backoff.
    """

    def __init__(
        self,
        identity: Identity,
        config: ProbeConfig | None = None,
        *,
        nvml: Any = None,
        start_sender: bool = True,
    ) -> None:
        self.identity = identity
        self.config = config or ProbeConfig.from_env()
        self._capacity = self.config.buffer_records
        #: Finished steps, oldest first, waiting for the sender thread (which pops them
        #: from the left); at most ``config.buffer_records``, then dropped and counted.
        self.records: deque[RawStep] = deque()
        #: One-off phases (``(t_start, kind, duration_s, step)``, perf_counter clock),
        #: bounded like ``records``.
        self.events: deque[tuple[float, str, float, int]] = deque()
        #: Steps dropped because ``records`` was full.
        self.dropped_buffer = 0
        #: The training thread's current phase, for the heartbeat.
        self.activity = Activity()
        #: How the watched model's collectives are timed (set up by ``watch``).
        self.comm = CommTiming()
        #: The CUDA event pool once steps are timed on the GPU (see :meth:`use_cuda_events`).
        self.cuda: EventPool | None = None
        # training-thread state
        self._step = 0
        self._wait_t0: float | None = None
        self._wait_s: float | None = None
        self._samples: int | None = None
        #: what the loop said of the step under way (``step(tokens=, flops=)``), or None
        self._given: tuple[int | None, float | None] | None = None
        self._t_enter = 0.0
        self._prev_exit: float | None = None
        self._cuda_start: Any = None
        self._captures_watched = False
        self._step_timer: _StepTimer | _NoStep = _StepTimer(self)
        self._iter_off = False
        #: Notes for the hub (what is measured and how; what was turned off and why).
        self.notes: list[str] = []
        #: Figures integrations measured, by name (``collectors.raytrain``: "ray_data";
        #: :meth:`count_flops`: "flops"; the settings' "pipeline_stage"), sent with the
        #: notes; a value is replaced whole, never changed in place.
        self.figures: dict[str, Any] = {}
        #: The model FLOPs of one step when a step does not say (:meth:`count_flops`, or
        #: the ``flops_per_step`` setting); None: not known.
        self.flops_per_step: float | None = self.config.flops_per_step
        if self.config.flops_per_step is not None:
            self.figures["flops"] = {"per_step": self.config.flops_per_step,
                                     "dtype": self.config.flops_dtype, "source": "setting"}
        if self.config.pipeline_stage is not None:
            self.figures["pipeline_stage"] = self.config.pipeline_stage
        #: Features turned off after a failure at one of ``collectors.guard``'s points.
        self.faults = Faults(self.notes)
        self.comm.on_failure = self.fault
        #: Set by the sender when it needs the training thread's current CUDA device
        #: (no CUDA model watched): answered at the next step entry (:attr:`cuda_device`).
        self.device_wanted = False
        #: ``torch.cuda.current_device()`` as the training thread saw it, once asked.
        self.cuda_device: int | None = None
        self.exit_reason = ""
        self.exit_error: str | None = None  # an uncaught exception, when we saw one
        self.memory = MemorySampler(self.config.memory_capacity_bytes)
        #: Actions of the hub armed for the training thread (:class:`collectors.control.
        #: Armed`); replaced whole under ``_armed_lock``, read without it.
        self._armed: list[Any] = []
        self._armed_lock = threading.Lock()
        self._control_off = False
        self._closed = False
        from collectors.sender import Sender

        self._sender = Sender(self, nvml=nvml)
        if start_sender:
            self._sender.start()
        #: Ray Train's and Ray Data's hooks (``collectors.raytrain``) once Ray is imported.
        self.raytrain: RayTrainHooks | None = None
        if "ray" in sys.modules:
            from collectors import raytrain

            self.raytrain = raytrain.install(self)

    # ---- the training loop's API -------------------------------------------------

    def iter(self, iterable: Iterable[T]) -> TimedIterable[T]:
        """Wrap a data loader (torch DataLoader, Ray Data iterator, any iterable) so
        the time blocked in each ``next()`` is measured as data wait. A Ray Data
        iterator's own figure for that time is set beside it (:mod:`collectors.raytrain`)."""
        if self._iter_off:
            return iterable  # type: ignore[return-value]
        if self.raytrain is not None:  # a Ray Data iterator: cross-checked with its stats
            ray_data = self.raytrain.iter(iterable)
            if ray_data is not None:
                return ray_data
        return TimedIterable(self, iterable)

    def drop_open_step(self) -> None:
        """Forget the step entered and not yet exited, recording nothing (rtop run's
        automatic step, when the code takes the step timing over right after a fetch):
        the wait just timed stays for the step the code begins next. Training thread
        only."""
        a = self.activity
        if a.depth <= 0:
            return
        a.depth -= 1
        if a.depth == 0:
            start, self._cuda_start = self._cuda_start, None
            if start is not None and self.cuda is not None:
                self.cuda.release(start)
            a.phase, a.since = "idle", time.perf_counter()

    def step(self, tokens: int | None = None, flops: float | None = None
             ) -> _StepTimer | _NoStep:
        """Context manager around one training step (forward, backward, optimizer).

        ``tokens``: the tokens in the step's batch (for tokens/s); ``flops``: the model
        FLOPs of this rank's step, when the loop knows them (else :meth:`count_flops`'s or
        the ``flops_per_step`` setting's figure is used). Both optional: a step without
        them costs what it did before."""
        if tokens is not None or flops is not None:
            self._given = (tokens, flops)
        return self._step_timer

    def count_flops(self, model: Any, *inputs: Any, dtype: str | None = None,
                    **kwargs: Any) -> float | None:
        """Count the model FLOPs of one training step once, with torch's FLOP counter
        (``torch.utils.flop_counter.FlopCounterMode``), for model TFLOPS and MFU: one
        forward pass of ``model`` (a DDP or FSDP wrapper's own module for a DDP model, so
        no collective runs) on ``inputs`` (one batch as the loop gives it) under
        ``torch.no_grad()``, its FLOPs times 3 (the backward pass costs twice the
        forward: the usual model-FLOPs convention, without recomputation). Call it once,
        before or between steps; it costs one forward pass, slowed by the counter
        (:mod:`collectors.flops`), and every later step that does not say its own FLOPs
        (``step(flops=...)``) uses the count. ``dtype`` is the precision the GPU's peak is
        read for (``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"``, ``"fp8"``); by default
        the autocast's, else the model's parameters' when 16-bit, else the hub assumes
        bf16 and says so. Returns the FLOPs per step, or None when they could not be
        counted (a note says why); never raises into the job."""
        from collectors import flops as counting

        try:
            counted = counting.count_step(model, inputs, kwargs, dtype)
        except Exception as exc:
            note = f"count_flops could not count the model's FLOPs: {exc!r}"
            log.warning("rtop: %s", note)
            self.notes.append(note)
            return None
        self.flops_per_step = counted.per_step
        self.figures["flops"] = counted.to_meta()
        return counted.per_step

    def checkpoint(self) -> _PhaseTimer:
        """Context manager around writing a checkpoint: its cost is measured and sent."""
        return _PhaseTimer(self, "checkpoint")

    def watch(self, model: T, optimizer: Any = None) -> T:
        """Watch a model (and optionally its optimizer); returns the model unchanged.

        A ``DistributedDataParallel`` model's allreduce is timed, on CPU, by DDP's own
        timer (see ``collectors.ddptimer``), and on GPU (or with ``comm_timing="hook"``)
        by a comm hook timing each gradient bucket with CUDA events. Once a process
        group is initialised, every other collective of the process is timed too
        (``collectors.collectives``): an FSDP2 (``fully_shard``) or FSDP1
        (``FullyShardedDataParallel``) model's all-gathers and reduce-scatters, and a
        user's own ``dist.all_reduce``, ``broadcast``, ... until :meth:`close`. Any
        model's parameters, gradients and the optimizer's state are counted for the
        memory breakdown; a model on CUDA switches step timing to CUDA events and picks
        the GPU that NVML samples.
        """
        try:
            self._watch(model, optimizer)
        except Exception as exc:  # never break the job because of rtop
            note = f"watch() could not instrument the model: {exc!r}"
            log.warning("rtop: %s", note)
            self.notes.append(note)
        return model

    def _watch(self, model: Any, optimizer: Any) -> None:
        torch = sys.modules.get("torch")
        self.memory.watch(model, optimizer)
        if torch is None or model is None:
            return
        self._answer_device()  # on the training thread: its current CUDA device
        if self.cuda is None and self.memory.device.startswith("cuda"):
            from collectors.cuda_events import torch_cuda_pool

            index = int(self.memory.device.split(":")[1])
            # tied to the model's device: recorded on its stream whatever device is
            # current on the recording thread (the training thread may be on cuda:0)
            self.use_cuda_events(torch_cuda_pool(index))
            self._sender.use_cuda_device(index)
        try:
            note = collectives.install(self)
        except Exception as exc:  # the DDP part below must not depend on it
            note = None
            self.notes.append(f"rtop could not time the process group's collectives: "
                              f"{exc!r}")
        if note is not None and note not in self.notes:
            self.notes.append(note)
        kind = sharded_kind(model)
        if kind is not None:
            said = (f"{kind} model: its all-gathers and reduce-scatters are timed with "
                    "every other collective" if note is not None else
                    f"{kind} model watched before a process group was initialised: its "
                    "collectives are not timed (call probe.watch after init_process_group)")
            if said not in self.notes:  # once, however many of its modules are watched
                self.notes.append(said)
        ddp = torch.nn.parallel.DistributedDataParallel
        if not isinstance(model, ddp):
            return
        import weakref

        self.comm.ddp_ref = weakref.ref(model)
        if getattr(model, "_rtop_probe_box", None) is not None:
            # watched before (by an earlier, closed probe): the same way again
            timed_by_ddp = not hasattr(model, "_rtop_original_register_comm_hook")
        else:
            why_not = ddptimer.unusable_reason(model)
            timed_by_ddp = self.config.comm_timing == "ddp" and why_not is None
        if timed_by_ddp:
            self.notes.append(ddptimer.install(self, model))
        else:
            from collectors.commhook import install

            self.notes.append(install(self, model))

    def use_cuda_events(self, pool: EventPool) -> None:
        """Time steps (and the comm hook's buckets) with ``pool``'s CUDA events from now
        on; the sender resolves them once the GPU has passed them. ``watch`` does this
        for a model on CUDA; tests give a pool of fake events. A failure to record an
        event turns CUDA timing off (one warning, a note), never raises into the job."""
        pool.on_failure = self._cuda_failed
        self.cuda = pool
        if pool.module is not None:  # CUDA graph captures: record and query nothing
            CAPTURES.on_failure = self.fault
            CAPTURES.install(pool.module)
            self._captures_watched = True
        collectives.use_cuda(self)

    # ---- failures on the training thread (collectors.guard) -----------------------

    def fault(self, point: str, error: BaseException | str) -> None:
        """One of ``collectors.guard``'s points failed: turn its feature off (warn once,
        note it for the hub). Never raises."""
        try:
            if not self.faults.failed(point, error):
                return
            if point.startswith(("step.", "iter")):
                self.activity.depth = 0
                self._cuda_start = None
            if point.startswith("step."):
                self._step_timer = _NoStep(self)
            elif point == "iter":
                self._iter_off = True
                self._wait_t0 = self._wait_s = self._samples = None
            elif point == "control.boundary":
                self._control_off = True
                with self._armed_lock:
                    armed, self._armed = self._armed, []
                for a in armed:
                    a.cancel(f"control actions are off on this rank: {error}")
            elif point.startswith(("commhook.", "ddptimer.")) and not self.comm.failed:
                self.comm.fail(point, error if isinstance(error, BaseException)
                               else RuntimeError(error))
            elif point == "cuda.capture" and self.cuda is not None:
                self.cuda.fail(f"watching CUDA graph captures failed: {error}")
            elif point.startswith("collectives.") and not self.comm.direct_failed:
                self.comm.fail_direct(point, error if isinstance(error, BaseException)
                                      else RuntimeError(error))
        except Exception:
            pass

    # ---- the hub's actions (collectors.control) -----------------------------------

    def arm(self, armed: Any) -> None:
        """Arm an action for the training thread's next step boundaries (any thread)."""
        if self._control_off or self._closed:
            raise RuntimeError("control actions are off on this rank" if self._control_off
                               else "the rank is closing")
        with self._armed_lock:
            self._armed = [*self._armed, armed]

    def _boundary(self) -> None:
        """On the training thread at a step boundary: run what is armed (guard point
        ``control.boundary``: a failure turns control actions off, never the job)."""
        try:
            for armed in self._armed:
                if armed.at_boundary(self._step):
                    with self._armed_lock:
                        self._armed = [a for a in self._armed if a is not armed]
        except Exception as exc:
            self.fault("control.boundary", exc)

    def _cuda_failed(self, why: str) -> None:
        """The event pool could not record: steps are timed on the host from now on."""
        self.cuda = None
        self.fault("cuda.record", why)

    def model_device(self) -> int | None:
        """The CUDA device index the watched model lives on (its event pool's, else the
        memory sampler's), or None when no watched model is on a GPU."""
        pool = self.cuda
        if pool is not None and pool.device is not None:
            return int(pool.device)
        device = self.memory.device
        if device.startswith("cuda:"):
            try:
                return int(device.split(":")[1])
            except ValueError:
                return None
        return None

    def _answer_device(self) -> None:
        """On the training thread: note its current CUDA device for the sender."""
        self.device_wanted = False
        if "torch" not in sys.modules:
            return
        from collectors import cuda_events

        try:
            cuda = cuda_events.cuda_module()
            if cuda.is_initialized():
                self.cuda_device = int(cuda.current_device())
        except Exception as exc:
            log.debug("rtop: could not read the current CUDA device: %r", exc)

    # ---- state and shutdown ------------------------------------------------------

    @property
    def sender(self) -> Sender:
        """The probe's sender thread (its counters, its CPU time)."""
        return self._sender

    @property
    def step_count(self) -> int:
        """Steps completed so far."""
        return self._step

    @property
    def closed(self) -> bool:
        """Whether the probe is closed or closing (:meth:`close`, :meth:`last_word`)."""
        return self._closed

    @property
    def iter_off(self) -> bool:
        """Whether :meth:`iter`'s data-wait timing is off (it failed at guard point
        ``iter``): loaders are no longer wrapped."""
        return self._iter_off

    def stats(self) -> dict[str, int]:
        """Counters: records sent, dropped (buffer full, hub unreachable), frames, connects."""
        return {"dropped_buffer": self.dropped_buffer, **self._sender.stats()}

    def last_word(self, error: str | None, timeout: float, *, reason: str = "signal"
                  ) -> None:
        """The process is about to die (a launcher's SIGTERM, :mod:`collectors.lastgasp`;
        ``os._exit``): have the sender flush and say goodbye with ``reason`` and
        ``error`` (None: no error), waiting for it at most ``timeout`` seconds. Nothing
        else is undone: the process ends right after. Safe from any thread; once closed,
        it only waits (as long) for the goodbye that closing sends."""
        sender = self._sender
        if self._closed:  # closing already (the interpreter's exit): give its goodbye time
            if sender.is_alive() and threading.current_thread() is not sender:
                sender.join(timeout)
            return
        self._closed = True
        self.exit_reason, self.exit_error = reason, error
        sender.stop(timeout, wait_s=timeout, sample=False)

    def close(self, timeout: float | None = None, *, reason: str = "closed") -> None:
        """Flush what can be flushed within ``timeout`` seconds (default from the config)
        and stop the sender. Safe to call twice; never hangs. What no hub took by then
        goes to this rank's spool file (:mod:`collectors.spool`, within
        ``spool_timeout_s`` more), for a later hub or ``rtop report``.

        The hub is told why the rank left: ``closed`` (this call, the end of training),
        or ``exit`` (the interpreter exited without it: the script ended or crashed).
        A DDP model timed by DDP's own timer is given back as ``watch`` found it.
        """
        if self._closed:
            return
        self._closed = True
        self.exit_reason = reason
        try:
            self._sender.control.close()
        except Exception as exc:
            log.debug("rtop: aborting the hub's actions failed: %r", exc)
        collectives.release(self)  # torch's own collective methods back, first
        if self.raytrain is not None:
            self.raytrain.release()  # what they wrapped in Ray Train, as it was
        self._sender.stop(self.config.close_timeout_s if timeout is None else timeout)
        ddptimer.release(self)  # the model goes back to DDP's own sampling
        if self._captures_watched:  # once the sender has read its last events
            CAPTURES.release()  # CUDAGraph's own methods back

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
