"""The rank's connection to its hub: one non-blocking socket and its state machine.

:class:`HubConnection` runs on the sender thread and never blocks it for long. It

* connects when due (the hub found through :mod:`collectors.discovery`), says hello
  with a fresh nonce, answers the hub's challenge with its proof, and waits for the
  welcome, which must carry the hub's proof that it holds the token too
  (:mod:`collectors.auth`; ``DOWN`` → ``HELLO`` → ``AUTH`` → ``UP``). No token is ever
  sent. A hub that cannot prove itself gets nothing more: the socket is closed (logged
  once) and the rank retries later. The hello carries this process's ``instance``, a
  random secret: a rank whose side saw a connection break before the hub did takes its
  place back at once (the hub refuses anyone else who claims a connected rank);
* reads small frames only: ``wire.UNPROVEN_HUB_FRAME_BYTES`` before the hub has proved
  itself, ``wire.RANK_FRAME_BYTES`` after, decoded with msgpack's limits; anything
  bigger closes the connection (logged once), so a hostile listener on the hub's port
  cannot make the training process allocate;
* answers a ping with a pong at once, and on a refusal (an ``error`` frame), a lost
  connection or a hello left unanswered closes the socket and retries with jittered
  exponential backoff (a refusal waits the longest);
* keeps batch frames in an outbox until they can be written, dropping the oldest
  (and counting their records) beyond ``backlog_frames`` frames or
  ``max_unsent_bytes`` bytes; writes them whole through partial writes;
* keeps each batch frame written until the hub acknowledges it (``ack``: the hub has
  recorded and flushed every batch up to that ``seq``; applied, for a hub that does not
  record or whose recording failed), so a connection that breaks
  loses nothing that sat in a socket buffer or in a hub killed before it flushed: on a
  reconnect the frames not acknowledged are sent again first (the hub ignores a batch
  whose ``seq`` it already holds), then the ones not started. At most
  ``max_unsent_bytes`` of them are kept; beyond that the oldest are let go unconfirmed
  (``unconfirmed_records``: most of them did arrive);
* in a large job, connects through its node's relay (:mod:`collectors.discovery`), a
  byte multiplexer: the conversation above is the same, with the hub. Every third try
  in a row that did not get in (a relay that cannot reach the hub, or is stuck) goes to
  the hub directly, so a relay never keeps a rank out;
* on :meth:`finish`, sends what it can before a deadline, then a ``bye``; what no hub
  took by then (and the ``bye``) goes to the rank's spool file (:mod:`collectors.spool`)
  for a later hub or ``rtop report``, unless ``spool`` is off.

Control frames (``wire.KIND_CONTROL``, commands for the rank from the hub) arrive here:
only once the hub has proved itself and welcomed the rank (state ``UP``) are they
handed to the ``on_control`` callback when one is given; else ignored, as every other
frame kind this collector does not know.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import random
import secrets
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collectors import auth, wire
from collectors.config import ProbeConfig
from collectors.discovery import HubAddress, resolve
from collectors.identity import Identity
from collectors.logonce import LogOnce
from collectors.spool import SpoolResult, write_spool

log = logging.getLogger("collectors")

RECV_BYTES = 65536
#: Characters of what a hub sent (an error message, a frame kind) that are logged.
LOG_CHARS = 120
#: Frames moved from the outbox to the socket's write queue at a time.
WRITE_QUEUE_FRAMES = 8

#: Called with each control frame from the hub (see :class:`HubConnection`).
ControlHandler = Callable[[wire.Frame], None]
#: Finds the hub: ``allow_spawn`` -> ``(host, port, token)`` or None (not found yet).
Resolver = Callable[[bool], "HubAddress | None"]


class ConnState(enum.Enum):
    """Where the connection to the hub stands."""

    DOWN = "down"  # no socket: waiting for the next connect attempt
    HELLO = "hello"  # connected, hello sent, waiting for the hub's challenge
    AUTH = "auth"  # our proof sent, waiting for the welcome and the hub's proof in it
    UP = "up"  # welcomed: batches flow


class HubConnection:
    """One rank's connection to its hub (see the module doc). Sender thread only.

    ``collector_info`` gives the ``collector`` part of each hello; ``on_connect`` is
    called whenever a new socket is opened (before the welcome); ``on_control``, when
    given, is called on the sender thread with every ``control`` frame from a hub that
    has proved itself and welcomed this rank: it must return quickly, and an exception
    from it is logged once and otherwise ignored. ``resolve`` replaces discovery
    (tests); by default the configured hub, else a discovered one. The token (master
    or ingest) is used as the key of the handshake, never sent.
    """

    def __init__(
        self,
        config: ProbeConfig,
        identity: Identity,
        *,
        collector_info: Callable[[], dict[str, Any]] = dict,
        on_connect: Callable[[], None] | None = None,
        on_control: ControlHandler | None = None,
        resolve: Resolver | None = None,
    ) -> None:
        self._cfg = config
        self._identity = identity
        self._collector_info = collector_info
        self._on_connect = on_connect
        self.on_control = on_control
        self._resolve = resolve
        self._once = LogOnce()
        self._sock: socket.socket | None = None
        self.state = ConnState.DOWN
        self._hello_deadline = 0.0
        self._decoder = wire.FrameDecoder(wire.UNPROVEN_HUB_FRAME_BYTES)
        self._key: bytes | None = None  # this connection's handshake key (ingest role)
        self._nonce = b""  # this connection's nonce
        self._hub_nonce = b""  # the hub's, from its challenge
        #: this rank process's secret: lets it take its own place back at the hub
        self._instance = secrets.token_bytes(auth.NONCE_BYTES)
        self._peer = ""  # host:port of the hub this socket goes to
        #: encoded batch frames not yet started: (frame, records, seq)
        self._outbox: deque[tuple[bytes, int, int]] = deque()
        self._outbox_bytes = 0
        #: [memoryview, records, seq] being written
        self._writing: deque[list[Any]] = deque()
        #: batch frames written, not yet acknowledged by the hub: (seq, frame, records)
        self._inflight: deque[tuple[int, bytes, int]] = deque()
        self._inflight_bytes = 0
        self._next_connect = 0.0
        self._backoff = config.backoff_initial_s
        self._finishing = False
        self._hub_known = False  # a hub was found (configured or discovered), reachable or not
        #: tries in a row that did not get in (welcomed); every third goes to the hub
        #: directly rather than through the node's relay
        self._misses = 0
        self._welcomed = False  # this socket got in
        #: The welcome's payload (the hub's clock and facts), once welcomed.
        self.hub_info: dict[str, Any] = {}
        # counters (monotonic; read from other threads without locking)
        self.sent_records = 0
        self.sent_frames = 0
        self.dropped_unsent = 0
        #: records written but let go before the hub confirmed them (beyond the bound)
        self.unconfirmed_records = 0
        #: batch frames sent again on a new connection (not acknowledged on the old one)
        self.resent_frames = 0
        self.connects = 0
        self.connect_failures = 0
        self.refusals = 0
        #: hubs that answered without proving they hold the token (or spoke out of turn)
        self.unproven_hubs = 0
        #: records written to the spool file at the end, and records it left out
        self.spooled_records = 0
        self.spool_dropped = 0
        #: what writing the spool did (:mod:`collectors.spool`), once it was written
        self.spool: SpoolResult | None = None

    # ---- what the sender asks -----------------------------------------------------

    @property
    def socket(self) -> socket.socket | None:
        """The socket while one is open (to wait on it with ``select``), else None."""
        return self._sock

    @property
    def wants_write(self) -> bool:
        """Whether a write is waiting for the socket to accept more bytes."""
        return bool(self._writing) and self.state is ConnState.UP

    @property
    def unsent_bytes(self) -> int:
        """Bytes of encoded frames not yet written: the outbox and the write queue."""
        return self._outbox_bytes + sum(len(w[0]) for w in self._writing)

    @property
    def unacked_frames(self) -> int:
        """Batch frames written and kept until the hub acknowledges them."""
        return len(self._inflight)

    @property
    def queued_frames(self) -> int:
        """Batch frames in the outbox, not yet started."""
        return len(self._outbox)

    def stats(self) -> dict[str, int]:
        """Counters of this connection."""
        return {
            "sent_records": self.sent_records,
            "sent_frames": self.sent_frames,
            "dropped_unsent": self.dropped_unsent,
            "unconfirmed_records": self.unconfirmed_records,
            "resent_frames": self.resent_frames,
            "connects": self.connects,
            "connect_failures": self.connect_failures,
            "refusals": self.refusals,
            "unproven_hubs": self.unproven_hubs,
            "spooled_records": self.spooled_records,
            "spool_dropped": self.spool_dropped,
            "connected": int(self.state is ConnState.UP),
        }

    def send(self, frame: bytes, records: int, seq: int = 0) -> None:
        """Queue an encoded batch frame holding ``records`` records, with the batch's
        ``seq`` (what the hub acknowledges; 0: none, never kept for an ack).

        Beyond ``backlog_frames`` queued frames, or ``max_unsent_bytes`` bytes not yet
        written, the oldest queued frames are dropped and their records counted.
        """
        self._outbox.append((frame, records, seq))
        self._outbox_bytes += len(frame)
        max_frames, max_bytes = self._cfg.backlog_frames, self._cfg.max_unsent_bytes
        while self._outbox and (len(self._outbox) > max_frames
                                or self.unsent_bytes > max_bytes):
            old, lost, _ = self._outbox.popleft()
            self._outbox_bytes -= len(old)
            self.dropped_unsent += lost

    def pump(self, now: float) -> None:
        """Connect when due, read what the hub sent, write what is waiting."""
        if self._sock is None:
            if now < self._next_connect:
                return
            self._connect(now, self._cfg.connect_timeout_s)
        self._service(now)

    def finish(self, deadline: float, bye: Callable[[], dict[str, Any]]) -> None:
        """Send what can be sent before ``deadline`` (monotonic), then ``bye()``'s frame.

        One last connect attempt if there is no connection (an existing hub only: none
        is started now). What is still unsent at the deadline is written to the spool
        (within ``spool_timeout_s`` and ``spool_max_bytes``), or, with ``spool`` off,
        beyond those bounds, or when no hub was ever found (none configured, none
        discovered: nobody to spool for), dropped and counted.
        """
        self._finishing = True
        bye_queued = False
        if self._sock is None and deadline > time.monotonic():
            self._connect(time.monotonic(), min(self._cfg.connect_timeout_s,
                                                deadline - time.monotonic()))
        while self._sock is not None:
            now = time.monotonic()
            if now >= deadline:
                break
            if self.state is ConnState.UP and not self._outbox and not self._writing \
                    and not bye_queued:
                self._queue_control(wire.KIND_BYE, bye())
                bye_queued = True
            self._service(now)
            # done when the bye is written and the hub has acknowledged every batch
            if self._sock is None or (bye_queued and not self._writing
                                      and not self._inflight):
                break
            select.select([self._sock], [self._sock] if self._writing else [], [],
                          min(0.05, max(0.0, deadline - now)))
        # what no hub took: batches the hub did not acknowledge, then those not yet
        # handed whole to the socket (a frame cut mid-write is whole here: the hub never
        # applies half a frame), oldest first. An acknowledging hub that got some of
        # them after all ignores them when it takes the spool (it holds their seq).
        unsent = [(f, n) for _, f, n in self._inflight]
        unsent += [(bytes(w[0].obj), int(w[1])) for w in self._writing if w[1]]
        unsent += [(f, n) for f, n, _ in self._outbox]
        self._outbox.clear()
        self._outbox_bytes = 0
        self._writing.clear()
        self._inflight.clear()
        self._inflight_bytes = 0
        records = sum(n for _, n in unsent)
        if records and self._cfg.spool and self._hub_known:
            self._spool(unsent, bye)
        else:
            self.dropped_unsent += records

    def _spool(self, unsent: list[tuple[bytes, int]], bye: Callable[[], dict[str, Any]]
               ) -> None:
        """Write what no hub took to this rank's spool file (:mod:`collectors.spool`),
        with the bye the hub never got; what the spool leaves out is counted as
        dropped. Never raises."""
        records = sum(n for _, n in unsent)
        try:
            last_words: dict[str, Any] | None = bye()
        except Exception:
            last_words = None
        cfg = self._cfg
        result = write_spool(
            self._identity, unsent, self._hello(with_nonce=False), last_words,
            max_bytes=cfg.spool_max_bytes, timeout_s=cfg.spool_timeout_s,
            directory=Path(cfg.spool_dir) if cfg.spool_dir else None)
        self.spool = result
        self.spooled_records += result.records
        self.spool_dropped += result.dropped_records
        self.dropped_unsent += result.dropped_records
        if result.error is not None:
            log.warning("rtop: no hub took this rank's last %d records and they could not "
                        "be spooled (%s); dropped and counted", records,
                        _short(result.error))
        else:
            log.warning("rtop: no hub took this rank's last %d records: %d spooled to %s "
                        "in %.3f s (%d dropped), for a later hub or `rtop report`",
                        records, result.records, result.path, result.seconds,
                        result.dropped_records)

    def close(self) -> None:
        """Close the socket (frames not yet started stay queued)."""
        self._close_socket()

    # ---- connecting ---------------------------------------------------------------

    def _find_hub(self) -> HubAddress | None:
        """The hub to connect to. While finishing, only an existing hub is looked up."""
        allow_spawn = not self._finishing
        if self._resolve is not None:
            return self._resolve(allow_spawn)
        return resolve(self._identity, self._cfg.hub, self._cfg.token, allow_spawn=allow_spawn,
                       relay=self._misses % 3 != 2)

    def _connect(self, now: float, timeout: float) -> None:
        try:
            target = self._find_hub()
        except Exception as exc:
            self._once("hub-addr", logging.WARNING, "rtop: no usable hub address: %s", exc)
            target = None
        if target is None:
            self._next_connect = now + self._cfg.backoff_max_s
            return
        self._hub_known = True
        host, port, token = target
        key = auth.key_for(token, "ingest")
        if key is None:
            self.connect_failures += 1
            self._once(f"no-token-{host}:{port}", logging.WARNING,
                       "rtop: no token that can send to the hub at %s:%s (set RTOP_TOKEN "
                       "to its token or ingest token); training continues", host, port)
            self._next_connect = now + self._cfg.backoff_max_s
            return
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            self.connect_failures += 1
            self._misses += 1
            self._once(
                f"connect-{host}:{port}", logging.INFO,
                "rtop: hub %s:%s not reachable (%s); training continues, retrying", host, port,
                exc.strerror or exc,
            )
            self._schedule_retry(now)
            return
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._cfg.send_buffer_bytes > 0:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                self._cfg.send_buffer_bytes)
        self._sock = sock
        self._welcomed = False
        self._decoder = wire.FrameDecoder(wire.UNPROVEN_HUB_FRAME_BYTES)
        self._key, self._nonce, self._peer = key, auth.new_nonce(), f"{host}:{port}"
        self.state = ConnState.HELLO
        self._hello_deadline = now + self._cfg.welcome_timeout_s
        if self._on_connect is not None:
            self._on_connect()
        self._writing.appendleft([memoryview(wire.encode(wire.KIND_HELLO, self._hello())),
                                  0, 0])

    def _hello(self, with_nonce: bool = True) -> dict[str, Any]:
        """This rank's hello (with this connection's nonce for a hub; without, for
        the spool)."""
        hello: dict[str, Any] = {"role": "rank"}
        if with_nonce:
            hello.update(nonce=self._nonce, auth=auth.VERSION, instance=self._instance)
        hello.update({
            "identity": self._identity.to_wire(),
            "clock": {"t_wall": time.time(), "t_mono": time.monotonic()},
            "collector": self._collector_info(),
        })
        return hello

    def _schedule_retry(self, now: float) -> None:
        jitter = 0.8 + 0.4 * random.random()
        self._next_connect = now + self._backoff * jitter
        self._backoff = min(self._backoff * 2.0, self._cfg.backoff_max_s)

    def _close_socket(self, requeue: bool = True) -> None:
        sock, self._sock = self._sock, None
        if sock is not None and not self._welcomed:
            self._misses += 1
        self.state = ConnState.DOWN
        self._key = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        # Every batch the hub did not acknowledge goes back to the outbox, whole, in
        # order (the hub ignores those it holds), a frame cut mid-write included.
        while self._writing:
            view, n, seq = self._writing.pop()
            if n and requeue:
                frame = bytes(view.obj)
                self._outbox.appendleft((frame, n, seq))
                self._outbox_bytes += len(frame)
            elif n:
                self.dropped_unsent += n
        while self._inflight:
            seq, frame, n = self._inflight.pop()
            if requeue:
                self._outbox.appendleft((frame, n, seq))
                self._outbox_bytes += len(frame)
                self.resent_frames += 1
            else:
                self.dropped_unsent += n
        self._inflight_bytes = 0

    def _lost(self, now: float, why: str, key: str | None = None) -> None:
        self._once(f"lost-{key or why}", logging.INFO, "rtop: %s; training continues, "
                   "retrying", why)
        self._close_socket()
        self._schedule_retry(now)

    def _distrust(self, now: float, why: str, *args: Any) -> None:
        """The peer is not a hub that proved itself: close, log once, wait the longest."""
        self.unproven_hubs += 1
        self._once(f"unproven-{self._peer}", logging.WARNING,
                   "rtop: the hub at %s " + why + "; nothing more sent to it, retrying",
                   self._peer, *args)
        self._close_socket()
        self._backoff = self._cfg.backoff_max_s
        self._schedule_retry(now)

    # ---- reading and writing ------------------------------------------------------

    def _service(self, now: float) -> None:
        if self._sock is None:
            return
        if self.state in (ConnState.HELLO, ConnState.AUTH) and now > self._hello_deadline:
            self._once("welcome", logging.WARNING, "rtop: hub did not answer the hello; retrying")
            self._close_socket()
            self._schedule_retry(now)
            return
        if not self._read(now):
            return
        if self.state is ConnState.UP:
            while self._outbox and len(self._writing) < WRITE_QUEUE_FRAMES:
                frame, n, seq = self._outbox.popleft()
                self._outbox_bytes -= len(frame)
                self._writing.append([memoryview(frame), n, seq])
        self._write(now)

    def _read(self, now: float) -> bool:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                data = sock.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:
                self._lost(now, f"connection error: {exc}")
                return False
            if not data:
                self._lost(now, "hub closed the connection")
                return False
            try:
                frames = self._decoder.feed(data)
            except wire.WireError as exc:
                if self.state in (ConnState.HELLO, ConnState.AUTH):  # hub not proven
                    self._distrust(now, "sent a bad frame before proving itself (%s)",
                                   _short(str(exc)))
                else:
                    self._lost(now, f"bad frame from the hub at {self._peer}: "
                                    f"{_short(str(exc))}", key="bad-frame")
                return False
            for frame in frames:
                self._on_frame(now, frame)
                if self._sock is None:
                    return False

    def _on_frame(self, now: float, frame: wire.Frame) -> None:
        if frame.kind == wire.KIND_ERROR:
            self.refusals += 1
            code = _short(str(frame.payload.get("code")), 24)
            self._once(
                f"refused-{code}", logging.WARNING, "rtop: hub refused this rank: %s",
                _short(str(frame.payload.get("message", "no reason"))),
            )
            self._close_socket()
            self._backoff = self._cfg.backoff_max_s
            self._schedule_retry(now)
        elif self.state is ConnState.HELLO:
            self._on_challenge(now, frame)
        elif self.state is ConnState.AUTH:
            self._on_welcome(now, frame)
        else:
            self._on_hub_frame(frame)

    def _on_challenge(self, now: float, frame: wire.Frame) -> None:
        """The hub's first answer: its nonce. This rank proves itself first; the hub
        proves itself in its welcome (:meth:`_on_welcome`)."""
        if frame.kind != wire.KIND_CHALLENGE:
            self._distrust(now, "answered the hello with %r, not a challenge (an older "
                           "hub, or not a hub)", _short(frame.kind, 40))
            return
        key, hub_nonce = self._key, frame.payload.get("nonce")
        assert key is not None
        if not isinstance(hub_nonce, bytes) or not auth.valid_nonce(hub_nonce):
            self._distrust(now, "sent a challenge without a valid nonce")
            return
        self._hub_nonce = hub_nonce
        self.state = ConnState.AUTH
        self._queue_control(wire.KIND_AUTH, {
            "proof": auth.client_proof(key, "rank", hub_nonce, self._nonce)})

    def _on_welcome(self, now: float, frame: wire.Frame) -> None:
        """The welcome must carry the hub's proof that it holds the token too."""
        key = self._key
        assert key is not None
        if frame.kind != wire.KIND_WELCOME:
            return  # nothing else is expected before the welcome; ignored
        if not auth.check(auth.hub_proof(key, "rank", self._nonce, self._hub_nonce),
                          frame.payload.get("proof")):
            self._distrust(now, "could not prove it holds this rank's token (a wrong "
                           "RTOP_TOKEN here, or not this job's hub)")
            return
        self._decoder.max_bytes = wire.RANK_FRAME_BYTES
        self.state = ConnState.UP
        self._welcomed, self._misses = True, 0
        self.connects += 1
        self._backoff = self._cfg.backoff_initial_s
        self.hub_info.update({k: v for k, v in frame.payload.items() if k != "proof"})
        log.debug("rtop: connected to hub")

    def _on_hub_frame(self, frame: wire.Frame) -> None:
        """A frame from a hub that proved itself and welcomed this rank (state UP)."""
        if frame.kind == wire.KIND_PING:
            self._queue_control(wire.KIND_PONG, {
                "t_hub": frame.payload.get("t_hub"),
                "t_rank": time.time(),
                "seq": frame.payload.get("seq"),
            })
        elif frame.kind == wire.KIND_ACK:
            self._acked(frame.payload.get("seq"))
        elif frame.kind == wire.KIND_CONTROL and self.on_control is not None:
            try:
                self.on_control(frame)
            except Exception as exc:  # a command handler's bug never drops the connection
                command = _short(str(frame.payload.get("command")), 40)
                self._once(f"control-{command}", logging.WARNING,
                           "rtop: a control frame (%r) failed: %s", command,
                           _short(repr(exc)))
        # other kinds (and control frames without a handler) are ignored by this collector

    def _acked(self, seq: Any) -> None:
        """The hub holds every batch up to ``seq``: they are sent, and forgotten."""
        if type(seq) is not int:
            return
        while self._inflight and self._inflight[0][0] <= seq:
            _, frame, n = self._inflight.popleft()
            self._inflight_bytes -= len(frame)
            self.sent_records += n
            self.sent_frames += 1

    def _written(self, frame: bytes, records: int, seq: int) -> None:
        """A batch frame handed whole to the socket: kept until the hub acknowledges it
        (within ``max_unsent_bytes``)."""
        if not seq:
            self.sent_records += records
            self.sent_frames += 1
            return
        self._inflight.append((seq, frame, records))
        self._inflight_bytes += len(frame)
        while self._inflight_bytes > self._cfg.max_unsent_bytes and len(self._inflight) > 1:
            _, old, n = self._inflight.popleft()
            self._inflight_bytes -= len(old)
            self.unconfirmed_records += n
            self.sent_records += n
            self.sent_frames += 1

    def _queue_control(self, kind: str, payload: dict[str, Any]) -> None:
        """Queue a protocol frame that carries no records (pong, bye) to be written."""
        self._writing.append([memoryview(wire.encode(kind, payload)), 0, 0])

    def queue_frame(self, kind: str, payload: dict[str, Any]) -> None:
        """Queue a frame without records (an action's answer) for the hub, when one is
        up; with none it is dropped: the hub that asked is gone, and a later hub did
        not ask."""
        if self.state is ConnState.UP:
            self._queue_control(kind, payload)

    def _write(self, now: float) -> None:
        sock = self._sock
        while sock is not None and self._writing:
            head = self._writing[0]
            try:
                sent = sock.send(head[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return
                self._lost(now, f"send failed: {exc.strerror or exc}")
                return
            head[0] = head[0][sent:]
            if len(head[0]) == 0:
                self._writing.popleft()
                if head[1]:
                    self._written(head[0].obj, head[1], head[2])


def _short(text: str, limit: int = LOG_CHARS) -> str:
    """``text`` cut to ``limit`` characters for a log line (what a hub sends is not
    trusted to be short)."""
    return text if len(text) <= limit else text[:limit] + "..."
