"""``rtop relay``: one node's ranks over one connection to the job's hub.

A hub holds one connection per rank; past a few thousand ranks its core goes to
per-connection work (a read, a wake-up, a frame header per batch). A relay runs on each
node, takes that node's ranks over loopback, and forwards what they send to the hub over
one connection, merged into one ``relay`` frame per interval (``interval_s``, 0.25 s):
the hub sees one connection and a few frames a second per node, not per GPU.

**A byte multiplexer, nothing more.** Each rank that connects is a *stream*. The relay
never decodes what a rank sends: it forwards the bytes as received (``relay`` frame,
``data``), and writes down to each rank what the hub sends it (``down`` frames). So the
rank's whole conversation is with the hub (:mod:`rtop.hub.relayed`): the rank proves
itself to the hub with the ingest token and the hub proves itself to the rank, through
the relay; the hub claims the rank, counts its batches by ``seq`` and acknowledges them
(an ``ack`` only ever comes from the hub, once it holds the batch), pings it, sends it
actions and takes their answers, exactly as for a rank connected directly. The relay
itself authenticates to the hub as a ``relay`` (the ingest token; its hello names its
node, and the hub lets it carry only that node's ranks).

**It holds no record a rank does not hold.** A rank keeps every batch until the hub
acknowledges it (:mod:`collectors.connection`) and sends it again on its next
connection; the hub drops what it already holds. So when the relay's connection to the
hub breaks (a hub restart, a cut link), the relay closes its ranks' sockets: each rank
sends again, to the relay once it is back on the hub, or to the hub directly, what the
hub had not acknowledged. A relay killed outright loses nothing either: its ranks'
sockets close, and they connect again (to a relay the first of them starts again, or to
the hub). While the hub is out of reach, ranks that connect wait at the relay for it
(each rank's own welcome deadline bounds the wait: then it tries again, and every third
try goes to the hub directly, so a relay that cannot serve never keeps a rank out), and
what they would send stays in their own bounded buffers; at their exit they spool it
as they always do. There is nothing for a relay to spool.

**Bounded.** What the relay reads and has not yet handed to the hub's socket is at most
one interval of its ranks' data, or ``flush_bytes`` (then it is sent at once); when the
hub's socket does not take it (``high_water_bytes`` queued), the relay stops reading its
ranks, and their own buffers hold the rest, as with a slow hub. The kernel's buffers on
the way are capped too (``send_buffer_bytes`` to the hub, ``rank_recv_buffer_bytes``
from each rank), as a rank caps its own: what sits in them is unacknowledged, and a
relay that is slow or stopped must not hold more of a rank's records than the rank
keeps to send again. A stream may hold at
most ``held_bytes`` while the hub is out of reach, a rank's socket at most
``rank_buffer_bytes`` the rank does not read, and the relay ``max_streams`` streams.

**Quick where it matters.** What a rank sends in answer to the hub (the handshake, a
pong, an action's answer: ``urgent`` streams) goes up at once, not at the next interval,
so a clock offset measured through a relay is not skewed by it.

One relay runs per node and job (its discovery file, ``relay-<key>.json`` in the
runtime directory, names its address and the hub it serves). The first rank of a large
job (``collectors.discovery``: a world of ``RTOP_RELAY_MIN_WORLD`` ranks or more) starts
it, as a node's hub is started; it exits ``linger_s`` after its last rank left. A relay
the hub refuses for good (a wrong token, an older hub) leaves ``relay-<key>.off`` saying
why and exits: the node's ranks then connect to the hub directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors import auth, wire
from collectors.discovery import read_hub_file, relay_off_path
from rtop import __version__

log = logging.getLogger("rtop.relay")

#: Refusals after which a relay gives up (the hub will not take it, whatever it tries).
#: (A bad frame is not: a hub that was slow to read may have cut a frame it had half.)
FINAL_REFUSALS = frozenset({"token", "protocol", "role", "node", "forbidden"})


@dataclass
class RelayConfig:
    """How a relay listens for its node's ranks and reaches the job's hub."""

    hub: str  # the hub's host:port
    token: str  # the hub's master or ingest token (only the ingest key is used)
    node: str  # the node this relay speaks for (the ranks' identity hostname)
    job: str = ""
    host: str = "127.0.0.1"  # where the node's ranks connect (loopback)
    port: int = 0
    interval_s: float = 0.25  # what the ranks sent goes up at least this often
    flush_bytes: int = 256 << 10  # ... or as soon as this much waits
    #: queued to the hub beyond this, the ranks are not read: what the hub cannot take
    #: stays with them (bounded there), not here (a node sends ~20 kB/s)
    high_water_bytes: int = 256 << 10
    held_bytes: int = 64 << 10  # what one stream may send before the hub is reached
    #: the kernel's buffers, capped as a rank caps its own send buffer: what the relay
    #: took from a rank (or the rank wrote to it) sits there unacknowledged, and uncapped
    #: they grow to megabytes (tcp_wmem, tcp_rmem) behind a slow or stopped relay, past
    #: what the rank keeps to send again (``max_unsent_bytes``): the hub's socket's send
    #: buffer, and the receive buffer of each rank's socket (0: the kernel's default)
    send_buffer_bytes: int = 256 << 10
    rank_recv_buffer_bytes: int = 128 << 10
    rank_buffer_bytes: int = 4 << 20  # queued to a rank that does not read: closed
    max_streams: int = 1024
    keepalive_s: float = 5.0  # an empty frame when nothing went up for this long
    #: nothing from the hub this long (it pings each rank every 10 s: six missed by every
    #: rank of the node): a connection that died silently, or one whose hub-to-relay
    #: direction waits on TCP's retransmission backoff after a cut link (tens of seconds
    #: of acknowledgements held back: the cut-link fault), so connect again; a hub merely
    #: busy for less is waited for, as ranks wait for it
    hub_silent_s: float = 60.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 2.0
    connect_timeout_s: float = 5.0  # for the hub to take the connection and welcome it
    linger_s: float | None = 60.0  # exit this long after the last rank left (None: never)
    discovery_file: Path | None = None  # where ranks find it (``relay-<key>.json``)


def _cap_buffer(sock: Any, option: int, nbytes: int) -> None:
    """Cap a socket's kernel buffer (``SO_SNDBUF`` or ``SO_RCVBUF``) at ``nbytes``
    (0: leave the kernel's default and its autotuning). Never raises."""
    if nbytes > 0 and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, nbytes)


class _Stream(asyncio.Protocol):
    """One rank's socket at the relay."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.sid = -1
        self.transport: asyncio.Transport | None = None
        self.opened = False  # announced to the hub on the current connection
        self.held = bytearray()  # sent before the hub was reached
        self.fresh = True  # nothing sent up yet: its hello goes at once
        self.urgent = False  # the hub asked something: the answer goes at once
        self.ended = False  # closed by the hub, or by the relay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.relay._open(self)

    def data_received(self, data: bytes) -> None:
        self.relay._up(self, data)

    def eof_received(self) -> bool:
        return False  # close: the hub ends the stream when the rank has said all

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay._gone(self, exc)

    def end(self) -> None:
        """Close the rank's socket (what was written to it goes first)."""
        self.ended = True
        if self.transport is not None:
            self.transport.close()


class _Upstream(asyncio.Protocol):
    """The relay's connection to the hub: the handshake of :mod:`collectors.auth` as a
    ``relay``, then ``relay`` frames up and ``down`` frames down."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.dec = wire.FrameDecoder(wire.UNPROVEN_HUB_FRAME_BYTES)
        self.key = auth.key_for(relay.cfg.token, "ingest") or b""
        self.nonce = auth.new_nonce()
        self.hub_nonce = b""
        self.state = "hello"
        self.last = time.monotonic()
        self.refusal: tuple[str, str] | None = None
        loop = asyncio.get_running_loop()
        self.welcomed: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=self.relay.cfg.high_water_bytes)
        cfg = self.relay.cfg
        _cap_buffer(transport.get_extra_info("socket"), socket.SO_SNDBUF,
                    cfg.send_buffer_bytes)
        self.send(wire.KIND_HELLO, {"role": "relay", "nonce": self.nonce,
                                    "auth": auth.VERSION, "node": cfg.node, "job": cfg.job,
                                    "pid": os.getpid(), "version": __version__})

    def send(self, kind: str, payload: dict[str, Any]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(wire.encode(kind, payload))

    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        try:
            frames = self.dec.feed(data)
        except wire.WireError as exc:
            self._fail(f"a bad frame from the hub: {exc}")
            return
        for frame in frames:
            if self.transport is None or self.transport.is_closing():
                return
            self._frame(frame)

    def _frame(self, frame: wire.Frame) -> None:
        p = frame.payload
        if frame.kind == wire.KIND_ERROR:
            code, message = str(p.get("code"))[:40], str(p.get("message"))[:200]
            self.refusal = (code, message)
            self._fail(f"the hub refused this relay ({code}): {message}")
        elif self.state == "hello":
            nonce = p.get("nonce")
            if frame.kind != wire.KIND_CHALLENGE or not auth.valid_nonce(nonce):
                self._fail(f"the hub answered the hello with {frame.kind[:40]!r}, not a "
                           f"challenge")
                return
            assert isinstance(nonce, bytes)
            self.hub_nonce, self.state = nonce, "auth"
            self.send(wire.KIND_AUTH, {"proof": auth.client_proof(
                self.key, "relay", nonce, self.nonce)})
        elif self.state == "auth":
            if frame.kind != wire.KIND_WELCOME or not auth.check(
                    auth.hub_proof(self.key, "relay", self.nonce, self.hub_nonce),
                    p.get("proof")):
                self._fail("the hub could not prove it holds the token (a wrong token "
                           "here, or not this job's hub)")
                return
            self.state = "up"
            self.dec.max_bytes = wire.MAX_FRAME_BYTES
            self.relay._upstream_up(self)
            if not self.welcomed.done():
                self.welcomed.set_result(None)
        elif frame.kind == wire.KIND_DOWN:
            self.relay._down(p)
        elif frame.kind == wire.KIND_PING:
            self.send(wire.KIND_PONG, {"t_hub": p.get("t_hub"), "seq": p.get("seq"),
                                       "t_rank": time.time()})

    def _fail(self, why: str) -> None:
        log.warning("rtop relay: %s", why)
        if self.transport is not None:
            self.transport.close()

    def pause_writing(self) -> None:
        self.relay._pause(True)

    def resume_writing(self) -> None:
        self.relay._pause(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay._upstream_lost(self)
        for fut in (self.welcomed, self.done):
            if not fut.done():
                fut.set_result(None)


class Relay:
    """One node's relay (see the module doc). ``await relay.start()`` (it listens and
    starts reaching the hub), then ``relay.address``; ``await relay.close()``.
    Several may run on one event loop (a benchmark's simulated nodes), each with its
    own listening socket and its own connection to the hub."""

    def __init__(self, cfg: RelayConfig) -> None:
        if auth.key_for(cfg.token, "ingest") is None:
            raise ValueError("a relay needs the hub's master or ingest token")
        wire.parse_address(cfg.hub)  # a ValueError that names it
        self.cfg = cfg
        self.address = ""
        self.streams: dict[int, _Stream] = {}
        self._next_sid = 0
        self._server: asyncio.base_events.Server | None = None
        self._up_conn: _Upstream | None = None  # once welcomed by the hub
        self._opens: list[int] = []
        self._data: dict[int, bytearray] = {}
        self._closed: list[int] = []
        self._reset: list[int] = []
        self._pending = 0
        self._soon: asyncio.Handle | None = None
        self._paused = False
        self._last_sent = time.monotonic()
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False
        self.closed = asyncio.Event()
        self.refused: tuple[str, str] | None = None  # why the hub refused it for good
        self.counters = {"streams": 0, "streams_refused": 0, "frames_up": 0,
                         "bytes_up": 0, "frames_down": 0, "hub_connects": 0,
                         "hub_losses": 0, "held_overflow": 0, "slow_ranks": 0}

    @property
    def up(self) -> bool:
        """Whether the hub has welcomed this relay (ranks' bytes flow)."""
        return self._up_conn is not None

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Listen for the node's ranks, write the discovery file, reach the hub."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Stream(self), self.cfg.host,
                                                self.cfg.port, backlog=1024,
                                                start_serving=False)
        for sock in self._server.sockets:  # the ranks' sockets get it from the listener
            _cap_buffer(sock, socket.SO_RCVBUF, self.cfg.rank_recv_buffer_bytes)
        await self._server.start_serving()
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"
        if self.cfg.discovery_file is not None:
            from rtop.hub.server import write_hub_file

            write_hub_file(self.cfg.discovery_file, {
                "address": self.address, "pid": os.getpid(), "hub": self.cfg.hub,
                "node": self.cfg.node, "job": self.cfg.job, "started": time.time()})
        self._tasks = [loop.create_task(self._keep_upstream()),
                       loop.create_task(self._flusher())]
        log.info("rtop relay for node %r listening on %s, for the hub at %s",
                 self.cfg.node, self.address, self.cfg.hub)

    async def close(self) -> None:
        """Stop: close the ranks' sockets (they send again elsewhere what the hub had
        not acknowledged), the hub's connection, and remove the discovery file."""
        if self._closing:
            await self.closed.wait()
            return
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        self.flush()  # what the ranks sent reaches the hub before their sockets close
        for stream in list(self.streams.values()):
            stream.end()
        up = self._up_conn
        if up is not None and up.transport is not None:
            up.transport.close()
        await asyncio.sleep(0)
        self._remove_file()
        self.closed.set()

    def _remove_file(self) -> None:
        path = self.cfg.discovery_file
        if path is None:
            return
        info = read_hub_file(path)
        if info is None or info.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                path.unlink()

    async def _keep_upstream(self) -> None:
        """Connect to the hub, and again whenever the connection ends (with backoff);
        give up when the hub refuses this relay for good."""
        loop = asyncio.get_running_loop()
        host, port = wire.parse_address(self.cfg.hub)
        backoff = self.cfg.backoff_initial_s
        while True:
            conn: _Upstream | None = None
            try:
                _, proto = await asyncio.wait_for(loop.create_connection(
                    lambda: _Upstream(self), host, port), self.cfg.connect_timeout_s)
                conn = proto
                await asyncio.wait_for(asyncio.shield(conn.welcomed),
                                       self.cfg.connect_timeout_s)
                backoff = self.cfg.backoff_initial_s
                await conn.done
            except (OSError, asyncio.TimeoutError) as exc:
                log.info("rtop relay: the hub at %s is not reachable (%s); retrying",
                         self.cfg.hub, exc)
            finally:
                if conn is not None and conn.transport is not None:
                    conn.transport.close()
            if conn is not None and conn.refusal is not None:
                code, message = conn.refusal
                if code in FINAL_REFUSALS:
                    self.refused = conn.refusal
                    self._give_up(f"the hub refused this relay ({code}): {message}")
                    return
                backoff = self.cfg.backoff_max_s  # e.g. relay_taken: the holder may be dead
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self.cfg.backoff_max_s)

    def _give_up(self, why: str) -> None:
        """The hub will not take this relay: say so where the ranks look (they connect
        to the hub directly then), and exit."""
        log.warning("rtop relay: %s; exiting (the node's ranks connect to the hub "
                    "directly)", why)
        path = self.cfg.discovery_file
        if path is not None:
            from rtop.hub.server import write_hub_file

            with contextlib.suppress(OSError):
                write_hub_file(relay_off_path(path), {"why": why, "t": time.time(),
                                                      "pid": os.getpid()})
        asyncio.get_running_loop().create_task(self.close())

    async def _flusher(self) -> None:
        """Send what the ranks sent every interval; a keepalive when idle; exit after
        ``linger_s`` without a rank."""
        cfg = self.cfg
        empty_since = time.monotonic()
        # the hub speaks to a relay through its ranks (pings, acks): silence counts only
        # while the relay has ranks, from when it last had none
        heard_floor = empty_since
        # each relay at its own phase of the interval: relays started together (a job's
        # nodes, a benchmark's) would otherwise reach the hub in bursts, all at once
        await asyncio.sleep(random.uniform(0, cfg.interval_s))
        while True:
            await asyncio.sleep(cfg.interval_s)
            now = time.monotonic()
            up = self._up_conn
            if not self.streams:
                heard_floor = now
            if up is not None and now - max(up.last, heard_floor) > cfg.hub_silent_s:
                log.warning("rtop relay: nothing from the hub for %.0f s; connecting "
                            "again", cfg.hub_silent_s)
                if up.transport is not None:
                    up.transport.close()
            self.flush(keepalive=now - self._last_sent > cfg.keepalive_s)
            if self.streams:
                empty_since = now
            elif cfg.linger_s is not None and now - empty_since > cfg.linger_s:
                log.info("rtop relay: no rank for %.0f s; exiting", cfg.linger_s)
                asyncio.get_running_loop().create_task(self.close())
                return

    # ---- the ranks' side -------------------------------------------------------------

    def _open(self, stream: _Stream) -> None:
        if self._closing or len(self.streams) >= self.cfg.max_streams:
            self.counters["streams_refused"] += 1
            stream.end()
            return
        stream.sid = self._next_sid
        self._next_sid += 1
        self.streams[stream.sid] = stream
        self.counters["streams"] += 1
        if self._paused and stream.transport is not None:
            stream.transport.pause_reading()
        if self.up:
            stream.opened = True
            self._opens.append(stream.sid)

    def _up(self, stream: _Stream, data: bytes) -> None:
        if stream.ended:
            return
        if not stream.opened:  # the hub is not reached yet: held, within a bound
            stream.held += data
            if len(stream.held) > self.cfg.held_bytes:
                self.counters["held_overflow"] += 1
                stream.end()
            return
        buf = self._data.get(stream.sid)
        if buf is None:
            self._data[stream.sid] = bytearray(data)
        else:
            buf += data
        self._pending += len(data)
        if stream.fresh or stream.urgent:
            stream.fresh = stream.urgent = False
            self._flush_soon()
        if self._pending >= self.cfg.flush_bytes:
            self.flush()

    def _gone(self, stream: _Stream, exc: Exception | None) -> None:
        if self.streams.get(stream.sid) is not stream:
            return
        del self.streams[stream.sid]
        if stream.opened and not stream.ended and self.up:
            (self._closed if exc is None else self._reset).append(stream.sid)
            self._flush_soon()

    def _flush_soon(self) -> None:
        """Flush on the next turn of the loop: what arrives together goes together."""
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self.flush)

    def _pause(self, paused: bool) -> None:
        """The hub's socket is full (or has room again): stop (resume) reading ranks."""
        self._paused = paused
        for stream in self.streams.values():
            t = stream.transport
            if t is not None and not t.is_closing():
                if paused:
                    t.pause_reading()
                else:
                    t.resume_reading()

    # ---- the hub's side --------------------------------------------------------------

    def flush(self, keepalive: bool = False) -> None:
        """Send the hub, in one frame, what the ranks sent since the last one."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        up = self._up_conn
        if up is None or not (self._opens or self._data or self._closed or self._reset
                              or keepalive):
            return
        payload: dict[str, Any] = {}
        if self._opens:
            payload["open"] = self._opens
        if self._data:
            data: list[Any] = []
            for sid, buf in self._data.items():
                data += (sid, bytes(buf))
            payload["data"] = data
        if self._closed:
            payload["closed"] = self._closed
        if self._reset:
            payload["reset"] = self._reset
        frame = wire.encode(wire.KIND_RELAY, payload)
        self._opens, self._data, self._closed, self._reset = [], {}, [], []
        self._pending = 0
        if up.transport is not None and not up.transport.is_closing():
            up.transport.write(frame)
        self._last_sent = time.monotonic()
        self.counters["frames_up"] += 1
        self.counters["bytes_up"] += len(frame)

    def _upstream_up(self, conn: _Upstream) -> None:
        """The hub welcomed this relay: the ranks waiting for it go through."""
        self._up_conn = conn
        self.counters["hub_connects"] += 1
        log.info("rtop relay: connected to the hub at %s", self.cfg.hub)
        for stream in list(self.streams.values()):
            if stream.ended or stream.opened:
                continue
            stream.opened = True
            self._opens.append(stream.sid)
            if stream.held:
                self._data[stream.sid] = stream.held
                self._pending += len(stream.held)
                stream.held = bytearray()
        self.flush()

    def _upstream_lost(self, conn: _Upstream) -> None:
        """The hub's connection ended: every stream on it ends too (its rank sends again
        what the hub had not acknowledged, on its next connection)."""
        if self._up_conn is not conn:
            return
        self._up_conn = None
        self.counters["hub_losses"] += 1
        if not self._closing:
            log.warning("rtop relay: lost the hub at %s; closing the %d rank connection%s "
                        "(they send again what it had not acknowledged)", self.cfg.hub,
                        len(self.streams), "" if len(self.streams) == 1 else "s")
        self._opens, self._data, self._closed, self._reset = [], {}, [], []
        self._pending = 0
        for stream in list(self.streams.values()):
            if stream.opened:
                del self.streams[stream.sid]
                stream.end()
        if self._paused:
            self._pause(False)

    def _down(self, p: dict[str, Any]) -> None:
        """What the hub sends the ranks."""
        self.counters["frames_down"] += 1
        data = p.get("data") or []
        if not isinstance(data, list):
            return
        urgent = p.get("urgent") or []
        for sid in urgent if isinstance(urgent, list) else []:
            stream = self.streams.get(sid) if type(sid) is int else None
            if stream is not None:
                stream.urgent = True
        for i in range(0, len(data) - 1, 2):
            sid, blob = data[i], data[i + 1]
            stream = self.streams.get(sid) if type(sid) is int else None
            if stream is None or not isinstance(blob, bytes):
                continue
            t = stream.transport
            if t is None or t.is_closing():
                continue
            t.write(blob)
            if t.get_write_buffer_size() > self.cfg.rank_buffer_bytes:
                self.counters["slow_ranks"] += 1
                self._end(stream, closed_by_hub=False)
        close = p.get("close") or []
        for sid in close if isinstance(close, list) else []:
            stream = self.streams.get(sid) if type(sid) is int else None
            if stream is not None:
                self._end(stream, closed_by_hub=True)

    def _end(self, stream: _Stream, closed_by_hub: bool) -> None:
        """Close a rank's socket; unless the hub ended the stream, tell it."""
        self.streams.pop(stream.sid, None)
        if not closed_by_hub and stream.opened and self.up:
            self._reset.append(stream.sid)
            self._flush_soon()
        stream.end()


async def serve(cfg: RelayConfig, ready: Callable[[Relay], None] | None = None) -> int:
    """Run a relay until it exits by itself (no rank for ``linger_s``, refused by the
    hub) or a signal comes. Returns an exit status: 0, or 2 when the hub refused it."""
    relay = Relay(cfg)
    await relay.start()
    if ready is not None:
        ready(relay)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, lambda: loop.create_task(relay.close()))
    try:
        await relay.closed.wait()
    finally:
        await relay.close()
    return 2 if relay.refused is not None else 0


class ThreadedRelay:
    """A relay on a daemon thread with its own event loop (the Ray relay actor's):
    ``start()`` returns once it listens (``address`` set); ``on_exit`` is called when it
    ends by itself (no rank for ``linger_s``, refused by the hub)."""

    def __init__(self, cfg: RelayConfig, on_exit: Callable[[], None] | None = None) -> None:
        import threading

        self.cfg = cfg
        self.relay: Relay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._on_exit = on_exit
        self._thread = threading.Thread(target=self._run, name="rtop-relay", daemon=True)

    @property
    def address(self) -> str:
        """``host:port`` the relay listens on, for the node's ranks."""
        return self.relay.address if self.relay is not None else ""

    def start(self, timeout: float = 10.0) -> ThreadedRelay:
        """Start the thread; return once the relay listens."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the relay did not start")
        if self._error is not None:
            raise RuntimeError(f"the relay failed to start: {self._error}") from self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def main() -> None:
            self.relay = Relay(self.cfg)
            try:
                await self.relay.start()
            finally:
                self._ready.set()
            await self.relay.closed.wait()

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()
        if self._on_exit is not None:
            self._on_exit()

    def stop(self, timeout: float = 5.0) -> None:
        """Close the relay (its ranks connect again elsewhere) and join its thread."""
        relay, loop = self.relay, self._loop
        if relay is not None and loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(relay.close()))
        self._thread.join(timeout)
