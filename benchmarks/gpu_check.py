"""The collectors' GPU paths, checked on a real CUDA machine (one GPU is enough).

What this machine's tests can only fake (NVML, CUDA), checked for real, in one short
run (about a minute on an H200):

1. NVML: the sampler finds the rank's own GPU (by UUID / PCI bus id, as the collectors
   do for ``cuda:0``) and reads it: every figure is printed with its unit and checked
   against torch's view of the same device (memory total) and for sanity (power within
   its limit, SM clock within its max, utilization high while a kernel runs).
2. CUDA-event step timing: a 1-rank NCCL DDP job of large matmuls. The probe's
   ``gpu_s`` per step is compared with CUDA events recorded independently around the
   same steps, and the training thread must never synchronize: calls to
   ``torch.cuda.synchronize``, ``Event.synchronize``, ``Event.elapsed_time`` and
   ``Stream.synchronize`` made by the training thread inside steps are counted (0).
3. The comm hook on CUDA (what CUDA models use): gradients bit-identical to plain DDP;
   ``comm_bytes`` equals the gradient bytes.
4. Overhead: the same job instrumented and not, in interleaved blocks; the ratio of
   median step times.

    python benchmarks/gpu_check.py [--steps 40]

Prints PASS/FAIL per check and exits 1 if any failed (2 without CUDA).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def nvml_check(torch: Any) -> None:
    from collectors.nvml import NvmlSampler, decode_reasons
    from collectors.schema import GPU_FIELDS

    print("\n1. NVML on the rank's own GPU (cuda:0)")
    props = torch.cuda.get_device_properties(0)
    uuid = getattr(props, "uuid", None)
    sampler = NvmlSampler(cuda_index=0, uuid=str(uuid) if uuid is not None else None)
    check("sampler available", sampler.available, sampler.reason or "NVML handle found")
    if not sampler.available:
        return
    info = sampler.info() or {}
    print(f"     info: {info}")
    total = info.get("mem_total_bytes") or 0
    check("memory total matches torch", abs(total - props.total_memory) < 0.02 * total,
          f"NVML {total / 2**30:.1f} GiB, torch {props.total_memory / 2**30:.1f} GiB")
    # load the GPU, then sample twice (PCIe/NVLink rates need two readings)
    a = torch.randn(8192, 8192, device="cuda")
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    t = threading.Thread(target=burn, daemon=True)
    t.start()
    time.sleep(1.5)
    sampler.sample(time.time())
    time.sleep(1.0)
    row = sampler.sample(time.time())
    stop.set()
    t.join()
    check("sample taken", row is not None, "one row per call")
    if row is None:
        return
    s = dict(zip(GPU_FIELDS, row, strict=True))
    for k, v in s.items():
        print(f"     {k:22} {v}")
    print(f"     clock-event reasons: {decode_reasons(s['clock_event_reasons'])}")
    check("utilization under load", (s["util_pct"] or 0) >= 50, f"{s['util_pct']}%")
    check("power within limit", s["power_w"] is not None and s["power_limit_w"] is not None
          and 0 < s["power_w"] <= 1.1 * s["power_limit_w"],
          f"{s['power_w']} W of {s['power_limit_w']} W")
    check("SM clock within max", s["sm_clock_mhz"] is not None
          and 0 < s["sm_clock_mhz"] <= (s["sm_clock_max_mhz"] or 0),
          f"{s['sm_clock_mhz']} of {s['sm_clock_max_mhz']} MHz")
    check("memory used within total", 0 < (s["mem_used_bytes"] or 0) <= (s["mem_total_bytes"] or 0),
          f"{(s['mem_used_bytes'] or 0) / 2**30:.1f} GiB used")
    sampler.close()


class SyncCounter:
    """Counts host-blocking CUDA calls made by one thread while armed."""

    def __init__(self, torch: Any) -> None:
        self.calls: list[str] = []
        self.armed = False
        self.tid = threading.get_ident()
        self._undo: list[tuple[Any, str, Any]] = []
        targets = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                   (torch.cuda.Event, "elapsed_time"), (torch.cuda.Stream, "synchronize")]
        for owner, name in targets:
            orig = getattr(owner, name)
            self._undo.append((owner, name, orig))
            setattr(owner, name, self._wrap(orig, f"{getattr(owner, '__name__', owner)}.{name}"))

    def _wrap(self, fn: Any, label: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.armed and threading.get_ident() == self.tid:
                self.calls.append(label)
            return fn(*args, **kwargs)
        return counted

    def restore(self) -> None:
        for owner, name, orig in self._undo:
            setattr(owner, name, orig)


def _job(torch: Any, layers: int = 6, dim: int = 4096) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    x = torch.randn(2048, dim, device="cuda")
    return ddp, opt, x


def timing_check(torch: Any, steps: int) -> None:
    import collectors
    from collectors.identity import detect
    from collectors.schema import STEP_FIELDS
    from collectors.steps import StepRecords

    print("\n2. CUDA-event step timing, and no synchronization on the training thread")
    ddp, opt, x = _job(torch)
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
    probe.watch(ddp, optimizer=opt)
    check("CUDA timing on", probe.cuda is not None, "step timing switched to CUDA events")
    check("comm hook on CUDA", probe.comm.ddp_logger is None and probe.comm.buckets is not None,
          probe.notes[-1] if probe.notes else "")
    # what the sender thread (not started here) does with the probe's finished steps
    records = StepRecords(probe.config.cuda_resolve_timeout_s)

    def drain() -> list[list[Any]]:
        """Every step record the finished steps make, all CUDA events resolved (the
        caller synchronized first: this is the check's clock, not the probe's)."""
        return records.drain(probe.records, probe.cuda, world=probe.comm.world,
                             nbytes=probe.comm.nbytes, now=time.monotonic(), final=True)

    for _ in range(5):  # warm-up, not measured
        with probe.step():
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    drain()  # the warm-up steps' records: not measured
    counter = SyncCounter(torch)
    ref: list[tuple[Any, Any]] = []
    host: list[float] = []
    try:
        for _ in range(steps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            counter.armed = True
            t0 = time.perf_counter()
            e0.record()
            with probe.step():
                ddp(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            e1.record()
            host.append(time.perf_counter() - t0)
            counter.armed = False
            ref.append((e0, e1))
        torch.cuda.synchronize()
    finally:
        counter.restore()
    check("no host sync on the training thread", not counter.calls,
          f"{len(counter.calls)} calls {sorted(set(counter.calls))}")
    rows = [dict(zip(STEP_FIELDS, r, strict=True)) for r in drain()]
    probe.close(1.0)
    ref_s = [a.elapsed_time(b) / 1e3 for a, b in ref]
    gpu_s = [r["gpu_s"] for r in rows]
    check("a gpu_s per step", len(gpu_s) == steps and all(g is not None for g in gpu_s),
          f"{sum(g is not None for g in gpu_s)} of {steps}")
    if len(gpu_s) == steps and all(g is not None for g in gpu_s):
        errs = [abs(g - r) / r for g, r in zip(gpu_s, ref_s, strict=True)]
        check("gpu_s matches independent CUDA events", statistics.median(errs) < 0.05,
              f"median {statistics.median(ref_s) * 1e3:.2f} ms (events) vs "
              f"{statistics.median(gpu_s) * 1e3:.2f} ms (probe), median error "
              f"{statistics.median(errs):.1%}")
    grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
    check("comm_bytes = gradient bytes", all(r["comm_bytes"] == grad_bytes for r in rows),
          f"{grad_bytes} bytes, {rows[0]['comm_calls'] if rows else 'n/a'} buckets")
    print(f"     host time per step (median): {statistics.median(host) * 1e3:.2f} ms; "
          f"GPU time per step: {statistics.median(ref_s) * 1e3:.2f} ms")


def gradients_check(torch: Any) -> None:
    import collectors
    from collectors.identity import detect

    print("\n3. Gradients with rtop's comm hook on CUDA")
    plain, _, x = _job(torch, layers=3, dim=1024)
    hooked, _, _ = _job(torch, layers=3, dim=1024)
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
    probe.watch(hooked)
    same = True
    for _ in range(4):
        for m in (plain, hooked):
            m.zero_grad(set_to_none=True)
            with probe.step():
                m(x).square().mean().backward()
        same &= all(torch.equal(a.grad, b.grad)
                    for a, b in zip(plain.parameters(), hooked.parameters(), strict=True))
    probe.close(1.0)
    check("bit-identical to plain DDP", same, "4 steps, every parameter")


def overhead_check(torch: Any, rounds: int = 8, block: int = 20) -> None:
    import collectors
    from collectors.identity import detect

    print("\n4. Overhead: instrumented vs not, interleaved blocks (medians)")
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for watched in ((False, True) if r % 2 else (True, False)):
            ddp, opt, x = _job(torch)
            probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None)) \
                if watched else None
            if probe is not None:
                probe.watch(ddp, optimizer=opt)
            torch.cuda.synchronize()
            prev = time.perf_counter()
            for i in range(block):
                ctx = probe.step() if probe is not None else _Null()
                with ctx:
                    ddp(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                torch.cuda.synchronize()  # outside the step: the benchmark's own clock
                now = time.perf_counter()
                if i >= 3:
                    times[watched].append(now - prev)
                prev = now
            if probe is not None:
                probe.close(1.0)
            del ddp, opt
    base, inst = statistics.median(times[False]), statistics.median(times[True])
    check("collectors <= 1.01x on GPU", inst / base <= 1.01,
          f"{base * 1e3:.2f} ms bare, {inst * 1e3:.2f} ms with rtop: {inst / base:.4f}x")


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    os.environ["RTOP_AUTOHUB"] = "0"  # no hub: the checks read the probe directly
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    from rtop.workload import free_port

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    dist.init_process_group("nccl", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    torch.cuda.set_device(0)
    try:
        for fn in (lambda: nvml_check(torch), lambda: timing_check(torch, args.steps),
                   lambda: gradients_check(torch), lambda: overhead_check(torch)):
            try:
                fn()
            except Exception as exc:  # report and go on: one run, every check
                check("no exception", False, repr(exc))
    finally:
        dist.destroy_process_group()
    failed = [r for r in RESULTS if not r[1]]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
