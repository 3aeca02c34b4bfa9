"""Appends every frame to the run's recording, in columnar, compressed blocks.

The recording starts with a ``run`` frame (what wrote it, when), then holds every frame
the ranks sent (as the hub's state took it), interleaved with the hub's own ``clock``
frames (the hub's time, at most every 0.25 s, so a replay knows when each frame
arrived), ``offset`` frames (a rank's clock offset) and ``conn`` frames (a rank's
connection closed), and ends with an ``end`` frame when the hub closes it (a recording
without one was cut short: ``rtop report`` says where).

Frames wait in memory and are written at each ``flush`` (the hub flushes at least once
a second, and before it acknowledges a rank's batches) as one block of the format of
:mod:`rtop.run.blocks`: a checksummed header and a zstandard-compressed body in which
the frames of one kind lie column by column, the records of every rank's batches too.
The measurements of the records are rounded to 14 significant bits (61 parts per
million, and no finer than their unit's resolution: :mod:`rtop.run.columns`);
everything else is kept exact. The blocks' headers say when their frames arrived and
what they hold, so a replay jumps anywhere at once (:mod:`rtop.run.seek`). At 4,096
ranks this is about a tenth of the older format, a wire frame after another
(``benchmarks/recording_size.py``), which a recording started in it keeps
(``rtop.run.recording`` reads both). The hub gives each frame as its state took it
(:meth:`Recorder.raw`'s ``frame``), so it is not decoded twice. A killed hub loses what
waited for the next flush: at most a second, and nothing it had acknowledged. When the
disk fills or the file becomes unwritable, recording stops with one error logged
(``failed``); the hub serves its ranks and viewers all the same.

It is opened as a private file (0600, never through a symbolic link, a regular file of
this user's: :func:`collectors.discovery.open_private`), and it never holds a secret:
a field named like one (``token``, ``proof``, ``nonce``, ``secret``, ...: see
:func:`rtop.run.recording.is_secret_key`) is dropped, and a value containing the hub's
token (:meth:`Recorder.add_secret`) is redacted, from whatever frame a peer sent, before
the frame waits for its block.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import IO, Any, Final

import msgpack

from collectors import wire
from collectors.discovery import open_private, safe_name
from rtop.run import blocks
from rtop.run.columns import MEASURE_BITS
from rtop.run.recording import KIND_END, may_hold_secret, scrub

log = logging.getLogger("rtop.hub")

CLOCK_EVERY_S = 0.25
#: Bytes of frames (as received) that make a block before the next flush is due.
BLOCK_BYTES: Final = 16 * 1024 * 1024


def default_runs_dir() -> Path:
    """Where recordings go unless told: ``$RTOP_RUNS_DIR``, else
    ``$XDG_DATA_HOME/rtop/runs`` (``~/.local/share/rtop/runs``)."""
    if os.environ.get("RTOP_RUNS_DIR"):
        return Path(os.environ["RTOP_RUNS_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "rtop" / "runs"


def default_record_path(job: str = "") -> Path:
    """A fresh recording path in :func:`default_runs_dir` named by job and time."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return default_runs_dir() / f"{safe_name(job, 'run', 60)}-{stamp}-{os.getpid()}.rtop"


class _FrameSink:
    """The older format: each frame appended as it comes (buffered, flushed by the
    recorder's ``flush``). Kept for a recording that was started in it (a hub restarted
    on the same path) and where zstandard is missing."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.bytes = 0

    def add(self, data: bytes, frame: wire.Frame | None = None) -> None:
        self._f.write(data)
        self.bytes += len(data)

    def flush(self) -> None:
        self._f.flush()


class _BlockSink:
    """The block format (:mod:`rtop.run.blocks`): frames gathered, then written as one
    block at each ``flush`` (and whenever :data:`BLOCK_BYTES` are waiting)."""

    def __init__(self, f: IO[bytes], rounded: bool) -> None:
        self._f = f
        self._writer = blocks.BlockWriter()
        self._rounded = rounded
        #: each frame's body, or the frame itself when the caller gave it decoded
        self._bodies: list[bytes | wire.Frame] = []
        self._waiting = 0
        self._t = math.nan  # the hub's time in effect at the next block's first frame
        self._stepped: set[Any] = set()  # the ranks seen with steps (blocks.FIRST)
        self.bytes = 0
        #: frames that could not be decoded again to be laid out (never from a hub)
        self.undecodable = 0

    def add(self, data: bytes, frame: wire.Frame | None = None) -> None:
        self._bodies.append(data[wire.HEADER_BYTES:] if frame is None else frame)
        self._waiting += len(data)
        if self._waiting >= BLOCK_BYTES:
            self.flush()

    def _frames(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        unpackb = msgpack.unpackb
        for body in self._bodies:
            if type(body) is wire.Frame:
                out.append((body.kind, body.payload))
                continue
            try:
                obj = unpackb(body, raw=False, strict_map_key=False)
            except Exception:  # msgpack raises several types: a frame that never decoded
                obj = None
            if type(obj) is list and len(obj) == 2 and type(obj[0]) is str \
                    and type(obj[1]) is dict:
                out.append((obj[0], obj[1]))
            else:
                self.undecodable += 1
        self._bodies, self._waiting = [], 0
        return out

    def flush(self) -> None:
        if not self._bodies:
            return
        frames = self._frames()
        t0 = t = self._t
        for kind, p in frames:
            if kind == wire.KIND_CLOCK:
                v = p.get("t_hub")
                if isinstance(v, float) and math.isfinite(v):
                    t = v
        self._t = t
        if len(self._stepped) > blocks.MAX_STEPPED:
            self._stepped.clear()  # a forged flood of ranks: flag their first steps again
        bits = MEASURE_BITS if self._rounded else None
        try:
            enc = blocks.encode_body(frames, bits, stepped=self._stepped)
        except Exception:  # never lose the frames: kept as msgpack rows instead
            log.exception("rtop hub: laying out a block failed; its frames are kept as "
                          "rows")
            enc = blocks.encode_body(frames, columnar=False)
        data = self._writer.block(enc, t0, t)
        self._f.write(data)
        self.bytes += len(data)


class Recorder:
    """Writes frames to a recording file; ``flush()`` is called at least once a second.

    ``rounded=False`` keeps every measurement exact (a recording about 3x, not 10x,
    smaller than the older format: see :mod:`rtop.run.columns`); ``legacy=True`` writes
    the older format (one wire frame after another), as does a recording that was
    started in it.
    """

    def __init__(self, path: str | Path, run_info: dict[str, Any],
                 secrets: list[str] | None = None, *, rounded: bool = True,
                 legacy: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # raises PermissionError for a link, a FIFO, a device or another user's file
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        head = os.pread(fd, len(blocks.FILE_MAGIC), 0)
        self._f: IO[bytes] = os.fdopen(fd, "ab", buffering=1 << 16)
        self._last_clock = -1.0
        self._secrets: list[bytes] = []
        self._told: set[str] = set()
        self.frames = 0
        #: bytes written to the file (in the older format, buffered too)
        self.bytes = 0
        self.failed = False
        #: fields (or values) taken out of frames because they were secrets
        self.secrets_dropped = 0
        for secret in secrets or ():
            self.add_secret(secret)
        blocked = head == blocks.FILE_MAGIC or (not head and not legacy)
        if blocked and not blocks.available():  # pragma: no cover - the app extra has it
            log.warning("rtop hub: zstandard is not installed: recording %s in the older, "
                        "larger format (pip install 'rtop-train[app]')", self.path)
            blocked = False
        self._sink: _FrameSink | _BlockSink = \
            _BlockSink(self._f, rounded) if blocked else _FrameSink(self._f)
        if blocked and not head:
            self._f.write(blocks.FILE_MAGIC)
        self.frame(wire.KIND_RUN, run_info, None)
        self.flush()  # the file says what it is, and when it started, at once

    def add_secret(self, secret: str) -> None:
        """A value (the hub's token) that must never be written, under any name."""
        if secret and secret.encode() not in self._secrets:
            self._secrets.append(secret.encode())

    def _clean(self, data: bytes) -> bytes | None:
        """``data`` (a whole frame) fit to record: as it is when it holds no secret,
        re-encoded without them when it does, None when that cannot be done."""
        named = may_hold_secret(data)
        valued = any(s in data for s in self._secrets)
        if not named and not valued:
            return data
        try:
            frame = wire.decode_body(memoryview(data)[wire.HEADER_BYTES:])
            removed: list[str] = []
            payload = scrub(frame.payload, self._secrets, removed)
            if not removed:
                return data  # a secret-like word, but no secret: as received
            out = wire.encode(frame.kind, payload)
            if any(s in out for s in self._secrets):  # in a key, a kind: give up
                raise ValueError("a secret in the frame's structure")
        except (ValueError, TypeError):
            self._tell("drop", "rtop hub: a frame that holds a secret was not recorded")
            self.secrets_dropped += 1
            return None
        self.secrets_dropped += len(removed)
        self._tell(frame.kind, "rtop hub: secret fields of a %r frame were not recorded: %s",
                   frame.kind[:20], ", ".join(repr(r) for r in removed[:5]))
        return out

    def _tell(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._told and len(self._told) < 32:
            self._told.add(key)
            log.warning(msg, *args)

    def _write(self, data: bytes, frame: wire.Frame | None = None) -> None:
        if self.failed or self._f.closed:
            return
        try:
            self.frames += 1
            self._sink.add(data, frame)
            self.bytes = self._sink.bytes
        except (OSError, ValueError) as exc:  # disk full, closed: keep serving viewers
            self._stop(exc)

    def _stop(self, exc: BaseException) -> None:
        self.failed = True
        log.error("rtop hub: recording to %s stopped: %s", self.path, exc)

    def clock(self, t_hub: float, force: bool = False) -> None:
        """Note the hub's time if it moved on since the last note."""
        if force or t_hub - self._last_clock >= CLOCK_EVERY_S:
            self._last_clock = t_hub
            self._write(wire.encode(wire.KIND_CLOCK, {"t_hub": t_hub}))

    def raw(self, data: bytes, t_hub: float, frame: wire.Frame | None = None) -> None:
        """A frame as a rank sent it (header and body), as received unless it holds a
        secret (see the module's docstring). ``frame``: the same frame as the caller
        decoded it (the hub's, once its state took it): spares decoding it again."""
        self.clock(t_hub)
        clean = self._clean(data)
        if clean is not None:
            self._write(clean, frame if clean is data else None)

    def frame(self, kind: str, payload: dict[str, Any], t_hub: float | None) -> None:
        """A frame of the hub's own (secrets taken out all the same)."""
        if t_hub is not None:
            self.clock(t_hub)
        removed: list[str] = []
        clean = scrub(payload, self._secrets, removed)
        if removed:
            self.secrets_dropped += len(removed)
            self._tell(kind, "rtop hub: secret fields of a %r frame were not recorded: %s",
                       kind[:20], ", ".join(repr(r) for r in removed[:5]))
        self._write(wire.encode(kind, clean))

    def flush(self) -> None:
        """Write what is waiting (in the block format: as one block) to the file."""
        if not self.failed and not self._f.closed:
            try:
                self._sink.flush()
                self.bytes = self._sink.bytes
                self._f.flush()
            except (OSError, ValueError) as exc:
                self._stop(exc)

    def sync(self) -> None:
        """Flush (everything given so far is in the file), and have the system write the
        file to disk (before a spool the recording now holds is let go:
        ``rtop.hub.spool``)."""
        self.flush()
        if not self.failed and not self._f.closed:
            try:
                os.fsync(self._f.fileno())
            except OSError as exc:
                self._stop(exc)

    def close(self) -> None:
        """Write the end mark (``KIND_END``: the hub closed the recording, which a
        report of a recording cut short misses), flush and close."""
        if not self.failed and not self._f.closed:
            self.frame(KIND_END, {"t_hub": time.time(), "frames": self.frames + 1}, None)
        self.flush()
        with contextlib.suppress(OSError):
            self._f.close()
