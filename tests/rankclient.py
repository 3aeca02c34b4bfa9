"""A hand-driven rank for hub tests: speaks the protocol over a real socket, step by step,
so a test can send exactly the frames (good or bad) it needs."""

from __future__ import annotations

import socket
import time
from typing import Any

from collectors import wire
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
    """One connection to a hub, as a rank."""

    def __init__(self, address: str, token: str, rank: int = 0, *, hello: bool = True,
                 **ident: Any) -> None:
        self.sock = socket.create_connection(wire.parse_address(address), timeout=10)
        self.dec = wire.FrameDecoder()
        self.rank = rank
        self.group = ident.get("group", "g0")
        self.frames: list[wire.Frame] = []
        if hello:
            self.send(wire.KIND_HELLO, {"role": "rank", "token": token,
                                        "identity": identity(rank, **ident),
                                        "clock": {"t_wall": time.time()}})

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
