"""A hand-driven rank for hub tests: speaks the protocol over a real socket, step by step,
so a test can send exactly the frames (good or bad) it needs, the handshake included."""

from __future__ import annotations

import socket
import time
from typing import Any

from collectors import auth, wire
from collectors.schema import GPU_FIELDS, HEARTBEAT_FIELDS, STEP_FIELDS


def identity(rank: int, world: int = 2, group: str = "g0", job: str = "test-job",
             host: str = "node-a") -> dict[str, Any]:
    return {"rank": rank, "local_rank": rank, "world_size": world, "hostname": host,
            "ip": "127.0.0.1", "pid": 1000 + rank, "attempt": 0, "job": job,
            "group": group, "node_id": "", "source": "env"}


def step_row(step: int, step_s: float = 0.05, data: float = 0.001, comm: float = 0.01,
             nbytes: int = 4_000_000) -> list[Any]:
    row: dict[str, Any] = dict.fromkeys(STEP_FIELDS)
    row.update(step=step, t_wall=time.time(), step_s=step_s, data_wait_s=data,
               compute_s=step_s - data - comm, comm_s=comm, comm_exposed_s=comm / 2,
               comm_bytes=nbytes, comm_calls=1, algbw_Bps=nbytes / comm,
               busbw_Bps=nbytes / comm, samples=32, gap_s=0.0)
    return [row[f] for f in STEP_FIELDS]


def gpu_row(util: float = 95.0) -> list[Any]:
    row: dict[str, Any] = dict.fromkeys(GPU_FIELDS)
    row.update(t_wall=time.time(), util_pct=util, mem_used_bytes=70e9, mem_total_bytes=141e9,
               power_w=600.0, power_limit_w=700.0, temp_c=60, sm_clock_mhz=1980,
               sm_clock_max_mhz=1980, clock_event_reasons=0)
    return [row[f] for f in GPU_FIELDS]


def hb_row(phase: str = "compute", phase_s: float = 0.01, step: int = 0,
           stack: str | None = None) -> list[Any]:
    row = {"t_wall": time.time(), "phase": phase, "phase_s": phase_s, "step": step,
           "stack": stack}
    return [row[f] for f in HEARTBEAT_FIELDS]


class RankClient:
    """One connection to a hub, as a rank (or ``role="viewer"``/``"control"``), from
    ``source`` (another loopback address, say) if given.

    With ``hello`` (the default) it goes through the handshake of
    :mod:`collectors.auth`: hello with a nonce, the hub's challenge, its proof; what the
    hub sends after the challenge (the welcome with the hub's proof, an error) is left
    for :meth:`recv`, so a test sees the hub refuse a wrong token
    (:meth:`welcome_proven` checks a welcome).
    """

    def __init__(self, address: str, token: str, rank: int = 0, *, hello: bool = True,
                 role: str = "rank", source: str | None = None,
                 instance: bytes | None = None, **ident: Any) -> None:
        self.sock = socket.create_connection(wire.parse_address(address), timeout=10,
                                             source_address=(source, 0) if source else None)
        self.dec = wire.FrameDecoder()
        self.rank = rank
        self.group = ident.get("group", "g0")
        self.frames: list[wire.Frame] = []
        self.hub_proven: bool | None = None
        self._expect_hub = b""
        self.challenge: wire.Frame | None = None
        if hello:
            extra: dict[str, Any] = {"identity": identity(rank, **ident)} \
                if role == "rank" else {}
            if instance is not None:  # a rank process's secret (collectors.connection)
                extra["instance"] = instance
            self.handshake(token, role, {"clock": {"t_wall": time.time()}, **extra})

    def handshake(self, token: str, role: str, hello: dict[str, Any]) -> bool:
        """hello -> challenge -> auth: the peer proves itself first. True once the
        challenge came (the hub then proves itself in its welcome, which is left for
        :meth:`recv`: :meth:`welcome_proven` checks it). A hub that answers the hello
        with something else (an error) leaves it to :meth:`recv`."""
        nonce = auth.new_nonce()
        self.send(wire.KIND_HELLO, {"role": role, "nonce": nonce, "auth": auth.VERSION,
                                    **hello})
        frame = self.recv()
        if frame is None or frame.kind != wire.KIND_CHALLENGE:
            if frame is not None:
                self.frames.insert(0, frame)
            return False
        self.challenge = frame
        hub_nonce = frame.payload["nonce"]
        key = auth.key_for(token, auth.HELLO_ROLES[role]) or b"no key for this role"
        self._expect_hub = auth.hub_proof(key, role, nonce, hub_nonce)
        self.send(wire.KIND_AUTH, {"proof": auth.client_proof(key, role, hub_nonce, nonce)})
        return True

    def welcome_proven(self, welcome: wire.Frame) -> bool:
        """Whether a welcome carries the hub's proof that it holds the token."""
        self.hub_proven = auth.check(self._expect_hub, welcome.payload.get("proof"))
        return self.hub_proven

    def send(self, kind: str, payload: dict[str, Any]) -> None:
        self.sock.sendall(wire.encode(kind, payload))

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def batch(self, **tables: Any) -> None:
        self.send(wire.KIND_BATCH, {"rank": self.rank, "group": self.group, "seq": 0,
                                    "t_wall": time.time(), "dropped": 0, **tables})

    def recv(self, timeout: float = 5.0) -> wire.Frame | None:
        """The next frame from the hub, or None if it closed the connection."""
        self.sock.settimeout(timeout)
        while not self.frames:
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                return None
            if not data:
                return None
            self.frames += self.dec.feed(data)
        return self.frames.pop(0)

    def closed_by_hub(self, timeout: float = 5.0) -> bool:
        """True once the hub has closed this connection (whatever it sent before)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                if not self.sock.recv(65536):
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()
