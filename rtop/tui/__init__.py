"""rtop's terminal UI (Textual). ``attach`` a live job, ``replay`` a recording."""

from __future__ import annotations

from pathlib import Path

from rtop.tui.logs import logs_to_file


def attach(address: str, token: str | None, *, title: str | None = None,
           rate_hz: float = 2.0) -> int:
    """Run the UI on a live hub until the user quits; returns an exit code."""
    from rtop.tui.app import make_app
    from rtop.tui.source import LiveSource

    source = LiveSource(address, token, rate_hz)
    if title:
        source.title = title
    with logs_to_file():
        make_app(source).run()
    return 0


def replay(path: str | Path, *, speed: float = 1.0, paused: bool = False) -> int:
    """Run the UI on a recording; returns an exit code."""
    from rtop.tui.app import make_app
    from rtop.tui.source import ReplaySource

    with logs_to_file():
        make_app(ReplaySource(path, speed=speed, paused=paused)).run()
    return 0
