"""GPU sections of ``benchmarks/gpu_check.py``: collective timing and CUDA graphs on one
GPU (issue 25, findings 3, 4, 5, 6 and 11), what ``tests/fakecuda.py`` can only fake.

``sections(torch, ui)`` returns ``(label, fn)`` pairs; ``gpu_check.main`` runs them after
it has initialised a one-rank NCCL process group and called ``torch.cuda.set_device(0)``.
Every check ends PASS, FAIL or SKIP (with a reason) through ``ui.check`` / ``ui.skip``;
``ui.say`` prints a detail line. Each section takes well under 20 s on an H200.

1. NCCL, synchronous and asynchronous: on the one-rank NCCL group, an out-of-place
   ``all_gather_into_tensor`` (one rank: a device copy, so it takes GPU time) and an
   ``all_reduce``, each synchronous (since torch 2.12: on the caller's stream, no Work)
   and asynchronous (waited on after some compute), inside instrumented steps. The
   synchronous ones must be exposed throughout (``comm_exposed_s`` measured, not 0,
   equal to ``comm_s`` and to CUDA events recorded around the call); the asynchronous
   ones measured with ``0 <= comm_exposed_s <= comm_s``; every record consistent
   (``compute_s + comm_exposed_s = gpu_s``).
2. FSDP2: a one-rank ``fully_shard`` model trains a few instrumented steps. One rank
   runs no collective (FSDP2 copies instead), but it still waits on its streams'
   events: rtop's ``Stream.wait_event`` hook must leave the parameters bit-identical to
   an unwatched run, give the method back on close, and keep every record measured.
   Then FSDP2's own wait pattern with a real NCCL collective: a synchronous all-gather
   on a side stream, compute beside it, and ``current_stream().wait_event`` on its
   event: the exposed time must match the stall CUDA events measure around that wait.
3. CUDA graph: steps, then a ``torch.cuda.graph`` capture in the default ("global")
   mode held open while rtop's sender thread runs (it must query nothing: a query then
   invalidates the capture), then replays, each inside ``probe.step()``: no capture
   error, rtop saw the capture, CUDA timing still on, and each replay's ``gpu_s`` within
   10% of CUDA events recorded around it (read back from an in-process hub). A graph
   that captured an NCCL all-reduce: its replays' collectives are not measured (None).
4. No ``set_device``, on whatever devices exist: a subprocess puts its model on the last
   GPU without ever calling ``torch.cuda.set_device`` and runs instrumented steps with
   NCCL collectives, a profile capture and rtop's sender thread; the same script
   without rtop is the control. Every CUDA context the process opens must be one the
   control opens too (with rtop's sender, exactly one device: the model's).

Run alone (``python benchmarks/gpu_check_collectives.py``) it runs the sections with a
plain printer; without CUDA each section says SKIP.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The note a probe leaves when it turned a feature off after an internal failure.
TURNED_OFF = "rtop turned off"
#: Tolerance of a GPU figure against CUDA events recorded around the same work.
REL_TOL = 0.10
ABS_TOL_S = 20e-6


def sections(torch: Any, ui: Any) -> list[tuple[str, Callable[[], None]]]:
    """The sections, as ``gpu_check.main`` runs them (see the module doc)."""
    return [
        ("C1. NCCL sync and async", lambda: nccl_check(torch, ui)),
        ("C2. FSDP2", lambda: fsdp2_check(torch, ui)),
        ("C3. CUDA graph", lambda: graph_check(torch, ui)),
        ("C4. no set_device", lambda: no_set_device_check(torch, ui)),
    ]


# ---- helpers --------------------------------------------------------------------------

def _close(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) <= max(ABS_TOL_S, REL_TOL * abs(b))


def _cuda_nccl(torch: Any, ui: Any, name: str) -> bool:
    """Whether this machine has CUDA and the one-rank NCCL group gpu_check made."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        ui.skip(name, "no CUDA device")
        return False
    if not dist.is_initialized() or "nccl" not in str(dist.get_backend()).lower():
        ui.skip(name, "no NCCL process group initialised (gpu_check.main makes one)")
        return False
    return True


def _probe(**settings: Any) -> Any:
    import collectors
    from collectors.identity import detect

    cfg = collectors.ProbeConfig(**{"hub": None, **settings})
    return collectors.Probe(detect(), cfg, start_sender=settings.get("hub") is not None)


def _drain(torch: Any, probe: Any) -> list[dict[str, Any]]:
    """Every step record of the probe's finished steps (the GPU synchronised first: the
    check's clock, not the probe's), as the sender thread makes them."""
    from collectors.schema import STEP_FIELDS
    from collectors.steps import StepRecords

    torch.cuda.synchronize()
    rows = StepRecords(probe.config.cuda_resolve_timeout_s).drain(
        probe.records, probe.cuda, world=probe.comm.world, nbytes=probe.comm.nbytes,
        now=time.monotonic(), final=True)
    return [dict(zip(STEP_FIELDS, r, strict=True)) for r in rows]


def _notes_ok(ui: Any, label: str, probe: Any) -> None:
    bad = [n for n in probe.notes if TURNED_OFF in n]
    failure = getattr(probe.cuda, "failure", None) if probe.cuda is not None else None
    ui.check(f"{label}: nothing turned off", not bad and failure is None,
             (bad[0] if bad else failure) or f"{len(probe.notes)} notes")


def _consistent(ui: Any, label: str, rows: list[dict[str, Any]]) -> None:
    """Every figure measured; ``compute_s + comm_exposed_s = gpu_s``; exposed <= comm."""
    bad = []
    for r in rows:
        g, c, e, k = r["gpu_s"], r["compute_s"], r["comm_exposed_s"], r["comm_s"]
        if None in (g, c, e, k):
            bad.append(f"step {r['step']}: not measured ({g}, {c}, {k}, {e})")
        elif not (_close(c + e, g) and e <= k * 1.05 + ABS_TOL_S):
            bad.append(f"step {r['step']}: gpu {g:.6f} compute {c:.6f} comm {k:.6f} "
                       f"exposed {e:.6f}")
    ui.check(f"{label}: step figures consistent", bool(rows) and not bad,
             bad[0] if bad else f"{len(rows)} steps")


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.3f} ms"


# ---- 1. NCCL, synchronous and asynchronous ----------------------------------------------

def nccl_check(torch: Any, ui: Any) -> None:
    """Section 1 (module doc)."""
    import torch.distributed as dist

    if not _cuda_nccl(torch, ui, "NCCL sync and async"):
        return
    ui.say("C1. one-rank NCCL: synchronous and asynchronous collectives inside steps")
    group = dist.group.WORLD
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    probe_buf = torch.ones(16, device="cuda")
    returned = group.allreduce([probe_buf], opts)
    ui.say(f"this torch's NCCL, a synchronous allreduce at the process group returns: "
           f"{'no Work (torch >= 2.12 rule)' if returned is None else type(returned).__name__}")
    if returned is not None:
        returned.wait()
    torch.cuda.synchronize()

    model = torch.nn.Linear(1024, 1024).cuda()
    a = torch.randn(4096, 4096, device="cuda")
    n = 32 << 20  # 128 MiB
    src, out, buf = (torch.ones(n, device="cuda"), torch.empty(n, device="cuda"),
                     torch.ones(n, device="cuda"))
    probe = _probe()
    probe.watch(model)
    ui.check("C1: event pool on the model's device", getattr(probe.cuda, "device", None) == 0,
             f"probe.cuda.device = {getattr(probe.cuda, 'device', None)}")

    def compute() -> None:
        a.matmul(a)

    kinds = {
        "sync all_gather": lambda: dist.all_gather_into_tensor(out, src),
        "sync all_reduce": lambda: dist.all_reduce(buf),
        "async all_gather": lambda: dist.all_gather_into_tensor(out, src, async_op=True),
        "async all_reduce": lambda: dist.all_reduce(buf, async_op=True),
    }
    results: dict[str, tuple[list[dict[str, Any]], list[float]]] = {}
    try:
        for kind, call in kinds.items():
            for _ in range(2):  # warm-up, not measured
                with probe.step():
                    compute()
                    work = call()
                    if work is not None:
                        work.wait()
            _drain(torch, probe)
            refs = []
            for _ in range(5):
                e0, e1 = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
                with probe.step():
                    compute()
                    e0.record()
                    work = call()
                    if work is None:
                        e1.record()  # on this stream it ran: its end
                    compute()
                    if work is not None:
                        work.wait()
                        e1.record()
                refs.append((e0, e1))
            rows = _drain(torch, probe)
            results[kind] = (rows, [x.elapsed_time(y) / 1e3 for x, y in refs])
    finally:
        probe.close(1.0)
    for kind, (rows, ref) in results.items():
        comm = [r["comm_s"] for r in rows]
        exposed = [r["comm_exposed_s"] for r in rows]
        ui.say(f"{kind}: comm {', '.join(_ms(c) for c in comm)}; exposed "
               f"{', '.join(_ms(e) for e in exposed)}; events around it "
               f"{', '.join(_ms(x) for x in ref)}")
        measured = bool(rows) and all(c is not None and e is not None
                                      for c, e in zip(comm, exposed, strict=True))
        ui.check(f"C1 {kind}: comm and exposed comm measured", measured,
                 f"{len(rows)} steps" if measured else "a figure was None")
        if not measured:
            continue
        if kind.startswith("sync"):
            moved = statistics.median(ref) > ABS_TOL_S  # one rank in place may do nothing
            if kind == "sync all_gather" or moved:
                ui.check(f"C1 {kind}: exposed throughout, not 0",
                         all(e > 0 and _close(e, c) for c, e in zip(comm, exposed,
                                                                    strict=True)),
                         f"median exposed {_ms(statistics.median(exposed))}, comm "
                         f"{_ms(statistics.median(comm))}")
                ui.check(f"C1 {kind}: comm_s matches CUDA events around the call",
                         all(_close(c, x) for c, x in zip(comm, ref, strict=True)),
                         f"median {_ms(statistics.median(comm))} vs "
                         f"{_ms(statistics.median(ref))} (events)")
            else:
                ui.skip(f"C1 {kind}: exposed throughout, not 0",
                        f"a one-rank in-place all_reduce took {_ms(statistics.median(ref))} "
                        f"on the GPU (NCCL did no work); measured: "
                        f"{_ms(statistics.median(exposed))}")
        else:
            ui.check(f"C1 {kind}: 0 <= exposed <= comm",
                     all(0 <= e <= c * 1.05 + ABS_TOL_S for c, e in zip(comm, exposed,
                                                                        strict=True)),
                     f"median exposed {_ms(statistics.median(exposed))} of "
                     f"{_ms(statistics.median(comm))}")
        _consistent(ui, f"C1 {kind}", rows)
    _notes_ok(ui, "C1", probe)


# ---- 2. FSDP2 ----------------------------------------------------------------------------

def _fsdp2_model(torch: Any, fully_shard: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _fsdp2_steps(torch: Any, model: Any, probe: Any, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(256, 1024, device="cuda", generator=g)
        with probe.step() if probe is not None else contextlib.nullcontext():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()


def fsdp2_check(torch: Any, ui: Any) -> None:
    """Section 2 (module doc)."""
    import torch.distributed as dist

    if not _cuda_nccl(torch, ui, "FSDP2 step"):
        return
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:
        ui.skip("FSDP2 step", f"this torch has no fully_shard ({exc})")
        return
    ui.say("C2. a one-rank FSDP2 model under rtop; FSDP2's wait pattern with NCCL")
    ref = _fsdp2_model(torch, fully_shard)
    _fsdp2_steps(torch, ref, None, 6)
    model = _fsdp2_model(torch, fully_shard)
    probe = _probe()
    probe.watch(model)
    hooked = getattr(torch.cuda.Stream.wait_event, "__module__", "") == "collectors.collectives"
    try:
        _fsdp2_steps(torch, model, probe, 6)
        rows = _drain(torch, probe)
    finally:
        probe.close(1.0)
    ui.check("C2: Stream.wait_event timed while watched, given back on close",
             hooked and torch.cuda.Stream.wait_event.__module__ != "collectors.collectives",
             f"during: {'rtop' if hooked else 'torch'}'s; after: "
             f"{torch.cuda.Stream.wait_event.__module__}")
    same = all(torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a,
                           b.full_tensor() if hasattr(b, "full_tensor") else b)
               for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    ui.check("C2: parameters bit-identical to the unwatched FSDP2 run", same, "6 steps")
    ui.check("C2: a gpu_s and comm figures per step",
             len(rows) == 6 and all(r["gpu_s"] is not None and r["comm_s"] is not None
                                    for r in rows),
             f"gpu {_ms(rows[-1]['gpu_s'] if rows else None)}, comm "
             f"{_ms(rows[-1]['comm_s'] if rows else None)} (one rank: FSDP2 runs no "
             f"collective)")
    _consistent(ui, "C2", rows)
    _notes_ok(ui, "C2", probe)

    # FSDP2's wait pattern (foreach_all_gather / foreach_all_gather_copy_out) with NCCL
    n = 32 << 20
    src, out = torch.ones(n, device="cuda"), torch.empty(n, device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    probe = _probe()
    probe.watch(torch.nn.Linear(8, 8).cuda())
    side = torch.cuda.Stream()
    stalls = []
    try:
        for i in range(7):
            w0, w1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with probe.step():
                a.matmul(a)
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    dist.all_gather_into_tensor(out, src)
                    event = side.record_event()
                a.matmul(a)  # beside the all-gather
                w0.record()
                main.wait_event(event)
                w1.record()
                a.matmul(a)
            if i:
                stalls.append((w0, w1))
            else:
                _drain(torch, probe)  # the first: warm-up
        rows = _drain(torch, probe)
    finally:
        probe.close(1.0)
    stall = [x.elapsed_time(y) / 1e3 for x, y in stalls]
    exposed = [r["comm_exposed_s"] for r in rows]
    ui.say(f"wait_event stall (events) {', '.join(_ms(s) for s in stall)}; rtop's exposed "
           f"{', '.join(_ms(e) for e in exposed)}")
    ui.check("C2: FSDP2's wait_event on an NCCL all-gather is exposed comm",
             len(rows) == len(stall) and all(_close(e, s) for e, s in zip(exposed, stall,
                                                                         strict=True)),
             f"median {_ms(statistics.median(exposed)) if exposed else 'n/a'} vs "
             f"{_ms(statistics.median(stall)) if stall else 'n/a'} stalled (events)")
    _consistent(ui, "C2 wait pattern", rows)


# ---- 3. CUDA graph -------------------------------------------------------------------------

def _hub_rows(hub: Any, rank: int) -> list[dict[str, Any]]:
    """The step rows the in-process hub holds for ``rank``."""
    fields = ("step", "gpu_s", "compute_s", "comm_s", "comm_exposed_s")

    def read(h: Any) -> list[dict[str, Any]]:
        state = h.state
        rs = state.rank_state(rank)
        if rs is None or rs.slot is None:
            return []
        cols = [state.steps.history(f, rs.slot).tolist() for f in fields]
        return [{f: (None if v is None or v != v else v) for f, v in zip(fields, vals,
                                                                          strict=True)}
                for vals in zip(*cols, strict=True)]

    rows: list[dict[str, Any]] = hub.call(read)
    return rows


def graph_check(torch: Any, ui: Any) -> None:
    """Section 3 (module doc)."""
    import torch.distributed as dist

    from collectors.cuda_events import CAPTURES
    from rtop.hub.service import ThreadedHub

    if not torch.cuda.is_available():
        ui.skip("CUDA graph", "no CUDA device")
        return
    ui.say("C3. a CUDA graph captured (global mode) while rtop's sender runs, then replayed")
    hub = ThreadedHub(record="").start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda()
    static_x = torch.randn(1024, 2048, device="cuda")
    probe = _probe(hub=hub.address, token=hub.token, flush_interval_s=0.05,
                   sample_interval_s=0.1)
    err: str | None = None
    refs = []
    try:
        probe.watch(model)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():  # warm-up on a side stream (docs)
            for _ in range(3):
                model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            for _ in range(5):  # steps the sender is still reading when the capture starts
                with probe.step():
                    model(static_x)
        graph = torch.cuda.CUDAGraph()
        seen = CAPTURES.seen
        try:
            with torch.no_grad(), torch.cuda.graph(graph):
                static_y = model(static_x)
                time.sleep(0.3)  # several of the sender's rounds
        except Exception as exc:
            err = f"{type(exc).__name__}: {str(exc)[:200]}"
        ui.check("C3: the capture is not disturbed (no capture error)", err is None,
                 err or "captured while the sender ran")
        ui.check("C3: rtop saw the capture begin", CAPTURES.seen > seen,
                 f"captures seen: {CAPTURES.seen - seen}, mode {CAPTURES.mode}")
        if err is None:
            for _ in range(10):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                e0.record()
                with probe.step():
                    static_x.normal_()
                    graph.replay()
                e1.record()
                refs.append((e0, e1))
            torch.cuda.synchronize()
            del static_y
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_hub_rows(hub, 0)) < 5 + len(refs):
            time.sleep(0.1)
        pool_failure = getattr(probe.cuda, "failure", "CUDA timing off") \
            if probe.cuda is not None else "CUDA timing off"
        ui.check("C3: CUDA timing still on after the capture", pool_failure is None,
                 pool_failure or "the event pool never failed")
    finally:
        probe.close(2.0)
    rows = _hub_rows(hub, 0)
    hub.stop()
    _notes_ok(ui, "C3", probe)
    if err is not None:
        ui.skip("C3: replays timed as steps", "the capture failed")
        return
    ref = [x.elapsed_time(y) / 1e3 for x, y in refs]
    replays = [r["gpu_s"] for r in rows[-len(ref):]] if len(rows) >= len(ref) else []
    timed = [g for g in replays if g is not None]
    ui.check("C3: each replay is a step with gpu_s within 10% of CUDA events",
             len(replays) == len(ref) and all(_close(g, x) for g, x in zip(replays, ref,
                                                                          strict=True)),
             f"{len(timed)} of {len(ref)} replays timed; median "
             f"{_ms(statistics.median(timed) if timed else None)} vs "
             f"{_ms(statistics.median(ref)) if ref else 'n/a'} (events)")

    # a graph that captured an NCCL all-reduce: its replays' collectives are not measured
    if not dist.is_initialized() or "nccl" not in str(dist.get_backend()).lower():
        ui.skip("C3: a replayed NCCL collective is not measured", "no NCCL process group")
        return
    buf = torch.ones(1 << 20, device="cuda")
    # a group of its own: whatever a failed capture does to a communicator stays there
    pg = dist.new_group([0], backend="nccl")
    probe = _probe()
    probe.watch(torch.nn.Linear(8, 8).cuda())
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(buf, group=pg)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph):
                dist.all_reduce(buf, group=pg)
        except Exception as exc:
            ui.skip("C3: a replayed NCCL collective is not measured",
                    f"this NCCL cannot be captured: {type(exc).__name__}: {str(exc)[:160]}")
            return
        _drain(torch, probe)
        for _ in range(3):
            with probe.step():
                graph.replay()
        rows = _drain(torch, probe)
    finally:
        probe.close(1.0)
        torch.cuda.synchronize()
        with contextlib.suppress(Exception):
            graph.reset()  # its kernels use the group's communicator
        with contextlib.suppress(Exception):
            dist.destroy_process_group(pg)
    ui.check("C3: a replayed NCCL collective is not measured (None, never 0)",
             len(rows) == 3 and all(r["comm_s"] is None and r["gpu_s"] is not None
                                    for r in rows),
             f"comm_s {[r['comm_s'] for r in rows]}, gpu_s "
             f"{[_ms(r['gpu_s']) for r in rows]}")


# ---- 4. no set_device ---------------------------------------------------------------------

NO_SET_DEVICE = r"""
import json, os, socket, sys, tempfile, time
import torch
import torch.distributed as dist

rtop = sys.argv[1] == "rtop"
n = torch.cuda.device_count()
dev = torch.device("cuda", n - 1)  # never torch.cuda.set_device
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
kw = {}
import inspect
if "device_id" in inspect.signature(dist.init_process_group).parameters:
    kw["device_id"] = dev
dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}",
                        **kw)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 1024)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 1024, device=dev)
t = torch.ones(1 << 20, device=dev)
out = {"device": n - 1}
if rtop:
    import collectors
    from collectors.identity import detect
    from collectors.profiler import ProfileCapture
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None,
                             flush_interval_s=0.05, sample_interval_s=0.1))
    probe.watch(model, opt)
    answers = []
    cap = ProfileCapture(tempfile.mkdtemp(), "rank0", 3, 0, answers.append,
                         device=probe.model_device())
    step = probe.step
else:
    import contextlib
    step = contextlib.nullcontext
done = False
for i in range(12):
    with step():
        model(x).square().mean().backward()
        dist.all_reduce(t)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        opt.step()
        opt.zero_grad()
    if rtop and i >= 4 and not done:
        done = cap.at_boundary(i)
if rtop:
    time.sleep(1.0)  # the sender reads the steps' events
    out["pool_device"] = getattr(probe.cuda, "device", None)
    out["turned_off"] = [m for m in probe.notes if "rtop turned off" in m]
    out["profile"] = answers[0] if answers else None
    probe.close(2.0)
torch.cuda.synchronize(dev)
has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
out["contexts"] = [i for i in range(n) if has(i)] if has is not None else None
dist.destroy_process_group()
print("RESULT " + json.dumps(out, default=str))
"""


def _no_set_device_run(mode: str) -> tuple[dict[str, Any] | None, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RTOP_AUTOHUB="0")
    try:
        proc = subprocess.run([sys.executable, "-c", NO_SET_DEVICE, mode], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None, "timed out after 60 s"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT "):])
            return result, ""
    return None, f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]}"


def no_set_device_check(torch: Any, ui: Any) -> None:
    """Section 4 (module doc)."""
    if not torch.cuda.is_available():
        ui.skip("no set_device", "no CUDA device")
        return
    n = torch.cuda.device_count()
    ui.say(f"C4. no set_device: model on cuda:{n - 1} of {n}, with and without rtop "
           f"(subprocesses)")
    bare, why_bare = _no_set_device_run("bare")
    inst, why = _no_set_device_run("rtop")
    if bare is None or inst is None:
        ui.check("C4: the no-set_device job runs", False, why_bare or why)
        return
    ui.say(f"contexts without rtop: {bare['contexts']}; with rtop: {inst['contexts']}")
    if inst["contexts"] is None:
        ui.skip("C4: CUDA contexts only where the job opens them",
                "this torch has no torch._C._cuda_hasPrimaryContext")
    else:
        ui.check("C4: CUDA contexts only where the job opens them",
                 set(inst["contexts"]) <= set(bare["contexts"]),
                 f"with rtop {inst['contexts']}, without {bare['contexts']}")
        ui.check("C4: the sender's CUDA contexts: exactly one device, the model's",
                 inst["contexts"] == [n - 1], f"devices with a context: {inst['contexts']}")
    ui.check("C4: event pool on the model's device", inst.get("pool_device") == n - 1,
             f"probe.cuda.device = {inst.get('pool_device')}")
    ui.check("C4: nothing turned off", not inst.get("turned_off"),
             (inst.get("turned_off") or ["no note"])[0])
    prof = inst.get("profile")
    ui.check("C4: a profile capture answers", isinstance(prof, dict) and not prof.get("error"),
             (prof or {}).get("error") or f"timeline {(prof or {}).get('timeline')}")


# ---- run alone --------------------------------------------------------------------------

class PlainUI:
    """``gpu_check``'s check/skip/say, for running this module alone."""

    def __init__(self) -> None:
        self.failed = 0

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.failed += not ok
        print(f"  {'PASS' if ok else 'FAIL':4}  {name}: {detail}", flush=True)

    def skip(self, name: str, why: str) -> None:
        print(f"  SKIP  {name}: {why}", flush=True)

    def say(self, line: str) -> None:
        print(f"     {line}", flush=True)


def main() -> int:
    """Run the sections alone (a one-rank NCCL group and set_device(0) first, as
    gpu_check.main does, where there is CUDA)."""
    import torch
    import torch.distributed as dist

    ui = PlainUI()
    made = False
    if torch.cuda.is_available() and not dist.is_initialized():
        with contextlib.closing(__import__("socket").socket()) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{port}")
        torch.cuda.set_device(0)
        made = True
    try:
        for label, fn in sections(torch, ui):
            print(label, flush=True)
            try:
                fn()
            except Exception as exc:
                ui.check(f"{label}: ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        if made:
            dist.destroy_process_group()
    return 1 if ui.failed else 0


if __name__ == "__main__":
    os.environ.setdefault("RTOP_AUTOHUB", "0")
    with tempfile.TemporaryDirectory():
        sys.exit(main())
