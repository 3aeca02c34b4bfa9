"""The link probe's GPU checks for ``benchmarks/gpu_check.py`` (issue 25, findings 1, 2
and 7): what only a real CUDA machine shows of ``collectors.linkprobe``.

``sections(torch, ui)`` gives gpu_check its sections; ``ui`` has ``check(name, ok,
detail)``, ``skip(name, why)`` and ``say(line)``. Every section ends PASS, FAIL or SKIP
with a reason, runs its CUDA work in subprocesses of this script (``--worker``, killed
past :data:`JOB_S`), installs nothing and takes well under a minute:

1. **The probe's device in a rank that never calls ``set_device``** (any number of
   GPUs): a one-rank NCCL job whose model lives on the last GPU, watched by a real
   ``collectors.Probe``; the device the control path hands the probe
   (``Control._probe_device``) must be the model's, and NVML must show this process's
   context on no other GPU after the probe's memory was judged there. With one GPU the
   device cannot be told apart from the default, and the check says so.
2. **The pair group, CUDA-event timing and freeing, on one GPU** (a self pair): a
   one-rank ``ProcessGroupNCCL`` made as the probe makes its pair groups
   (``linkprobe.nccl_pair_group``), a coalesced send and receive to itself of 64 MiB
   posted with a stream of its own current, timed by events recorded on that stream
   after ``block_current_stream``: the events must complete, read less than the host's
   clock around the same transfer, and give a plausible figure; the data must arrive;
   ``shutdown()`` must give back the communicator's memory (``cudaMemGetInfo`` within
   64 MiB of before it was made).
3. **A real two-rank probe** (2+ GPUs; SKIP on one: NCCL refuses two ranks of a
   communicator on one GPU, "duplicate GPU"): two processes, model on ``cuda:rank``,
   ``set_device`` never called. A full probe: every link measured, its figure from CUDA
   events against a 1 GiB transfer timed the same way (within 25 %), every operation
   completed, each pair group freed, contexts only on the rank's own GPU. Then a probe
   that rank 1 cancels once its transfers are under way: both ranks answer within a few
   seconds, nothing left posted (posted = completed + drained), the group freed, and
   the job's own ``all_reduce`` still right afterwards.

Run alone: ``python benchmarks/gpu_check_probe.py`` (exit 1 on a FAIL, 2 without CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPT = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(SCRIPT))
#: Wall-clock limit of one subprocess job (seconds).
JOB_S = 45.0
MiB = 1 << 20


# ---- the sections (gpu_check's process) ---------------------------------------------


def sections(torch: Any, ui: Any) -> list[tuple[str, Callable[[], None]]]:
    """gpu_check's sections for the link probe (see the module doc)."""
    return [
        ("probe: device", lambda: device_check(torch, ui)),
        ("probe: pair group on one GPU", lambda: self_pair_check(torch, ui)),
        ("probe: two ranks", lambda: two_rank_check(torch, ui)),
    ]


def _devices(torch: Any) -> int:
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def device_check(torch: Any, ui: Any) -> None:
    name = "probe device, no set_device"
    n = _devices(torch)
    if n == 0:
        ui.skip(name, "no CUDA device")
        return
    res, why = _job("device", 1)
    if res is None:
        ui.check(name, False, why)
        return
    r = res[0]
    ui.say(f"model on cuda:{r['model']}, training thread on cuda:{r['current']}, probe "
           f"device {r['probe_device']}, contexts (NVML) on {r['contexts']}")
    if r.get("error"):
        ui.check(name, False, r["error"])
        return
    ok = r["probe_device"] == f"cuda:{n - 1}"
    ctx_ok = r["contexts"] is None or set(r["contexts"]) <= {n - 1}
    ui.check(name, ok and ctx_ok,
             (f"the probe takes the model's GPU cuda:{n - 1}" if ok else
              f"the probe took {r['probe_device']}, the model is on cuda:{n - 1}")
             + ("" if ctx_ok else f"; contexts on {r['contexts']}")
             + ("" if r["contexts"] is not None else "; NVML unavailable: contexts "
                "not checked")
             + (" (one GPU: the model's and the default device are the same one, so this "
                "shows the path runs, not that it picks right)" if n == 1 else ""))


def self_pair_check(torch: Any, ui: Any) -> None:
    name = "probe pair group, events, freeing"
    if _devices(torch) == 0:
        ui.skip(name, "no CUDA device")
        return
    res, why = _job("selfpair", 1)
    if res is None:
        ui.check(name, False, why)
        return
    r = res[0]
    if r.get("error"):
        ui.check(name, False, r["error"])
        return
    ui.say(f"64 MiB to itself: events {r['event_s'] * 1e6:.0f} µs, host clock "
           f"{r['host_s'] * 1e6:.0f} µs; {r['event_Bps'] / 1e9:.1f} GB/s from events; "
           f"communicator {r['comm_bytes'] / MiB:.0f} MiB, "
           f"{r['freed_bytes'] / MiB:.0f} MiB back after shutdown")
    problems = []
    if not 0 < r["event_s"] <= r["host_s"]:
        problems.append("events read no less than the host's clock")
    if r["event_Bps"] < 10e9:
        problems.append(f"{r['event_Bps'] / 1e9:.1f} GB/s is implausibly low for one GPU")
    if not r["data_ok"]:
        problems.append("what arrived is not what was sent")
    if r["left_bytes"] > 64 * MiB:
        problems.append(f"{r['left_bytes'] / MiB:.0f} MiB not given back by shutdown()")
    ui.check(name, not problems, "; ".join(problems) or
             "the pair group is made, timed by events on the probe's stream and freed")


def two_rank_check(torch: Any, ui: Any) -> None:
    name = "probe over two GPUs"
    n = _devices(torch)
    if n == 0:
        ui.skip(name, "no CUDA device")
        return
    if n < 2:
        ui.skip(name, f"{n} GPU: NCCL refuses two ranks of one communicator on one GPU "
                "(\"duplicate GPU\"), and one rank has no link to probe")
        return
    res, why = _job("pair", 2)
    if res is None:
        ui.check(name, False, why)
        return
    for r in res:
        ui.say(f"rank {r['rank']}: {r.get('answer')}; reference "
               f"{(r.get('reference_Bps') or 0) / 1e9:.1f} GB/s; counts {r.get('counts')}; "
               f"cancelled: {r.get('cancel_answer')} in {r.get('cancel_s', 0):.2f} s, "
               f"counts {r.get('cancel_counts')}; contexts {r.get('contexts')}")
    problems = []
    for r in res:
        k = r["rank"]
        if r.get("error"):
            problems.append(f"rank {k}: {r['error']}")
            continue
        a = r["answer"]
        if "links" not in a or len(a["links"]) != 1:
            problems.append(f"rank {k}: {a}")
        else:
            bps, ref = a["links"][0][1], r["reference_Bps"]
            if not 0.75 * ref <= bps <= 1.25 * ref:
                problems.append(f"rank {k}: {bps / 1e9:.1f} GB/s from the probe, "
                                f"{ref / 1e9:.1f} GB/s from a 1 GiB transfer")
        for label, c in (("probe", r["counts"]), ("cancelled probe", r["cancel_counts"])):
            if c["posted"] != c["completed"] + c["drained"] or c["groups"] != \
                    c["groups_freed"]:
                problems.append(f"rank {k}, {label}: {c}")
        if "error" not in r["cancel_answer"]:
            problems.append(f"rank {k}: the cancelled probe answered {r['cancel_answer']}")
        if r["cancel_s"] > 5.0:
            problems.append(f"rank {k}: the cancelled probe took {r['cancel_s']:.1f} s")
        if not r["allreduce_ok"]:
            problems.append(f"rank {k}: the job's all_reduce after the probe was wrong")
        if r["contexts"] is not None and set(r["contexts"]) != {k}:
            problems.append(f"rank {k}: contexts on {r['contexts']}")
    ui.check(name, not problems, "; ".join(problems)[:600] or
             "links from events match a 1 GiB transfer; nothing left posted, groups freed, "
             "after a cancel too; the job's all_reduce intact")


# ---- subprocess jobs ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(mode: str, world: int, extra: list[str] | None = None
         ) -> tuple[list[dict[str, Any]] | None, str]:
    """Run ``world`` workers of ``mode``; their results (by rank), or None and why."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="rtop-gpu-probe-") as out:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "RTOP_AUTOHUB": "0"}
        procs = []
        for r in range(world):
            log = open(os.path.join(out, f"log{r}"), "wb")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen(
                [sys.executable, SCRIPT, "--worker", mode, "--rank", str(r), "--world",
                 str(world), "--port", str(port), "--out", out, *(extra or [])],
                stdout=log, stderr=subprocess.STDOUT, env=env), log))
        deadline = time.monotonic() + JOB_S
        timed_out = False
        for p, log in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                p.kill()
                p.wait(5)
            log.close()
        results: list[dict[str, Any]] = []
        for r, (p, _) in enumerate(procs):
            path = Path(out, f"result{r}.json")
            if not path.exists():
                tail = Path(out, f"log{r}").read_text(errors="replace").strip()
                tail = tail.splitlines()[-1] if tail else "(no output)"
                how = f"ran past {JOB_S:g} s" if timed_out else f"exited {p.returncode}"
                return None, f"rank {r} {how} without a result: {tail}"[:400]
            results.append(json.loads(path.read_text()))
        return results, ""


def _contexts(pid: int) -> list[int] | None:
    """GPUs on which NVML lists ``pid`` among compute processes (None: no NVML)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            if pid in {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}:
                out.append(i)
        return _torch_indices(out)
    except Exception:
        return None


def _torch_indices(nvml: list[int]) -> list[int]:
    """NVML's device indices as torch numbers them (``CUDA_VISIBLE_DEVICES`` of plain
    indices; anything else is left as it is)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not visible:
        return nvml
    try:
        order = [int(x) for x in visible.split(",") if x.strip()]
    except ValueError:
        return nvml
    return [order.index(i) for i in nvml if i in order]


# ---- workers (one rank each) ------------------------------------------------------------


def _worker_device(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import collectors
    from collectors.control import Control
    from collectors.identity import detect
    from collectors.linkprobe import probe_memory

    n = torch.cuda.device_count()
    dist.init_process_group("nccl", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{args.port}")
    try:
        model = torch.nn.Linear(64, 64).to(f"cuda:{n - 1}")  # never set_device
        probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None),
                                 start_sender=False)
        try:
            probe.watch(model)
            device, _ = Control(probe, wake=lambda: None)._probe_device()
            where, free = probe_memory(device)
            contexts = _contexts(os.getpid())  # before anything else touches a device
            return {"model": n - 1, "current": torch.cuda.current_device(),
                    "probe_device": str(device), "free": free, "where": where,
                    "contexts": contexts}
        finally:
            probe.close(0.5)
    finally:
        dist.destroy_process_group()


def _worker_selfpair(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from collectors.linkprobe import block_current_stream, nccl_pair_group

    d = torch.cuda.device_count() - 1
    nbytes = 64 * MiB
    with torch.cuda.device(d):
        send = torch.ones(nbytes, dtype=torch.uint8, device=d)
        recv = torch.zeros(nbytes, dtype=torch.uint8, device=d)
        torch.cuda.synchronize(d)
        free0, _ = torch.cuda.mem_get_info(d)
        pg = nccl_pair_group(dist, dist.PrefixStore("self/", dist.HashStore()), 0, 1)
        stream = torch.cuda.Stream(device=d)

        def once() -> tuple[float, float]:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                start.record(stream)
                try:
                    pg._start_coalescing()
                except TypeError:
                    pg._start_coalescing(torch.device("cuda", d))
                pg.send([send], 0, 0)
                pg.recv([recv], 0, 0)
                try:
                    work = pg._end_coalescing()
                except TypeError:
                    work = pg._end_coalescing(torch.device("cuda", d))
                block_current_stream(work)
                end.record(stream)
            deadline = time.monotonic() + 20
            while not (work.is_completed() and end.query()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the self transfer did not complete in 20 s")
                time.sleep(5e-5)
            host = time.perf_counter() - t0
            return start.elapsed_time(end) / 1000.0, host

        once()  # creates the communicator, connects
        torch.cuda.synchronize(d)
        free1, _ = torch.cuda.mem_get_info(d)
        best = min(once() for _ in range(5))
        ok = bool(torch.equal(recv, send))
        pg.shutdown()
        torch.cuda.synchronize(d)
        free2, _ = torch.cuda.mem_get_info(d)
    return {"event_s": best[0], "host_s": best[1], "event_Bps": nbytes / best[0],
            "comm_bytes": max(0, free0 - free1), "freed_bytes": max(0, free2 - free1),
            "left_bytes": max(0, free0 - free2), "data_ok": ok}


def _worker_pair(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from collectors.linkprobe import LinkProbe, block_current_stream, plan

    rank, cpu = args.rank, args.cpu
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=2)
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)  # never set_device
    try:
        answers: list[dict[str, Any]] = []
        probe = LinkProbe(rank, plan(["node", "node"]), 64 * MiB, answers.append, reps=3,
                          timeout_s=10.0, device=device, probe_id=1)
        probe.at_boundary(0)
        out: dict[str, Any] = {"answer": answers[0], "counts": dict(probe.counts)}
        # the reference: 1 GiB from rank 0 to rank 1, timed the same way (events)
        ref = (256 if cpu else 1024) * MiB
        big = torch.ones(ref, dtype=torch.uint8, device=device)
        if not cpu:
            stream = torch.cuda.Stream(device=device)
            with torch.cuda.device(rank), torch.cuda.stream(stream):
                dist.barrier(device_ids=[rank])
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                work = dist.isend(big, 1) if rank == 0 else dist.irecv(big, 0)
                block_current_stream(work)
                end.record(stream)
                end.synchronize()
                out["reference_Bps"] = ref / (start.elapsed_time(end) / 1000.0)
        else:
            dist.barrier()
            t0 = time.perf_counter()
            (dist.send(big, 1) if rank == 0 else dist.recv(big, 0))
            out["reference_Bps"] = ref / (time.perf_counter() - t0)
        del big
        dist.barrier(**({} if cpu else {"device_ids": [rank]}))
        # a probe rank 1 cancels once its transfers are under way
        cancel: list[dict[str, Any]] = []
        again = LinkProbe(rank, plan(["node", "node"]), 64 * MiB, cancel.append, reps=20,
                          timeout_s=10.0, device=device, probe_id=2)

        def cancel_soon() -> None:
            deadline = time.monotonic() + 10
            while again.counts["posted"] < 8 and time.monotonic() < deadline:
                time.sleep(1e-4)
            again.abort("cancelled by the check")

        if rank == 1:
            threading.Thread(target=cancel_soon, daemon=True).start()
        t0 = time.monotonic()
        again.at_boundary(0)
        out["cancel_s"] = time.monotonic() - t0
        out["cancel_answer"] = cancel[0]
        out["cancel_counts"] = dict(again.counts)
        x = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(x)
        if not cpu:
            torch.cuda.synchronize(device)
        out["allreduce_ok"] = bool((x == 3.0).all())
        out["contexts"] = None if cpu else _contexts(os.getpid())
        return out
    finally:
        dist.destroy_process_group()


WORKERS = {"device": _worker_device, "selfpair": _worker_selfpair, "pair": _worker_pair}


def worker_main(args: argparse.Namespace) -> int:
    """One rank of a subprocess job: writes ``result<rank>.json`` into ``--out``."""
    try:
        result = WORKERS[args.worker](args)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    result["rank"] = args.rank
    Path(args.out, f"result{args.rank}.json").write_text(json.dumps(result, default=str))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    # the "pair" worker over gloo on the CPU: this script's plumbing without a GPU
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check_probe: no CUDA device here", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check_collectives import PlainUI

    ui = PlainUI()
    for label, fn in sections(torch, ui):
        print(label, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            try:
                fn()
            except Exception as exc:
                ui.check(label, False, f"the section raised {type(exc).__name__}: {exc}")
    return 1 if ui.failed else 0


if __name__ == "__main__":
    sys.exit(main())
