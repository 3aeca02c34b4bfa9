"""A small, real data-parallel training job with injectable faults.

Used by ``rtop demo``, the benchmarks and the tests: a real model trained with real
DDP over gloo on synthetic data, run either as local processes
(``torch.multiprocessing``) or as a Ray Train ``TorchTrainer`` job. Faults are real
too: a loader that sleeps, extra matrix multiplications, a rank that stops, memory
that grows, a checkpoint that takes seconds.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Faults:
    """Faults to inject, keyed by rank. All start at ``start_step`` or, with
    ``start_file`` set, at the first step from ``start_step`` on at which that file
    exists (so a test can start them at a moment of its choosing, whatever the pace)."""

    loader_sleep_s: dict[int, float] = field(default_factory=dict)
    all_loader_sleep_s: float = 0.0
    extra_compute_s: dict[int, float] = field(default_factory=dict)
    hang_at_step: dict[int, int] = field(default_factory=dict)
    die_at_step: dict[int, int] = field(default_factory=dict)
    mem_grow_bytes_per_step: dict[int, int] = field(default_factory=dict)
    mem_grow_max_bytes: int = 0  # stop growing past this much (0: never stop)
    checkpoint_every: int = 0
    checkpoint_s: float = 0.0
    start_step: int = 0
    start_file: str | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """What to train, for how long, with or without rtop."""

    world_size: int = 2
    steps: int = 50
    duration_s: float | None = None  # if set, run until this much time has passed
    batch: int = 64
    dim: int = 256
    hidden: int = 512
    layers: int = 3
    instrument: bool = True
    profile: bool = False  # torch.profiler on for every step (for comparison)
    hub: str | None = None
    token: str | None = None
    threads: int = 1
    seed: int = 0
    #: "synthetic" (pre-made batches), "torch" (a torch DataLoader over a TensorDataset)
    #: or "ray_data" (the Ray Train dataset shard "train", via iter_torch_batches)
    loader: str = "synthetic"
    loader_workers: int = 0
    faults: Faults = field(default_factory=Faults)
    probe_settings: dict[str, Any] = field(default_factory=dict)
    #: where each rank writes ``fault-rank<r>`` (its wall time) when its fault starts
    fault_mark_dir: str | None = None
    #: a file whose appearance ends the run, as ``duration_s`` does: every rank leaves
    #: the loop at the same step (checked every 20 steps) and closes its probe
    stop_file: str | None = None

    def to_json(self) -> str:
        """The spec as JSON (to hand to Ray Train's config)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkloadSpec:
        """The inverse of :meth:`to_json`."""
        data = json.loads(text)
        faults = data.pop("faults")
        for key in ("loader_sleep_s", "extra_compute_s", "hang_at_step", "die_at_step",
                    "mem_grow_bytes_per_step"):
            faults[key] = {int(k): v for k, v in faults[key].items()}
        return cls(faults=Faults(**faults), **data)


class SyntheticLoader:
    """Pre-made batches served in a loop; optionally sleeping per batch like slow I/O,
    for the batches at which ``sleeping(index)`` is true (all of them by default)."""

    def __init__(self, batches: list[Any], n: int, sleep_s: float = 0.0,
                 sleeping: Callable[[int], bool] | None = None) -> None:
        self._batches = batches
        self._n = n
        self.sleep_s = sleep_s
        self._sleeping = sleeping

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._n):
            if self.sleep_s and (self._sleeping is None or self._sleeping(i)):
                time.sleep(self.sleep_s)
            yield self._batches[i % len(self._batches)]


class _FaultStart:
    """Whether a rank's faults are on at a step: from ``start_step`` on, and once
    ``start_file`` has appeared if it is set (checked each step until it has; then
    latched, so the faults never switch off)."""

    def __init__(self, faults: Faults) -> None:
        self._from = faults.start_step
        self._file = faults.start_file
        self.began_at: int | None = None  # the step the faults began at

    def __call__(self, step: int) -> bool:
        if self.began_at is not None:
            return step >= self.began_at
        if step < self._from or (self._file and not os.path.exists(self._file)):
            return False
        self.began_at = step
        return True


def _write_mark(path: Path, stamp: float) -> None:
    """Write ``stamp`` to ``path`` atomically, so a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(repr(stamp))
    os.replace(tmp, path)


def build_model(spec: WorkloadSpec) -> Any:
    """An MLP of ``layers`` hidden layers."""
    import torch

    torch.manual_seed(spec.seed)
    mods: list[Any] = [torch.nn.Linear(spec.dim, spec.hidden), torch.nn.ReLU()]
    for _ in range(spec.layers - 1):
        mods += [torch.nn.Linear(spec.hidden, spec.hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(spec.hidden, 1))
    return torch.nn.Sequential(*mods)


def _burn(seconds: float, a: Any) -> None:
    """Real compute (matrix products) for about ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = (a @ a).tanh()


def train_loop(rank: int, spec: WorkloadSpec, model: Any, probe: Any) -> list[float]:
    """Train ``model`` (already DDP-wrapped) and return each iteration's wall time."""
    import torch

    faults = spec.faults
    gen = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    batches = [
        (torch.randn(spec.batch, spec.dim, generator=gen),
         torch.randn(spec.batch, 1, generator=gen))
        for _ in range(8)
    ]
    n = spec.steps if spec.duration_s is None else 10**9
    sleep = faults.loader_sleep_s.get(rank, 0.0) + faults.all_loader_sleep_s
    fault_on = _FaultStart(faults)
    loader: Any = SyntheticLoader(batches, n, sleep, fault_on)
    if spec.loader == "torch":
        dataset = torch.utils.data.TensorDataset(
            torch.randn(spec.steps * spec.batch, spec.dim, generator=gen),
            torch.randn(spec.steps * spec.batch, 1, generator=gen))
        loader = torch.utils.data.DataLoader(dataset, batch_size=spec.batch,
                                             num_workers=spec.loader_workers)
    elif spec.loader == "ray_data":
        import ray.train

        # Ray Data's iterator itself is what the probe wraps: dict batches
        loader = ray.train.get_dataset_shard("train").iter_torch_batches(
            batch_size=spec.batch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if probe is not None:
        model = probe.watch(model, optimizer=opt)
        loader = probe.iter(loader)
    loss_fn = torch.nn.MSELoss()
    burn = torch.randn(96, 96, generator=gen) / 10
    hoard: list[Any] = []
    times: list[float] = []
    profiler = None
    if spec.profile:
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        )
        profiler.__enter__()
    started = time.perf_counter()
    prev = started
    step_ctx = probe.step if probe is not None else _null_ctx
    for i, batch in enumerate(loader):
        if isinstance(batch, dict):  # Ray Data
            x, y = batch["x"].float(), batch["y"].float().reshape(-1, 1)
        else:
            x, y = batch
        if i >= n:
            break
        faulty = fault_on(i)
        if faulty and i == fault_on.began_at and spec.fault_mark_dir:
            _write_mark(Path(spec.fault_mark_dir, f"fault-rank{rank}"), time.time())
        if faulty and faults.die_at_step.get(rank) == i:
            os._exit(17)
        with step_ctx():
            if faulty and faults.hang_at_step.get(rank) == i:
                time.sleep(3600)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            extra = faults.extra_compute_s.get(rank, 0.0)
            if faulty and extra:
                _burn(extra, burn)
            grow = faults.mem_grow_bytes_per_step.get(rank, 0)
            if faulty and grow and (not faults.mem_grow_max_bytes
                                    or len(hoard) * grow < faults.mem_grow_max_bytes):
                hoard.append(torch.ones(grow // 4, dtype=torch.float32))
        if faulty and faults.checkpoint_every and (i + 1) % faults.checkpoint_every == 0:
            ctx = probe.checkpoint() if probe is not None else _null_ctx()
            with ctx:
                time.sleep(faults.checkpoint_s)
        now = time.perf_counter()
        times.append(now - prev)
        prev = now
        if (i + 1) % 20 == 0 and (spec.duration_s is not None or spec.stop_file) \
                and _all_agree_to_stop(_time_to_stop(spec, now - started)):
            break
    if profiler is not None:
        profiler.__exit__(None, None, None)
    return times


def _time_to_stop(spec: WorkloadSpec, elapsed_s: float) -> bool:
    """This rank's vote: the duration is up, or the stop file appeared."""
    if spec.duration_s is not None and elapsed_s >= spec.duration_s:
        return True
    return bool(spec.stop_file) and os.path.exists(str(spec.stop_file))


def _all_agree_to_stop(mine: bool) -> bool:
    """Every rank must leave the loop at the same step, or the others hang in allreduce."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return mine
    flag = torch.tensor([1.0 if mine else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


class _null_ctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def free_port() -> int:
    """A TCP port that was free a moment ago on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forked_rank(rank: int, spec: WorkloadSpec, port: int, out_dir: str,
                 env: dict[str, str]) -> None:
    """One rank of :func:`run_local`, forked by its fork server, made to look like a
    launcher's child: the run's environment (not the server's), the platform's start
    method (for its data loader's workers), and at its end the interpreter's exit
    handlers, which a forked child skips (it leaves with ``os._exit``) where a
    launcher's rank runs them (rtop's goodbye and spool among them)."""
    import atexit
    import multiprocessing

    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)
    try:
        _rank_main(rank, spec, port, out_dir)
    finally:
        atexit._run_exitfuncs()


def _rank_main(rank: int, spec: WorkloadSpec, port: int, out_dir: str,
               master: str = "127.0.0.1", local_rank: int | None = None) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    os.environ.update({"MASTER_ADDR": master, "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
                       "LOCAL_RANK": str(rank if local_rank is None else local_rank)})
    dist.init_process_group("gloo", rank=rank, world_size=spec.world_size)
    probe = None
    if spec.instrument:
        import collectors

        probe = collectors.start(hub=spec.hub, token=spec.token, **spec.probe_settings)
    model = torch.nn.parallel.DistributedDataParallel(build_model(spec))
    times = train_loop(rank, spec, model, probe)
    if probe is not None:
        probe.close()
        stats = probe.stats()
    else:
        stats = {}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"times": times, "stats": stats}))
    del model  # DDP before its process group: the other order can abort at exit
    dist.barrier()
    dist.destroy_process_group()


#: What :func:`run_local`'s fork server imports before it forks any rank.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "rtop.workload")


def run_local(spec: WorkloadSpec, timeout_s: float | None = None, check: bool = True,
              stop: threading.Event | None = None, failure_grace_s: float = 5.0
              ) -> list[dict[str, Any]]:
    """Run the job as ``world_size`` local processes; return each rank's results.

    Like a launcher: when a rank fails, the others get ``failure_grace_s`` to notice
    (their collective errors out) and exit on their own before they are killed. With
    ``check`` (the default) a failed rank or a job past ``timeout_s`` raises; without,
    ranks without results get ``{}``. ``stop`` kills the job early.
    """
    import multiprocessing
    import multiprocessing.connection

    import torch.multiprocessing as mp

    # A fork server that has imported torch once starts each rank in milliseconds, where
    # spawning one costs a fresh interpreter and torch's import (2-3 s of CPU here).
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    with tempfile.TemporaryDirectory(prefix="rtop-job-") as out_dir:
        ctx = mp.start_processes(
            _forked_rank, args=(spec, free_port(), out_dir, dict(os.environ)),
            nprocs=spec.world_size, join=False, start_method="forkserver",
        )
        procs = ctx.processes
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed_at: float | None = None
        timed_out = False
        while True:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if (failed_at is not None and now - failed_at > failure_grace_s) or (
                    stop is not None and stop.is_set()):
                break
            if deadline is not None and now > deadline:
                timed_out = True
                break
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.25)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if check and timed_out:
            raise TimeoutError(f"workload did not finish within {timeout_s} s")
        if check:
            bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
            if bad:
                raise RuntimeError(f"ranks failed (rank, exit code): {bad}")
        out = []
        for r in range(spec.world_size):
            path = Path(out_dir, f"rank{r}.json")
            out.append(json.loads(path.read_text()) if path.exists() else {})
        return out


def median_step_s(results: list[dict[str, Any]], skip: int = 5) -> float:
    """Median iteration time over all ranks, skipping each rank's warm-up steps."""
    return statistics.median(t for r in results for t in r["times"][skip:])


def ray_worker_setup(config: dict[str, Any]) -> tuple[WorkloadSpec, Any, Any, int]:
    """Inside a Ray Train worker: ``(spec, probe, prepared model, world rank)``."""
    import ray.train
    import ray.train.torch
    import torch

    spec = WorkloadSpec.from_json(config["spec"])
    torch.set_num_threads(spec.threads)
    probe = None
    if spec.instrument:
        import collectors

        probe = collectors.start(hub=spec.hub, token=spec.token, **spec.probe_settings)
    model = ray.train.torch.prepare_model(build_model(spec))
    return spec, probe, model, ray.train.get_context().get_world_rank()


def ray_train_loop(config: dict[str, Any]) -> None:
    """The per-worker function for a Ray Train ``TorchTrainer`` (``config["spec"]``)."""
    spec, probe, model, rank = ray_worker_setup(config)
    try:
        train_loop(rank, spec, model, probe)
    finally:
        if probe is not None:
            probe.close()


def main(argv: list[str] | None = None) -> None:
    """Run one rank by hand (``python -m rtop.workload --rank R --master HOST:PORT``),
    e.g. inside a network namespace that plays another node."""
    import argparse

    ap = argparse.ArgumentParser(description="one rank of rtop's demo workload")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--local-rank", type=int, default=0)
    ap.add_argument("--master", required=True, help="host:port of rank 0's rendezvous")
    ap.add_argument("--spec", required=True, help="WorkloadSpec as JSON")
    ap.add_argument("--out", required=True, help="directory for the rank's results")
    args = ap.parse_args(argv)
    from collectors.wire import parse_address

    host, port = parse_address(args.master)
    _rank_main(args.rank, WorkloadSpec.from_json(args.spec), port, args.out, host,
               args.local_rank)
    # done: results written, the probe closed, the process group destroyed. Leave as a
    # forked rank does (run_local), without the interpreter's teardown: gloo's threads
    # may still be winding down then, and the process aborts ("terminate called without
    # an active exception", pytorch/pytorch#190489; seen in CI on the job run without
    # rtop at all, 1 run in ~20)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
