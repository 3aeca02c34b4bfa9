"""Memory of the rank's training device: what is used, the peak, the capacity, and the
static part (parameters, gradients, optimizer state) behind the memory wall.

On CUDA the figures are torch's caching-allocator counters for the model's device; on
CPU they are the process's RSS against the machine's memory (or the cgroup's limit,
whichever is smaller), so headroom means something on a laptop too.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import psutil

from collectors.host import cgroup_memory_limit


def _peak_rss_of_this_process() -> int:
    """The process's own RSS high-water mark (``VmHWM``), peaks between samples included.

    Not ``getrusage().ru_maxrss``: Linux keeps that across ``exec``, so a rank spawned by
    a big parent (torch.multiprocessing's spawn, a launcher) would report the parent's
    peak as its own.
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _tensor_bytes(t: Any) -> int:
    """The bytes this rank holds for ``t``: a sharded ``DTensor`` (FSDP2's parameters
    and their optimizer state) counts its local shard, not the global tensor whose
    shape it reports. ``_local_tensor`` is read as an attribute, not through
    ``to_local()``, which would add an autograd node from the sender thread."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        t = local
    return int(t.numel()) * int(t.element_size())


def static_bytes(models: list[Any], optimizers: list[Any]) -> tuple[int, int, int]:
    """``(param_bytes, grad_bytes, optim_bytes)`` of models and optimizers, shared
    tensors counted once.

    Gradients are counted as the bytes of the parameters that require one (a gradient
    has its parameter's shape and dtype) rather than by reading ``p.grad``: this runs
    on the sender thread, and the autograd engine swaps ``.grad`` without the GIL while
    backward runs, so touching it from another thread can crash the process.
    """
    seen: set[int] = set()
    params = grads = optim = 0
    for model in models:
        for p in model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            nbytes = _tensor_bytes(p)
            params += nbytes
            if p.requires_grad:
                grads += nbytes
    torch = sys.modules.get("torch")
    for opt in optimizers:
        for state in list(opt.state.values()):
            for value in list(state.values()):
                if torch is not None and isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    optim += _tensor_bytes(value)
    return params, grads, optim


class MemorySampler:
    """Samples one rank's device memory; ``watch`` adds models/optimizers to account for.

    ``capacity_bytes`` overrides the capacity (``RTOP_MEM_CAPACITY_BYTES``), e.g. to
    rehearse the memory wall of a smaller device.
    """

    STATIC_EVERY = 5  # recount parameters/gradients/optimizer state every N samples

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self._capacity_override = capacity_bytes
        self._models: weakref.WeakSet[Any] = weakref.WeakSet()
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._cuda_index: int | None = None
        #: Bytes NVML counts for this process on its GPU (the sender sets it to the
        #: GPU sampler's reader); None where it cannot tell.
        self.process_bytes: Callable[[], int | None] | None = None
        self._static: tuple[int | None, int | None, int | None] = (None, None, None)
        self._count = 0
        self._peak_rss = 0
        self._proc = psutil.Process()
        limit = cgroup_memory_limit()
        total = int(psutil.virtual_memory().total)
        self._cpu_capacity = min(total, limit) if limit else total

    @property
    def device(self) -> str:
        """``cuda:N`` when a watched model lives on a GPU, else ``cpu``."""
        return f"cuda:{self._cuda_index}" if self._cuda_index is not None else "cpu"

    def watch(self, model: Any = None, optimizer: Any = None) -> None:
        """Account for a model's parameters and gradients and an optimizer's state."""
        if model is not None:
            self._models.add(model)
            try:
                first = next(iter(model.parameters()))
                if first.device.type == "cuda":
                    self._cuda_index = int(first.device.index or 0)
            except (StopIteration, AttributeError):
                pass
        if optimizer is not None:
            self._optimizers.add(optimizer)
        self._count = 0  # recount at the next sample

    def _static_now(self) -> tuple[int | None, int | None, int | None]:
        if self._count % self.STATIC_EVERY == 0:
            models, opts = list(self._models), list(self._optimizers)
            if models or opts:
                try:
                    p, g, o = static_bytes(models, opts)
                    self._static = (p, g, o if opts else None)
                except Exception:  # a model mutating under us: keep the last count
                    pass
        self._count += 1
        return self._static

    def sample(self, t_wall: float) -> list[Any]:
        """One row in the order of ``collectors.schema.MEM_FIELDS``."""
        params, grads, optim = self._static_now()
        process: int | None = None
        if self._cuda_index is not None:
            from collectors import cuda_events

            cuda = cuda_events.cuda_module()
            idx = self._cuda_index
            used: int | None = int(cuda.memory_allocated(idx))
            reserved: int | None = int(cuda.memory_reserved(idx))
            peak: int | None = int(cuda.max_memory_reserved(idx))
            capacity: int | None = int(cuda.get_device_properties(idx).total_memory)
            reader = self.process_bytes
            process = reader() if reader is not None else None
            if process is not None and reserved is not None and peak is not None:
                # Rebase the allocator's peak onto the device: what the process holds
                # outside the allocator (CUDA context, NCCL buffers, cuBLAS workspace)
                # is there at the peak too. The allocator's own peak counter is left
                # alone (resetting it would change what the job itself reads).
                peak += max(0, process - reserved)
        else:
            try:
                used = int(self._proc.memory_info().rss)
            except psutil.Error:
                used = None
            self._peak_rss = max(self._peak_rss, used or 0, _peak_rss_of_this_process())
            reserved, peak, capacity = None, self._peak_rss, self._cpu_capacity
        if self._capacity_override:
            capacity = self._capacity_override
        return [t_wall, self.device, used, reserved, peak, capacity, params, grads, optim,
                process]
