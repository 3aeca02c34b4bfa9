"""Waiting in tests for something real processes and sockets do: one :func:`wait_for`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, every: float = 0.1, *,
             what: str | None = None) -> Any:
    """Poll ``cond`` every ``every`` seconds until it returns something true, for at
    most ``timeout`` seconds, and return that (else its last, false, value: one more
    look once the time is up). With ``what``, a timeout fails the test instead, saying
    what was waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    got = cond()
    assert got or what is None, f"timed out after {timeout:g} s waiting for {what}"
    return got
