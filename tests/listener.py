"""A minimal real TCP listener that speaks the rank side of the wire protocol.

Used by the collector tests, independently of the hub: it accepts
connections, goes through the hub's side of the handshake (:mod:`collectors.auth`: a
challenge with its proof, the rank's proof checked, a welcome or a refusal), and
keeps every decoded frame after it, acknowledging each batch as it comes (``ack``, as
a hub does once it holds one).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import defaultdict
from typing import Any

from collectors import auth, wire
from collectors.schema import TABLES


class Listener:
    """Accepts rank connections on 127.0.0.1 and records their frames by rank."""

    def __init__(self, port: int = 0, token: str = "test-token") -> None:
        self.token = token
        self._srv = socket.create_server(("127.0.0.1", port))
        self.port = self._srv.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.frames: list[tuple[float, wire.Frame]] = []
        self.hellos: dict[int, dict[str, Any]] = {}
        self.refused = 0
        self._lock = threading.Lock()
        self._stop = False
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._srv.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self._srv.accept()
            except (TimeoutError, OSError):
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One rank: the hub's side of the handshake, then every frame kept."""
        dec = wire.FrameDecoder()
        expect: bytes | None = None  # the proof the rank's auth must carry
        proof = b""  # the hub's, sent in the welcome
        hello: dict[str, Any] | None = None
        with conn:
            while not self._stop:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                for frame in dec.feed(data):
                    if frame.kind == wire.KIND_HELLO and hello is None:
                        key = auth.key_for(self.token, "ingest")
                        assert key is not None
                        nonce, mine = frame.payload["nonce"], auth.new_nonce()
                        expect = auth.client_proof(key, "rank", mine, nonce)
                        proof = auth.hub_proof(key, "rank", nonce, mine)
                        hello = frame.payload
                        conn.sendall(wire.encode(wire.KIND_CHALLENGE, {"nonce": mine}))
                        continue
                    if frame.kind == wire.KIND_AUTH and expect is not None:
                        if not auth.check(expect, frame.payload.get("proof")):
                            self.refused += 1
                            conn.sendall(wire.encode(wire.KIND_ERROR, {
                                "code": "token", "message": "wrong token"}))
                            return
                        expect = None
                        assert hello is not None
                        with self._lock:
                            self.hellos[hello["identity"]["rank"]] = hello
                        conn.sendall(wire.encode(wire.KIND_WELCOME, {"t_hub": time.time(),
                                                                     "proof": proof}))
                        continue
                    with self._lock:
                        self.frames.append((time.time(), frame))
                    seq = frame.payload.get("seq")
                    if frame.kind == wire.KIND_BATCH and type(seq) is int and seq > 0:
                        with contextlib.suppress(OSError):
                            conn.sendall(wire.encode(wire.KIND_ACK, {"seq": seq}))

    def records(self, table: str = "steps") -> dict[int, list[dict[str, Any]]]:
        """Every record of a table received so far, as dicts, by rank."""
        fields = TABLES[table]
        out: dict[int, list[dict[str, Any]]] = defaultdict(list)
        with self._lock:
            frames = list(self.frames)
        for _, frame in frames:
            if frame.kind == wire.KIND_BATCH:
                for row in frame.payload.get(table, []):
                    out[frame.payload["rank"]].append(dict(zip(fields, row, strict=True)))
        return out

    def batches(self) -> list[dict[str, Any]]:
        with self._lock:
            return [f.payload for _, f in self.frames if f.kind == wire.KIND_BATCH]

    def close(self) -> None:
        self._stop = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._srv.close()
        self._thread.join(2)
