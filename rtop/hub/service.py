"""Running a hub: in the foreground (``rtop serve``) or on a thread of its own (the Ray
actor, tests).

Both write the hub's discovery file themselves (:func:`write_hub_file`:
``mkstemp`` then rename, 0600; the ranks' ingest token in it, the master token in the
private key file beside it) once the hub listens, remove both when the hub ends, and
tell the recorder the hub's tokens (master and roles), so that none reaches the
recording.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from collectors.discovery import hub_key_path, read_hub_file, read_hub_key
from rtop.analysis import AnalysisConfig, Monitor
from rtop.hub.server import Hub, HubConfig, write_hub_file
from rtop.run.state import RunState

log = logging.getLogger("rtop.hub")


def hub_monitor(cfg: HubConfig, thresholds: AnalysisConfig | str | Path | None = None
                ) -> Monitor:
    """The run state a hub keeps (its windows sized by ``cfg``) and its diagnosis, with
    thresholds given, or from ``RTOP_THRESHOLDS`` and an optional JSON file."""
    config = thresholds if isinstance(thresholds, AnalysisConfig) else \
        AnalysisConfig.load(thresholds)
    state = RunState(window_steps=cfg.window_steps, window_samples=cfg.window_samples,
                     lost_after_s=cfg.lost_after_s, max_ranks=cfg.max_ranks)
    return Monitor(state, config)


def remove_hub_file(path: Path, pid: int | None = None) -> None:
    """Remove a hub's file and its key file, if they are still this hub's (``pid``): a
    newer hub of the same job may have replaced them."""
    if pid is not None:
        info = read_hub_file(path)
        if info is not None and info.get("pid") != pid:
            return
    with contextlib.suppress(OSError):
        path.unlink()
    key = hub_key_path(path)
    if pid is None or read_hub_key(path, pid) is not None or not key.exists():
        with contextlib.suppress(OSError):
            key.unlink()


def _own_discovery(cfg: HubConfig) -> tuple[HubConfig, Path | None]:
    """The config without its discovery file, and that file: this module writes it."""
    if not cfg.discovery_file:
        return cfg, None
    return replace(cfg, discovery_file=None), Path(cfg.discovery_file)


def _started(hub: Hub, discovery: Path | None) -> None:
    """Once the hub listens (its recording already keeps every token out): write its
    file."""
    if discovery is not None:  # ranks read the ingest token; viewers the key file's master
        write_hub_file(discovery, {
            "address": hub.address, "token": hub.role_token("ingest"), "pid": os.getpid(),
            "job": hub.cfg.job, "record": str(hub.recorder.path) if hub.recorder else None,
            "started": time.time()}, master=hub.token)


def _ended(discovery: Path | None) -> None:
    if discovery is not None:
        remove_hub_file(discovery, os.getpid())


async def serve(cfg: HubConfig, ready: Callable[[Hub], None] | None = None,
                thresholds: str | None = None) -> None:
    """Run a hub until it is closed, a signal arrives, or it has lingered long enough."""
    cfg, discovery = _own_discovery(cfg)
    hub = Hub(cfg, hub_monitor(cfg, thresholds))
    await hub.start()
    try:
        _started(hub, discovery)
        if ready is not None:
            ready(hub)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, lambda: loop.create_task(hub.close()))
        await hub.serve_forever()
    finally:
        await hub.close()
        _ended(discovery)


def lower_priority(nice: int, thread: bool = False) -> bool:
    """Lower this process's (or, on Linux, only this thread's) CPU priority by ``nice``.

    The hub shares nodes with training ranks and their data loaders; run niced, it
    takes the CPU time they leave, and when it cannot keep up, records are dropped
    and counted rather than a rank slowed. Returns whether it took effect.
    """
    try:
        if thread and sys.platform.startswith("linux"):
            tid = threading.get_native_id()  # a Linux thread is a task with its own nice
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        else:
            os.nice(nice)
        return True
    except (OSError, AttributeError) as exc:
        log.info("rtop: could not lower the hub's priority: %s", exc)
        return False


class ThreadedHub:
    """A hub on a daemon thread with its own event loop.

    ``start()`` returns once it listens; ``address`` and ``token`` are then set.
    """

    def __init__(self, job: str = "", record: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None, linger_s: float | None = None,
                 on_exit: Callable[[], None] | None = None, thresholds: Any = None,
                 nice: int = 0, **settings: Any) -> None:
        self.cfg, self._discovery = _own_discovery(HubConfig(
            host=host, port=port, token=token, job=job, record=record, linger_s=linger_s,
            **settings))
        self.job = job
        self.thresholds = thresholds  # an AnalysisConfig, a JSON file path, or None
        self.nice = nice  # the hub thread's niceness: >0 yields the CPU to the job
        self.hub: Hub | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._on_exit = on_exit
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rtop-hub", daemon=True)

    @property
    def address(self) -> str:
        """``host:port`` the hub listens on."""
        return self.hub.address if self.hub else ""

    @property
    def token(self) -> str:
        """The hub's token."""
        return self.hub.token if self.hub else ""

    @property
    def record_path(self) -> str | None:
        """Where the hub records, if it does."""
        rec = self.hub.recorder if self.hub else None
        return str(rec.path) if rec else None

    def start(self, timeout: float = 10.0) -> ThreadedHub:
        """Start the thread and wait until the hub listens."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the hub did not start")
        if self._error is not None:
            raise RuntimeError(f"the hub failed to start: {self._error}") from self._error
        return self

    def _run(self) -> None:
        if self.nice:
            lower_priority(self.nice, thread=True)
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def main() -> None:
            self.hub = Hub(self.cfg, hub_monitor(self.cfg, self.thresholds))
            try:
                await self.hub.start()
                _started(self.hub, self._discovery)
            except BaseException:
                await self.hub.close()
                raise
            finally:
                self._ready.set()
            try:
                await self.hub.serve_forever()
            finally:
                await self.hub.close()
                _ended(self._discovery)

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()
        if self._on_exit is not None:
            self._on_exit()

    def call(self, fn: Callable[[Hub], Any], timeout: float = 10.0) -> Any:
        """Run ``fn(hub)`` on the hub's loop and return its result."""
        assert self._loop is not None and self.hub is not None
        hub = self.hub

        async def run() -> Any:
            return fn(hub)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the hub (flushing the recording) and join its thread."""
        if self._loop is not None and self.hub is not None and self._thread.is_alive():
            hub = self.hub
            # closing ends serve_forever, and the thread closes its loop right after: do
            # not wait on a future that loop may never resolve, wait for the thread
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(hub.close()))
        self._thread.join(timeout)
