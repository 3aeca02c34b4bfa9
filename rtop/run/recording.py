"""Reading a recording: every whole frame, up to a truncated tail, into a RunState.

Also what counts as a secret in a frame (:func:`is_secret_key`, :func:`scrub`), which
the recorder never writes. Reading yields frames as recorded: a recording made by an
earlier rtop holds each rank's token in its hello, and is as secret as the token.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from collectors import wire
from rtop.run.state import RunState
from rtop.run.validate import ProtocolError

log = logging.getLogger("rtop")


#: Words that make a field's name a secret's, matched against the name's parts
#: (``token``, ``hub_token``, ``authToken``, ``client-proof``; not ``tokens_per_s``).
SECRET_WORDS = frozenset({"token", "proof", "nonce", "secret", "password", "passwd",
                          "credential", "credentials", "hmac"})
#: Cheap test on raw frame bytes, lower-cased: a frame without any of these holds no
#: secret-named field, and is written as received without being decoded again.
_MAYBE_SECRET = re.compile(rb"token|proof|nonce|secret|passw|credential|hmac")
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_PARTS = re.compile(r"[^a-z0-9]+")
REDACTED = "[redacted]"
#: The hub's last frame in a recording it closed (:meth:`rtop.hub.recorder.Recorder.
#: close`); a recording without one was cut short (a killed hub, a full disk) or is
#: still being written. Ranks may not send it (not in ``wire.RANK_KINDS``).
KIND_END = "end"


def is_secret_key(key: object) -> bool:
    """Whether a field of this name holds a secret (see :data:`SECRET_WORDS`)."""
    if isinstance(key, bytes):
        key = key.decode("utf-8", "replace")
    if not isinstance(key, str):
        return False
    parts = _PARTS.split(_CAMEL.sub(r"\1_\2", key).lower())
    return any(part in SECRET_WORDS for part in parts)


def may_hold_secret(data: bytes) -> bool:
    """A quick, conservative look at a frame's bytes: False means it surely holds no
    secret-named field."""
    return _MAYBE_SECRET.search(data.lower()) is not None


def scrub(obj: Any, values: Iterable[bytes] = (), removed: list[str] | None = None
          ) -> Any:
    """``obj`` (a frame payload) without secret-named fields at any depth, and with
    strings that contain one of the secret ``values`` replaced by ``[redacted]``;
    the names of what was taken out are appended to ``removed``. Unchanged parts are
    the same objects."""
    secrets = tuple(v.decode("utf-8", "replace") for v in values if v)
    out = removed if removed is not None else []
    return _scrub(obj, secrets, out)


def _scrub(obj: Any, secrets: tuple[str, ...], removed: list[str]) -> Any:
    if isinstance(obj, dict):
        clean: dict[Any, Any] = {}
        changed = False
        for k, v in obj.items():
            if is_secret_key(k) or (isinstance(k, str) and any(x in k for x in secrets)):
                removed.append(str(k)[:40])
                changed = True
                continue
            new = _scrub(v, secrets, removed)
            changed = changed or new is not v
            clean[k] = new
        return clean if changed else obj
    if isinstance(obj, list):
        items = [_scrub(v, secrets, removed) for v in obj]
        return items if any(a is not b for a, b in zip(items, obj, strict=True)) else obj
    if isinstance(obj, str) and secrets and any(x in obj for x in secrets):
        removed.append("(a value)")
        return REDACTED
    if isinstance(obj, bytes) and secrets and any(x.encode() in obj for x in secrets):
        removed.append("(a value)")
        return REDACTED
    return obj


@dataclass
class ReadResult:
    """What reading a recording found besides its frames."""

    frames: int = 0
    truncated: bool = False
    warnings: list[str] = field(default_factory=list)
    #: the hub closed the recording (its last frame is the end mark, ``KIND_END``)
    closed: bool = False
    #: where the last whole frame ends, in bytes from the start of the file
    end_byte: int = 0
    #: the file's size when it was read (more than ``end_byte`` when cut mid-frame)
    size_bytes: int = 0
    #: the hub's time at the last whole frame (None: no frame held a time)
    last_t_hub: float | None = None

    def cut(self) -> str | None:
        """Where and how the recording ends, in words, if the hub did not close it
        (None when it did)."""
        if self.closed:
            return None
        when = "" if self.last_t_hub is None else f", last hub time {_stamp(self.last_t_hub)}"
        if self.truncated:
            return (f"recording ends mid-frame at byte {self.end_byte:,} of "
                    f"{self.size_bytes:,}{when}, after {self.frames:,} whole frames; the "
                    f"hub stopped without closing it (killed, or its disk filled or "
                    f"became unwritable: its log says), or is still writing it")
        return (f"recording ends at byte {self.end_byte:,}{when}, after {self.frames:,} "
                f"whole frames, with no end mark; the hub stopped without closing it "
                f"(killed, or its disk became unwritable: its log says), or is still "
                f"writing it")


def read(path: str | Path, result: ReadResult | None = None
         ) -> Iterator[tuple[float, wire.Frame]]:
    """Yield ``(t_hub, frame)`` for each whole frame of a recording.

    A recording still being written, or cut short by a killed hub, ends inside a frame:
    reading stops at the last whole frame and a warning is added to ``result``. A
    recording that is not an rtop recording at all raises :class:`wire.WireError`.
    """
    res = result if result is not None else ReadResult()
    t_hub = 0.0
    with open(path, "rb") as f:
        res.size_bytes = os.fstat(f.fileno()).st_size
        first = True
        while True:
            try:
                frame = wire.read_frame(f)
            except wire.TruncatedStream as exc:
                res.truncated = True
                msg = f"{path}: truncated after {res.frames} whole frames ({exc}) at " \
                      f"byte {res.end_byte}; read up to the last whole frame"
                res.warnings.append(msg)
                log.warning("%s", msg)
                return
            except wire.WireError as exc:
                if first:
                    raise wire.WireError(f"{path} is not an rtop recording: {exc}") from None
                res.truncated = True
                msg = f"{path}: corrupt after {res.frames} whole frames ({exc})"
                res.warnings.append(msg)
                log.warning("%s", msg)
                return
            if frame is None:
                return
            if first and frame.kind != wire.KIND_RUN:
                raise wire.WireError(f"{path} is not an rtop recording (no run header)")
            if first:
                hub = frame.payload.get("hub")
                started = hub.get("started") if isinstance(hub, dict) else None
                if _finite_time(started):
                    t_hub = float(started)
            first = False
            res.frames += 1
            res.end_byte = f.tell()
            res.size_bytes = max(res.size_bytes, res.end_byte)
            res.closed = frame.kind == KIND_END
            if frame.kind in (wire.KIND_CLOCK, KIND_END):
                t = frame.payload.get("t_hub")
                if _finite_time(t):  # a forged inf or NaN keeps the last good time
                    t_hub = float(t)
            if t_hub > 0:
                res.last_t_hub = t_hub
            yield t_hub, frame


def _stamp(t: float) -> str:
    """A hub time as local date and time to the millisecond (as a number when it is
    beyond what a date can say: a hostile recording's)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + \
            f".{int(t % 1 * 1000):03d}"
    except (OverflowError, OSError, ValueError):
        return f"t={t!r}"


def _finite_time(t: object) -> TypeGuard[float]:
    """True for a number a recording's clock may take (not a bool, inf or NaN)."""
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)


def replay(path: str | Path, state: RunState | None = None,
           on_frame: Callable[[float, wire.Frame, RunState], None] | None = None,
           result: ReadResult | None = None) -> tuple[RunState, ReadResult]:
    """Apply a whole recording to a RunState (a fresh one unless given)."""
    st = state if state is not None else RunState()
    res = result if result is not None else ReadResult()
    for t_hub, frame in read(path, res):
        try:
            st.apply(frame, t_hub)
        except ProtocolError as exc:
            st.bad_frames += 1
            if len(res.warnings) < 20:
                res.warnings.append(f"skipped a {frame.kind} frame: {exc}")
            continue
        if on_frame is not None:
            on_frame(t_hub, frame, st)
    return st, res
