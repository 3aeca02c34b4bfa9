"""The collectors' GPU paths, checked on a real CUDA machine (one GPU is enough; with two
or more, the two-rank job and the NVLink load run too).

What this machine's tests can only fake (NVML, CUDA, NCCL), checked for real, in one
run of a couple of minutes on an H200:

1. NVML through the real GPU-mapping path: ``GpuSampler(local_rank=0)`` told
   ``use_cuda_device(0)`` must find the GPU torch calls ``cuda:0`` (same UUID, same PCI
   bus id), and so must ``NvmlSampler(uuid=...)`` and ``NvmlSampler(pci_bus_id=...)``.
   Every figure is printed and checked for sanity under a matmul load (memory total as
   torch says, power within its limit, SM clock within its max, utilization high);
   clock-event reasons are decoded idle and under load (``gpu_idle`` must not be among
   them under load); ``info()``'s ``pcie_window`` and ``mig`` are printed where present;
   ``NvmlSampler.process_memory()``, where it exists, must be at least torch's reserved
   memory while a model is loaded.
2. Two ranks (2+ GPUs; SKIP otherwise): a 2-rank NCCL DDP job in subprocesses (this
   script with ``--worker ddp2``), each rank doing ``model.to(rank)`` and
   ``DDP(model, device_ids=[rank])`` without ever calling ``torch.cuda.set_device``, as
   PyTorch's DDP tutorial does, instrumented with ``collectors.start`` / ``watch`` /
   ``iter`` / ``step`` and sending to an in-process hub. Checked: the job finishes;
   rank 1 opens no CUDA context on GPU 0 (its pid is not in NVML's compute processes of
   GPU 0, polled while it runs, with a control poll after bare steps before rtop
   starts); ``probe.cuda.device == 1`` after ``watch``; nothing turned off in the probe
   (its notes); rank 1's steps reach the hub with ``gpu_s`` measured and consistent,
   and the hub's metadata names GPU 1.
3. CUDA-event step timing: a 1-rank NCCL DDP job of large matmuls. The probe's ``gpu_s``
   per step is compared with CUDA events recorded independently around the same steps.
   The instrumented steps run under ``torch.cuda.set_sync_debug_mode("error")`` (after a
   control run of the bare step under it; if the bare step itself synchronizes, "warn"
   mode counts the synchronizing calls instead, and rtop may add none), and calls to
   ``torch.cuda.synchronize``, ``Event.synchronize``, ``Event.elapsed_time`` and
   ``Stream.synchronize`` made by the training thread inside steps are counted (0).
   The step records must be consistent: every figure present and non-negative,
   ``comm_exposed_s <= comm_s <= gpu_s`` (5% slack), ``compute_s + comm_exposed_s =
   gpu_s``.
4. The comm hook on CUDA (what CUDA models use): gradients bit-identical to plain DDP.
5. NVLink: active links from the sampler's ``info()["nvlink_links"]``, and NVLink tx/rx
   rates idle and under load (peer-to-peer copies to ``cuda:1``, with 2+ GPUs); SKIP
   where there is no NVLink or NVML cannot read its counters.
6. Overhead: the same job instrumented and not, in interleaved blocks; the ratio of
   median step times (target <= 1.01x).
7. A device-side assert as a rank's last step: a 1-rank job in a subprocess (``--worker
   assert``) trains a few instrumented steps, then indexes a CUDA tensor out of range
   inside ``with probe.step():`` and lets the error kill the process. It must exit
   non-zero, and the hub must have the rank's goodbye carrying the error (status
   ``failed``, the error naming the CUDA error), not merely "lost".
8. Issue 25's sections, from ``gpu_check_collectives.py`` (NCCL sync and async
   collectives with exposed comm measured, a one-rank FSDP2 step, a CUDA graph captured
   and replayed while the sender runs, the no-``set_device`` case with the process's
   contexts), ``gpu_check_profile.py`` (a profile with CUDA activity: GPU kernels in the
   trace, the GPU split against CUDA events; the profile's bounds on a GPU) and
   ``gpu_check_probe.py`` (the probe's device without ``set_device``, a pair group on one
   GPU timed by events and freed, a real 2-rank probe with 2+ GPUs); see each module.

Any "rtop turned off ..." note in a probe of these healthy runs is a FAIL.

    python benchmarks/gpu_check.py [--steps 40]

Prints one PASS/FAIL/SKIP line per check with a short detail, then a tally; exits 1 if
any check failed, 2 without CUDA. ``--worker`` is internal: one rank of a subprocess
job, started by the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCRIPT = str(Path(__file__).resolve())
#: Wall-clock limit of each subprocess job; a job that runs longer is killed and FAILs.
WORKER_TIMEOUT_S = 120.0
#: How long a worker waits for the parent to acknowledge a phase (its NVML poll).
ACK_TIMEOUT_S = 30.0
#: The note a probe leaves when it turned a feature off after an internal failure.
TURNED_OFF = "rtop turned off"

RESULTS: list[tuple[str, str, str]] = []


def report(status: str, name: str, detail: str) -> None:
    RESULTS.append((status, name, detail))
    print(f"  {status:4}  {name}: {detail}", flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    report("PASS" if ok else "FAIL", name, detail)


def skip(name: str, why: str) -> None:
    report("SKIP", name, why)


def say(line: str) -> None:
    print(f"     {line}", flush=True)


def first_line(text: str, limit: int = 240) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:limit]


def check_notes(label: str, notes: list[str], failure: str | None = None) -> None:
    """Print a probe's notes; any "rtop turned off" note (or an event-pool failure) FAILs."""
    for note in notes:
        say(f"note: {note}")
    bad = [n for n in notes if TURNED_OFF in n]
    if failure:
        bad.append(f"CUDA event pool failed: {failure}")
    check(f"{label}: nothing turned off", not bad,
          f"{len(notes)} notes, none turning a feature off" if not bad
          else " | ".join(bad)[:400])


# ---- step records -------------------------------------------------------------------

def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def consistency(label: str, rows: list[dict[str, Any]], slack: float = 0.05) -> None:
    """Check the CUDA-timed figures of step records against one another."""
    keys = ("gpu_s", "compute_s", "comm_s", "comm_exposed_s")
    bad: list[str] = []
    for r in rows:
        v = {k: r.get(k) for k in keys}
        step = r.get("step")
        where = f"step {int(step) if isinstance(step, (int, float)) else step}"
        missing = [k for k, x in v.items() if _missing(x)]
        if missing:
            bad.append(f"{where}: {', '.join(missing)} missing")
            continue
        g, c, e, k = v["gpu_s"], v["comm_s"], v["comm_exposed_s"], v["compute_s"]
        negative = [name for name, x in v.items() if x < 0]
        if negative:
            bad.append(f"{where}: {', '.join(negative)} negative")
        if e > c + 1e-6:
            bad.append(f"{where}: comm_exposed_s {e * 1e3:.3f} ms > comm_s {c * 1e3:.3f} ms")
        if c > g * (1 + slack) + 1e-6:
            bad.append(f"{where}: comm_s {c * 1e3:.3f} ms > gpu_s {g * 1e3:.3f} ms")
        if abs(k + e - g) > 1e-6 + 0.01 * g:
            bad.append(f"{where}: compute_s + comm_exposed_s = {(k + e) * 1e3:.3f} ms, "
                       f"gpu_s {g * 1e3:.3f} ms")
    ok = bool(rows) and not bad
    if rows and not bad:
        def med(key: str) -> float:
            return statistics.median(float(r[key]) for r in rows) * 1e3

        detail = (f"{len(rows)} steps; medians gpu_s {med('gpu_s'):.3f}, compute_s "
                  f"{med('compute_s'):.3f}, comm_s {med('comm_s'):.3f}, comm_exposed_s "
                  f"{med('comm_exposed_s'):.3f} ms")
    elif not rows:
        detail = "no step records"
    else:
        detail = f"{len(bad)} problems in {len(rows)} steps: " + "; ".join(bad[:3])
    check(f"{label}: step figures consistent", ok, detail)


# ---- NVML helpers -------------------------------------------------------------------

def torch_uuid(props: Any) -> str | None:
    """NVML's name for a torch device's UUID (``GPU-<uuid>``), if torch gives one."""
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text[:4].upper() in ("GPU-", "MIG-") else "GPU-" + text


def torch_pci(props: Any) -> str | None:
    """A torch device's PCI bus id, ``domain:bus:device.0`` in hex, if torch gives one."""
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    domain = getattr(props, "pci_domain_id", 0) or 0
    device = getattr(props, "pci_device_id", 0) or 0
    return f"{domain:08x}:{bus:02x}:{device:02x}.0"


def pci_key(text: Any) -> tuple[int, ...] | None:
    """A PCI bus id as numbers, whatever the zero padding and case."""
    m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)\s*",
                     str(text or ""))
    return tuple(int(g, 16) for g in m.groups()) if m else None


def same_uuid(a: Any, b: Any) -> bool:
    return bool(a) and bool(b) and str(a).strip().lower() == str(b).strip().lower()


def gpu_sample(sampler: Any) -> dict[str, Any] | None:
    """One GPU row from a ``GpuSampler`` (records) or an ``NvmlSampler`` (a row), as a dict."""
    from collectors.schema import GPU_FIELDS

    got = sampler.sample(time.time())
    if isinstance(got, list) and got and isinstance(got[0], tuple):
        got = got[-1][1]  # GpuSampler: [("gpu", row)]
    if not got:
        return None
    return dict(zip(GPU_FIELDS, got, strict=True))


class NvmlProcs:
    """The compute processes NVML lists on each CUDA device (pynvml, directly)."""

    def __init__(self, torch: Any) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handles: dict[int, Any] = {}
        for i in range(torch.cuda.device_count()):
            uuid = torch_uuid(torch.cuda.get_device_properties(i))
            try:
                self.handles[i] = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid
                                   else pynvml.nvmlDeviceGetHandleByIndex(i))
            except Exception as exc:
                say(f"NVML has no handle for cuda:{i}: {exc}")

    def pids(self, index: int) -> set[int] | None:
        handle = self.handles.get(index)
        if handle is None:
            return None
        try:
            return {int(p.pid) for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        except Exception:
            return None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


@contextlib.contextmanager
def matmul_load(torch: Any, seconds_before: float = 1.5) -> Iterator[list[BaseException]]:
    """Back-to-back large matmuls on cuda:0 on a thread, while the block runs."""
    a = torch.randn(8192, 8192, device="cuda:0")
    stop = threading.Event()
    errors: list[BaseException] = []

    def burn() -> None:
        try:
            while not stop.is_set():
                for _ in range(20):
                    a @ a
                torch.cuda.synchronize(0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=burn, daemon=True)
    t.start()
    time.sleep(seconds_before)
    try:
        yield errors
    finally:
        stop.set()
        t.join()


# ---- 1. NVML ------------------------------------------------------------------------

def nvml_check(torch: Any) -> None:
    from collectors.nvml import NvmlSampler, decode_reasons
    from collectors.samplers import GpuSampler

    print("\n1. NVML: the rank's own GPU, found the way the collectors find it (cuda:0)")
    props = torch.cuda.get_device_properties(0)
    t_uuid, t_bus = torch_uuid(props), torch_pci(props)
    say(f"torch cuda:0: {props.name}, {t_uuid}, PCI {t_bus}, "
        f"{props.total_memory / 2**30:.1f} GiB")
    gs = GpuSampler(local_rank=0)
    try:
        gs.use_cuda_device(0)
        first = gpu_sample(gs)
        facts = gs.info()
        check("GpuSampler.use_cuda_device(0) reads a GPU", facts is not None and first is not None,
              "NVML handle found, one row per sample" if facts is not None
              else "no NVML handle (pynvml installed? driver loaded?)")
        if facts is None:
            return
        for k, v in facts.items():
            say(f"info {k:22} {v}")
        for key in ("pcie_window", "mig"):
            say(f"info[{key!r}]: " + (repr(facts.get(key)) if key in facts
                                      else "(not reported by these collectors)"))
        n_uuid = facts.get("uuid")
        check("same GPU as torch: UUID", t_uuid is not None and same_uuid(n_uuid, t_uuid),
              f"NVML {n_uuid}, torch {t_uuid}")
        if t_bus is None:
            skip("same GPU as torch: PCI bus id", "torch gives no PCI bus id")
        else:
            n_bus = facts.get("pci_bus_id")
            check("same GPU as torch: PCI bus id",
                  pci_key(n_bus) is not None and pci_key(n_bus) == pci_key(t_bus),
                  f"NVML {n_bus}, torch {t_bus}")
        for label, value in (("uuid", t_uuid), ("pci_bus_id", t_bus)):
            name = f"NvmlSampler({label}=...) finds the same GPU"
            if value is None:
                skip(name, f"torch gives no {label}")
                continue
            s = NvmlSampler(**{label: value})
            try:
                got = (s.info() or {}).get("uuid") if s.available else None
                check(name, same_uuid(got, n_uuid), f"{label}={value}: {got or s.reason}")
            finally:
                s.close()
        total = facts.get("mem_total_bytes") or 0
        check("memory total matches torch", abs(total - props.total_memory) < 0.02 * total,
              f"NVML {total / 2**30:.1f} GiB, torch {props.total_memory / 2**30:.1f} GiB")

        time.sleep(1.0)
        idle = gpu_sample(gs)
        idle_mask = idle["clock_event_reasons"] if idle else None
        say(f"clock-event reasons, idle: {decode_reasons(idle_mask)} (mask {idle_mask})")
        model = torch.nn.Linear(8192, 8192, device="cuda:0")  # a model held for process memory
        with matmul_load(torch) as errors:
            gpu_sample(gs)
            time.sleep(1.0)
            row = gpu_sample(gs)
        check("load ran", not errors, repr(errors[0]) if errors else "matmuls on a thread")
        check("sample taken under load", row is not None, "one row per call")
        if row is None:
            return
        for k, v in row.items():
            say(f"{k:22} {v}")
        mask = row["clock_event_reasons"]
        reasons = decode_reasons(mask)
        say(f"clock-event reasons, under load: {reasons} (mask {mask})")
        if mask is None:
            skip("no gpu_idle reason under load", "NVML gives no clock-event reasons here")
        else:
            check("no gpu_idle reason under load", "gpu_idle" not in reasons, f"{reasons}")
        check("utilization under load", (row["util_pct"] or 0) >= 50, f"{row['util_pct']}%")
        check("power within limit", row["power_w"] is not None
              and row["power_limit_w"] is not None
              and 0 < row["power_w"] <= 1.1 * row["power_limit_w"],
              f"{row['power_w']} W of {row['power_limit_w']} W")
        check("SM clock within max", row["sm_clock_mhz"] is not None
              and 0 < row["sm_clock_mhz"] <= (row["sm_clock_max_mhz"] or 0),
              f"{row['sm_clock_mhz']} of {row['sm_clock_max_mhz']} MHz")
        check("memory used within total",
              0 < (row["mem_used_bytes"] or 0) <= (row["mem_total_bytes"] or 0),
              f"{(row['mem_used_bytes'] or 0) / 2**30:.1f} GiB used")
        process_memory_check(torch, t_uuid)
        del model
    finally:
        gs.close()


def process_memory_check(torch: Any, t_uuid: str | None) -> None:
    """``NvmlSampler.process_memory()`` >= torch's reserved memory, while a model is loaded."""
    from collectors.nvml import NvmlSampler

    name = "process_memory() >= torch reserved"
    if not hasattr(NvmlSampler, "process_memory"):
        skip(name, "NvmlSampler has no process_memory() in these collectors")
        return
    s = NvmlSampler(uuid=t_uuid) if t_uuid else NvmlSampler(cuda_index=0)
    try:
        torch.cuda.synchronize(0)
        got = s.process_memory()
        reserved = torch.cuda.memory_reserved(0)
    finally:
        s.close()
    say(f"NVML process memory {got if got is None else f'{got / 2**20:.0f} MiB'}, "
        f"torch reserved {reserved / 2**20:.0f} MiB")
    if got is None:
        procs = NvmlProcs(torch)
        try:
            listed = procs.pids(0)
        finally:
            procs.close()
        if listed is None or os.getpid() not in listed:
            skip(name, f"NVML lists no process with this pid ({os.getpid()}; it lists "
                       f"{'nothing readable' if listed is None else sorted(listed)}): "
                       "another PID namespace, so None is right")
            return
        check(name, False, "None, although NVML lists this process on the GPU")
        return
    check(name, got >= reserved,
          f"{got / 2**20:.0f} MiB vs {reserved / 2**20:.0f} MiB reserved "
          f"(+{(got - reserved) / 2**20:.0f} MiB: context, workspaces, NCCL)")


# ---- subprocess jobs ----------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    """A finished subprocess job: exit statuses, pids, the workers' results and logs."""

    rcs: list[int | None]
    pids: list[int]
    timed_out: bool
    results: list[dict[str, Any] | None]
    logs: list[str] = field(default_factory=list)

    def log_tail(self, rank: int, lines: int = 15) -> str:
        text = self.logs[rank] if rank < len(self.logs) else ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def show_logs(self, lines: int = 15) -> None:
        for r in range(len(self.logs)):
            say(f"--- rank {r} log (last {lines} lines) ---")
            for ln in self.log_tail(r, lines).splitlines():
                say(f"  {ln}")


def run_workers(mode: str, world: int, steps: int, hub: Any, *, cpu: bool = False,
                timeout: float = WORKER_TIMEOUT_S,
                on_poll: Callable[[list[str | None], set[str]], None] | None = None) -> Job:
    """Run ``world`` workers of this script (``--worker mode``) against ``hub``.

    Every 0.1 s ``on_poll(phases, acked)`` is called (each rank's latest phase, and the
    phases acknowledged so far); once every rank has reached a phase it is polled twice
    more and acknowledged, and the ranks go on. A rank that fails gets the others killed
    10 s later; past ``timeout`` every rank is killed.
    """
    out = Path(tempfile.mkdtemp(prefix="rtop-gpu-check-"))
    env = dict(os.environ, RTOP_HUB=hub.address, RTOP_TOKEN=hub.token, RTOP_AUTOHUB="0",
               PYTHONUNBUFFERED="1")
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for r in range(world):
            log = open(out / f"rank{r}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = [sys.executable, SCRIPT, "--worker", mode, "--rank", str(r), "--world",
                   str(world), "--port", str(port), "--out", str(out), "--steps", str(steps)]
            if cpu:
                cmd.append("--cpu")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        acked: set[str] = set()
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        timed_out = False

        def phases() -> list[str | None]:
            got: list[str | None] = []
            for r in range(world):
                try:
                    got.append((out / f"phase{r}").read_text().strip() or None)
                except OSError:
                    got.append(None)
            return got

        while True:
            rcs = [p.poll() for p in procs]
            now = phases()
            if on_poll is not None:
                on_poll(now, acked)
            common = now[0]
            if common is not None and all(p == common for p in now) and common not in acked:
                for _ in range(2):  # let NVML catch up with the phase, then look again
                    time.sleep(0.3)
                    if on_poll is not None:
                        on_poll(now, acked)
                (out / f"ack-{common}").write_text("ok")
                acked.add(common)
            if all(rc is not None for rc in rcs):
                break
            t = time.monotonic()
            if any(rc not in (None, 0) for rc in rcs):
                first_failure = first_failure or t
                if t - first_failure > 10.0:
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
            if t > deadline:
                timed_out = True
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.1)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        results: list[dict[str, Any] | None] = []
        for r in range(world):
            try:
                results.append(json.loads((out / f"result{r}.json").read_text()))
            except (OSError, ValueError):
                results.append(None)
        texts = []
        for r in range(world):
            try:
                texts.append((out / f"rank{r}.log").read_text(errors="replace"))
            except OSError:
                texts.append("")
        return Job([p.poll() for p in procs], [p.pid for p in procs], timed_out, results,
                   texts)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
        shutil.rmtree(out, ignore_errors=True)


def hub_rank(hub: Any, rank: int) -> dict[str, Any] | None:
    """What the hub holds about a rank of the current attempt: status, meta, step rows."""
    fields = ("step", "gpu_s", "compute_s", "comm_s", "comm_exposed_s")

    def read(h: Any) -> dict[str, Any] | None:
        state = h.state
        rs = state.rank_state(rank)
        if rs is None:
            return None
        rows: list[dict[str, Any]] = []
        if rs.slot is not None:
            cols = [state.steps.history(f, rs.slot).tolist() for f in fields]
            rows = [{f: (None if _missing(v) else v) for f, v in zip(fields, vals, strict=True)}
                    for vals in zip(*cols, strict=True)]
        return {"status": rs.status, "meta": dict(rs.meta), "steps_seen": rs.steps_seen,
                "rows": rows}

    result: dict[str, Any] | None = hub.call(read)
    return result


def wait_final(hub: Any, rank: int, timeout: float = 10.0) -> dict[str, Any] | None:
    """The rank as the hub holds it once it is no longer active (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        rs = hub_rank(hub, rank)
        if (rs is not None and rs["status"] != "active") or time.monotonic() > deadline:
            return rs
        time.sleep(0.2)


def start_hub() -> Any:
    from rtop.hub.service import ThreadedHub

    return ThreadedHub(record="").start()


# ---- 2. two ranks -------------------------------------------------------------------

TWO_RANK_CHECKS = (
    "2-rank job finishes", "rank 1 opens no CUDA context on GPU 0",
    "rank 1's event pool on cuda:1", "rank 1: nothing turned off",
    "rank 1's steps reach the hub with gpu_s", "rank 1 samples GPU 1",
    "rank 1 (hub): step figures consistent",
)


def two_rank_check(torch: Any, steps: int) -> None:
    print("\n2. Two ranks; rank 1 on cuda:1 without torch.cuda.set_device (DDP tutorial style)")
    n = torch.cuda.device_count()
    if n < 2:
        for name in TWO_RANK_CHECKS:
            skip(name, f"{n} GPU visible; this needs 2")
        return
    torch.zeros(1, device="cuda:0")  # the parent's own context: NVML lists it if PIDs match
    torch.cuda.synchronize(0)
    hub = start_hub()
    try:
        procs = NvmlProcs(torch)
    except BaseException:
        hub.stop()
        raise
    base = {g: procs.pids(g) or set() for g in (0, 1)}
    seen: dict[tuple[int, str], set[int]] = {
        (g, s): set() for g in (0, 1) for s in ("control", "rtop", "teardown")}
    unreadable = {"n": 0}

    def on_poll(phases: list[str | None], acked: set[str]) -> None:
        stage = ("teardown" if "trained" in acked else "rtop" if "bare" in acked
                 else "control")
        for g in (0, 1):
            got = procs.pids(g)
            if got is None:
                unreadable["n"] += 1
            else:
                seen[(g, stage)] |= got

    try:
        job = run_workers("ddp2", 2, steps, hub, on_poll=on_poll)
        final = [wait_final(hub, r) for r in (0, 1)]
    finally:
        hub.stop()
        procs.close()
    res = job.results
    errors = [f"rank {r}: {first_line(x.get('error', ''))}" for r, x in enumerate(res)
              if x is not None and x.get("error")]
    ok = not job.timed_out and job.rcs == [0, 0] and all(x is not None for x in res) \
        and not errors
    detail = (f"exit statuses {job.rcs}" + (" (timed out, killed)" if job.timed_out else "")
              + (f"; {'; '.join(errors)}" if errors else ""))
    check("2-rank job finishes", ok, detail if not ok else f"{steps} steps on each rank; {detail}")
    if not ok:
        job.show_logs()
    r1 = res[1] or {}
    say(f"rank 1: current device while training cuda:{r1.get('current_device')} "
        f"(never set), model on cuda:{r1.get('model_device')}; rank 0's event pool on "
        f"cuda:{(res[0] or {}).get('pool_device')}")

    # (a) no context of rank 1 on GPU 0
    name = "rank 1 opens no CUDA context on GPU 0"
    pid0, pid1 = job.pids
    all0 = set().union(*(seen[(0, s)] for s in ("control", "rtop", "teardown")))
    all1 = set().union(*(seen[(1, s)] for s in ("control", "rtop", "teardown")))
    say(f"NVML compute pids, GPU 0: control {sorted(seen[(0, 'control')])}, rtop "
        f"{sorted(seen[(0, 'rtop')])}; GPU 1: control {sorted(seen[(1, 'control')])}, rtop "
        f"{sorted(seen[(1, 'rtop')])}; parent {os.getpid()}, rank 0 {pid0}, rank 1 {pid1}")
    if not all0 and not all1:
        skip(name, "NVML listed no compute process on either GPU "
                   f"({unreadable['n']} unreadable polls)")
    elif os.getpid() in all0:  # NVML's pids are this namespace's
        if pid1 not in all1:
            skip(name, f"NVML never listed rank 1 (pid {pid1}) on GPU 1 either: no evidence")
        elif pid1 in seen[(0, "control")]:
            skip(name, "rank 1 held a context on GPU 0 before rtop was started (after "
                       "bare DDP steps): torch/NCCL's own doing, rtop's part cannot be told")
        else:
            check(name, pid1 not in seen[(0, "rtop")],
                  "rank 1's pid listed on GPU 0 while instrumented" if pid1 in seen[(0, "rtop")]
                  else "rank 1's pid never on GPU 0 while it trained, on GPU 1 as expected")
            if pid1 in seen[(0, "teardown")] and pid1 not in seen[(0, "rtop")]:
                say("rank 1 showed on GPU 0 only after training, in destroy_process_group")
    else:  # another PID namespace: look for a new process that holds both GPUs
        new0 = {s: seen[(0, s)] - base[0] for s in ("control", "rtop")}
        new1 = {s: seen[(1, s)] - base[1] for s in ("control", "rtop")}
        if not (new1["control"] | new1["rtop"]):
            skip(name, "NVML's pids are another namespace's and no new process showed on "
                       "GPU 1: no evidence")
        elif new0["control"] & new1["control"]:
            skip(name, "(pids of another namespace) a worker held both GPUs before rtop "
                       "was started: torch/NCCL's own doing, rtop's part cannot be told")
        else:
            both = (new0["control"] | new0["rtop"]) & (new1["control"] | new1["rtop"])
            check(name, not both,
                  f"NVML's pids are another namespace's; new pids on both GPUs: {sorted(both)}"
                  if both else "NVML's pids are another namespace's; no new process held "
                               "both GPUs (each worker on its own)")

    # (c) the event pool of rank 1
    dev = r1.get("pool_device", "(no result)")
    check("rank 1's event pool on cuda:1", dev == 1, f"probe.cuda.device = {dev}")
    # notes and pool failure of both ranks
    for r, x in enumerate(res):
        if x is None:
            skip(f"rank {r}: nothing turned off", "no result from the rank")
        else:
            check_notes(f"rank {r}", list(x.get("notes") or []), x.get("pool_failure"))

    # (d) rank 1's steps at the hub
    f1 = final[1]
    if f1 is None:
        check("rank 1's steps reach the hub with gpu_s", False, "the hub never heard of rank 1")
        skip("rank 1 samples GPU 1", "the hub never heard of rank 1")
        skip("rank 1 (hub): step figures consistent", "the hub never heard of rank 1")
        return
    rows = f1["rows"]
    gpu = [row["gpu_s"] for row in rows]
    measured = [g for g in gpu if g is not None and g > 0]
    check("rank 1's steps reach the hub with gpu_s",
          f1["steps_seen"] >= steps and len(measured) == len(gpu) and len(gpu) >= steps,
          f"{f1['steps_seen']} steps seen, {len(measured)} of {len(gpu)} with gpu_s"
          + (f" (median {statistics.median(measured) * 1e3:.2f} ms)" if measured else "")
          + f"; status {f1['status']!r}")
    meta = f1["meta"]
    say(f"rank 1 meta: cuda_timing={meta.get('cuda_timing')}, mem_device="
        f"{meta.get('mem_device')}, comm_measured={meta.get('comm_measured')}")
    device = meta.get("device") or {}
    want = torch_uuid(torch.cuda.get_device_properties(1))
    check("rank 1 samples GPU 1", same_uuid(device.get("uuid"), want),
          f"hub meta device {device.get('uuid')} (NVML index {device.get('index')}), "
          f"cuda:1 is {want}" + (f"; {meta['device_reason']}" if meta.get("device_reason")
                                 else ""))
    consistency("rank 1 (hub)", rows)
    if final[0] is not None:
        consistency("rank 0 (hub)", final[0]["rows"])


def worker_ddp2(args: argparse.Namespace, torch: Any, result: dict[str, Any],
                phase: Callable[[str], None], save: Callable[[], None]) -> None:
    """One rank of the two-rank job (see ``two_rank_check``)."""
    import torch.distributed as dist

    rank, world, cpu = args.rank, args.world, args.cpu
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port)})
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world)
    phase("init")
    dev = torch.device("cpu") if cpu else torch.device("cuda", rank)
    dim, batch = 2048, 1024

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        layers: list[Any] = []
        for _ in range(4):
            layers += [torch.nn.Linear(dim, dim), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers).to(dev)  # the tutorial's model.to(rank)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=None if cpu else [rank])
        return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-6)

    def train_step(ddp: Any, opt: Any, x: Any) -> None:
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if not cpu:
            torch.cuda.synchronize(dev)

    batches = [torch.randn(batch, dim, device=dev) for _ in range(4)]
    # control: bare DDP steps on a model of its own, before rtop exists in this process
    bare, bare_opt = build()
    for x in batches[:3]:
        train_step(bare, bare_opt, x)
    sync()
    del bare, bare_opt
    phase("bare")
    result["acks"] = [wait_ack(args, "bare")]

    import collectors

    probe = collectors.start(hub=os.environ.get("RTOP_HUB"), token=os.environ.get("RTOP_TOKEN"),
                             rank=rank, world_size=world, local_rank=rank)
    ddp, opt = build()
    probe.watch(ddp, opt)
    pool = getattr(probe, "cuda", None)
    result["cuda_timing"] = pool is not None
    result["pool_device"] = getattr(pool, "device", "(no device attribute)") \
        if pool is not None else None
    result["model_device"] = next(ddp.parameters()).device.index
    if not cpu:
        result["current_device"] = torch.cuda.current_device()
    loader = [batches[i % len(batches)] for i in range(args.steps)]
    for x in probe.iter(loader):
        with probe.step():
            train_step(ddp, opt, x)
    sync()
    result["steps"] = probe.step_count
    result["pool_failure"] = getattr(pool, "failure", None)
    result["notes"] = list(getattr(probe, "notes", []))
    probe.close()
    result["stats"] = probe.stats()
    save()
    phase("trained")
    result["acks"].append(wait_ack(args, "trained"))
    save()
    del ddp, opt
    dist.destroy_process_group()


def worker_assert(args: argparse.Namespace, torch: Any, result: dict[str, Any],
                  save: Callable[[], None]) -> None:
    """A 1-rank job whose last step dies of a device-side assert, uncaught."""
    import collectors

    cpu = args.cpu
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    probe = collectors.start(rank=0, world_size=1, local_rank=0)  # hub: RTOP_HUB, RTOP_TOKEN
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    probe.watch(model, opt)
    pool = getattr(probe, "cuda", None)
    result["pool_device"] = getattr(pool, "device", None) if pool is not None else None
    batches = [torch.randn(256, 1024, device=dev) for _ in range(4)]
    loader = [batches[i % len(batches)] for i in range(args.steps)]
    for i, x in enumerate(probe.iter(loader)):
        with probe.step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if i == args.steps - 3:  # these steps reach the hub; the last two are still pending
            if not cpu:
                torch.cuda.synchronize(0)
            time.sleep(1.5)
    result["steps"] = probe.step_count
    result["notes"] = list(getattr(probe, "notes", []))
    result["stats"] = probe.stats()
    save()
    with probe.step():  # the last step: dies, and nothing catches it
        if cpu:
            raise RuntimeError("CUDA error: device-side assert triggered (CPU stand-in)")
        torch.zeros(4, device=dev)[torch.tensor([10], device=dev)].item()


def wait_ack(args: argparse.Namespace, name: str) -> bool:
    """Wait for the parent to acknowledge a phase (it has polled NVML); False on timeout."""
    path = Path(args.out) / f"ack-{name}"
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.05)
    return False


def worker_main(args: argparse.Namespace) -> int:
    """One rank of a subprocess job; writes ``result<rank>.json`` into ``--out``."""
    os.environ["RTOP_AUTOHUB"] = "0"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"rank": args.rank, "pid": os.getpid(), "mode": args.worker}

    def write(name: str, text: str) -> None:
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)

    def save() -> None:
        write(f"result{args.rank}.json", json.dumps(result, default=repr))

    def phase(name: str) -> None:
        write(f"phase{args.rank}", name)

    try:
        import torch

        if not args.cpu and not torch.cuda.is_available():
            result["error"] = "no CUDA device here"
            save()
            print("gpu_check worker: no CUDA device here", file=sys.stderr)
            return 2
    except Exception:
        result["error"] = traceback.format_exc()
        save()
        raise
    if args.worker == "assert":
        worker_assert(args, torch, result, save)  # its last step raises, uncaught
        result["error"] = "the device-side assert did not raise"
        save()
        return 3
    try:
        worker_ddp2(args, torch, result, phase, save)
    except Exception:
        result["error"] = traceback.format_exc()
        save()
        traceback.print_exc()
        return 1
    save()
    return 0


# ---- 3. step timing -----------------------------------------------------------------

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


#: Unmeasured steps first, bare and instrumented alike: DDP samples its own runtime
#: statistics (synchronizing on CUDA events) in its first 10 iterations.
WARMUP_STEPS = 10


def _bare_steps(ddp: Any, opt: Any, x: Any, n: int) -> None:
    for _ in range(n):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _sync_warnings(torch: Any, fn: Callable[[], None]) -> list[str]:
    """Run ``fn`` under sync-debug mode "warn"; the synchronizing calls it warned about."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]


def timing_check(torch: Any, steps: int) -> None:
    import collectors
    from collectors.identity import detect
    from collectors.schema import STEP_FIELDS
    from collectors.steps import StepRecords

    print("\n3. CUDA-event step timing; no synchronization on the training thread")
    # control: the bare step under sync-debug "error"
    bare, bare_opt, x = _job(torch)
    _bare_steps(bare, bare_opt, x, WARMUP_STEPS)
    torch.cuda.synchronize()
    bare_error = None
    try:
        torch.cuda.set_sync_debug_mode("error")
        _bare_steps(bare, bare_opt, x, steps)
    except Exception as exc:
        bare_error = f"{type(exc).__name__}: {first_line(str(exc))}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    del bare, bare_opt
    mode, bare_warned = "error", 0
    if bare_error is None:
        check("control: the bare step runs under sync-debug 'error'", True,
              f"{steps} steps, no synchronizing call")
    else:
        skip("sync-debug 'error' around the instrumented steps",
             f"the bare step itself synchronizes ({bare_error}); counting with 'warn' instead")
        mode = "warn"
        bare, bare_opt, x = _job(torch)
        _bare_steps(bare, bare_opt, x, WARMUP_STEPS)
        torch.cuda.synchronize()
        msgs = _sync_warnings(torch, lambda: _bare_steps(bare, bare_opt, x, steps))
        bare_warned = len(msgs)
        say(f"bare step under 'warn': {bare_warned} synchronizing calls in {steps} steps"
            + (f"; first: {first_line(msgs[0])}" if msgs else ""))
        torch.cuda.synchronize()
        del bare, bare_opt

    ddp, opt, x = _job(torch)
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
    probe.watch(ddp, optimizer=opt)
    pool = probe.cuda
    check("CUDA timing on", pool is not None, "step timing switched to CUDA events")
    pool_dev = getattr(pool, "device", "(no device attribute)") if pool is not None else None
    check("event pool on the model's device", pool_dev == 0, f"probe.cuda.device = {pool_dev}")
    check("comm hook on CUDA", probe.comm.ddp_logger is None and probe.comm.buckets is not None,
          probe.notes[-1] if probe.notes else "")
    # what the sender thread (not started here) does with the probe's finished steps
    records = StepRecords(probe.config.cuda_resolve_timeout_s)

    def drain() -> list[list[Any]]:
        """Every step record the finished steps make, all CUDA events resolved (the
        caller synchronized first: this is the check's clock, not the probe's)."""
        return records.drain(probe.records, probe.cuda, world=probe.comm.world,
                             nbytes=probe.comm.nbytes, now=time.monotonic(), final=True)

    for _ in range(WARMUP_STEPS):  # warm-up, not measured
        with probe.step():
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    drain()  # the warm-up steps' records: not measured
    counter = SyncCounter(torch)
    ref: list[tuple[Any, Any]] = []
    host: list[float] = []

    def measured() -> None:
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

    raised = None
    inst_msgs: list[str] = []
    try:
        if mode == "error":
            torch.cuda.set_sync_debug_mode("error")
            try:
                measured()
            except Exception as exc:
                raised = f"{type(exc).__name__}: {first_line(str(exc))}"
        else:
            inst_msgs = _sync_warnings(torch, measured)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        counter.armed = False
        counter.restore()
    torch.cuda.synchronize()
    if mode == "error":
        check("no synchronizing CUDA call in instrumented steps (sync-debug 'error')",
              raised is None, raised or f"{steps} steps")
    else:
        check("instrumented steps synchronize no more than bare ones (sync-debug 'warn')",
              len(inst_msgs) <= bare_warned,
              f"{len(inst_msgs)} synchronizing calls instrumented, {bare_warned} bare"
              + (f"; first: {first_line(inst_msgs[0])}" if inst_msgs else ""))
    check("no host sync on the training thread", not counter.calls,
          f"{len(counter.calls)} calls {sorted(set(counter.calls))}")
    rows = [dict(zip(STEP_FIELDS, r, strict=True)) for r in drain()]
    probe.close(1.0)
    check_notes("timing probe", probe.notes, getattr(pool, "failure", None))
    if raised is not None:
        for name in ("a gpu_s per step", "gpu_s matches independent CUDA events",
                     "1 rank: step figures consistent"):
            skip(name, "the instrumented run was interrupted by the error above")
        return
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
    check("comm_bytes = gradient bytes", bool(rows)
          and all(r["comm_bytes"] == grad_bytes for r in rows),
          f"{grad_bytes} bytes, {rows[0]['comm_calls'] if rows else 'n/a'} buckets")
    consistency("1 rank", rows)
    print(f"     host time per step (median): {statistics.median(host) * 1e3:.2f} ms; "
          f"GPU time per step: {statistics.median(ref_s) * 1e3:.2f} ms")


# ---- 4. gradients -------------------------------------------------------------------

def gradients_check(torch: Any) -> None:
    import collectors
    from collectors.identity import detect

    print("\n4. Gradients with rtop's comm hook on CUDA")
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
    check_notes("gradients probe", probe.notes, getattr(probe.cuda, "failure", None))


# ---- 5. NVLink ----------------------------------------------------------------------

def nvlink_check(torch: Any) -> None:
    from collectors.samplers import GpuSampler

    print("\n5. NVLink: links, and tx/rx rates idle and under peer-to-peer copies")
    gs = GpuSampler(local_rank=0)
    try:
        gs.use_cuda_device(0)
        gpu_sample(gs)  # the first reading: rates need two
        facts = gs.info()
        if facts is None:
            skip("NVLink", "no NVML GPU")
            return
        links = facts.get("nvlink_links")
        say(f"NVLink links active on GPU 0: {links}")
        if links is None:
            skip("NVLink", "NVML cannot tell the link count")
            return
        if links == 0:
            skip("NVLink", "no active NVLink on this GPU")
            return
        time.sleep(1.0)
        idle = gpu_sample(gs) or {}
        itx, irx = idle.get("nvlink_tx_Bps"), idle.get("nvlink_rx_Bps")
        say(f"idle: tx {_rate(itx)}, rx {_rate(irx)}")
        n = torch.cuda.device_count()
        if n < 2:
            skip("NVLink rate under load", f"{n} GPU visible: no peer to copy to")
            return
        if not torch.cuda.can_device_access_peer(0, 1):
            skip("NVLink rate under load", "cuda:0 cannot access cuda:1 as a peer")
            return
        src = torch.randn(64 * 2**20, device="cuda:0")  # 256 MiB
        dst = torch.empty_like(src, device="cuda:1")
        stop = threading.Event()
        moved = {"bytes": 0, "t0": 0.0, "t1": 0.0}
        errors: list[BaseException] = []

        def copy() -> None:
            try:
                moved["t0"] = time.perf_counter()
                while not stop.is_set():
                    for _ in range(10):
                        dst.copy_(src, non_blocking=True)  # the same as x.to("cuda:1")
                    torch.cuda.synchronize(0)
                    torch.cuda.synchronize(1)
                    moved["bytes"] += 10 * src.nbytes
                    moved["t1"] = time.perf_counter()
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=copy, daemon=True)
        t.start()
        time.sleep(0.5)
        gpu_sample(gs)
        time.sleep(1.5)
        load = gpu_sample(gs) or {}
        stop.set()
        t.join()
        copied = moved["bytes"] / max(moved["t1"] - moved["t0"], 1e-9)
        ltx, lrx = load.get("nvlink_tx_Bps"), load.get("nvlink_rx_Bps")
        say(f"under load: tx {_rate(ltx)}, rx {_rate(lrx)}; the copies moved "
            f"{_rate(copied)} cuda:0 -> cuda:1")
        if errors:
            check("NVLink rate under load", False, f"the copies failed: {errors[0]!r}")
        elif ltx is None and lrx is None:
            skip("NVLink rate under load", "NVML gives no NVLink throughput counters here")
        else:
            peak = max(v for v in (ltx, lrx) if v is not None)
            check("NVLink rate under load", peak > 1e9 and peak > 10 * max(itx or 0, irx or 0),
                  f"tx {_rate(ltx)}, rx {_rate(lrx)} (idle {_rate(itx)}, {_rate(irx)})")
    finally:
        gs.close()


def _rate(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e9:.2f} GB/s"


# ---- 6. overhead --------------------------------------------------------------------

def overhead_check(torch: Any, rounds: int = 8, block: int = 20) -> None:
    import collectors
    from collectors.identity import detect

    print("\n6. Overhead: instrumented vs not, interleaved blocks (medians)")
    times: dict[bool, list[float]] = {False: [], True: []}
    notes: list[str] = []
    failures: list[str] = []
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
                ctx = probe.step() if probe is not None else contextlib.nullcontext()
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
                notes += [n for n in probe.notes if TURNED_OFF in n]
                failure = getattr(probe.cuda, "failure", None)
                if failure:
                    failures.append(failure)
            del ddp, opt
    base, inst = statistics.median(times[False]), statistics.median(times[True])
    check("collectors <= 1.01x on GPU", inst / base <= 1.01,
          f"{base * 1e3:.2f} ms bare, {inst * 1e3:.2f} ms with rtop: {inst / base:.4f}x")
    check("overhead probes: nothing turned off", not notes and not failures,
          f"{rounds} probes with a sender thread" if not notes and not failures
          else " | ".join(notes + failures)[:400])


# ---- 7. device-side assert ----------------------------------------------------------

def assert_check(cpu: bool = False) -> None:
    print("\n7. A device-side assert as the last step: the hub hears why the rank died")
    hub = start_hub()
    try:
        job = run_workers("assert", 1, 8, hub, cpu=cpu)
        final = wait_final(hub, 0)
    finally:
        hub.stop()
    rc = job.rcs[0]
    last = first_line("\n".join(reversed(job.log_tail(0, 5).splitlines())))
    ok = not job.timed_out and rc not in (None, 0)
    check("the rank's process dies of it", ok,
          ("timed out, killed" if job.timed_out else f"exit status {rc}")
          + (f"; last line: {last}" if last else ""))
    res = job.results[0] or {}
    if res.get("error"):
        say(f"worker error before the assert: {first_line(res['error'])}")
    if final is None:
        check("the hub got the rank's goodbye with the error", False,
              "the hub never heard of the rank")
        job.show_logs()
        return
    say(f"hub: status {final['status']!r}, {final['steps_seen']} steps seen, "
        f"error {final['meta'].get('error')!r}")
    for note in final["meta"].get("notes") or []:
        say(f"note (hub): {note}")
    check("steps reached the hub before the failure", final["steps_seen"] >= 6,
          f"{final['steps_seen']} step records (8 trained, then the failing step)")
    err = str(final["meta"].get("error") or "")
    named = "device-side assert" in err.lower() or "cuda error" in err.lower()
    good = final["status"] == "failed" and named
    check("the hub got the rank's goodbye with the error", good,
          f"status {final['status']!r} (want 'failed', not 'lost'/'exited'); "
          f"error {first_line(err, 200)!r}")
    if not (ok and good):
        job.show_logs(25)


# ---- main ---------------------------------------------------------------------------

def run_section(label: str, fn: Callable[[], None], torch: Any) -> None:
    """Run one section; an exception is one FAIL, and the next section still runs."""
    try:
        fn()
    except Exception as exc:
        check(f"{label}: ran to the end", False, f"{type(exc).__name__}: {first_line(str(exc))}")
        for ln in traceback.format_exc().rstrip().splitlines()[-8:]:
            say(ln)
    finally:
        with contextlib.suppress(Exception):
            torch.cuda.set_sync_debug_mode("default")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="measured steps per job (40)")
    ap.add_argument("--worker", choices=("ddp2", "assert"),
                    help="internal: run one rank of a subprocess job")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    # workers only: CPU and gloo, to try this script's plumbing on a machine without a GPU
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if not args.out:
            ap.error("--worker needs --out")
        return worker_main(args)

    os.environ["RTOP_AUTOHUB"] = "0"  # no hub found by discovery: each check sets its own
    logging.getLogger("rtop").setLevel(logging.ERROR)  # the in-process hubs' findings
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        print(f"gpu_check: torch is not importable ({exc}); run it on a GPU machine",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2

    t_start = time.monotonic()
    print(f"devices: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    dist.init_process_group("nccl", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    torch.cuda.set_device(0)
    try:
        sections: list[tuple[str, Callable[[], None]]] = [
            ("1. NVML", lambda: nvml_check(torch)),
            ("2. two ranks", lambda: two_rank_check(torch, args.steps)),
            ("3. step timing", lambda: timing_check(torch, args.steps)),
            ("4. gradients", lambda: gradients_check(torch)),
            ("5. NVLink", lambda: nvlink_check(torch)),
            ("6. overhead", lambda: overhead_check(torch)),
            ("7. device-side assert", lambda: assert_check()),
        ]
        # issue 25's sections, one module per area (each imports nothing of this script:
        # it runs as __main__, so the results are reported through ``ui``)
        import types

        ui = types.SimpleNamespace(check=check, skip=skip, say=say)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        for module in ("gpu_check_collectives", "gpu_check_profile", "gpu_check_probe"):
            try:
                extra = __import__(module).sections(torch, ui)
            except Exception as exc:
                check(f"{module}: imports", False, f"{type(exc).__name__}: {exc}")
                continue
            sections += [(f"8. {label}", fn) for label, fn in extra]
        for label, fn in sections:
            run_section(label, fn, torch)
    finally:
        dist.destroy_process_group()
    counts = {s: sum(1 for r in RESULTS if r[0] == s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"({len(RESULTS)} checks, {time.monotonic() - t_start:.0f} s)")
    for status, name, detail in RESULTS:
        if status == "FAIL":
            print(f"  FAIL  {name}: {first_line(detail, 160)}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
