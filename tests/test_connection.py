"""HubConnection on its own, against real sockets: states, the handshake, ping, refusal,
control frames, the limits on what waits unsent, and the bye."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable

import pytest

from collectors import auth, wire
from collectors.config import ProbeConfig
from collectors.connection import ConnState, HubConnection
from collectors.identity import detect
from rtop.workload import free_port
from tests.listener import Listener


def _pump_until(conn: HubConnection, what: str, cond: Callable[[], bool],
                timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        conn.pump(time.monotonic())
        time.sleep(0.01)


def _batch(seq: int, pad: int = 0) -> bytes:
    return wire.encode(wire.KIND_BATCH, {"rank": 0, "group": "g", "seq": seq, "pad": b"x" * pad})


def _conn(hub: str, token: str = "tok", **settings) -> HubConnection:
    cfg = ProbeConfig(**{"hub": hub, "token": token, "backoff_initial_s": 0.01,
                         "backoff_max_s": 0.05, **settings})
    return HubConnection(cfg, detect())


class ScriptedHub:
    """One connection's hub side, driven by the test: reads frames, sends what it's told."""

    def __init__(self) -> None:
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._srv.getsockname()[1]}"
        self._srv.settimeout(10)
        self.conn: socket.socket | None = None
        self._dec = wire.FrameDecoder()

    def accept(self) -> None:
        self.conn, _ = self._srv.accept()
        self.conn.settimeout(10)
        self._dec = wire.FrameDecoder()

    def send(self, kind: str, payload: dict) -> None:
        assert self.conn is not None
        self.conn.sendall(wire.encode(kind, payload))

    def read(self) -> wire.Frame:
        assert self.conn is not None
        while True:
            frames = self._dec.feed(self.conn.recv(65536))
            if frames:
                assert len(frames) == 1, frames
                return frames[0]

    def challenge(self, hello: wire.Frame, token: str = "tok") -> bytes:
        """Answer a rank's hello with a challenge (a nonce: the rank proves itself
        first); the proof its auth must carry. The hub's own proof of ``token`` goes in
        the welcome (:meth:`welcome`)."""
        key = auth.key_for(token, "ingest")
        assert key is not None
        nonce = auth.new_nonce()
        self.welcome_proof = auth.hub_proof(key, "rank", hello.payload["nonce"], nonce)
        self.send(wire.KIND_CHALLENGE, {"nonce": nonce})
        return auth.client_proof(key, "rank", nonce, hello.payload["nonce"])

    def welcome(self, payload: dict | None = None) -> None:
        """The welcome, with the hub's proof of the token given to :meth:`challenge`."""
        self.send(wire.KIND_WELCOME, {**(payload or {}), "proof": self.welcome_proof})

    def handshake(self, conn: HubConnection, token: str = "tok") -> wire.Frame:
        """Accept, read the hello, prove ``token``, check the rank's proof (pumping
        ``conn`` meanwhile); the hello."""
        self.accept()
        hello = self.read()
        expect = self.challenge(hello, token)
        _pump_until(conn, "the hub's proof", lambda: conn.state is ConnState.AUTH)
        assert self.read() == wire.Frame(wire.KIND_AUTH, {"proof": expect})
        return hello

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._srv.close()


@pytest.fixture
def hub():
    h = ScriptedHub()
    yield h
    h.close()


def test_states_hello_welcome_ping_control(hub):
    controls: list[wire.Frame] = []
    conn = _conn(hub.address, token="t")
    conn.on_control = controls.append
    assert conn.state is ConnState.DOWN
    conn.pump(time.monotonic())  # connects (the kernel accepts), sends the hello
    assert conn.state is ConnState.HELLO
    hub.accept()
    hello = hub.read()
    assert hello.kind == wire.KIND_HELLO and "token" not in hello.payload  # never sent
    assert "t" not in [v for v in hello.payload.values() if isinstance(v, str)]
    assert isinstance(hello.payload["nonce"], bytes) and len(hello.payload["nonce"]) >= 16
    assert hello.payload["role"] == "rank" and hello.payload["identity"]["rank"] == 0
    conn.send(_batch(1), 3)  # queued: no batch goes out before the welcome
    expect = hub.challenge(hello, token="t")
    _pump_until(conn, "the hub's proof", lambda: conn.state is ConnState.AUTH)
    assert hub.read() == wire.Frame(wire.KIND_AUTH, {"proof": expect})
    hub.welcome({"t_hub": 1.0})
    _pump_until(conn, "the welcome", lambda: conn.state is ConnState.UP)
    assert conn.connects == 1 and conn.hub_info["t_hub"] == 1.0
    assert hub.read().payload["seq"] == 1
    _pump_until(conn, "the batch to be counted", lambda: conn.sent_records == 3)
    hub.send(wire.KIND_PING, {"t_hub": 2.0, "seq": 7})
    hub.send(wire.KIND_CONTROL, {"command": "stacks"})
    _pump_until(conn, "the control frame", lambda: bool(controls))
    pong = hub.read()
    assert pong.kind == wire.KIND_PONG and pong.payload["seq"] == 7
    assert pong.payload["t_hub"] == 2.0
    assert [c.payload for c in controls] == [{"command": "stacks"}]
    assert conn.stats()["connected"] == 1
    conn.close()


def test_control_frames_without_a_handler_or_with_a_failing_one_are_harmless(hub):
    conn = _conn(hub.address)
    conn.pump(time.monotonic())
    hub.handshake(conn)
    hub.welcome()
    hub.send(wire.KIND_CONTROL, {"command": "profile"})  # ignored: no handler
    _pump_until(conn, "the welcome", lambda: conn.state is ConnState.UP)

    def broken(frame: wire.Frame) -> None:
        raise RuntimeError("a handler's bug")

    conn.on_control = broken
    hub.send(wire.KIND_CONTROL, {"command": "profile"})
    hub.send(wire.KIND_PING, {"seq": 1})
    _pump_until(conn, "an answer to the ping after the control frame",
                lambda: bool(select.select([hub.conn], [], [], 0)[0]))
    assert hub.read().kind == wire.KIND_PONG
    assert conn.state is ConnState.UP, "a control handler's error dropped the connection"
    conn.close()


def _sent_nothing_more(sock: socket.socket) -> bool:
    """True if the rank closed ``sock`` without sending anything more."""
    sock.settimeout(2)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:  # closed with the hub's frames unread
        return True


def test_a_hub_that_cannot_prove_itself_gets_nothing_more(hub):
    """Whoever listens on the hub's port without the token: the rank proves itself
    first (a proof keyed by the ingest key, which a role token's 192 bits or scrypt
    protect: collectors.auth), but the welcome's proof does not check out, so the rank
    sends no batch, ignores the welcome and the control frame, closes and retries
    later."""
    controls: list[wire.Frame] = []
    conn = _conn(hub.address, token="the-real-token")
    conn.on_control = controls.append
    conn.send(_batch(1), 1)
    conn.pump(time.monotonic())
    hub.accept()
    hello = hub.read()
    hub.challenge(hello, token="a-guess")
    _pump_until(conn, "the rank's proof", lambda: conn.state is ConnState.AUTH)
    assert hub.read().kind == wire.KIND_AUTH
    hub.welcome()
    hub.send(wire.KIND_CONTROL, {"command": "profile"})
    _pump_until(conn, "the hub to be distrusted", lambda: conn.unproven_hubs == 1)
    assert conn.state is ConnState.DOWN and conn.socket is None
    assert _sent_nothing_more(hub.conn)
    assert not controls and conn.connects == 0
    assert conn.sent_records == 0 and conn.queued_frames == 1  # kept for the real hub


def test_anything_but_a_challenge_before_the_proof_closes_the_connection(hub):
    """A welcome, a ping or a control frame before the hub proved itself: an older hub,
    or not a hub. Nothing is acted upon."""
    controls: list[wire.Frame] = []
    conn = _conn(hub.address)
    conn.on_control = controls.append
    conn.pump(time.monotonic())
    hub.accept()
    hub.read()
    hub.send(wire.KIND_CONTROL, {"command": "profile"})
    hub.send(wire.KIND_WELCOME, {})
    hub.send(wire.KIND_PING, {"seq": 1})
    _pump_until(conn, "the hub to be distrusted", lambda: conn.unproven_hubs == 1)
    assert conn.state is ConnState.DOWN and not controls and conn.connects == 0
    assert _sent_nothing_more(hub.conn)


def test_frames_from_the_hub_are_small_or_the_connection_closes(hub):
    """Before the proof, 4 kB at most; after, 64 kB: a bigger one closes the connection
    (read no further than its header) and the rank reconnects."""
    conn = _conn(hub.address)
    conn.pump(time.monotonic())
    hub.accept()
    hub.read()
    hub.conn.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION,
                                      wire.UNPROVEN_HUB_FRAME_BYTES + 1))
    _pump_until(conn, "the connection to close", lambda: conn.state is ConnState.DOWN)
    assert conn.unproven_hubs == 1
    _pump_until(conn, "the reconnect", lambda: conn.state is ConnState.HELLO)
    hub.handshake(conn)  # this time the hub proves itself
    hub.welcome()
    _pump_until(conn, "the welcome", lambda: conn.state is ConnState.UP)
    hub.send(wire.KIND_PING, {"seq": 1, "pad": b"p" * (wire.RANK_FRAME_BYTES - 100)})
    _pump_until(conn, "the pong", lambda: bool(select.select([hub.conn], [], [], 0)[0]))
    assert hub.read().kind == wire.KIND_PONG  # 64 kB: fine
    hub.send(wire.KIND_PING, {"seq": 2, "pad": b"p" * wire.RANK_FRAME_BYTES})
    _pump_until(conn, "the connection to close", lambda: conn.state is ConnState.DOWN)
    assert conn.connects == 1


def test_no_token_no_connection():
    """Without a token the rank could not tell its hub from an impostor: it does not
    connect (and says so once)."""
    listener = Listener(token="tok")
    try:
        conn = _conn(listener.address, token="")
        conn.pump(time.monotonic())
        assert conn.socket is None and conn.connect_failures == 1
        time.sleep(0.2)
        assert not listener.hellos
    finally:
        listener.close()


def test_refusal_closes_and_backs_off(hub):
    conn = _conn(hub.address, token="wrong", backoff_max_s=30.0)
    conn.pump(time.monotonic())
    hub.accept()
    hub.read()
    hub.send(wire.KIND_ERROR, {"code": "token", "message": "wrong token"})
    _pump_until(conn, "the refusal", lambda: conn.refusals == 1)
    assert conn.state is ConnState.DOWN and conn.socket is None
    conn.pump(time.monotonic())  # backing off (backoff_max_s after a refusal): no retry
    assert conn.socket is None


def test_unreachable_hub_keeps_the_newest_frames_within_max_unsent_bytes():
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    listener = Listener(token="tok")
    target = {"address": dead}
    cfg = ProbeConfig(hub=dead, token="tok", backlog_frames=1000, max_unsent_bytes=10_000,
                      backoff_initial_s=0.01, backoff_max_s=0.05)

    def resolve(allow_spawn: bool):
        host, port = wire.parse_address(target["address"])
        return host, port, "tok"

    conn = HubConnection(cfg, detect(), resolve=resolve)
    try:
        conn.pump(time.monotonic())
        assert conn.connect_failures == 1 and conn.state is ConnState.DOWN
        frame_bytes = len(_batch(0, pad=2900))
        for seq in range(10):
            conn.send(_batch(seq, pad=2900), 5)
            assert conn.unsent_bytes <= 10_000
        kept = 10_000 // frame_bytes
        assert conn.queued_frames == kept == 3
        assert conn.dropped_unsent == 5 * (10 - kept)
        target["address"] = listener.address  # the hub appears
        _pump_until(conn, "the kept frames to be sent", lambda: conn.sent_frames == kept)
        deadline = time.monotonic() + 5
        while len(listener.batches()) < kept and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [b["seq"] for b in listener.batches()] == [7, 8, 9], "not the newest frames"
        assert conn.unsent_bytes == 0
    finally:
        conn.close()
        listener.close()


def test_backlog_frames_limit_counts_what_it_drops():
    conn = _conn(f"127.0.0.1:{free_port()}", backlog_frames=4)
    conn.pump(time.monotonic())
    for seq in range(10):
        conn.send(_batch(seq), 2)
    assert conn.queued_frames == 4 and conn.dropped_unsent == 12


def test_frame_larger_than_the_limit_is_dropped_at_once():
    conn = _conn(f"127.0.0.1:{free_port()}", max_unsent_bytes=1000)
    conn.send(_batch(0, pad=2000), 9)
    assert conn.queued_frames == 0 and conn.unsent_bytes == 0 and conn.dropped_unsent == 9


def test_stalled_hub_bounds_unsent_bytes(hub):
    """A hub that welcomes and never reads: writes stall, the outbox stays within limit."""
    limit = 256 * 1024
    conn = _conn(hub.address, backlog_frames=100_000, max_unsent_bytes=limit)
    conn.pump(time.monotonic())
    hub.accept()
    hub.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    expect = hub.challenge(hub.read())
    _pump_until(conn, "the hub's proof", lambda: conn.state is ConnState.AUTH)
    assert hub.read().payload["proof"] == expect
    hub.welcome()
    _pump_until(conn, "the welcome", lambda: conn.state is ConnState.UP)
    frame = _batch(0, pad=20_000)
    sent = 0
    for _ in range(1000):  # 20 MB: far more than the socket buffers take
        conn.send(frame, 1)
        conn.pump(time.monotonic())
        sent += 1
        assert conn.queued_frames == 0 or conn.unsent_bytes <= limit
    assert conn.state is ConnState.UP, "a stalled hub is not a lost one"
    assert conn.dropped_unsent > 0
    assert conn.sent_records + conn.dropped_unsent + conn.queued_frames <= sent
    # what is waiting: at most the limit in the outbox, plus the frames being written
    assert conn.unsent_bytes <= limit + 8 * len(frame)
    conn.close()


def test_finish_sends_what_waits_then_bye():
    listener = Listener(token="tok")
    conn = _conn(listener.address, token="tok")
    try:
        for seq in range(3):
            conn.send(_batch(seq), 1)
        conn.finish(time.monotonic() + 5.0, lambda: {"rank": 0, "reason": "closed"})
        deadline = time.monotonic() + 5
        while not any(f.kind == wire.KIND_BYE for _, f in listener.frames):
            assert time.monotonic() < deadline, "no bye"
            time.sleep(0.01)
        assert [b["seq"] for b in listener.batches()] == [0, 1, 2]
        assert conn.sent_records == 3 and conn.dropped_unsent == 0
        bye = next(f for _, f in listener.frames if f.kind == wire.KIND_BYE)
        assert bye.payload["reason"] == "closed"
    finally:
        conn.close()
        listener.close()


def test_finish_with_no_hub_counts_everything_unsent():
    # with the spool off (with it on, they are spooled: tests/test_spool.py)
    conn = _conn(f"127.0.0.1:{free_port()}", spool=False)
    conn.send(_batch(0), 4)
    t0 = time.monotonic()
    conn.finish(time.monotonic() + 0.3, dict)
    assert time.monotonic() - t0 < 1.5
    assert conn.dropped_unsent == 4 and conn.unsent_bytes == 0


def test_reconnect_requeues_frames_not_started():
    """The hub goes away after the welcome: queued frames wait and go to the next hub."""
    first = socket.create_server(("127.0.0.1", 0))
    port = first.getsockname()[1]
    conn = _conn(f"127.0.0.1:{port}", token="tok")
    conn.pump(time.monotonic())
    peer, _ = first.accept()
    scripted = ScriptedHub()
    scripted._srv.close()
    scripted.conn = peer
    scripted.challenge(scripted.read())
    _pump_until(conn, "the hub's proof", lambda: conn.state is ConnState.AUTH)
    scripted.read()
    scripted.welcome()
    _pump_until(conn, "the welcome", lambda: conn.state is ConnState.UP)
    peer.close()
    first.close()
    _pump_until(conn, "the loss to be seen", lambda: conn.state is ConnState.DOWN)
    for seq in range(3):
        conn.send(_batch(seq), 1)
    listener = Listener(port=port, token="tok")
    try:
        _pump_until(conn, "the frames on the new connection", lambda: conn.sent_records == 3)
        assert conn.connects == 2
        deadline = time.monotonic() + 5
        while len(listener.batches()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [b["seq"] for b in listener.batches()] == [0, 1, 2]
    finally:
        conn.close()
        listener.close()
