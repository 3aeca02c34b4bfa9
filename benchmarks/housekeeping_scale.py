"""The hub's periodic work at thousands of ranks: what its housekeeping timer costs the
loop (issue 28, item 2: at 16,384 ranks it must leave the core to ingest).

Builds a hub (``rtop.hub.server.Hub``, not started: no sockets) holding ``--ranks``
ranks, 8 per node, each with a connection object as the hub's own (role ``rank``; what
is sent to it is encoded and dropped), its state filled through the real
``RunState.apply`` path with ``--history`` seconds of a data-parallel job (two steps a
second, GPU/host/memory samples and a heartbeat once a second; rank 17 starved by its
loader, 333 a straggler, 600 throttled, 901 leaking memory). Then it runs the hub's
timer as the hub does, one tick every 0.25 s of simulated time (the first ``--warmup``
untimed: the first evaluations of a new set of ranks): between ticks the ranks
whose batch is due (each sends one a second) are applied (not timed), then
``Hub._housekeep`` (the connection checks, pings, losses and the diagnosis when due:
``Monitor.advance``) and the acknowledgements (``Hub._ack_ranks``) are timed.

Printed per size: the CPU time of a housekeeping pass (this thread's: a loaded machine
inflates the wall time, which is printed beside it), median and max (the longest stall
of the loop), how many diagnoses ran and the CPU time of ``Analyzer.update`` (all of an
evaluation, or its last part where the window is read in parts), and the share of a
core the housekeeping takes on average (its CPU time over the simulated time); the
acknowledgements apart (one per batch: ingest's work more than the timer's); then the
findings of the last evaluation, to compare revisions.

    python benchmarks/housekeeping_scale.py [--ranks 1024 4096 16384] [--ticks 40]

To compare with an older revision, run this file from a worktree of it (it puts its own
checkout first on the path).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors import wire
from collectors.schema import (
    GPU_FIELDS,
    HEARTBEAT_FIELDS,
    HOST_FIELDS,
    MEM_FIELDS,
    STEP_FIELDS,
)
from rtop.analysis.config import AnalysisConfig
from rtop.analysis.monitor import Monitor
from rtop.hub.server import Hub, HubConfig, _Conn
from rtop.run.state import RunState

TICK_S = 0.25  # the hub's housekeeping period (server.py _housekeeping)
PERIOD_S = 0.5  # one step every half second
CAPACITY = 141e9
FAULTS = {17: "starved", 333: "straggler", 600: "throttled", 901: "leak"}
JOB, GROUP = "hk-bench", "hk-bench-g0"
T0 = 1_760_000_000.0


def row(fields: tuple[str, ...], **values: Any) -> list[Any]:
    """A wire row of ``fields`` (None where not given)."""
    return [values.get(f) for f in fields]


class Rank:
    """What one rank sends (see the module doc)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.fault = FAULTS.get(rank)
        self.rnd = random.Random(rank).random
        self.step = 0
        self.seq = 0
        self.t_step = T0  # when its next step starts

    def hello(self) -> dict[str, Any]:
        """Its hello."""
        node = self.rank // 8
        return {"role": "rank", "token": "x", "identity": {
            "rank": self.rank, "local_rank": self.rank % 8, "world_size": self.world,
            "hostname": f"node-{node:04d}", "ip": f"10.0.{node // 256}.{node % 256}",
            "pid": 1000 + self.rank % 8, "attempt": 0, "job": JOB, "group": GROUP,
            "node_id": f"{node:016x}", "source": "env"},
            "clock": {"t_wall": T0, "t_mono": 1000.0}}

    def batch(self, t: float) -> dict[str, Any]:
        """The steps that ended by ``t`` and the samples of each second since the last."""
        rnd, f = self.rnd, self.fault
        steps, gpu, host, mem = [], [], [], []
        while self.t_step + PERIOD_S <= t:
            data = 0.15 if f == "starved" else 0.003 * (0.5 + rnd())
            compute = 0.33 * (1.45 if f == "straggler" else 1.0) * (1 + 0.01 * (rnd() - .5))
            step_s = data + compute + 0.05 + 0.001
            steps.append(row(STEP_FIELDS, step=self.step, t_wall=self.t_step + step_s,
                             step_s=step_s, data_wait_s=data, compute_s=compute,
                             gpu_s=compute * 0.97, comm_s=0.11, comm_exposed_s=0.05,
                             comm_bytes=2.8e9, comm_calls=112, algbw_Bps=2.5e10,
                             busbw_Bps=4.9e10, samples=32, gap_s=0.001))
            self.t_step += PERIOD_S
            self.step += 1
            if self.step % 2 == 0:  # a sample a second
                ts = self.t_step
                used = 6.1e10 + 1e9 * rnd() + (3e8 * (ts - T0) if f == "leak" else 0)
                clock = 1410 if f == "throttled" else 1980
                gpu.append(row(GPU_FIELDS, t_wall=ts, util_pct=90 + 10 * rnd(),
                               mem_used_bytes=used + 2e9, mem_total_bytes=CAPACITY,
                               power_w=600.0, power_limit_w=700.0, temp_c=60,
                               sm_clock_mhz=clock, sm_clock_max_mhz=1980,
                               clock_event_reasons=0x20 if f == "throttled" else 0))
                host.append(row(HOST_FIELDS, t_wall=ts, proc_cpu_pct=100.0,
                                loader_cpu_pct=300.0, loader_procs=8, rss_bytes=1.2e10,
                                sys_mem_avail_bytes=1.6e12, sys_mem_total_bytes=2e12,
                                sys_cpu_pct=30.0, load_avg_1m=20.0))
                mem.append(row(MEM_FIELDS, t_wall=ts, device="cuda:0", used_bytes=used,
                               reserved_bytes=used + 1e9, peak_bytes=used + 2e9,
                               capacity_bytes=CAPACITY, param_bytes=5.6e9,
                               grad_bytes=5.6e9, optim_bytes=1.12e10))
        self.seq += 1
        p: dict[str, Any] = {"rank": self.rank, "group": GROUP, "seq": self.seq,
                             "t_wall": t, "dropped": 0, "steps": steps}
        if gpu:
            p.update(gpu=gpu, host=host, mem=mem, hb=[row(
                HEARTBEAT_FIELDS, t_wall=t, phase="compute", phase_s=0.1 * rnd(),
                step=self.step - 1)])
        return p


class _Sink:
    """A transport that drops what is written (what the hub sends is still encoded)."""

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def build(ranks: int, history_s: float) -> tuple[Hub, list[Rank], dict[int, _Conn], float]:
    """A hub with ``ranks`` ranks and ``history_s`` seconds of their history; the time
    it is at."""
    state = RunState(window_steps=1200, window_samples=600, lost_after_s=10.0,
                     max_ranks=ranks)
    hub = Hub(HubConfig(host="127.0.0.1", spool_dir="", token="x" * 32),
              monitor=Monitor(state, AnalysisConfig.load()))
    sims = [Rank(r, ranks) for r in range(ranks)]
    conns: dict[int, _Conn] = {}
    mono0 = time.monotonic()
    for s in sims:
        rs = state.apply(wire.Frame(wire.KIND_HELLO, s.hello()), T0)
        conn = _Conn(hub)
        conn.transport = _Sink()  # type: ignore[assignment]
        conn.role, conn.rank, conn.spoke = "rank", rs, True
        conn.next_ping = mono0 + 0.2
        hub._conns.add(conn)
        conns[s.rank] = conn
    t = T0
    while t < T0 + history_s:  # in 10 s batches
        t += 10.0
        for s in sims:
            state.apply(wire.Frame(wire.KIND_BATCH, s.batch(t)), t)
    return hub, sims, conns, t


def run(ranks: int, ticks: int, history_s: float, warmup: int = 20) -> dict[str, Any]:
    """Build, then time ``ticks`` housekeeping ticks after ``warmup`` untimed ones (see
    the module doc)."""
    t = time.perf_counter()
    hub, sims, conns, now = build(ranks, history_s)
    built = time.perf_counter() - t
    mon = hub.monitor
    assert mon.analyzer is not None
    update = mon.analyzer.update
    evals: list[float] = []  # each diagnosis' CPU time (its last part, where in parts)

    def timed_update(*args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        out = update(*args, **kwargs)
        evals.append(time.thread_time() - c0)
        return out

    mon.analyzer.update = timed_update  # type: ignore[method-assign]
    mono = time.monotonic()
    per_tick, per_tick_cpu, acks = [], [], []
    for i in range(-warmup, ticks):
        # the first ``warmup`` passes are not timed: the first evaluations of a new set
        # of ranks (who they are, their long memory fits) and the first pings of every
        # new connection, as after the ranks arrived
        if i == 0:
            evals.clear()
            gc.collect()
        now += TICK_S
        mono += TICK_S
        for s in sims[i % 4::4]:  # each rank sends a batch a second
            rs = hub.state.apply(wire.Frame(wire.KIND_BATCH, s.batch(now)), now)
            if rs is not None:
                conns[s.rank].last = mono
        if i < 0:
            hub._housekeep(mono, now)
            hub._ack_ranks()
            continue
        t0, c0 = time.perf_counter(), time.thread_time()
        hub._housekeep(mono, now)
        t1, c1 = time.perf_counter(), time.thread_time()
        hub._ack_ranks()
        acks.append(time.thread_time() - c1)
        per_tick.append(t1 - t0)
        per_tick_cpu.append(c1 - c0)
    findings = [(f["kind"], f["ranks"][:6]) for f in mon.findings]
    return {"ranks": ranks, "built_s": built, "tick": per_tick, "tick_cpu": per_tick_cpu,
            "ack": acks, "evals": evals,
            "share": sum(per_tick_cpu) / (ticks * TICK_S),
            "findings": sorted(findings), "lost": sum(
                1 for rs in hub.state.active_ranks() if rs.status != "active")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--ticks", type=int, default=40, help="housekeeping ticks timed "
                    "(0.25 s of simulated time each; default 40)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed ticks first "
                    "(default 20: 5 s)")
    ap.add_argument("--history", type=float, default=60.0,
                    help="seconds of history before timing (default 60)")
    args = ap.parse_args()
    ms = 1e3
    for n in args.ranks:
        r = run(n, args.ticks, args.history, args.warmup)
        tick, cpu, ev = r["tick"], r["tick_cpu"], r["evals"]
        print(f"{n:>6} ranks: housekeeping pass CPU median {statistics.median(cpu) * ms:6.1f}"
              f" ms, max {max(cpu) * ms:6.1f} ms (wall median "
              f"{statistics.median(tick) * ms:6.1f}, max {max(tick) * ms:6.1f}); "
              f"{len(ev)} diagnoses in {len(tick) * TICK_S:g} s (update CPU median "
              f"{statistics.median(ev) * ms if ev else float('nan'):6.1f} ms); core share "
              f"{r['share'] * 100:5.1f}%; acks (apart) CPU median "
              f"{statistics.median(r['ack']) * ms:5.1f} ms  (built in {r['built_s']:.0f} s, "
              f"{r['lost']} not active)", flush=True)
        print(f"{'':>13}findings: {r['findings']}", flush=True)


if __name__ == "__main__":
    main()
