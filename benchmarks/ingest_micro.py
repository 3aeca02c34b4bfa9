"""What one rank's batch costs the hub to ingest, in-process, through the hub's own path.

A :class:`rtop.hub.server.Hub` (not listening, no recorder, no housekeeping) gets
``--ranks`` ranks through relays of 8 ranks each, as ``benchmarks/hub_scale.py
--mode relays`` makes them: each relay is a connection object of the hub's fed bytes
by ``data_received``, as the event loop would; its ranks' streams are opened by
``relay`` frames and say hello (the handshake itself is skipped: each stream is set
authenticated, as ``Hub._auth`` leaves it, before its hello is applied). Then every
relay sends ``relay`` frames of ``--per-frame`` rank batches each (hub_scale's
batches: one step record, and every other batch a GPU, host, memory and heartbeat
sample) and the CPU time of feeding them all is divided by the rank batches:

    data_received -> FrameDecoder.feed_raw -> Hub._frame -> RelayLinks.frame
      -> the stream's data_received -> feed_raw -> Hub._rank_frame -> RunState.apply

It also times ``RunState.apply`` alone on decoded frames (1-step batches, with and
without samples). For before/after figures run it against another checkout::

    python benchmarks/ingest_micro.py
    PYTHONPATH=/tmp/before python benchmarks/ingest_micro.py
    python benchmarks/ingest_micro.py --profile /tmp/ingest.prof
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import statistics
import sys
import time
from typing import Any

import hub_scale  # benchmarks/, beside this file

import rtop
from collectors import wire
from rtop.hub.server import Hub, HubConfig
from rtop.run.state import RunState


class Sink(asyncio.Transport):
    """A relay's socket at the hub: what the hub writes is counted and dropped."""

    def __init__(self, port: int) -> None:
        super().__init__({"peername": ("127.0.0.1", port)})
        self.written = 0
        self.closed = False

    def write(self, data: Any) -> None:
        """Count the bytes."""
        self.written += len(data)

    def is_closing(self) -> bool:
        """Whether closed."""
        return self.closed

    def close(self) -> None:
        """Closed (the benchmark fails if the hub closes a relay)."""
        self.closed = True

    def get_write_buffer_size(self) -> int:
        """Nothing waits."""
        return 0


def relay_frame(pairs: list[Any]) -> bytes:
    """One ``relay`` frame carrying ``[sid, bytes, ...]``."""
    return wire.encode(wire.KIND_RELAY, {"data": pairs})


async def through_hub(ranks: int, rounds: int, per_frame: int, profile: str | None,
                      warmup: int = 0) -> dict[str, float]:
    """Rank batches fed through a hub's relay connections: CPU us per rank batch."""
    hub = Hub(HubConfig(record=""))
    group = f"{hub_scale.JOB}-g0"
    per_node = hub_scale.RANKS_PER_NODE
    nodes = ranks // per_node
    relays, streams = [], []
    for node in range(nodes):
        conn = hub.relays.by_conn  # noqa: F841 - documents where the link goes
        from rtop.hub.server import _Conn

        rc = _Conn(hub)
        rc.connection_made(Sink(10000 + node))
        hub.admission.release(rc)
        rc.dec.max_bytes = hub.cfg.max_frame_bytes
        rc.role = "relay"
        assert hub.relays.attach(rc, {"node": f"node-{node:04d}"})
        link = hub.relays.by_conn[rc]
        rc.data_received(wire.encode(wire.KIND_RELAY, {"open": list(range(per_node))}))
        for sid in range(per_node):
            sc = link.streams[sid].conn
            assert sc is not None
            hub.admission.release(sc)
            sc.dec.max_bytes = hub.cfg.max_frame_bytes
            sc.role = "rank"
            rank = node * per_node + sid
            hub._rank_frame(sc, b"", wire.Frame(wire.KIND_HELLO, hub_scale.hello_payload(
                rank, ranks, group)))
            assert sc.rank is not None, "hello refused"
        relays.append(rc)
        streams.append([hub_scale.PatchedStream(node * per_node + s, ranks, group)
                        for s in range(per_node)])
        await asyncio.sleep(0)
    # rounds of frames, built before the clock starts: in each, every relay sends one
    # frame of ``per_frame`` of its ranks' batches (its ranks take turns); the first
    # ``warmup`` rounds untimed (a rank's first steps cost more: its warm-up is noted)
    frames: list[list[bytes]] = []
    turn = 0
    batches = 0
    for k in range(warmup + rounds):
        if k == warmup:
            for one in frames:
                for rc, data in zip(relays, one, strict=True):
                    rc.data_received(data)
                await asyncio.sleep(0)
            frames, batches = [], 0
        one = []
        for streams_of in streams:
            pairs: list[Any] = []
            for k in range(per_frame):
                sid = (turn + k) % per_node
                s = streams_of[sid]
                pairs += (sid, s.next(with_samples=s.seq % 2 == 0))
            one.append(relay_frame(pairs))
            batches += per_frame
        turn += per_frame
        frames.append(one)
    before = hub.state.step_records
    prof = cProfile.Profile() if profile else None
    c0 = time.process_time()
    if prof:
        prof.enable()
    for one in frames:
        for rc, data in zip(relays, one, strict=True):
            rc.data_received(data)
        await asyncio.sleep(0)  # the relays' down frames go (a turn of the loop)
    if prof:
        prof.disable()
        prof.dump_stats(profile)
    cpu = time.process_time() - c0
    got = hub.state.step_records - before
    assert got == batches, (got, batches, hub.counters)
    assert not any(rc.transport.closed for rc in relays)  # type: ignore[attr-defined]
    return {"us_per_batch": cpu / batches * 1e6, "batches": batches}


def apply_alone(n: int = 4000) -> tuple[float, float]:
    """``RunState.apply`` on decoded 1-step batches: us per batch, without and with
    samples."""
    group = f"{hub_scale.JOB}-g0"
    ranks = 64
    out = []
    for samples in (False, True):
        st = RunState()
        for r in range(ranks):
            st.apply(wire.Frame(wire.KIND_HELLO, hub_scale.hello_payload(r, ranks, group)),
                     time.time())
        streams = [hub_scale.PatchedStream(r, ranks, group) for r in range(ranks)]
        frames = [wire.decode_body(memoryview(streams[i % ranks].next(samples))[
            wire.HEADER_BYTES:]) for i in range(n)]
        t = time.time()
        c0 = time.process_time()
        for f in frames:
            st.apply(f, t)
        assert st.step_records == n, st.step_records
        out.append((time.process_time() - c0) / n * 1e6)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--per-frame", type=int, default=4,
                    help="rank batches per relay frame (8 ranks, 2 batches/s, 0.25 s)")
    ap.add_argument("--warmup", type=int, default=48,
                    help="rounds sent before the timed ones (each rank past its warm-up)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", help="write a cProfile of the first run here")
    args = ap.parse_args()
    print(f"rtop from {rtop.__file__}", file=sys.stderr)
    hub_runs = []
    for i in range(args.repeat):
        r = asyncio.run(through_hub(args.ranks, args.rounds, args.per_frame,
                                    args.profile if i == 0 else None, args.warmup))
        hub_runs.append(r["us_per_batch"])
    plain, samples = zip(*(apply_alone() for _ in range(args.repeat)), strict=True)
    print(f"through the hub ({args.ranks} ranks via relays, {args.per_frame} batches a "
          f"relay frame): {statistics.median(hub_runs):.1f} us per rank batch "
          f"(runs: {', '.join(f'{x:.1f}' for x in hub_runs)})")
    print(f"RunState.apply alone: {statistics.median(plain):.1f} us per 1-step batch, "
          f"{statistics.median(samples):.1f} us with samples")


if __name__ == "__main__":
    main()
