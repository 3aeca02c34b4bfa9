"""Appends every frame to the run's recording, in the wire format itself.

The recording starts with a ``run`` frame (what wrote it, when), then holds every frame
the ranks sent, byte for byte as received, interleaved with the hub's own ``clock``
frames (the hub's time, at most every 0.25 s, so a replay knows when each frame
arrived), ``offset`` frames (a rank's clock offset) and ``conn`` frames (a rank's
connection closed). It is flushed at least once a second and created 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from collectors import wire

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
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)[:60] or "run"
    return default_runs_dir() / f"{safe}-{stamp}-{os.getpid()}.rtop"


class Recorder:
    """Writes frames to a recording file; ``flush()`` is called at least once a second."""

    def __init__(self, path: str | Path, run_info: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        self._f: IO[bytes] = os.fdopen(fd, "ab", buffering=1 << 16)
        self._last_clock = -1.0
        self.bytes = 0
        self.frames = 0
        self.failed = False
        self._write(wire.encode(wire.KIND_RUN, run_info))

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
            self._write(wire.encode("clock", {"t_hub": t_hub}))

    def raw(self, data: bytes, t_hub: float) -> None:
        """A frame exactly as a rank sent it (header and body)."""
        self.clock(t_hub)
        self._write(data)

    def frame(self, kind: str, payload: dict[str, Any], t_hub: float) -> None:
        """A frame of the hub's own."""
        self.clock(t_hub)
        self._write(wire.encode(kind, payload))

    def flush(self) -> None:
        """Push buffered frames to the file."""
        if not self.failed and not self._f.closed:
            try:
                self._f.flush()
            except (OSError, ValueError) as exc:
                self.failed = True
                log.error("rtop hub: recording to %s stopped: %s", self.path, exc)

    def close(self) -> None:
        """Flush and close."""
        self.flush()
        with contextlib.suppress(OSError):
            self._f.close()
