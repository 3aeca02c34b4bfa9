"""A DDP communication hook that times every gradient bucket's allreduce.

The hook wraps DDP's default ``allreduce_hook`` (or the user's own hook, registered
later through the model's ``register_comm_hook``) and does nothing to the gradients:
it notes the bucket's size and launch time and chains a callback on the returned
future that notes the completion time. Gradients stay bit-identical to an un-hooked
DDP model (the averaging replicates DDP's built-in reducer path operation for
operation; ``tests/test_commhook.py`` checks it with 2 and 3 ranks).

On CPU (gloo) the times are ``time.perf_counter`` readings; on CUDA they are pooled
CUDA events recorded on the current stream, resolved later by the sender thread. A
bucket on a GPU with no event pool (CUDA timing off after a CUDA error) is not
measured: NCCL's future completes at enqueue, so the host's clock would read ~0 (its
entry's launch is None, and the step's collective figures are None, never ~0); nor is
one launched while a CUDA graph is captured (nothing is recorded then, see
``collectors.cuda_events``).
"""

from __future__ import annotations

import logging
import time
import types
from typing import TYPE_CHECKING, Any

from collectors.collectives import on_device
from collectors.cuda_events import CAPTURES

if TYPE_CHECKING:
    from collectors.probe import Probe

log = logging.getLogger("collectors")

#: A bucket entry is ``[launch, done, nbytes]``; the step keeps at most this many.
MAX_BUCKETS_PER_STEP = 4096


def _mean_allreduce_like_ddp(model: Any) -> Any:
    """DDP's built-in averaging allreduce, operation for operation.

    Without a hook, DDP's reducer multiplies each gradient by ``1/world`` while copying
    it into the bucket, and divides in place (``div_``) where the gradient already *is*
    the bucket view (``gradient_as_bucket_view=True`` once gradients exist). ``x * (1/3)``
    and ``x / 3`` differ in the last bit, so, to keep gradients bit-identical, this
    does the same rather than ``allreduce_hook``'s unconditional ``div_``.

    Which of the two applies is decided before the reducer runs, so with
    ``gradient_as_bucket_view=True`` one gradient pre-hook on the parameter whose
    gradient comes first in backward (the last one) notes whether gradients were
    already allocated (zeroed in place) or set to None since the last step.
    """
    import weakref

    import torch.distributed as dist

    state = {"alias": False}
    if bool(getattr(model, "gradient_as_bucket_view", False)):
        params = [p for p in model.parameters() if p.requires_grad]
        if params:
            ref = weakref.ref(params[-1])

            def note_grad_state(grad: Any) -> None:
                param = ref()
                state["alias"] = param is not None and param.grad is not None

            params[-1].register_hook(note_grad_state)

    opts = dist.AllreduceOptions()  # SUM

    def allreduce_mean(process_group: Any, bucket: Any, on_done: Any = None) -> Any:
        group: Any = process_group if process_group is not None else dist.group.WORLD
        buf = bucket.buffer()
        if state["alias"]:
            buf.div_(group.size())
        else:
            buf.mul_(1.0 / group.size())
        if buf.is_complex():
            work = dist.all_reduce(buf, group=group, async_op=True)
        else:  # what dist.all_reduce ends in, without its ~10 us of Python checks
            work = group.allreduce([buf], opts)
        if on_done is None:
            return work.get_future().then(lambda fut: fut.value()[0])

        def finish(fut: Any) -> Any:
            on_done()
            return fut.value()[0]

        return work.get_future().then(finish)

    return allreduce_mean


def install(probe: Probe, model: Any) -> str:
    """Install the timing hook on a DDP model; return a note saying what is measured.

    If the model already has a comm hook, DDP allows no second one: rtop then leaves
    the user's hook alone and reports collective timing as unmeasured. A hook the
    user registers *after* ``probe.watch`` is wrapped, so it keeps working and is timed.
    """
    import torch
    import torch.distributed as dist

    box = getattr(model, "_rtop_probe_box", None)
    if box is not None:  # watched before (by an earlier, closed probe): report here now
        probe.comm.use_hook(box[1])
        box[0] = probe
        return "allreduce timed by rtop's comm hook, installed earlier on this model"
    existing = list(getattr(model, "_comm_hooks", []) or [])
    if existing:
        name = getattr(existing[-1][0], "__qualname__", repr(existing[-1][0]))
        note = (
            f"model already has the DDP comm hook {name!r}; DDP allows only one, so rtop "
            "cannot time the allreduce (comm_s is reported as not measured). Call "
            "probe.watch(model) before model.register_comm_hook(...) to have it timed."
        )
        log.warning("rtop: %s", note)
        return note

    process_group: Any = getattr(model, "process_group", None) or dist.group.WORLD
    world = int(process_group.size()) if process_group is not None else 1
    default_hook = _mean_allreduce_like_ddp(model)
    inner: dict[str, Any] = {"hook": default_hook, "state": process_group}
    clock = time.perf_counter
    box = [probe, world]  # the probe the hook reports to; a later watch() re-points it

    def rtop_timed_allreduce(state: object, bucket: Any) -> Any:
        p = box[0]
        comm = p.comm
        hook = inner["hook"]
        if comm.failed:  # timing off: only the allreduce it wraps
            comm.buckets = None
            return hook(inner["state"], bucket)
        try:  # guard point "commhook.launch": rtop's part only, never the allreduce
            cuda = p.cuda
            buf = bucket.buffer()
            if cuda is not None:
                launch: Any = cuda.record()  # None while a CUDA graph is captured
                if CAPTURES.busy():
                    CAPTURES.note_comm()
            elif on_device(buf, process_group):
                launch = None  # NCCL's future completes at enqueue: not measured
            else:
                launch = clock()
            entry: list[Any] = [launch, None, buf.nbytes]
            steps = comm.buckets
            if steps is not None and len(steps) < MAX_BUCKETS_PER_STEP:
                steps.append(entry)
            if bucket.is_last():
                p.activity.enter("comm", clock())
        except Exception as exc:
            comm.fail("commhook.launch", exc)
            return hook(inner["state"], bucket)

        def mark_done() -> None:
            try:  # guard point "commhook.done"
                if entry[0] is not None:
                    entry[1] = cuda.record() if cuda is not None else clock()
            except Exception as exc:
                comm.fail("commhook.done", exc)

        if hook is default_hook:  # time inside the default hook's own callback
            return default_hook(inner["state"], bucket, mark_done)

        def done(f: Any) -> Any:
            mark_done()
            return f.value()

        return hook(inner["state"], bucket).then(done)

    # DDP compares annotations with the real classes; this module's are strings.
    rtop_timed_allreduce.__annotations__ = {
        "state": object,
        "bucket": getattr(dist, "GradBucket"),  # noqa: B009 - not re-exported for mypy
        "return": torch.futures.Future[torch.Tensor],
    }
    model.register_comm_hook(None, rtop_timed_allreduce)
    probe.comm.use_hook(world)
    original_register = model.register_comm_hook

    def register_comm_hook(self: Any, state: object, hook: Any) -> None:
        """Wrapped by rtop: your hook runs inside rtop's timing hook, unchanged."""
        self._check_comm_hook(hook)
        inner["hook"], inner["state"] = hook, state
        self._comm_hooks.append((hook, state))
        if getattr(self, "logger", None) is not None:
            self.logger._set_comm_hook_name(f"{hook.__qualname__} (timed by rtop)")

    model.register_comm_hook = types.MethodType(register_comm_hook, model)
    model._rtop_original_register_comm_hook = original_register
    model._rtop_probe_box = box
    return (
        f"allreduce timed per bucket by a DDP comm hook around DDP's default allreduce "
        f"({world} ranks); a comm hook registered later is wrapped and timed, its "
        "comm_bytes counting the bucket before any compression the hook applies"
    )
