"""Can one hub hold a job of thousands of ranks? Measured with real processes and sockets.

The hub runs as its own process (``python -m rtop serve``, recording to a temp dir);
``--procs`` load-generator processes, each one asyncio loop with many sockets, play the
ranks. Nothing is simulated inside the hub: every rank is a real TCP connection that
says ``hello`` with a realistic identity (8 ranks per node, ``node-0042``), goes through
the handshake as the collectors do (checks the hub's challenge, sends its proof, with
the job's ingest token; the viewer uses the view token), waits for its ``welcome``,
answers the hub's ``ping`` frames with ``pong`` and streams frames shaped like the
collectors' own.

Phase 1 - a job of ``--ranks`` ranks (default 4096) for ``--duration`` seconds. Every
rank trains 2 steps/s and sends a ``batch`` as the collectors would in a world of that
size (``--flush``: every 0.5 s with one step record, every 1 s with two from 1,024 ranks
on) and, once a second, one GPU, host, memory and heartbeat sample. Sends are spread
evenly over the period across all ranks and processes. Once every rank is connected, after a
short warm-up, it measures:

* the hub's CPU (100% = one core) and RSS, from psutil once a second, and the hub's CPU
  time per frame ingested;
* a viewer (:class:`rtop.client.HubClient`) requesting snapshots at ``--viewer-hz``
  (2 Hz: what a TUI asks for; ``--viewer``: the fleet view's snapshot above 64 ranks,
  as the UI asks, else every rank's row): the hub's own ``build_s`` and the round trip
  (request, build, encode, transfer, client decode), median and max;
* ingest: the snapshot's ``run.step_records`` over time against what the generators
  counted as sent; then, once sending stops, how long the hub takes to catch up and
  whether every record arrived;
* that the snapshot lists ``--ranks`` ranks, all ``active``, with clock offsets.

Memory for a 10-minute window: the windows are ring buffers preallocated per rank slot,
so the RSS once every rank is connected is already close to the full-window figure;
the RSS trend over the window is printed too. The benchmark also builds a
:class:`rtop.run.state.RunState` in its own process, registers the ranks through
``apply()`` with hello frames and prints ``nbytes()`` (and what one restart of the job,
a new attempt beside the kept old one, makes of it).

Phase 2 - the most step records per second the hub ingests on one core, on a fresh hub:
``--p2-conns`` connections (default 256) send batches of ``--p2-rows`` step records
(default 100), respecting TCP backpressure (``await writer.drain()``) and staying far
below the hub's per-connection flood limits. The offered rate ramps up by 1.5x every
``--p2-step`` seconds until the hub falls behind: the hub reads sockets into large
per-connection buffers, so "as fast as it accepts" would mostly measure buffering; a
ramp finds the highest rate it sustains, and the ingest rate once it is saturated. The
rate is the growth of ``run.step_records`` in the hub's snapshots. Step rows are
fixed-width msgpack filled from a numpy record array, so generators stay cheap.

**Relays** (``--mode relays``, or ``both`` for the two side by side on fresh hubs):
the ranks of each simulated node (8 a node) connect to their node's relay instead of
the hub: a real :class:`rtop.hub.relay.Relay` each, with its own loopback listening
socket and its own authenticated connection to the hub, forwarding its ranks' bytes in
one ``relay`` frame per ``--relay-interval``. One process per node would be 2,048
processes at 16,384 ranks, more than a small machine holds, so ``--relay-procs``
processes each run their share of the relays on one event loop (separate objects,
sockets and connections: nothing is shared but the process). The hub sees one
connection per node; the relays' CPU is measured apart from the hub's and the
generators'.

Generators and relays stand in for the ranks' own machines: they run niced
(``--load-nice``, 10), so that on one small machine the hub gets the CPU it needs
first, as it would on a machine of its own; their own CPU is measured apart.

Last, without sockets, in this process: what ``RunState.apply()`` costs per frame and
``snapshot()`` per call at full size, to split the hub's time between its state and
its server. The hub's logs are scanned for floods, bad frames, lost ranks and errors.
Everything (hubs, generators, temp dir) is cleaned up at the end, on errors and on
Ctrl-C. On a small machine other processes compete for the same cores: the summary
says how much CPU they took.

    python benchmarks/hub_scale.py [--ranks 4096] [--duration 30] [--procs 4]
    python benchmarks/hub_scale.py --mode both --no-phase2        # direct vs relays
    python benchmarks/hub_scale.py --ranks 16384 --mode relays --no-phase2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import random
import re
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors import auth, wire
from collectors.config import ProbeConfig
from collectors.schema import (
    GPU_FIELDS,
    HEARTBEAT_FIELDS,
    HOST_FIELDS,
    MEM_FIELDS,
    STEP_FIELDS,
)
from rtop.analysis.viewport import ViewRequest
from rtop.client import HubClient, HubError
from rtop.tui.app import FLEET_ABOVE

ROOT = Path(__file__).resolve().parents[1]
JOB = "scale"
RANKS_PER_NODE = 8
PERIOD_S = 0.5  # one batch per rank every PERIOD_S; samples every other batch
FLOOD_FRAMES_PER_S = 5000.0  # HubConfig defaults: stay far below them per connection
FLOOD_BYTES_PER_S = 32e6
FLOOD_SAFETY = 0.5
H200_MEM_BYTES = 150_754_820_096  # what NVML reports as an H200's total memory
COMM_BYTES = 2 * 1_400_000_000  # bf16 gradients of a 1.4B-parameter model, per step
MB = 1e6

# Per-generator counters, in a shared array of doubles (one row per generator process).
(C_CONNECTED, C_FAILED, C_STEPS, C_FRAMES, C_BYTES, C_DROPPED, C_SKIPPED, C_CLOSED,
 C_PONGS, C_ERRORS, C_LATE, C_LAG_MAX, C_READY, C_DONE) = range(14)
NC = 14


# ---- frames ------------------------------------------------------------------------------


def identity(rank: int, world: int, group: str) -> dict[str, Any]:
    """A rank's identity as collectors.identity would send it from a torchrun job."""
    node = rank // RANKS_PER_NODE
    return {"rank": rank, "local_rank": rank % RANKS_PER_NODE, "world_size": world,
            "hostname": f"node-{node:04d}",
            "ip": f"10.{node // 65536 % 256}.{node // 256 % 256}.{node % 256}",
            "pid": 20000 + 37 * (rank % RANKS_PER_NODE), "attempt": 0, "job": JOB,
            "group": group, "node_id": f"{node * 2654435761 % (1 << 64):016x}",
            "source": "torch"}


def hello_payload(rank: int, world: int, group: str, nonce: bytes = b"") -> dict[str, Any]:
    """The first frame of a rank, as collectors.connection writes it (no token: the
    handshake of collectors.auth proves it)."""
    return {"role": "rank", "nonce": nonce, "auth": auth.VERSION,
            "identity": identity(rank, world, group),
            "clock": {"t_wall": time.time(), "t_mono": time.monotonic()},
            "collector": {"version": "0.1.0", "python": sys.version.split()[0],
                          "torch": "2.5.1", "dropped": 0}}


def _step_row(**values: Any) -> list[Any]:
    """A step record in ``STEP_FIELDS`` order; fields not given are not measured."""
    assert set(values) <= set(STEP_FIELDS), set(values) - set(STEP_FIELDS)
    return [values.get(f) for f in STEP_FIELDS]


def _row(fields: Sequence[str], values: dict[str, Any]) -> list[Any]:
    assert set(values) == set(fields), set(fields) ^ set(values)
    return [values[f] for f in fields]


_G, _H, _M = ({f: i for i, f in enumerate(t)} for t in (GPU_FIELDS, HOST_FIELDS, MEM_FIELDS))
_PHASES = ("compute", "compute", "compute", "comm", "data")


class RankStream:
    """What one healthy rank of a large data-parallel job sends, step after step.

    Cheap on purpose (a few microseconds a batch): sample rows are built once and only
    their changing values are rewritten; randomness comes from ``random.random``.
    """

    def __init__(self, rank: int, world: int, group: str) -> None:
        self.rank, self.group = rank, group
        rng = random.Random(rank)
        self.rnd = rng.random
        self.step = self.seq = self.dropped = 0
        self.speed = 1.0 + (rng.random() - 0.5) * 0.01  # per-rank compute speed
        self.data_mean = 0.002 + 0.004 * rng.random()
        self.bus = 2 * (world - 1) / world
        temp = 48 + 18 * random.Random(rank // RANKS_PER_NODE).random() + 4 * rng.random()
        self.gpu = _row(GPU_FIELDS, {
            "t_wall": 0.0, "util_pct": 95.0, "mem_util_pct": 45.0,
            "mem_used_bytes": 118_000_000_000 + rng.randrange(2_000_000_000),
            "mem_total_bytes": H200_MEM_BYTES, "power_w": 610.0, "power_limit_w": 700.0,
            "temp_c": round(temp), "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980,
            "clock_event_reasons": 0, "pcie_tx_Bps": 1e9, "pcie_rx_Bps": 1e9,
            "nvlink_tx_Bps": 1.1e11, "nvlink_rx_Bps": 1.1e11})
        self.host = _row(HOST_FIELDS, {
            "t_wall": 0.0, "proc_cpu_pct": 120.0, "loader_cpu_pct": 330.0, "loader_procs": 8,
            "rss_bytes": 11e9 + 2e9 * rng.random(), "sys_mem_avail_bytes": 1.6e12,
            "sys_mem_total_bytes": 2.0e12, "cgroup_mem_limit_bytes": None,
            "sys_cpu_pct": 30.0, "load_avg_1m": 50.0})
        self.mem = _row(MEM_FIELDS, {
            "t_wall": 0.0, "device": "cuda:0", "used_bytes": 61e9, "reserved_bytes": 84e9,
            "peak_bytes": 97e9, "capacity_bytes": H200_MEM_BYTES, "param_bytes": 5.6e9,
            "grad_bytes": 5.6e9, "optim_bytes": 11.2e9, "process_bytes": 86e9})
        self.hb = _row(HEARTBEAT_FIELDS, {"t_wall": 0.0, "phase": "compute", "phase_s": 0.0,
                                          "step": -1, "stack": None})

    def batch(self, with_samples: bool, steps: int = 1) -> dict[str, Any]:
        """The next batch: ``steps`` step records, plus one row of each sample when
        asked."""
        rnd, now = self.rnd, time.time()
        rows: list[list[Any]] = []
        for i in range(steps):
            step_s = (PERIOD_S + (rnd() - 0.5) * 0.02) * self.speed
            data = self.data_mean * (0.5 + rnd())
            comm = 0.11 + 0.02 * rnd()
            exposed = comm * (0.1 + 0.1 * rnd())
            gap = 0.0006 + 0.0004 * rnd()
            compute = step_s - data - exposed - gap
            algbw = COMM_BYTES / comm
            # in STEP_FIELDS order; fields not named here (collectives: a DDP model's are
            # all allreduces, in the step's own figures) not measured
            rows.append(_step_row(
                step=self.step + i, t_wall=now - (steps - i) * step_s, step_s=step_s,
                data_wait_s=data, compute_s=compute, gpu_s=compute * (0.95 + 0.04 * rnd()),
                comm_s=comm, comm_exposed_s=exposed, comm_bytes=COMM_BYTES, comm_calls=112,
                algbw_Bps=algbw, busbw_Bps=algbw * self.bus, samples=16, gap_s=gap))
        payload: dict[str, Any] = {"rank": self.rank, "group": self.group, "seq": self.seq,
                                   "t_wall": now, "dropped": self.dropped, "steps": rows}
        if with_samples:
            g, h, m, hb = self.gpu, self.host, self.mem, self.hb
            g[0] = h[0] = m[0] = hb[0] = now
            g[_G["util_pct"]] = 88 + 12 * rnd()
            g[_G["mem_util_pct"]] = 35 + 25 * rnd()
            g[_G["power_w"]] = 560 + 140 * rnd()
            g[_G["pcie_tx_Bps"]], g[_G["pcie_rx_Bps"]] = 0.5e9 + 1.5e9 * rnd(), 1e9 * rnd()
            g[_G["nvlink_tx_Bps"]] = g[_G["nvlink_rx_Bps"]] = 8e10 + 6e10 * rnd()
            h[_H["proc_cpu_pct"]] = 100 + 40 * rnd()
            h[_H["loader_cpu_pct"]] = 250 + 170 * rnd()
            h[_H["sys_cpu_pct"]] = 25 + 15 * rnd()
            m[_M["used_bytes"]] = 61e9 + 1e9 * rnd()
            hb[1] = _PHASES[int(rnd() * len(_PHASES))]
            hb[2], hb[3] = 0.3 * rnd(), self.step - 1
            payload.update(gpu=[g], host=[h], mem=[m], hb=[hb])
        self.step += steps
        self.seq += 1
        return payload


class PatchedStream:
    """A :class:`RankStream`'s two batches (with and without samples) encoded once, then
    patched in place for each batch: its ``seq``, its step number and the wall times
    (fixed-width msgpack fields found by sentinel values). About a microsecond a batch,
    so a generator process plays thousands of ranks; the figures in a rank's batches are
    its own (from its stream) but repeat from batch to batch, which costs the hub the
    same to decode and apply."""

    SEQ, STEP = 0xFEEDBEEF, 0xFACEB00C  # > 2**31: msgpack writes them as uint32
    T_BATCH, T_STEP = 1234567.125, 7654321.375  # float64 sentinels

    def __init__(self, rank: int, world: int, group: str, steps: int = 1) -> None:
        import struct

        self._u32, self._f64 = struct.Struct(">I"), struct.Struct(">d")
        src = RankStream(rank, world, group)
        self.steps = steps
        self.templates: list[tuple[bytearray, int, list[int], list[int], list[int]]] = []
        for with_samples in (True, False):
            p = src.batch(with_samples, steps)
            p["seq"], p["t_wall"] = self.SEQ, self.T_BATCH
            for i, row in enumerate(p["steps"]):
                row[0], row[1] = self.STEP + i, self.T_STEP + i
            for table in ("gpu", "host", "mem", "hb"):
                if table in p:
                    p[table][0][0] = self.T_BATCH
            raw = bytearray(wire.encode(wire.KIND_BATCH, p))
            seq = raw.index(b"\xce" + self._u32.pack(self.SEQ)) + 1
            step_at = [raw.index(b"\xce" + self._u32.pack(self.STEP + i)) + 1
                       for i in range(steps)]
            marker = b"\xcb" + self._f64.pack(self.T_BATCH)
            times, at = [], raw.find(marker)
            while at >= 0:
                times.append(at + 1)
                at = raw.find(marker, at + 1)
            t_step = [raw.index(b"\xcb" + self._f64.pack(self.T_STEP + i)) + 1
                      for i in range(steps)]
            self.templates.append((raw, seq, step_at, times, t_step))
        self.seq = self.step = 0
        self.dropped = 0

    def next(self, with_samples: bool) -> bytes:
        """The next batch frame (header and body): :attr:`steps` step records."""
        raw, seq, step_at, times, t_step = self.templates[0 if with_samples else 1]
        self.seq += 1
        now = time.time()
        self._u32.pack_into(raw, seq, self.seq)
        for at in times:
            self._f64.pack_into(raw, at, now)
        for i, (at_step, at_t) in enumerate(zip(step_at, t_step, strict=True)):
            self._u32.pack_into(raw, at_step, self.step + i)
            self._f64.pack_into(raw, at_t, now - (self.steps - i) * PERIOD_S)
        self.step += self.steps
        return bytes(raw)


# Step rows at 100k+/s: fixed-width msgpack (uint32/uint64/float64 with their type tags)
# laid out by a numpy record dtype, so a batch of rows is filled by a few vector ops.
_INT_FIELDS = {"step": "u4", "comm_bytes": "u8", "comm_calls": "u4", "samples": "u4"}
_TAG = {"u4": 0xCE, "u8": 0xCF, "f8": 0xCB}
#: the step fields these batches fill; any other (collectives: nil for DDP) is nil
_NUM_FIELDS = ("step", "t_wall", "step_s", "data_wait_s", "compute_s", "gpu_s", "comm_s",
               "comm_exposed_s", "comm_bytes", "comm_calls", "algbw_Bps", "busbw_Bps",
               "samples", "gap_s")
_ROW_HEAD = bytes([0x90 | len(STEP_FIELDS)]) if len(STEP_FIELDS) < 16 else \
    b"\xdc" + len(STEP_FIELDS).to_bytes(2, "big")  # the row's msgpack array header
_ROW_DTYPE = np.dtype([("array", f"S{len(_ROW_HEAD)}")] + [
    item for f in STEP_FIELDS
    for item in (((f"{f}__tag", "u1"), (f, ">" + _INT_FIELDS.get(f, "f8")))
                 if f in _NUM_FIELDS else ((f"{f}__nil", "u1"),))])


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


class FastStepBatches:
    """Batches of ``rows`` step records for one rank, encoded without per-row Python."""

    def __init__(self, rank: int, world: int, group: str, rows: int) -> None:
        assert 0 < rows < 65536
        self.rng = np.random.default_rng(rank)
        self.rows = np.zeros(rows, dtype=_ROW_DTYPE)
        self.rows["array"] = _ROW_HEAD
        for f in STEP_FIELDS:
            if f in _NUM_FIELDS:
                self.rows[f"{f}__tag"] = _TAG[_INT_FIELDS.get(f, "f8")]
            else:
                self.rows[f"{f}__nil"] = 0xC0  # msgpack nil
        self.rows["comm_bytes"], self.rows["comm_calls"], self.rows["samples"] = COMM_BYTES, 112, 16
        self.n, self.bus, self.step, self.seq = rows, 2 * (world - 1) / world, 0, 0
        pk = msgpack.packb
        self._head = (b"\x92" + pk("batch") + b"\x86" + pk("rank") + pk(rank) + pk("group")
                      + pk(group) + pk("dropped") + pk(0))
        self._steps_key = pk("steps") + _array_header(rows)

    def next(self) -> bytes:
        """The next frame (header and body)."""
        n, r, rng, now = self.n, self.rows, self.rng, time.time()
        step_s = np.maximum(rng.normal(PERIOD_S, 0.006, n), 0.3)
        data = np.abs(rng.normal(0.004, 0.0015, n))
        comm = np.maximum(rng.normal(0.12, 0.008, n), 0.02)
        exposed = comm * 0.15
        gap = np.abs(rng.normal(0.0008, 0.0002, n))
        compute = step_s - data - exposed - gap
        r["step"] = np.arange(self.step, self.step + n)
        r["t_wall"] = now - np.cumsum(step_s[::-1])[::-1]
        r["step_s"], r["data_wait_s"], r["compute_s"] = step_s, data, compute
        r["gpu_s"], r["comm_s"] = compute * 0.97, comm
        r["comm_exposed_s"], r["gap_s"] = exposed, gap
        r["algbw_Bps"] = COMM_BYTES / comm
        r["busbw_Bps"] = r["algbw_Bps"] * self.bus
        body = b"".join((self._head, msgpack.packb("seq"), msgpack.packb(self.seq),
                         msgpack.packb("t_wall"), msgpack.packb(now), self._steps_key,
                         r.tobytes()))
        self.step += n
        self.seq += 1
        return wire.HEADER.pack(wire.MAGIC, wire.VERSION, len(body)) + body


def check_frames() -> None:
    """Both generators' frames decode to what the collectors would have sent."""
    p = RankStream(3, 8, "g").batch(with_samples=True)
    for key, fields in (("steps", STEP_FIELDS), ("gpu", GPU_FIELDS), ("host", HOST_FIELDS),
                        ("mem", MEM_FIELDS), ("hb", HEARTBEAT_FIELDS)):
        assert len(p[key][0]) == len(fields), key
    step = dict(zip(STEP_FIELDS, p["steps"][0], strict=True))
    assert step["step"] == 0 and step["comm_bytes"] == COMM_BYTES and step["samples"] == 16
    assert abs(step["step_s"] - step["data_wait_s"] - step["compute_s"] - step["comm_exposed_s"]
               - step["gap_s"]) < 1e-9 and step["busbw_Bps"] > step["algbw_Bps"]
    patched = PatchedStream(3, 8, "g")
    for k in range(3):
        q = wire.decode_body(patched.next(with_samples=k % 2 == 0)[wire.HEADER_BYTES:]).payload
        assert q["seq"] == k + 1 and q["steps"][0][0] == k and q["rank"] == 3, q
        assert abs(q["t_wall"] - time.time()) < 5 and ("gpu" in q) == (k % 2 == 0), q
    two = PatchedStream(3, 8, "g", steps=2)
    for k in range(2):
        q = wire.decode_body(two.next(with_samples=True)[wire.HEADER_BYTES:]).payload
        assert [r[0] for r in q["steps"]] == [2 * k, 2 * k + 1] and q["seq"] == k + 1, q
        assert q["steps"][0][1] < q["steps"][1][1] < q["t_wall"], q
    frame = FastStepBatches(3, 8, "g", 20).next()
    got = wire.decode_body(frame[wire.HEADER_BYTES:])
    q = got.payload
    assert got.kind == wire.KIND_BATCH and q["rank"] == 3 and q["group"] == "g", q.keys()
    rows = q["steps"]
    assert len(rows) == 20 and all(len(row) == len(STEP_FIELDS) for row in rows)
    first = dict(zip(STEP_FIELDS, rows[0], strict=True))
    assert first["step"] == 0 and isinstance(first["step"], int), first
    assert first["comm_bytes"] == COMM_BYTES and 0.3 <= first["step_s"] < 0.7, first
    assert rows[-1][0] == 19 and rows[-1][1] > first["t_wall"]


# ---- load generators (child processes) ---------------------------------------------------


class Counters:
    """This generator's row of the shared counter array."""

    def __init__(self, arr: Any, idx: int) -> None:
        self.arr, self.base = arr, idx * NC

    def add(self, i: int, n: float = 1.0) -> None:
        self.arr[self.base + i] += n

    def set(self, i: int, v: float) -> None:
        self.arr[self.base + i] = v


def raise_nofile(need: int) -> int:
    """Raise this process's open-file soft limit to at least ``need`` (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Conn:
    """One rank's connection, from a generator's side."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.decoder = wire.FrameDecoder()
        self.alive = False


class Generator:
    """The asyncio side of one load-generator process."""

    def __init__(self, idx: int, opts: dict[str, Any], counters: Any, flags: dict[str, Any],
                 notes: Any) -> None:
        self.idx, self.o, self.c = idx, opts, Counters(counters, idx)
        self.flags, self.notes = flags, notes
        self.host, self.port = wire.parse_address(opts["address"])
        #: in relay mode, each node's relay (by node number): its ranks connect there
        self.relays = [wire.parse_address(a) for a in opts.get("relay_addrs") or []]
        self.stopping = False  # stop sending (flags["stop"])
        self.quitting = False  # say bye and leave (flags["quit"])
        self._ppid = os.getppid()
        self._noted = 0

    def note(self, text: str) -> None:
        if self._noted < 5:
            self._noted += 1
            with contextlib.suppress(Exception):
                self.notes.put_nowait(f"generator {self.idx}: {text}")

    async def watch(self) -> None:
        """Follow the parent's flags; leave at once if the parent died."""
        while True:
            if os.getppid() != self._ppid:
                os._exit(3)
            self.stopping = self.stopping or self.flags["stop"].is_set()
            self.quitting = self.quitting or self.flags["quit"].is_set()
            await asyncio.sleep(0.1)

    async def connect(self, conn: Conn, world: int, group: str,
                      sem: asyncio.Semaphore | None) -> None:
        """Open the connection, say hello, wait for the welcome; retry transient failures."""
        loop = asyncio.get_running_loop()
        async with sem if sem is not None else contextlib.nullcontext():
            for attempt in range(8):
                if self.quitting:
                    return
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                if self.o.get("sndbuf"):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.o["sndbuf"])
                target = self.relays[conn.rank // RANKS_PER_NODE] if self.relays else \
                    (self.host, self.port)
                try:
                    await asyncio.wait_for(loop.sock_connect(sock, target), 20)
                    conn.reader, conn.writer = await asyncio.open_connection(sock=sock)
                    nonce = auth.new_nonce()
                    conn.writer.write(wire.encode(wire.KIND_HELLO, hello_payload(
                        conn.rank, world, group, nonce)))
                    await asyncio.wait_for(self._welcome(conn, nonce), 30)
                    conn.alive = True
                    self.c.add(C_CONNECTED)
                    return
                except (OSError, asyncio.TimeoutError, wire.WireError) as exc:
                    if conn.writer is not None:
                        conn.writer.close()
                    else:
                        sock.close()
                    conn.reader = conn.writer = None
                    conn.decoder = wire.FrameDecoder()
                    if attempt == 7:
                        self.note(f"rank {conn.rank} could not connect: {exc!r}")
                    await asyncio.sleep(0.2 * 2 ** attempt * random.uniform(0.7, 1.3))
                except RuntimeError as exc:  # refused by the hub: no point retrying
                    if conn.writer is not None:
                        conn.writer.close()
                    self.note(f"rank {conn.rank}: {exc}")
                    break
            self.c.add(C_FAILED)

    async def _next_frames(self, conn: Conn) -> list[wire.Frame]:
        assert conn.reader is not None
        while True:
            data = await conn.reader.read(65536)
            if not data:
                raise ConnectionError("the hub closed the connection before its welcome")
            frames = conn.decoder.feed(data)
            if frames:
                return frames

    async def _welcome(self, conn: Conn, nonce: bytes) -> None:
        """The handshake (collectors.auth), as the collectors do it: the hub's challenge,
        our proof, then the welcome with the hub's proof, checked."""
        assert conn.writer is not None
        key = self.o["key"]
        frames = await self._next_frames(conn)
        first = frames.pop(0)
        hub_nonce = first.payload.get("nonce")
        if first.kind != wire.KIND_CHALLENGE or not isinstance(hub_nonce, bytes):
            raise RuntimeError(f"hub answered the hello with {first.kind!r}, not a "
                               f"challenge: {first.payload}")
        conn.writer.write(wire.encode(wire.KIND_AUTH, {
            "proof": auth.client_proof(key, "rank", hub_nonce, nonce)}))
        if not frames:
            frames = await self._next_frames(conn)
        if frames[0].kind != wire.KIND_WELCOME or not auth.check(
                auth.hub_proof(key, "rank", nonce, hub_nonce), frames[0].payload.get("proof")):
            raise RuntimeError(f"hub answered the proof with {frames[0].kind!r}, not a "
                               f"welcome that proves the token: {frames[0].payload}")
        self._handle(conn, frames[1:])

    def _handle(self, conn: Conn, frames: list[wire.Frame]) -> None:
        for f in frames:
            if f.kind == wire.KIND_PING and conn.writer is not None:
                conn.writer.write(wire.encode(wire.KIND_PONG, {
                    "t_hub": f.payload.get("t_hub"), "seq": f.payload.get("seq"),
                    "t_rank": time.time()}))
                self.c.add(C_PONGS)
            elif f.kind == wire.KIND_ERROR:
                self.c.add(C_ERRORS)
                self.note(f"rank {conn.rank} got an error frame: {f.payload}")

    async def pump(self, conn: Conn) -> None:
        """Read what the hub sends: answer pings, count errors and closes."""
        assert conn.reader is not None
        try:
            while True:
                data = await conn.reader.read(65536)
                if not data:
                    break
                self._handle(conn, conn.decoder.feed(data))
        except (OSError, wire.WireError):
            pass
        if conn.alive and not self.quitting:
            self.c.add(C_CLOSED)
            self.note(f"the hub closed rank {conn.rank}'s connection")
        conn.alive = False

    async def drain_all(self, conns: list[Conn], timeout: float) -> None:
        async def one(w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                await w.drain()

        writers = [c.writer for c in conns if c.writer is not None and not c.writer.is_closing()]
        if writers:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(one(w) for w in writers)), timeout)

    async def session(self, world: int, group: str,
                      send: Callable[[list[Conn]], Any]) -> None:
        """Connect this generator's ranks, run ``send`` until told to stop, say bye."""
        conns = [Conn(r) for r in range(self.idx, world, self.o["procs"])]
        watcher = asyncio.create_task(self.watch())
        conc = self.o["connect_concurrency"]
        sem = asyncio.Semaphore(conc) if conc > 0 else None
        pumps: list[asyncio.Task[None]] = []

        sending = asyncio.Event()
        settled = [0]  # connections that got in or gave up

        async def connect(conn: Conn) -> None:
            await self.connect(conn, world, group, sem)
            settled[0] += 1
            if settled[0] == len(conns):
                sending.set()
            if not conn.alive:
                return
            # while the others connect, it answers the hub's pings and says it is
            # alive every 2 s (an empty batch, as a rank's sender sends one when its
            # loop is idle), so that a slow start loses no rank to the hub's timeouts
            pumps.append(asyncio.create_task(self.pump(conn)))
            idle = wire.encode(wire.KIND_BATCH, {"rank": conn.rank, "group": group,
                                                 "seq": 0, "dropped": 0})
            while not sending.is_set() and conn.alive and conn.writer is not None:
                conn.writer.write(idle)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(sending.wait(), 2.0)

        await asyncio.gather(*(connect(c) for c in conns))
        await send([c for c in conns if c.alive])
        await self.drain_all(conns, 10.0)
        self.c.set(C_READY, 2)  # sent everything
        while not self.quitting:
            await asyncio.sleep(0.05)
        for conn in conns:
            if conn.alive and conn.writer is not None and not conn.writer.is_closing():
                conn.writer.write(wire.encode(wire.KIND_BYE, {
                    "rank": conn.rank, "group": group, "dropped": 0}))
        await self.drain_all(conns, 5.0)
        # half-close and let the hub close first: closing a socket with unread data (a
        # ping) would send a reset, and the hub would lose what it had not read yet
        for conn in conns:
            if conn.writer is not None and not conn.writer.is_closing():
                with contextlib.suppress(OSError):
                    conn.writer.write_eof()
        if pumps:
            await asyncio.wait(pumps, timeout=10.0)
        for conn in conns:
            conn.alive = False
            if conn.writer is not None:
                conn.writer.close()
        for t in [*pumps, watcher]:
            t.cancel()
        await asyncio.gather(*pumps, watcher, return_exceptions=True)

    # -- phase 1 ---------------------------------------------------------------------------

    async def send_job(self, conns: list[Conn]) -> None:
        """Phase 1: every rank one batch per flush interval (``--flush``: as the
        collectors send in a world this big), in its own slot of the interval; a batch
        holds the steps of the interval (2 steps/s) and, once a second, the samples."""
        world, flush_s = self.o["ranks"], self.o["flush"]
        steps = max(1, round(flush_s / PERIOD_S))
        streams = {c.rank: PatchedStream(c.rank, world, f"{JOB}-g0", steps) for c in conns}
        loop = asyncio.get_running_loop()
        # each rank owns a slot of the interval, at random as each rank's sender thread
        # keeps its own (so a node's ranks are spread over it too, as a relay sees them);
        # loop.time() is CLOCK_MONOTONIC, shared by the processes, so the slots line up
        order = sorted((random.Random(c.rank).random() * flush_s, c.rank, c) for c in conns)
        self.c.set(C_READY, 1)
        t0 = math.ceil(loop.time() / flush_s + 1) * flush_s
        every = max(1, round(1.0 / flush_s))  # batches per sample (samples at 1 Hz)
        tick, lag_max, high_water = 0, 0.0, self.o["backlog_bytes"]
        while not self.stopping:
            base = t0 + tick * flush_s
            if loop.time() - base > flush_s:  # fell a whole interval behind: skip ahead
                behind = int((loop.time() - t0) / flush_s) - tick
                self.c.add(C_SKIPPED, behind * len(order))
                tick += behind
                continue
            for offset, _, conn in order:
                delay = base + offset - loop.time()
                if delay > 0.001:
                    await asyncio.sleep(delay)
                elif delay < -0.05:
                    self.c.add(C_LATE)
                    lag_max = max(lag_max, -delay)
                w = conn.writer
                if not conn.alive or w is None or w.is_closing():
                    continue
                stream = streams[conn.rank]
                if w.transport.get_write_buffer_size() > high_water:
                    stream.dropped += 1  # like the collectors: never queue without bound
                    self.c.add(C_DROPPED)
                    continue
                data = stream.next(with_samples=tick % every == 0)
                w.write(data)
                self.c.add(C_STEPS, steps)
                self.c.add(C_FRAMES)
                self.c.add(C_BYTES, len(data))
            self.c.set(C_LAG_MAX, lag_max)
            tick += 1

    # -- phase 2 ---------------------------------------------------------------------------

    async def send_flood(self, conns: list[Conn]) -> None:
        """Phase 2: big batches at the offered rate the parent sets (rows/s, all together)."""
        self.c.set(C_READY, 1)
        senders = [asyncio.create_task(self._flood(c)) for c in conns]
        while not self.stopping:
            await asyncio.sleep(0.05)
        await asyncio.gather(*senders, return_exceptions=True)

    async def _flood(self, conn: Conn) -> None:
        o, rate = self.o, self.flags["rate"]
        batches = FastStepBatches(conn.rank, o["p2_conns"], f"{JOB}-max", o["p2_rows"])
        loop = asyncio.get_running_loop()
        w = conn.writer
        assert w is not None
        last: float | None = None  # when this connection last sent
        size = 0
        with contextlib.suppress(ConnectionError, OSError):
            while not self.stopping and conn.alive and not w.is_closing():
                offered = rate.value
                if offered <= 0:
                    await asyncio.sleep(0.02)
                    last = None
                    continue
                # this connection's share of the offered rate, far under the flood limits;
                # re-read at every wake-up so that a new rate applies at once
                interval = max(o["p2_conns"] * o["p2_rows"] / offered,
                               1.0 / (FLOOD_FRAMES_PER_S * FLOOD_SAFETY),
                               size / (FLOOD_BYTES_PER_S * FLOOD_SAFETY))
                now = loop.time()
                if last is None:  # spread the connections over the first interval
                    last = now - random.random() * interval
                due = last + interval
                if due > now:
                    await asyncio.sleep(min(due - now, 0.1))
                    continue
                data = batches.next()
                size = len(data)
                w.write(data)
                self.c.add(C_STEPS, o["p2_rows"])
                self.c.add(C_FRAMES)
                self.c.add(C_BYTES, size)
                await w.drain()
                last = max(due, loop.time() - 0.5)  # no long catch-up bursts


def generator_main(kind: str, idx: int, opts: dict[str, Any], counters: Any,
                   flags: dict[str, Any], notes: Any) -> None:
    """Entry point of a load-generator process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    os.nice(opts.get("load_nice", 0))  # the ranks' machines, not the hub's
    world = opts["ranks"] if kind == "job" else opts["p2_conns"]
    raise_nofile(world // opts["procs"] + 256)
    gen = Generator(idx, opts, counters, flags, notes)
    try:
        if kind == "job":
            asyncio.run(gen.session(world, f"{JOB}-g0", gen.send_job))
        else:
            asyncio.run(gen.session(world, f"{JOB}-max", gen.send_flood))
    except Exception as exc:
        gen.note(f"crashed: {exc!r}")
        raise
    finally:
        gen.c.set(C_DONE, 1)


# ---- relays (child processes) ------------------------------------------------------------


def relay_main(idx: int, nodes: list[int], opts: dict[str, Any], addrs: Any, flags: Any,
               counters: Any) -> None:
    """Entry point of a relay process: one real relay per node of ``nodes``, each with
    its own listening socket and its own connection to the hub, on one event loop.
    Each relay's address goes into ``addrs`` (by node); its counters, summed, into
    ``counters`` row ``idx`` at the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(opts.get("load_nice", 0))  # the nodes' machines, not the hub's
    raise_nofile(len(nodes) * (RANKS_PER_NODE + 3) + 256)
    from rtop.hub.relay import Relay, RelayConfig

    async def run() -> None:
        relays: list[Relay] = []
        ppid = os.getppid()
        for k, node in enumerate(nodes):
            relay = Relay(RelayConfig(
                hub=opts["address"], token=opts["ingest"], node=f"node-{node:04d}",
                job=JOB, interval_s=opts["relay_interval"], linger_s=None))
            await relay.start()
            relays.append(relay)
            if k % 16 == 15:  # a few at a time: handshakes, not a burst of thousands
                deadline = time.monotonic() + 10
                while not all(r.up for r in relays[-16:]) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
        deadline = time.monotonic() + 60
        while not all(r.up for r in relays) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for node, relay in zip(nodes, relays, strict=True):  # the ranks come once all are up
            addrs[node] = relay.address
        def publish() -> None:
            for j, key in enumerate(RelayFleet.KEYS):
                counters[idx * len(RelayFleet.KEYS) + j] = sum(r.counters[key]
                                                               for r in relays)

        while not flags["quit"].is_set():
            if os.getppid() != ppid:
                os._exit(3)
            publish()
            await asyncio.sleep(0.2)
        publish()
        for r in relays:
            await r.close()

    asyncio.run(run())


class RelayFleet:
    """``--relay-procs`` processes running one relay per simulated node between them
    (see :func:`relay_main`)."""

    KEYS = ("frames_up", "bytes_up", "frames_down", "hub_losses", "streams")

    def __init__(self, opts: dict[str, Any], procs: int) -> None:
        ctx = mp.get_context("spawn")
        nodes = -(-opts["ranks"] // RANKS_PER_NODE)
        self.n = min(procs, nodes)
        self.addrs = ctx.Manager().dict()
        self.flags = {"quit": ctx.Event()}
        self.counters = ctx.RawArray("d", self.n * len(self.KEYS))
        self.procs = [ctx.Process(target=relay_main, name=f"rtop-relays-{i}",
                                  args=(i, list(range(i, nodes, self.n)), opts, self.addrs,
                                        self.flags, self.counters), daemon=True)
                      for i in range(self.n)]
        for p in self.procs:
            p.start()
        self.ps = [psutil.Process(p.pid) for p in self.procs if p.pid is not None]
        self.nodes = nodes

    def addresses(self, timeout: float) -> list[str]:
        """Every node's relay address, by node, once all listen."""
        wait_until(lambda: len(self.addrs) >= self.nodes, timeout, "the relays to start",
                   lambda: f"{len(self.addrs)} of {self.nodes} relays listening",
                   [self.alive_check])
        return [self.addrs[n] for n in range(self.nodes)]

    def alive_check(self) -> None:
        if any(p.exitcode not in (None, 0) for p in self.procs):
            raise RuntimeError("a relay process died")

    def total(self, key: str) -> int:
        """A counter summed over the relays (published every 0.2 s)."""
        j, k = self.KEYS.index(key), len(self.KEYS)
        return int(sum(self.counters[i * k + j] for i in range(self.n)))

    def finish(self, timeout: float = 20.0) -> None:
        self.flags["quit"].set()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(3)


# ---- the parent: hubs, generators, measurements ------------------------------------------


class HubProcess:
    """``python -m rtop serve`` in its own session, logging to a file."""

    def __init__(self, tmp: Path, name: str, token: str, profile: Path | None) -> None:
        self.log_path = tmp / f"{name}.log"
        self.record = tmp / f"{name}.rtop"
        self.profile = profile
        cmd = [sys.executable]
        if profile is not None:
            cmd += ["-m", "cProfile", "-o", str(profile)]
        cmd += ["-m", "rtop", "serve", "--port", "0", "--token", token,
                "--record", str(self.record), "--job", JOB,
                "--discovery-file", str(tmp / f"{name}.json"),
                "--linger", "60"]  # exits by itself should this benchmark be killed
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_address(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"^rtop hub (\S+:\d+)$", self.log_text(), re.M)
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("the hub did not start:\n" + self.log_text()[-3000:])

    def alive_check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError("the hub exited:\n" + self.log_text()[-3000:])

    def rss(self) -> int:
        try:
            return int(self.ps.memory_info().rss)
        except psutil.Error:
            return 0

    def record_bytes(self) -> int:
        try:
            return self.record.stat().st_size
        except OSError:
            return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)  # the hub closes and flushes on TERM
            try:
                self.proc.wait(30 if self.profile else 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class CpuMeter:
    """CPU used by a set of processes since the last call, in % of one core."""

    def __init__(self, procs: Callable[[], list[psutil.Process]]) -> None:
        self.procs = procs
        self.t0 = self.t = time.monotonic()
        self.cpu0 = self.cpu = self.seconds()

    def seconds(self) -> float:
        total = 0.0
        for p in self.procs():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def sample(self) -> float:
        t, cpu = time.monotonic(), self.seconds()
        pct = 100.0 * (cpu - self.cpu) / max(t - self.t, 1e-6)
        self.t, self.cpu = t, cpu
        return pct


def children(proc: psutil.Process) -> list[psutil.Process]:
    """``proc``'s child processes (the hub's: its recorder, ``rtop.hub.record_proc``)."""
    try:
        return list(proc.children(recursive=True))
    except psutil.Error:
        return []


class SystemMeter:
    """Busy CPU of the whole machine since the last call, in % of one core."""

    def __init__(self) -> None:
        self.t, self.busy = time.monotonic(), self._busy()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(getattr(t, f, 0.0) for f in ("user", "system", "nice", "irq", "softirq",
                                                 "steal"))

    def sample(self) -> float:
        t, busy = time.monotonic(), self._busy()
        pct = 100.0 * (busy - self.busy) / max(t - self.t, 1e-6)
        self.t, self.busy = t, busy
        return pct


class Fleet:
    """The load-generator processes of one phase and their shared counters."""

    def __init__(self, kind: str, opts: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.n = opts["procs"]
        self.counters = ctx.RawArray("d", self.n * NC)
        self.rate = ctx.RawValue("d", 0.0)
        self.flags = {"stop": ctx.Event(), "quit": ctx.Event(), "rate": self.rate}
        self.notes = ctx.Queue()
        self.notes_seen: list[str] = []
        self.procs = [ctx.Process(target=generator_main, name=f"rtop-load-{kind}-{i}",
                                  args=(kind, i, opts, self.counters, self.flags, self.notes),
                                  daemon=True) for i in range(self.n)]
        for p in self.procs:
            p.start()
        self.ps = [psutil.Process(p.pid) for p in self.procs if p.pid is not None]

    def total(self, i: int) -> float:
        return sum(self.counters[g * NC + i] for g in range(self.n))

    def maximum(self, i: int) -> float:
        return max(self.counters[g * NC + i] for g in range(self.n))

    def all_at_least(self, i: int, v: float) -> bool:
        return all(self.counters[g * NC + i] >= v for g in range(self.n))

    def alive_check(self) -> None:
        if any(p.exitcode not in (None, 0) for p in self.procs):
            raise RuntimeError("a generator process died: " + "; ".join(self.drain_notes()))

    def drain_notes(self) -> list[str]:
        """What the generators had to say (kept in ``notes_seen``)."""
        with contextlib.suppress(Exception):
            while True:
                self.notes_seen.append(self.notes.get_nowait())
        return self.notes_seen

    def finish(self, timeout: float = 20.0) -> None:
        """Ask the generators to say bye and leave; kill the ones that do not."""
        self.flags["stop"].set()
        self.flags["quit"].set()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)
        self.drain_notes()
        with contextlib.suppress(Exception):
            self.notes.cancel_join_thread()
            self.notes.close()


def wait_until(cond: Callable[[], bool], timeout: float, what: str,
               progress: Callable[[], str] | None = None,
               checks: Sequence[Callable[[], None]] = ()) -> None:
    deadline = time.monotonic() + timeout
    next_print = time.monotonic() + 5
    while not cond():
        for check in checks:
            check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}"
                               + (f" ({progress()})" if progress else ""))
        if progress is not None and time.monotonic() > next_print:
            print(f"  ... {progress()}", flush=True)
            next_print += 5
        time.sleep(0.05)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def fmax(xs: Sequence[float]) -> float:
    return max(xs) if xs else math.nan


class Viewer:
    """A viewer connection that times snapshot requests: those of ``view`` (what the
    UI's fleet view asks for: aggregates, findings, the top outliers and the rows in
    sight), or every rank's row (``view`` None: what ``rtop status`` asks for)."""

    def __init__(self, address: str, token: str, view: ViewRequest | None = None) -> None:
        self.address, self.token, self.view = address, token, view
        self.client = HubClient(address, token, timeout=120.0)
        self.rtt: list[float] = []
        self.build: list[float] = []
        self.sizes: list[int] = []
        self.failures = 0

    def snapshot(self, keep: bool = True, full: bool = False
                 ) -> tuple[dict[str, Any], float] | None:
        """A snapshot (every rank's row when ``full``, else the viewer's) and when it
        was taken (middle of the request, monotonic seconds). A hub that takes longer
        than 120 s to answer (overloaded) counts a failure; the viewer connects again
        and waits up to 10 minutes for the next."""
        t0 = time.monotonic()
        try:
            snap = self.client.snapshot(None if full else self.view)
        except HubError as exc:
            self.failures += 1
            print(f"  viewer: snapshot failed: {exc}", flush=True)
            self.close()
            with contextlib.suppress(HubError, OSError):
                self.client = HubClient(self.address, self.token, timeout=600.0)
            return None
        rtt = time.monotonic() - t0
        if keep:
            self.rtt.append(rtt)
            self.build.append(float(snap.get("build_s") or math.nan))
            self.sizes.append(len(msgpack.packb(snap, use_bin_type=True)))
        return snap, t0 + rtt / 2

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


def step_records(snap: dict[str, Any]) -> int:
    return int(snap["run"]["step_records"])


def frames_applied(snap: dict[str, Any]) -> int:
    return int(snap["run"]["frames"])


def run_job_phase(args: argparse.Namespace, opts: dict[str, Any], hub: HubProcess,
                  viewer: Viewer, res: dict[str, Any], relays: RelayFleet | None = None
                  ) -> None:
    """Phase 1: --ranks ranks for --duration seconds (through ``relays``, if given)."""
    via = f", through {relays.nodes} relays in {relays.n} processes" if relays else ""
    print(f"phase 1: {args.ranks} ranks from {args.procs} generator processes{via} ...",
          flush=True)
    t_start = time.monotonic()
    fleet = Fleet("job", opts)
    res["fleet"] = fleet
    checks: tuple[Callable[[], None], ...] = (fleet.alive_check, hub.alive_check)
    if relays is not None:
        checks += (relays.alive_check,)
    try:
        wait_until(lambda: fleet.all_at_least(C_READY, 1), 120 + args.ranks / 20,
                   "the ranks to connect",
                   lambda: f"{fleet.total(C_CONNECTED):.0f} of {args.ranks} connected", checks)
        res["connect_s"] = time.monotonic() - t_start
        res["connected"] = int(fleet.total(C_CONNECTED))
        res["connect_failed"] = int(fleet.total(C_FAILED))
        print(f"  {res['connected']} ranks connected in {res['connect_s']:.1f} s"
              + (f", {res['connect_failed']} FAILED" if res["connect_failed"] else ""),
              flush=True)
        time.sleep(args.warmup)  # first pings, first samples, generators settle
        res["rss_connected"] = hub.rss()

        hub_cpu, gen_cpu, sys_cpu = (CpuMeter(lambda: [hub.ps]), CpuMeter(lambda: fleet.ps),
                                     SystemMeter())
        self_cpu = CpuMeter(lambda: [psutil.Process()])
        relay_cpu = CpuMeter(lambda: relays.ps if relays is not None else [])
        rec_cpu = CpuMeter(lambda: children(hub.ps))  # apart from the hub's own
        recs: list[float] = []
        cpu: list[float] = []
        gens: list[float] = []
        rel: list[float] = []
        other: list[float] = []
        rss = [hub.rss()]
        rec0, sent0 = hub.record_bytes(), fleet.total(C_STEPS)
        up0 = relays.total("frames_up") if relays is not None else 0
        first = viewer.snapshot(keep=False, full=True)
        if first is None:
            raise RuntimeError("the viewer could not get a first snapshot")
        t_begin = time.monotonic()
        t_end = t_begin + args.duration
        next_sample, next_snap = t_begin + 1.0, t_begin + 1.0 / args.viewer_hz
        print(f"  measuring for {args.duration:.0f} s ...", flush=True)
        while (now := time.monotonic()) < t_end:
            if now >= next_snap:
                viewer.snapshot()
                next_snap = max(next_snap + 1.0 / args.viewer_hz, time.monotonic())
            if now >= next_sample:
                c, g, s, me, rl = hub_cpu.sample(), gen_cpu.sample(), sys_cpu.sample(), \
                    self_cpu.sample(), relay_cpu.sample()
                cpu.append(c)
                gens.append(g)
                rel.append(rl)
                recs.append(rec_cpu.sample())
                other.append(max(0.0, s - c - g - me - rl - recs[-1]))
                rss.append(hub.rss())
                next_sample += 1.0
                for check in checks:
                    check()
            time.sleep(max(0.0, min(next_snap, next_sample, t_end) - time.monotonic()))
        sent1 = fleet.total(C_STEPS)
        up1 = relays.total("frames_up") if relays is not None else 0
        hub_cpu_s = hub_cpu.seconds() - hub_cpu.cpu0
        rec_cpu_s = rec_cpu.seconds() - rec_cpu.cpu0
        last = viewer.snapshot(keep=False, full=True) or viewer.snapshot(keep=False, full=True)
        if last is None:
            raise RuntimeError("the viewer could not get a last snapshot")
        rec1, t_rec = hub.record_bytes(), time.monotonic()
        snap, t_last = last
        span = t_last - first[1]
        n_frames = frames_applied(snap) - frames_applied(first[0])
        build_total = sum(b for b in viewer.build if not math.isnan(b))
        res["relay_frame_rate"] = (up1 - up0) / span
        res.update(rec_cpu=recs, rec_cpu_per_frame=rec_cpu_s / max(n_frames, 1))
        res.update(cpu=cpu, rss=rss, gen_cpu=gens, relay_cpu=rel, other_cpu=other, span=span,
                   ingest_rate=(step_records(snap) - step_records(first[0])) / span,
                   sent_rate=(sent1 - sent0) / span, nominal_rate=args.ranks / PERIOD_S,
                   nominal_frames=args.ranks / args.flush,
                   behind=int(sent1 - step_records(snap)),
                   record_rate=(rec1 - rec0) / max(t_rec - t_begin, 1e-6),
                   cpu_per_frame=hub_cpu_s / max(n_frames, 1),
                   cpu_per_frame_ingest=(hub_cpu_s - build_total) / max(n_frames, 1),
                   snap_bytes=median(viewer.sizes), viewer=viewer.view is not None,
                   rtt=list(viewer.rtt), build=list(viewer.build),
                   viewer_failures=viewer.failures)
        status = snap["ranks"]["status"]
        res["relays_up"] = int(snap["hub"]["counters"].get("relays", 0))
        res["hub_counters"] = dict(snap["hub"]["counters"])
        with contextlib.suppress(psutil.Error):  # the hub's own TCP connections
            res["hub_sockets"] = sum(1 for c in hub.ps.net_connections("tcp")
                                     if c.status == psutil.CONN_ESTABLISHED)
        res["ranks_listed"] = len(status)
        res["ranks_active"] = sum(1 for s in status if s == "active")
        res["ranks_offset"] = sum(1 for x in snap["ranks"]["offset_s"] if x is not None)
        res["ranks_step"] = sum(1 for x in snap["ranks"]["step_s"] if x is not None)
        for key, counter in (("late", C_LATE), ("skipped", C_SKIPPED), ("dropped", C_DROPPED),
                             ("closed", C_CLOSED), ("errors", C_ERRORS), ("pongs", C_PONGS)):
            res[key] = int(fleet.total(counter))
        res["lag_max"] = fleet.maximum(C_LAG_MAX)
        t = time.perf_counter()
        msgpack.unpackb(msgpack.packb(snap, use_bin_type=True), raw=False)
        res["client_decode_s"] = time.perf_counter() - t

        # stop sending; how long until everything sent has been ingested?
        fleet.flags["stop"].set()
        wait_until(lambda: fleet.all_at_least(C_READY, 2), 30,
                   "the generators to stop sending", checks=checks)
        t_stop = time.monotonic()
        sent_total = int(fleet.total(C_STEPS))
        got = viewer.snapshot(keep=False)
        while got is not None and step_records(got[0]) < sent_total \
                and time.monotonic() - t_stop < args.drain_timeout:
            if time.monotonic() - t_stop > 5:
                print(f"  ... hub catching up: {step_records(got[0]):,} of {sent_total:,} "
                      "ingested", flush=True)
                time.sleep(2)
            else:
                time.sleep(0.25)
            got = viewer.snapshot(keep=False)
        res["sent_total"] = sent_total
        res["ingested_total"] = step_records(got[0]) if got else -1
        res["drain_s"] = time.monotonic() - t_stop
    finally:
        fleet.finish()
        res["notes"] = list(fleet.notes_seen)


def run_flood_phase(args: argparse.Namespace, opts: dict[str, Any], hub: HubProcess,
                    viewer: Viewer) -> dict[str, Any]:
    """Phase 2: ramp the offered step records/s until the hub falls behind."""
    print(f"phase 2 (fresh hub): {args.p2_conns} connections x {args.p2_rows}-row batches, "
          f"offered rate x1.5 every {args.p2_step:g} s until the hub falls behind ...",
          flush=True)
    out: dict[str, Any] = {"steps": [], "notes": []}
    fleet = Fleet("flood", opts)
    checks = (fleet.alive_check, hub.alive_check)
    try:
        wait_until(lambda: fleet.all_at_least(C_READY, 1), 120, "the connections",
                   lambda: f"{fleet.total(C_CONNECTED):.0f} of {args.p2_conns} connected",
                   checks)
        out["connected"] = int(fleet.total(C_CONNECTED))
        hub_cpu, gen_cpu = CpuMeter(lambda: [hub.ps]), CpuMeter(lambda: fleet.ps)
        rate = args.p2_start
        t_phase_end = time.monotonic() + args.p2_duration
        while time.monotonic() < t_phase_end:
            fleet.rate.value = rate
            time.sleep(0.5)  # settle
            a = viewer.snapshot(keep=False)
            sent_a = fleet.total(C_STEPS)
            hub_cpu.sample()
            gen_cpu.sample()
            t_a = time.monotonic()
            rss = [hub.rss()]
            while time.monotonic() - t_a < args.p2_step:
                time.sleep(0.5)
                rss.append(hub.rss())
                for check in checks:
                    check()
            sent_b = fleet.total(C_STEPS)
            c, g = hub_cpu.sample(), gen_cpu.sample()
            t_b = time.monotonic()
            b = viewer.snapshot(keep=False)
            if a is None or b is None:
                raise RuntimeError("the viewer lost the hub")
            ingest = (step_records(b[0]) - step_records(a[0])) / (b[1] - a[1])
            sent = (sent_b - sent_a) / (t_b - t_a)
            row = {"offered": rate, "sent": sent, "ingest": ingest, "cpu": c, "gen_cpu": g,
                   "rss": max(rss), "backlog": sent_b - step_records(b[0])}
            out["steps"].append(row)
            print(f"  offered {rate:9,.0f}/s  sent {sent:9,.0f}/s  ingested {ingest:9,.0f}/s  "
                  f"hub CPU {c:3.0f}%  generators {g:3.0f}%  hub RSS {max(rss) / MB:5.0f} MB",
                  flush=True)
            if ingest < 0.9 * sent:
                out["saturated"] = row
                break
            if sent < 0.85 * rate:
                out["generator_bound"] = row
                break
            rate *= 1.5
        fleet.rate.value = 0.0
        out.update(closed=int(fleet.total(C_CLOSED)), errors=int(fleet.total(C_ERRORS)),
                   connected=int(fleet.total(C_CONNECTED)))
    finally:
        fleet.finish()
        out["notes"] = list(fleet.notes_seen)
    out["floods"] = hub.log_text().count("floods the hub")
    return out


def in_process_costs(ranks: int) -> dict[str, Any]:
    """RunState alone, in this process: memory, apply() per frame, snapshot() per call."""
    from rtop.run.state import RunState

    out: dict[str, Any] = {}
    state = RunState(window_steps=1200, window_samples=600)
    group = f"{JOB}-g0"
    t = time.perf_counter()
    for r in range(ranks):
        state.apply(wire.Frame(wire.KIND_HELLO, hello_payload(r, ranks, group)), 1.0)
    out["hello_s"] = (time.perf_counter() - t) / ranks
    out["nbytes"] = state.nbytes()
    streams = [RankStream(r, ranks, group) for r in range(ranks)]
    # frames as the hub gets them: decoded from the wire
    frames = [[wire.decode_body(wire.encode(wire.KIND_BATCH, s.batch(with_samples=i % 2 == 0))
                                [wire.HEADER_BYTES:]) for s in streams] for i in range(4)]
    times = []
    for i in range(len(frames)):
        t = time.perf_counter()
        for f in frames[i]:
            state.apply(f, 2.0 + i)
        times.append((time.perf_counter() - t) / ranks)
    out["apply_samples_s"] = statistics.mean(times[0::2])
    out["apply_plain_s"] = statistics.mean(times[1::2])
    snaps = []
    for _ in range(5):
        t = time.perf_counter()
        snap = state.view()
        snaps.append(time.perf_counter() - t)
    out["snapshot_s"] = median(snaps)
    t = time.perf_counter()
    wire.encode(wire.KIND_SNAPSHOT, snap)
    out["snapshot_encode_s"] = time.perf_counter() - t
    big = FastStepBatches(0, 256, group, 100)
    frame = wire.decode_body(big.next()[wire.HEADER_BYTES:])
    rs = state.rank_state(0)
    assert rs is not None
    t = time.perf_counter()
    n = 200
    for _ in range(n):
        state.on_batch(rs, frame.payload, 3.0)
    out["apply_100_rows_s"] = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        wire.decode_body(big.next()[wire.HEADER_BYTES:])
    out["decode_100_rows_s"] = (time.perf_counter() - t) / n
    del state, streams, frames
    # a restart of the job: a new attempt, the old one kept for its history
    state = RunState(window_steps=1200, window_samples=600, max_ranks=2 * ranks)
    for attempt in range(2):
        for r in range(ranks):
            state.apply(wire.Frame(wire.KIND_HELLO, hello_payload(
                r, ranks, f"{JOB}-g{attempt}")), 1.0 + attempt)
    out["nbytes_restart"] = state.nbytes()
    return out


def scan_log(text: str) -> dict[str, list[str]]:
    """Lines of a hub log worth a look, by what they say."""
    patterns = {
        "floods": "floods the hub", "bad frames": "bad frame",
        "errors": r"unexpected error|Traceback|[A-Za-z]Error\b",
        "lost": "marked lost", "no goodbye": "without saying goodbye",
        "silent": "never spoke|sent nothing for", "refused": "refused",
        "fd limit": "Too many open files|out of system resource",
        "recording": r"recording to .* stopped",
    }
    found: dict[str, list[str]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for name, pat in patterns.items():
            if re.search(pat, line):
                found.setdefault(name, []).append(line.strip())
        if line.startswith("Traceback"):  # the whole of it, with what was logged before
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j] and not lines[j][0].isspace()), len(lines) - 1)
            found.setdefault("traceback", []).append(
                "\n".join(lines[max(0, i - 1):min(end + 1, i + 40)]))
    return found


def print_profile(path: Path, top: int = 30) -> None:
    import pstats

    if not path.exists():
        print(f"(no profile written to {path})")
        return
    print(f"\nhub profile (cProfile, top {top} by own time; cProfile slows the hub down):")
    pstats.Stats(str(path)).sort_stats("tottime").print_stats(top)


def rss_trend(rss: Sequence[int]) -> float:
    """RSS growth in bytes per minute: least squares over the samples (one a second) after
    the first third of the window, which still holds the start-up growth."""
    ys = list(rss[len(rss) // 3:])
    if len(ys) < 3:
        return 0.0
    xs = range(len(ys))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def summarize(args: argparse.Namespace, res: dict[str, Any], p2: dict[str, Any] | None,
              cost: dict[str, Any], logs: dict[str, dict[str, list[str]]],
              hub_nofile: int, mode: str = "direct") -> None:
    cpu, rss = res["cpu"], res["rss"]
    build = [b for b in res["build"] if not math.isnan(b)]
    rtt = res["rtt"]
    us = 1e6
    print()
    via = (f"through {res['relays_up']} relays ({args.relay_procs} processes, "
           f"{args.relay_interval:g} s interval)" if mode == "relays" else "direct")
    print(f"hub scale: {args.ranks} ranks {via}, 2 steps/s each + 1 Hz gpu/host/mem/hb "
          f"samples, a batch every {args.flush:g} s, {args.duration:.0f} s; a viewer at "
          f"{args.viewer_hz:g} Hz  "
          f"({os.cpu_count()} CPUs, {args.procs} generator processes)")
    print(f"  sockets   {res.get('hub_sockets', '?')} TCP connections at the hub"
          + (f"; {res['relay_frame_rate']:,.0f} relay frames/s carried "
             f"{res['ingest_rate']:,.0f} step records/s" if mode == "relays" else ""))
    print(f"  connect   {res['connected']} ranks in {res['connect_s']:.1f} s"
          + (f", {res['connect_failed']} FAILED" if res["connect_failed"] else ""))
    missing = res["sent_total"] - res["ingested_total"]
    keeps = res["ingest_rate"] >= 0.98 * res["sent_rate"] and missing == 0 \
        and res["drain_s"] < 3
    # what the nominal load would take: per-frame ingest cost plus the snapshot builds
    need = 100 * (res["cpu_per_frame_ingest"] * res["nominal_frames"]
                  + median(build) * args.viewer_hz)
    print(f"  hub CPU   median {median(cpu):.0f}% of one core, max {fmax(cpu):.0f}%"
          f"{'':14}(target <= 100%: {verdict(keeps and median(cpu) <= 100)})")
    print(f"{'':12}{res['cpu_per_frame'] * us:.0f} us of hub CPU per batch frame ingested "
          f"({res['cpu_per_frame_ingest'] * us:.0f} us without snapshot builds): the nominal "
          f"load needs ~{need:.0f}% of a core")
    print(f"  recorder  {median(res['rec_cpu']):.0f}% of a core (median), "
          f"{res['rec_cpu_per_frame'] * us:.0f} us per batch frame: the hub's child "
          f"processes (its recording's writer), not in the hub CPU above")
    growth = rss_trend(rss)
    print(f"  hub RSS   max {fmax(rss) / MB:.0f} MB (after connect {res['rss_connected'] / MB:.0f}"
          f" MB, {growth / MB:+.1f} MB/min over the window)   (target <= 500 MB for a "
          f"10-minute window: {verdict(fmax(rss) + max(growth, 0) * 10 <= 500 * MB)})")
    print(f"{'':12}windows: RunState.nbytes() = {cost['nbytes'] / MB:.0f} MB for "
          f"{args.ranks} ranks (preallocated), {cost['nbytes_restart'] / MB:.0f} MB after a "
          f"restart of the job (new attempt, old kept)")
    print(f"  ingest    {res['ingest_rate']:,.0f} step records/s ingested vs "
          f"{res['sent_rate']:,.0f} sent (nominal {res['nominal_rate']:,.0f}) "
          f"({'keeps up' if keeps else 'FALLS BEHIND'})")
    print(f"{'':12}{res['behind']:,} records behind at the end of the window; after the stop "
          f"{res['ingested_total']:,} of {res['sent_total']:,} in after {res['drain_s']:.1f} s")
    rtt_target = 0.1 if args.ranks <= 4096 else 0.2  # issue 28: 200 ms at 16,384 ranks
    print(f"  snapshot  build median {median(build) * 1e3:.0f} ms, max {fmax(build) * 1e3:.0f} "
          f"ms; round trip median {median(rtt) * 1e3:.0f} ms, max {fmax(rtt) * 1e3:.0f} ms  "
          f"(target <= {rtt_target * 1e3:.0f} ms: {verdict(median(rtt) <= rtt_target)})")
    what = "the fleet view (as the UI asks)" if res["viewer"] else "every rank's row"
    print(f"{'':12}{len(rtt)} snapshots of {what}, {res['snap_bytes'] / MB:.2f} MB each "
          f"(every rank's: client decode ~{res['client_decode_s'] * 1e3:.0f} ms); "
          f"{median(build) * args.viewer_hz * 100:.0f}% of the hub's core goes to building "
          f"them at {args.viewer_hz:g} Hz")
    print(f"  ranks     {res['ranks_listed']} listed, {res['ranks_active']} active, "
          f"{res['ranks_offset']} with a clock offset, {res['ranks_step']} with step medians "
          f"({verdict(res['ranks_active'] == args.ranks)})")
    print(f"  recording {res['record_rate'] / MB:.2f} MB/s "
          f"({res['record_rate'] * 3600 / 1e9:.1f} GB/hour)")
    hc = res.get("hub_counters", {})
    if hc.get("recorder_stalls"):
        print(f"{'':12}its process fell behind {hc['recorder_stalls']} time(s), "
              f"{hc.get('recorder_stalled_ms', 0) / 1e3:.1f} s in all: the hub paused its "
              f"ranks {hc.get('ingest_pauses', 0)} time(s) "
              f"({hc.get('ingest_paused_ms', 0) / 1e3:.1f} s), its loop waited "
              f"{hc.get('recorder_waits', 0)} time(s)")
    if mode == "relays":
        print(f"  relays    {median(res['relay_cpu']):.0f}% of a core for all of them (median), "
              f"{median(res['relay_cpu']) / max(res['relays_up'], 1) * 10:.2f}% per 10 "
              f"relays")
    print(f"  load      generators {median(res['gen_cpu']):.0f}% of a core, other processes "
          f"{median(res['other_cpu']):.0f}% (median); send lag max {res['lag_max'] * 1e3:.0f} "
          f"ms, {res['late']} sends > 50 ms late, {res['skipped']} skipped, {res['dropped']} "
          f"dropped (backpressure), {res['pongs']} pongs")
    if res["closed"] or res["errors"] or res["viewer_failures"]:
        print(f"  PROBLEMS  {res['closed']} connections closed by the hub, {res['errors']} "
              f"error frames, {res['viewer_failures']} failed snapshots")
    print(f"  in-process RunState.apply(): {cost['apply_plain_s'] * us:.0f} us per 1-step "
          f"batch, {cost['apply_samples_s'] * us:.0f} us with samples; snapshot() "
          f"{cost['snapshot_s'] * 1e3:.0f} ms + encode {cost['snapshot_encode_s'] * 1e3:.0f} ms "
          f"for {args.ranks} ranks")
    print(f"  fd limit  hub {hub_nofile} (inherited; this benchmark raised its own soft limit)")
    if p2 is not None and p2["steps"]:
        kept = [s for s in p2["steps"] if s["ingest"] >= 0.95 * s["sent"]]
        best = max(kept, key=lambda s: s["ingest"]) if kept else None
        sat = p2.get("saturated")
        top = max(p2["steps"], key=lambda s: s["ingest"])
        print(f"max sustained ingest on one core: {top['ingest']:,.0f} step records/s (hub CPU "
              f"{top['cpu']:.0f}%; {p2['connected']} connections x {args.p2_rows} rows)  "
              f"(target >= 100,000: {verdict(top['ingest'] >= 100_000)})")
        if best is not None:
            print(f"{'':12}highest offered rate fully kept up with: {best['ingest']:,.0f}/s "
                  f"(hub CPU {best['cpu']:.0f}%)")
        if sat is not None:
            print(f"{'':12}at {sat['sent']:,.0f}/s offered the hub fell behind: ingested "
                  f"{sat['ingest']:,.0f}/s at CPU {sat['cpu']:.0f}%, RSS {sat['rss'] / MB:.0f} MB")
        elif p2.get("generator_bound"):
            print(f"{'':12}the generators could not offer more (a lower bound)")
        else:
            print(f"{'':12}the hub kept up with every rate offered (a lower bound)")
        if top["cpu"] < 85:
            print(f"{'':12}hub below one core ({top['cpu']:.0f}%): other processes took the "
                  "CPU, or the hub waits; treat as a lower bound")
        print(f"{'':12}in-process: decode {cost['decode_100_rows_s'] * us:.0f} us + apply "
              f"{cost['apply_100_rows_s'] * us:.0f} us per 100-row batch = "
              f"{1e2 / (cost['decode_100_rows_s'] + cost['apply_100_rows_s']):,.0f} rows/s "
              f"ceiling; {p2['floods']} floods, {p2['closed']} connections closed by the hub")
    for name, found in logs.items():
        for kind, lines in found.items():
            if kind == "traceback":
                print(f"  {name} log: {len(lines)} traceback(s), the first:")
                print(textwrap.indent(lines[0], "    | "))
                continue
            print(f"  {name} log: {kind}: {len(lines)} line(s), e.g. {lines[0][:150]}")
    notes = res.get("notes", []) + (p2["notes"] if p2 else [])
    for n in notes[:10]:
        print(f"  note: {n}")


def compare(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    """The modes measured, side by side: each figure's median over the runs of a mode
    (``--repeat``; the modes' runs alternate, so a machine that gets busier or quieter
    weighs on both alike), and relays / direct."""
    modes = list(results)
    runs = len(next(iter(results.values())))
    print()
    print(f"side by side: {args.ranks} ranks, {args.duration:.0f} s a run, fresh hubs; "
          f"median of {runs} run{'s' if runs > 1 else ''} each, alternating")

    def build(r: dict[str, Any]) -> float:
        return median([b for b in r["build"] if not math.isnan(b)]) * 1e3

    rows: list[tuple[str, Callable[[dict[str, Any]], float], str]] = [
        ("TCP connections at the hub", lambda r: float(r.get("hub_sockets", math.nan)),
         "{:,.0f}"),
        ("hub CPU, median (% of a core)", lambda r: median(r["cpu"]), "{:.0f}%"),
        ("hub CPU, max (% of a core)", lambda r: fmax(r["cpu"]), "{:.0f}%"),
        ("hub CPU per rank batch (us)", lambda r: r["cpu_per_frame"] * 1e6, "{:.0f}"),
        ("  without snapshot builds (us)", lambda r: r["cpu_per_frame_ingest"] * 1e6,
         "{:.0f}"),
        ("hub RSS, max (MB)", lambda r: fmax(r["rss"]) / MB, "{:.0f}"),
        ("snapshot round trip, median (ms)", lambda r: median(r["rtt"]) * 1e3, "{:.0f}"),
        ("snapshot build, median (ms)", build, "{:.0f}"),
        ("step records/s ingested", lambda r: r["ingest_rate"], "{:,.0f}"),
        ("ranks active", lambda r: float(r["ranks_active"]), "{:,.0f}"),
        ("relays' CPU, median (% of a core)", lambda r: median(r["relay_cpu"])
         if r.get("relays_up") else math.nan, "{:.0f}%"),
        ("generators' CPU, median", lambda r: median(r["gen_cpu"]), "{:.0f}%"),
        ("other processes' CPU, median", lambda r: median(r["other_cpu"]), "{:.0f}%"),
    ]
    ratio = modes == ["direct", "relays"]
    print(f"  {'':36}" + "".join(f"{m:>12}" for m in modes)
          + (f"{'relays/direct':>15}" if ratio else ""))
    for name, value, fmt in rows:
        vals = [median([v for v in (value(r) for r in results[m]) if not math.isnan(v)])
                for m in modes]
        cells = "".join(f"{'-' if math.isnan(v) else fmt.format(v):>12}" for v in vals)
        extra = ""
        if ratio and not any(math.isnan(v) for v in vals) and vals[0]:
            extra = f"{vals[1] / vals[0]:>15.2f}"
        print(f"  {name:36}{cells}{extra}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--duration", type=float, default=30.0, help="phase 1 window (s)")
    ap.add_argument("--procs", type=int, default=4, help="load-generator processes")
    ap.add_argument("--viewer-hz", type=float, default=2.0, help="snapshot requests per second")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    ap.add_argument("--drain-timeout", type=float, default=120.0,
                    help="how long to wait for the hub to catch up after phase 1")
    ap.add_argument("--connect-concurrency", type=int, default=16,
                    help="connections opened at once per generator (0: all at once)")
    ap.add_argument("--p2-conns", type=int, default=256)
    ap.add_argument("--p2-rows", type=int, default=100, help="step records per batch")
    ap.add_argument("--p2-start", type=float, default=20_000, help="first offered rows/s")
    ap.add_argument("--p2-step", type=float, default=3.0, help="seconds per offered rate")
    ap.add_argument("--p2-duration", type=float, default=45.0, help="phase 2 time cap (s)")
    ap.add_argument("--no-phase2", action="store_true")
    ap.add_argument("--profile", type=Path, default=None,
                    help="run the phase-1 hub under cProfile, save its stats here, print the top")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, recordings)")
    ap.add_argument("--mode", choices=["direct", "relays", "both"], default="direct",
                    help="ranks connect to the hub (direct), through one relay per node of "
                         f"{RANKS_PER_NODE} (relays), or one then the other on fresh hubs")
    ap.add_argument("--load-nice", type=int, default=10, metavar="N",
                    help="niceness of the generators and relays: they stand in for the "
                         "ranks' own machines, so on one small machine the hub gets the "
                         "CPU first (0: all alike)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --mode both: run each mode this many times, alternating, "
                         "and compare the medians")
    ap.add_argument("--relay-procs", type=int, default=2,
                    help="processes the relays run in (each runs its share, one relay "
                         "object, socket and hub connection per node)")
    ap.add_argument("--relay-interval", type=float, default=0.25, metavar="S",
                    help="how often a relay forwards what its ranks sent")
    ap.add_argument("--viewer", choices=("auto", "view", "full"), default="auto",
                    help="what the viewer asks for: the fleet view's snapshot (aggregates, "
                         "findings, top outliers, the rows in sight), as the UI does above "
                         f"{FLEET_ABOVE} ranks, or every rank's row, as `rtop status` does "
                         "(auto: as the UI)")
    ap.add_argument("--flush", type=float, default=None, metavar="S",
                    help="how often each rank sends a batch (default: as the collectors "
                         "do in a world of --ranks: 0.5 s, 1 s from 1,024 ranks)")
    args = ap.parse_args(argv)
    if args.viewer == "auto":
        args.viewer = "view" if args.ranks > FLEET_ABOVE else "full"
    if args.flush is None:
        args.flush = ProbeConfig().flush_every(args.ranks)
    if not 0.1 <= args.flush <= 10:
        ap.error("--flush is between 0.1 and 10 s")
    if min(args.ranks, args.procs, args.p2_conns, args.p2_rows) < 1 or args.duration <= 0:
        ap.error("counts and durations must be positive")
    args.procs = min(args.procs, args.ranks)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_frames()

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # the hub inherits this limit, and needs a descriptor per rank
    raise_nofile(max(args.ranks, args.p2_conns) + 1024)
    tmp = Path(tempfile.mkdtemp(prefix="rtop-hub-scale-"))
    token = secrets.token_urlsafe(16)
    hubs: list[HubProcess] = []
    viewers: list[Viewer] = []
    results: dict[str, list[dict[str, Any]]] = {}
    relay_fleets: list[RelayFleet] = []
    res: dict[str, Any] = {}
    p2: dict[str, Any] | None = None
    modes = ["direct", "relays"] if args.mode == "both" else [args.mode]
    runs = [(mode, i) for i in range(max(args.repeat, 1)) for mode in modes]
    try:
        ingest = auth.role_token(token, "ingest")
        for mode, i in runs:
            hub = HubProcess(tmp, f"hub-{mode}-{i}", token,
                             args.profile if (mode, i) == runs[-1] else None)
            hubs.append(hub)
            address = hub.wait_address()
            hub_nofile = hub.ps.rlimit(psutil.RLIMIT_NOFILE)[0]
            print(f"hub {address} (pid {hub.proc.pid}), RSS at start {hub.rss() / MB:.0f} MB, "
                  f"recording to {hub.record}", flush=True)
            viewer = Viewer(address, auth.role_token(token, "view"),  # its role's token
                            ViewRequest() if args.viewer == "view" else None)
            viewers.append(viewer)
            opts = {"address": address, "key": auth.key_for(ingest, "ingest"),
                    "ingest": ingest, "ranks": args.ranks, "procs": args.procs,
                    "connect_concurrency": args.connect_concurrency,
                    "backlog_bytes": 1 << 20, "p2_conns": args.p2_conns,
                    "p2_rows": args.p2_rows, "sndbuf": 256 << 10,
                    "relay_interval": args.relay_interval, "load_nice": args.load_nice,
                    "flush": args.flush}
            relays = None
            if mode == "relays":
                relays = RelayFleet(opts, args.relay_procs)
                relay_fleets.append(relays)
                print(f"starting {relays.nodes} relays in {relays.n} processes ...",
                      flush=True)
                opts["relay_addrs"] = relays.addresses(120 + relays.nodes / 10)
            res = {}
            results.setdefault(mode, []).append(res)
            run_job_phase(args, opts, hub, viewer, res, relays)
            viewer.close()
            if relays is not None:
                relays.finish()
            hub.stop()
        if not args.no_phase2:
            hub2 = HubProcess(tmp, "hub2", token, None)
            hubs.append(hub2)
            address2 = hub2.wait_address()
            viewer2 = Viewer(address2, auth.role_token(token, "view"))
            viewers.append(viewer2)
            p2 = run_flood_phase(args, {**opts, "address": address2,
                                        "procs": min(args.procs, args.p2_conns)}, hub2, viewer2)
            viewer2.close()
            hub2.stop()
        print("in-process costs ...", flush=True)
        cost = in_process_costs(args.ranks)
        logs = {h.log_path.stem: scan_log(h.log_text()) for h in hubs}
        for mode, i in runs:
            summarize(args, results[mode][i], p2 if (mode, i) == runs[-1] else None, cost,
                      {k: v for k, v in logs.items() if k == f"hub-{mode}-{i}" or k == "hub2"},
                      hub_nofile, mode)
        if len(runs) > 1:
            compare(args, results)
        if args.profile is not None:
            print_profile(args.profile)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        for v in viewers:
            v.close()
        for rs in results.values():
            for r in rs:
                if r.get("fleet") is not None:
                    r["fleet"].finish(5)
        for rf in relay_fleets:
            rf.finish(5)
        for h in hubs:
            h.stop()
        if args.keep:
            print(f"kept {tmp} (hub logs, recordings)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
