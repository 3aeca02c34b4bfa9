"""What the sender samples on its own period, each behind one small interface.

A :class:`Sampler` returns records, ``(table, row)`` pairs with rows in the order of
``collectors.schema.TABLES[table]``, and is closed once when the sender stops. The
sender calls each in turn about once a second, on its own thread; a sampler that
raises is logged once and skipped that time, and never stops the thread.

* :class:`HeartbeatSampler`: the training thread's phase, and its Python stack when a
  phase has lasted too long (a hang, a slow checkpoint).
* :class:`TableSampler`: one row of one table from a function (device memory).
* :class:`LazyHostSampler`: process, loader workers and machine (psutil), made on first use.
* :class:`GpuSampler`: NVML counters of the rank's GPU, made once the rank is known to
  use one.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from collectors.handover import Activity
from collectors.logonce import LogOnce

if TYPE_CHECKING:
    from collectors.host import HostSampler
    from collectors.nvml import NvmlSampler

#: A record: the table it belongs to and its row.
Record = tuple[str, list[Any]]

MAX_STACK_CHARS = 16_000
#: The GPU must have sat in one collective this long before the heartbeat says "comm"
#: (every healthy step spends a few milliseconds there).
GPU_COMM_AFTER_S = 1.0
STACK_REPEAT_S = 5.0


class Sampler(Protocol):
    """Something the sender samples on its period (see the module doc)."""

    #: A short name for logs (``"hb"``, ``"gpu"``, ...).
    name: str

    def sample(self, t_wall: float) -> list[Record]:
        """The records of one sample taken now (``t_wall``: wall-clock time); may be empty."""

    def close(self) -> None:
        """Release what the sampler holds; called once, on the sender thread."""


class HeartbeatSampler:
    """The training thread's phase and how long it has lasted (table ``hb``).

    A phase longer than ``stack_after_s`` also sends the training thread's stack, at
    most once every ``STACK_REPEAT_S`` seconds.
    """

    name = "hb"

    def __init__(self, activity: Activity, steps_done: Callable[[], int],
                 stack_after_s: float,
                 gpu_collective: Callable[[], float | None] | None = None) -> None:
        self._activity = activity
        self._steps_done = steps_done
        self._stack_after_s = stack_after_s
        self._gpu_collective = gpu_collective
        self._last_stack_t = -1e9

    def sample(self, t_wall: float) -> list[Record]:
        """One heartbeat row: ``[t_wall, phase, phase_s, step, stack]``.

        On a GPU the phase is "comm" once the GPU has sat in one collective for
        ``GPU_COMM_AFTER_S`` (``gpu_collective``: since when, on the ``perf_counter``
        clock), whatever the host does meanwhile: a hung allreduce shows as one, not as
        "compute" or "idle"."""
        act = self._activity
        phase, since = act.phase, act.since
        now_pc = time.perf_counter()
        if self._gpu_collective is not None:
            in_collective = self._gpu_collective()
            if in_collective is not None and now_pc - in_collective >= GPU_COMM_AFTER_S:
                phase, since = "comm", in_collective
        phase_s = max(0.0, now_pc - since)
        stack = None
        now = time.monotonic()
        if (
            phase_s >= self._stack_after_s
            and act.thread_id is not None
            and now - self._last_stack_t >= STACK_REPEAT_S
        ):
            frame = sys._current_frames().get(act.thread_id)
            if frame is not None:
                stack = "".join(traceback.format_stack(frame, limit=60))[-MAX_STACK_CHARS:]
                self._last_stack_t = now
        return [("hb", [t_wall, phase, phase_s, self._steps_done() - 1, stack])]

    def close(self) -> None:
        """Nothing to release."""


class TableSampler:
    """One row of ``table`` per sample from ``row(t_wall)`` (None: no row this time)."""

    def __init__(self, table: str, row: Callable[[float], list[Any] | None]) -> None:
        self.name = table
        self._table = table
        self._row = row

    def sample(self, t_wall: float) -> list[Record]:
        """The function's row, if any."""
        row = self._row(t_wall)
        return [] if row is None else [(self._table, row)]

    def close(self) -> None:
        """Nothing to release."""


class LazyHostSampler:
    """Host figures (table ``host``) from :class:`collectors.host.HostSampler`, made on
    the first sample; if it cannot be made, that is logged once and tried again later."""

    name = "host"

    def __init__(self) -> None:
        self._host: HostSampler | None = None
        self._once = LogOnce()

    def sample(self, t_wall: float) -> list[Record]:
        """One host row, once the host sampler exists."""
        if self._host is None:
            try:
                from collectors.host import HostSampler

                self._host = HostSampler()
            except Exception as exc:
                self._once("host-init", logging.WARNING, "rtop: no host sampling: %r", exc)
                return []
        return [("host", self._host.sample(t_wall))]

    def close(self) -> None:
        """Nothing to release."""


class GpuSampler:
    """NVML counters of the rank's GPU (table ``gpu``).

    The NVML sampler is made once the rank is known to use a GPU: the probe saw a
    model on ``cuda:N`` (:meth:`use_cuda_device`, exact), or ``torch.cuda`` has been
    initialised (then the GPU is found from the local rank). ``nvml`` replaces the
    ``pynvml`` module (tests). :attr:`generation` grows each time a new NVML sampler is
    made, so the sender knows to send the device's facts again.
    """

    name = "gpu"

    def __init__(self, local_rank: int, nvml: Any = None,
                 training_device: Callable[[], int | None] | None = None) -> None:
        self._local_rank = local_rank
        self._module = nvml
        self._training_device = training_device
        self._args: dict[str, Any] | None = None
        self._nvml: NvmlSampler | None = None
        self._made_with: dict[str, Any] | None = None
        self.generation = 0

    def use_cuda_device(self, index: int) -> None:
        """The training device is ``cuda:index``: sample that GPU (any thread may call).

        It is found in NVML by the device's UUID (exact whatever the ordering and
        ``CUDA_VISIBLE_DEVICES``), else its PCI bus id."""
        args: dict[str, Any] = {"cuda_index": index, "local_rank": self._local_rank}
        try:
            from collectors import cuda_events

            props = cuda_events.cuda_module().get_device_properties(index)
            uuid = getattr(props, "uuid", None)
            if uuid is not None:
                args["uuid"] = str(uuid)
            bus = getattr(props, "pci_bus_id", None)
            if bus is not None:
                domain = getattr(props, "pci_domain_id", 0)
                device = getattr(props, "pci_device_id", 0)
                args["pci_bus_id"] = f"{domain:08x}:{bus:02x}:{device:02x}.0"
        except Exception:
            pass
        self._args = args

    def _sampler(self) -> NvmlSampler | None:
        """The NVML sampler for the rank's GPU; made once the rank is known to use one.

        Without a watched CUDA model, the GPU is the training thread's current CUDA
        device (``training_device``, once ``torch.cuda`` is initialised), mapped to NVML
        through its UUID: never a guess from the local rank, which is wrong under
        per-task binding (``CUDA_VISIBLE_DEVICES=3``, ``LOCAL_RANK=3``)."""
        args = self._args
        if args is None and "torch" in sys.modules and self._training_device is not None:
            from collectors import cuda_events

            try:
                if cuda_events.cuda_module().is_initialized():
                    index = self._training_device()
                    if index is not None:
                        self.use_cuda_device(index)
                        args = self._args
            except Exception:
                args = None
        if args is None:
            return None
        if self._nvml is None or self._made_with is not args:
            from collectors.nvml import NvmlSampler

            if self._nvml is not None:
                self._nvml.close()
            self._nvml = NvmlSampler(nvml=self._module, **args)
            self._made_with = args
            self.generation += 1
        return self._nvml if self._nvml.available else None

    def process_memory(self) -> int | None:
        """Bytes NVML counts for this process on the rank's GPU (allocator, CUDA
        context, NCCL buffers); None when unknown."""
        nvml = self._nvml
        if nvml is None or not nvml.available:
            return None
        reader = getattr(nvml, "process_memory", None)
        return reader() if reader is not None else None

    def sample(self, t_wall: float) -> list[Record]:
        """One GPU row while NVML can read the rank's GPU, else nothing."""
        nvml = self._sampler()
        row = nvml.sample(t_wall) if nvml is not None else None
        return [] if row is None else [("gpu", row)]

    def reason(self) -> str | None:
        """Why the rank's GPU is not measured, once a sampler was made and could not
        read it (no driver, a MIG instance not found, ...); else None."""
        nvml = self._nvml
        if nvml is None or nvml.available:
            return None
        return nvml.reason or None

    def info(self) -> dict[str, Any] | None:
        """The GPU's static facts, once an available NVML sampler has been made."""
        nvml = self._nvml
        return nvml.info() if nvml is not None and nvml.available else None

    def close(self) -> None:
        """Shut NVML down if it was started."""
        if self._nvml is not None:
            self._nvml.close()
