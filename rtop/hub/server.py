"""The hub: an asyncio TCP server where every rank's stream meets.

One port serves five kinds of peer, told apart by what they send first:

* ranks: ``hello`` (``role: rank``, identity, clock) then, once authenticated,
  ``batch`` frames, answered with a ``welcome`` and, now and then, a ``ping`` whose
  ``pong`` refreshes the rank's clock offset;
* viewers: ``hello`` with ``role: viewer``, then ``request`` (a snapshot, or one rank's
  window), as often as they like: the hub answers each, and skips the answers of a viewer
  that does not read (``viewer_high_water``);
* control peers: ``hello`` with ``role: control``: a viewer's frames and ``control``;
* relays: ``hello`` with ``role: relay`` and its node, then ``relay`` frames that carry
  the node's ranks, each an ordinary rank connection to the hub
  (:mod:`rtop.hub.relayed`);
* Prometheus: an HTTP ``GET /metrics`` with ``Authorization: Bearer <view token>``
  (:mod:`rtop.hub.http`).

Every peer but Prometheus authenticates by challenge-response (:mod:`collectors.auth`):
``hello`` (role, nonce Nc, ``auth: 2``) -> ``challenge`` (nonce Ns, nothing else) ->
``auth`` (the peer's proof) -> ``welcome`` (the hub's proof), or ``error`` with code
``token`` and the connection closed: the peer proves first, so whoever merely connects
gets nothing to test guesses against. No token ever travels; a rank's hello is applied
and recorded only once it has authenticated, and without its nonce or its ``instance``.
Each role may then send only its own kinds (``wire.RANK_KINDS``, ``VIEWER_KINDS``,
``CONTROL_KINDS``): anything else is refused with an error and not recorded.

One open connection holds each rank (:meth:`Hub._claim`): a second connection that
claims a connected rank is refused (``rank_taken``) unless it shows the rank process's
``instance`` secret (the same process, back after a break the hub had not seen yet), and
the holder is closed only if it shows no sign of life. A rank's identity cannot change
on its connection, and an action's answer counts only on the connection the action was
sent on (:mod:`rtop.hub.control`). A worker group that says hello beside the running
one waits apart until it plausibly is the job's restart (:meth:`RunState._takes_over`).

Before a peer has authenticated it may send only small frames
(``HubConfig.preauth_frame_bytes``), must finish within ``auth_timeout_s``, and such
connections are capped, overall and per address group (:func:`addr_group`: a /24, a
/64, or loopback), as are their pending bytes. HTTP requests have a deadline, a size
limit and caps of their own. At a cap the newcomer gets in and the oldest unfinished
connection of the fullest group is closed, so stalled connections from a few
addresses can neither fill the table nor keep a scraper or a rank out (all of this is
:mod:`rtop.hub.admission`'s). Off loopback, an address that fails to authenticate
``throttle_failures`` times within ``throttle_window_s`` is refused for
``throttle_block_s``. What is logged about a peer is cut short and quoted
(``%r``), and refusals are logged at most once per address every ``log_every_s``, with
a count of the rest.

Connections are ``asyncio.Protocol`` objects: received bytes go straight through the
frame decoder into the run state, with no coroutine or timer per frame, so one core
ingests thousands of ranks. Timeouts (a peer that never speaks or never authenticates,
half a frame, a silent rank, a slow HTTP request) and pings run from one housekeeping
loop. While the hub is busy it simply reads less: unread data stays in
the kernel, and the ranks' own bounded buffers take it from there; nothing piles up in
the hub.

Bad input gets one (rate-limited) log line and that one connection closed; what was
recorded stays recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import resource
import secrets
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors import auth, wire
from rtop import __version__
from rtop.analysis.config import AnalysisConfig
from rtop.analysis.monitor import EVAL_SHARE, Evaluation, Monitor
from rtop.analysis.viewport import Viewports
from rtop.hub import http
from rtop.hub.admission import Admission, Bucket, PeerLog, addr_group, is_loopback
from rtop.hub.control import Actions, default_profile_dir
from rtop.hub.recorder import Recorder, default_record_path
from rtop.hub.relayed import RelayLink, RelayLinks
from rtop.hub.spool import SpoolIngest
from rtop.run.snapshot import HubInfo, RankDetail, Snapshot
from rtop.run.state import (
    KIND_INGEST,
    KIND_JOB_EXIT,
    KIND_LINKS,
    MAX_RANKS,
    RankState,
    RunState,
)
from rtop.run.validate import ProtocolError, clean_identity

log = logging.getLogger("rtop.hub")

#: A token given for a hub that listens beyond loopback must be at least this long.
MIN_TOKEN_CHARS = 16
#: Characters of what a peer sent (a frame kind, an error's text) that reach the log.
LOG_CHARS = 80
#: Hello payload keys never recorded (what a handshake or an old client carries; a
#: rank process's ``instance``, the secret that lets it take its own place back).
SECRET_KEYS = frozenset({"token", "nonce", "proof", "instance"})
#: When a second connection claims a rank that is connected, the first must show it is
#: alive (send anything; it is pinged at once) within this, or it is closed as dead.
TAKEN_LIVENESS_S = 3.0


@dataclass
class HubConfig:
    """How a hub listens, records and defends itself."""

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None  # the master token; None: a fresh random one
    record: str | Path | None = None  # None: default location; "" : no recording
    job: str = ""
    hello_timeout_s: float = 5.0  # a connection that never speaks is closed after this
    auth_timeout_s: float = 5.0  # ... and one not authenticated after this
    idle_timeout_s: float = 120.0  # a rank connection silent this long is closed
    frame_timeout_s: float = 30.0  # a frame started and not finished within this
    ping_every_s: float = 10.0
    lost_after_s: float = 10.0
    max_frame_bytes: int = wire.MAX_FRAME_BYTES  # once authenticated
    preauth_frame_bytes: int = wire.PREAUTH_FRAME_BYTES  # before
    max_unauth: int = 2048  # connections not yet authenticated, overall ...
    max_unauth_per_addr: int = 256  # ... and from one address group (addr_group)
    max_unauth_pending_bytes: int = 8 << 20  # bytes of half frames they may hold, overall
    http_deadline_s: float = 5.0  # an HTTP request must arrive whole within this
    max_http: int = 64  # HTTP connections open at once, overall ...
    max_http_per_addr: int = 8  # ... and from one address group (addr_group)
    throttle_failures: int = 5  # failed authentications from one address within ...
    throttle_window_s: float = 60.0  # ... this long get that address ...
    throttle_block_s: float = 60.0  # ... refused for this long
    throttle_loopback: bool = False  # throttle loopback addresses too (tests)
    log_every_s: float = 10.0  # at most one refusal logged per address this often ...
    log_summary_s: float = 60.0  # ... and a count of the others this often
    flood_bytes_per_s: float = 32e6
    flood_frames_per_s: float = 5000.0
    flood_burst_s: float = 4.0
    viewer_high_water: int = 8 << 20  # bytes queued to a viewer before snapshots skip
    linger_s: float | None = None  # exit this long after the last rank and viewer left
    discovery_file: str | Path | None = None
    window_steps: int = 1200
    window_samples: int = 600
    max_ranks: int = MAX_RANKS  # ranks whose windows the hub holds at most (see RunState)
    #: where ranks leave spools (records no hub took at their end: rtop.hub.spool); None:
    #: the runtime directory; "": this hub takes in none
    spool_dir: str | Path | None = None
    spool_scan_s: float = 5.0  # how often it looks for spools
    spool_take_all: bool = False  # take every spool found, not only its own (rtop.hub.spool)
    extra: dict[str, Any] = field(default_factory=dict)


def clip(text: object, limit: int = LOG_CHARS) -> str:
    """What a peer sent, cut to ``limit`` characters for a log line (log it with %r)."""
    s = text if isinstance(text, str) else str(text)
    return s if len(s) <= limit else s[:limit] + "..."


class _Conn(asyncio.Protocol):
    """One peer. ``role`` is None until it has authenticated (then "rank", "viewer" or
    "control") or is known to speak HTTP ("http"); ``claimed`` is its hello's role while
    the hub waits for its ``auth``."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.transport: asyncio.Transport | None = None
        self.dec = wire.FrameDecoder(hub.cfg.preauth_frame_bytes)
        self.role: str | None = None
        self.claimed: str | None = None
        self.hello: dict[str, Any] | None = None  # a rank's hello, applied once it authenticates
        self.expect = b""  # the proof its auth must carry
        self.welcome_proof = b""  # the hub's proof, sent in the welcome once it has
        self.slot: tuple[str, int] | None = None  # (group, rank) this connection holds
        self.via: RelayLink | None = None  # the relay this rank's connection comes through
        self.instance = b""  # the rank process's secret, from its hello
        self.replaced = False  # its rank process came back on a newer connection
        self.alive_by: float | None = None  # must show it is alive by then (see _claim)
        self.alive_asked = 0.0
        self.unauth = False  # counted among the connections not yet authenticated
        self.pending = 0  # bytes of half frames counted while not authenticated
        self.http_counted = False  # counted among the open HTTP connections
        self.who = "?"
        self.addr = "?"
        self.group = "?"  # the address's group for the connection limits (addr_group)
        now = time.monotonic()
        self.opened = self.last = now
        self.spoke = False
        self.partial_since: float | None = None
        self.rank: RankState | None = None
        self.acked = 0  # the batch seq last acknowledged to this rank
        self.clean = False
        self.closing = False
        self.bytes_in = Bucket(hub.cfg.flood_bytes_per_s, hub.cfg.flood_burst_s)
        self.frames_in = Bucket(hub.cfg.flood_frames_per_s, hub.cfg.flood_burst_s)
        self.pings: dict[int, float] = {}
        self.best: list[tuple[float, float]] = []  # (rtt, offset) of recent pongs
        self.ping_seq = 0
        self.next_ping = now + 0.2
        self.http = bytearray()
        #: what was read from it and waits for its turn (see ``Hub.wait_turn``)
        self.held = bytearray()

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.addr = str(peer[0])
            self.who = f"{peer[0]}:{peer[1]}"
        else:
            self.addr = self.who = str(peer)
        self.group = addr_group(self.addr)
        self.hub._conns.add(self)
        self.hub.counters["connections"] += 1
        self.hub.admission.admit(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        if self.gated:
            hub = self.hub
            if self.held or hub.ingest_paused_since is not None or hub.slice_full:
                # read before the hub stopped reading it: kept, in order, for its turn
                self.held += data
                hub.wait_turn(self)
                return
            t0 = time.perf_counter()
            self._received(data)
            hub.spend(time.perf_counter() - t0)
        else:
            self._received(data)

    @property
    def gated(self) -> bool:
        """A rank's own connection, or a relay's: what it sends is the ranks' data, read
        in the hub's slices and paused with its ingest (a relayed rank's stream is read
        with its relay's connection)."""
        return self.via is None and self.role in ("rank", "relay")

    def _received(self, data: bytes) -> None:
        now = time.monotonic()
        self.last = now
        self.spoke = True
        if self.role == "http" or (self.role is None and self.claimed is None
                                   and not self.dec.pending and http.starts_request(data)):
            if self.role != "http":
                self.hub.admission.admit_http(self)
                self.role = "http"
            self.http += data
            self.hub._http(self)
            return
        if not self.bytes_in.take(len(data), now):
            self.hub._flood(self)
            return
        if self.unauth and not self.hub.admission.hold(self, len(data)):
            return
        error: wire.WireError | None = None
        try:
            frames = self.dec.feed_raw(data)
        except wire.WireError as exc:
            frames, error = exc.partial, exc
        if self.unauth:
            self.hub.admission.held(self, self.dec.pending)
        # when the frame now pending began: a peer that streams big frames (a relay)
        # ends most reads inside one, but each is another frame, not one left half-sent
        self.partial_since = None if not self.dec.pending else (
            now if frames or self.partial_since is None else self.partial_since)
        if frames and not self.frames_in.take(len(frames), now):
            self.hub._flood(self)
            return
        for raw, frame in frames:
            try:
                self.hub._frame(self, raw, frame)
            except Exception as exc:  # one peer's frame never breaks another connection
                self.hub._internal(self, frame.kind, exc)
            if self.closing:
                return
        if error is not None:
            self.hub._bad(self, error)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.hub._lost(self, exc)

    # helpers
    def send(self, kind: str, payload: dict[str, Any]) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(wire.encode(kind, payload))

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


class Hub:
    """One job's hub. ``await hub.start()``, then ``hub.address`` and ``hub.token`` (the
    master token; :meth:`role_token` gives the ingest, view and control tokens)."""

    def __init__(self, config: HubConfig | None = None, monitor: Monitor | None = None
                 ) -> None:
        self.cfg = config or HubConfig()
        given = self.cfg.token
        if given is not None and auth.token_role(given) is not None:
            raise ValueError(f"a hub needs the master token, not a role token "
                             f"(rtop-{auth.token_role(given)}-...)")
        if not is_loopback(self.cfg.host):
            if given == "":
                raise ValueError("refusing to listen beyond loopback without a token")
            if given is not None and len(given) < MIN_TOKEN_CHARS:
                raise ValueError(f"refusing to listen beyond loopback with a token shorter "
                                 f"than {MIN_TOKEN_CHARS} characters ({len(given)}): give "
                                 f"a longer one, or none and the hub makes one")
            weak = auth.token_weakness(given) if given else None
            if weak is not None:
                raise ValueError(f"refusing to start: {weak}")
        self.token = given if given else secrets.token_urlsafe(24)
        #: the handshake key of each hello role (the hub holds the master: every role's)
        self._keys: dict[str, bytes] = {}
        for hello_role, key_role in auth.HELLO_ROLES.items():
            key = auth.key_for(self.token, key_role)
            assert key is not None
            self._keys[hello_role] = key
        self._view_token = auth.role_token(self.token, "view").encode()
        self._acting_tokens = [self.token.encode(),
                               auth.role_token(self.token, "control").encode(),
                               auth.role_token(self.token, "ingest").encode()]
        #: the run's state and diagnosis (without one given: the state alone, no findings)
        self.monitor = monitor if monitor is not None else Monitor(
            RunState(window_steps=self.cfg.window_steps,
                     window_samples=self.cfg.window_samples,
                     lost_after_s=self.cfg.lost_after_s,
                     max_ranks=self.cfg.max_ranks), diagnose=False)
        self.recorder: Recorder | None = None
        #: actions a control peer asked of the ranks (profile, probe, stacks)
        self.actions = Actions(self)
        #: takes in the spools of ranks that could not reach a hub at their end
        self.spools: SpoolIngest | None = None if self.cfg.spool_dir == "" else SpoolIngest(
            self, Path(self.cfg.spool_dir) if self.cfg.spool_dir else None,
            self.cfg.spool_scan_s)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        #: the open connection that holds each rank: (group, rank) -> connection
        self._rank_conns: dict[tuple[str, int], _Conn] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._snap_cache: tuple[float, bytes] | None = None
        self.viewports = Viewports()  # the views viewers ask for (rtop.analysis.viewport)
        self._metrics_cache: tuple[float, bytes] | None = None
        self._closed = asyncio.Event()
        self._closing: asyncio.Task[None] | None = None
        self._idle_since: float | None = None
        self._last_tick: float | None = None  # the last housekeeping pass (monotonic)
        #: since when (monotonic) the hub does not read its ranks: its recorder's process
        #: is behind (:meth:`_recorder_behind`); None while it reads
        self.ingest_paused_since: float | None = None
        #: this pass of the loop has spent its :data:`INGEST_SLICE_S` on the ranks' data:
        #: what else is read in it waits for the next (:meth:`spend`)
        self.slice_full = False
        self._slice_spent = 0.0
        self._slice_open = False  # a new slice is due at the next pass (_next_slice)
        #: since when (monotonic) housekeeping passes have found data waiting its turn
        self._waiting_since: float | None = None
        #: since when (monotonic) data read has waited for its turn at every pass
        self._behind_since: float | None = None
        #: the hub does not hear its ranks now (paused, or behind: :meth:`_update_deaf`)
        self.deaf = False
        #: connections holding data read but not yet handled, in the order they came
        self._waiting: dict[_Conn, None] = {}
        self._scan_turn = 0  # which share of the connections the next pass looks at
        self.peer_log = PeerLog(self.cfg.log_every_s, self.cfg.log_summary_s)
        self.address = ""
        self.counters = {"connections": 0, "refused": 0, "bad_frames": 0, "floods": 0,
                         "silent": 0, "snapshots_skipped": 0, "snapshots_sent": 0,
                         "forbidden": 0, "unauthenticated_timeouts": 0, "busy": 0,
                         "throttled": 0, "http_timeouts": 0, "duplicate_batches": 0,
                         "internal_errors": 0, "rank_taken": 0, "rank_replaced": 0,
                         "dead_connections": 0, "evicted": 0, "ingest_pauses": 0,
                         "ingest_paused_ms": 0, "ingest_deferred": 0, "ingest_behind": 0,
                         "ingest_behind_ms": 0}
        self.counters.update(relays=0, relay_taken=0, relay_foreign=0, relay_streams=0,
                             relay_streams_refused=0)
        #: who may connect, and what a connection may hold before it authenticates
        self.admission = Admission(self.cfg, self.counters, self.peer_log)
        #: the node relays connected, each carrying its node's ranks (rtop.hub.relayed)
        self.relays = RelayLinks(self)

    def role_token(self, role: str) -> str:
        """The token of a role (``ingest``, ``view``, ``control``) for this hub."""
        return auth.role_token(self.token, role)

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
            # no token is ever written, whatever a peer sends
            self.recorder = Recorder(path, info, secrets=[
                self.token, *(self.role_token(r) for r in auth.ROLES)])
            self.recorder.on_behind = self._recorder_behind
            info["record"] = str(path)
        self.state.run_info = info
        if self.cfg.discovery_file:  # ranks read the ingest token; viewers the master's file
            write_hub_file(Path(self.cfg.discovery_file), {
                "address": self.address, "token": self.role_token("ingest"),
                "pid": os.getpid(), "job": self.cfg.job, "record": info.get("record"),
                "started": time.time()}, master=self.token)
        self.spawn(self._housekeeping())
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
        with contextlib.suppress(Exception):
            self.actions.close()
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
            from collectors.discovery import hub_key_path

            for path in (Path(self.cfg.discovery_file),
                         hub_key_path(Path(self.cfg.discovery_file))):
                with contextlib.suppress(OSError):
                    path.unlink()
        self._closed.set()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of the hub's, cancelled when the hub closes (its
        spool ingestion, its housekeeping). Call it on the hub's loop."""
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
            if self.recorder is None:
                self._ack_ranks()
            elif time.monotonic() >= next_flush:
                # what is written survives this hub: the ranks let it go (the recorder
                # calls back once it is, without holding up the loop)
                self.recorder.flush(then=self._ack_later())
                next_flush = time.monotonic() + 1.0

    # ---- when the recorder falls behind ------------------------------------------------

    def _recorder_behind(self, behind: bool) -> None:
        """The recorder's process fell :data:`rtop.hub.recorder.BACKLOG_BYTES` behind
        (``behind``): stop reading the ranks, and the relays, until it has caught up.
        They keep what is not acknowledged meanwhile, as for a slow hub (a collector
        drops its oldest records, and counts them, if that lasts); the loop goes on:
        viewers are served, pings and acknowledgements sent. No rank is silent for the
        time the hub did not read (``ingest`` frames, recorded: a replay agrees)."""
        mono = time.monotonic()
        if behind:
            if self.ingest_paused_since is not None:
                return
            self.ingest_paused_since = mono
            self.counters["ingest_pauses"] += 1
            for conn in list(self._conns):
                self.hold(conn)
            self._update_deaf(mono)
        elif self.ingest_paused_since is not None:
            self.counters["ingest_paused_ms"] += round(
                (mono - self.ingest_paused_since) * 1000)
            self.ingest_paused_since = None
            self._update_deaf(mono)
            for conn in list(self._conns):
                if conn.gated and conn not in self._waiting \
                        and conn.transport is not None and not conn.closing:
                    conn.transport.resume_reading()
            self._drain()

    def hold(self, conn: _Conn) -> None:
        """Stop reading ``conn`` while the hub's ingest is paused (a rank's own
        connection, or a relay's: the ranks behind it wait with it)."""
        if conn.gated and conn.transport is not None and not conn.closing:
            conn.transport.pause_reading()

    def spend(self, seconds: float) -> None:
        """``seconds`` of this pass went to a rank's (or relay's) data. Past
        :data:`INGEST_SLICE_S` what else is read in the pass waits for the next
        (:meth:`wait_turn`): a viewer's request, the housekeeping and the other
        connections get their turn between slices, so that a hub behind on its ranks
        (data piled up in every socket after a pause, or a load beyond its core) answers
        in a fraction of a second rather than after a pass of many seconds."""
        if not self._slice_open:  # the pass's first: the next pass starts a new slice
            self._slice_open = True
            asyncio.get_running_loop().call_soon(self._next_slice)
        self._slice_spent += seconds
        if self._slice_spent > INGEST_SLICE_S:
            self.slice_full = True

    def wait_turn(self, conn: _Conn) -> None:
        """``conn`` holds data it read that waits (the hub pauses its ingest, or this
        pass's slice is spent): it reads no more until its turn comes (:meth:`_drain`)."""
        if conn not in self._waiting:
            self._waiting[conn] = None
            self.counters["ingest_deferred"] += 1
        if conn.transport is not None and not conn.closing:
            conn.transport.pause_reading()

    def _next_slice(self) -> None:
        """A new pass of the loop: a new slice for the ranks' data, the waiting first."""
        self.slice_full, self._slice_spent, self._slice_open = False, 0.0, False
        self._drain()

    def _drain(self) -> None:
        """Handle what waiting connections hold, oldest first, while the slice lasts
        (and the ingest is not paused); each one done reads again."""
        while self._waiting and not self.slice_full and self.ingest_paused_since is None:
            conn = next(iter(self._waiting))
            del self._waiting[conn]
            if conn.closing:
                continue
            data, conn.held = bytes(conn.held), bytearray()
            if data:
                conn.data_received(data)
            if not conn.held and not conn.closing and conn.transport is not None:
                conn.transport.resume_reading()

    def _update_deaf(self, mono: float) -> None:
        """The hub does not hear its ranks while its ingest is paused or it is behind
        on what they sent (connections wait with data read and not handled, at a
        housekeeping pass): the state, and the recording, are told when that begins and
        ends (``KIND_INGEST``), so that no rank is silent for that time, live or in a
        replay; the connections' own silence checks wait too."""
        deaf = self.ingest_paused_since is not None or self._behind_since is not None
        if deaf == self.deaf:
            return
        self.deaf = deaf
        if not deaf:
            self._heard_again(mono)
        self._say_ingest(paused=deaf)

    def _heard_again(self, mono: float) -> None:
        """The hub hears its ranks again after a while it could not: their silence
        meanwhile, and a frame half read, were not theirs."""
        for conn in self._conns:
            if conn.partial_since is not None:
                conn.partial_since = mono
            if conn.role in ("rank", "relay"):
                conn.last = max(conn.last, mono)

    def _say_ingest(self, paused: bool, since: float | None = None) -> None:
        """Tell the state (and the recording) that the hub stopped hearing its ranks,
        or hears them again (``since``: deaf since then, a stall it learns of after the
        fact) (``KIND_INGEST``)."""
        now = time.time()
        payload: dict[str, Any] = {"paused": paused}
        if since is not None:
            payload["since"] = since
        self.monitor.apply(wire.Frame(KIND_INGEST, payload), now)
        if self.recorder is not None:
            self.recorder.frame(KIND_INGEST, payload, now)

    def _ack_ranks(self) -> None:
        """Tell each rank the last batch this hub holds (recorded and flushed, when it
        records): the rank forgets the frames it kept to send again (``ack``)."""
        self._ack_later()()

    def _ack_later(self) -> Callable[[], None]:
        """:meth:`_ack_ranks` for the batches held now, when called (once the recorder
        wrote them)."""
        due = [(conn, rs.last_seq) for conn in list(self._conns)
               if conn.role == "rank" and (rs := conn.rank) is not None
               and not conn.closing and rs.last_seq is not None
               and rs.last_seq != conn.acked]

        def ack() -> None:
            for conn, seq in due:
                if not conn.closing and seq != conn.acked:
                    conn.acked = seq
                    conn.send(wire.KIND_ACK, {"seq": seq})
        return ack

    def _housekeep(self, mono: float, now: float) -> None:
        cfg = self.cfg
        if self._last_tick is not None and mono - self._last_tick > BUSY_S:
            # the hub was too busy to read for a while (its loop held up): a frame it has
            # half of may have its rest waiting in the kernel, and the ranks' silence
            # meanwhile was the hub's deafness; neither is the peers' doing
            self._heard_again(mono)
            if not self.deaf:
                self._say_ingest(paused=False, since=now - (mono - self._last_tick))
        self._last_tick = mono
        # behind on its ranks: data read has waited its turn (see spend) at every
        # housekeeping pass for half a second (one long pass, a burst, is not)
        if not self._waiting:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = mono
        if self._waiting_since is not None and mono - self._waiting_since >= BEHIND_S \
                and self._behind_since is None:
            self._behind_since = mono
            self.counters["ingest_behind"] += 1
            if self.counters["ingest_behind"] == 1:
                log.warning("rtop hub: behind on its ranks' data (more than one core's "
                            "worth, or a burst): no rank is taken for silent until it has "
                            "caught up (logged once; counted in ingest_behind)")
        elif self._waiting_since is None and self._behind_since is not None:
            self.counters["ingest_behind_ms"] += round((mono - self._behind_since) * 1000)
            self._behind_since = None
        self._update_deaf(mono)
        deaf = self.deaf
        conns = list(self._conns)
        if len(conns) > SCAN_PER_TICK:
            # thousands of ranks: each pass looks at a share of the connections, in turn
            # (every one within a few passes: the timeouts are seconds, pings 10 s apart)
            parts = -(-len(conns) // SCAN_PER_TICK)
            self._scan_turn = (self._scan_turn + 1) % parts
            conns = conns[self._scan_turn::parts]
        for conn in conns:
            if conn.closing:
                continue
            if conn.role is None and not conn.spoke and mono - conn.opened > \
                    cfg.hello_timeout_s:
                self.counters["silent"] += 1
                self.peer_log(conn.addr, "rtop hub: %r connected and never spoke within "
                              "%.0f s; closed", conn.who, cfg.hello_timeout_s)
                conn.close()
            elif conn.role == "http" and mono - conn.opened > cfg.http_deadline_s:
                self.counters["http_timeouts"] += 1
                self.peer_log(conn.addr, "rtop hub: HTTP request from %r not complete "
                              "within %.0f s; closed", conn.who, cfg.http_deadline_s)
                conn.close()
            elif conn.partial_since is not None and mono - conn.partial_since > \
                    cfg.frame_timeout_s and not deaf:
                self._bad(conn, wire.WireError(
                    f"half a frame: {conn.dec.pending} bytes of a frame, the rest not sent "
                    f"within {cfg.frame_timeout_s:.0f} s"))
            elif conn.role is None and mono - conn.opened > cfg.auth_timeout_s:
                self.counters["unauthenticated_timeouts"] += 1
                self.peer_log(conn.addr, "rtop hub: %r did not authenticate within %.0f s; "
                              "closed", conn.who, cfg.auth_timeout_s)
                conn.close()
            elif conn.alive_by is not None and mono >= conn.alive_by and not deaf:
                # (while the hub does not read, nobody can show it is alive: see
                # _recorder_behind; nor is a rank silent then)
                if conn.last > conn.alive_asked:
                    conn.alive_by = None  # it is alive: the claim stays refused
                else:
                    self.counters["dead_connections"] += 1
                    log.warning("rtop hub: %s's connection (%r) sent nothing for %.0f s "
                                "once another connection claimed its place; closed as "
                                "dead", f"rank {conn.rank.rank}" if conn.rank else
                                f"the {conn.role}", conn.who, TAKEN_LIVENESS_S)
                    conn.close()
            elif conn.role == "rank" and mono - conn.last > cfg.idle_timeout_s and not deaf:
                log.warning("rtop hub: rank %s (%r) sent nothing for %.0f s; closed",
                            conn.rank.rank if conn.rank else "?", conn.who,
                            cfg.idle_timeout_s)
                conn.close()
            elif conn.role == "rank" and mono >= conn.next_ping:
                self._ping(conn, now)
        self.admission.tick(mono)
        self.actions.tick(mono)
        self.relays.tick(mono, deaf)
        if self.spools is not None:
            self.spools.tick(mono)
        # the diagnosis takes at most its share of the core (less often at thousands of
        # ranks: Monitor.advance)
        evaluation = self.monitor.advance(now, share=EVAL_SHARE)
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
        for kind in ev.withdrawn:
            log.info("rtop: %s withdrawn: its ranks ended as their command exited 0", kind)
            if self.recorder is not None:
                self.recorder.frame("finding", {"event": "withdrawn", "kind": kind}, ev.t)

    def _check_linger(self, mono: float, linger: float) -> None:
        viewers = any(c.role in ("viewer", "control") for c in self._conns)
        busy = viewers or any(rs.status == "active" for rs in self.state.active_ranks())
        if busy or self.state.current is None:
            self._idle_since = None
            return
        self._idle_since = self._idle_since or mono
        if mono - self._idle_since > linger:
            log.info("rtop hub: job over and nobody watching for %.0f s; exiting", linger)
            self.spawn(self.close())

    # ---- frames ----------------------------------------------------------------------

    def _frame(self, conn: _Conn, raw: bytes, frame: wire.Frame) -> None:
        role = conn.role
        if role is None:
            if conn.claimed is None:
                self._hello(conn, frame)
            else:
                self._auth(conn, frame)
        elif role == "rank":
            if frame.kind in wire.RANK_KINDS:
                self._rank_frame(conn, raw, frame)
            else:
                self._forbidden(conn, frame.kind)
        elif role == "relay":
            if frame.kind not in wire.RELAY_KINDS:
                self._forbidden(conn, frame.kind)
                return
            try:
                self.relays.frame(conn, frame)
            except ProtocolError as exc:  # the relay's frame itself, not a rank's
                self._bad(conn, exc)
        elif role in ("viewer", "control"):
            allowed = wire.VIEWER_KINDS if role == "viewer" else wire.CONTROL_KINDS
            if frame.kind in allowed:
                self._viewer_frame(conn, frame)
            else:
                self._forbidden(conn, frame.kind)

    def refuse(self, conn: _Conn, code: str, message: str) -> None:
        """Tell ``conn`` why it is refused (an ``error`` frame with ``code``), and close
        it."""
        conn.send(wire.KIND_ERROR, {"code": code, "message": message})
        conn.close()

    def _hello(self, conn: _Conn, frame: wire.Frame) -> None:
        """First frame: a hello with a role and a nonce; answered with a challenge."""
        if frame.kind != wire.KIND_HELLO:
            self._bad(conn, wire.WireError(f"expected a hello, got {clip(frame.kind)!r}"))
            return
        p = frame.payload
        role = p.get("role", "rank")
        nonce = p.get("nonce")
        if not isinstance(role, str) or role not in self._keys:
            self.counters["refused"] += 1
            self.peer_log(conn.addr, "rtop hub: %r said hello with an unknown role %r; "
                          "refused", conn.who, clip(role))
            self.refuse(conn, "role", f"unknown role {clip(role, 40)!r} (rank, viewer, "
                                     "control or relay)")
            return
        if not isinstance(nonce, bytes) or not auth.valid_nonce(nonce) \
                or p.get("auth") != auth.VERSION:
            self.counters["refused"] += 1
            why = "sent its token in the clear" if "token" in p else (
                "sent no valid nonce" if not isinstance(nonce, bytes)
                or not auth.valid_nonce(nonce) else "speaks an older handshake")
            self.peer_log(conn.addr, "rtop hub: %r (a %s) %s: an older rtop? refused",
                          conn.who, role, why)
            self.refuse(conn, "protocol", f"this hub authenticates by challenge-response "
                                          f"version {auth.VERSION} (the peer proves "
                                          f"first; never the token): upgrade rtop on "
                                          f"this side")
            return
        key = self._keys[role]
        hub_nonce = auth.new_nonce()
        conn.claimed = role
        conn.expect = auth.client_proof(key, role, hub_nonce, nonce)
        # the hub proves itself only in the welcome, to a peer that has proved itself:
        # whoever merely connects learns nothing to test guesses at the token against
        conn.welcome_proof = auth.hub_proof(key, role, nonce, hub_nonce)
        if role in ("rank", "relay"):
            conn.hello = p
        conn.send(wire.KIND_CHALLENGE, {"nonce": hub_nonce})

    def _auth(self, conn: _Conn, frame: wire.Frame) -> None:
        """Second frame: the peer's proof. Right: welcome (a rank's hello applied now),
        with the hub's own proof."""
        if frame.kind != wire.KIND_AUTH:
            self._bad(conn, wire.WireError(
                f"expected auth after the challenge, got {clip(frame.kind)!r}"))
            return
        role = conn.claimed
        assert role is not None
        if not auth.check(conn.expect, frame.payload.get("proof")):
            self.admission.failed(conn)
            self.peer_log(conn.addr, "rtop hub: %r (a %s) presented a wrong token; "
                          "refused", conn.who, role)
            self.refuse(conn, "token", "wrong token")
            return
        self.admission.release(conn)
        conn.dec.max_bytes = self.cfg.max_frame_bytes
        conn.role, conn.expect = role, b""
        if role == "rank":
            hello, conn.hello = conn.hello or {}, None
            self._rank_frame(conn, b"", wire.Frame(wire.KIND_HELLO, hello))
        elif role == "relay":
            hello, conn.hello = conn.hello or {}, None
            if self.relays.attach(conn, hello):
                self._welcome(conn)
        else:
            self._welcome(conn)

    def _welcome(self, conn: _Conn, **extra: Any) -> None:
        conn.send(wire.KIND_WELCOME, {"t_hub": time.time(), "hub": __version__,
                                      "proof": conn.welcome_proof, **extra})
        conn.welcome_proof = b""

    def _internal(self, conn: _Conn, kind: str, exc: Exception) -> None:
        """Handling one frame failed inside the hub: that connection alone is closed."""
        self.counters["internal_errors"] += 1
        log.error("rtop hub: handling a %r frame from %r failed; that connection is "
                  "closed", clip(kind), conn.who, exc_info=exc)
        with contextlib.suppress(Exception):
            self.refuse(conn, "internal", "the hub could not handle that frame")
        conn.close()

    def _forbidden(self, conn: _Conn, kind: str) -> None:
        self.counters["forbidden"] += 1
        self.state.bad_frames += 1
        who = f"rank {conn.rank.rank} ({conn.who})" if conn.rank else conn.who
        self.peer_log(conn.addr, "rtop hub: %r, a %s, sent a %r frame, which it may not "
                      "send; refused, connection closed", who, conn.role, clip(kind))
        self.refuse(conn, "forbidden", f"a {conn.role} may not send {clip(kind, 40)!r} "
                                       "frames")

    def _rank_frame(self, conn: _Conn, raw: bytes, frame: wire.Frame) -> None:
        now = time.time()
        if frame.kind == wire.KIND_RESULT:  # an action's answer: not the run's record
            if conn.rank is not None:
                self.actions.result(conn, conn.rank.rank, frame.payload, size=len(raw))
            return
        if frame.kind == wire.KIND_PONG:
            if conn.rank is not None:
                self._pong(conn, conn.rank, frame.payload, now)
            return
        if self.state.is_duplicate(frame, conn.rank):
            # sent again after a reconnect: this hub holds it (acknowledged soon)
            self.state.duplicate_frames += 1
            self.counters["duplicate_batches"] += 1
            return
        if frame.kind == wire.KIND_HELLO:  # recorded without anything of the handshake
            if conn.rank is not None:
                self._bad(conn, ProtocolError("one connection is one rank: it says hello "
                                              "once, and its identity cannot change"))
                return
            if conn.via is not None and not conn.via.speaks_for(conn, frame.payload):
                return
            if not self._claim(conn, frame.payload):
                return
            instance = frame.payload.get("instance")
            conn.instance = instance if isinstance(instance, bytes) \
                and 16 <= len(instance) <= 64 else b""
            clean = {k: v for k, v in frame.payload.items() if k not in SECRET_KEYS}
            frame = wire.Frame(wire.KIND_HELLO, clean)
            raw = wire.encode(wire.KIND_HELLO, clean)
        try:  # one connection is one rank: the state refuses frames for another
            rs = self.monitor.apply(frame, now, peer=conn.rank)
        except ProtocolError as exc:
            self._bad(conn, exc)
            return
        if self.recorder is not None:
            self.recorder.raw(raw, now, frame)  # decoded already: not again
        if frame.kind == wire.KIND_HELLO and rs is not None:
            conn.rank = rs
            self._take_slot(conn, rs)
            # acks: this hub acknowledges batches (collectors.connection); collectors
            # released before that was taken as given still look for it here
            self._welcome(conn, acks=True)
            if self.state.is_current(rs):
                log.info("rtop hub: rank %d of %d (%r, attempt %d) connected from %r",
                         rs.rank, rs.identity.world_size, clip(rs.node), rs.attempt,
                         conn.who)
            else:
                self.peer_log(conn.addr, "rtop hub: rank %d of %d (%r, job %r, group %r) "
                              "connected from %r while another attempt runs: kept apart "
                              "until that one ends (another job on this hub, or a stray "
                              "rank)", rs.rank, rs.identity.world_size, clip(rs.node),
                              clip(rs.identity.job), clip(rs.identity.group), conn.who)
        elif frame.kind == wire.KIND_BYE:
            conn.clean = True
            # a rank's end (and the last steps its goodbye came with) is seen at once,
            # not from a view built a moment before it
            self._snap_cache = None
            self.viewports.clear()
            if rs is not None and rs.last_seq is not None:
                # the rank waits for this before it leaves (or spools what is not)
                seq = rs.last_seq

                def ack() -> None:
                    conn.acked = seq
                    conn.send(wire.KIND_ACK, {"seq": seq})
                if self.recorder is not None:
                    self.recorder.flush(then=ack)  # once its frames are written
                else:
                    ack()

    def _claim(self, conn: _Conn, hello: dict[str, Any]) -> bool:
        """One live connection per rank: may ``conn`` (authenticated, saying ``hello``)
        speak for the rank it names?

        Yes if no other open connection holds that rank. If one does, and this hello
        carries the same rank process's ``instance`` secret, the process came back (its
        side saw the old connection break before the hub did): the old one is closed
        and this one takes its place. Anyone else is refused (``rank_taken``), and the
        old connection is asked to show it is alive: silent for
        :data:`TAKEN_LIVENESS_S` after a ping, it is closed as dead, and the rank's next
        try gets in. A malformed identity is left to the state to refuse."""
        try:
            ident = clean_identity(hello.get("identity"))
        except ProtocolError:
            return True
        slot = (RunState.group_of(ident), ident.rank)
        old = self._rank_conns.get(slot)
        if old is None or old is conn or old.closing:
            return True
        instance = hello.get("instance")
        if isinstance(instance, bytes) and len(instance) >= 16 and old.instance \
                and hmac.compare_digest(instance, old.instance):
            self.counters["rank_replaced"] += 1
            log.info("rtop hub: rank %d (%r) came back on a new connection from %r; the "
                     "old one (%r) is closed", ident.rank, clip(ident.hostname), conn.who,
                     old.who)
            old.replaced = True
            old.close()
            return True
        self.counters["rank_taken"] += 1
        self.ask_alive(old)
        self.peer_log(conn.addr, "rtop hub: %r claims rank %d of group %r, which %r "
                      "holds; refused (the holder must show it is alive within %.0f s)",
                      conn.who, ident.rank, clip(slot[0]), old.who, TAKEN_LIVENESS_S)
        self.refuse(conn, "rank_taken",
                    f"rank {ident.rank} of group {clip(slot[0], 60)!r} is connected "
                    f"already; a second connection for it is refused (if the first is "
                    f"dead, the hub closes it within {TAKEN_LIVENESS_S:.0f} s and the "
                    f"next try gets in)")
        return False

    def ask_alive(self, holder: _Conn) -> None:
        """Another connection claims ``holder``'s place (its rank, or its node for a
        relay): it must show it is alive within :data:`TAKEN_LIVENESS_S` (it is pinged
        now), else housekeeping closes it as dead."""
        mono = time.monotonic()
        if holder.alive_by is None:
            holder.alive_by, holder.alive_asked = mono + TAKEN_LIVENESS_S, mono
            self._ping(holder, time.time())

    def _take_slot(self, conn: _Conn, rs: RankState) -> None:
        """``conn`` now holds its rank (see :meth:`_claim`)."""
        conn.slot = (RunState.group_of(rs.identity), rs.rank)
        self._rank_conns[conn.slot] = conn

    def _bad(self, conn: _Conn, exc: Exception) -> None:
        self.counters["bad_frames"] += 1
        self.state.bad_frames += 1
        self.peer_log(conn.addr, "rtop hub: bad frame from %r: %r; connection closed",
                      conn.who, clip(exc))
        self.refuse(conn, "bad_frame", clip(exc, 200))

    def _flood(self, conn: _Conn) -> None:
        self.counters["floods"] += 1
        who = f"rank {conn.rank.rank} ({conn.who})" if conn.rank else conn.who
        self.peer_log(conn.addr, "rtop hub: %r floods the hub (over %.0f MB/s or %.0f "
                      "frames/s); connection closed", who, self.cfg.flood_bytes_per_s / 1e6,
                      self.cfg.flood_frames_per_s)
        conn.close()

    def _lost(self, conn: _Conn, exc: Exception | None = None) -> None:
        """A connection closed (``exc``: why, None for an orderly end of stream). A
        rank's without a goodbye: the rank is lost as of now, and how is noted (the
        first of several to go is the culprit: rtop.analysis.detectors.lost_rank)."""
        self._conns.discard(conn)
        self._waiting.pop(conn, None)  # what it held goes with it (never acknowledged)
        self.admission.release(conn)
        holder = self._rank_conns.get(conn.slot) if conn.slot is not None else None
        if holder is conn and conn.slot is not None:
            del self._rank_conns[conn.slot]
        elif holder is not None:
            conn.replaced = True  # its rank is held by a newer connection already
        try:
            if conn.role == "relay":
                self.relays.lost(conn)
            elif conn.role == "control":
                self.actions.peer_lost(conn)
            elif conn.role == "rank" and conn.rank is not None:
                self.actions.rank_lost(conn, conn.rank.rank)
        except Exception:
            log.exception("rtop hub: ending the actions of a closed connection failed")
        rs = conn.rank
        if conn.role != "rank" or rs is None or conn.clean or conn.replaced \
                or self._closed.is_set():
            return
        if self._closing is not None:
            return
        now = time.time()
        how = "eof" if exc is None else ("reset" if isinstance(exc, ConnectionResetError)
                                         else "closed")
        self.state.on_disconnect(rs, now, how)
        if self.recorder is not None:
            self.recorder.frame("conn", {"event": "close", "rank": rs.rank,
                                         "group": rs.identity.group, "clean": False,
                                         "how": how}, now)
        log.warning("rtop hub: rank %d (%r) disconnected without saying goodbye (%s)",
                    rs.rank, clip(rs.node), "connection reset" if how == "reset"
                    else "connection closed")

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
        spools = self.spools.counters if self.spools is not None else {}
        rec = self.recorder
        recording = {"recorder_stalls": rec.stalls,
                     "recorder_stalled_ms": round(rec.stalled_s * 1000),
                     "recorder_waits": rec.waits} if rec else {}
        return self.monitor.snapshot(hub=HubInfo(
            address=self.address, counters={**self.counters, **spools, **recording},
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
        if frame.kind == wire.KIND_REQUEST:
            if p.get("what") == "rank" and isinstance(p.get("rank"), int):
                t = conn.transport
                if t is not None and t.get_write_buffer_size() > self.cfg.viewer_high_water:
                    # a viewer that does not read: its window is not even built
                    self.counters["snapshots_skipped"] += 1
                    return
                self._offer(conn, wire.encode("rank", self.rank_detail(p["rank"])))
            elif isinstance(p.get("view"), dict):  # the fleet's aggregates, the rows shown
                self._offer(conn, self.viewports.frame(p["view"], self.snapshot))
            else:
                self._offer(conn, self._snapshot_frame())
        elif frame.kind == wire.KIND_CONTROL:  # a control peer's only (see _frame)
            self.actions.request(conn, p)

    def _metrics_text(self) -> bytes:
        """The Prometheus exposition of the current snapshot, rebuilt at most once per
        :data:`METRICS_CACHE_S` (several scrapers, or a fast one, cost one build)."""
        from rtop.hub.metrics import prometheus_text

        now = time.monotonic()
        cached = self._metrics_cache
        if cached is not None and now - cached[0] < METRICS_CACHE_S:
            return cached[1]
        body = prometheus_text(self.snapshot(), hub_counters={
            **self.counters, **self.actions.counters}).encode()
        self._metrics_cache = (now, body)
        return body

    # ---- what actions need (rtop.hub.control) ---------------------------------------

    def rank_connections(self) -> dict[int, _Conn]:
        """The connections of the current attempt's ranks that are up, by rank."""
        att = self.state.current
        if att is None:
            return {}
        out = {rank: conn for (group, rank), conn in self._rank_conns.items()
               if group == att.group and not conn.closing and conn.rank is not None
               and att.ranks.get(rank) is conn.rank}
        return dict(sorted(out.items()))

    def last_step(self, rank: int) -> int:
        """The last step a rank of the current attempt reported (-1: none yet)."""
        rs = self.state.rank_state(rank)
        return rs.last_step if rs is not None else -1

    def node_of(self, rank: int) -> str:
        """The node a rank of the current attempt runs on."""
        rs = self.state.rank_state(rank)
        return rs.node if rs is not None else "?"

    def world_size(self) -> int | None:
        """The current attempt's world size."""
        att = self.state.current
        return att.world_size if att is not None else None

    def step_seconds(self, ranks: Iterable[int]) -> float | None:
        """The slowest recent step time (median of its window) among ``ranks``."""
        cols = self.snapshot()["ranks"]
        wanted = set(ranks)
        times = [t for r, t in zip(cols.get("rank", []), cols.get("step_s", []), strict=False)
                 if r in wanted and isinstance(t, float) and math.isfinite(t) and t > 0]
        return max(times) if times else None

    def probe_refusal(self, nbytes: int, ranks: Iterable[int]) -> str | None:
        """Why a link probe of ``nbytes`` per transfer would take more of some rank's
        free memory than a probe may (:func:`collectors.linkprobe.affordable`), judged
        from the rank's latest samples: its GPU's free memory (NVML) where it trains on
        a GPU, else the host's available memory shared by the node's ranks. None when
        every rank can afford it, or nothing was measured. The rank checks again itself
        before it allocates anything."""
        from collectors.config import ProbeConfig
        from collectors.linkprobe import affordable

        share = ProbeConfig.from_env().probe_memory_share
        state = self.state
        wanted = list(ranks)
        per_node: dict[str, int] = {}
        for r in wanted:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        col = state.latest_index
        for r in wanted:
            rs = state.rank_state(r)
            if rs is None or rs.slot is None:
                continue
            row = state.latest[rs.slot]
            device = rs.mem_device or ""
            if device.startswith("cuda"):
                total, used = row[col["gpu_mem_total_bytes"]], row[col["gpu_mem_used_bytes"]]
                free = None if math.isnan(total) or math.isnan(used) else int(total - used)
                why = affordable(nbytes, free, share=share, where=device)
            else:
                avail = row[col["host_sys_mem_avail_bytes"]]
                why = affordable(nbytes, None if math.isnan(avail) else int(avail),
                                 sharing=per_node[rs.node], share=share,
                                 where=f"host memory of {rs.node}")
            if why is not None:
                return f"rank {r}: {why}"
        return None

    def profile_dir(self) -> str:
        """Where a profile's traces go by default (beside the recording)."""
        return default_profile_dir(self.recorder.path if self.recorder else None,
                                   self.cfg.job)

    def job_exited(self, code: int, exited_at: float | None = None) -> list[int]:
        """The command whose ranks this hub watches exited with ``code`` (as a shell
        reports it) at hub time ``exited_at`` (default now): ``rtop run`` says so once
        its ranks' last frames are in. Recorded (a ``job_exit`` frame) and applied like
        a rank's frame, so the live view, the recording and ``rtop report`` agree: with
        code 0, ranks lost without a goodbye as it exited ended with it, and a
        ``lost_rank`` finding only they made is withdrawn (``RunState.on_job_exit``).
        Returns the ranks it ended. Call it on the hub's loop."""
        now = time.time()
        payload = {"code": int(code),
                   "exited_at": float(exited_at) if exited_at is not None else now}
        self.monitor.apply(wire.Frame(KIND_JOB_EXIT, payload), now)
        if self.recorder is not None:
            self.recorder.frame(KIND_JOB_EXIT, payload, now)
        evaluation = self.monitor.advance(now, force=True)
        if evaluation is not None:
            self._report(evaluation)
        self._snap_cache = None
        self.viewports.clear()  # the views say the job ended at once
        ended = self.state.job_exit
        return list(ended.ended) if ended is not None else []

    def keep_links(self, result: dict[str, Any]) -> None:
        """A finished link probe's result (:meth:`rtop.hub.control.Actions.probe_done`
        makes it): kept in the run's state (the fabric view, the slow_link detector) and
        recorded (a ``links`` frame), as of now."""
        now = time.time()
        self.state.set_links(result, now)
        if self.recorder is not None:
            self.recorder.frame(KIND_LINKS, result, now)
        self._snap_cache = None
        self.viewports.clear()

    def analysis_config(self) -> AnalysisConfig:
        """The thresholds the diagnosis judges by (the defaults before it starts)."""
        analyzer = self.monitor.analyzer
        return analyzer.cfg if analyzer is not None else AnalysisConfig()

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

    # ---- Prometheus ----------------------------------------------------------------------

    def _http(self, conn: _Conn) -> None:
        """Answer an HTTP request (:mod:`rtop.hub.http`) once its head is whole: the
        metrics to the view token, 401 to no token or a wrong one, 403 to a token that
        can act on the job (it must never sit in a scraper's config); then close."""
        try:
            request = http.parse_head(bytes(conn.http))
        except http.RequestTooLarge:
            self.peer_log(conn.addr, "rtop hub: oversized HTTP request from %r; closed",
                          conn.who)
            conn.close()
            return
        if request is None:
            return
        presented = request.bearer
        t = conn.transport
        assert t is not None
        if not hmac.compare_digest(presented, self._view_token):
            acting = any(hmac.compare_digest(presented, tok) for tok in self._acting_tokens)
            if acting:  # a token that can act must never sit in a scraper's config
                self.peer_log(conn.addr, "rtop hub: HTTP request from %r with a token that "
                              "can act, not the view token; refused", conn.who)
                t.write(http.response("403 Forbidden", b"/metrics takes the hub's view token "
                                      b"(rtop-view-...), never a token that can act on the "
                                      b"job\n", "text/plain"))
            else:
                self.admission.failed(conn)
                self.peer_log(conn.addr, "rtop hub: HTTP request from %r without the view "
                              "token; refused", conn.who)
                t.write(http.response("401 Unauthorized"))
        elif request.path != "/metrics":
            t.write(http.response("404 Not Found"))
        else:
            t.write(http.response("200 OK", self._metrics_text(),
                                  "text/plain; version=0.0.4; charset=utf-8"))
        conn.close()

#: Housekeeping runs every 0.25 s; a pass this much later means the hub was busy.
BUSY_S = 2.0
#: The most of one pass of the hub's loop that goes to the ranks' data before the rest
#: read in that pass waits for the next (:meth:`Hub.spend`).
INGEST_SLICE_S = 0.05
#: Data waiting its turn at every housekeeping pass for this long: the hub is behind on
#: its ranks, and does not hear them (``Hub._update_deaf``).
BEHIND_S = 0.5
#: Connections one housekeeping pass looks at (timeouts, pings): with more, each pass
#: looks at a share of them in turn (at 16,384 ranks each every 2 s), so that no pass
#: stalls the loop on a Python loop over every rank.
SCAN_PER_TICK = 2048
METRICS_CACHE_S = 1.0  # one exposition serves every scrape within this (0.3 s at 1,024 ranks)


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


def write_hub_file(path: Path, info: dict[str, Any], master: str | None = None) -> None:
    """Write a hub's discovery file for ranks and ``rtop`` to find: ``info`` (its
    address, and the *ingest* token: all a rank needs) in ``path``, and, when given, the
    ``master`` token (with the hub's ``pid``) in the private file beside it
    (:func:`collectors.discovery.hub_key_path`), which viewers and actions read and ranks
    never do. The key file is written first, so a viewer that finds the hub file finds
    it too. Each file atomically: a fresh 0600 file of an unpredictable name
    (``mkstemp``, created with ``O_EXCL``, so no planted link is followed) in the same
    directory, then renamed over its name."""
    from collectors.discovery import hub_key_path

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if master is not None:
        _write_private_json(hub_key_path(path), {"token": master, "pid": info.get("pid")})
    _write_private_json(path, info)


def _write_private_json(path: Path, info: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            json.dump(info, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
