"""The Ray actor that runs a Ray Train job's hub.

A rank of the job creates it through ``collectors.discovery`` (the one place where the
in-rank package names this one), as a detached, zero-CPU named actor; its code runs in
the actor's own process, where importing the application is fine. This module imports
nothing of the hub until the actor starts, so a rank that merely names the class
stays light.
"""

from __future__ import annotations

from typing import Any

from collectors.wire import parse_address


class RayHubActor:
    """Runs a job's hub on a thread of the actor's process, niced (on a node it shares
    with training workers, the workers come first); the actor exits with the hub, ten
    minutes after the last rank and viewer left."""

    def __init__(self, job: str, record: str | None = None) -> None:
        from rtop.hub.service import ThreadedHub

        self._hub = ThreadedHub(job=job, record=record, host="0.0.0.0", linger_s=600.0,
                                on_exit=self._exit, nice=10)
        self._hub.start()

    def _exit(self) -> None:
        import ray

        ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    def address(self) -> tuple[str, int, str]:
        """``(host, port, token)`` of the hub."""
        host, port = parse_address(self._hub.address)
        return host, port, self._hub.token

    def info(self) -> dict[str, Any]:
        """What ``rtop`` shows when listing hubs."""
        return {"address": self._hub.address, "token": self._hub.token,
                "job": self._hub.job, "record": self._hub.record_path}

    def shutdown(self) -> str | None:
        """Stop the hub (the recording is flushed and closed); returns its path."""
        path = self._hub.record_path
        self._hub.stop()
        return path
