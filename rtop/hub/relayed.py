"""The hub's side of relays: one connection from a node's relay carries that node's ranks.

A relay (:mod:`rtop.hub.relay`, ``rtop relay``) is a byte multiplexer. Each rank that
connects to it is a **stream**; the relay forwards what the rank sends, as sent, and
the hub answers on the same stream. So every rank's connection is, at the hub, an
ordinary connection object (``server._Conn``) whose transport is a
:class:`RelayedTransport`: the same decoder, handshake (the rank proves itself to the
hub, with the ingest token, and the hub to the rank, through the relay, which never
sees a proof it could reuse), claim of the rank, per-rank ``seq`` and
acknowledgements, pings and clock offsets, actions and their answers, flood limits,
bad frames and losses as a rank that connects directly. Nothing of that is copied here;
only the transport differs.

Wire (``wire.KIND_RELAY`` up, ``wire.KIND_DOWN`` down), once the relay has
authenticated (hello with ``role: relay`` and its ``node``; the ingest token):

* ``relay``: ``open`` (stream ids new since the last frame), ``data`` (a flat list
  ``[sid, bytes, sid, bytes, ...]``: what each stream's rank sent, in order), ``closed``
  and ``reset`` (streams whose rank went, cleanly or not), applied in that order;
* ``down``: ``data`` (the same flat list, what the hub sends each rank), ``close``
  (streams the hub ended: the relay writes what it got for them, then closes them) and
  ``urgent`` (streams whose rank is asked something that waits for its answer: the
  relay sends that answer up at once rather than at its next interval).

**A relay speaks for its own node only.** Its hello names its node; one live relay
holds a node at a time (a second is refused, ``relay_taken``, and the holder is asked
to show it is alive, as a rank is: silent, it is closed and the next try gets in), and
a rank's hello on a relayed stream must name the relay's node, else that stream is
refused (``relay_node``), counted (``relay_foreign``) and logged; the relay's other
streams go on. The node a relay declares is its word, as a rank's identity is a
rank's: any holder of the ingest token may say hello as any rank. What the rule
bounds is what one relay can touch: its own node's ranks, never those of a node whose
relay is up, and never a rank connected elsewhere unless it is that rank's own process
(the ``instance`` secret, as for a direct connection).

When a relay's connection ends, every stream on it ends with it (lost, as a connection
that closes without a goodbye), and the ranks connect again, to a relay or to the hub,
sending again what the hub had not acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from collectors import wire
from rtop.fmt import safe_text
from rtop.run.validate import MAX_NAME, ProtocolError, clean_identity

if TYPE_CHECKING:
    from rtop.hub.server import Hub, _Conn

log = logging.getLogger("rtop.hub")

#: Streams one relay may hold open at once (a node has a few ranks; 8 or 16 usually).
MAX_STREAMS = 1024
#: Down bytes held for one relay before they are sent without waiting for the loop.
DOWN_FLUSH_BYTES = 1 << 20
#: Kinds of the hub's frames that wait for the rank's answer (``urgent`` streams).
URGENT_KINDS = frozenset({b"challenge", b"welcome", b"ping", b"control", b"error"})


def frame_kind(data: bytes) -> bytes:
    """The kind of the frame ``data`` starts with (one the hub encoded itself), read
    without decoding: the body is ``[kind, payload]``, ``kind`` a short string."""
    head = wire.HEADER_BYTES
    if len(data) > head + 1 and data[head] == 0x92 and data[head + 1] & 0xE0 == 0xA0:
        n = data[head + 1] & 0x1F
        return bytes(data[head + 2:head + 2 + n])
    return b""


class RelayedTransport(asyncio.Transport):
    """The transport of one rank's connection that comes through a relay (stream
    ``sid`` of ``link``): writing queues the bytes down to the relay, closing tells the
    relay to close the rank's socket once it has written them."""

    def __init__(self, link: RelayLink, sid: int) -> None:
        super().__init__({"peername": f"relay:{link.node}", "relay": link.conn.who})
        self.link, self.sid = link, sid
        self.conn: _Conn | None = None
        self._closing = False

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """The hub's connection object for this stream."""
        self.conn = protocol  # type: ignore[assignment]

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The hub's connection object for this stream."""
        assert self.conn is not None
        return self.conn

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data`` (one frame, as the hub writes them) for the rank."""
        if not self._closing:
            self.link.down(self.sid, bytes(data))

    def is_closing(self) -> bool:
        """Whether the stream is closed or closing."""
        return self._closing

    def close(self) -> None:
        """End the stream: the relay writes what it got for it, then closes the rank's
        socket; the connection object hears ``connection_lost`` (on the next turn of
        the loop, as with a socket)."""
        if self._closing:
            return
        self._closing = True
        self.link.end(self.sid)
        if self.conn is not None:
            asyncio.get_running_loop().call_soon(self.conn.connection_lost, None)

    def abort(self) -> None:
        """As :meth:`close` (the relay's side decides how the socket ends)."""
        self.close()

    def gone(self, exc: Exception | None) -> None:
        """The rank's side went (its socket closed at the relay, or the relay's
        connection ended): the connection object hears it now."""
        if self._closing:
            return
        self._closing = True
        self.link.streams.pop(self.sid, None)
        if self.conn is not None:
            self.conn.connection_lost(exc)

    def get_write_buffer_size(self) -> int:
        """Bytes queued to the relay (its connection's, shared by its streams)."""
        t = self.link.conn.transport
        return t.get_write_buffer_size() if t is not None else 0

    def pause_reading(self) -> None:  # the relay's connection is read as a whole
        """Nothing: a relay's streams are read with its connection."""

    def resume_reading(self) -> None:
        """Nothing: a relay's streams are read with its connection."""


class RelayLink:
    """One relay's connection (``conn``, authenticated, role ``relay``) for ``node``:
    its streams (the ranks' connection objects) and what waits to go down."""

    def __init__(self, hub: Hub, conn: _Conn, node: str) -> None:
        self.hub, self.conn, self.node = hub, conn, node
        self.streams: dict[int, RelayedTransport] = {}
        self._out: dict[int, bytearray] = {}
        self._out_bytes = 0
        self._close: list[int] = []
        self._urgent: set[int] = set()
        self._scheduled = False
        self.opened = 0  # streams ever opened on this link (ids only grow)
        self.next_ping = time.monotonic() + hub.cfg.ping_every_s

    # -- down ---------------------------------------------------------------------------

    def down(self, sid: int, data: bytes) -> None:
        """Queue ``data`` for stream ``sid``: one ``down`` frame per turn of the loop
        carries what the hub wrote to every stream of this relay meanwhile."""
        buf = self._out.get(sid)
        if buf is None:
            self._out[sid] = bytearray(data)
        else:
            buf += data
        self._out_bytes += len(data)
        if frame_kind(data) in URGENT_KINDS:
            self._urgent.add(sid)
        self._schedule()

    def end(self, sid: int) -> None:
        """The hub ended stream ``sid``."""
        self.streams.pop(sid, None)
        self._close.append(sid)
        self._schedule()

    def _schedule(self) -> None:
        if self._out_bytes >= DOWN_FLUSH_BYTES:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what waits to go down, as one frame."""
        self._scheduled = False
        if not self._out and not self._close:
            return
        data: list[Any] = []
        for sid, buf in self._out.items():
            data += (sid, bytes(buf))
        payload: dict[str, Any] = {"data": data}
        if self._close:
            payload["close"] = self._close
        if self._urgent:
            payload["urgent"] = sorted(self._urgent)
        self._out, self._out_bytes, self._close, self._urgent = {}, 0, [], set()
        self.conn.send(wire.KIND_DOWN, payload)

    # -- up -----------------------------------------------------------------------------

    def open(self, sid: int) -> None:
        """A rank connected to the relay: a connection object of the hub's for it."""
        from rtop.hub.server import _Conn

        if sid in self.streams or sid < self.opened:
            raise ProtocolError(f"stream {sid} opened twice (stream ids only grow)")
        self.opened = sid + 1
        if len(self.streams) >= MAX_STREAMS:
            self.hub.counters["relay_streams_refused"] += 1
            self.hub.peer_log(self.conn.addr, "rtop hub: the relay of %r (%r) holds %d "
                              "streams, its limit; a new one refused", self.node,
                              self.conn.who, MAX_STREAMS)
            self._close.append(sid)
            self._schedule()
            return
        transport = RelayedTransport(self, sid)
        conn = _Conn(self.hub)
        transport.set_protocol(conn)
        self.streams[sid] = transport
        conn.via = self
        conn.connection_made(transport)
        conn.who = f"{self.node}#{sid} via {self.conn.who}"
        self.hub.counters["relay_streams"] += 1

    def gone(self, sid: int, exc: Exception | None) -> None:
        """The rank of stream ``sid`` went at the relay (``exc`` None: cleanly)."""
        transport = self.streams.get(sid)
        if transport is not None:
            transport.gone(exc)

    def lost(self) -> None:
        """The relay's connection ended: so did every stream on it."""
        for transport in list(self.streams.values()):
            transport.gone(ConnectionAbortedError("the relay's connection to the hub "
                                                  "closed"))
        self.streams.clear()
        self._out.clear()
        self._close.clear()

    def speaks_for(self, conn: _Conn, hello: dict[str, Any]) -> bool:
        """May this relay carry the rank that ``hello`` (on its stream ``conn``) names?
        Only a rank of the relay's own node; any other is refused and the stream
        closed. A malformed identity is left to the hub to refuse as it does."""
        try:
            ident = clean_identity(hello.get("identity"))
        except ProtocolError:
            return True
        if ident.hostname == self.node:
            return True
        hub = self.hub
        hub.counters["relay_foreign"] += 1
        hub.peer_log(self.conn.addr, "rtop hub: the relay of node %r (%r) carried rank "
                     "%d of node %r: a relay speaks for its own node's ranks only; that "
                     "stream refused", self.node, self.conn.who, ident.rank,
                     ident.hostname)
        hub.refuse(conn, "relay_node", f"this relay speaks for node "
                                       f"{safe_text(self.node, 60)!r}, not for "
                                       f"{safe_text(ident.hostname, 60)!r}")
        return False


def _sids(p: dict[str, Any], key: str) -> list[int]:
    xs = p.get(key) or []
    if not isinstance(xs, list) or not all(type(x) is int and x >= 0 for x in xs):
        raise ProtocolError(f"relay: {key!r} must be a list of stream ids")
    return xs


class RelayLinks:
    """The hub's relays, by connection and by node (see the module doc)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.by_conn: dict[_Conn, RelayLink] = {}
        self.by_node: dict[str, RelayLink] = {}

    def attach(self, conn: _Conn, hello: dict[str, Any]) -> bool:
        """A relay authenticated with this ``hello``: may it hold its node? If another
        live relay holds it, no (``relay_taken``): that one must show it is alive
        (as a rank's holder must, :meth:`Hub._claim`), else it is closed and the
        newcomer's next try gets in."""
        hub = self.hub
        node = hello.get("node")
        if not isinstance(node, str) or not node or len(node) > MAX_NAME:
            hub.counters["refused"] += 1
            hub.refuse(conn, "node", "a relay's hello names its node (a string of at most "
                                     f"{MAX_NAME} characters)")
            return False
        node = safe_text(node, MAX_NAME)
        old = self.by_node.get(node)
        if old is not None and old.conn is not conn and not old.conn.closing:
            hub.counters["relay_taken"] += 1
            hub.ask_alive(old.conn)
            hub.peer_log(conn.addr, "rtop hub: %r, a relay for node %r, refused: the "
                         "relay %r holds that node", conn.who, node, old.conn.who)
            hub.refuse(conn, "relay_taken", f"a relay for node {safe_text(node, 60)!r} "
                                            "is connected already")
            return False
        link = RelayLink(hub, conn, node)
        self.by_conn[conn] = link
        self.by_node[node] = link
        hub.counters["relays"] += 1
        log.info("rtop hub: relay for node %r connected from %r", node, conn.who)
        return True

    def frame(self, conn: _Conn, frame: wire.Frame) -> None:
        """A frame from a relay's connection (``wire.RELAY_KINDS``)."""
        link = self.by_conn.get(conn)
        if link is None or frame.kind != wire.KIND_RELAY:
            return  # a pong: the connection is alive (its ``last`` moved)
        p = frame.payload
        opens, closed, reset = _sids(p, "open"), _sids(p, "closed"), _sids(p, "reset")
        data = p.get("data") or []
        if not isinstance(data, list) or len(data) % 2:
            raise ProtocolError("relay: 'data' must be a flat list of stream id, bytes")
        for sid in opens:
            link.open(sid)
        streams = link.streams
        for i in range(0, len(data), 2):
            sid, blob = data[i], data[i + 1]
            if type(sid) is not int or not isinstance(blob, bytes):
                raise ProtocolError("relay: 'data' must be a flat list of stream id, bytes")
            transport = streams.get(sid)
            if transport is not None and transport.conn is not None:
                transport.conn.data_received(blob)  # ended by the hub: dropped
        for sid in closed:
            link.gone(sid, None)
        for sid in reset:
            link.gone(sid, ConnectionResetError("the rank's connection to its relay "
                                                "was reset"))

    def lost(self, conn: _Conn) -> None:
        """A relay's connection closed: its streams end with it."""
        link = self.by_conn.pop(conn, None)
        if link is None:
            return
        if self.by_node.get(link.node) is link:
            del self.by_node[link.node]
        n = len(link.streams)
        link.lost()
        log.info("rtop hub: relay for node %r (%r) disconnected; its %d stream%s ended",
                 link.node, conn.who, n, "" if n == 1 else "s")

    def tick(self, mono: float, deaf: bool = False) -> None:
        """Housekeeping: ping each relay now and then (it answers: alive), close one
        silent for the hub's idle timeout (unless the hub does not read them now,
        ``deaf``: the silence is its own)."""
        cfg = self.hub.cfg
        for conn, link in list(self.by_conn.items()):
            if conn.closing:
                continue
            if mono - conn.last > cfg.idle_timeout_s and not deaf:
                log.warning("rtop hub: the relay of node %r (%r) sent nothing for %.0f s; "
                            "closed", link.node, conn.who, cfg.idle_timeout_s)
                conn.close()
            elif mono >= link.next_ping:
                link.next_ping = mono + cfg.ping_every_s
                conn.send(wire.KIND_PING, {"t_hub": time.time(), "seq": 0})

    def count(self) -> int:
        """Relays connected."""
        return len(self.by_conn)
