"""What rtop's collectors cost a training job, measured side by side.

Part 1 - whole job: one 2-rank gloo DDP job (~20 ms steps) that switches, block by
block in shuffled rounds, between (a) no rtop, (b) no rtop again (an A/A control: its
ratio is the benchmark's noise floor), (c) collectors with the hub up, (d) collectors
with the hub unreachable (both with the default timing: DDP's own timer on CPU),
(e) collectors with the hub up timing the allreduce with rtop's comm hook instead
(``comm_timing="hook"``, what a GPU job runs),
(f) torch's own Python ``allreduce_hook`` and no rtop (what any Python comm hook costs
DDP on CPU), (g) torch.profiler on.
Prints the median step time of each and its ratio to (a), pooled, plus the median of
the per-round ratios with a 95% bootstrap interval, and the ratio of CPU time per step
(all the rank's threads, rtop's sender included).

Part 2 - training-thread cost: per step, what ``probe.iter`` + ``probe.step`` (and
``probe.step(tokens=...)``) + the comm hook add on the training thread, against the same
loop without them; and what ``probe.count_flops`` costs, once.

    python benchmarks/collector_overhead.py [--rounds 12] [--block 60] [--no-pin]
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

WARMUP = 20  # default: steps after each switch of configuration not counted (startup)
CONFIGS = ("no rtop", "no rtop (A/A control)", "collectors, hub up",
           "collectors, hub unreachable", "collectors, comm hook (hook)",
           "torch's allreduce_hook, no rtop", "torch.profiler on")
#: Configurations that install a comm hook, which DDP cannot take back: each of their
#: blocks builds a model of its own (so their ratios carry the noise of a fresh model's
#: memory placement, which the others, sharing one model per round, do not)
OWN_MODEL = ("collectors, comm hook (hook)", "torch's allreduce_hook, no rtop")


def _bench_rank(rank: int, world: int, port: int, hub_up: str, hub_dead: str, token: str,
                rounds: int, block: int, out_dir: str, pin: bool, warmup: int) -> None:
    """One rank: the same DDP job, switching configuration every ``block`` steps.

    Running every configuration inside the same two processes, in shuffled order round
    after round, cancels the run-to-run noise (core placement, caches) that dominates
    separate runs on a small shared machine. Every round builds a fresh model, DDP
    wrapper and optimizer, used by all the configurations of that round that leave a
    model as they found it: no configuration keeps its own copy for the whole run, so
    a copy that happens to sit better in memory cannot bias one configuration (that
    bias, not the scheduler, once moved the A/A control by up to 3%), and within a
    round the blocks differ only in rtop. Each collectors block starts a fresh probe
    (its sender thread, its connection) and closes it at the end, so "no rtop" blocks
    run with no rtop thread.
    Per step it keeps the wall time and the process's CPU time (all its threads: the
    training thread, gloo's, and rtop's sender when there is one).
    """
    import gc
    import json
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import collectors
    from collectors.identity import detect
    from rtop.workload import WorkloadSpec, build_model

    if pin:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = WorkloadSpec(world_size=world, batch=256, dim=256, hidden=512, layers=3)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(spec.batch, spec.dim, generator=gen),
                torch.randn(spec.batch, 1, generator=gen)) for _ in range(8)]
    loss_fn = torch.nn.MSELoss()
    wall: dict[str, list[list[float]]] = {name: [] for name in CONFIGS}
    cpu: dict[str, list[list[float]]] = {name: [] for name in CONFIGS}
    sender_cpu: dict[str, list[float]] = {name: [] for name in CONFIGS}  # s per step
    for r in range(rounds):
        order = list(CONFIGS)
        random.Random(r).shuffle(order)  # the same order on every rank
        # one model for the round, shared by every configuration that leaves the model
        # as it found it (a closed probe does): their blocks differ only in rtop
        shared = torch.nn.parallel.DistributedDataParallel(build_model(spec))
        shared_opt = torch.optim.SGD(shared.parameters(), lr=1e-4)
        for name in order:
            if name in OWN_MODEL:  # a comm hook stays for good: a model of its own
                model = torch.nn.parallel.DistributedDataParallel(build_model(spec))
                opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            else:
                model, opt = shared, shared_opt
            if name == "torch's allreduce_hook, no rtop":
                # any Python comm hook in place of DDP's C++ allreduce: what a hook costs
                model.register_comm_hook(None, default_hooks.allreduce_hook)
            probe: Any = None
            profiler: Any = None
            if name.startswith("collectors"):
                hub = hub_dead if name.endswith("unreachable") else hub_up
                timing = "hook" if name.endswith("(hook)") else "ddp"
                probe = collectors.Probe(detect(), collectors.ProbeConfig(
                    hub=hub, token=token, comm_timing=timing))
                probe.watch(model, optimizer=opt)
            elif name == "torch.profiler on":
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                profiler.__enter__()
            loader: Any = (batches[i % 8] for i in range(block))
            if probe is not None:
                loader = probe.iter(loader)
            block_wall: list[float] = []
            block_cpu: list[float] = []
            prev, prev_cpu = time.perf_counter(), time.process_time()
            for i, (x, y) in enumerate(loader):
                ctx = probe.step() if probe is not None else _Null()
                with ctx:
                    loss_fn(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                now, now_cpu = time.perf_counter(), time.process_time()
                if i >= warmup:
                    block_wall.append(now - prev)
                    block_cpu.append(now_cpu - prev_cpu)
                prev, prev_cpu = now, now_cpu
            if probe is not None:
                sender_cpu[name].append(_thread_cpu(probe.sender) / max(1, block))
                probe.close()
            if profiler is not None:
                profiler.__exit__(None, None, None)
            wall[name].append(block_wall)
            cpu[name].append(block_cpu)
            dist.barrier()
            del model, opt, probe, profiler
            gc.collect()
        del shared, shared_opt
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"wall": wall, "cpu": cpu, "sender_cpu": sender_cpu}, f)
    dist.barrier()
    dist.destroy_process_group()


def _thread_cpu(thread: Any) -> float:
    """CPU seconds a live thread of this process has used so far (0 if unreadable)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError, TypeError):
        return 0.0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _bootstrap_ci(values: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of ``values`` (rounds resampled)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def job_benchmark(rounds: int, block: int, pin: bool, warmup: int = WARMUP) -> None:
    import json
    import os
    import tempfile

    import torch.multiprocessing as mp

    pin = pin and (os.cpu_count() or 1) >= 2
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with tempfile.TemporaryDirectory() as out:
        # niced, as the hub that collectors start on their node and the Ray hub actor are
        hub = ThreadedHub(job="bench", record=str(Path(out, "bench.rtop")), nice=10).start()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            mp.start_processes(_bench_rank, nprocs=2, start_method="spawn", args=(
                2, free_port(), hub.address, dead, hub.token, rounds, block, out, pin, warmup))
        finally:
            hub_cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
            hub.stop()
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]

    def blocks(kind: str, name: str, r: int) -> list[float]:
        return [t for rank in per_rank for t in rank[kind][name][r]]

    def pooled(kind: str, name: str) -> float:
        return statistics.median(t for r in range(rounds) for t in blocks(kind, name, r))

    def round_ratios(kind: str, name: str) -> list[float]:
        return [statistics.median(blocks(kind, name, r))
                / statistics.median(blocks(kind, "no rtop", r)) for r in range(rounds)]

    print(f"\nwhole job: 2 ranks, gloo DDP on CPU, {rounds} rounds x {len(CONFIGS)} "
          f"configurations x {block} steps ({warmup} not counted), interleaved in the same "
          "processes"
          f"{', each rank pinned to its own core' if pin else ''}")
    print("step time: wall clock per step; ratio = pooled median / pooled median of"
          " 'no rtop'; per round = median over rounds of (this block / the 'no rtop'"
          " block of the same round), with its 95% bootstrap interval")
    print(f"the hub (niced, in this process) used {hub_cpu:.1%} of a core on average")
    print(f"{'configuration':31} {'median step':>11} {'ratio':>7} {'per round':>10} "
          f"{'95% interval':>15} {'CPU/step ratio':>15}")
    for name in CONFIGS:
        ratios = round_ratios("wall", name)
        lo, hi = _bootstrap_ci(ratios)
        cpu_ratio = statistics.median(round_ratios("cpu", name))
        print(f"{name:31} {pooled('wall', name) * 1e3:8.2f} ms "
              f"{pooled('wall', name) / pooled('wall', 'no rtop'):6.3f}x "
              f"{statistics.median(ratios):9.3f}x  {lo:6.3f}-{hi:5.3f}x {cpu_ratio:14.3f}x")
    print("rtop's sender thread, CPU per step (median over blocks, both ranks):")
    for name in CONFIGS:
        per_step = [c for rank in per_rank for c in rank["sender_cpu"][name]]
        if per_step:
            med = statistics.median(per_step)
            print(f"  {name:31} {med * 1e6:7.1f} us  "
                  f"({med / pooled('wall', 'no rtop'):.2%} of a step)")


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

    def instrumented_tokens() -> float:
        """The same loop telling each step its tokens (``probe.step(tokens=...)``)."""
        t0 = time.perf_counter()
        for _ in probe.iter(data):
            with probe.step(tokens=4096):
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
            probe.comm.buckets.clear()
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
            probe.comm.buckets.clear()
        ours = time.thread_time() - t0
        t0 = time.thread_time()
        for _ in range(k):
            allreduce_hook(dist.group.WORLD, bucket).wait()  # type: ignore[arg-type]
        return ours / k, (time.thread_time() - t0) / k

    def ddp_timer_read_cost(k: int = 2000) -> float:
        """Seconds the training thread spends at step exit reading DDP's stamps (the CPU
        default), on the whole-job benchmark's model after a real backward."""
        from collectors import ddptimer
        from rtop.workload import WorkloadSpec, build_model

        spec = WorkloadSpec(world_size=1, batch=256, dim=256, hidden=512, layers=3)
        model = torch.nn.parallel.DistributedDataParallel(build_model(spec))
        p = collectors.Probe(detect(), collectors.ProbeConfig(buffer_records=10**6),
                             start_sender=False)
        p.watch(model)
        model(torch.randn(spec.batch, spec.dim)).sum().backward()
        costs = []
        for _ in range(9):
            t0 = time.thread_time()
            for _ in range(k):
                ddptimer.read(p.comm)
            costs.append((time.thread_time() - t0) / k)
        p.close(0.1)
        return statistics.median(costs)

    def real_step_cost(rounds: int = 80, steps: int = 40) -> dict[str, Any]:
        """Training-thread CPU per step of a real DDP step: the whole-job benchmark's
        model and batch on 1 rank, in shuffled interleaved blocks, each on a fresh model.
        CPU time of this thread only, so the other cores' noise does not enter; the
        sender thread is not started (its cost is measured in the whole-job part).
        Returns, per configuration, the median paired difference to "no rtop" in
        seconds per step and its 95% bootstrap interval."""
        import gc
        import os

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the job; an idle OpenMP worker would spin beside us
        if hasattr(os, "sched_setaffinity"):  # one core: no migrations mid-block
            cores = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {min(cores)})

        from rtop.workload import WorkloadSpec, build_model

        spec = WorkloadSpec(world_size=1, batch=256, dim=256, hidden=512, layers=3)
        x, y = torch.randn(spec.batch, spec.dim), torch.randn(spec.batch, 1)
        loss_fn = torch.nn.MSELoss()
        names = ("no rtop", "no rtop (A/A control)", "rtop, DDP's timer (the default)",
                 "rtop, comm hook (comm_timing='hook')")
        per: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            order = list(names)
            random.Random(r).shuffle(order)
            for name in order:
                model = torch.nn.parallel.DistributedDataParallel(build_model(spec))
                opt = torch.optim.SGD(model.parameters(), lr=1e-4)
                p: Any = None
                if name.startswith("rtop"):
                    timing = "hook" if "'hook'" in name else "ddp"
                    p = collectors.Probe(detect(), collectors.ProbeConfig(
                        buffer_records=10**6, comm_timing=timing), start_sender=False)
                    p.watch(model, optimizer=opt)
                loader: Any = p.iter(range(steps)) if p is not None else range(steps)
                block: list[float] = []
                for i in loader:
                    t0 = time.thread_time()
                    with p.step() if p is not None else _Null():
                        loss_fn(model(x), y).backward()
                        opt.step()
                        opt.zero_grad()
                    if i >= 10:
                        block.append(time.thread_time() - t0)
                per[name].append(statistics.median(block))
                if p is not None:
                    p.records.clear()
                    p.close(0.1)
                del model, opt, p
                gc.collect()
        torch.set_num_threads(threads)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        base = per["no rtop"]
        out: dict[str, Any] = {"base": statistics.median(base)}
        for name in names[1:]:
            deltas = [a - b for a, b in zip(per[name], base, strict=True)]
            out[name] = (statistics.median(deltas), *_bootstrap_ci(deltas))
        return out

    loop_us = statistics.median((instrumented() - bare()) / n for _ in range(5)) * 1e6
    probe.records.clear()
    tokens_us = statistics.median((instrumented_tokens() - bare()) / n for _ in range(5)) * 1e6
    probe.records.clear()
    add_us = statistics.median(additions(50_000) for _ in range(9)) * 1e6
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    real = [real_issue_cost(5_000) for _ in range(9)]
    ddp_read_us = ddp_timer_read_cost() * 1e6
    real_step = real_step_cost()
    dist.destroy_process_group()
    ours_us = statistics.median(r[0] for r in real) * 1e6
    torch_us = statistics.median(r[1] for r in real) * 1e6
    print("\ntraining-thread cost per step (medians)")
    print(f"  probe.iter + probe.step:                         {loop_us:6.2f} us")
    print(f"  probe.iter + probe.step(tokens=...):             {tokens_us:6.2f} us")
    print("  on CPU (the default): DDP's own timer, its stamps read at step exit")
    print(f"  reading DDP's stamps:                            {ddp_read_us:6.2f} us")
    print(f"  total, iter + step + that read:                  "
          f"{loop_us + ddp_read_us:6.2f} us   (target <= 20 us)")
    print("  on GPU (and on CPU with RTOP_COMM_TIMING=hook): rtop's comm hook")
    print(f"  comm hook, rtop's additions per bucket:          {add_us:6.2f} us")
    print(f"  total, iter + step + {buckets} buckets:                  "
          f"{loop_us + buckets * add_us:6.2f} us   (target <= 20 us)")
    print(f"  a real DDP step of the whole-job benchmark's model, 1 rank, training-thread CPU"
          f" ({real_step['base'] * 1e3:.2f} ms bare), added per step (median of paired"
          f" blocks):")
    for name, value in real_step.items():
        if name != "base":
            delta, lo, hi = value
            print(f"    {name:38} {delta * 1e6:+8.1f} us  ({delta / real_step['base']:+.2%});"
                  f" 95% interval {lo * 1e6:+.0f} to {hi * 1e6:+.0f} us")
    count_ms, forward_ms = count_flops_cost()
    print("  probe.count_flops, once, the whole-job benchmark's model and batch (median of 7;"
          " a FLOP counter's pass against a plain no_grad forward):")
    print(f"    count_flops:                                   {count_ms:6.2f} ms")
    print(f"    plain forward:                                 {forward_ms:6.2f} ms")
    print("  issuing a real 1-rank gloo allreduce, training-thread CPU per bucket:")
    print(f"    through rtop's hook {ours_us:6.1f} us, through torch's allreduce_hook "
          f"{torch_us:6.1f} us (rtop skips dist.all_reduce's Python checks)")


def count_flops_cost(repeat: int = 7) -> tuple[float, float]:
    """What ``probe.count_flops`` costs, once (it is not on the per-step path): its pass
    under torch's FLOP counter, and a plain ``no_grad`` forward of the same model and
    batch (the whole-job benchmark's), each the median of ``repeat``, in ms."""
    import torch

    from collectors.flops import count_step
    from rtop.workload import WorkloadSpec, build_model

    spec = WorkloadSpec(world_size=1, batch=256, dim=256, hidden=512, layers=3)
    model = build_model(spec)
    x = torch.randn(spec.batch, spec.dim)
    counted, plain = [], []
    for _ in range(repeat):
        counted.append(count_step(model, (x,), {}).seconds)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        plain.append(time.perf_counter() - t0)
    return statistics.median(counted) * 1e3, statistics.median(plain) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=60, help="steps per configuration block")
    ap.add_argument("--warmup", type=int, default=WARMUP,
                    help="steps at the start of each block that are not counted")
    ap.add_argument("--skip-job", action="store_true")
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--no-pin", action="store_true",
                    help="let the scheduler move the ranks (default: one core each)")
    args = ap.parse_args()
    if not args.skip_micro:
        thread_cost()
    if not args.skip_job:
        job_benchmark(args.rounds, args.block, not args.no_pin, args.warmup)


if __name__ == "__main__":
    main()
