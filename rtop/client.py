"""A blocking client for viewers: ask a hub for snapshots and rank details."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any, cast

from collectors import wire
from rtop.run.snapshot import RankDetail, Snapshot


class HubError(RuntimeError):
    """The hub refused us or the connection broke."""


class HubClient:
    """Connects to a hub as a viewer. ``with HubClient(addr, token) as c: c.snapshot()``."""

    def __init__(self, address: str, token: str | None, timeout: float = 10.0) -> None:
        host, port = wire.parse_address(address)
        self.address = address
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise HubError(f"cannot reach the hub at {address}: {exc}") from None
        self._dec = wire.FrameDecoder()
        self._pending: list[wire.Frame] = []
        self._sock.sendall(wire.encode(wire.KIND_HELLO, {
            "role": "viewer", "token": token or "",
            "clock": {"t_wall": time.time()}}))
        first = self._next()
        if first.kind == wire.KIND_ERROR:
            raise HubError(f"the hub refused us: {first.payload.get('message')}")
        if first.kind != wire.KIND_WELCOME:
            raise HubError(f"unexpected first frame {first.kind!r}")

    def _next(self) -> wire.Frame:
        while not self._pending:
            try:
                data = self._sock.recv(1 << 20)
            except OSError as exc:
                raise HubError(f"connection to the hub broke: {exc}") from None
            if not data:
                raise HubError("the hub closed the connection")
            self._pending += self._dec.feed(data)
        return self._pending.pop(0)

    def _expect(self, kind: str) -> dict[str, Any]:
        while True:
            frame = self._next()
            if frame.kind == kind:
                return frame.payload
            if frame.kind == wire.KIND_ERROR:
                raise HubError(str(frame.payload.get("message")))

    def snapshot(self) -> Snapshot:
        """The hub's current snapshot."""
        self._sock.sendall(wire.encode(wire.KIND_REQUEST, {"what": "snapshot"}))
        return cast(Snapshot, self._expect(wire.KIND_SNAPSHOT))

    def rank(self, rank: int) -> RankDetail:
        """One rank's full window (histories, stack, events)."""
        self._sock.sendall(wire.encode(wire.KIND_REQUEST, {"what": "rank", "rank": rank}))
        return cast(RankDetail, self._expect("rank"))

    def subscribe(self, rate_hz: float = 2.0) -> Iterator[Snapshot]:
        """Snapshots pushed by the hub at ``rate_hz``."""
        self._sock.sendall(wire.encode(wire.KIND_SUBSCRIBE, {"rate_hz": rate_hz}))
        while True:
            yield cast(Snapshot, self._expect(wire.KIND_SNAPSHOT))

    def close(self) -> None:
        """Disconnect."""
        self._sock.close()

    def __enter__(self) -> HubClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
