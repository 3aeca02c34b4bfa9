"""Is the TUI fast enough? Snapshot to frame, update rate, and opening a long replay.

The issue's targets: from a 1,024-rank snapshot to a rendered frame in <= 100 ms;
updates at >= 2 Hz without a backlog; ``rtop replay`` of a 1-hour, 64-rank recording
opens in <= 2 s. Everything runs the real app (``rtop.tui.app.make_app``) headless, under
Textual's ``App.run_test(size=(200, 60))``, in this process.

How a frame is known to be painted. Textual paints in ``App._display(screen, update)``:
the screen's compositor has already rendered the dirty regions (``render_update``, which
calls the widgets' ``render_line``) and ``_display`` turns that update into terminal
escape sequences and writes them. Headless, ``_display`` skips the encoding and the
write, so the probe (:class:`FrameProbe`) wraps the app's ``_display``, does the
encoding itself (``update.render_segments(app.console)``: the same call a terminal run
makes) and timestamps the frame after it. A frame counts for snapshot *n* when it is
painted after the app's ``snapshots_seen`` reached *n*: ``on_snapshot_received`` is
synchronous, so a frame painted after the counter moved contains everything the handler
changed (the update timer batches the dirty widgets into the next frame). Latency is
from ``post_message(SnapshotReceived)`` (the source's own call) to that frame, so it
includes the message queue, the handler, Textual's layout and update timer (up to 1/60 s)
and the compositor. The first frame must contain a rank's node name (checked).

1. Render: a RunState fed realistic frames (hello, then batches with two step records
   and a GPU/host/memory/heartbeat sample a second) for 1,024 ranks on 128 nodes, with
   a starved rank, a straggler, a throttled GPU and a rank near its memory wall; the
   hub's Analyzer makes the findings. Snapshots are round-tripped through the wire
   format (what a live viewer gets). Measured: snapshot -> frame in the flat view (the
   handler alone beside it), a sort key press -> frame, snapshot -> frame sorted by
   step time, and grouped by node (folded, 128 lines).
2. Update rate: a source posts distinct 1,024-rank snapshots at 4 Hz from its worker
   thread (as every source does) for 10 s. Counted: snapshots sent and processed, the
   app's message queue (sampled every 20 ms) and the age of the snapshot on each painted
   frame (sent -> painted). A backlog would show as a growing queue and growing ages.
   Then, for information, 20 Hz for 3 s: more than the app can draw, so ``can_replace``
   must drop the stale snapshots and keep the queue short.
3. Replay: a 1-hour, 64-rank recording (8 nodes) written with the hub's own Recorder
   (run header, clock frames every 0.25 s, each rank's hello, then a batch a second with
   2 step records and a GPU/host/memory sample and a heartbeat, offset frames every
   10 s per rank as the hub's pings make them), cached under /tmp. Time from creating
   the ReplaySource (what ``rtop replay`` does first) to the first painted frame with a
   snapshot, median of 5; and, for information, the same for the real ``python -m rtop
   replay FILE`` process in a pseudo-terminal (Python start-up and imports included),
   and a seek to the end (``ReplaySource.seek(duration)``) until the snapshot there is
   painted, with the worst event-loop stall during the seek.

4. The fleet view (issue 29): simulated fleets of 1,024, 4,096 and 16,384 ranks with a
   slow node (``rtop.fleetsim``, in nodes of 8), written as recordings (cached under
   /tmp/rtop-bench) and replayed through the real state and diagnosis to 35 s in (the
   snapshots of its last three seconds are the ones posted). On the hub's side: the full
   snapshot's build (``Monitor.snapshot``: every rank's row, what every viewer got
   before, and still the input of each view), the fleet's arrays
   (``rtop.analysis.viewport.Fleet``, once per snapshot whatever the viewers), and one
   viewer's view (the fleet screen's: the cursor's node and the top outliers; and a
   table page of 60 rows) built and encoded; the bytes of each on the wire. On the
   viewer's side, Pilot-driven as in 1: the app opened on the fleet view, each view's
   snapshot posted -> its frame painted, and a key (``c``, the next figure; an arrow)
   -> its frame. Targets: a view of 16,384 ranks <= 1 MB, snapshot -> frame <= 100 ms.

The machine this runs on may be small and shared: medians are the verdicts; the UI
thread's CPU time is printed beside the wall time, and the load average with them.

    python benchmarks/tui_speed.py [--quick] [--profile] [--fleets 1024,4096,16384]
        [--only fleet]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import fcntl
import io
import os
import pstats
import pty
import random
import select
import signal
import statistics
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors import wire
from collectors.schema import GPU_FIELDS, HEARTBEAT_FIELDS, HOST_FIELDS, MEM_FIELDS, STEP_FIELDS
from rtop.analysis import AnalysisConfig, Monitor
from rtop.hub.recorder import Recorder
from rtop.run.snapshot import HubInfo, Snapshot
from rtop.run.state import RunState
from rtop.tui.app import RtopApp, make_app
from rtop.tui.messages import SnapshotReceived, SourceStatus
from rtop.tui.ranks import RanksView
from rtop.tui.source import ReplaySource, Source, StaticSource

ROOT = Path(__file__).resolve().parents[1]
SIZE = (200, 60)
RANKS_PER_NODE = 8
PERIOD_S = 0.5  # one training step every half second: two step records a second
H200_MEM_BYTES = 150_754_820_096
COMM_BYTES = 2 * 1_400_000_000  # bf16 gradients of a 1.4B-parameter model
JOB = "llama-pretrain"  # not in any file name: the pty test looks for it on screen
CACHE = Path("/tmp/rtop-bench")
#: bump when the generator or the format changes: cached files are regenerated (2: blocks)
RECORDING_VERSION = 2
RENDER_TARGET_MS, RATE_TARGET_HZ, OPEN_TARGET_S = 100.0, 2.0, 2.0
VIEW_TARGET_BYTES = 1_000_000
FLEET_AT_S = 35.0  # into a 36 s simulated run: its slow node slowed at 30 s

_PHASES = ("compute", "compute", "compute", "comm", "data")


# ---- realistic ranks -----------------------------------------------------------------------


class SynthRank:
    """What one rank of a data-parallel job on H200s sends, at times the caller gives.

    ``fault``: None, "starved" (waits on its loader), "straggler" (computes slower),
    "throttled" (SM clock held down, with a reason) or "memwall" (peak memory near the
    device's capacity).
    """

    def __init__(self, rank: int, world: int, group: str, fault: str | None = None) -> None:
        self.rank, self.world, self.group, self.fault = rank, world, group, fault
        rng = random.Random(rank)
        self.rnd = rng.random
        self.step = 0
        self.speed = 1.0 + (rng.random() - 0.5) * 0.01
        self.data_mean = 0.002 + 0.004 * rng.random()
        self.bus = 2 * (world - 1) / world
        self.mem_used = 118e9 + 2e9 * rng.random()
        self.temp = 48 + 18 * random.Random(rank // RANKS_PER_NODE).random() + 4 * rng.random()
        self.rss = 11e9 + 2e9 * rng.random()

    def identity(self) -> dict[str, Any]:
        """As collectors.identity sends it from a torchrun job."""
        node = self.rank // RANKS_PER_NODE
        return {"rank": self.rank, "local_rank": self.rank % RANKS_PER_NODE,
                "world_size": self.world, "hostname": f"node-{node:04d}",
                "ip": f"10.{node // 65536 % 256}.{node // 256 % 256}.{node % 256}",
                "pid": 20000 + 37 * (self.rank % RANKS_PER_NODE), "attempt": 0, "job": JOB,
                "group": self.group, "node_id": f"{node * 2654435761 % (1 << 64):016x}",
                "source": "torch"}

    def hello(self, t: float) -> dict[str, Any]:
        """The first frame, as collectors.sender writes it."""
        return {"role": "rank", "token": "bench-token", "identity": self.identity(),
                "clock": {"t_wall": t, "t_mono": t - 1.7e9},
                "collector": {"version": "0.1.0", "python": "3.11.7", "torch": "2.5.1",
                              "dropped": 0}}

    def batch(self, t: float, steps: int = 2, samples: bool = True) -> dict[str, Any]:
        """The batch sent at ``t``: ``steps`` step records that ended by ``t`` and, when
        ``samples``, one GPU, host and memory sample and a heartbeat."""
        rnd, f = self.rnd, self.fault
        rows: list[list[Any]] = []
        start = t - 0.01 * rnd() - steps * PERIOD_S * self.speed  # the steps end by t
        for _ in range(steps):
            step_s = (PERIOD_S + (rnd() - 0.5) * 0.02) * self.speed
            data = self.data_mean * (0.5 + rnd())
            if f == "starved":
                data = 0.14 + 0.02 * rnd()
            comm = 0.11 + 0.02 * rnd()
            exposed = comm * (0.1 + 0.1 * rnd())
            gap = 0.0006 + 0.0004 * rnd()
            compute = step_s - data - exposed - gap
            if f == "straggler":
                compute *= 1.45
                step_s = compute + data + exposed + gap
            algbw = COMM_BYTES / comm
            rows.append([self.step, start, step_s, data, compute,
                         compute * (0.95 + 0.04 * rnd()), comm, exposed, COMM_BYTES, 112,
                         algbw, algbw * self.bus, 16, gap])
            start += step_s
            self.step += 1
        p: dict[str, Any] = {"rank": self.rank, "group": self.group, "seq": self.step,
                             "t_wall": t, "dropped": 0, "steps": rows}
        if not samples:
            return p
        clock, reasons = 1980, 0
        if f == "throttled":
            clock, reasons = 1410 + int(40 * rnd()), 0x20 | 0x40  # SW/HW thermal slowdown
        peak = 97e9 if f != "memwall" else 141e9
        g = [t, 88 + 12 * rnd(), 35 + 25 * rnd(), self.mem_used, H200_MEM_BYTES,
             560 + 140 * rnd(), 700.0, round(self.temp + (12 if f == "throttled" else 0)),
             clock, 1980, reasons, 0.5e9 + 1.5e9 * rnd(), 1e9 * rnd(),
             8e10 + 6e10 * rnd(), 8e10 + 6e10 * rnd()]
        h = [t, 100 + 40 * rnd(), 250 + 170 * rnd(), 8, self.rss, 1.6e12, 2.0e12, None,
             25 + 15 * rnd(), 50.0]
        m = [t, "cuda:0", 61e9 + 1e9 * rnd() + (40e9 if f == "memwall" else 0), 84e9, peak,
             H200_MEM_BYTES, 5.6e9, 5.6e9, 11.2e9]
        hb = [t, _PHASES[int(rnd() * len(_PHASES))], 0.3 * rnd(), self.step - 1, None]
        assert (len(rows[0]), len(g), len(h), len(m), len(hb)) == (
            len(STEP_FIELDS), len(GPU_FIELDS), len(HOST_FIELDS), len(MEM_FIELDS),
            len(HEARTBEAT_FIELDS))
        p.update(gpu=[g], host=[h], mem=[m], hb=[hb])
        return p


def _wire(kind: str, payload: dict[str, Any]) -> wire.Frame:
    """A frame as the hub gets it: encoded and decoded by the wire format."""
    return wire.decode_body(wire.encode(kind, payload)[wire.HEADER_BYTES:])


FAULTS_1024 = {17: "starved", 333: "straggler", 600: "throttled", 901: "memwall"}


class BigJob:
    """A 1,024-rank job (128 nodes) in the hub's RunState with the hub's Analyzer; each
    :meth:`snapshot` advances it by a second and returns what a viewer receives."""

    def __init__(self, ranks: int = 1024, history_s: int = 16) -> None:
        self.monitor = Monitor(RunState(window_steps=1200, window_samples=600,
                                        lost_after_s=10.0), AnalysisConfig())
        self.state = self.monitor.state
        group = f"{JOB}-g0"
        self.t0 = 1_760_000_000.0
        self.state.run_info = {"hub": {"version": "0.1.0", "address": "10.0.0.1:7077",
                                       "pid": 4242, "started": self.t0}, "job": JOB}
        self.ranks = [SynthRank(r, ranks, group, FAULTS_1024.get(r)) for r in range(ranks)]
        for rk in self.ranks:
            self.state.apply(_wire(wire.KIND_HELLO, rk.hello(self.t0 + 0.1)), self.t0 + 0.1)
        self.t = self.t0 + 1.0
        for _ in range(history_s):
            self._second()

    def _second(self) -> None:
        n = len(self.ranks)
        for i, rk in enumerate(self.ranks):
            t = self.t + i / n
            self.state.apply(_wire(wire.KIND_BATCH, rk.batch(t)), t)
        self.t += 1.0
        self.state.now = self.t
        self.monitor.advance(self.t - 0.5, force=True)
        self.monitor.advance(self.t, force=True)

    def snapshot(self) -> Snapshot:
        """One more second of the job, then the hub's snapshot of it (wire round trip)."""
        self._second()
        snap = self.monitor.snapshot(hub=HubInfo(
            address="10.0.0.1:7077", record=None,
            counters={"connections": len(self.ranks), "refused": 0, "bad_frames": 0,
                      "floods": 0, "silent": 0, "snapshots_skipped": 0,
                      "snapshots_sent": 0}))
        return cast(Snapshot, _wire(wire.KIND_SNAPSHOT, snap).payload)


# ---- the frame probe ------------------------------------------------------------------------


class FrameProbe:
    """Timestamps every frame the app paints (see the module doc) and wakes a waiter
    when a painted frame satisfies the armed condition."""

    def __init__(self, app: RtopApp) -> None:
        self.app = app
        self.frames: list[tuple[float, int]] = []  # (painted at, snapshots_seen)
        self.encode_s: list[float] = []
        self.ages: list[tuple[float, float]] = []  # (painted at, age of its snapshot)
        self.last_text = ""
        self._cond: Callable[[], bool] | None = None
        self._event: asyncio.Event | None = None
        self.hit_t = self.hit_cpu = 0.0
        self.hit_text = ""
        original = app._display

        def display(screen: Any, renderable: Any) -> None:
            original(screen, renderable)
            if renderable is None or app._batch_count or screen is not app.screen:
                return
            t = time.perf_counter()
            text = renderable.render_segments(app.console) \
                if hasattr(renderable, "render_segments") else ""
            now = time.perf_counter()
            self.encode_s.append(now - t)
            self.frames.append((now, app.snapshots_seen))
            sent = (app.snapshot or {}).get("_bench_sent")
            if isinstance(sent, float):
                self.ages.append((now, now - sent))
            if self._cond is not None and self._event is not None and self._cond():
                self._cond = None
                self.hit_t, self.hit_cpu, self.hit_text = now, time.thread_time(), text
                self._event.set()

        app._display = display  # type: ignore[method-assign]

    def arm(self, cond: Callable[[], bool]) -> None:
        """Wake :meth:`wait` at the first frame painted while ``cond()`` holds."""
        self._event = asyncio.Event()
        self._cond = cond

    async def wait(self, timeout: float = 60.0) -> float:
        """The time the awaited frame was painted."""
        assert self._event is not None
        await asyncio.wait_for(self._event.wait(), timeout)
        return self.hit_t


async def stop_source(app: RtopApp) -> None:
    """Stop the source's thread and let its last messages be handled before the app
    closes: a snapshot handled while Textual tears the screen down raises NoMatches
    (JobHeader) out of ``on_snapshot_received`` (seen once in ~20 replay runs)."""
    app._stop.set()
    app.source.wake.set()
    await app.workers.wait_for_complete()
    await asyncio.sleep(0.05)


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ---- 1. render ------------------------------------------------------------------------------


async def snapshot_to_frame(app: RtopApp, probe: FrameProbe, snaps: list[dict[str, Any]],
                            n: int, check: str | None = None
                            ) -> tuple[list[float], list[float], float]:
    """Post ``n`` snapshots one at a time: seconds from each post to its painted frame,
    the UI thread's CPU seconds in between (what a busy machine cannot inflate much),
    and the frames painted per snapshot (follow-ups included)."""
    wall, cpu = [], []
    f0 = len(probe.frames)
    for i in range(n):
        await asyncio.sleep(0.08)  # let the previous snapshot's follow-up frames settle
        want = app.snapshots_seen + 1
        probe.arm(lambda w=want: app.snapshots_seen >= w)  # type: ignore[misc]
        c0, t0 = time.thread_time(), time.perf_counter()
        app.post_message(SnapshotReceived(snaps[i % len(snaps)]))
        wall.append(await probe.wait() - t0)
        cpu.append(probe.hit_cpu - c0)
        if check is not None and i == 0 and check not in probe.hit_text:
            raise AssertionError(f"the painted frame does not show {check!r}")
    await asyncio.sleep(0.08)
    return wall, cpu, (len(probe.frames) - f0) / n


async def handler_alone(app: RtopApp, probe: FrameProbe, snaps: list[dict[str, Any]],
                        n: int) -> tuple[list[float], list[float], list[float]]:
    """``on_snapshot_received`` called directly (the same code the message runs): its own
    time, and from its end to the painted frame."""
    hs, cpu, rest = [], [], []
    for i in range(n):
        await asyncio.sleep(0.08)
        want = app.snapshots_seen + 1
        probe.arm(lambda w=want: app.snapshots_seen >= w)  # type: ignore[misc]
        c0, t0 = time.thread_time(), time.perf_counter()
        app.on_snapshot_received(SnapshotReceived(snaps[i % len(snaps)]))
        c1, t1 = time.thread_time(), time.perf_counter()
        hs.append(t1 - t0)
        cpu.append(c1 - c0)
        rest.append(await probe.wait() - t1)
    return hs, cpu, rest


async def action_to_frame(app: RtopApp, probe: FrameProbe, action: Callable[[], None],
                          n: int) -> list[float]:
    """Run a key's action ``n`` times; seconds from each to the next painted frame."""
    out = []
    for _ in range(n):
        await asyncio.sleep(0.08)
        count = len(probe.frames)
        probe.arm(lambda c=count: len(probe.frames) > c)  # type: ignore[misc]
        t0 = time.perf_counter()
        action()
        out.append(await probe.wait() - t0)
    return out


async def render_bench(snaps: list[dict[str, Any]], n: int) -> dict[str, Any]:
    app = make_app(StaticSource(snaps[:1], title="bench", interval_s=3600.0))
    probe = FrameProbe(app)
    res: dict[str, Any] = {}
    async with app.run_test(size=SIZE):
        probe.arm(lambda: app.snapshots_seen >= 1)
        await probe.wait()
        await asyncio.sleep(0.3)
        view = app.query_one(RanksView)
        res["flat"], res["flat_cpu"], res["flat_fps"] = await snapshot_to_frame(
            app, probe, snaps, n, check="node-0")
        res["flat_rows"] = len(view.rows)
        res["findings"] = [(f["kind"], f["ranks"][:3]) for f in app.snapshot["findings"]]
        res["handler"], res["handler_cpu"], res["after_handler"] = await handler_alone(
            app, probe, snaps, max(5, n // 3))
        enc0 = len(probe.encode_s)
        overview = app.overview
        res["sort_key"] = await action_to_frame(app, probe, lambda: overview.action_sort(1),
                                                max(13, n))
        while overview.sort_key != "step ms":
            overview.action_sort(1)
        res["sorted"], res["sorted_cpu"], res["sorted_fps"] = await snapshot_to_frame(
            app, probe, snaps, n)
        res["group_key"] = await action_to_frame(app, probe, overview.action_group, 1)
        res["grouped"], res["grouped_cpu"], res["grouped_fps"] = await snapshot_to_frame(
            app, probe, snaps, n, check="node-0")
        res["grouped_rows"] = len(view.rows)
        res["encode"] = probe.encode_s[enc0:]
        await stop_source(app)
    return res


# ---- 2. update rate ---------------------------------------------------------------------------


class PacedSource(Source):
    """Like StaticSource, at a fixed rate on a fixed schedule, for a fixed time once
    ``go`` is set; each snapshot is a fresh shallow copy stamped with when it was sent."""

    live = False
    title = "paced"

    def __init__(self, snaps: list[dict[str, Any]], hz: float, seconds: float) -> None:
        super().__init__()
        self.snaps, self.hz, self.seconds = snaps, hz, seconds
        self.go = threading.Event()
        self.sent = 0
        self.t_start = self.t_end = 0.0

    def run(self, post: Any, stop: threading.Event) -> None:
        post(SourceStatus("paced source"))
        post(SnapshotReceived(dict(self.snaps[0])))
        while not self.go.wait(0.05):
            if stop.is_set():
                return
        self.t_start = nxt = time.perf_counter()
        end = self.t_start + self.seconds
        i = 0
        while not stop.is_set() and nxt < end:
            snap = dict(self.snaps[i % len(self.snaps)])
            snap["_bench_sent"] = time.perf_counter()
            post(SnapshotReceived(snap))
            self.sent += 1
            i += 1
            nxt += 1.0 / self.hz
            stop.wait(max(0.0, nxt - time.perf_counter()))
        self.t_end = time.perf_counter()


async def rate_bench(snaps: list[dict[str, Any]], seconds: float, hz: float = 4.0
                     ) -> dict[str, Any]:
    src = PacedSource(snaps, hz, seconds)
    app = make_app(src)
    probe = FrameProbe(app)
    queue: list[int] = []
    async with app.run_test(size=SIZE):
        probe.arm(lambda: app.snapshots_seen >= 1)
        await probe.wait()
        await asyncio.sleep(0.5)
        seen0, frames0, ages0 = app.snapshots_seen, len(probe.frames), len(probe.ages)
        src.go.set()
        while not src.t_end:
            queue.append(app.message_queue_size)
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0)  # whatever was queued is handled by now
        processed = app.snapshots_seen - seen0
        painted = len(probe.frames) - frames0
        ages = probe.ages[ages0:]
        await stop_source(app)
    span = src.t_end - src.t_start
    t_mid = src.t_start + span / 2
    return {"sent": src.sent, "processed": processed, "span": span, "painted": painted,
            "queue_max": max(queue) if queue else 0,
            "queue_med": statistics.median(queue) if queue else 0,
            "ages": [a for _, a in ages],
            "ages_first_half": [a for t, a in ages if t < t_mid],
            "ages_second_half": [a for t, a in ages if t >= t_mid]}


# ---- 3. replay ---------------------------------------------------------------------------------


def write_recording(path: Path, ranks: int, seconds: int) -> None:
    """A recording as the hub writes it, for a job of ``ranks`` ranks, ``seconds`` long,
    with synthetic hub times (written as fast as it can be)."""
    tmp = path.with_suffix(".part")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    t0 = 1_760_000_000.0
    group = f"{JOB}-g0"
    rec = Recorder(tmp, {"hub": {"version": "0.1.0", "address": "10.0.0.1:7077",
                                 "pid": 4242, "started": t0}, "job": JOB})
    rks = [SynthRank(r, ranks, group, "straggler" if r == 5 else None) for r in range(ranks)]
    rng = random.Random(7)
    for i, rk in enumerate(rks):  # the ranks connect within the first 0.2 s
        t = t0 + 0.05 + 0.15 * i / ranks
        rec.raw(wire.encode(wire.KIND_HELLO, rk.hello(t)), t)
    for s in range(seconds):
        base = t0 + 1.0 + s
        for q in range(4):
            rec.clock(base + 0.25 * q)  # the hub's housekeeping tick
        for i, rk in enumerate(rks):
            t = base + (i + 0.5) / ranks
            rec.raw(wire.encode(wire.KIND_BATCH, rk.batch(t)), t)
            if s % 10 == i % 10:  # a ping answered: the hub records the rank's offset
                rec.frame("offset", {"rank": rk.rank, "group": group,
                                     "offset_s": 0.002 * rng.random() - 0.001,
                                     "rtt_s": 0.0002 + 0.0003 * rng.random()}, t + 0.001)
        if s % 60 == 0:
            rec.flush()
    rec.clock(t0 + 1.0 + seconds, force=True)
    rec.close()
    os.replace(tmp, path)


def recording(seconds: int, ranks: int = 64) -> tuple[Path, float]:
    """The cached recording (made first if missing) and how long making it took."""
    CACHE.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = CACHE / f"replay-{ranks}r-{seconds}s-v{RECORDING_VERSION}.rtop"
    if path.exists():
        return path, 0.0
    t = time.perf_counter()
    write_recording(path, ranks, seconds)
    return path, time.perf_counter() - t


async def replay_open(path: Path, ranks: int, seek_to: float | None = None
                      ) -> dict[str, Any]:
    """From creating the ReplaySource to the first frame painted with a snapshot (and
    with every rank); then, if asked, a seek and its painted frame."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    src = ReplaySource(path)
    app = make_app(src)
    probe = FrameProbe(app)
    probe.arm(lambda: app.snapshots_seen >= 1)
    async with app.run_test(size=SIZE):
        out["first"] = await probe.wait() - t0

        def all_ranks() -> bool:
            return len(((app.snapshot or {}).get("ranks") or {}).get("rank") or []) >= ranks

        probe.arm(all_ranks)
        out["all_ranks"] = await probe.wait() - t0
        if seek_to is not None:
            lags: list[float] = []
            done = asyncio.Event()

            async def ticker() -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    await asyncio.sleep(0.02)
                    lags.append(time.perf_counter() - t - 0.02)

            def there() -> bool:
                rp = (app.snapshot or {}).get("replay") or {}
                return (rp.get("position_s") or 0.0) >= seek_to - 1.0

            probe.arm(there)
            task = asyncio.create_task(ticker())
            t1 = time.perf_counter()
            src.seek(seek_to)
            out["seek"] = await probe.wait(timeout=600) - t1
            done.set()
            await task
            out["seek_stall"] = max(lags) if lags else 0.0
            out["seek_findings"] = [f["kind"] for f in app.snapshot.get("findings") or []]
        await stop_source(app)
    return out


def replay_in_pty(path: Path, timeout: float = 60.0) -> tuple[float | None, int | None]:
    """``python -m rtop replay FILE`` in a 200x60 pseudo-terminal: seconds from the exec
    to the first screen that shows the job's name (the header draws it from the first
    snapshot; None if it never did), and the exit status after pressing q."""
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # the child: size the terminal, then become rtop
        with contextlib.suppress(OSError):
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", SIZE[1], SIZE[0], 0, 0))
        env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(SIZE[0]),
                   LINES=str(SIZE[1]))
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "rtop", "replay", str(path)], env)
    seen: float | None = None
    status: int | None = None
    buf = b""
    marker = JOB.encode()
    try:
        deadline = t0 + timeout
        while time.perf_counter() < deadline:
            r, _, _ = select.select([fd], [], [], 0.05)
            if not r:
                continue
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                break
            if not data:
                break
            buf = (buf + data)[-4096:]
            if marker in buf:
                seen = time.perf_counter() - t0
                break
        with contextlib.suppress(OSError):
            os.write(fd, b"q")
        end = time.perf_counter() + 10
        while time.perf_counter() < end:  # drain the output until it closes the terminal
            r, _, _ = select.select([fd], [], [], 0.1)
            try:
                if r and not os.read(fd, 1 << 16):
                    break
            except OSError:
                break
        while time.perf_counter() < end:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                pid, status = 0, os.waitstatus_to_exitcode(st)
                break
            time.sleep(0.02)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = os.waitstatus_to_exitcode(st)
                else:
                    os.kill(pid, signal.SIGTERM)
                    os.waitpid(pid, 0)
        os.close(fd)
    return seen, status


# ---- 4. the fleet view ---------------------------------------------------------------------------


def fleet_monitor(ranks: int) -> tuple[Monitor, list[Snapshot], float, float]:
    """A simulated fleet replayed as ``rtop replay`` does (its frames into the hub's
    Monitor, the clock frames advancing it) to FLEET_AT_S: the monitor, the full
    snapshots of its last three seconds (distinct, as a live hub's are), and the seconds
    writing (0 if cached) and replaying took."""
    from rtop.fleetsim import T0, FleetSpec
    from rtop.fleetsim import write_recording as write_fleet
    from rtop.run.recording import read
    from rtop.run.validate import ProtocolError

    CACHE.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = CACHE / f"fleet-{ranks}r-slow_node-36s-v{RECORDING_VERSION}.rtop"
    made = 0.0
    if not path.exists():
        t = time.perf_counter()
        part = path.with_suffix(".part")
        write_fleet(part, FleetSpec(ranks=ranks, seed=5, duration_s=36.0), "slow_node")
        part.replace(path)
        made = time.perf_counter() - t
    t = time.perf_counter()
    monitor = Monitor(RunState(lost_after_s=10.0), AnalysisConfig.load())
    moments = [T0 + FLEET_AT_S - 2, T0 + FLEET_AT_S - 1, T0 + FLEET_AT_S]
    snaps: list[Snapshot] = []
    for t_hub, frame in read(path):
        while moments and t_hub > moments[0]:
            moments.pop(0)
            snaps.append(monitor.snapshot())
        if not moments:
            break
        try:
            monitor.apply(frame, t_hub)
        except ProtocolError:
            continue
        if frame.kind == wire.KIND_CLOCK:
            monitor.state.now = t_hub
            monitor.advance(t_hub)
    return monitor, snaps, made, time.perf_counter() - t


def timed(fn: Callable[[], Any], n: int) -> tuple[list[float], Any]:
    """Seconds of ``n`` calls, and the last result."""
    out, res = [], None
    for _ in range(n):
        t = time.perf_counter()
        res = fn()
        out.append(time.perf_counter() - t)
    return out, res


def fleet_hub_side(monitor: Monitor, fulls: list[Snapshot], n: int) -> dict[str, Any]:
    """What the hub does per view: the full snapshot, the fleet's arrays, a view; and
    the views of ``fulls`` as a viewer gets them (through the wire)."""
    from rtop.analysis.viewport import TOP_K, Fleet, Page, ViewRequest

    res: dict[str, Any] = {}
    res["full"], full = timed(monitor.snapshot, n)
    res["full_bytes"] = len(wire.encode(wire.KIND_SNAPSHOT, full))
    res["fleet"], fleet = timed(lambda: Fleet(full), n)
    node = fleet.nodes[len(fleet.nodes) // 2]
    reqs = {"screen": ViewRequest(nodes=(node,), top=TOP_K),
            "table": ViewRequest(top=0, pages={"table": Page(limit=60)})}
    for key, req in reqs.items():
        res[key], data = timed(lambda r=req: wire.encode(wire.KIND_SNAPSHOT, fleet.view(r)),
                               n)
        res[key + "_bytes"] = len(data)
    res["views"] = []
    for snap in fulls:  # what the viewer gets: the wire round trip
        data = wire.encode(wire.KIND_SNAPSHOT, Fleet(snap).view(reqs["screen"]))
        res["views"].append(wire.decode_body(data[wire.HEADER_BYTES:]).payload)
    return res


async def fleet_viewer_side(views: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The app on the fleet view: each view's snapshot -> its frame, and keys -> frames."""
    from rtop.tui.fleet import FleetScreen
    from rtop.tui.heatmap import FleetMap

    snaps = views
    app = make_app(StaticSource(snaps[:1], title="bench", interval_s=3600.0))
    probe = FrameProbe(app)
    res: dict[str, Any] = {}
    async with app.run_test(size=SIZE):
        probe.arm(lambda: isinstance(app.screen, FleetScreen) and app.screen.data is not None)
        await probe.wait()
        await asyncio.sleep(0.3)
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        fmap = screen.query_one(FleetMap)
        res["folded"] = fmap.map is not None and fmap.map.folded
        res["lines"] = fmap.map.lines if fmap.map is not None else 0
        res["frame"], res["frame_cpu"], res["fps"] = await snapshot_to_frame(
            app, probe, snaps, n, check="running")
        res["figure_key"] = await action_to_frame(app, probe, lambda: screen.action_figure(1),
                                                  max(6, n // 2))
        res["arrow_key"] = await action_to_frame(app, probe, lambda: fmap.action_move(1, 0),
                                                 max(6, n // 2))
        await stop_source(app)
    return res


def fleet_section(sizes: list[int], n: int, rows: list[tuple[str, str, str]]) -> bool:
    """Section 4; whether the targets were met."""
    print(f"\n4. fleet view: simulated fleets of {', '.join(f'{r:,}' for r in sizes)} ranks "
          f"(slow node), replayed to {FLEET_AT_S:.0f} s; {n} snapshots per measure")
    print(f"   {'ranks':>6} {'full MB':>8} {'hub: full':>10} {'fleet':>7} {'view':>7} "
          f"{'view kB':>8} {'table kB':>9} | {'snap->frame':>12} {'p90':>6} {'cpu':>6} "
          f"{'c key':>7} {'arrow':>7}  map")
    ok = True
    for ranks in sizes:
        monitor, fulls, made, replayed = fleet_monitor(ranks)
        hub = fleet_hub_side(monitor, fulls, max(3, n // 3))
        viewer = asyncio.run(fleet_viewer_side(hub["views"], n))
        med = statistics.median
        frame = med(viewer["frame"])
        fits = hub["screen_bytes"] <= VIEW_TARGET_BYTES and \
            hub["table_bytes"] <= VIEW_TARGET_BYTES
        fast = frame * 1e3 <= RENDER_TARGET_MS
        ok = ok and fits and fast
        print(f"   {ranks:>6} {hub['full_bytes'] / 1e6:>8.2f} {med(hub['full']) * 1e3:>8.0f}ms "
              f"{med(hub['fleet']) * 1e3:>5.0f}ms {med(hub['screen']) * 1e3:>5.1f}ms "
              f"{hub['screen_bytes'] / 1e3:>8.0f} {hub['table_bytes'] / 1e3:>9.0f} | "
              f"{frame * 1e3:>10.1f}ms {pct(viewer['frame'], 0.9) * 1e3:>4.0f}ms "
              f"{med(viewer['frame_cpu']) * 1e3:>4.0f}ms {med(viewer['figure_key']) * 1e3:>5.1f}ms "
              f"{med(viewer['arrow_key']) * 1e3:>5.1f}ms  "
              f"{'nodes' if viewer['folded'] else 'ranks'}, {viewer['lines']} lines"
              f"   (recording {f'written in {made:.0f} s' if made else 'cached'}, "
              f"replayed in {replayed:.0f} s)")
        rows.append((f"fleet view {ranks:,}: view bytes",
                     f"{hub['screen_bytes'] / 1e3:.0f} kB (table page "
                     f"{hub['table_bytes'] / 1e3:.0f} kB; full {hub['full_bytes'] / 1e6:.2f} MB)",
                     verdict(fits)))
        rows.append((f"fleet view {ranks:,}: snapshot -> frame",
                     f"{frame * 1e3:.0f} ms (p90 {pct(viewer['frame'], 0.9) * 1e3:.0f}, cpu "
                     f"{med(viewer['frame_cpu']) * 1e3:.0f})", verdict(fast)))
        rows.append((f"fleet view {ranks:,}: hub full / fleet / view",
                     f"{med(hub['full']) * 1e3:.0f} / {med(hub['fleet']) * 1e3:.0f} / "
                     f"{med(hub['screen']) * 1e3:.1f} ms", "info"))
        del monitor
    print(f"   {verdict(ok)}: views <= {VIEW_TARGET_BYTES / 1e6:.0f} MB and snapshot -> frame "
          f"<= {RENDER_TARGET_MS:.0f} ms at every size")
    return ok


# ---- profiles -----------------------------------------------------------------------------------


def profile_text(prof: cProfile.Profile, sort: str = "cumulative", top: int = 18) -> str:
    """The top of a profile, the event loop's own waiting left out."""
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(
        r"^(?!.*(asyncio|selectors|epoll))", top)
    return "\n".join(line for line in s.getvalue().splitlines() if line.strip() and not
                     line.strip().startswith(("Ordered", "List reduced")))


async def profile_handler(snaps: list[dict[str, Any]], n: int = 20) -> str:
    """cProfile of on_snapshot_received and the frames it causes, 1,024 ranks, flat
    (by own time: the cumulative view is all Textual's callbacks)."""
    app = make_app(StaticSource(snaps[:1], title="bench", interval_s=3600.0))
    probe = FrameProbe(app)
    async with app.run_test(size=SIZE):
        probe.arm(lambda: app.snapshots_seen >= 1)
        await probe.wait()
        await asyncio.sleep(0.3)
        prof = cProfile.Profile()
        prof.enable()
        await snapshot_to_frame(app, probe, snaps, n)
        prof.disable()
        await stop_source(app)
    return profile_text(prof, "tottime", 22)


def profile_seek(path: Path, seconds: float) -> str:
    """cProfile of what a seek to ``seconds`` does in the source's thread."""
    src = ReplaySource(path)
    src._open()
    prof = cProfile.Profile()
    prof.enable()
    src._advance(until=(src._t0 or 0.0) + seconds, analyse_from=(src._t0 or 0.0) + seconds - 15)
    src._snapshot()
    prof.disable()
    return profile_text(prof)


# ---- main ----------------------------------------------------------------------------------------


def ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:6.1f} ms  p90 {pct(xs, 0.9) * 1e3:6.1f} ms"


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer repeats, 5 s of updates, a 10-minute recording")
    ap.add_argument("--profile", action="store_true",
                    help="also print cProfile tops of 1,024-rank updates and of a seek")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--fleets", default="1024,4096,16384",
                    help="fleet sizes of section 4 (comma-separated; '' skips it)")
    ap.add_argument("--only", choices=("fleet",), help="run only section 4")
    args = ap.parse_args(argv)
    fleets = [int(x) for x in args.fleets.split(",") if x.strip()]
    n = 10 if args.quick else 30
    rate_s = 5.0 if args.quick else 10.0
    rec_s = 600 if args.quick else 3600
    opens = 3 if args.quick else 5
    rows: list[tuple[str, str, str]] = []
    print(f"rtop TUI speed  (python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"{load()}, terminal {SIZE[0]}x{SIZE[1]}, headless)"
          f"{'  [quick]' if args.quick else ''}")

    if args.only == "fleet":
        ok4 = fleet_section(fleets, n, rows)
        print(f"\nsummary ({load()})")
        w = max(len(a) for a, _, _ in rows)
        for a, b, c in rows:
            print(f"  {a:<{w}}  {b:<44}  {c}")
        return 0 if ok4 else 1

    # 1. render
    t = time.perf_counter()
    job = BigJob(args.ranks)
    snaps = [job.snapshot() for _ in range(6)]
    nodes = len(snaps[0]["nodes"]["node"])
    print(f"\n1. render: {args.ranks} ranks on {nodes} nodes, {len(snaps)} distinct snapshots "
          f"built in {time.perf_counter() - t:.1f} s "
          f"({len(wire.encode(wire.KIND_SNAPSHOT, snaps[0])) / 1e6:.2f} MB on the wire); "
          f"{n} snapshots per view")
    r = asyncio.run(render_bench(snaps, n))
    print(f"   findings: {r['findings']}")
    print("   wall = post -> frame painted; cpu = UI thread CPU in that time")
    for key, label in (("flat", f"flat ({r['flat_rows']} rows)"),
                       ("sorted", "sorted by step ms"),
                       ("grouped", f"grouped by node, folded ({r['grouped_rows']} rows)")):
        print(f"   snapshot -> frame, {label:<36} wall {ms(r[key])}  cpu median "
              f"{statistics.median(r[key + '_cpu']) * 1e3:5.1f} ms  "
              f"({r[key + '_fps']:.1f} frames/snapshot)")
    print(f"     flat: on_snapshot_received alone            {ms(r['handler'])}  cpu median "
          f"{statistics.median(r['handler_cpu']) * 1e3:5.1f} ms")
    print(f"     flat: handler end -> frame painted          {ms(r['after_handler'])}")
    print(f"     terminal encoding of a frame (render_segments) {ms(r['encode'])}")
    print(f"   sort key (s, {len(r['sort_key'])} columns in turn) -> frame          "
          f"{ms(r['sort_key'])}")
    print(f"   group key (g) -> frame                          "
          f"{r['group_key'][0] * 1e3:6.1f} ms")
    worst = max(statistics.median(r[k]) for k in ("flat", "sorted", "grouped"))
    ok1 = worst * 1e3 <= RENDER_TARGET_MS
    print(f"   {verdict(ok1)}: worst median {worst * 1e3:.1f} ms vs {RENDER_TARGET_MS:.0f} ms")
    for k, label in (("flat", "render flat"), ("sorted", "render sorted"),
                     ("grouped", "render grouped")):
        med = statistics.median(r[k])
        rows.append((f"{label} ({args.ranks} ranks)",
                     f"{med * 1e3:.0f} ms (p90 {pct(r[k], 0.9) * 1e3:.0f}, cpu "
                     f"{statistics.median(r[k + '_cpu']) * 1e3:.0f})",
                     verdict(med * 1e3 <= RENDER_TARGET_MS)))
    rows.append(("sort key -> frame", f"{statistics.median(r['sort_key']) * 1e3:.0f} ms",
                 "info"))

    # 2. update rate
    print(f"\n2. updates: {args.ranks}-rank snapshots posted at 4 Hz for {rate_s:.0f} s "
          "from the source's thread")
    u = asyncio.run(rate_bench(snaps, rate_s))
    rate = u["processed"] / u["span"]
    ages = u["ages"] or [float("nan")]
    a1, a2 = u["ages_first_half"] or [0.0], u["ages_second_half"] or [0.0]
    backlog = u["queue_max"] > 3 or pct(ages, 0.9) > 1.0 or \
        statistics.median(a2) > statistics.median(a1) + 0.25
    ok2 = rate >= RATE_TARGET_HZ and not backlog
    print(f"   sent {u['sent']} in {u['span']:.1f} s, processed {u['processed']} "
          f"({rate:.2f} Hz), {u['sent'] - u['processed']} replaced while queued, "
          f"{u['painted']} frames painted")
    print(f"   app message queue: median {u['queue_med']:.0f}, max {u['queue_max']}")
    print(f"   snapshot age when painted (sent -> on screen): {ms(ages)}, "
          f"max {max(ages) * 1e3:.0f} ms")
    print(f"   age, first half {statistics.median(a1) * 1e3:.0f} ms vs second half "
          f"{statistics.median(a2) * 1e3:.0f} ms (growth would mean a backlog)")
    print(f"   {verdict(ok2)}: {rate:.2f} Hz processed (>= {RATE_TARGET_HZ:.0f} Hz), "
          f"{'a backlog' if backlog else 'no backlog'}")
    o = asyncio.run(rate_bench(snaps, 3.0, hz=20.0))
    oages = o["ages"] or [float("nan")]
    print(f"   overload (info): 20 Hz for 3 s: processed {o['processed'] / o['span']:.1f} Hz, "
          f"{o['sent'] - o['processed']} of {o['sent']} replaced while queued, queue max "
          f"{o['queue_max']}, age when painted {ms(oages)}")
    rows.append(("updates processed", f"{rate:.2f} Hz of 4 Hz", verdict(rate >= RATE_TARGET_HZ)))
    rows.append(("backlog (queue max, age p90)",
                 f"{u['queue_max']}, {pct(ages, 0.9) * 1e3:.0f} ms", verdict(not backlog)))
    rows.append(("overload 20 Hz: processed", f"{o['processed'] / o['span']:.1f} Hz, "
                 f"queue max {o['queue_max']}", "info"))

    # 3. replay
    path, made = recording(rec_s)
    size = path.stat().st_size
    print(f"\n3. replay: {path} ({rec_s / 60:.0f} min, 64 ranks): {size / 1e6:.1f} MB"
          + (f", written in {made:.1f} s" if made else ", cached"))
    first, allr = [], []
    seek: dict[str, Any] = {}
    for i in range(opens):
        o = asyncio.run(replay_open(path, 64, seek_to=float(rec_s) if i == opens - 1 else None))
        first.append(o["first"])
        allr.append(o["all_ranks"])
        if "seek" in o:
            seek = o
    ok3 = statistics.median(first) <= OPEN_TARGET_S
    print(f"   open -> first frame with a snapshot (in process): median "
          f"{statistics.median(first):.2f} s  max {max(first):.2f} s  "
          f"[{', '.join(f'{x:.2f}' for x in first)}]")
    print(f"   open -> first frame with all 64 ranks:             median "
          f"{statistics.median(allr):.2f} s (includes ~0.2 s of playback at 1x)")
    pty_runs = [replay_in_pty(path) for _ in range(3)]
    pty_t = [x for x, _ in pty_runs if x is not None]
    codes = [c for _, c in pty_runs]
    if pty_t:
        print(f"   `python -m rtop replay` in a pty -> first snapshot on screen: median "
              f"{statistics.median(pty_t):.2f} s [{', '.join(f'{x:.2f}' for x in pty_t)}] "
              f"(process start and imports included); exit status after q: {codes}")
    else:
        print("   `python -m rtop replay` in a pty: the job's name never showed (n/a)")
    print(f"   seek to the end ({rec_s} s) -> its frame painted: {seek['seek']:.1f} s "
          f"(worst UI event-loop stall meanwhile {seek['seek_stall'] * 1e3:.0f} ms; "
          f"findings there: {seek['seek_findings']})")
    print(f"   {verdict(ok3)}: opens in {statistics.median(first):.2f} s "
          f"(<= {OPEN_TARGET_S:.0f} s)")
    rows.append((f"replay open ({rec_s // 60} min, 64 ranks)",
                 f"{statistics.median(first):.2f} s", verdict(ok3)))
    if pty_t:
        rows.append(("replay open, real process (pty)", f"{statistics.median(pty_t):.2f} s",
                     "info"))
    rows.append((f"seek to end ({rec_s} s)", f"{seek['seek']:.1f} s", "info"))
    rows.append(("UI stall during seek", f"{seek['seek_stall'] * 1e3:.0f} ms", "info"))

    ok4 = fleet_section(fleets, n, rows) if fleets else True

    if args.profile:
        print(f"\nprofile: {n} snapshots of {args.ranks} ranks -> frames (own time)")
        print(asyncio.run(profile_handler(snaps, n)))
        print(f"\nprofile: seek to {rec_s} s in the source's thread (cumulative)")
        print(profile_seek(path, float(rec_s)))

    print(f"\nsummary ({load()})")
    w = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"  {a:<{w}}  {b:<30}  {c}")
    ok = ok1 and ok2 and ok3 and ok4
    print(f"  {'overall':<{w}}  {'':<30}  {verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
