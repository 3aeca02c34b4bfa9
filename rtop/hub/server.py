"""The hub: an asyncio TCP server where every rank's stream meets.

One port serves three kinds of peer, told apart by what they send first:

* ranks: ``hello`` (identity, token, clock) then ``batch`` frames, answered with a
  ``welcome`` and, every ``ping_every_s``, a ``ping`` whose ``pong`` refreshes the rank's
  clock offset;
* viewers: ``hello`` with ``role: viewer``, then ``subscribe`` (snapshots pushed at
  ``rate_hz``, default 2) and ``request`` (one snapshot now);
* Prometheus: an HTTP ``GET /metrics`` with ``Authorization: Bearer <token>``.

Every connection must present the hub's token (compared in constant time, never
logged). Bad input (garbage, an oversized length, a half frame, a wrong version, a
connection that never speaks, a flood) gets one log line and that one connection
closed; everything else carries on, and what was recorded stays recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors import wire
from rtop import __version__
from rtop.hub.recorder import Recorder, default_record_path
from rtop.hub.state import ProtocolError, RankState, RunState

log = logging.getLogger("rtop.hub")


@dataclass
class HubConfig:
    """How a hub listens, records and defends itself."""

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None  # None: a fresh random token
    record: str | Path | None = None  # None: default location; "" : no recording
    job: str = ""
    push_hz: float = 2.0
    hello_timeout_s: float = 5.0
    idle_timeout_s: float = 120.0  # a rank connection silent this long is closed
    frame_timeout_s: float = 30.0  # a frame started and not finished within this
    ping_every_s: float = 10.0
    lost_after_s: float = 10.0
    max_frame_bytes: int = wire.MAX_FRAME_BYTES
    flood_bytes_per_s: float = 32e6
    flood_frames_per_s: float = 5000.0
    flood_burst_s: float = 4.0
    viewer_high_water: int = 8 << 20  # bytes queued to a viewer before snapshots skip
    linger_s: float | None = None  # exit this long after the last rank and viewer left
    discovery_file: str | Path | None = None
    window_steps: int = 1200
    window_samples: int = 600
    extra: dict[str, Any] = field(default_factory=dict)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Bucket:
    """A token bucket: ``rate`` per second, ``burst`` seconds of it in reserve."""

    def __init__(self, rate: float, burst_s: float) -> None:
        self.rate, self.cap = rate, rate * burst_s
        self.level = self.cap
        self.t = time.monotonic()

    def take(self, n: float) -> bool:
        now = time.monotonic()
        self.level = min(self.cap, self.level + (now - self.t) * self.rate)
        self.t = now
        self.level -= n
        return self.level >= 0


class Hub:
    """One job's hub. ``await hub.start()``, then ``hub.address`` and ``hub.token``."""

    def __init__(self, config: HubConfig | None = None, state: RunState | None = None,
                 analyze: Callable[[RunState], list[dict[str, Any]]] | None = None) -> None:
        self.cfg = config or HubConfig()
        if not is_loopback(self.cfg.host) and self.cfg.token == "":
            raise ValueError("refusing to listen beyond loopback without a token")
        self.token = self.cfg.token if self.cfg.token else secrets.token_urlsafe(24)
        self.state = state or RunState(window_steps=self.cfg.window_steps,
                                       window_samples=self.cfg.window_samples,
                                       lost_after_s=self.cfg.lost_after_s)
        self.analyze = analyze
        self.recorder: Recorder | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._conn_ids = itertools.count(1)
        self._rank_writers: dict[int, asyncio.StreamWriter] = {}
        self._conns: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._pings: dict[int, dict[int, float]] = {}  # per rank writer: seq -> t sent
        self._viewers = 0
        self._snap_cache: tuple[float, bytes] | None = None
        self._closed = asyncio.Event()
        self._closing: asyncio.Task[None] | None = None
        self._idle_since: float | None = None
        self.address = ""
        self.counters = {"connections": 0, "refused": 0, "bad_frames": 0, "floods": 0,
                         "silent": 0, "snapshots_skipped": 0, "snapshots_sent": 0}

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Bind, open the recording, write the discovery file, start housekeeping."""
        self._server = await asyncio.start_server(
            self._on_conn, self.cfg.host, self.cfg.port, limit=self.cfg.max_frame_bytes + 64)
        sock = self._server.sockets[0]
        host, port = sock.getsockname()[:2]
        if host in ("0.0.0.0", "::"):
            host = _outward_ip()
        self.address = f"{host}:{port}"
        info = {"hub": {"version": __version__, "address": self.address, "pid": os.getpid(),
                        "started": time.time()}, "job": self.cfg.job}
        if self.cfg.record != "":
            path = Path(self.cfg.record) if self.cfg.record else default_record_path(self.cfg.job)
            self.recorder = Recorder(path, info)
            info["record"] = str(path)
        self.state.run_info = info
        if self.cfg.discovery_file:
            write_discovery_file(Path(self.cfg.discovery_file), {
                "address": self.address, "token": self.token, "pid": os.getpid(),
                "job": self.cfg.job, "record": info.get("record"), "started": time.time()})
        self._spawn(self._housekeeping())
        log.info("rtop hub listening on %s%s", self.address,
                 f", recording to {info['record']}" if "record" in info else "")

    async def serve_forever(self) -> None:
        """Run until :meth:`close` (or the linger time after the job ended)."""
        await self._closed.wait()
        if self._closing is not None:
            await asyncio.shield(self._closing)

    async def close(self) -> None:
        """Stop accepting, close every connection, flush and close the recording."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        conns = list(self._conns)
        for t, w in list(self._conns.items()):
            w.close()
            t.cancel()
        if conns:
            await asyncio.wait(conns, timeout=2.0)
        if self.recorder is not None:
            self.recorder.close()
        if self.cfg.discovery_file:
            with contextlib.suppress(OSError):
                Path(self.cfg.discovery_file).unlink()
        self._closed.set()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _housekeeping(self) -> None:
        next_flush = 0.0
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            lost = self.state.tick(now)
            if lost:
                names = ", ".join(str(rs.rank) for rs in lost[:10])
                more = f" and {len(lost) - 10} more" if len(lost) > 10 else ""
                log.warning("rtop hub: rank%s %s%s silent for over %.0f s: marked lost",
                            "s" if len(lost) > 1 else "", names, more,
                            self.state.lost_after_s)
            if self.recorder is not None:
                self.recorder.clock(now)
                if time.monotonic() >= next_flush:
                    self.recorder.flush()
                    next_flush = time.monotonic() + 1.0
            if self.cfg.linger_s is not None:
                self._check_linger()

    def _check_linger(self) -> None:
        busy = self._viewers > 0 or any(
            rs.status == "active" for rs in self.state.active_ranks())
        ever = self.state.current is not None
        if busy or not ever:
            self._idle_since = None
            return
        self._idle_since = self._idle_since or time.monotonic()
        linger = self.cfg.linger_s
        if linger is not None and time.monotonic() - self._idle_since > linger:
            log.info("rtop hub: job over and nobody watching for %.0f s; exiting",
                     self.cfg.linger_s)
            self._spawn(self.close())

    # ---- connections -------------------------------------------------------------------

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cid = next(self._conn_ids)
        task = asyncio.current_task()
        if task is not None:
            self._conns[task] = writer
        peer = writer.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.counters["connections"] += 1
        try:
            await self._serve(cid, who, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("rtop hub: unexpected error on connection %s; closed", who)
        finally:
            if task is not None:
                self._conns.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, cid: int, who: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readexactly(wire.HEADER_BYTES),
                                          self.cfg.hello_timeout_s)
        except asyncio.TimeoutError:
            self.counters["silent"] += 1
            log.warning("rtop hub: %s connected and never spoke within %.0f s; closed",
                        who, self.cfg.hello_timeout_s)
            return
        if head[:4] in (b"GET ", b"HEAD"):
            await self._http(head, reader, writer, who)
            return
        try:
            header, body, frame = await self._read_rest(head, reader, who)
        except wire.WireError as exc:
            self._bad(who, exc, writer)
            return
        if frame.kind != wire.KIND_HELLO:
            self._bad(who, wire.WireError(f"expected a hello, got {frame.kind!r}"), writer)
            return
        token = frame.payload.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(
                token.encode(), self.token.encode()):
            self.counters["refused"] += 1
            log.warning("rtop hub: %s presented a wrong token; refused", who)
            await self._send(writer, wire.KIND_ERROR,
                             {"code": "token", "message": "wrong token"})
            return
        role = frame.payload.get("role", "rank")
        if role == "viewer":
            await self._viewer(who, frame, reader, writer)
        else:
            await self._rank(cid, who, header, body, frame, reader, writer)

    def _bad(self, who: str, exc: Exception, writer: asyncio.StreamWriter | None) -> None:
        self.counters["bad_frames"] += 1
        self.state.bad_frames += 1
        log.warning("rtop hub: bad frame from %s: %s; connection closed", who, exc)
        if writer is not None and not writer.is_closing():
            with contextlib.suppress(Exception):
                writer.write(wire.encode(wire.KIND_ERROR, {"code": "bad_frame",
                                                           "message": str(exc)[:200]}))

    async def _read_rest(self, head: bytes, reader: asyncio.StreamReader, who: str
                         ) -> tuple[bytes, bytes, wire.Frame]:
        length = wire.parse_header(head, self.cfg.max_frame_bytes)
        try:
            body = await asyncio.wait_for(reader.readexactly(length), self.cfg.frame_timeout_s)
        except asyncio.TimeoutError:
            raise wire.WireError(
                f"half a frame: {length} bytes announced, not all sent within "
                f"{self.cfg.frame_timeout_s:.0f} s") from None
        return head, body, wire.decode_body(body)

    async def _read_frame(self, reader: asyncio.StreamReader, who: str, idle_s: float
                          ) -> tuple[bytes, bytes, wire.Frame] | None:
        try:
            head = await asyncio.wait_for(reader.readexactly(wire.HEADER_BYTES), idle_s)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise wire.WireError("connection closed inside a frame header") from None
            return None
        return await self._read_rest(head, reader, who)

    async def _send(self, writer: asyncio.StreamWriter, kind: str, payload: dict[str, Any]
                    ) -> None:
        writer.write(wire.encode(kind, payload))
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    # ---- ranks -------------------------------------------------------------------------

    async def _rank(self, cid: int, who: str, header: bytes, body: bytes, hello: wire.Frame,
                    reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        now = time.time()
        try:
            rs = self.state.apply(hello, now)
        except ProtocolError as exc:
            self._bad(who, exc, writer)
            return
        assert rs is not None
        if self.recorder is not None:
            self.recorder.raw(header, body, now)
        self._rank_writers[cid] = writer
        await self._send(writer, wire.KIND_WELCOME, {"t_hub": time.time(), "hub": __version__})
        log.info("rtop hub: rank %d of %d (%s, attempt %d) connected from %s", rs.rank,
                 rs.identity.world_size, rs.node, rs.attempt, who)
        pings: dict[int, float] = {}
        self._pings[id(writer)] = pings
        pinger = self._spawn(self._pinger(writer))
        best: list[tuple[float, float]] = []  # (rtt, offset) of recent pongs
        bytes_bucket = _Bucket(self.cfg.flood_bytes_per_s, self.cfg.flood_burst_s)
        frames_bucket = _Bucket(self.cfg.flood_frames_per_s, self.cfg.flood_burst_s)
        clean = False
        n = 0
        try:
            while True:
                try:
                    got = await self._read_frame(reader, who, self.cfg.idle_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("rtop hub: rank %d (%s) sent nothing for %.0f s; closed",
                                rs.rank, who, self.cfg.idle_timeout_s)
                    return
                except wire.WireError as exc:
                    self._bad(who, exc, writer)
                    return
                if got is None:
                    return
                header, body, frame = got
                if not bytes_bucket.take(len(body) + len(header)) or not frames_bucket.take(1):
                    self.counters["floods"] += 1
                    log.warning("rtop hub: rank %d (%s) floods the hub (over %.0f MB/s or "
                                "%.0f frames/s); connection closed", rs.rank, who,
                                self.cfg.flood_bytes_per_s / 1e6, self.cfg.flood_frames_per_s)
                    return
                now = time.time()
                if frame.kind == wire.KIND_PONG:
                    self._on_pong(rs, frame.payload, pings, best, now)
                    continue
                try:
                    got_rs = self.state.apply(frame, now)
                except ProtocolError as exc:
                    self._bad(who, exc, writer)
                    return
                rs = got_rs or rs
                if self.recorder is not None:
                    self.recorder.raw(header, body, now)
                if frame.kind == wire.KIND_BYE:
                    clean = True
                n += 1
                if n % 64 == 0:
                    await asyncio.sleep(0)  # let other connections in
        finally:
            pinger.cancel()
            self._pings.pop(id(writer), None)
            self._rank_writers.pop(cid, None)
            if not clean:
                now = time.time()
                payload = {"event": "close", "rank": rs.rank, "group": rs.identity.group,
                           "clean": False}
                self.state.on_disconnect(rs, now)
                if self.recorder is not None:
                    self.recorder.frame("conn", payload, now)
                log.warning("rtop hub: rank %d (%s) disconnected without saying goodbye",
                            rs.rank, rs.node)

    async def _pinger(self, writer: asyncio.StreamWriter) -> None:
        seq = 0
        await asyncio.sleep(0.2)
        while not writer.is_closing():
            seq += 1
            pings = self._pings.get(id(writer))
            if pings is None:
                return
            t = time.time()
            pings[seq] = t
            if len(pings) > 8:
                pings.pop(min(pings))
            writer.write(wire.encode(wire.KIND_PING, {"t_hub": t, "seq": seq}))
            # a few quick pings at first for a good estimate, then a refresh now and then
            await asyncio.sleep(0.5 if seq < 4 else self.cfg.ping_every_s)

    def _on_pong(self, rs: RankState, p: dict[str, Any], pings: dict[int, float],
                 best: list[tuple[float, float]], now: float) -> None:
        seq = p.get("seq")
        sent = pings.pop(seq, None) if isinstance(seq, int) else None
        t_rank = p.get("t_rank")
        if sent is None or not isinstance(t_rank, (int, float)):
            return
        rtt = now - sent
        best.append((rtt, float(t_rank) - (sent + now) / 2))
        del best[:-8]
        rtt_min, offset = min(best)  # the least-delayed exchange is the most accurate
        rs.offset_s, rs.rtt_s = offset, rtt_min
        if self.recorder is not None:
            self.recorder.frame("offset", {"rank": rs.rank, "group": rs.identity.group,
                                           "offset_s": offset, "rtt_s": rtt_min}, now)

    # ---- viewers -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The current snapshot, with findings when an analyzer is attached."""
        snap = self.state.snapshot()
        snap["findings"] = self.analyze(self.state) if self.analyze else []
        snap["hub"] = {"address": self.address, "counters": dict(self.counters),
                       "record": str(self.recorder.path) if self.recorder else None}
        return snap

    def _snapshot_frame(self) -> bytes:
        now = time.monotonic()
        if self._snap_cache is not None and now - self._snap_cache[0] < 0.1:
            return self._snap_cache[1]
        data = wire.encode(wire.KIND_SNAPSHOT, self.snapshot())
        self._snap_cache = (now, data)
        return data

    async def _viewer(self, who: str, hello: wire.Frame, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        self._viewers += 1
        await self._send(writer, wire.KIND_WELCOME, {"t_hub": time.time(), "hub": __version__})
        pusher: asyncio.Task[Any] | None = None
        try:
            while True:
                try:
                    got = await self._read_frame(reader, who, 3600.0)
                except wire.WireError as exc:
                    self._bad(who, exc, writer)
                    return
                except asyncio.TimeoutError:
                    return
                if got is None:
                    return
                frame = got[2]
                if frame.kind == wire.KIND_SUBSCRIBE:
                    rate = frame.payload.get("rate_hz", self.cfg.push_hz)
                    rate = min(max(float(rate) if isinstance(rate, (int, float)) else 2.0,
                                   0.1), 20.0)
                    if pusher is not None:
                        pusher.cancel()
                    pusher = self._spawn(self._push(writer, rate))
                elif frame.kind == wire.KIND_REQUEST:
                    self._offer(writer, self._answer(frame.payload))
        finally:
            self._viewers -= 1
            if pusher is not None:
                pusher.cancel()

    def _answer(self, req: dict[str, Any]) -> bytes:
        what = req.get("what", "snapshot")
        if what == "rank" and isinstance(req.get("rank"), int):
            return wire.encode("rank", self.rank_detail(req["rank"]))
        return self._snapshot_frame()

    def rank_detail(self, rank: int) -> dict[str, Any]:
        """One rank's full window: step and sample histories, stack, events, meta."""
        rs = self.state.rank_state(rank)
        if rs is None:
            return {"rank": rank, "found": False}
        st = self.state
        return {
            "rank": rank, "found": True, "identity": rs.identity.to_wire(),
            "status": rs.status, "meta": rs.meta, "stack": rs.stack,
            "events": list(rs.events), "offset_s": rs.offset_s,
            "steps": {f: _clean(st.steps.history(f, rs.slot)) for f in st.steps.fields},
            "samples": {f: _clean(st.samples.history(f, rs.slot)) for f in st.samples.fields},
        }

    def _offer(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        transport = writer.transport
        if writer.is_closing():
            return
        if transport.get_write_buffer_size() > self.cfg.viewer_high_water:
            self.counters["snapshots_skipped"] += 1  # a slow viewer gets fewer, never a backlog
            return
        writer.write(data)
        self.counters["snapshots_sent"] += 1

    async def _push(self, writer: asyncio.StreamWriter, rate: float) -> None:
        while not writer.is_closing():
            self._offer(writer, self._snapshot_frame())
            await asyncio.sleep(1.0 / rate)

    # ---- Prometheus ----------------------------------------------------------------------

    async def _http(self, head: bytes, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, who: str) -> None:
        try:
            rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        except (asyncio.TimeoutError, asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            log.warning("rtop hub: incomplete HTTP request from %s; closed", who)
            return
        text = (head + rest)[:16384].decode("latin-1")
        lines = text.split("\r\n")
        parts = lines[0].split()
        path = parts[1] if len(parts) > 1 else "/"
        auth = ""
        for line in lines[1:]:
            if line.lower().startswith("authorization:"):
                auth = line.split(":", 1)[1].strip()
        presented = auth[7:] if auth.lower().startswith("bearer ") else ""
        if "?token=" in path:
            path, presented = path.split("?token=", 1)
        if not hmac.compare_digest(presented.encode(), self.token.encode()):
            self.counters["refused"] += 1
            log.warning("rtop hub: HTTP request from %s without the right token; refused", who)
            writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
            return
        if path != "/metrics":
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
            return
        from rtop.hub.metrics import prometheus_text

        body = prometheus_text(self.snapshot()).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                     + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()


def _clean(values: Any) -> list[float | None]:
    return [None if v != v else float(v) for v in values.tolist()]


def _outward_ip() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def write_discovery_file(path: Path, info: dict[str, Any]) -> None:
    """Write a hub's address and token for ``rtop`` to find: 0600, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
