"""What rtop's collectors cost a training job, measured side by side.

Part 1 - whole job: one 2-rank gloo DDP job (~20 ms steps) that switches, block by
block in shuffled rounds, between (a) no rtop, (b) no rtop again, on its own copy of
the model (an A/A control: its ratio is the benchmark's noise floor), (c) collectors
with the hub up, (d) collectors with the hub unreachable, (e) collectors with the hub up
but no comm hook (iter, step and the sender thread only: splits the cost between the
hook and the rest), (f) torch's own Python ``allreduce_hook`` and no rtop (what replacing
DDP's C++ allreduce by any Python comm hook costs), (g) torch.profiler on.
Prints the median step time of each and its ratio to (a), pooled, plus the median of
the per-round ratios.

Part 2 - training-thread cost: per step, what ``probe.iter`` + ``probe.step`` + the
comm hook add on the training thread, against the same loop without them.

    python benchmarks/collector_overhead.py [--rounds 12] [--block 60]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtop.hub.service import ThreadedHub
from rtop.workload import free_port

WARMUP = 20  # steps after each switch of configuration that are not counted (startup)
CONFIGS = ("no rtop", "no rtop (A/A control)", "collectors, hub up",
           "collectors, hub unreachable", "collectors, no comm hook",
           "torch's allreduce_hook, no rtop", "torch.profiler on")


def _bench_rank(rank: int, world: int, port: int, hub_up: str, hub_dead: str, token: str,
                rounds: int, block: int, out_dir: str) -> None:
    """One rank: the same DDP job, switching configuration every ``block`` steps.

    Running every configuration inside the same two processes, in shuffled order round
    after round, cancels the run-to-run noise (core placement, caches) that dominates
    separate runs on a small shared machine. Each configuration trains its own copy of
    the model, so the un-instrumented model never carries rtop's comm hook; each
    collectors block starts a fresh probe (its sender thread, its connection) and
    closes it at the end, so "no rtop" blocks run with no rtop thread at all.
    """
    import json
    import os

    import torch
    import torch.distributed as dist

    import collectors
    from collectors.identity import detect
    from rtop.workload import WorkloadSpec, build_model

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = WorkloadSpec(world_size=world, batch=256, dim=256, hidden=512, layers=3)
    models = {name: torch.nn.parallel.DistributedDataParallel(build_model(spec))
              for name in CONFIGS}
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # any Python comm hook in place of DDP's C++ allreduce, without rtop: what a hook costs
    models["torch's allreduce_hook, no rtop"].register_comm_hook(None, default_hooks.allreduce_hook)
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(spec.batch, spec.dim, generator=gen),
                torch.randn(spec.batch, 1, generator=gen)) for _ in range(8)]
    loss_fn = torch.nn.MSELoss()
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for r in range(rounds):
        order = list(CONFIGS)
        random.Random(r).shuffle(order)  # the same order on every rank
        for name in order:
            model, opt = models[name], opts[name]
            probe: Any = None
            profiler: Any = None
            if name.startswith("collectors"):
                hub = hub_dead if name.endswith("unreachable") else hub_up
                probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=hub, token=token))
                if name != "collectors, no comm hook":  # that one: iter, step, sender only
                    probe.watch(model, optimizer=opt)  # the 2nd time re-points the hook
            elif name == "torch.profiler on":
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                profiler.__enter__()
            loader: Any = (batches[i % 8] for i in range(block))
            if probe is not None:
                loader = probe.iter(loader)
            prev = time.perf_counter()
            for i, (x, y) in enumerate(loader):
                ctx = probe.step() if probe is not None else _Null()
                with ctx:
                    loss_fn(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                now = time.perf_counter()
                if i >= WARMUP:
                    times[name].append(now - prev)
                prev = now
            if probe is not None:
                probe.close()
            if profiler is not None:
                profiler.__exit__(None, None, None)
            dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def job_benchmark(rounds: int, block: int) -> None:
    import json
    import tempfile

    import torch.multiprocessing as mp

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with tempfile.TemporaryDirectory() as out:
        hub = ThreadedHub(job="bench", record=str(Path(out, "bench.rtop"))).start()
        try:
            mp.start_processes(_bench_rank, nprocs=2, start_method="spawn", args=(
                2, free_port(), hub.address, dead, hub.token, rounds, block, out))
        finally:
            hub.stop()
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    times = {name: [t for rank in per_rank for t in rank[name]] for name in CONFIGS}
    counted = block - WARMUP
    base = statistics.median(times["no rtop"])
    print(f"\nwhole job: 2 ranks, gloo DDP on CPU, {rounds} rounds x {len(CONFIGS)} "
          f"configurations x {block} steps, interleaved in the same processes")
    print(f"{'configuration':30} {'median step':>12} {'ratio':>7} {'median of round ratios':>23}")
    for name in CONFIGS:
        med = statistics.median(times[name])
        ratios = []
        for r in range(rounds):
            mine = times[name][r * counted:(r + 1) * counted]
            ref = times["no rtop"][r * counted:(r + 1) * counted]
            ratios.append(statistics.median(mine) / statistics.median(ref))
        print(f"{name:30} {med * 1e3:9.2f} ms {med / base:6.3f}x "
              f"{statistics.median(ratios):22.3f}x")


class _Bucket:
    """Stands in for DDP's GradBucket: what the hook reads of it."""

    def __init__(self, buf: Any, last: bool) -> None:
        self._buf, self._last = buf, last

    def buffer(self) -> Any:
        return self._buf

    def is_last(self) -> bool:
        return self._last


def thread_cost(n: int = 200_000, buckets: int = 4) -> None:
    import torch

    import collectors
    from collectors.identity import detect

    probe = collectors.Probe(detect(), collectors.ProbeConfig(buffer_records=10**7),
                             start_sender=False)
    data = list(range(n))

    def bare() -> float:
        t0 = time.perf_counter()
        for _ in data:
            pass
        return time.perf_counter() - t0

    def instrumented() -> float:
        t0 = time.perf_counter()
        for _ in probe.iter(data):
            with probe.step():
                pass
        return time.perf_counter() - t0

    # The comm hook. (1) rtop's own additions: the hook's default path in full (scaling,
    # entry, clocks, callback) with the collective itself replaced by a completed future,
    # against the same scaling + collective + callback without rtop. (2) For context,
    # the CPU time of the training thread issuing a real 1-rank gloo allreduce through
    # rtop's hook and through torch's allreduce_hook.
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from collectors import commhook

    completed = torch.futures.Future()
    completed.set_result([torch.zeros(1)])

    class InstantWork:
        def get_future(self) -> Any:
            return completed

    class InstantGroup:
        """A process group whose allreduce has already finished."""

        def size(self) -> int:
            return 2

        def allreduce(self, tensors: Any, opts: Any = None) -> InstantWork:
            return InstantWork()

    class StandInDDP:
        """What commhook.install touches of a DDP model."""

        gradient_as_bucket_view = False
        logger = None

        def __init__(self, group: Any) -> None:
            self._comm_hooks: list[Any] = []
            self.process_group = group

        def parameters(self) -> list[Any]:
            return []

        def _check_comm_hook(self, hook: Any) -> None:
            pass

        def register_comm_hook(self, state: Any, hook: Any) -> None:
            self.reducer_hook = hook

    bucket = _Bucket(torch.zeros(256), last=False)
    group = InstantGroup()
    opts = dist.AllreduceOptions()

    def without_rtop(state: Any, b: _Bucket) -> Any:
        buf = b.buffer()
        buf.mul_(1.0 / state.size())
        return state.allreduce([buf], opts).get_future().then(lambda f: f.value()[0])

    def additions(k: int) -> float:
        model = StandInDDP(group)
        commhook.install(probe, model)
        hook = model.reducer_hook
        t0 = time.perf_counter()
        for _ in range(k):
            hook(group, bucket)
            probe._comm.clear()
        hooked = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(k):
            without_rtop(group, bucket)
        return (hooked - (time.perf_counter() - t0)) / k

    def real_issue_cost(k: int) -> tuple[float, float]:
        model = StandInDDP(dist.group.WORLD)
        commhook.install(probe, model)
        hook = model.reducer_hook
        t0 = time.thread_time()
        for _ in range(k):
            hook(dist.group.WORLD, bucket).wait()
            probe._comm.clear()
        ours = time.thread_time() - t0
        t0 = time.thread_time()
        for _ in range(k):
            allreduce_hook(dist.group.WORLD, bucket).wait()  # type: ignore[arg-type]
        return ours / k, (time.thread_time() - t0) / k

    loop_us = statistics.median((instrumented() - bare()) / n for _ in range(5)) * 1e6
    probe._records.clear()
    add_us = statistics.median(additions(50_000) for _ in range(9)) * 1e6
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    real = [real_issue_cost(5_000) for _ in range(9)]
    dist.destroy_process_group()
    ours_us = statistics.median(r[0] for r in real) * 1e6
    torch_us = statistics.median(r[1] for r in real) * 1e6
    print("\ntraining-thread cost per step (medians)")
    print(f"  probe.iter + probe.step:                         {loop_us:6.2f} us")
    print(f"  comm hook, rtop's additions per bucket:          {add_us:6.2f} us")
    print(f"  total, iter + step + {buckets} buckets:                  "
          f"{loop_us + buckets * add_us:6.2f} us   (target <= 20 us)")
    print("  issuing a real 1-rank gloo allreduce, training-thread CPU per bucket:")
    print(f"    through rtop's hook {ours_us:6.1f} us, through torch's allreduce_hook "
          f"{torch_us:6.1f} us (rtop skips dist.all_reduce's Python checks)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=60, help="steps per configuration block")
    ap.add_argument("--skip-job", action="store_true")
    ap.add_argument("--skip-micro", action="store_true")
    args = ap.parse_args()
    if not args.skip_micro:
        thread_cost()
    if not args.skip_job:
        job_benchmark(args.rounds, args.block)


if __name__ == "__main__":
    main()
