"""Appends every frame to the run's recording, in the wire format itself.

The recording starts with a ``run`` frame (what wrote it, when), then holds every frame
the ranks sent, byte for byte as received, interleaved with the hub's own ``clock``
frames (the hub's time, at most every 0.25 s, so a replay knows when each frame
arrived), ``offset`` frames (a rank's clock offset) and ``conn`` frames (a rank's
connection closed), and ends with an ``end`` frame when the hub closes it (a recording
without one was cut short: ``rtop report`` says where). It is flushed at least once a
second. When the disk fills or the file becomes unwritable, recording stops with one
error logged (``failed``); the hub serves its ranks and viewers all the same.

It is opened as a private file (0600, never through a symbolic link, a regular file of
this user's: :func:`collectors.discovery.open_private`), and it never holds a secret:
a field named like one (``token``, ``proof``, ``nonce``, ``secret``, ...: see
:func:`rtop.run.recording.is_secret_key`) is dropped, and a value containing the hub's
token (:meth:`Recorder.add_secret`) is redacted, from whatever frame a peer sent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from collectors import wire
from collectors.discovery import open_private, safe_name
from rtop.run.recording import KIND_END, may_hold_secret, scrub

log = logging.getLogger("rtop.hub")

CLOCK_EVERY_S = 0.25


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


class Recorder:
    """Writes frames to a recording file; ``flush()`` is called at least once a second."""

    def __init__(self, path: str | Path, run_info: dict[str, Any],
                 secrets: list[str] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # raises PermissionError for a link, a FIFO, a device or another user's file
        fd = open_private(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._f: IO[bytes] = os.fdopen(fd, "ab", buffering=1 << 16)
        self._last_clock = -1.0
        self._secrets: list[bytes] = []
        self._told: set[str] = set()
        self.bytes = 0
        self.frames = 0
        self.failed = False
        #: fields (or values) taken out of frames because they were secrets
        self.secrets_dropped = 0
        for secret in secrets or ():
            self.add_secret(secret)
        self.frame(wire.KIND_RUN, run_info, None)

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

    def _write(self, data: bytes) -> None:
        if self.failed or self._f.closed:
            return
        try:
            self._f.write(data)
            self.bytes += len(data)
            self.frames += 1
        except (OSError, ValueError) as exc:  # disk full, closed: keep serving viewers
            self.failed = True
            log.error("rtop hub: recording to %s stopped: %s", self.path, exc)

    def clock(self, t_hub: float, force: bool = False) -> None:
        """Note the hub's time if it moved on since the last note."""
        if force or t_hub - self._last_clock >= CLOCK_EVERY_S:
            self._last_clock = t_hub
            self._write(wire.encode(wire.KIND_CLOCK, {"t_hub": t_hub}))

    def raw(self, data: bytes, t_hub: float) -> None:
        """A frame as a rank sent it (header and body), byte for byte unless it holds a
        secret (see the module's docstring)."""
        self.clock(t_hub)
        clean = self._clean(data)
        if clean is not None:
            self._write(clean)

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
        """Push buffered frames to the file."""
        if not self.failed and not self._f.closed:
            try:
                self._f.flush()
            except (OSError, ValueError) as exc:
                self.failed = True
                log.error("rtop hub: recording to %s stopped: %s", self.path, exc)

    def sync(self) -> None:
        """Flush, and have the system write the file to disk (before a spool the
        recording now holds is let go: ``rtop.hub.spool``)."""
        self.flush()
        if not self.failed and not self._f.closed:
            try:
                os.fsync(self._f.fileno())
            except OSError as exc:
                self.failed = True
                log.error("rtop hub: recording to %s stopped: %s", self.path, exc)

    def close(self) -> None:
        """Write the end mark (``KIND_END``: the hub closed the recording, which a
        report of a recording cut short misses), flush and close."""
        if not self.failed and not self._f.closed:
            self.frame(KIND_END, {"t_hub": time.time(), "frames": self.frames + 1}, None)
        self.flush()
        with contextlib.suppress(OSError):
            self._f.close()
