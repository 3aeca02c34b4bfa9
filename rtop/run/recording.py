"""Reading a recording: every whole frame, up to a truncated tail, into a RunState.

Two formats are read, told apart by the file's first bytes: the block format the hub
writes now (:mod:`rtop.run.blocks`: columnar, compressed blocks, each checksummed), and
the older one (a wire frame after another, as every earlier rtop wrote). Either way a
recording cut short (a killed hub, a full disk, one still being written) is read up to
its last whole frame, or block, with a warning; a damaged block is skipped with a
warning and reading goes on from the next whole one.

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
from rtop.run import blocks
from rtop.run.blocks import BlockError, BlockInfo
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
    #: the recording is in the block format (:mod:`rtop.run.blocks`), not a frame after
    #: another
    blocks: bool = False
    #: damaged stretches skipped (a block or more: reading went on from the next whole
    #: block after each)
    damaged: int = 0

    def cut(self) -> str | None:
        """Where and how the recording ends, in words, if the hub did not close it
        (None when it did)."""
        if self.closed:
            return None
        when = "" if self.last_t_hub is None else f", last hub time {_stamp(self.last_t_hub)}"
        if self.truncated:
            inside = " (in a block of frames cut short or damaged)" if self.blocks else ""
            return (f"recording ends mid-frame at byte {self.end_byte:,} of "
                    f"{self.size_bytes:,}{inside}{when}, after {self.frames:,} whole "
                    f"frames; the hub stopped without closing it (killed, or its disk "
                    f"filled or became unwritable: its log says), or is still writing it")
        return (f"recording ends at byte {self.end_byte:,}{when}, after {self.frames:,} "
                f"whole frames, with no end mark; the hub stopped without closing it "
                f"(killed, or its disk became unwritable: its log says), or is still "
                f"writing it")


def is_blocks(path: str | Path) -> bool:
    """Whether a recording is in the block format (by its first bytes; a file cut
    inside them counts)."""
    with open(path, "rb") as f:
        head = f.read(len(blocks.FILE_MAGIC))
    return bool(head) and blocks.FILE_MAGIC.startswith(head)


def read(path: str | Path, result: ReadResult | None = None, *,
         start: BlockInfo | None = None) -> Iterator[tuple[float, wire.Frame]]:
    """Yield ``(t_hub, frame)`` for each whole frame of a recording, in either format.

    A recording still being written, or cut short by a killed hub, ends inside a frame
    (or a block): reading stops at the last whole one and a warning is added to
    ``result``. A recording that is not an rtop recording at all raises
    :class:`wire.WireError`. ``start``: a block of a block-format recording
    (:func:`index`) to read from instead of the first one (the frames before it are
    not read).
    """
    res = result if result is not None else ReadResult()
    if is_blocks(path):
        yield from _read_blocks(path, res, start)
    elif start is not None:
        raise ValueError(f"{path} is not in the block format: it is read from its start")
    else:
        yield from _read_frames(path, res)


def _read_frames(path: str | Path, res: ReadResult) -> Iterator[tuple[float, wire.Frame]]:
    """The older format: a wire frame after another."""
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
            if first:
                t_hub = _first(path, frame, t_hub)
            first = False
            t_hub = _count(res, frame, t_hub)
            res.end_byte = f.tell()
            res.size_bytes = max(res.size_bytes, res.end_byte)
            yield t_hub, frame


def _first(path: str | Path, frame: wire.Frame, t_hub: float) -> float:
    """The hub's time a recording starts at, from its first frame (which must be the
    run header)."""
    if frame.kind != wire.KIND_RUN:
        raise wire.WireError(f"{path} is not an rtop recording (no run header)")
    t = started(frame)
    return t if t is not None else t_hub


def started(frame: wire.Frame) -> float | None:
    """When the hub that wrote a recording started, from its run header (None: not
    said, or no time)."""
    hub = frame.payload.get("hub")
    t = hub.get("started") if isinstance(hub, dict) else None
    return float(t) if _finite_time(t) else None


def _count(res: ReadResult, frame: wire.Frame, t_hub: float) -> float:
    """Note a frame read in ``res``; the hub's time from then on."""
    res.frames += 1
    res.closed = frame.kind == KIND_END
    if frame.kind in (wire.KIND_CLOCK, KIND_END):
        t = frame.payload.get("t_hub")
        if _finite_time(t):  # a forged inf or NaN keeps the last good time
            t_hub = float(t)
    if t_hub > 0:
        res.last_t_hub = t_hub
    return t_hub


def _warn(res: ReadResult, msg: str) -> None:
    res.warnings.append(msg)
    log.warning("%s", msg)


def _read_blocks(path: str | Path, res: ReadResult, start: BlockInfo | None
                 ) -> Iterator[tuple[float, wire.Frame]]:
    """The block format (:mod:`rtop.run.blocks`)."""
    res.blocks = True
    with open(path, "rb") as f:
        size = res.size_bytes = os.fstat(f.fileno()).st_size
        at = res.end_byte = len(blocks.FILE_MAGIC) if start is None else start.offset
        t_hub = 0.0 if start is None or blocks.finite(start.t_start) is None \
            else start.t_start
        first = start is None
        if size < at:  # cut inside its first bytes
            res.truncated, res.end_byte = True, 0
            _warn(res, f"{path}: truncated inside its first {len(blocks.FILE_MAGIC)} bytes "
                       f"({size} of them written): no frame to read")
            return
        while at < size:
            try:
                frames, info = _block_at(f, at, size)
            except BlockError as exc:
                nxt = blocks.find_next(f, size, at)
                if nxt is None:
                    res.truncated = True
                    _warn(res, f"{path}: corrupt after {res.frames} whole frames ({exc}); "
                               f"read up to the last whole block")
                    return
                res.damaged += 1
                _warn(res, f"{path}: {exc}: its frames are skipped; read on from the "
                           f"next whole block, at byte {nxt.offset:,}")
                first, at = False, nxt.offset
                if _finite_time(nxt.t_start):  # its clocks are lost: the next one's says
                    t_hub = nxt.t_start
                continue
            if frames is None:
                res.truncated = True
                _warn(res, f"{path}: truncated after {res.frames} whole frames (the file "
                           f"ends inside the block at byte {at:,}: {size - at:,} of its "
                           f"bytes written) at byte {res.end_byte}; read up to the last "
                           f"whole block")
                return
            at = info.end
            for frame in frames:
                if first:
                    t_hub = _first(path, frame, t_hub)
                    first = False
                t_hub = _count(res, frame, t_hub)
                yield t_hub, frame
            res.end_byte = at
            first = False


def _block_at(f: Any, at: int, size: int) -> tuple[list[wire.Frame] | None, BlockInfo]:
    """The frames of the block at byte ``at`` (None: the file ends inside it); raises
    :class:`BlockError` for a damaged one."""
    if at + blocks.HEADER_BYTES > size:
        return None, BlockInfo(at, 0, 0, math.nan, math.nan, -1, 0, 0, 0)
    f.seek(at)
    info = blocks.parse_header(f.read(blocks.HEADER_BYTES), at)
    if info.end > size:
        return None, info
    body = blocks.read_body(f, info)
    if body is None:
        return None, info
    return blocks.decode_body(blocks.decompress(body, info), info), info


def index(path: str | Path) -> list[BlockInfo]:
    """The blocks of a block-format recording, read from their headers alone (their
    bodies are neither read nor checked); a damaged stretch is stepped over to the
    next whole block. Empty for a recording of the older format."""
    if not is_blocks(path):
        return []
    out: list[BlockInfo] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        at = len(blocks.FILE_MAGIC)
        while at < size:
            out.extend(blocks.scan(f, size, at))
            at = out[-1].end if out and out[-1].end > at else at
            if at >= size:
                break
            nxt = blocks.find_next(f, size, at)
            if nxt is None:
                break
            at = nxt.offset
    return out


def block_frames(path: str | Path, info: BlockInfo) -> list[wire.Frame]:
    """The frames of one block (:func:`index`); raises :class:`BlockError` when it is
    damaged or cut."""
    with open(path, "rb") as f:
        frames, _ = _block_at(f, info.offset, os.fstat(f.fileno()).st_size)
    if frames is None:
        raise BlockError(f"{path}: the file ends inside the block at byte {info.offset:,}")
    return frames


def rare_frames(path: str | Path) -> Iterator[wire.Frame]:
    """The frames of a block-format recording's blocks that hold more than batches and
    clocks (``blocks.RARE``: hellos, goodbyes, closed connections, ...), every frame of
    those blocks, in order; damaged blocks are skipped. Nothing for the older format."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for info in index(path):
            if info.flags & blocks.RARE:
                try:
                    frames, _ = _block_at(f, info.offset, size)
                except BlockError:
                    continue
                yield from frames or ()


def plain_bytes(path: str | Path) -> bytes:
    """What a recording holds, as stored but decompressed: the file itself in the older
    format, every whole block's decompressed body in the block format (to search for
    what must never be written: a secret)."""
    if not is_blocks(path):
        return Path(path).read_bytes()
    parts = []
    with open(path, "rb") as f:
        for info in index(path):
            body = blocks.read_body(f, info)
            if body is not None:
                parts.append(blocks.decompress(body, info))
    return b"".join(parts)


def span(path: str | Path) -> tuple[float | None, float | None]:
    """``(start, end)`` hub times of a block-format recording, from its first block's
    run header and its last block's header."""
    blocks_ = index(path)
    start = end = None
    if blocks_:
        try:
            head = block_frames(path, blocks_[0])
        except BlockError:
            head = []
        if head and head[0].kind == wire.KIND_RUN:
            start = started(head[0])
        ends = [b.t_end for b in blocks_ if _finite_time(b.t_end)]
        end = ends[-1] if ends else None
    return start, end


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
