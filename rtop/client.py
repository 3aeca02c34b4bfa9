"""A blocking client for viewers: ask a hub for snapshots and rank details."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, cast

from collectors import auth, wire
from rtop.analysis.viewport import ViewRequest, viewport
from rtop.run.snapshot import RankDetail, Snapshot

#: What each client role authenticates as (see :mod:`collectors.auth`).
_KEY_ROLE = {"viewer": "view", "control": "control"}


class HubError(RuntimeError):
    """The hub refused us, could not prove itself, or the connection broke."""


class HubClient:
    """Connects to a hub as a viewer. ``with HubClient(addr, token) as c: c.snapshot()``.

    ``token`` is the hub's master token or, for a viewer, its view token (for
    ``role="control"``, its control token). It is never sent: the client proves it
    holds it, and the hub proves that it does in its welcome (:mod:`collectors.auth`);
    a hub that cannot gets nothing more, and :class:`HubError` says so.
    """

    def __init__(self, address: str, token: str | None, timeout: float = 10.0,
                 role: str = "viewer") -> None:
        host, port = wire.parse_address(address)
        self.address = address
        self._timeout = timeout
        self._seq = 0
        if role not in _KEY_ROLE:
            raise ValueError(f"unknown role {role!r} (viewer or control)")
        key = auth.key_for(token, _KEY_ROLE[role])
        if key is None:
            what = "no token" if not token else \
                f"a token for another role ({auth.token_role(token) or '?'})"
            raise HubError(f"cannot connect to the hub at {address} as a {role}: {what}; "
                           f"give the hub's token (RTOP_TOKEN) or its "
                           f"{_KEY_ROLE[role]} token")
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise HubError(f"cannot reach the hub at {address}: {exc}") from None
        # small frames only until the hub has proved itself
        self._dec = wire.FrameDecoder(wire.UNPROVEN_HUB_FRAME_BYTES)
        self._pending: list[wire.Frame] = []
        try:
            self._handshake(role, key)
        except BaseException:
            self._sock.close()
            raise

    def _handshake(self, role: str, key: bytes) -> None:
        nonce = auth.new_nonce()
        self._send(wire.KIND_HELLO, {"role": role, "nonce": nonce, "auth": auth.VERSION,
                                     "clock": {"t_wall": time.time()}})
        first = self._next()
        if first.kind == wire.KIND_ERROR:
            raise HubError(f"the hub at {self.address} refused us: "
                           f"{_clip(first.payload.get('message'))}")
        hub_nonce = first.payload.get("nonce")
        if first.kind != wire.KIND_CHALLENGE or not isinstance(hub_nonce, bytes) \
                or not auth.valid_nonce(hub_nonce):
            raise HubError(f"the hub at {self.address} answered the hello with "
                           f"{_clip(first.kind, 40)!r}, not a challenge (an older rtop, "
                           f"or not a hub); nothing sent to it")
        self._send(wire.KIND_AUTH, {"proof": auth.client_proof(key, role, hub_nonce, nonce)})
        welcome = self._next()
        if welcome.kind == wire.KIND_ERROR:
            hint = f" (is the token right? give the hub's token or its {_KEY_ROLE[role]} " \
                   f"token)" if welcome.payload.get("code") == "token" else ""
            raise HubError(f"the hub at {self.address} refused us: "
                           f"{_clip(welcome.payload.get('message'))}{hint}")
        if welcome.kind != wire.KIND_WELCOME:
            raise HubError(f"unexpected frame {_clip(welcome.kind, 40)!r} from the hub at "
                           f"{self.address}")
        if not auth.check(auth.hub_proof(key, role, nonce, hub_nonce),
                          welcome.payload.get("proof")):
            raise HubError(f"the hub at {self.address} could not prove it holds the token "
                           f"(is the token right? or that is not the hub it should be); "
                           f"nothing more sent to it")
        self._dec.max_bytes = wire.MAX_FRAME_BYTES

    def _send(self, kind: str, payload: dict[str, Any]) -> None:
        try:
            self._sock.sendall(wire.encode(kind, payload))
        except OSError as exc:
            raise HubError(f"connection to the hub broke: {exc}") from None

    def _next(self) -> wire.Frame:
        while not self._pending:
            try:
                data = self._sock.recv(1 << 20)
            except OSError as exc:
                raise HubError(f"connection to the hub broke: {exc}") from None
            if not data:
                raise HubError("the hub closed the connection")
            try:
                self._pending += self._dec.feed(data)
            except wire.WireError as exc:
                raise HubError(f"bad frame from the hub at {self.address}: "
                               f"{_clip(exc)}") from None
        return self._pending.pop(0)

    def _expect(self, kind: str) -> dict[str, Any]:
        while True:
            frame = self._next()
            if frame.kind == kind:
                return frame.payload
            if frame.kind == wire.KIND_ERROR:
                code = frame.payload.get("code")
                msg = _clip(frame.payload.get("message"), 200)
                if code == "forbidden" and "control" in msg:
                    msg += " (acting on a job needs the control token: `rtop token control`)"
                raise HubError(msg)

    def snapshot(self, view: ViewRequest | None = None) -> Snapshot:
        """The hub's current snapshot: every rank's row, or, for a ``view``, the fleet's
        aggregates and the rows of the view (:mod:`rtop.analysis.viewport`). A hub older
        than views answers with every row; the view is then made here."""
        body: dict[str, Any] = {"what": "snapshot"}
        if view is not None:
            body["view"] = view.to_wire()
        self._send(wire.KIND_REQUEST, body)
        snap = cast(Snapshot, self._expect(wire.KIND_SNAPSHOT))
        return viewport(snap, view) if view is not None else snap

    def rank(self, rank: int) -> RankDetail:
        """One rank's full window (histories, stack, events)."""
        self._send(wire.KIND_REQUEST, {"what": "rank", "rank": rank})
        return cast(RankDetail, self._expect("rank"))

    def act(self, action: str, *, ranks: list[int] | None = None,
            args: dict[str, Any] | None = None, timeout_s: float | None = None,
            on_started: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Ask the hub for an action on the ranks (``profile``, ``probe``, ``stacks``;
        needs the control role) and wait for its result: ``{"action", "ranks",
        "answers": [...], "errors": [{"rank", "error"}], "missing": [ranks], ...}``.

        The hub answers by its deadline (``timeout_s``, or one it picks for the
        action), naming the ranks that did not answer; this waits that long and a
        little more. A refusal (no such rank, another action running, not the control
        role) raises :class:`HubError` with the hub's reason.
        """
        self._seq += 1
        cid = f"c{self._seq}"
        body: dict[str, Any] = {"id": cid, "action": action, "args": args or {}}
        if ranks is not None:
            body["ranks"] = list(ranks)
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        self._send(wire.KIND_CONTROL, body)
        wait = (timeout_s or 60.0) + 15.0
        while True:
            self._sock.settimeout(wait)
            try:
                p = self._expect(wire.KIND_RESULT)
            except TimeoutError:
                raise HubError(f"the hub sent no answer to the {action} within "
                               f"{wait:.0f} s") from None
            finally:
                self._sock.settimeout(self._timeout)
            if p.get("id") != cid:
                continue
            state = p.get("state")
            if state == "refused":
                raise HubError(f"the hub refused the {action}: {_clip(p.get('error'), 300)}")
            if state == "started":
                t = p.get("timeout_s")
                if isinstance(t, (int, float)) and t > 0:
                    wait = float(t) + 15.0
                if on_started is not None:
                    on_started(p)
                continue
            return p

    def close(self) -> None:
        """Disconnect."""
        self._sock.close()

    def __enter__(self) -> HubClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _clip(text: object, limit: int = 120) -> str:
    """What a hub sent, cut short for an error message."""
    s = str(text)
    return s if len(s) <= limit else s[:limit] + "..."
