"""Reading a recording: every whole frame, up to a truncated tail, into a RunState."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from collectors import wire
from rtop.run.state import ProtocolError, RunState

log = logging.getLogger("rtop")


@dataclass
class ReadResult:
    """What reading a recording found besides its frames."""

    frames: int = 0
    truncated: bool = False
    warnings: list[str] = field(default_factory=list)


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
        first = True
        while True:
            try:
                frame = wire.read_frame(f)
            except wire.TruncatedStream as exc:
                res.truncated = True
                msg = f"{path}: truncated after {res.frames} whole frames ({exc}); "\
                      "read up to the last whole frame"
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
                if isinstance(started, (int, float)):
                    t_hub = float(started)
            first = False
            res.frames += 1
            if frame.kind == "clock":
                t = frame.payload.get("t_hub")
                if isinstance(t, (int, float)):
                    t_hub = float(t)
            yield t_hub, frame


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
