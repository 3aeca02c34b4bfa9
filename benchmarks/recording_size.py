"""How large is a recording, and how fast does a replay jump in one? Measured on the
hub's own recorder (:class:`rtop.hub.recorder.Recorder`), fed what a hub records.

The traffic is ``benchmarks/hub_scale.py``'s: ``--ranks`` ranks (default 4,096, 8 per
node) each sending a batch every 0.5 s with one step record (2 steps/s per rank) and,
every other batch, one GPU, host, memory and heartbeat sample (``hub_scale.RankStream``,
its values drawn as there: step times, rates, utilisation and watts with random low
digits); each rank's ``hello`` first (as the hub records it: without its nonce), and
the hub's own ``offset`` frame for each rank every 10 s (its pings). Hub time is
simulated (``--seconds`` of it, default 20): the recorder is flushed once per second of
it, as the hub does. The recorder's own CPU time (clock frames, the secret check,
decoding and laying out the frames, compressing, writing) is measured around its calls
alone, the traffic made beforehand.

It prints:

1. the bytes per hour at ``--ranks`` ranks, old format (a wire frame after another)
   against the block format (rounded measurements, the default; and exact), their
   ratio, the recorder's CPU per second of recording in each (given each frame decoded,
   as the hub gives it; and decoding each frame again, as a caller that gives bytes
   alone makes it), and read speed (every frame back through
   :func:`rtop.run.recording.read`);
2. compressors compared on the same blocks (``--codec-seconds`` of them): zlib and lzma
   from the standard library and zstandard at several levels, each on the columnar
   bodies (and zstandard on the old format's bytes, without columns): ratio to the old
   format, compression CPU per MB of body and per second of recording, decompression
   speed;
3. what the rounding of measurements is worth: bytes per hour with measurements kept
   to 16, 18 (the default), 20 and 24 significant bits, and exact;
4. seeking (``--seek-ranks``, default 1,024, ``--seek-minutes``, default 60): a
   recording of that length written through the recorder into ``--seek-file`` (reused
   when it exists: writing an hour of 1,024 ranks takes minutes), then ``--jumps``
   jumps of a replay (:meth:`rtop.tui.source.ReplaySource.jump`, what ``rtop replay``'s
   seek does) to random positions: the time until the snapshot there is built, median
   and max; beside it, what replaying frame by frame costs per second of the recording
   (what a seek in the older format does, from the start).

    python benchmarks/recording_size.py [--ranks 4096] [--seconds 20] [--seek-minutes 60]
"""

from __future__ import annotations

import argparse
import lzma
import os
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hub_scale
import zstandard

from collectors import wire
from rtop.hub.recorder import Recorder
from rtop.run import blocks
from rtop.run.columns import MEASURE_BITS
from rtop.run.recording import ReadResult, read

T0 = 1_800_000_000.0
OFFSET_EVERY_S = 10.0  # the hub's ping interval (HubConfig.ping_every_s)
MB = 1e6
GB = 1e9


class SimClock:
    """``hub_scale``'s clock, moved by hand: its ranks stamp their records with the
    simulated time, not this machine's."""

    def __init__(self) -> None:
        self.now = T0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now - T0 + 1000.0


Item = tuple[float, str, Any]  # (hub time, "raw" | hub frame kind, bytes | payload)


def traffic(ranks: int, seconds: float, seed: int = 0) -> Iterator[Item]:
    """What a hub records of ``ranks`` ranks over ``seconds`` (see the module doc)."""
    clock = SimClock()
    hub_scale.time = clock  # type: ignore[assignment]  # its ranks' records, simulated time
    rng = random.Random(seed)
    group = f"{hub_scale.JOB}#0"
    streams = [hub_scale.RankStream(r, ranks, group) for r in range(ranks)]
    for r in range(ranks):
        hello = hub_scale.hello_payload(r, ranks, group)
        hello.pop("nonce", None)  # the hub records a hello without its nonce
        yield T0, "raw", wire.encode(wire.KIND_HELLO, hello)
    period = hub_scale.PERIOD_S
    per_offset = round(OFFSET_EVERY_S / period)
    for k in range(round(seconds / period)):
        for r, st in enumerate(streams):
            t = clock.now = T0 + k * period + period * r / ranks
            yield t, "raw", wire.encode(wire.KIND_BATCH, st.batch(with_samples=k % 2 == 0))
            if k % per_offset == r % per_offset:
                yield t, "offset", {"rank": r, "group": group,
                                    "offset_s": rng.gauss(0.0, 0.003),
                                    "rtt_s": 0.0002 + 0.0004 * rng.random()}


def record(path: Path, items: list[Item] | Iterator[Item], decoded: bool = False,
           **kw: Any) -> float:
    """Write ``items`` through a Recorder (flushed each second of hub time, closed at
    the end); the CPU seconds it took (the recorder's alone when ``items`` is a list
    made beforehand). ``decoded``: give the recorder each frame decoded too, as the hub
    does (decoded here beforehand, outside the time measured)."""
    if path.exists():
        path.unlink()
    frames = [wire.decode_body(memoryview(data)[wire.HEADER_BYTES:]) if kind == "raw"
              else None for _, kind, data in items] if decoded else None
    info = {"hub": {"version": "bench", "address": "10.0.0.1:7077", "pid": 1,
                    "started": T0}, "job": hub_scale.JOB}
    c0 = time.process_time()
    rec = Recorder(path, info, **kw)
    next_flush = T0 + 1.0
    for i, (t, kind, data) in enumerate(items):
        if t >= next_flush:
            rec.flush()
            next_flush = t - (t - T0) % 1.0 + 1.0
        if kind == "raw":
            rec.raw(data, t, frames[i] if frames is not None else None)
        else:
            rec.frame(kind, data, t)
    rec.close()
    return time.process_time() - c0


def per_second(items: list[Item]) -> list[list[tuple[str, dict[str, Any]]]]:
    """The frames of each second of hub time, as the recorder's blocks hold them (with
    the clock frames it adds every 0.25 s)."""
    out: list[list[tuple[str, dict[str, Any]]]] = [[]]
    edge, last_clock = T0 + 1.0, -1.0
    for t, kind, data in items:
        if t >= edge:
            out.append([])
            edge = t - (t - T0) % 1.0 + 1.0
        if t - last_clock >= 0.25:
            out[-1].append((wire.KIND_CLOCK, {"t_hub": t}))
            last_clock = t
        if kind == "raw":
            f = wire.decode_body(memoryview(data)[wire.HEADER_BYTES:])
            out[-1].append((f.kind, f.payload))
        else:
            out[-1].append((kind, data))
    return [s for s in out if s]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the CPU seconds it took."""
    c0 = time.process_time()
    out = fn()
    return out, time.process_time() - c0


def read_speed(path: Path) -> tuple[int, float]:
    """Frames read back, and the wall seconds it took."""
    t0 = time.perf_counter()
    res = ReadResult()
    n = sum(1 for _ in read(path, res))
    assert not res.warnings, res.warnings
    return n, time.perf_counter() - t0


def sizes(args: argparse.Namespace, tmp: Path, items: list[Item]) -> int:
    """Part 1: the old format against the new; returns the old format's bytes."""
    secs = args.seconds
    print(f"\n1. Recording {args.ranks:,} ranks for {secs:g} s of hub time "
          f"({len(items):,} frames; per hour = x {3600 / secs:g})")
    rows = []
    for name, kw in (("old format (wire frames)", {"legacy": True}),
                     ("blocks, rounded (default), as the hub", {"decoded": True}),
                     ("blocks, rounded, frames decoded again", {}),
                     ("blocks, exact", {"rounded": False, "decoded": True})):
        path = tmp / f"{name.split()[0]}-{len(rows)}.rtop"
        cpu = record(path, items, **kw)
        size = path.stat().st_size
        n, read_s = read_speed(path)
        rows.append((name, size, cpu, n, read_s))
        path.unlink()
    old = rows[0][1]
    print(f"   {'format':<40} {'GB/hour':>8} {'ratio':>6} {'recorder CPU':>16} "
          f"{'read':>22}")
    for name, size, cpu, n, read_s in rows:
        print(f"   {name:<40} {size / secs * 3600 / GB:>8.2f} {old / size:>5.1f}x "
              f"{cpu / secs * 1e3:>9.0f} ms/s   {n / read_s / 1e3:>7.0f}k frames/s "
              f"({read_s / secs * 1e3:.0f} ms/s)")
    new = rows[1][1] / secs * 3600 / GB
    print(f"   target: <= 1 GB/hour at 4,096 ranks: {new:.2f} GB/hour "
          f"({'met' if new <= 1.0 or args.ranks != 4096 else 'NOT met'})")
    return old


def codecs(args: argparse.Namespace, items: list[Item], old_bytes: int) -> None:
    """Part 2: compressors compared on the same blocks."""
    seconds = per_second(items)[1:1 + args.codec_seconds]  # past the hellos' second
    n = len(seconds)
    bodies = [blocks.encode_body(s).body for s in seconds]
    old = [b"".join(wire.encode(k, p) for k, p in s) for s in seconds]
    old_n = sum(map(len, old))
    raw_mb = sum(map(len, bodies)) / MB
    print(f"\n2. Compressors on {n} one-second blocks of {args.ranks:,} ranks "
          f"({raw_mb:.1f} MB of columnar bodies, {old_n / MB:.1f} MB in the old format)")
    print(f"   {'compressor':<30} {'ratio':>6} {'CPU ms/MB':>10} {'CPU ms per s':>13} "
          f"{'GB/hour':>8} {'decompress':>11}")
    zc = {lvl: zstandard.ZstdCompressor(level=lvl) for lvl in (1, 3, 9, 19)}
    zd = zstandard.ZstdDecompressor()
    cases: list[tuple[str, list[bytes], Callable[[bytes], bytes], Callable[[bytes], bytes]]]
    cases = [(f"zlib level {lvl}", bodies, (lambda b, lvl=lvl: zlib.compress(b, lvl)),
              zlib.decompress) for lvl in (1, 6, 9)]
    cases += [(f"lzma preset {p}", bodies, (lambda b, p=p: lzma.compress(b, preset=p)),
               lzma.decompress) for p in (0, 6)]
    cases += [(f"zstd level {lvl}", bodies, zc[lvl].compress, zd.decompress)
              for lvl in (1, 3, 9, 19)]
    cases.append(("zstd level 3, old format", old, zc[3].compress, zd.decompress))
    for name, data, comp, decomp in cases:
        out, cpu = timed(lambda data=data, comp=comp: [comp(b) for b in data])
        size = sum(map(len, out))
        _, dcpu = timed(lambda out=out, decomp=decomp: [decomp(b) for b in out])
        mb = sum(map(len, data)) / MB
        print(f"   {name:<30} {old_n / size:>5.1f}x {cpu / mb * 1e3:>10.1f} "
              f"{cpu / n * 1e3:>13.1f} {size / n * 3600 / GB:>8.2f} "
              f"{mb / dcpu if dcpu else float('inf'):>7.0f} MB/s")
    _ = old_bytes


def precision(args: argparse.Namespace, items: list[Item]) -> None:
    """Part 3: bytes per hour against the measurements' precision."""
    seconds = per_second(items)[1:1 + args.codec_seconds]
    old_n = sum(len(wire.encode(k, p)) for s in seconds for k, p in s)
    z = zstandard.ZstdCompressor(level=blocks.LEVEL)
    print(f"\n3. Measurements' precision ({len(seconds)} one-second blocks, zstd level "
          f"{blocks.LEVEL})")
    print(f"   {'significant bits':<22} {'largest error':>14} {'GB/hour':>8} {'ratio':>6}")
    for bits in [*sorted({12, 14, 16, MEASURE_BITS, 18, 20, 24}), None]:
        size = sum(len(z.compress(blocks.encode_body(s, bits).body)) for s in seconds)
        err = f"{2.0 ** -bits * 1e6:.2f} ppm" if bits else "exact"
        label = f"{bits if bits else 'all (exact)'}{' (default)' if bits == MEASURE_BITS else ''}"
        print(f"   {label:<22} {err:>14} {size / len(seconds) * 3600 / GB:>8.2f} "
              f"{old_n / size:>5.1f}x")


def seeking(args: argparse.Namespace) -> None:
    """Part 4: jumps of a replay in a long recording."""
    from rtop.tui.source import ReplaySource

    path = Path(args.seek_file)
    secs = args.seek_minutes * 60.0
    if not path.exists():
        print(f"\n4. Writing {args.seek_minutes:g} minutes of {args.seek_ranks:,} ranks to "
              f"{path} (once; reused next time) ...", flush=True)
        t0 = time.perf_counter()
        record(path, traffic(args.seek_ranks, secs))
        print(f"   written in {time.perf_counter() - t0:.0f} s: "
              f"{path.stat().st_size / MB:,.0f} MB", flush=True)
    else:
        print(f"\n4. Seeking in {path} ({path.stat().st_size / MB:,.0f} MB, written before)")
    t0 = time.perf_counter()
    src = ReplaySource(path, paused=True)
    opened = time.perf_counter() - t0
    dur = src.duration or 0.0
    print(f"   {dur / 60:.1f} minutes of {args.seek_ranks:,} ranks; opening it (its index "
          f"of {len(src._seeker.blocks) if src._seeker else 0:,} blocks) took "
          f"{opened * 1e3:.0f} ms")
    rng = random.Random(1)
    walls, cpus = [], []
    for i in range(args.jumps + 1):
        at = rng.uniform(0.0, dur)
        t0, c0 = time.perf_counter(), time.process_time()
        ok = src.jump(at)
        snap = src.monitor.snapshot()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert ok, "the recording could not be jumped in"
        assert len(snap["ranks"]["rank"]) == args.seek_ranks, len(snap["ranks"]["rank"])
        if i == 0:
            print(f"   first jump (cold caches): {wall * 1e3:.0f} ms ({cpu * 1e3:.0f} ms CPU)")
            continue
        walls.append(wall)
        cpus.append(cpu)
    print(f"   {args.jumps} jumps to random positions, to the snapshot there: median "
          f"{statistics.median(walls) * 1e3:.0f} ms, max {max(walls) * 1e3:.0f} ms "
          f"(CPU median {statistics.median(cpus) * 1e3:.0f} ms, max "
          f"{max(cpus) * 1e3:.0f} ms; target <= 500 ms)")
    # the older way, what a seek does without the index: every frame from the start
    # (the diagnosis over the last 15 s), here the first 30 s
    old = ReplaySource(path, paused=True)
    old._seeker = None
    old._open()
    t0 = time.perf_counter()
    old._do_seek(lambda message: None, "time", 30.0)
    slow = time.perf_counter() - t0
    print(f"   frame by frame from the start instead (a seek in the older format): "
          f"{slow:.1f} s to 30 s in, {slow / 30.0 * dur / 60:.0f} minutes to the end")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--codec-seconds", type=int, default=4)
    p.add_argument("--seek-ranks", type=int, default=1024)
    p.add_argument("--seek-minutes", type=float, default=60.0)
    p.add_argument("--seek-file", default=os.path.join(tempfile.gettempdir(),
                                                       "rtop-seek-bench.rtop"))
    p.add_argument("--jumps", type=int, default=20)
    p.add_argument("--skip-seek", action="store_true")
    p.add_argument("--seek-only", action="store_true", help="part 4 alone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.seek_only:
        seeking(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="rtop-recsize-") as d:
        items = list(traffic(args.ranks, args.seconds))
        old = sizes(args, Path(d), items)
        codecs(args, items, old)
        precision(args, items)
    if not args.skip_seek:
        seeking(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
