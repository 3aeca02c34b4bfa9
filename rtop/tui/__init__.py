"""rtop's terminal UI (Textual). ``attach`` a live job, ``replay`` a recording."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def quiet_logging() -> Iterator[Path | None]:
    """While the UI owns the terminal, log lines go to a file, not across the screen
    (a hub or Ray in this process would otherwise scribble over it)."""
    from collectors.discovery import runtime_dir

    root = logging.getLogger()
    saved = root.handlers[:]
    path: Path | None
    try:
        path = runtime_dir() / "rtop-ui.log"
        handler: logging.Handler = logging.FileHandler(path)
    except OSError:
        path, handler = None, logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    root.handlers = [handler]
    try:
        yield path
    finally:
        root.handlers = saved
        handler.close()


def attach(address: str, token: str | None, *, title: str | None = None,
           rate_hz: float = 2.0) -> int:
    """Run the UI on a live hub until the user quits; returns an exit code."""
    from rtop.tui.app import make_app
    from rtop.tui.source import LiveSource

    source = LiveSource(address, token, rate_hz)
    if title:
        source.title = title
    with quiet_logging():
        make_app(source).run()
    return 0


def replay(path: str | Path, *, speed: float = 1.0, paused: bool = False) -> int:
    """Run the UI on a recording; returns an exit code."""
    from rtop.tui.app import make_app
    from rtop.tui.source import ReplaySource

    with quiet_logging():
        make_app(ReplaySource(path, speed=speed, paused=paused)).run()
    return 0
