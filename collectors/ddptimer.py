"""Collective timing from DDP's own C++ timer, on CPU (the default; ``RTOP_COMM_TIMING``).

Any Python comm hook, rtop's or torch's own ``allreduce_hook``, changes DDP's gradient
path: DDP then copies each gradient into its bucket unscaled and leaves the averaging
to the hook, which costs one more pass over the gradients every step. On a CPU (gloo)
that pass and the hook's calls cost a few per cent of a step
(``benchmarks/collector_overhead.py`` measures it). DDP already times its backward
pass for its own logging, in C++, with one clock read at each point: when the first
bucket's allreduce is launched, when the last gradient is ready, and when the last
allreduce has finished. Sampled every iteration, these stamps give the step's
collective figures and leave the gradients' path exactly as DDP built it.

The default for CPU models; ``RTOP_COMM_TIMING=hook`` (``ProbeConfig(comm_timing=
"hook")``) keeps the comm hook everywhere, for its per-bucket intervals.

On CUDA the same timer records CUDA events and synchronizes them when read, which
would stall the host every step, so CUDA models keep the comm hook with pooled events
(:mod:`collectors.commhook`), where the extra pass is a microsecond-scale kernel.

What is lost against the hook: DDP's stamps give the span from the first launch to the
last completion, not each bucket's interval, so a pause between buckets counts as
collective time; ``comm_calls`` is the number of buckets DDP reduced.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collectors.handover import CommTiming
    from collectors.probe import Probe

log = logging.getLogger("collectors")

#: DDP's own sampling of its runtime stats (``kDDPRuntimeLoggingSampleRate`` in torch's
#: reducer): what a model gets back when the probe that timed it closes.
DDP_DEFAULT_SAMPLE_RATE = 100

#: What the training thread leaves per step: DDP's stamps (ns on ``time.time_ns``'s
#: clock) and the wall clock at step exit, to put them on ``time.perf_counter``'s.
#: ``(comm_start_ns, compute_end_ns, comm_end_ns, buckets, wall_exit_ns)``; an empty
#: tuple when no synchronized backward ran in the step (``no_sync``).
DdpStamps = tuple[int, ...]


def unusable_reason(model: Any) -> str | None:
    """Why DDP's timer cannot time this model (``None`` when it can)."""
    if not callable(getattr(model, "_set_ddp_runtime_logging_sample_rate", None)):
        return "this torch has no DDP runtime logging"
    if getattr(model, "logger", None) is None:
        return "DDP logging is off for this model"
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return "the model has no parameter that needs a gradient"
    if any(p.is_cuda for p in params):
        return "the model is on CUDA (DDP's timer would synchronize the GPU when read)"
    if bool(getattr(model, "is_multi_device_module", False)):
        return "DDP does not time multi-device modules"
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        return "TORCH_DISTRIBUTED_DEBUG=DETAIL would make DDP log every step"
    return None


def install(probe: Probe, model: Any) -> str:
    """Have DDP time every iteration and point the probe's ``comm`` at its logger;
    return a note."""
    import torch.distributed as dist

    model._set_ddp_runtime_logging_sample_rate(1)
    logger = model.logger
    ints = logger._get_ddp_logging_data().ints_map
    group: Any = getattr(model, "process_group", None) or dist.group.WORLD
    world = int(group.size()) if group is not None else 1
    # The heartbeat's "comm" phase starts when backward has produced the last gradient:
    # one hook, on the parameter whose gradient backward computes last (the first one,
    # in a model whose layers run in the order they are declared).
    box = getattr(model, "_rtop_probe_box", None)
    if box is None:
        box = [probe]
        first = next(p for p in model.parameters() if p.requires_grad)
        clock = time.perf_counter

        def rtop_backward_done(param: Any) -> None:
            p = box[0]
            try:
                act = p.activity
                if act.in_step and not p.comm.failed:
                    act.enter("comm", clock())
            except Exception as exc:  # guard point "ddptimer.backward"
                p.comm.fail("ddptimer.backward", exc)

        register = getattr(first, "register_post_accumulate_grad_hook", None)
        if register is not None:  # torch >= 2.1; without it the phase stays "compute"
            model._rtop_hook_handle = register(rtop_backward_done)
        model._rtop_probe_box = box
    else:
        box[0] = probe
    probe.comm.use_ddp_timer(logger, world, int(ints.get("total_parameter_size_bytes", 0)),
                             weakref.ref(model))
    return (
        f"allreduce timed by DDP's own timer, every step ({world} ranks): from the first "
        "bucket's launch to the last one's completion; no comm hook, the gradients' "
        "path is DDP's own"
    )


def release(probe: Probe) -> None:
    """When the probe closes: leave its model as ``watch`` found it (DDP's own sampling
    rate, no rtop hook on the parameter), unless a newer probe watches it now."""
    ref = probe.comm.ddp_model
    probe.comm.ddp_model = None
    model = ref() if ref is not None else None
    if model is None:
        return
    try:
        box = getattr(model, "_rtop_probe_box", None)
        if box is None or box[0] is not probe:
            return
        model._set_ddp_runtime_logging_sample_rate(DDP_DEFAULT_SAMPLE_RATE)
        handle = getattr(model, "_rtop_hook_handle", None)
        if handle is not None:
            handle.remove()
            del model._rtop_hook_handle
        del model._rtop_probe_box
    except Exception as exc:  # never break the job because of rtop (at exit, torch may be gone)
        log.debug("rtop: could not release the DDP model: %r", exc)


def read(comm: CommTiming) -> DdpStamps | None:
    """On the training thread at step exit: DDP's stamps of the step's backward.

    Costs about 8 us (the logger's own update and one read of its figures).
    ``None`` when they cannot be read, an empty tuple when the step ran no
    synchronized backward.
    """
    logger = comm.ddp_logger
    try:
        logger.set_runtime_stats_and_log()  # what DDP's next forward would do
        ints = logger._get_ddp_logging_data().ints_map
        iteration = ints.get("iteration")
        if iteration is None or iteration == comm.ddp_iteration:
            return ()
        comm.ddp_iteration = iteration
        return (
            int(ints.get("backward_comm_time_start", 0)),
            int(ints.get("backward_compute_time_end", 0)),
            int(ints.get("backward_comm_time_end", 0)),
            int(ints.get("num_buckets_reduced", 0)),
            time.time_ns(),
        )
    except Exception as exc:  # guard point "ddptimer.read": never break the job
        comm.fail("ddptimer.read", exc)
        return None
