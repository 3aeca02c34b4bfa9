"""Ranks for the never-raise suite (spawned by torch.multiprocessing): a real DDP job
on gloo, run once per guarded point of ``collectors.guard`` with an exception injected
there, beside the same job unwatched."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from tests.ddp_workers import _model, _setup, _teardown

STEPS = 8
FAULT_AT = 3  # the step (from 0) at which the fault is injected


class FaultyClock:
    """Stands in for the ``time`` module of one collectors module: its ``perf_counter``
    raises once, on the ``skip + 1``-th call after :meth:`arm`."""

    def __init__(self) -> None:
        self.armed = False
        self.countdown = 0
        self.fired = 0

    def arm(self, skip: int = 0) -> None:
        self.armed, self.countdown = True, skip

    def perf_counter(self) -> float:
        if self.armed:
            if self.countdown == 0:
                self.armed = False
                self.fired += 1
                raise RuntimeError("injected fault")
            self.countdown -= 1
        return time.perf_counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class FaultyClockIn(FaultyClock):
    """A ``FaultyClock`` whose ``perf_counter`` raises once armed, only when called from
    the function named ``where`` (a completion callback runs on gloo's own thread, so
    counting calls would race)."""

    def __init__(self) -> None:
        super().__init__()
        self.where = ""

    def arm_in(self, where: str) -> None:
        self.armed, self.countdown, self.where = True, 0, where

    def perf_counter(self) -> float:
        import sys

        if self.armed and sys._getframe(1).f_code.co_name == self.where:
            self.armed = False
            self.fired += 1
            raise RuntimeError("injected fault")
        return time.perf_counter()


#: The function of ``collectors.collectives`` whose clock reading fails, per point.
COLLECTIVE_FAULTS = {"collectives.launch": "_launch", "collectives.done": "on_done",
                     "collectives.wait": "rtop_wait"}


def _own_collectives(rank: int, step: int) -> None:
    """A user's own collectives inside the step: a synchronous allreduce, and an
    asynchronous broadcast waited on."""
    import torch.distributed as dist

    t = torch.full((64,), float(rank + step))
    dist.all_reduce(t)
    work = dist.broadcast(torch.zeros(16), src=0, async_op=True)
    work.wait()


class FaultyLogger:
    """DDP's logger, whose update raises once armed."""

    def __init__(self, real: Any) -> None:
        self.real, self.armed, self.fired = real, False, 0

    def set_runtime_stats_and_log(self) -> None:
        if self.armed:
            self.armed = False
            self.fired += 1
            raise RuntimeError("injected fault")
        self.real.set_runtime_stats_and_log()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class FaultyArmed:
    """A hub's action armed on the training thread whose boundary call raises once (a
    bug in rtop's own dispatch: ``collectors.control.Armed`` catches the action's)."""

    def __init__(self) -> None:
        self.fired = 0
        self.cancelled: str | None = None

    def at_boundary(self, step: int) -> bool:
        self.fired += 1
        raise RuntimeError("injected fault")

    def cancel(self, why: str) -> None:
        self.cancelled = why


class FaultyLock:
    """``collectors.cuda_events.CAPTURES.lock`` whose ``__enter__`` raises once armed (a
    bug in rtop's watch of a CUDA graph's capture)."""

    def __init__(self, real: Any) -> None:
        self.real, self.armed, self.fired = real, False, 0

    def __enter__(self) -> Any:
        if self.armed:
            self.armed = False
            self.fired += 1
            raise RuntimeError("injected fault")
        return self.real.__enter__()

    def __exit__(self, *exc: object) -> Any:
        return self.real.__exit__(*exc)


def _capture(fake: Any) -> bool:
    """The user's CUDA graph capture (what ``torch.cuda.graph`` does, on the fake); True
    when it succeeded."""
    graph = fake.CUDAGraph()
    with fake.stream(fake.Stream(0)):
        graph.capture_begin()
        fake.run(0, 1.0)
        graph.capture_end()
    graph.replay()
    return bool(graph.captured)


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 40, generator=g), torch.randn(16, 7, generator=g))
            for _ in range(STEPS)]


def _unwatched(rank: int) -> list[torch.Tensor]:
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _data(rank):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = [p.detach().clone() for p in model.parameters()]
    del model
    return out


def _scenario(point: str, rank: int) -> dict[str, Any]:
    import collectors
    from collectors import collectives, commhook, ddptimer
    from collectors import probe as probe_module
    from collectors.cuda_events import CAPTURES, torch_cuda_pool
    from collectors.identity import detect
    from tests.fakecuda import FakeCuda

    clocks = {name: FaultyClock() for name in ("probe", "commhook", "ddptimer")}
    direct_clock = FaultyClockIn()
    clocks["collectives"] = direct_clock
    saved = (probe_module.time, commhook.time, ddptimer.time, collectives.time)
    probe_module.time = clocks["probe"]  # type: ignore[assignment]
    commhook.time = clocks["commhook"]  # type: ignore[assignment]
    ddptimer.time = clocks["ddptimer"]  # type: ignore[assignment]
    collectives.time = direct_clock  # type: ignore[assignment]
    try:
        mode = "ddp" if point.startswith("ddptimer.") else "hook"
        model = torch.nn.parallel.DistributedDataParallel(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None, comm_timing=mode),
                                 start_sender=False)
        fake = FakeCuda(devices=1)
        if point in ("cuda.record", "cuda.capture"):
            probe.use_cuda_events(torch_cuda_pool(0, cuda=fake))
        lock = FaultyLock(CAPTURES.lock)
        CAPTURES.lock = lock  # type: ignore[assignment]
        captured = None
        probe.watch(model, opt)
        logger = None
        if point == "ddptimer.read":
            logger = FaultyLogger(probe.comm.ddp_logger)
            probe.comm.ddp_logger = logger
        armed = FaultyArmed()
        done = 0
        for i, (x, y) in enumerate(probe.iter(_data(rank))):
            arm = i == FAULT_AT
            if arm and point == "control.boundary":
                probe.arm(armed)  # runs at this step's exit
            if arm and point == "step.enter":
                clocks["probe"].arm()
            if arm and point == "cuda.record":
                fake.sticky = RuntimeError("CUDA error: an illegal memory access was "
                                           "encountered (injected)")
            with probe.step():
                loss = torch.nn.functional.mse_loss(model(x), y)
                if arm and point == "commhook.launch":
                    clocks["commhook"].arm()
                if arm and point == "commhook.done":
                    clocks["commhook"].arm(skip=2)  # launch, the phase, then completion
                if arm and point == "ddptimer.backward":
                    clocks["ddptimer"].arm()
                if arm and logger is not None:
                    logger.armed = True
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if point in COLLECTIVE_FAULTS:
                    if arm:
                        direct_clock.arm_in(COLLECTIVE_FAULTS[point])
                    _own_collectives(rank, i)
                if arm and point == "cuda.capture":
                    lock.armed = True
                    captured = _capture(fake)
                fake.run(0, 1.0)
                if arm and point == "step.exit":
                    clocks["probe"].arm()
            if arm and point == "iter":
                clocks["probe"].arm()  # the loader wrapper's next clock reading
            done += 1
        fired = sum(c.fired for c in clocks.values()) + (logger.fired if logger else 0) \
            + (fake.sticky is not None) + armed.fired + lock.fired
        params = [p.detach().clone() for p in model.parameters()]
        result = {
            "steps": done, "fired": fired, "records": len(probe.records),
            "off": sorted(probe.faults.off), "notes": list(probe.notes),
            "comm": [r[6] is not None for r in probe.records],
            "cuda": [r[8] is not None for r in probe.records],
            # the user's own collectives timed (before the fault), not (from it on)
            "direct": [bool(r[9]) for r in probe.records],
            "captured": captured,  # the user's CUDA graph capture (point cuda.capture)
        }
        probe.close(0.5)
        del model
        result["graph_restored"] = all(  # CUDAGraph's own methods back after close
            vars(fake.CUDAGraph)[n].__module__ == "tests.fakecuda"
            for n in ("capture_begin", "capture_end", "replay"))
    finally:
        (probe_module.time, commhook.time, ddptimer.time,  # type: ignore[assignment]
         collectives.time) = saved
        CAPTURES.lock = lock.real
    result["same"] = all(torch.equal(a, b) for a, b in
                         zip(params, _unwatched(rank), strict=True))
    return result


def every_point(rank: int, world: int, port: int, out: str) -> None:
    """Each guarded point in turn, as one rank of a ``world``-rank job."""
    from collectors.guard import ENTRY_POINTS

    _setup(rank, world, port)
    results = {point: _scenario(point, rank) for point in ENTRY_POINTS}
    Path(out, f"rank{rank}").write_text(json.dumps(results))
    _teardown()


# ---- the profiler (``rtop profile``): a failure at each stage --------------------------

#: Where a capture fails, and how: the method of ``torch.profiler.profile`` that raises
#: once ("stop": ``stop_trace``, where torch synchronises the GPU: a CUDA error there), or
#: rtop's own summary ("summary").
PROFILE_FAULTS = {"start": "start", "step": "step", "stop": "stop_trace",
                  "export": "export_chrome_trace", "events": "events", "summary": ""}
PROFILE_AT = 2  # the step the capture starts at
PROFILE_STEPS = 3  # steps asked


def _comm_state() -> dict[str, Any]:
    """What the job's communicators look like from Python: its process groups, any
    coalescing left open, and the methods of ProcessGroup and Work."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return {"groups": len(c10d._world.pg_map), "coalescing": len(c10d._world.pg_coalesce_state),
            "methods": [id(v) for k, v in sorted(vars(dist.ProcessGroup).items())
                        if not k.startswith("__")] + [id(vars(dist.Work)["wait"])]}


def _profile_scenario(fault: str, rank: int, out: str) -> dict[str, Any]:
    import torch.autograd.profiler as autograd_profiler
    import torch.distributed as dist
    import torch.profiler

    import collectors
    from collectors import profiler
    from collectors.control import Armed
    from collectors.identity import detect
    from collectors.profiler import ProfileCapture

    before = _comm_state()
    target = PROFILE_FAULTS[fault]
    owner: Any = torch.profiler.profile if target else profiler
    name = target or "summarise"
    own = name in vars(owner)  # else inherited (from torch's _KinetoProfile)
    original = getattr(owner, name)
    fired = {"n": 0}

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if not fired["n"]:
            fired["n"] += 1
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    setattr(owner, name, faulty)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None),
                                 start_sender=False)
        probe.watch(model, opt)
        answers: list[dict[str, Any]] = []
        cap = ProfileCapture(f"{out}/{fault}-{rank}", f"rank{rank}", PROFILE_STEPS, rank,
                             answers.append)
        probe.arm(Armed(probe.sender.control, f"profile-{fault}", "profile", cap,
                        PROFILE_AT, sync=False, wait_s=1.0))
        done = 0
        for x, y in probe.iter(_data(rank)):
            with probe.step():
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            done += 1
        for _ in range(3):  # the step boundaries after the job's last step
            if cap.at_boundary(probe.step_count):
                break
        params = [p.detach().clone() for p in model.parameters()]
        probe.close(0.5)
        enabled = bool(autograd_profiler._is_profiler_enabled) or bool(
            torch._C._autograd._profiler_enabled())
        # the job's communicators still work as the job made them
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        from datetime import timedelta

        dist.monitored_barrier(timeout=timedelta(seconds=30))
        del model
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
    return {"fired": fired["n"], "steps": done, "answers": answers, "enabled": enabled,
            "params": params, "sum": t.tolist(), "comm_same": _comm_state() == before}


def profile_faults(rank: int, world: int, port: int, out: str) -> None:
    """Each profiler fault in turn, as one rank of a ``world``-rank job."""
    _setup(rank, world, port)
    reference = _unwatched(rank)
    results = {}
    for fault in PROFILE_FAULTS:
        r = _profile_scenario(fault, rank, out)
        r["same"] = all(torch.equal(a, b) for a, b in
                        zip(r.pop("params"), reference, strict=True))
        results[fault] = r
    Path(out, f"rank{rank}").write_text(json.dumps(results))
    _teardown()
