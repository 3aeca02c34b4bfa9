"""Waiting in tests for something real processes and sockets do: one :func:`wait_for`,
and :func:`snapshots`, a viewer's snapshots at a steady rate."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtop.client import HubClient
    from rtop.run.snapshot import Snapshot


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


def snapshots(client: HubClient, rate_hz: float = 2.0) -> Iterator[Snapshot]:
    """The hub's snapshots, asked for ``rate_hz`` times a second (as the UI does)."""
    period = 1.0 / rate_hz
    due = time.monotonic()
    while True:
        yield client.snapshot()
        due = max(due + period, time.monotonic())
        time.sleep(max(0.0, due - time.monotonic()))
