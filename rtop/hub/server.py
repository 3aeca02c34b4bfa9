"""The hub: an asyncio TCP server where every rank's stream meets.

One port serves three kinds of peer, told apart by what they send first:

* ranks: ``hello`` (identity, token, clock) then ``batch`` frames, answered with a
  ``welcome`` and, now and then, a ``ping`` whose ``pong`` refreshes the rank's clock
  offset;
* viewers: ``hello`` with ``role: viewer``, then ``subscribe`` (snapshots pushed at
  ``rate_hz``, default 2, at most 10) and ``request`` (a snapshot, or one rank's window);
* Prometheus: an HTTP ``GET /metrics`` with ``Authorization: Bearer <token>``.

Connections are ``asyncio.Protocol`` objects: received bytes go straight through the
frame decoder into the run state, with no coroutine or timer per frame, so one core
ingests thousands of ranks. Timeouts (a peer that never speaks, half a frame, a silent
rank), pings and viewer pushes run from one housekeeping loop. While the hub is busy
it simply reads less: unread data stays in the kernel, and the ranks' own bounded
buffers take it from there; nothing piles up in the hub.

Every connection must present the hub's token (compared in constant time, never
logged). Bad input gets one log line and that one connection closed; what was recorded
stays recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import resource
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors import wire
from rtop import __version__
from rtop.analysis.monitor import Evaluation, Monitor
from rtop.hub.recorder import Recorder, default_record_path
from rtop.run.snapshot import HubInfo, RankDetail, Snapshot
from rtop.run.state import ProtocolError, RankState, RunState

log = logging.getLogger("rtop.hub")

MAX_VIEWER_HZ = 10.0
HTTP_MAX_BYTES = 16384


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

    __slots__ = ("cap", "level", "rate", "t")

    def __init__(self, rate: float, burst_s: float) -> None:
        self.rate, self.cap = rate, rate * burst_s
        self.level = self.cap
        self.t = time.monotonic()

    def take(self, n: float, now: float) -> bool:
        self.level = min(self.cap, self.level + (now - self.t) * self.rate)
        self.t = now
        self.level -= n
        return self.level >= 0


class _Conn(asyncio.Protocol):
    """One peer. ``role`` is None until its hello, then "rank", "viewer" or "http"."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.transport: asyncio.Transport | None = None
        self.dec = wire.FrameDecoder(hub.cfg.max_frame_bytes)
        self.role: str | None = None
        self.who = "?"
        now = time.monotonic()
        self.opened = self.last = now
        self.partial_since: float | None = None
        self.rank: RankState | None = None
        self.clean = False
        self.closing = False
        self.bytes_in = _Bucket(hub.cfg.flood_bytes_per_s, hub.cfg.flood_burst_s)
        self.frames_in = _Bucket(hub.cfg.flood_frames_per_s, hub.cfg.flood_burst_s)
        self.pings: dict[int, float] = {}
        self.best: list[tuple[float, float]] = []  # (rtt, offset) of recent pongs
        self.ping_seq = 0
        self.next_ping = now + 0.2
        self.rate = 0.0
        self.next_push = 0.0
        self.http = bytearray()

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.hub._conns.add(self)
        self.hub.counters["connections"] += 1

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        now = time.monotonic()
        self.last = now
        if self.role == "http" or (self.role is None and not self.dec.pending
                                   and data[:4] in (b"GET ", b"HEAD")):
            self.role = "http"
            self.http += data
            self.hub._http(self)
            return
        if not self.bytes_in.take(len(data), now):
            self.hub._flood(self)
            return
        try:
            frames = self.dec.feed_raw(data)
        except wire.WireError as exc:
            for raw, frame in exc.partial:
                self.hub._frame(self, raw, frame)
            self.hub._bad(self, exc)
            return
        self.partial_since = (self.partial_since or now) if self.dec.pending else None
        if frames and not self.frames_in.take(len(frames), now):
            self.hub._flood(self)
            return
        for raw, frame in frames:
            self.hub._frame(self, raw, frame)
            if self.closing:
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.hub._lost(self)

    # helpers
    def send(self, kind: str, payload: dict[str, Any]) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(wire.encode(kind, payload))

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


class Hub:
    """One job's hub. ``await hub.start()``, then ``hub.address`` and ``hub.token``."""

    def __init__(self, config: HubConfig | None = None, monitor: Monitor | None = None
                 ) -> None:
        self.cfg = config or HubConfig()
        if not is_loopback(self.cfg.host) and self.cfg.token == "":
            raise ValueError("refusing to listen beyond loopback without a token")
        self.token = self.cfg.token if self.cfg.token else secrets.token_urlsafe(24)
        self._token = self.token.encode()
        #: the run's state and diagnosis (without one given: the state alone, no findings)
        self.monitor = monitor if monitor is not None else Monitor(
            RunState(window_steps=self.cfg.window_steps,
                     window_samples=self.cfg.window_samples,
                     lost_after_s=self.cfg.lost_after_s), diagnose=False)
        self.recorder: Recorder | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
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
        _raise_fd_limit()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Conn(self), self.cfg.host, self.cfg.port, backlog=4096,
            reuse_address=True)
        host, port = self._server.sockets[0].getsockname()[:2]
        if host in ("0.0.0.0", "::"):
            host = _outward_ip()
        self.address = f"{host}:{port}"
        info: dict[str, Any] = {"hub": {"version": __version__, "address": self.address,
                                        "pid": os.getpid(), "started": time.time()},
                                "job": self.cfg.job}
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
        self._spawn(self._pusher())
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
        for conn in list(self._conns):
            conn.close()
        await asyncio.sleep(0)
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

    # ---- housekeeping -------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        next_flush = 0.0
        while True:
            await asyncio.sleep(0.25)
            try:
                self._housekeep(time.monotonic(), time.time())
            except Exception:
                log.exception("rtop hub: housekeeping failed")
            if self.recorder is not None and time.monotonic() >= next_flush:
                self.recorder.flush()
                next_flush = time.monotonic() + 1.0

    def _housekeep(self, mono: float, now: float) -> None:
        cfg = self.cfg
        for conn in list(self._conns):
            if conn.closing:
                continue
            if conn.role is None and mono - conn.opened > cfg.hello_timeout_s \
                    and conn.partial_since is None:
                self.counters["silent"] += 1
                log.warning("rtop hub: %s connected and never spoke within %.0f s; closed",
                            conn.who, cfg.hello_timeout_s)
                conn.close()
            elif conn.partial_since is not None and mono - conn.partial_since > \
                    cfg.frame_timeout_s:
                self._bad(conn, wire.WireError(
                    f"half a frame: {conn.dec.pending} bytes of a frame, the rest not sent "
                    f"within {cfg.frame_timeout_s:.0f} s"))
            elif conn.role == "rank" and mono - conn.last > cfg.idle_timeout_s:
                log.warning("rtop hub: rank %s (%s) sent nothing for %.0f s; closed",
                            conn.rank.rank if conn.rank else "?", conn.who,
                            cfg.idle_timeout_s)
                conn.close()
            elif conn.role == "rank" and mono >= conn.next_ping:
                self._ping(conn, now)
        evaluation = self.monitor.advance(now)
        if evaluation is not None:
            self._report(evaluation)
        if self.recorder is not None:
            self.recorder.clock(now)
        if cfg.linger_s is not None:
            self._check_linger(mono, cfg.linger_s)

    @property
    def state(self) -> RunState:
        """The run's state (the monitor's)."""
        return self.monitor.state

    def _report(self, ev: Evaluation) -> None:
        """Log ranks newly lost, and log and record the findings that start or end."""
        if ev.lost:
            names = ", ".join(str(rs.rank) for rs in ev.lost[:10])
            more = f" and {len(ev.lost) - 10} more" if len(ev.lost) > 10 else ""
            log.warning("rtop hub: rank%s %s%s silent for over %.0f s: marked lost",
                        "s" if len(ev.lost) > 1 else "", names, more,
                        self.state.lost_after_s)
        for f in ev.started:
            log.warning("rtop: %s %s: %s", f["severity"], f["kind"], f["summary"])
            if self.recorder is not None:
                self.recorder.frame("finding", {"event": "onset", **f}, ev.t)
        for kind in ev.cleared:
            log.info("rtop: %s cleared", kind)
            if self.recorder is not None:
                self.recorder.frame("finding", {"event": "clear", "kind": kind}, ev.t)

    def _check_linger(self, mono: float, linger: float) -> None:
        viewers = any(c.role == "viewer" for c in self._conns)
        busy = viewers or any(rs.status == "active" for rs in self.state.active_ranks())
        if busy or self.state.current is None:
            self._idle_since = None
            return
        self._idle_since = self._idle_since or mono
        if mono - self._idle_since > linger:
            log.info("rtop hub: job over and nobody watching for %.0f s; exiting", linger)
            self._spawn(self.close())

    # ---- frames ----------------------------------------------------------------------

    def _frame(self, conn: _Conn, raw: bytes, frame: wire.Frame) -> None:
        if conn.role is None:
            self._hello(conn, raw, frame)
        elif conn.role == "rank":
            self._rank_frame(conn, raw, frame)
        elif conn.role == "viewer":
            self._viewer_frame(conn, frame)

    def _hello(self, conn: _Conn, raw: bytes, frame: wire.Frame) -> None:
        if frame.kind != wire.KIND_HELLO:
            self._bad(conn, wire.WireError(f"expected a hello, got {frame.kind!r}"))
            return
        token = frame.payload.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
            self.counters["refused"] += 1
            log.warning("rtop hub: %s presented a wrong token; refused", conn.who)
            conn.send(wire.KIND_ERROR, {"code": "token", "message": "wrong token"})
            conn.close()
            return
        if frame.payload.get("role") == "viewer":
            conn.role = "viewer"
            conn.send(wire.KIND_WELCOME, {"t_hub": time.time(), "hub": __version__})
            return
        conn.role = "rank"
        self._rank_frame(conn, raw, frame)

    def _rank_frame(self, conn: _Conn, raw: bytes, frame: wire.Frame) -> None:
        now = time.time()
        if frame.kind == wire.KIND_PONG:
            if conn.rank is not None:
                self._pong(conn, conn.rank, frame.payload, now)
            return
        try:
            rs = self.monitor.apply(frame, now)
        except ProtocolError as exc:
            self._bad(conn, exc)
            return
        if self.recorder is not None:
            self.recorder.raw(raw, now)
        if frame.kind == wire.KIND_HELLO and rs is not None:
            first = conn.rank is None
            conn.rank = rs
            if first:
                conn.send(wire.KIND_WELCOME, {"t_hub": time.time(), "hub": __version__})
                log.info("rtop hub: rank %d of %d (%s, attempt %d) connected from %s",
                         rs.rank, rs.identity.world_size, rs.node, rs.attempt, conn.who)
        elif frame.kind == wire.KIND_BYE:
            conn.clean = True

    def _bad(self, conn: _Conn, exc: Exception) -> None:
        self.counters["bad_frames"] += 1
        self.state.bad_frames += 1
        log.warning("rtop hub: bad frame from %s: %s; connection closed", conn.who, exc)
        conn.send(wire.KIND_ERROR, {"code": "bad_frame", "message": str(exc)[:200]})
        conn.close()

    def _flood(self, conn: _Conn) -> None:
        self.counters["floods"] += 1
        who = f"rank {conn.rank.rank} ({conn.who})" if conn.rank else conn.who
        log.warning("rtop hub: %s floods the hub (over %.0f MB/s or %.0f frames/s); "
                    "connection closed", who, self.cfg.flood_bytes_per_s / 1e6,
                    self.cfg.flood_frames_per_s)
        conn.close()

    def _lost(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        rs = conn.rank
        if conn.role != "rank" or rs is None or conn.clean or self._closed.is_set():
            return
        if self._closing is not None:
            return
        now = time.time()
        self.state.on_disconnect(rs, now)
        if self.recorder is not None:
            self.recorder.frame("conn", {"event": "close", "rank": rs.rank,
                                         "group": rs.identity.group, "clean": False}, now)
        log.warning("rtop hub: rank %d (%s) disconnected without saying goodbye",
                    rs.rank, rs.node)

    # ---- clocks ----------------------------------------------------------------------

    def _ping(self, conn: _Conn, now: float) -> None:
        conn.ping_seq += 1
        conn.pings[conn.ping_seq] = now
        if len(conn.pings) > 8:
            conn.pings.pop(min(conn.pings))
        conn.send(wire.KIND_PING, {"t_hub": now, "seq": conn.ping_seq})
        # a few quick pings at first for a good estimate, then a refresh now and then
        conn.next_ping = time.monotonic() + (0.5 if conn.ping_seq < 4 else
                                             self.cfg.ping_every_s)

    def _pong(self, conn: _Conn, rs: RankState, p: dict[str, Any], now: float) -> None:
        seq = p.get("seq")
        sent = conn.pings.pop(seq, None) if isinstance(seq, int) else None
        t_rank = p.get("t_rank")
        if sent is None or not isinstance(t_rank, (int, float)):
            return
        conn.best.append((now - sent, float(t_rank) - (sent + now) / 2))
        del conn.best[:-8]
        rtt, offset = min(conn.best)  # the least-delayed exchange is the most accurate
        rs.offset_s, rs.rtt_s = offset, rtt
        if self.recorder is not None:
            self.recorder.frame("offset", {"rank": rs.rank, "group": rs.identity.group,
                                           "offset_s": offset, "rtt_s": rtt}, now)

    # ---- viewers -----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The current snapshot, with findings when the monitor diagnoses."""
        return self.monitor.snapshot(hub=HubInfo(
            address=self.address, counters=dict(self.counters),
            record=str(self.recorder.path) if self.recorder else None))

    def _snapshot_frame(self) -> bytes:
        now = time.monotonic()
        if self._snap_cache is not None and now - self._snap_cache[0] < 0.2:
            return self._snap_cache[1]
        data = wire.encode(wire.KIND_SNAPSHOT, self.snapshot())
        self._snap_cache = (now, data)
        return data

    def _viewer_frame(self, conn: _Conn, frame: wire.Frame) -> None:
        p = frame.payload
        if frame.kind == wire.KIND_SUBSCRIBE:
            rate = p.get("rate_hz", self.cfg.push_hz)
            ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0
            conn.rate = min(float(rate), MAX_VIEWER_HZ) if ok else self.cfg.push_hz
            conn.next_push = 0.0
        elif frame.kind == wire.KIND_REQUEST:
            if p.get("what") == "rank" and isinstance(p.get("rank"), int):
                self._offer(conn, wire.encode("rank", self.rank_detail(p["rank"])))
            else:
                self._offer(conn, self._snapshot_frame())

    def rank_detail(self, rank: int) -> RankDetail:
        """One rank's full window: step and sample histories, stack, events, meta."""
        return self.monitor.rank_detail(rank)

    def _offer(self, conn: _Conn, data: bytes) -> None:
        t = conn.transport
        if t is None or conn.closing:
            return
        if t.get_write_buffer_size() > self.cfg.viewer_high_water:
            self.counters["snapshots_skipped"] += 1  # a slow viewer gets fewer, never a backlog
            return
        t.write(data)
        self.counters["snapshots_sent"] += 1

    async def _pusher(self) -> None:
        while True:
            await asyncio.sleep(1.0 / MAX_VIEWER_HZ)
            mono = time.monotonic()
            for conn in [c for c in self._conns if c.role == "viewer" and c.rate > 0]:
                if mono >= conn.next_push:
                    try:
                        self._offer(conn, self._snapshot_frame())
                    except Exception:
                        log.exception("rtop hub: could not build a snapshot")
                    conn.next_push = max(conn.next_push + 1.0 / conn.rate, mono)

    # ---- Prometheus ----------------------------------------------------------------------

    def _http(self, conn: _Conn) -> None:
        buf = bytes(conn.http)
        if b"\r\n\r\n" not in buf:
            if len(buf) > HTTP_MAX_BYTES:
                log.warning("rtop hub: oversized HTTP request from %s; closed", conn.who)
                conn.close()
            return
        lines = buf.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        parts = lines[0].split()
        path = parts[1] if len(parts) > 1 else "/"
        auth = ""
        for line in lines[1:]:
            if line.lower().startswith("authorization:"):
                auth = line.split(":", 1)[1].strip()
        presented = auth[7:] if auth.lower().startswith("bearer ") else ""
        if "?token=" in path:
            path, presented = path.split("?token=", 1)
        t = conn.transport
        assert t is not None
        if not hmac.compare_digest(presented.encode(), self._token):
            self.counters["refused"] += 1
            log.warning("rtop hub: HTTP request from %s without the right token; refused",
                        conn.who)
            t.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n"
                    b"Connection: close\r\n\r\n")
        elif path != "/metrics":
            t.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        else:
            from rtop.hub.metrics import prometheus_text

            body = prometheus_text(self.snapshot()).encode()
            t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                    + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body)
        conn.close()


def _raise_fd_limit() -> None:
    """One socket per rank: lift the soft open-file limit to the hard one."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


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
