"""Where the UI's data comes from: a live hub, a recording, or fixed snapshots.

A source runs in the app's worker thread (:meth:`Source.run`) and talks back only by
posting messages; the UI never touches a socket or a file itself. Every source produces
the hub's :class:`~rtop.run.snapshot.Snapshot` (``Monitor.snapshot()``), so live and
replay share every screen.
"""

from __future__ import annotations

import math
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

from textual.message import Message

from collectors import wire
from rtop.analysis import AnalysisConfig, Monitor
from rtop.analysis.viewport import ViewRequest, viewport
from rtop.fmt import fmt_duration
from rtop.run.recording import ReadResult, is_blocks, read, span
from rtop.run.seek import Seeker
from rtop.run.snapshot import HubInfo, RankDetail, ReplayInfo, Snapshot
from rtop.run.state import RunState
from rtop.run.validate import ProtocolError
from rtop.tui.messages import DetailReceived, SnapshotReceived, SourceStatus

#: How a source hands a message to the app (``App.post_message``).
Post = Callable[[Message], object]


class Source:
    """Base class: ``run(post, stop)`` until ``stop`` is set; ``follow(rank)`` asks for
    that rank's full detail with every update (None: no detail wanted); ``want(view)``
    says which rows the screens show (:class:`~rtop.analysis.viewport.ViewRequest`):
    every snapshot posted is that view's (``rtop.analysis.viewport.viewport``)."""

    live = True
    title = ""

    def __init__(self) -> None:
        self.detail_rank: int | None = None
        self.view = ViewRequest()
        self.wake = threading.Event()

    def follow(self, rank: int | None) -> None:
        """Send :class:`DetailReceived` for ``rank`` from now on (None stops it)."""
        self.detail_rank = rank
        self.wake.set()

    def want(self, view: ViewRequest) -> None:
        """Send the snapshot of ``view`` from now on, the next one at once (called from
        the UI thread: the worker reads the attribute, which is replaced whole)."""
        if view != self.view:
            self.view = view
            self.wake.set()

    def run(self, post: Post, stop: threading.Event) -> None:  # pragma: no cover - abstract
        """Produce messages until ``stop`` is set."""
        raise NotImplementedError


class LiveSource(Source):
    """A running job's hub, polled at ``rate_hz`` (default 2 Hz) over one viewer
    connection; reconnects with backoff if the hub goes away."""

    def __init__(self, address: str, token: str | None, rate_hz: float = 2.0) -> None:
        super().__init__()
        self.address, self.token, self.rate_hz = address, token, rate_hz
        self.title = address

    def act(self, action: str, ranks: list[int] | None = None,
            args: dict[str, Any] | None = None,
            on_started: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Ask the hub for an action (profile, probe, stacks) over a connection of its
        own as a control peer, and wait for the result (raises ``HubError``);
        ``on_started`` hears the hub's ``started`` answers (a probe's re-measurement of
        its slow links is one)."""
        from rtop.client import HubClient

        with HubClient(self.address, self.token, timeout=10.0, role="control") as client:
            return client.act(action, ranks=ranks, args=args, on_started=on_started)

    def run(self, post: Post, stop: threading.Event) -> None:
        """Poll the hub until ``stop``; say so when it is unreachable, and retry."""
        from rtop.client import HubClient, HubError

        backoff = 0.5
        while not stop.is_set():
            try:
                with HubClient(self.address, self.token, timeout=5.0) as client:
                    post(SourceStatus(f"live · {self.address}"))
                    backoff = 0.5
                    while not stop.is_set():
                        t0 = time.monotonic()
                        post(SnapshotReceived(client.snapshot(self.view)))
                        rank = self.detail_rank
                        if rank is not None:
                            post(DetailReceived(client.rank(rank)))
                        self.wake.clear()
                        self.wake.wait(max(0.0, 1.0 / self.rate_hz - (time.monotonic() - t0)))
            except HubError as exc:
                post(SourceStatus(f"{exc}; retrying in {backoff:.0f} s", error=True))
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)


class StaticSource(Source):
    """Fixed snapshots (tests, screenshots, benchmarks): posts them in turn, then keeps
    the last one. ``details`` maps a rank to its detail."""

    live = False

    def __init__(self, snapshots: list[Snapshot],
                 details: dict[int, RankDetail] | None = None, title: str = "fixture",
                 interval_s: float = 0.5) -> None:
        super().__init__()
        self.snapshots, self.details = snapshots, details or {}
        self.title, self.interval_s = title, interval_s

    def run(self, post: Post, stop: threading.Event) -> None:
        """Post each snapshot (and the followed rank's detail), then idle."""
        post(SourceStatus(self.title))
        i = 0
        while not stop.is_set():
            snap = self.snapshots[min(i, len(self.snapshots) - 1)]
            post(SnapshotReceived(viewport(snap, self.view)))
            i += 1
            rank = self.detail_rank
            if rank is not None:
                post(DetailReceived(self.details.get(rank, {"rank": rank, "found": False})))
            self.wake.clear()
            self.wake.wait(self.interval_s)


_CLOCK_MARK = b"\x92\xa5clock"  # the start of a msgpack ["clock", {...}] body


def recording_span(path: str | Path) -> tuple[float | None, float | None]:
    """``(start, end)`` hub times of a recording, read from its head and tail only (of
    the block format: its first block and its blocks' headers)."""
    if is_blocks(path):
        return span(path)
    start = end = None
    with open(path, "rb") as f:
        try:
            head = wire.read_frame(f)
        except wire.WireError:
            head = None
        if head is not None and head.kind == wire.KIND_RUN:
            hub = head.payload.get("hub")
            if isinstance(hub, dict) and isinstance(hub.get("started"), (int, float)) \
                    and math.isfinite(hub["started"]):
                start = float(hub["started"])
        size = f.seek(0, 2)
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    i = len(tail)
    while True:
        i = tail.rfind(_CLOCK_MARK, 0, i)
        if i < wire.HEADER_BYTES:
            break
        try:
            n = wire.parse_header(tail[i - wire.HEADER_BYTES:i])
            # wire's own decoder: what a body claims is checked against what it holds
            frame = wire.decode_body(tail[i:i + n])
            t = frame.payload.get("t_hub") if frame.kind == wire.KIND_CLOCK else None
            if isinstance(t, (int, float)) and not isinstance(t, bool) \
                    and math.isfinite(t):
                end = float(t)
                break
        except (wire.WireError, struct.error, ValueError):
            continue
    return start, end


#: The replay speeds :meth:`ReplaySource.faster` steps through.
SPEEDS: Final = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class ReplaySource(Source):
    """A recording played back through the same state and diagnosis as the live hub.

    :meth:`toggle_pause`, :meth:`faster`, :meth:`set_speed`, :meth:`seek` (seconds from
    the start) and :meth:`seek_step` are safe to call from the UI thread; they wake the
    player, which applies them at once. Seeking back replays from the start (the
    diagnosis needs the history).
    """

    live = False
    TICK_S = 0.25
    #: seeking: frames older than this before the target skip the rolling windows
    #: (they would be pushed out by newer ones; 1,200 steps at 2 steps/s is 600 s)
    HISTORY_S = 900.0
    #: seeking in a recording of the block format: jump (:meth:`jump`) rather than play
    #: up to the target when more frames than this lie between (about 0.4 s of work)
    JUMP_FRAMES = 8_000
    #: ... and, after a jump, diagnose the last this many seconds before the target (an
    #: evaluation of a thousand ranks costs tens of milliseconds)
    JUMP_ANALYSE_S = 1.0

    def __init__(self, path: str | Path, thresholds: AnalysisConfig | None = None,
                 speed: float = 1.0, paused: bool = False) -> None:
        super().__init__()
        self.path = Path(path)
        self.title = self.path.name
        self.thresholds = thresholds or AnalysisConfig.load()
        self._speed, self._paused = speed, paused
        self.start, self.end = recording_span(self.path)
        #: jumps in a recording of the block format (None: the older format)
        self._seeker = Seeker(self.path) if is_blocks(self.path) else None
        self._seek: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self.position = 0.0  # seconds since the recording started
        self.finished = False
        self.warnings: list[str] = []

    @property
    def duration(self) -> float | None:
        """Length of the recording in seconds (None if it has no clock yet)."""
        if self.start is None or self.end is None:
            return None
        return max(0.0, self.end - self.start)

    @property
    def speed(self) -> float:
        """How many seconds of the recording play per second."""
        return self._speed

    @property
    def paused(self) -> bool:
        """Whether the replay stands still."""
        return self._paused

    def toggle_pause(self) -> bool:
        """Pause, or play on; returns whether it is paused now."""
        with self._lock:
            self._paused = paused = not self._paused
        self.wake.set()
        return paused

    def set_speed(self, speed: float) -> None:
        """Play ``speed`` seconds of the recording per second."""
        with self._lock:
            self._speed = speed
        self.wake.set()

    def faster(self, steps: int) -> float:
        """The speed ``steps`` places up :data:`SPEEDS` (down when negative, from the
        nearest one, within its ends); returns the new speed."""
        with self._lock:
            i = min(range(len(SPEEDS)), key=lambda k: abs(SPEEDS[k] - self._speed))
            self._speed = speed = SPEEDS[max(0, min(len(SPEEDS) - 1, i + steps))]
        self.wake.set()
        return speed

    def seek(self, seconds: float) -> None:
        """Jump to ``seconds`` from the start of the recording."""
        with self._lock:
            self._seek = ("time", max(0.0, seconds))
        self.wake.set()

    def seek_step(self, step: int) -> None:
        """Jump to the moment the first rank reached training step ``step``."""
        with self._lock:
            self._seek = ("step", float(step))
        self.wake.set()

    def snapshot_at(self, seconds: float, ranks: list[int] | tuple[int, ...] = ()
                    ) -> tuple[Snapshot, dict[int, RankDetail]]:
        """The snapshot (and these ranks' details) ``seconds`` into the recording,
        computed synchronously: for screenshots, fixtures and tests."""
        self._open()
        self._advance(until=(self._t0 or 0.0) + seconds)
        self._paused = True
        return self._snapshot(), {r: self.monitor.rank_detail(r) for r in ranks}

    # ---- the player --------------------------------------------------------------------

    def _open(self) -> None:
        self.monitor = Monitor(RunState(lost_after_s=10.0), self.thresholds)
        self.state = self.monitor.state
        self.result = ReadResult()
        self._frames: Iterator[tuple[float, wire.Frame]] = read(self.path, self.result)
        self._next: tuple[float, wire.Frame] | None = None
        self._t0: float | None = self.start
        self._now = self.start or 0.0
        self.finished = False

    def _peek(self) -> tuple[float, wire.Frame] | None:
        if self._next is None:
            try:
                self._next = next(self._frames)
            except StopIteration:
                self.finished = True
                return None
            if self._t0 is None:
                self._t0 = self._next[0]
        return self._next

    def _advance(self, until: float | None, step: int | None = None,
                 analyse_from: float = 0.0) -> None:
        """Apply frames up to hub time ``until`` (or until a rank reaches ``step``)."""
        full_from = -math.inf if until is None else until - self.HISTORY_S
        while True:
            nxt = self._peek()
            if nxt is None:
                break
            t, frame = nxt
            if until is not None and t > until:
                break
            if step is not None and self._max_step() >= step:
                break
            self._next = None
            if not math.isfinite(t):  # a recording's clock is a peer's word too
                self.state.bad_frames += 1
                continue
            try:
                self.monitor.apply(frame, t, history=t >= full_from)
            except ProtocolError:
                self.state.bad_frames += 1
            self._now = max(self._now, t)
            if frame.kind == wire.KIND_CLOCK:
                self.state.now = t
                self.monitor.advance(t, diagnose=t >= analyse_from)
        if until is not None and not self.finished:
            self._now = until
            self.state.now = until

    def _max_step(self) -> int:
        steps = [r.last_step for r in self.state.active_ranks() if r.last_step is not None]
        return max(steps) if steps else -1

    def _snapshot(self) -> Snapshot:
        return self.monitor.snapshot(
            hub=HubInfo(address=None, counters={}, record=str(self.path)),
            replay=ReplayInfo(position_s=self._now - (self._t0 or 0.0),
                              duration_s=self.duration, speed=self.speed, paused=self.paused,
                              finished=self.finished, warnings=self.result.warnings[:3]))

    def run(self, post: Post, stop: threading.Event) -> None:
        """Play until ``stop``: a snapshot every tick, the followed rank's detail too."""
        try:
            self._open()
            self._advance(until=(self.start or 0.0) + 0.001)
        except (OSError, wire.WireError) as exc:
            post(SourceStatus(f"cannot replay {self.path}: {exc}", error=True))
            return
        post(SourceStatus(f"replay · {self.path.name}"))
        while not stop.is_set():
            t0 = time.monotonic()
            with self._lock:
                seek, self._seek = self._seek, None
            if seek is not None:
                self._do_seek(post, *seek)
            elif not self.paused and not self.finished:
                self._advance(until=self._now + self.TICK_S * self.speed)
            self.warnings = self.result.warnings
            self.position = self._now - (self._t0 or 0.0)
            post(SnapshotReceived(viewport(self._snapshot(), self.view)))
            rank = self.detail_rank
            if rank is not None:
                post(DetailReceived(self.monitor.rank_detail(rank)))
            self.wake.clear()
            # paused or at the end, nothing moves: a snapshot a second (any key wakes us)
            tick = self.TICK_S if not (self.paused or self.finished) else 1.0
            self.wake.wait(max(0.0, tick - (time.monotonic() - t0)))

    def _do_seek(self, post: Post, what: str, value: float) -> None:
        where = f"step {int(value)}" if what == "step" else fmt_duration(value)
        post(SourceStatus(f"seeking to {where}…"))
        t0 = self._t0 or 0.0
        if what == "time":
            target = t0 + value
            if not self._jumps_to(target):
                if target < self._now:
                    self._open()
                # the diagnosis needs a little history: analyse the last 15 s before it
                self._advance(until=target, analyse_from=target - 15.0)
        else:
            at = self._seeker.time_of_step(int(value)) if self._seeker else None
            if (at is None or not self._jumps_to(at)) and self._max_step() >= value:
                self._open()
            self._advance(until=None, step=int(value))
        post(SourceStatus(f"replay · {self.path.name}"))

    def _jumps_to(self, target: float) -> bool:
        """Jump to hub time ``target`` (:meth:`jump`) when playing up to it from here
        (or from the start, back) would take longer; whether it did."""
        seeker = self._seeker
        if seeker is None:
            return False
        seeker.refresh()  # a recording still being written has grown
        ahead = seeker.frames_between(self._now if target >= self._now else -math.inf,
                                      target)
        return ahead > self.JUMP_FRAMES and self.jump(target - (self._t0 or 0.0))

    def jump(self, seconds: float) -> bool:
        """Make the state ``seconds`` into the recording at once (a recording of the
        block format: :mod:`rtop.run.seek`), paused or playing on from there; False (and
        nothing changed) for a recording of the older format. The rolling windows then
        hold the last seconds before it, and fill as the replay plays on."""
        if self._seeker is None:
            return False
        self._open()
        target = (self._t0 or 0.0) + max(0.0, seconds)
        plan = self._seeker.jump(target)
        if plan.start is not None:
            for t, frame in plan.frames:
                try:
                    self.monitor.apply(frame, t, history=False)
                except ProtocolError:
                    self.state.bad_frames += 1
            if math.isfinite(plan.t):
                self.monitor.advance(plan.t, diagnose=False)
                self._now = max(self._now, plan.t)
            self._frames = read(self.path, self.result, start=plan.start)
        self._advance(until=target, analyse_from=target - self.JUMP_ANALYSE_S)
        return True

