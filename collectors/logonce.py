"""A logger that says each thing once: the collectors run for days inside a job, and a
hub that stays away must not fill the job's log with the same line every second."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("collectors")


class LogOnce:
    """Logs a message the first time its key is seen, then stays quiet about that key."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, key: str, level: int, msg: str, *args: Any) -> None:
        """Log ``msg % args`` at ``level`` unless ``key`` was logged before."""
        if key not in self._seen:
            self._seen.add(key)
            log.log(level, msg, *args)
