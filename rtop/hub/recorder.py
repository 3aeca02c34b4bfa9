"""Appends every frame to the run's recording, in columnar, compressed blocks.

The recording starts with a ``run`` frame (what wrote it, when), then holds every frame
the ranks sent (as the hub's state took it), interleaved with the hub's own ``clock``
frames (the hub's time, at most every 0.25 s, so a replay knows when each frame
arrived), ``offset`` frames (a rank's clock offset) and ``conn`` frames (a rank's
connection closed), and ends with an ``end`` frame when the hub closes it (a recording
without one was cut short: ``rtop report`` says where).

Frames wait in memory and are written at each ``flush`` (the hub flushes at least once
a second, and before it acknowledges a rank's batches) as one block of the format of
:mod:`rtop.run.blocks`: a checksummed header and a zstandard-compressed body in which
the frames of one kind lie column by column, the records of every rank's batches too.
The measurements of the records are rounded to 14 significant bits (61 parts per
million, and no finer than their unit's resolution: :mod:`rtop.run.columns`);
everything else is kept exact. The blocks' headers say when their frames arrived and
what they hold, so a replay jumps anywhere at once (:mod:`rtop.run.seek`). At 4,096
ranks this is about a tenth of the older format, a wire frame after another
(``benchmarks/recording_size.py``), which a recording started in it keeps
(``rtop.run.recording`` reads both). The hub gives each frame as its state took it
(:meth:`Recorder.raw`'s ``frame``): that is what is recorded. A killed hub loses what
waited for the next flush: at most a second, and nothing it had acknowledged. When the
disk fills or the file becomes unwritable, recording stops with one error logged
(``failed``); the hub serves its ranks and viewers all the same.

That work (taking secrets out, decoding, laying out, rounding, compressing, writing) is
done by :class:`rtop.hub.record_proc.RecordCore`, in the hub's process while the frames
come slowly, and in a process of its own (``python -m rtop.hub.record_proc``, started
without forking the hub, fed each flush's frames through a pipe) once they come at more
than :data:`PROCESS_BYTES_PER_S` (or from the start, ``process=True``): for a large job
the hub's loop only gathers bytes. Both write the same file. A flush given ``then``
(the hub's acknowledgements) hands the frames over and returns at once; ``then`` runs on
the hub's loop once they are in the file, so acknowledged frames are always written.
Should the process die or hang, one error is logged and the hub writes what it had not
confirmed, and what comes after, itself (a new process is started later if the one
that died had run for a while). A hub killed loses nothing that reached the process's
pipe: it writes every whole chunk it was given before it ends.

The token is taken out where the frames are written (in the recorder's process too,
which gets the secrets through its pipe, never in its arguments or environment): a
frame holding a secret is never written, whichever process writes it.

It is opened as a private file (0600, never through a symbolic link, a regular file of
this user's: :func:`collectors.discovery.open_private`), and it never holds a secret:
a field named like one (``token``, ``proof``, ``nonce``, ``secret``, ...: see
:func:`rtop.run.recording.is_secret_key`) is dropped, and a value containing the hub's
token (:meth:`Recorder.add_secret`) is redacted, from whatever frame a peer sent, before
the frame is written.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import fcntl
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgpack

from collectors import wire
from collectors.discovery import open_private, safe_name
from rtop.hub import record_proc
from rtop.hub.record_proc import RecordCore
from rtop.run import blocks

log = logging.getLogger("rtop.hub")

CLOCK_EVERY_S = 0.25
#: Bytes of frames waiting that are handed over as one block before the next flush.
BLOCK_BYTES: Final = 16 * 1024 * 1024
#: Frames (bytes a second, over a second or more) above which the recording is written
#: by a process of its own rather than the hub's (``Recorder(process=None)``).
PROCESS_BYTES_PER_S: Final = 256 * 1024
#: A recorder process that confirms nothing for this long is taken for hung (killed).
HUNG_S: Final = 60.0
#: Bytes handed to the recorder's process and not yet confirmed written, above which
#: the hub stops reading its ranks until the process has written half of them (on a
#: machine whose cores are all busy, or a slow disk, the process falls behind, and
#: what it has not written would otherwise pile up in the hub's memory: 600 MB a
#: minute at 16,384 ranks). The ranks keep what is not acknowledged meanwhile, as they
#: do for a slow hub; the hub's loop goes on (viewers, pings, acknowledgements), and no
#: rank is taken for silent while the hub does not read (``Recorder.on_behind``).
BACKLOG_BYTES = 64 * 1024 * 1024
#: Past this many times :data:`BACKLOG_BYTES` (what reads already under way brought
#: after the hub stopped reading, or a recorder with nobody to pause its input) a flush
#: waits for the process to write half of :data:`BACKLOG_BYTES`: the memory's bound of
#: last resort.
HARD_BACKLOG_FACTOR: Final = 2
#: A recorder process is started again after one died only if that one ran this long.
RESTART_AFTER_S: Final = 60.0
#: The most recorder processes one recording starts.
MAX_PROCESSES: Final = 4

Then = Callable[[], None]
_FRAME_HEAD = wire.HEADER.pack


def default_runs_dir() -> Path:
    """Where recordings go unless told: ``$RTOP_RUNS_DIR``, else
    ``$XDG_DATA_HOME/rtop/runs`` (``~/.local/share/rtop/runs``)."""
    if os.environ.get("RTOP_RUNS_DIR"):
        return Path(os.environ["RTOP_RUNS_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "rtop" / "runs"


def default_record_path(job: str = "") -> Path:
    """A fresh recording path in :func:`default_runs_dir` named by job and time."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return default_runs_dir() / f"{safe_name(job, 'run', 60)}-{stamp}-{os.getpid()}.rtop"


def _loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _call_on(loop: asyncio.AbstractEventLoop, fn: Then) -> None:
    with contextlib.suppress(RuntimeError):  # a loop closed meanwhile: nobody to tell
        loop.call_soon_threadsafe(fn)


@dataclass
class _Handed:
    """A message handed to the recorder's process, until it answers it."""

    number: int
    kind: bytes
    body: bytes | bytearray
    since: float
    then: list[tuple[asyncio.AbstractEventLoop, Then]] = field(default_factory=list)


class _Process:
    """The recorder's process (:mod:`rtop.hub.record_proc`) and the two threads that
    talk to it: one writes the messages (a pipe may be full), one reads the answers."""

    def __init__(self, fd: int, start: dict[str, Any], path: Path,
                 on_failed: Callable[[str], None]) -> None:
        self.path = path
        self.on_failed = on_failed
        import collectors
        import rtop

        roots = {str(Path(m.__file__ or "").resolve().parent.parent)
                 for m in (rtop, collectors)}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [*sorted(roots), *filter(None, [os.environ.get("PYTHONPATH")])])
        # no fork of the hub (it may hold threads): a fresh interpreter, given the
        # recording's descriptor; the secrets go through the pipe, never argv or env
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rtop.hub.record_proc", str(fd)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,),
            start_new_session=True, env=env)
        self.started = time.monotonic()
        assert self.proc.stdin is not None
        with contextlib.suppress(AttributeError, OSError):  # Linux: a 1 MiB pipe
            fcntl.fcntl(self.proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
        self.lock = threading.Condition()
        self.pending: collections.deque[_Handed] = collections.deque()
        self.numbered = 0  # messages that get an answer, handed so far
        self.answered = 0
        self.backlog = 0  # bytes of the messages handed over and not answered
        self.state: dict[str, Any] = {k: start[k] for k in (
            "t", "frames", "written", "secrets_dropped", "undecodable")}
        self.dead: str | None = None  # why it ended before it was told to
        self.ending = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_dead: Then | None = None
        self._below: list[tuple[int, asyncio.AbstractEventLoop, Then]] = []
        self._out: queue.SimpleQueue[bytes | bytearray | None] = queue.SimpleQueue()
        self.send(record_proc.START, msgpack.packb(start, use_bin_type=True))
        self._threads = [threading.Thread(target=self._writing, daemon=True,
                                          name="rtop-recorder-writer"),
                         threading.Thread(target=self._reading, daemon=True,
                                          name="rtop-recorder-reader")]
        for t in self._threads:
            t.start()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def send(self, kind: bytes, body: bytes | bytearray, then: Then | None = None,
             loop: asyncio.AbstractEventLoop | None = None) -> int:
        """Hand a message over; returns the answer that confirms it (0: none comes)."""
        self._out.put(record_proc.MESSAGE.pack(kind, len(body)))
        if body:
            self._out.put(body)
        if kind in (record_proc.START, record_proc.SECRET):
            return 0
        with self.lock:
            self.numbered += 1
            h = _Handed(self.numbered, kind, body, time.monotonic())
            if then is not None and loop is not None:
                h.then.append((loop, then))
            self.pending.append(h)
            self.backlog += len(body)
            return self.numbered

    def after(self, then: Then, loop: asyncio.AbstractEventLoop) -> bool:
        """Call ``then`` on ``loop`` once everything handed over is written; False when
        nothing waits (call it now)."""
        with self.lock:
            if not self.pending:
                return False
            self.pending[-1].then.append((loop, then))
            return True

    def wait(self, number: int, timeout: float = HUNG_S) -> bool:
        """Wait until answer ``number`` came (True), the process died or ``timeout``
        passed (False)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.answered < number and self.dead is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(min(left, 1.0))
            return self.answered >= number

    def wait_backlog(self, most: int, timeout: float = HUNG_S) -> bool:
        """Wait until at most ``most`` bytes handed over are not answered (True), the
        process died or ``timeout`` passed (False)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.backlog > most and self.dead is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(min(left, 1.0))
            return self.backlog <= most

    def when_below(self, most: int, loop: asyncio.AbstractEventLoop, fn: Then) -> bool:
        """Call ``fn`` on ``loop`` once at most ``most`` bytes handed over are not
        answered (or the process died); False when that holds now (call it now)."""
        with self.lock:
            if self.backlog <= most or self.dead is not None:
                return False
            self._below.append((most, loop, fn))
            return True

    def _tell_below(self) -> list[tuple[asyncio.AbstractEventLoop, Then]]:
        """The :meth:`when_below` callbacks due now (under :attr:`lock`)."""
        due = [(loop, fn) for most, loop, fn in self._below
               if self.backlog <= most or self.dead is not None]
        if due:
            self._below = [w for w in self._below
                           if not (self.backlog <= w[0] or self.dead is not None)]
        return due

    def oldest(self) -> float | None:
        """Since when (monotonic) the oldest message not answered waits."""
        with self.lock:
            return self.pending[0].since if self.pending else None

    def end(self) -> None:
        """No more messages: the process writes what it has and exits."""
        self.ending = True
        self._out.put(None)

    def kill(self, why: str) -> None:
        """Take it for dead (``why``) and end it."""
        with self.lock:
            if self.dead is None:
                self.dead = why
            self.lock.notify_all()
        with contextlib.suppress(OSError):
            self.proc.kill()

    def take_pending(self) -> list[_Handed]:
        """The messages not answered, for another writer (once it is dead)."""
        with self.lock:
            out = list(self.pending)
            self.pending.clear()
            self.backlog = 0
            return out

    def _writing(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        fd = stdin.fileno()
        try:
            while (item := self._out.get()) is not None:
                view = memoryview(item)
                while view:
                    view = view[os.write(fd, view):]
        except OSError:  # it died: the reader says so
            pass
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    def _reading(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        fd = stdout.fileno()
        while True:
            head = record_proc.read_exactly(fd, record_proc.ANSWER.size)
            body = None if head is None else \
                record_proc.read_exactly(fd, record_proc.ANSWER.unpack(head)[0])
            if body is None:
                break
            number, state, notes = msgpack.unpackb(body, raw=False)
            for level, text in notes:
                log.log(level, "%s", text)
            then = []
            with self.lock:
                self.answered = number
                self.state = state
                while self.pending and self.pending[0].number <= number:
                    done = self.pending.popleft()
                    self.backlog -= len(done.body)
                    then += done.then
                then += self._tell_below()
                self.lock.notify_all()
            if state.get("failed"):
                self.on_failed(state["failed"])
            for loop, fn in then:
                _call_on(loop, fn)
        with contextlib.suppress(OSError):
            stdout.close()
        try:
            code = self.proc.wait(10 if self.ending else 2)
        except subprocess.TimeoutExpired:
            code = None
        with self.lock:
            if self.dead is None and (not self.ending or self.pending):
                self.dead = (f"killed by signal {-code}" if code is not None and code < 0
                             else f"exit status {code}" if code is not None
                             else "its answers ended")
            self.lock.notify_all()
            dead, its_loop, on_dead = self.dead, self.loop, self.on_dead
            below = self._tell_below()
        for loop, fn in below:
            _call_on(loop, fn)
        if dead is not None and its_loop is not None and on_dead is not None:
            _call_on(its_loop, on_dead)


class Recorder:
    """Writes frames to a recording file; ``flush()`` is called at least once a second.

    ``rounded=False`` keeps every measurement exact (a recording about 3x, not 10x,
    smaller than the older format: see :mod:`rtop.run.columns`); ``legacy=True`` writes
    the older format (one wire frame after another), as does a recording that was
    started in it. ``process``: write the blocks in a process of the recorder's own
    from the start (True), never (False), or once the frames come fast (None: see the
    module doc).
    """

    def __init__(self, path: str | Path, run_info: dict[str, Any],
                 secrets: list[str] | None = None, *, rounded: bool = True,
                 legacy: bool = False, process: bool | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # raises PermissionError for a link, a FIFO, a device or another user's file
        self._fd = open_private(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        head = os.pread(self._fd, len(blocks.FILE_MAGIC), 0)
        self._last_clock = -1.0
        self._buf = bytearray()
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._closed = False
        self.failed = False
        self._process = process
        self._proc: _Process | None = None
        self._started = 0  # recorder processes started
        #: called with True when the recorder's process falls :data:`BACKLOG_BYTES`
        #: behind (the hub stops reading its ranks), with False once it has written
        #: half of that (the hub reads again); on the event loop that flushed. Without
        #: it, a flush that finds the process that far behind waits for it.
        self.on_behind: Callable[[bool], None] | None = None
        #: the process is behind: :attr:`on_behind` was told so, and not yet otherwise
        self.behind = False
        self._behind_since = 0.0
        #: times the recorder's process fell behind (the hub stopped reading, or a flush
        #: waited), and for how long in all
        self.stalls = 0
        self.stalled_s = 0.0
        #: of those, the flushes that waited (the loop held up: the bound of last resort)
        self.waits = 0
        self._rate_t, self._rate_bytes = time.monotonic(), 0
        blocked = head == blocks.FILE_MAGIC or (not head and not legacy)
        if blocked and not blocks.available():  # pragma: no cover - the app extra has it
            log.warning("rtop hub: zstandard is not installed: recording %s in the older, "
                        "larger format (pip install 'rtop-train[app]')", self.path)
            blocked = False
        self._core: RecordCore | None = RecordCore(
            self._fd, blocked=blocked, rounded=rounded, path=str(self.path))
        self._blocked, self._rounded = blocked, rounded
        self._secrets: list[bytes] = []
        for secret in secrets or ():
            self.add_secret(secret)
        if blocked and not head:
            try:
                os.write(self._fd, blocks.FILE_MAGIC)
            except OSError as exc:
                self._stop(str(exc))
        self.frame(wire.KIND_RUN, run_info, None)
        self.flush()  # the file says what it is, and when it started, at once
        if process:
            self._start_process()

    # ---- what was written ----------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        if self._core is not None:
            return self._core.state()
        assert self._proc is not None
        return self._proc.state

    @property
    def frames(self) -> int:
        """Frames written (confirmed, when a process writes them)."""
        return int(self._state()["frames"])

    @property
    def bytes(self) -> int:
        """Bytes this recorder wrote to the file (confirmed, when a process writes)."""
        return int(self._state()["written"])

    @property
    def secrets_dropped(self) -> int:
        """Fields (or values) taken out of frames because they were secrets."""
        return int(self._state()["secrets_dropped"])

    @property
    def process_pid(self) -> int | None:
        """The recorder's process, while one writes the recording."""
        return self._proc.pid if self._proc is not None else None

    # ---- frames in -------------------------------------------------------------------------

    def add_secret(self, secret: str) -> None:
        """A value (the hub's token) that must never be written, under any name (from
        the frames not yet handed over on)."""
        if secret and secret.encode() not in self._secrets:
            self._secrets.append(secret.encode())
            if self._core is not None:
                self._core.add_secret(secret.encode())
            if self._proc is not None:
                self._proc.send(record_proc.SECRET, secret.encode())

    def _stop(self, why: str) -> None:
        if not self.failed:
            self.failed = True
            if self._core is not None and self._core.failed is None:  # not logged yet
                log.error("rtop hub: recording to %s stopped: %s", self.path, why)

    def clock(self, t_hub: float, force: bool = False) -> None:
        """Note the hub's time if it moved on since the last note."""
        if force or t_hub - self._last_clock >= CLOCK_EVERY_S:
            self._last_clock = t_hub
            self._add(wire.encode(wire.KIND_CLOCK, {"t_hub": t_hub}))

    def _add(self, data: builtins.bytes) -> None:
        if self.failed or self._closed:
            return
        self._buf += data
        if len(self._buf) >= BLOCK_BYTES:
            self._flush(None, wait=False)

    def raw(self, data: builtins.bytes, t_hub: float, frame: wire.Frame | None = None) -> None:
        """A frame as a rank sent it (header and body), recorded without its secrets
        (see the module's docstring). ``frame``: the same frame as the caller decoded it
        (the hub's, once its state took it): recorded as it is then."""
        if self.failed or self._closed:
            return
        if t_hub - self._last_clock >= CLOCK_EVERY_S:
            self.clock(t_hub)
        if frame is not None:
            try:  # as wire.encode does, without making a packer each time
                body = self._pack([frame.kind, frame.payload])
            except (TypeError, ValueError, OverflowError):  # then as it was sent
                pass
            else:
                buf = self._buf
                buf += _FRAME_HEAD(wire.MAGIC, wire.VERSION, len(body))
                buf += body
                if len(buf) >= BLOCK_BYTES:
                    self._flush(None, wait=False)
                return
        self._add(data)

    def frame(self, kind: str, payload: dict[str, Any], t_hub: float | None) -> None:
        """A frame of the hub's own (secrets taken out all the same)."""
        if t_hub is not None:
            self.clock(t_hub)
        self._add(wire.encode(kind, payload))

    # ---- frames out ------------------------------------------------------------------------

    def flush(self, then: Then | None = None) -> None:
        """Write what is waiting (in the block format: as one block) to the file.

        Without ``then`` it returns once that is done. With it, called on a running
        event loop, it hands the frames over and returns at once, and ``then()`` runs on
        that loop once they (and all before them) are written, or recording stopped (the
        hub's acknowledgements); elsewhere ``then()`` runs before it returns."""
        loop = _loop() if then is not None else None
        self._flush(then if loop is not None else None, wait=loop is None, loop=loop)
        if then is not None and loop is None:
            then()

    def _flush(self, then: Then | None, wait: bool,
               loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._check_process()
        chunk, self._buf = self._buf, bytearray()  # not copied: never changed again
        proc = self._proc
        if proc is None:
            if chunk and self._core is not None and not self.failed:
                self._core.write(chunk)
                self._core_failed()
                self._pace(len(chunk))
            if then is not None:
                then()
            return
        number = proc.send(record_proc.DATA, chunk) if chunk and not self.failed else 0
        if proc.backlog > BACKLOG_BYTES and proc.dead is None:
            running = _loop()
            if self.on_behind is None or running is None \
                    or proc.backlog > HARD_BACKLOG_FACTOR * BACKLOG_BYTES:
                self._catch_up(proc)
            elif not self.behind:
                self._fall_behind(proc, running)
        if then is not None:
            assert loop is not None
            proc.loop, proc.on_dead = loop, self._check_process
            if not proc.after(then, loop):
                then()
        if wait:
            self._wait(proc, number or proc.numbered)

    def _fall_behind(self, proc: _Process, loop: asyncio.AbstractEventLoop) -> None:
        """The recorder's process is :data:`BACKLOG_BYTES` behind: tell
        :attr:`on_behind` (the hub stops reading its ranks) and, once the process has
        written half of that, tell it again (see :meth:`_caught_up`). A process that
        writes nothing meanwhile is taken for hung as ever (:meth:`_check_process`)."""
        self.behind, self._behind_since = True, time.monotonic()
        self.stalls += 1
        if self.stalls == 1:
            log.warning("rtop hub: the recorder's process fell %.0f MB behind (the "
                        "machine's cores are busy, or its disk is slow): the hub reads its "
                        "ranks again once it has caught up (they keep what is not "
                        "acknowledged meanwhile; logged once, counted in recorder_stalls)",
                        proc.backlog / 1e6)
        if not proc.when_below(BACKLOG_BYTES // 2, loop, self._caught_up):
            loop.call_soon(self._caught_up)
        assert self.on_behind is not None
        self.on_behind(True)

    def _caught_up(self) -> None:
        """The process behind has written half of :data:`BACKLOG_BYTES` (or ended): tell
        :attr:`on_behind`."""
        if not self.behind:
            return
        self.behind = False
        self.stalled_s += time.monotonic() - self._behind_since
        if self.on_behind is not None:
            self.on_behind(False)

    def _catch_up(self, proc: _Process) -> None:
        """The recorder's process is too far behind, and nothing stops the frames coming
        (nobody to tell, or past :data:`HARD_BACKLOG_FACTOR` times the bound): wait for
        it to write down to half of :data:`BACKLOG_BYTES` (the hub's loop waits too;
        :attr:`on_behind` is told, so that no rank is taken for silent meanwhile), or
        take it for hung."""
        behind = proc.backlog
        told = self.on_behind is not None and not self.behind
        if told:
            assert self.on_behind is not None
            self.on_behind(True)
        t0 = time.monotonic()
        caught_up = proc.wait_backlog(BACKLOG_BYTES // 2)
        waited = time.monotonic() - t0
        self.waits += 1
        if not self.behind:  # else counted from when it fell behind
            self.stalls += 1
            self.stalled_s += waited
        if self.waits == 1:
            log.warning("rtop hub: the recorder's process fell %.0f MB behind (the "
                        "machine's cores are busy, or its disk is slow); the hub waited "
                        "%.1f s for it before reading on (logged once; counted in "
                        "recorder_stalls)", behind / 1e6, waited)
        if not caught_up and proc.dead is None:
            proc.kill(f"still {proc.backlog / 1e6:.0f} MB behind after {HUNG_S:.0f} s")
        self._check_process()
        if told and self.on_behind is not None:
            self.on_behind(False)

    def _wait(self, proc: _Process, number: int) -> None:
        if number and not proc.wait(number) and proc.dead is None:
            proc.kill(f"confirmed nothing for {HUNG_S:.0f} s")
        self._check_process()

    def sync(self) -> None:
        """Flush (everything given so far is in the file), and have the system write the
        file to disk (before a spool the recording now holds is let go:
        ``rtop.hub.spool``)."""
        self.flush()
        if self.failed or self._closed:
            return
        if self._proc is not None:
            self._wait(self._proc, self._proc.send(record_proc.SYNC, b""))
        if self._core is not None:  # also when the process died meanwhile
            self._core.sync()
            self._core_failed()

    def close(self) -> None:
        """Write the end mark (``KIND_END``: the hub closed the recording, which a
        report of a recording cut short misses), flush, close (and wait for the
        recorder's process to end)."""
        if self._closed:
            return
        self._check_process()
        chunk = bytes(self._buf)
        self._buf.clear()
        t = time.time()
        proc = self._proc
        if proc is not None:
            if not self.failed:
                proc.send(record_proc.END, msgpack.packb([t, chunk], use_bin_type=True))
            proc.end()
            self._wait(proc, proc.numbered)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(10)
            if proc.proc.poll() is None:
                proc.kill("it did not end")
                proc.proc.wait(5)
        elif self._core is not None and not self.failed:
            self._core.write(chunk, end_t=t)
            self._core_failed()
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # ---- the recorder's process ----------------------------------------------------------

    def _core_failed(self) -> None:
        if self._core is not None and self._core.failed is not None:
            self.failed = True

    def _pace(self, n: int) -> None:
        """Count the bytes written in the hub's process; start a process of the
        recorder's own when they come fast (see :data:`PROCESS_BYTES_PER_S`)."""
        self._rate_bytes += n
        now = time.monotonic()
        if now - self._rate_t < 1.0:
            return
        rate = self._rate_bytes / (now - self._rate_t)
        self._rate_t, self._rate_bytes = now, 0
        if self._process is not False and (self._process or rate >= PROCESS_BYTES_PER_S):
            self._start_process()

    def _start_process(self) -> None:
        core = self._core
        if core is None or self.failed or self._closed or self._started >= MAX_PROCESSES \
                or not sys.executable:  # an embedded interpreter: none to start
            return
        start = core.state(full=True)
        start.update(blocked=self._blocked, rounded=self._rounded, path=str(self.path),
                     secrets=self._secrets)
        try:
            proc = _Process(self._fd, start, self.path, self._process_failed)
        except OSError as exc:
            log.error("rtop hub: the recorder's process could not start (%s): the hub "
                      "records %s itself", exc, self.path)
            self._started = MAX_PROCESSES
            return
        self._started += 1
        self._proc, self._core = proc, None
        log.info("rtop hub: recording to %s in a process of its own (pid %d)", self.path,
                 proc.pid)

    def _process_failed(self, why: str) -> None:
        self.failed = True  # the process logged why (once)

    def _check_process(self) -> None:
        """Should the recorder's process have died (or hung), the hub's process takes
        over: what the process had not confirmed is written here, and the hub is told
        as it would have been (one error logged)."""
        proc = self._proc
        if proc is None:
            return
        oldest = proc.oldest()
        if proc.dead is None and oldest is not None and \
                time.monotonic() - oldest > HUNG_S:
            proc.kill(f"confirmed nothing for {HUNG_S:.0f} s")
        if proc.dead is None:
            return
        self._proc = None
        with contextlib.suppress(OSError):
            proc.proc.kill()
        left = proc.take_pending()
        log.error("rtop hub: the recorder's process (pid %d) ended (%s); the hub records "
                  "%s itself%s", proc.pid, proc.dead, self.path,
                  f", from {len(left)} flushes it had not confirmed" if left else "")
        state = dict(proc.state)
        core = self._core = RecordCore(
            self._fd, blocked=self._blocked, rounded=self._rounded, path=str(self.path),
            secrets=self._secrets, t=state["t"], frames=state["frames"],
            written=state["written"], secrets_dropped=state["secrets_dropped"],
            undecodable=state["undecodable"])
        if time.monotonic() - proc.started < RESTART_AFTER_S:
            self._started = MAX_PROCESSES  # it would die again: this process records
        for h in left:
            if h.kind == record_proc.DATA:
                core.write(h.body)
            elif h.kind == record_proc.SYNC:
                core.sync()
            elif h.kind == record_proc.END:
                t, chunk = msgpack.unpackb(h.body, raw=False)
                core.write(chunk, end_t=t)
            for loop, fn in h.then:
                _call_on(loop, fn)
        self._core_failed()
        self._caught_up()  # nothing waits for it now: the hub reads again
