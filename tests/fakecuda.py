"""A fake of ``torch.cuda`` as far as rtop uses it, for a machine without CUDA.

It behaves like the real runtime where rtop's GPU path has gone wrong before
(``c10/cuda/CUDAEvent.h``, ``torch/cuda/streams.py``, CUDA's runtime):

* the current device is per thread, and a new thread starts on device 0;
* a CUDA context opens on a device at the first runtime call that needs one there:
  ``set_device(d)``, recording an event on a stream of ``d`` (``CUDAGuard`` on the
  event's device), and ``cudaEventQuery`` / ``cudaEventElapsedTime`` on the calling
  thread's *current* device (``CUDAEvent::query`` sets no device);
* an event belongs to the device of the stream it is first recorded on; recording it
  on another device's stream raises ``RuntimeError("Event device 0 does not match
  recording stream's device 1.")``;
* ``Event.record()`` without a stream records on ``current_stream()``, the current
  device's;
* an event never recorded reads as complete; a sticky CUDA error (:attr:`sticky`)
  makes every later call raise, as after a device-side assert.

GPU time is simulated: each device has a clock of issued work (ms), advanced by
:meth:`FakeCuda.run`; the device executes it at once unless :attr:`paused`.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any


class FakeStream:
    """A device's current stream."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.device_index = device


class FakeCuda:
    """The fake runtime; pass it where ``torch.cuda`` is expected (see module doc)."""

    def __init__(self, devices: int = 2, total_memory: int = 80 * 2**30) -> None:
        self.devices = devices
        self._tls = threading.local()
        self._lock = threading.Lock()
        #: (device, thread name, what opened it): every CUDA context opened.
        self.contexts: list[tuple[int, str, str]] = []
        self.issued = [0.0] * devices  # ms of work enqueued per device
        self.done = [0.0] * devices  # ms of work executed per device
        self.paused = False
        #: A sticky CUDA error: every later call raises it.
        self.sticky: RuntimeError | None = None
        self.initialized = True
        self.allocated = [0] * devices
        self.reserved = [0] * devices
        self.peak_reserved = [0] * devices
        self.total_memory = total_memory
        #: bytes other processes hold on each device (``mem_get_info`` counts them used)
        self.others_use = [0] * devices
        self.uuids = [f"0000000{i}-1111-2222-3333-44444444444{i}" for i in range(devices)]
        self.Event = self._event_class()

    # ---- what rtop calls -------------------------------------------------------------

    def current_device(self) -> int:
        return int(getattr(self._tls, "device", 0))

    def set_device(self, device: int) -> None:
        self._check()
        self._tls.device = device
        self._context(device, "set_device")

    def current_stream(self, device: int | None = None) -> FakeStream:
        return FakeStream(self.current_device() if device is None else device)

    def is_initialized(self) -> bool:
        return self.initialized

    def memory_allocated(self, device: int) -> int:
        return self.allocated[device]

    def memory_reserved(self, device: int) -> int:
        return self.reserved[device]

    def max_memory_reserved(self, device: int) -> int:
        return self.peak_reserved[device]

    def mem_get_info(self, device: int) -> tuple[int, int]:
        """``(free, total)`` bytes of the device, as ``cudaMemGetInfo`` says: memory that
        any context holds is not free, and that includes what torch's caching allocator
        of this process has reserved from the device but not handed out (torch reuses
        that first); :attr:`others_use` is what other processes hold."""
        self._check()
        self._context(device, "mem_get_info")
        used = self.reserved[device] + self.others_use[device]
        return max(0, self.total_memory - used), self.total_memory

    def get_device_properties(self, device: int) -> Any:
        return SimpleNamespace(total_memory=self.total_memory, uuid=self.uuids[device],
                               pci_bus_id=0x10 + device, pci_domain_id=0, pci_device_id=0)

    # ---- what a test drives ----------------------------------------------------------

    def run(self, device: int, ms: float) -> None:
        """Enqueue ``ms`` of GPU work on ``device``; it executes at once unless paused."""
        self.issued[device] += ms
        if not self.paused:
            self.done[device] = self.issued[device]

    def finish(self) -> None:
        """The GPU catches up with everything enqueued."""
        self.paused = False
        self.done = list(self.issued)

    def as_autograd_thread(self, device: int) -> None:
        """Make the calling thread current on ``device`` without opening a context there
        (autograd's device thread for a device whose context exists)."""
        self._tls.device = device

    def context_devices(self) -> set[int]:
        with self._lock:
            return {d for d, _, _ in self.contexts}

    # ---- internals -------------------------------------------------------------------

    def _check(self) -> None:
        if self.sticky is not None:
            raise self.sticky

    def _context(self, device: int, why: str) -> None:
        with self._lock:
            if device not in {d for d, _, _ in self.contexts}:
                self.contexts.append((device, threading.current_thread().name, why))

    def _event_class(self) -> type:
        runtime = self

        class Event:
            """``torch.cuda.Event`` (timing only)."""

            def __init__(self, enable_timing: bool = False) -> None:
                self.enable_timing = enable_timing
                self.device: int | None = None
                self.t: float | None = None

            def record(self, stream: FakeStream | None = None) -> None:
                if stream is None:
                    stream = runtime.current_stream()
                runtime._check()
                if self.device is None:
                    self.device = stream.device
                if self.device != stream.device:
                    raise RuntimeError(
                        f"Event device {self.device} does not match recording stream's "
                        f"device {stream.device}.")
                runtime._context(self.device, "event record")
                self.t = runtime.issued[self.device]

            def query(self) -> bool:
                if self.t is None:
                    return True
                runtime._context(runtime.current_device(), "event query")
                runtime._check()
                assert self.device is not None
                return runtime.done[self.device] >= self.t

            def elapsed_time(self, end: Event) -> float:
                runtime._context(runtime.current_device(), "elapsed_time")
                runtime._check()
                assert self.t is not None and end.t is not None
                assert self.query() and end.query(), "elapsed_time on an incomplete event"
                return end.t - self.t

            def synchronize(self) -> None:
                raise AssertionError("rtop must never synchronize")

        return Event
