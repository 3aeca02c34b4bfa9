"""Log records go to a file while a full-screen view owns the terminal.

A hub or Ray in the viewer's process logs as it goes; printed, those lines would
scribble over the screen. :func:`logs_to_file` is used by ``rtop attach``/``replay``
and by ``rtop demo`` (which wraps the live view in its own log file).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path


class _ViewLog(logging.FileHandler):
    """The file a view's log records go to. A record that cannot be written is
    dropped: an error printed to the terminal is what this is here to prevent."""

    def handleError(self, record: logging.LogRecord) -> None:
        """Drop the record silently."""


@contextlib.contextmanager
def logs_to_file(path: str | Path | None = None) -> Iterator[Path | None]:
    """Send every log record (and Python warning) that would reach the terminal to
    ``path`` instead (default: ``rtop-ui.log`` in rtop's runtime directory) until the
    block ends; yields the file (None: no file could be had, records are dropped).

    The file is only created if something is logged. Handlers that write to files stay
    as they are. Inside another ``logs_to_file`` block, the outer one's file is kept.
    """
    root = logging.getLogger()
    outer = next((h for h in root.handlers if isinstance(h, _ViewLog)), None)
    if outer is not None:
        yield Path(outer.baseFilename)
        return
    handler: logging.Handler
    where: Path | None
    try:
        if path is None:
            from collectors.discovery import runtime_dir

            path = runtime_dir() / "rtop-ui.log"
        where = Path(path)
        handler = _ViewLog(where, delay=True)
    except OSError:
        where, handler = None, logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [root] + [lg for lg in logging.Logger.manager.loggerDict.values()
                        if isinstance(lg, logging.Logger)]
    swapped: list[tuple[logging.Logger, list[logging.Handler]]] = []
    for lg in loggers:
        to_terminal = [h for h in lg.handlers if isinstance(h, logging.StreamHandler)
                       and not isinstance(h, logging.FileHandler)]
        if to_terminal or lg is root:
            swapped.append((lg, list(lg.handlers)))
            lg.handlers = [h for h in lg.handlers if h not in to_terminal]
            if lg is root or not lg.propagate:
                lg.handlers.append(handler)
    logging.captureWarnings(True)
    try:
        yield where
    finally:
        logging.captureWarnings(False)
        for lg, handlers in swapped:
            lg.handlers = handlers
        handler.close()
