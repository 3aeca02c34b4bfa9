"""A malicious peer against the real hub and a real rank, over real sockets (issue 12).

One test per attack: each one reproduces the attack as it was tried on the code before
the fix and fails there. The figures the issue quotes are measured again and printed
(``pytest -s``): the hub's peak RSS after a big frame before authentication (finding
1), how long "GET " sockets stay open (finding 2), and the RSS a hostile "hub" adds to
a training process (finding 11). The ``measure_*`` functions take a ``pythonpath`` so
the same attack can be replayed against another checkout.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest

from collectors import auth, wire
from collectors.config import ProbeConfig
from collectors.connection import ConnState, HubConnection
from collectors.identity import detect
from rtop.client import HubClient, HubError
from rtop.hub.server import Hub, HubConfig
from rtop.hub.service import ThreadedHub
from rtop.run.recording import plain_bytes, read
from rtop.workload import WorkloadSpec, free_port, run_local
from tests import waiting
from tests.listener import Listener
from tests.rankclient import RankClient, step_row

#: This module's pace: sockets polled every 20 ms, given 10 s by default.
wait_for = partial(waiting.wait_for, timeout=10.0, every=0.02)

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("ingest", "view", "control")


def empty_maps_frame(body_bytes: int) -> bytes:
    """A frame whose body is one msgpack array of empty maps: 1 byte each on the wire,
    a Python dict each once decoded (the issue's amplifier)."""
    n = body_bytes - 5
    body = b"\xdd" + struct.pack(">I", n) + b"\x80" * n
    return wire.HEADER.pack(wire.MAGIC, wire.VERSION, len(body)) + body


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return psutil.Process(pid).memory_info().rss


def _env(pythonpath: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath or str(ROOT)
    return env


def closed(sock: socket.socket, timeout: float) -> bool:
    """True once the peer closed ``sock`` (whatever it sent first)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 16):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True


class Server:
    """A listening socket whose accept loop runs on a thread until :meth:`close`, which
    frees the port (a thread blocked in accept() would keep it listening)."""

    def __init__(self, port: int = 0) -> None:
        self.srv = socket.create_server(("127.0.0.1", port))
        self.srv.settimeout(0.05)
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.srv.accept()
            except (TimeoutError, OSError):
                continue
            conn.settimeout(10)
            self.connections += 1
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.srv.close()


# ---- a hub in a process of its own ---------------------------------------------------------

HUB_SCRIPT = """
import asyncio, sys
from rtop.hub.server import Hub, HubConfig

async def main():
    hub = Hub(HubConfig(port=int(sys.argv[1]), token=sys.argv[2], record=sys.argv[3]))
    await hub.start()
    print("ready", hub.address, flush=True)
    await hub.serve_forever()

asyncio.run(main())
"""


class HubProcess:
    """``rtop.hub.server.Hub`` in a subprocess (of this checkout, or of ``pythonpath``)."""

    def __init__(self, token: str, record: str = "", pythonpath: str | None = None) -> None:
        self.port = free_port()
        self.token = token
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HUB_SCRIPT, str(self.port), token, record],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=pythonpath or ROOT,
            env=_env(pythonpath))
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("ready"):
            self.proc.kill()
            raise RuntimeError(f"the hub did not start: {line} {self.proc.stderr.read()}")
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def measure_preauth_blowup(body_bytes: int, pythonpath: str | None = None) -> dict[str, float]:
    """Finding 1: a fresh hub, then one connection whose first frame is ``body_bytes``
    of empty maps. The hub's peak RSS before and after, and how long it took to close."""
    hub = HubProcess("blowup-token-0123456789", pythonpath=pythonpath)
    try:
        time.sleep(0.5)
        before = peak_rss(hub.proc.pid)
        frame = empty_maps_frame(body_bytes)
        with socket.create_connection(("127.0.0.1", hub.port)) as s:
            t0 = time.monotonic()
            with contextlib.suppress(OSError):  # closed mid-send: refused at the header
                s.sendall(frame)
            was_closed = closed(s, 30.0)
            took = time.monotonic() - t0
        time.sleep(0.3)
        after = peak_rss(hub.proc.pid)
        alive = hub.proc.poll() is None
    finally:
        hub.stop()
    return {"before": before, "after": after, "close_s": took, "closed": was_closed,
            "alive": alive}


def test_finding1_a_big_frame_before_authentication_costs_the_hub_nothing():
    """A 4 MB (and an 8 MB) frame of empty maps as a connection's first frame: before
    the fix the hub decoded it whole, unauthenticated (44 -> 330 MB, 617 MB for 8 MB)."""
    for size in (4_000_000, 8_000_000):
        m = measure_preauth_blowup(size)
        print(f"\nfinding 1: {size / 1e6:.0f} MB frame of empty maps before auth: hub peak "
              f"RSS {m['before'] / 1e6:.0f} MB -> {m['after'] / 1e6:.0f} MB "
              f"(+{(m['after'] - m['before']) / 1e6:.1f} MB); connection closed after "
              f"{m['close_s'] * 1e3:.0f} ms")
        assert m["alive"] and m["closed"]
        assert m["after"] - m["before"] < 10e6, m
        assert m["close_s"] < 1.0, m


def test_finding1_preauth_limits_frames_time_and_connections(tmp_path, caplog):
    """Before authenticating, a peer gets small frames, a few seconds, and a share of a
    capped number of connections and pending bytes; a rank still gets in after."""
    hub = ThreadedHub(record="", auth_timeout_s=1.0, hello_timeout_s=5.0,
                      max_unauth=12, max_unauth_per_addr=8,
                      max_unauth_pending_bytes=40_000).start()
    try:
        # a frame over the pre-authentication limit, even as a hello: refused at its header
        big_hello = wire.encode(wire.KIND_HELLO, {"role": "rank", "nonce": auth.new_nonce(),
                                                  "pad": "x" * (wire.PREAUTH_FRAME_BYTES + 1)})
        with socket.create_connection(wire.parse_address(hub.address)) as s:
            s.sendall(big_hello[:wire.HEADER_BYTES])
            assert closed(s, 2.0)
        # ... and a 4 MB frame in place of the auth, after a proper hello
        r = RankClient(hub.address, hub.token, 0, hello=False)
        r.send(wire.KIND_HELLO, {"role": "rank", "nonce": auth.new_nonce(),
                                 "auth": auth.VERSION, "identity": {"rank": 0}})
        assert r.recv().kind == wire.KIND_CHALLENGE
        r.raw(empty_maps_frame(4_000_000)[:64 * 1024])
        assert r.closed_by_hub(2.0)
        # a hello and then nothing: closed at the authentication deadline, not after 30 s
        # (the frame timeout), and never welcomed
        t0 = time.monotonic()
        lazy = RankClient(hub.address, hub.token, 0, hello=False)
        lazy.send(wire.KIND_HELLO, {"role": "rank", "nonce": auth.new_nonce(),
                                    "auth": auth.VERSION, "identity": {"rank": 0}})
        assert lazy.recv().kind == wire.KIND_CHALLENGE
        assert lazy.closed_by_hub(3.0)
        assert 0.9 < time.monotonic() - t0 < 2.5
        # half frames from one address: 8 held (until the deadline); each one more closes
        # the oldest (issue 24, G: evicted, not the newcomer refused)
        half = wire.encode(wire.KIND_HELLO, {"pad": "y" * 100})[:20]
        socks = []
        for _ in range(10):
            s = socket.create_connection(wire.parse_address(hub.address))
            s.sendall(half)
            socks.append(s)
        time.sleep(0.2)
        refused_now = sum(closed(s, 0.01) for s in socks)
        assert refused_now == 2, refused_now
        # another address still gets in meanwhile (here 127.0.0.2), and is welcomed
        other = RankClient(hub.address, hub.token, 1, source="127.0.0.2")
        assert other.recv().kind == wire.KIND_WELCOME
        assert all(closed(s, 3.0) for s in socks), "held past the authentication deadline"
        for s in socks:
            s.close()
        # pending bytes, overall: 15 kB half frames; the third goes over 40 kB
        partial = empty_maps_frame(16_000)[:15_000]
        socks = []
        for _ in range(3):
            s = socket.create_connection(wire.parse_address(hub.address))
            s.sendall(partial)
            socks.append(s)
            time.sleep(0.1)
        assert [closed(s, 0.01) for s in socks] == [False, False, True]
        for s in socks:
            s.close()
        # (issue 24, G) the half frames beyond 8 and the newcomer from 127.0.0.2 each
        # closed the oldest of the loopback group; the pending bytes refused the third
        assert hub.hub.counters["evicted"] >= 3 and hub.hub.counters["busy"] >= 1
        # and after all that, a rank from the same address is welcomed
        ok = RankClient(hub.address, hub.token, 0)
        assert ok.recv().kind == wire.KIND_WELCOME
    finally:
        hub.stop()


# ---- A: mutual authentication, no secret on the wire, roles --------------------------------


class Tap(Server):
    """A TCP relay in front of the hub that keeps every byte, both ways."""

    def __init__(self, target: str) -> None:
        self.target = wire.parse_address(target)
        self.seen = bytearray()
        self.lock = threading.Lock()
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        other = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(other, conn), daemon=True).start()
        self._pipe(conn, other)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def test_role_tokens_keys_and_proofs():
    """The master derives a token per role (through scrypt: ~80 ms a guess); a role
    token yields its own role's key and no other; proofs are bound to the side, the
    role and both nonces."""
    master = "master-token-0123456789"
    toks = {r: auth.role_token(master, r) for r in ROLES}
    stretched = hashlib.scrypt(master.encode(), salt=b"rtop-role-v2", n=1 << 14, r=8, p=1,
                               dklen=32)
    assert toks["view"] == "rtop-view-" + base64.urlsafe_b64encode(hmac.new(
        stretched, b"rtop-role-v2:view", hashlib.sha256).digest()).decode()[:32]
    for role, tok in toks.items():
        assert auth.token_role(tok) == role and tok != master
        assert auth.key_for(tok, role) == auth.key_for(master, role)
        assert all(auth.key_for(tok, other) is None for other in ROLES if other != role)
    assert len({auth.key_for(master, r) for r in ROLES}) == 3
    assert auth.token_role(master) is None
    assert auth.key_for("", "view") is None and auth.key_for(None, "view") is None
    assert auth.role_token("another-master", "view") != toks["view"]
    with pytest.raises(ValueError, match="unknown role"):
        auth.role_token(master, "admin")
    key, nc, ns = auth.key_for(master, "ingest"), auth.new_nonce(), auth.new_nonce()
    assert key is not None and len(nc) >= 16 and nc != ns
    proof = auth.hub_proof(key, "rank", nc, ns)
    assert proof == hmac.new(key, b"rtop-auth-v2|hub|rank|" + nc + b"|" + ns,
                             hashlib.sha256).digest()
    assert auth.client_proof(key, "rank", ns, nc) == hmac.new(
        key, b"rtop-auth-v2|client|rank|" + ns + b"|" + nc, hashlib.sha256).digest()
    others = {auth.client_proof(key, "rank", ns, nc), auth.hub_proof(key, "viewer", nc, ns),
              auth.hub_proof(key, "rank", nc, auth.new_nonce()),
              auth.hub_proof(auth.key_for(master, "view") or b"", "rank", nc, ns)}
    assert proof not in others
    assert auth.check(proof, proof) and not auth.check(proof, proof[:-1] + b"x")
    assert not auth.check(proof, proof.hex()) and not auth.check(proof, None)
    assert not auth.valid_nonce(b"x" * 15) and not auth.valid_nonce("x" * 16)
def _secrets(master: str) -> dict[str, str]:
    return {"master": master, **{r: auth.role_token(master, r) for r in ROLES}}


def test_no_token_ever_travels_between_a_rank_a_viewer_and_the_hub(tmp_path):
    """Before: the rank's and the viewer's hello carried the token in the clear."""
    hub = ThreadedHub(record=str(tmp_path / "run.rtop"), token="wire-master-token-0123").start()
    tap = Tap(hub.address)
    try:
        cfg = ProbeConfig(hub=tap.address, token=hub.token, backoff_initial_s=0.01)
        conn = HubConnection(cfg, detect())
        deadline = time.monotonic() + 10
        while conn.state is not ConnState.UP and time.monotonic() < deadline:
            conn.pump(time.monotonic())
            time.sleep(0.01)
        assert conn.state is ConnState.UP
        conn.close()
        with HubClient(tap.address, hub.token) as c:
            c.snapshot()
        with HubClient(tap.address, auth.role_token(hub.token, "view")) as c:
            c.snapshot()
        time.sleep(0.2)
        with tap.lock:
            seen = bytes(tap.seen)
        assert b"challenge" in seen and b"auth" in seen  # the handshake went through here
        for name, secret in _secrets(hub.token).items():
            assert secret.encode() not in seen, f"the {name} token travelled"
    finally:
        tap.close()
        hub.stop()


class Impostor(Server):
    """Whoever took the hub's port: it does not hold the token. It answers a hello with
    a challenge whose proof is made with another key, then a welcome and a control
    frame, and keeps everything the rank sends."""

    def __init__(self, port: int) -> None:
        self.received = bytearray()
        super().__init__(port)

    def serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                data = conn.recv(65536)
                self.received += data
                [hello] = wire.FrameDecoder().feed(data)
                key = auth.key_for("a-guess-not-the-token", "ingest")
                assert key is not None
                ns = auth.new_nonce()
                conn.sendall(wire.encode(wire.KIND_CHALLENGE, {
                    "nonce": ns, "proof": auth.hub_proof(key, "rank",
                                                         hello.payload["nonce"], ns)})
                    + wire.encode(wire.KIND_WELCOME, {"t_hub": 0.0})
                    + wire.encode(wire.KIND_CONTROL, {"command": "profile"}))
                while data := conn.recv(65536):
                    self.received += data
            except (OSError, ValueError, KeyError):
                pass


def test_a_rank_sends_nothing_to_a_hub_that_cannot_prove_itself():
    """Before: whoever took the port got the token in the hello, and a welcome from it
    was enough for the rank to stream to it and obey its control frames. Now it gets
    the hello and the rank's proof (the peer proves first: collectors.auth; a proof
    keyed through scrypt, or by a role token's 192 bits), and nothing more: the welcome's
    proof does not check out."""
    port, token = free_port(), "the-real-token-0123456789"
    impostor = Impostor(port)
    controls: list[wire.Frame] = []
    cfg = ProbeConfig(hub=f"127.0.0.1:{port}", token=token, backoff_initial_s=0.01,
                      backoff_max_s=0.1)
    conn = HubConnection(cfg, detect(), on_control=controls.append)
    conn.send(wire.encode(wire.KIND_BATCH, {"rank": 0, "group": "g", "seq": 1}), 1)
    try:
        assert wait_for(lambda: (conn.pump(time.monotonic()), conn.unproven_hubs >= 2)[1])
        assert conn.state is not ConnState.UP and not controls
        assert conn.sent_records == 0 and conn.queued_frames == 1  # kept for the real hub
        frames = wire.FrameDecoder().feed(bytes(impostor.received))
        kinds = {f.kind for f in frames}
        assert wire.KIND_HELLO in kinds and kinds <= {wire.KIND_HELLO, wire.KIND_AUTH}, \
            "sent more than its hello and its proof"
        for f in frames:
            assert "token" not in f.payload
        for secret in _secrets(token).values():
            assert secret.encode() not in impostor.received
    finally:
        conn.close()
        impostor.close()


def test_roles_each_token_does_only_its_own(tmp_path):
    """An ingest token sends, a view token views (and scrapes), only a control token (or
    the master) acts; /metrics takes the view token only. Before: one token did all."""
    hub = ThreadedHub(record=str(tmp_path / "run.rtop"), token="roles-master-token-0123").start()
    tok = {r: auth.role_token(hub.token, r) for r in ROLES}
    try:
        # ingest: a rank works with it alone; it cannot view
        r = RankClient(hub.address, tok["ingest"], 0, world=1)
        assert r.recv().kind == wire.KIND_WELCOME
        r.batch(steps=[step_row(0)])
        with pytest.raises(HubError, match=r"cannot connect .* as a viewer"):
            HubClient(hub.address, tok["ingest"])
        v = RankClient(hub.address, tok["ingest"], role="viewer")
        assert v.recv().payload["code"] == "token"
        # a rank cannot send control frames (nor view)
        r.send(wire.KIND_CONTROL, {"command": "profile"})
        err = r.recv()
        assert err.kind == wire.KIND_ERROR and err.payload["code"] == "forbidden"
        # view: a viewer works with it alone; it cannot act or send
        with HubClient(hub.address, tok["view"]) as c:
            assert wait_for(lambda: c.snapshot()["ranks"]["step"] == [0])
        with pytest.raises(HubError, match="as a control"):
            HubClient(hub.address, tok["view"], role="control")
        for role in ("control", "rank"):
            bad = RankClient(hub.address, tok["view"], 5, role=role)
            assert bad.recv().payload["code"] == "token"
        viewer = RankClient(hub.address, tok["view"], role="viewer")
        assert viewer.recv().kind == wire.KIND_WELCOME
        viewer.send(wire.KIND_CONTROL, {"command": "profile"})
        assert viewer.recv().payload["code"] == "forbidden"
        # control: accepted from the control role (an action it cannot do is refused
        # with the reason, and the connection stays)
        ctl = RankClient(hub.address, tok["control"], role="control")
        assert ctl.recv().kind == wire.KIND_WELCOME
        ctl.send(wire.KIND_CONTROL, {"id": "x", "action": "profile", "ranks": [9]})
        answer = ctl.recv()
        assert answer.kind == wire.KIND_RESULT and answer.payload["state"] == "refused"
        # (the rank above was closed for its control frame: no rank is left)
        assert "no rank is connected" in answer.payload["error"]
        assert not ctl.closed_by_hub(0.3)
        with HubClient(hub.address, hub.token, role="control") as c:  # the master too
            c.snapshot()
        # /metrics: the view token only, in the header only
        url = f"http://{hub.address}/metrics"

        def scrape(token: str | None, query: str = "") -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            try:
                return urllib.request.urlopen(urllib.request.Request(
                    url + query, headers=headers), timeout=5).status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert scrape(tok["view"]) == 200
        assert scrape(None, f"?token={tok['view']}") == 401
        assert scrape(None, f"?token={hub.token}") == 401
        for acting in (hub.token, tok["control"], tok["ingest"]):
            assert scrape(acting) == 403
        assert scrape("not-a-token") == 401
    finally:
        hub.stop()


def test_rtop_token_gives_each_role_its_token_and_never_a_stronger_one():
    """``rtop token ROLE`` derives a role's token from the master (RTOP_TOKEN); the view
    token it prints works for a viewer; a role token never yields another role's."""
    hub = ThreadedHub(record="", token="token-cli-master-0123456").start()
    try:
        def rtop_token(role: str, token: str) -> subprocess.CompletedProcess[str]:
            env = dict(_env(None), RTOP_TOKEN=token)
            return subprocess.run([sys.executable, "-m", "rtop.cli", "token", role,
                                   hub.address], env=env, capture_output=True, text=True,
                                  timeout=60)

        for role in ROLES:
            out = rtop_token(role, hub.token)
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == auth.role_token(hub.token, role)
        view = rtop_token("view", hub.token).stdout.strip()
        with HubClient(hub.address, view) as c:
            c.snapshot()
        assert rtop_token("view", view).stdout.strip() == view  # its own: as it is
        refused = rtop_token("control", view)
        assert refused.returncode == 2 and "cannot give the control token" in refused.stderr
        assert view not in refused.stderr + refused.stdout
    finally:
        hub.stop()


def test_off_loopback_short_tokens_are_refused_and_failures_throttled(caplog):
    """Before: any token, however short, beyond loopback, and unlimited guesses."""
    with pytest.raises(ValueError, match="shorter than 16 characters"):
        Hub(HubConfig(host="0.0.0.0", token="short-token"))
    with pytest.raises(ValueError, match="without a token"):
        Hub(HubConfig(host="0.0.0.0", token=""))
    # long enough, but words a guesser tries first (issue 24, C): refused, saying how weak
    with pytest.raises(ValueError, match=r"too weak .* about 55 bits"):
        Hub(HubConfig(host="0.0.0.0", token="sixteen-chars-ok"))
    Hub(HubConfig(host="0.0.0.0", token="Xq7-vT2k_9Lm4pZr8wYc"))  # strong enough (not started)
    Hub(HubConfig(host="127.0.0.1", token="short"))  # loopback: the user's own business
    with pytest.raises(ValueError, match="master token, not a role token"):
        Hub(HubConfig(token=auth.role_token("m" * 20, "view")))
    hub = ThreadedHub(record="", throttle_loopback=True, throttle_failures=5,
                      throttle_window_s=60, throttle_block_s=1.5).start()
    try:
        with caplog.at_level(logging.WARNING, logger="rtop.hub"):
            for _ in range(5):
                guess = RankClient(hub.address, "a-wrong-guess-0123456789", 0)
                assert guess.recv().payload["code"] == "token"
            # the address is refused now, even with the right token
            t0 = time.monotonic()
            blocked = RankClient(hub.address, hub.token, 0, hello=False)
            assert blocked.closed_by_hub(1.0) and time.monotonic() - t0 < 0.5
            assert hub.hub.counters["throttled"] >= 1
            assert wait_for(lambda: (RankClient(hub.address, hub.token, 0).recv() or
                                     wire.Frame("", {})).kind == wire.KIND_WELCOME,
                            timeout=5, every=0.3)
        assert caplog.text.count("failed to authenticate 5 times") == 1
    finally:
        hub.stop()
    # on loopback, by default, a misconfigured rank on the node locks nobody out
    hub = ThreadedHub(record="").start()
    try:
        for _ in range(8):
            RankClient(hub.address, "a-wrong-guess-0123456789", 0).recv()
        assert RankClient(hub.address, hub.token, 0).recv().kind == wire.KIND_WELCOME
    finally:
        hub.stop()


# ---- C: finding 2, HTTP never timed out -----------------------------------------------------


def measure_get_flood(address: str, n: int = 200, watch_s: float = 7.0
                      ) -> dict[str, Any]:
    """Finding 2: ``n`` sockets that send only ``GET ``; how many are open over time."""
    host, port = wire.parse_address(address)
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port))
        s.sendall(b"GET ")
        socks.append(s)
    t0 = time.monotonic()
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    open_at: dict[float, int] = {}
    still = set(socks)
    marks = [0.5, 2.0, 4.0, 6.0, watch_s]
    while marks:
        left = marks[0] - (time.monotonic() - t0)
        if left <= 0:
            open_at[marks.pop(0)] = len(still)
            continue
        for key, _ in sel.select(min(left, 0.1)):
            s = key.fileobj
            try:
                data = s.recv(4096)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                still.discard(s)  # type: ignore[arg-type]
    for s in socks:
        s.close()
    return {"n": n, "open_at": open_at}


def test_finding2_http_requests_have_a_deadline_and_limits():
    """200 sockets that sent only "GET ": before, all stayed open for good (and with
    the file limit they could lock every rank out). Now: at most 8 from one address are
    held, and not past the 5 s deadline; a rank gets in meanwhile."""
    hub = ThreadedHub(record="").start()
    try:
        result: dict[str, Any] = {}
        flood = threading.Thread(target=lambda: result.update(
            measure_get_flood(hub.address)))
        flood.start()
        assert wait_for(lambda: hub.hub.counters["connections"] >= 200, timeout=10)
        t0 = time.monotonic()
        rank = RankClient(hub.address, hub.token, 0, world=1)
        assert rank.recv().kind == wire.KIND_WELCOME
        welcomed = time.monotonic() - t0
        flood.join(30)
        opened = result["open_at"]
        print("\nfinding 2: 200 sockets that sent only 'GET ': open after "
              + ", ".join(f"{t:.1f} s: {k}" for t, k in opened.items())
              + f"; a rank was welcomed in {welcomed * 1e3:.0f} ms meanwhile")
        assert opened[0.5] <= HubConfig.max_http_per_addr
        assert opened[6.0] == 0
        assert welcomed < 2.0
        # a request head over the size limit is closed at once
        with socket.create_connection(wire.parse_address(hub.address)) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 10_000)
            assert closed(s, 1.0)
        # a slow request that keeps sending is closed by the deadline all the same
        with socket.create_connection(wire.parse_address(hub.address)) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 7:
                try:
                    s.sendall(b"X")
                except OSError:
                    break
                time.sleep(0.2)
            assert closed(s, 0.5) and time.monotonic() - t0 < 6.5
    finally:
        hub.stop()


# ---- D: finding 5, forged hub frames --------------------------------------------------------


def test_finding5_a_rank_cannot_forge_the_hubs_own_frames(tmp_path):
    """Before: a rank's ``run`` frame changed what every viewer saw, its ``clock`` and
    ``finding`` frames were recorded (an infinite clock broke ``rtop report --json``),
    and its ``conn`` frame marked other ranks lost."""
    record = tmp_path / "run.rtop"
    hub = ThreadedHub(job="forge-job", record=str(record), lost_after_s=60).start()
    try:
        victim = RankClient(hub.address, hub.token, 1, world=2)
        assert victim.recv().kind == wire.KIND_WELCOME
        victim.batch(steps=[step_row(0)])
        with HubClient(hub.address, hub.token) as c:
            assert wait_for(lambda: c.snapshot()["ranks"]["step"] == [0])
            before = c.snapshot()
        forged = {
            "run": {"hub": {"address": "evil:1", "pid": 1}, "job": "evil-job",
                    "record": "/tmp/evil.rtop"},
            "clock": {"t_hub": math.inf},
            "finding": {"event": "onset", "kind": "straggler", "ranks": [1],
                        "severity": "critical", "summary": "FORGED", "evidence": {}},
            "conn": {"event": "close", "rank": 1, "group": "g0", "clean": False},
            "offset": {"rank": 1, "group": "g0", "offset_s": 1e9, "rtt_s": 0.0},
            "snapshot": {"ranks": {}},
            "welcome": {},
            "auth": {"proof": b"x" * 32},
        }
        for kind, payload in forged.items():
            forger = RankClient(hub.address, hub.token, 0, world=2)
            assert forger.recv().kind == wire.KIND_WELCOME
            forger.send(kind, payload)
            err = forger.recv()
            assert err is not None and err.kind == wire.KIND_ERROR, kind
            assert err.payload["code"] == "forbidden" and repr(kind) in err.payload["message"]
            assert forger.closed_by_hub()
        assert hub.hub.counters["forbidden"] == len(forged)
        with HubClient(hub.address, hub.token) as c:
            after = c.snapshot()
        assert after["run"] == before["run"], "a forged run frame changed the run"
        assert after["ranks"]["status"][after["ranks"]["rank"].index(1)] == "active"
        assert all(f["summary"] != "FORGED" for f in after.get("findings") or [])
    finally:
        hub.stop()
    frames = [f for _, f in read(record)]
    assert [f.kind for f in frames].count("run") == 1
    assert not any(f.kind == "finding" and f.payload.get("summary") == "FORGED"
                   for f in frames)
    assert all(math.isfinite(f.payload["t_hub"]) for f in frames if f.kind == "clock")
    assert not any(f.kind == "conn" and f.payload.get("rank") == 1 for f in frames)
    assert not any(f.kind == "offset" and f.payload.get("offset_s") == 1e9 for f in frames)
    out = subprocess.run([sys.executable, "-m", "rtop", "report", str(record), "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["run"]["job"] != "evil-job"


# ---- E: finding 8, log flooding ----------------------------------------------------------------


def test_finding8_what_peers_send_is_logged_short_quoted_and_rate_limited(caplog):
    """Before: a 1 MB frame kind made a 1 MB log line, names went to the log raw, and
    every refusal was a line of its own."""
    hub = ThreadedHub(record="", log_every_s=10.0, log_summary_s=1.0).start()
    try:
        with caplog.at_level(logging.INFO, logger="rtop.hub"):
            r = RankClient(hub.address, hub.token, 0, world=1,
                           host="node\x1b]0;owned\x07" + "n" * 5000)
            r.recv()
            huge = RankClient(hub.address, hub.token, 1, world=2)
            assert huge.recv().kind == wire.KIND_WELCOME
            huge.send("K" * 1_000_000, {})
            assert huge.closed_by_hub()
            assert "KKKK" in caplog.text
            # before authentication too, from other addresses (one line each)
            for source in ("127.0.0.2", "127.0.0.3"):
                s = socket.create_connection(wire.parse_address(hub.address),
                                             source_address=(source, 0))
                s.sendall(wire.encode("X" * 15_000, {}))
                assert closed(s, 2.0)
                s.close()
            lines = caplog.text.splitlines()
            assert max(len(line) for line in lines) < 400, max(lines, key=len)[:200]
            assert "\x1b" not in caplog.text and "\x07" not in caplog.text
            # 30 refusals from one address: logged once, then counted
            caplog.clear()
            for _ in range(30):
                with socket.create_connection(wire.parse_address(hub.address),
                                              source_address=("127.0.0.4", 0)) as s:
                    s.sendall(b"\x00garbage, not a frame")
                    assert closed(s, 2.0)
            assert wait_for(lambda: "more refusals" in caplog.text, timeout=3)
        refusals = [ln for ln in caplog.text.splitlines() if "127.0.0.4" in ln]
        assert len(refusals) == 1, refusals
        assert "30 more refusals" in caplog.text or "29 more refusals" in caplog.text
    finally:
        hub.stop()


# ---- F: finding 11, a hostile hub must not blow up the training process -------------------

RANK_SCRIPT = """
import os, sys, time
import collectors

hub, token, out, stop = sys.argv[1:5]
probe = collectors.start(hub=hub, token=token, flush_interval_s=0.1, backoff_max_s=1.0)
with open(out, "w") as f:
    i = 0
    for _ in probe.iter(iter(int, 1)):
        t0 = time.perf_counter()
        with probe.step():
            x = 0
            for k in range(20000):
                x += k * k
        f.write(f"{time.time():.4f} {time.perf_counter() - t0:.6f}\\n")
        i += 1
        if i % 20 == 0:
            f.flush()
            if os.path.exists(stop):
                break
probe.close()
"""


class HostileHub(Server):
    """Answers each connection with a frame of ``body_bytes`` of empty msgpack maps."""

    def __init__(self, port: int, body_bytes: int = 8_000_000) -> None:
        self.frame = empty_maps_frame(body_bytes)
        super().__init__(port)

    def serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(self.frame)
                while conn.recv(65536):
                    pass
            except OSError:
                pass


def _steps(path: Path) -> list[tuple[float, float]]:
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((float(parts[0]), float(parts[1])))
    return out


def measure_hostile_hub(tmp: Path, hostile_s: float = 6.0, pythonpath: str | None = None,
                        then_listener: bool = True) -> dict[str, Any]:
    """Finding 11: a rank trains with nothing at its hub's address, then a hostile hub
    takes the port for ``hostile_s``, then (``then_listener``) a real one."""
    port, token = free_port(), "hostile-test-token-0123"
    out, stop = tmp / "steps.txt", tmp / "stop"
    env = {**_env(pythonpath), "RANK": "0", "WORLD_SIZE": "1", "RTOP_AUTOHUB": "0"}
    proc = subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, f"127.0.0.1:{port}", token,
                             str(out), str(stop)], env=env, cwd=pythonpath or ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res: dict[str, Any] = {}
    listener = hostile = None
    try:
        assert wait_for(lambda: out.exists() and len(_steps(out)) > 50, timeout=30)
        time.sleep(1.5)  # the baseline: training, its hub not there yet
        t_hostile = time.time()
        res["rss_before"] = psutil.Process(proc.pid).memory_info().rss
        res["peak_before"] = peak_rss(proc.pid)
        hostile = HostileHub(port)
        time.sleep(hostile_s)
        res["rss_after"] = psutil.Process(proc.pid).memory_info().rss
        res["peak_after"] = peak_rss(proc.pid)
        res["connections"] = hostile.connections
        hostile.close()
        t_end = time.time()
        steps = _steps(out)
        base = [d for t, d in steps if t < t_hostile]
        during = [d for t, d in steps if t_hostile <= t < t_end]
        res["base_rate"] = len(base) / (max(t for t, _ in steps if t < t_hostile)
                                        - steps[0][0])
        res["hostile_rate"] = len(during) / (t_end - t_hostile)
        res["base_median"] = sorted(base)[len(base) // 2]
        res["hostile_median"] = sorted(during)[len(during) // 2] if during else None
        res["hostile_max"] = max(during) if during else None
        if then_listener:
            listener = Listener(port=port, token=token)
            res["recovered"] = wait_for(lambda: len(listener.records().get(0, [])) > 10,
                                        timeout=15)
    finally:
        stop.touch()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        if hostile is not None:
            hostile.close()
        if listener is not None:
            listener.close()
    res["log"] = proc.stdout.read() if proc.stdout else ""
    return res


@pytest.mark.job
def test_finding11_a_hostile_hub_cannot_blow_up_the_training_process(tmp_path):
    """A listener on the hub's address answers each connection with an 8 MB frame of
    empty maps. Before: +563 MB in every rank, decoded on the sender thread under the
    GIL. Now the rank refuses it at the header, keeps training at the same pace, and
    streams to the real hub once there is one."""
    m = measure_hostile_hub(tmp_path)
    print(f"\nfinding 11: a hostile hub (8 MB of empty maps per connection, "
          f"{m['connections']} connections in 6 s): rank RSS {m['rss_before'] / 1e6:.0f} MB "
          f"-> {m['rss_after'] / 1e6:.0f} MB (+{(m['rss_after'] - m['rss_before']) / 1e6:.1f}"
          f" MB), peak {m['peak_before'] / 1e6:.0f} -> {m['peak_after'] / 1e6:.0f} MB; "
          f"steps/s {m['base_rate']:.0f} before, {m['hostile_rate']:.0f} during; median "
          f"step {m['base_median'] * 1e3:.2f} ms before, {m['hostile_median'] * 1e3:.2f} ms "
          f"during (max {m['hostile_max'] * 1e3:.1f} ms)")
    assert m["connections"] >= 2, "the rank did not keep trying"
    assert m["peak_after"] - m["peak_before"] < 20e6, m
    assert m["hostile_rate"] > 0.7 * m["base_rate"], m
    assert m["recovered"], f"no steps reached the real hub afterwards: {m['log'][-2000:]}"
    assert "could not prove it holds" in m["log"] or "bad frame" in m["log"] or \
        "before proving itself" in m["log"]


# ---- G: finding 3, no secret in anything a run writes -------------------------------------


def _walk(obj: Any) -> Any:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


@pytest.mark.job
def test_finding3_no_token_in_any_file_a_run_writes(tmp_path, monkeypatch):
    """A node-local hub started by real ranks (recording, discovery file, its log),
    a viewer, ``rtop status`` and a /metrics scrape: then every file under the run's
    directories is searched for the master token and every role token. Only the key
    file beside the discovery file (0600, how viewers on the node act on the job) may
    hold the master, and the discovery file (0600) only the ranks' ingest token.
    Before: every recording held the token (the rank's hello, recorded as received)."""
    monkeypatch.setenv("RTOP_AUTOHUB", "1")
    runs, xdg = tmp_path / "runs", tmp_path / "xdg"
    spec = WorkloadSpec(world_size=2, steps=25, dim=64, hidden=128)
    run_local(spec, timeout_s=180)
    from collectors.discovery import runtime_dir

    files = list(runtime_dir().glob("hub-*.json"))
    assert len(files) == 1, files
    discovery = files[0]
    info = json.loads(discovery.read_text())
    assert stat.S_IMODE(discovery.stat().st_mode) == 0o600
    key = discovery.with_name(f"{discovery.stem}.key")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    master = json.loads(key.read_text())["token"]
    secrets = _secrets(master)
    assert info["token"] == secrets["ingest"]
    try:
        with HubClient(info["address"], secrets["view"]) as c:
            assert c.snapshot()["ranks"]["rank"] == [0, 1]
        status = subprocess.run([sys.executable, "-m", "rtop", "status", "--json"],
                                capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert status.returncode == 0, status.stderr
        req = urllib.request.Request(f"http://{info['address']}/metrics",
                                     headers={"Authorization": f"Bearer {secrets['view']}"})
        assert b"rtop_rank_up" in urllib.request.urlopen(req, timeout=5).read()
    finally:
        os.kill(info["pid"], signal.SIGTERM)
    assert wait_for(lambda: not psutil.pid_exists(info["pid"]) or
                    psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE, timeout=15)
    written = [p for base in (runs, xdg) for p in base.rglob("*") if p.is_file()]
    recordings = [p for p in written if p.suffix == ".rtop"]
    assert recordings, written
    found = []
    for path in written:
        data = path.read_bytes() + (plain_bytes(path) if path.suffix == ".rtop" else b"")
        for name, secret in secrets.items():
            if secret.encode() in data and not ((path == discovery and name == "ingest")
                                                or (path == key and name == "master")):
                found.append(f"{path.relative_to(tmp_path)} holds the {name} token")
    assert not found, found
    for rec in recordings:
        for _, frame in read(rec):
            assert frame.kind not in (wire.KIND_AUTH, wire.KIND_CHALLENGE), frame.kind
            keys = set(_walk(frame.payload))
            assert not keys & {"token", "nonce", "proof"}, (frame.kind, keys)


def test_the_recorded_hello_holds_nothing_of_the_handshake(tmp_path):
    """The hub records a rank's hello once it has authenticated, without its nonce; an
    old client's hello with a token in it is refused and never recorded."""
    record = tmp_path / "run.rtop"
    hub = ThreadedHub(record=str(record), token="recorded-master-token").start()
    try:
        r = RankClient(hub.address, hub.token, 0, world=1)
        assert r.recv().kind == wire.KIND_WELCOME
        old = RankClient(hub.address, hub.token, 1, hello=False)
        old.send(wire.KIND_HELLO, {"role": "rank", "token": hub.token,
                                   "identity": {"rank": 1}})
        err = old.recv()
        assert err.kind == wire.KIND_ERROR and err.payload["code"] == "protocol"
    finally:
        hub.stop()
    data = record.read_bytes() + plain_bytes(record)  # as stored, and decompressed
    for secret in _secrets(hub.token).values():
        assert secret.encode() not in data
    hellos = [f for _, f in read(record) if f.kind == wire.KIND_HELLO]
    assert len(hellos) == 1 and hellos[0].payload["identity"]["rank"] == 0
    assert "nonce" not in hellos[0].payload and "token" not in hellos[0].payload
