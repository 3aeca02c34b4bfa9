"""A last word when a launcher tears the rank down: a goodbye on SIGTERM.

torchrun and ``torch.multiprocessing.spawn`` end the surviving ranks with SIGTERM a few
milliseconds after one of them dies, so at the hub every rank vanishes at once and the
one that died first cannot be told apart from those that were killed after it. A rank
that says "terminated by SIGTERM" as it goes is a follower, not a culprit.

:func:`install` (called by ``collectors.start``) puts a SIGTERM handler in place only
where the job has none of its own (the disposition is still the default), only from
the main thread and only where signals can be handled (POSIX); with ``RTOP_DISABLE=1``
``start`` makes no probe and nothing is installed. On SIGTERM the handler has the
sender flush and send a goodbye with the error ``terminated by SIGTERM``, waiting at
most :data:`GOODBYE_S` for it, then puts the default disposition back and raises the
signal again: the process dies of SIGTERM, exactly as it would have without rtop.

Python runs a signal handler on the main thread between two bytecodes, never while the
main thread is blocked inside C code (a collective waiting for a dead peer). So the
handler is also reached through the interpreter's wakeup fd: the C-level handler writes
the signal's number to a pipe that a small daemon thread watches, and that thread says
goodbye and ends the process itself when the main thread cannot. Whichever comes first
does it. A job that installs its own SIGTERM handler later replaces ours: the watch
thread then leaves the signal to it, and ours, if the job's calls it as the handler it
replaced (Lightning chains them), does nothing. A forked child (a data-loader worker) gets the
default disposition back and no wakeup fd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from types import FrameType
from typing import Any, Protocol

log = logging.getLogger("collectors")

#: The most seconds the goodbye may hold up the rank's death.
GOODBYE_S = 0.1

__all__ = ["GOODBYE_S", "Goodbye", "install", "installed"]


class Goodbye(Protocol):
    """What the handler needs of a probe: a bounded last word (``Probe.last_word``)."""

    def last_word(self, error: str, timeout: float) -> None:
        """Send what is pending and a goodbye carrying ``error``, within ``timeout``."""


class _Installed:
    """What :func:`install` put in place (one per process)."""

    def __init__(self, probe: Goodbye) -> None:
        self.probe = probe
        self.pid = os.getpid()
        self.once = threading.Lock()
        self.wake_r = -1
        self.wake_w = -1
        self.watcher: threading.Thread | None = None
        self.lent = False  # the wakeup fd taken back while the main thread forks
        self.lent_handler = False  # ... and SIGTERM's default disposition put back


_state: _Installed | None = None


def installed() -> bool:
    """Whether this process's SIGTERM goodbye is in place (and still ours)."""
    st = _state
    return st is not None and st.pid == os.getpid() and signal.getsignal(
        signal.SIGTERM) is _on_sigterm


def install(probe: Goodbye) -> bool:
    """Say goodbye through ``probe`` on SIGTERM (see the module doc); True when
    installed. Never raises; does nothing where the job handles (or ignores) SIGTERM
    itself, off the main thread, or where signals cannot be handled."""
    global _state
    try:
        if os.name != "posix" or not hasattr(signal, "SIGTERM"):
            return False
        if threading.current_thread() is not threading.main_thread():
            return False
        if _state is not None and _state.pid == os.getpid():
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                _state.probe = probe  # a new probe of the same process
                return True
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False  # the job's own handler (or SIG_IGN, or one set from C) stays
        st = _Installed(probe)
        signal.signal(signal.SIGTERM, _on_sigterm)
        _state = st
        _watch(st)
        return True
    except Exception as exc:  # never break the job because of rtop
        log.debug("rtop: could not install the SIGTERM goodbye: %r", exc)
        return False


# ---- the watch thread: SIGTERM while the main thread is stuck in C --------------------

def _watch(st: _Installed) -> None:
    """Take the interpreter's wakeup fd, if nobody else has it, and watch it."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        old = -2
    if old != -1:  # someone's (asyncio's): leave it; the handler alone must do
        if old >= 0:
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    st.wake_r, st.wake_w = r, w
    st.watcher = threading.Thread(target=_watch_loop, args=(st,), name="rtop-lastgasp",
                                  daemon=True)
    st.watcher.start()


def _release_wakeup_fd(st: _Installed) -> None:
    """Give the wakeup fd up if it is still ours (someone else's stays)."""
    with contextlib.suppress(ValueError, OSError):
        current = signal.set_wakeup_fd(-1)
        if current not in (-1, st.wake_w):
            signal.set_wakeup_fd(current)


def _watch_loop(st: _Installed) -> None:
    """Wait for signal numbers on the wakeup pipe; on SIGTERM, while the handler is
    still ours, say goodbye and end the process (the main thread may never get to)."""
    fd = st.wake_r
    term = int(signal.SIGTERM)
    try:
        while True:
            select.select([fd], [], [])
            with contextlib.suppress(BlockingIOError, InterruptedError):
                data = os.read(fd, 512)
                if term in data and _state is st \
                        and signal.getsignal(signal.SIGTERM) is _on_sigterm:
                    _goodbye_and_die(st, from_main=False)
    except Exception as exc:  # a bug: the handler on the main thread remains (the pipe
        # stays open: the interpreter may still write to it)
        log.debug("rtop: the SIGTERM watch stopped: %r", exc)


# ---- the handler -----------------------------------------------------------------------

def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """The SIGTERM handler (main thread)."""
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        # the job's handler replaced ours and calls it as "the previous one" (Lightning
        # chains them so): SIGTERM is the job's to handle, as if rtop were not here
        return
    st = _state
    if st is None or st.pid != os.getpid():  # a forked child that kept it: die as usual
        _die(from_main=True)
        return
    _goodbye_and_die(st, from_main=True)


def _goodbye_and_die(st: _Installed, from_main: bool) -> None:
    """The goodbye (once, whichever thread gets here first), then death by SIGTERM."""
    if st.once.acquire(blocking=False):
        try:
            st.probe.last_word("terminated by SIGTERM", GOODBYE_S)
        except Exception as exc:
            log.debug("rtop: the goodbye on SIGTERM failed: %r", exc)
    elif from_main:
        time.sleep(GOODBYE_S + 0.05)  # the watch thread says goodbye and ends us
    else:
        return  # the main thread's handler says goodbye and ends us
    _die(from_main)


def _die(from_main: bool) -> None:
    """Default disposition back, then the signal again: the process dies of SIGTERM."""
    if from_main:
        with contextlib.suppress(Exception):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    elif not _default_from_c():
        os._exit(128 + int(signal.SIGTERM))  # as a shell reports death by SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)
    if not from_main:
        time.sleep(1.0)  # the signal is on its way
        os._exit(128 + int(signal.SIGTERM))


def _default_from_c() -> bool:
    """Set SIGTERM's disposition to the default from any thread (``signal.signal``
    works on the main thread only): libc's ``signal()`` through ctypes."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn: Any = libc.signal
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_void_p
        fn(int(signal.SIGTERM), None)  # NULL is SIG_DFL
        return True
    except Exception:
        return False


def _before_fork() -> None:
    """The default disposition and no wakeup fd while the main thread forks: a child
    that receives SIGTERM before its own hook has run would otherwise lose it (the
    interpreter clears pending signals in a new child) or write it to the parent's pipe,
    where the watch thread would take it for the parent's. (A fork from another thread
    keeps that window: ``signal`` and ``set_wakeup_fd`` work on the main thread only.)"""
    st = _state
    if st is None or st.pid != os.getpid() \
            or threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(Exception):
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            st.lent_handler = True
    if st.wake_w < 0:
        return
    with contextlib.suppress(Exception):
        current = signal.set_wakeup_fd(-1)
        if current == st.wake_w:
            st.lent = True
        elif current != -1:
            signal.set_wakeup_fd(current)


def _after_fork_in_parent() -> None:
    """The handler and the wakeup fd back after the fork."""
    st = _state
    if st is None:
        return
    if st.lent_handler:
        st.lent_handler = False
        with contextlib.suppress(Exception):
            signal.signal(signal.SIGTERM, _on_sigterm)
    if st.lent:
        st.lent = False
        with contextlib.suppress(Exception):
            signal.set_wakeup_fd(st.wake_w, warn_on_full_buffer=False)


def _after_fork_in_child() -> None:
    """A forked child (a data-loader worker): SIGTERM kills it as it did, and signals
    it receives are not written to the parent's pipe."""
    global _state
    st = _state
    if st is None:
        return
    _state = None
    with contextlib.suppress(Exception):
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if st.wake_w >= 0:  # the watch thread did not survive the fork: the pipe is ours
        _release_wakeup_fd(st)
        for fd in (st.wake_r, st.wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
