"""Worker functions for the comm-hook tests (spawned by torch.multiprocessing)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _setup(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _teardown() -> None:
    """Free the DDP modules (deleted by the caller) before their process group, then
    leave the process group: the reverse order can abort the process at exit
    ("terminate called without an active exception" from a gloo thread)."""
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 300), torch.nn.Tanh(),
        torch.nn.Linear(300, 7),
    )


def _probe(mode: str):
    import collectors
    from collectors.identity import detect

    return collectors.Probe(detect(), collectors.ProbeConfig(hub=None, comm_timing=mode),
                            start_sender=False)


def _row(probe, raw) -> list:
    """The step record the sender would make of a raw step (CPU: no CUDA events)."""
    from collectors.steps import ClockMap, step_row

    return step_row(raw, None, ClockMap(), world=probe.comm.world, nbytes=probe.comm.nbytes)


def _counting_hook():
    """A user's comm hook (torch's allreduce_hook) that counts its calls."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = {"n": 0}

    def counting_hook(state, bucket):
        calls["n"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    return calls, counting_hook


def _grads(model: torch.nn.Module, x: torch.Tensor, to_none: bool = True) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=to_none)
    model(x).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def compare_grads(rank: int, world: int, port: int, out: str) -> None:
    """Hooked vs un-hooked DDP on identical inputs: gradients must be bit-identical."""
    _compare_grads(rank, world, port, out, as_view=False)


def compare_grads_bucket_view(rank: int, world: int, port: int, out: str) -> None:
    """The same with ``gradient_as_bucket_view=True`` (DDP divides in place there)."""
    _compare_grads(rank, world, port, out, as_view=True)


def _compare_grads(rank: int, world: int, port: int, out: str, as_view: bool) -> None:
    _setup(rank, world, port)
    probe = _probe("hook")
    kw = {"bucket_cap_mb": 0.1, "gradient_as_bucket_view": as_view}  # several buckets
    plain = torch.nn.parallel.DistributedDataParallel(_model(), **kw)
    hooked = probe.watch(torch.nn.parallel.DistributedDataParallel(_model(), **kw))
    results = []
    for step in range(6):
        x = torch.randn(16, 40, generator=torch.Generator().manual_seed(rank * 100 + step))
        # with bucket views, alternate zeroing in place and setting grads to None:
        # DDP divides in place in the first case and multiplies while copying in the other
        to_none = step % 3 == 2 if as_view else True
        with probe.step():
            g_hooked = _grads(hooked, x, to_none=to_none)
        g_plain = _grads(plain, x, to_none=to_none)
        results.append(all(torch.equal(a, b) for a, b in zip(g_plain, g_hooked, strict=True)))
    rows = []
    while probe.records:
        rows.append(probe.records.popleft())
    calls = [len(r[6]) for r in rows]
    probe.close(0.1)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{int(all(results))} {max(calls)} {probe.notes[-1]!r}")
    del plain, hooked
    _teardown()


def user_hook_after_watch(rank: int, world: int, port: int, out: str) -> None:
    """A comm hook the user registers after watch keeps working and is timed."""
    _setup(rank, world, port)
    probe = _probe("hook")
    calls, counting_hook = _counting_hook()

    model = probe.watch(torch.nn.parallel.DistributedDataParallel(_model()))
    model.register_comm_hook(dist.group.WORLD, counting_hook)
    plain = torch.nn.parallel.DistributedDataParallel(_model())
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(rank))
    with probe.step():
        g = _grads(model, x)
    same = all(torch.equal(a, b) for a, b in zip(_grads(plain, x), g, strict=True))
    raw = probe.records.popleft()
    timed = len(raw[6]) > 0 and all(b[1] is not None for b in raw[6])
    probe.close(0.1)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{calls['n']} {int(timed)} {int(same)}")
    del model, plain
    _teardown()


def user_hook_before_watch(rank: int, world: int, port: int, out: str) -> None:
    """A hook registered before watch stays in charge; rtop says comm is unmeasured."""
    _setup(rank, world, port)
    probe = _probe("hook")
    calls, counting_hook = _counting_hook()

    model = torch.nn.parallel.DistributedDataParallel(_model())
    model.register_comm_hook(dist.group.WORLD, counting_hook)
    model = probe.watch(model)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(rank))
    with probe.step():
        _grads(model, x)
    raw = probe.records.popleft()
    probe.close(0.1)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{calls['n']} {int(raw[6] is None)} {probe.notes[-1]!r}")
    del model
    _teardown()


def ddp_timer_figures(rank: int, world: int, port: int, out: str) -> None:
    """With comm_timing="ddp", rtop reads DDP's own timer: no comm hook, figures per step,
    no_sync honoured."""
    import json

    _setup(rank, world, port)
    probe = _probe("ddp")
    kw = {"bucket_cap_mb": 0.1}
    plain = torch.nn.parallel.DistributedDataParallel(_model(), **kw)
    timed = probe.watch(torch.nn.parallel.DistributedDataParallel(_model(), **kw))
    same, rows = [], []
    for step in range(8):
        x = torch.randn(16, 40, generator=torch.Generator().manual_seed(rank * 100 + step))
        if step == 5:  # gradient accumulation: no allreduce in this step
            with probe.step(), timed.no_sync():
                _grads(timed, x)
            _grads(plain, x)  # keeps the two models' steps paired; not compared
            continue
        with probe.step():
            g = _grads(timed, x)
        same.append(all(torch.equal(a, b) for a, b in zip(_grads(plain, x), g, strict=True)))
    while probe.records:
        rows.append(_row(probe, probe.records.popleft()))
    grad_bytes = sum(q.numel() * q.element_size() for q in timed.parameters())
    first = next(timed.parameters())
    hooked = len(first._post_accumulate_grad_hooks or {})
    probe.close(0.1)
    # closed, the probe leaves the model as it found it; a new probe can watch it again
    released = not hasattr(timed, "_rtop_probe_box") and \
        not (first._post_accumulate_grad_hooks or {})
    again = _probe("ddp")
    again.watch(timed)
    with again.step():
        _grads(timed, torch.randn(16, 40, generator=torch.Generator().manual_seed(9)))
    rewatched = _row(again, again.records.popleft())
    again.close(0.1)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        json.dump({"same": all(same), "hooks": len(timed._comm_hooks), "note": probe.notes[-1],
                   "grad_bytes": grad_bytes, "rows": rows, "phase_hooks": hooked,
                   "released": released, "rewatched": rewatched}, f)
    del plain, timed
    _teardown()


def ddp_timer_with_user_hook(rank: int, world: int, port: int, out: str) -> None:
    """A user's comm hook registered before watch stays in charge and is timed anyway."""
    import json

    _setup(rank, world, port)
    probe = _probe("ddp")
    calls, counting_hook = _counting_hook()

    model = torch.nn.parallel.DistributedDataParallel(_model())
    model.register_comm_hook(dist.group.WORLD, counting_hook)
    model = probe.watch(model)
    for step in range(3):
        with probe.step():
            _grads(model, torch.randn(8, 40, generator=torch.Generator().manual_seed(step)))
    rows = [_row(probe, probe.records.popleft()) for _ in range(3)]
    probe.close(0.1)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        json.dump({"calls": calls["n"], "rows": rows}, f)
    del model
    _teardown()
