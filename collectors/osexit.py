"""A goodbye before ``os._exit(0)``: a script that skips its teardown still ends cleanly.

Many training scripts end with ``os._exit(0)`` to skip NCCL's (slow, sometimes hanging)
teardown. That skips ``atexit`` too, so the probe's goodbye never went out and the hub
saw every rank's connection close without a word: ``lost_rank``, "the node likely went
away", for a job that finished.

:func:`install` (called by ``collectors.start``, so for ``rtop run``'s automatic
instrumentation and for the contract API alike) replaces ``os._exit`` with a wrapper.
When this process's probe is open and the code is 0, the wrapper has the sender flush
what is queued and say goodbye with reason ``exit``, waiting for it at most
:data:`GOODBYE_S`; then, always, the real ``os._exit`` runs with the same arguments. It
never raises and never holds the exit longer than the budget (a hub that does not read
costs the budget, no more). Elsewhere it costs one comparison:

* a non-zero code leaves without a goodbye, as before: the rank failed, and to the hub
  it is a lost rank, the culprit a crash's diagnosis names;
* a forked child (a data-loader worker, which multiprocessing ends with ``os._exit``)
  is not the process that started the probe: nothing is sent;
* no probe, or one already closed (whose goodbye is on its way): nothing is sent.

Code that took ``os._exit`` before the probe started (``from os import _exit``) calls
the original, and its rank ends as before: without a goodbye.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import threading
from collections.abc import Callable
from typing import Any, Final, NoReturn, Protocol

log = logging.getLogger("collectors")

#: The most seconds the goodbye may hold up ``os._exit``.
GOODBYE_S: Final = 0.5

__all__ = ["GOODBYE_S", "Goodbye", "install", "installed"]


class Goodbye(Protocol):
    """What the wrapper needs of a probe: a bounded last word (``Probe.last_word``)."""

    def last_word(self, error: str | None, timeout: float, *, reason: str = "signal"
                  ) -> None:
        """Send what is pending and a goodbye with ``reason``, within ``timeout``."""


class _Installed:
    """The probe the wrapper speaks for, and the process it belongs to."""

    def __init__(self, probe: Goodbye, real: Callable[..., NoReturn]) -> None:
        self.probe = probe
        self.pid = os.getpid()
        self.real = real


_state: _Installed | None = None
_lock = threading.Lock()


def installed() -> bool:
    """Whether ``os._exit`` is this module's wrapper, for a probe of this process."""
    st = _state
    return st is not None and st.pid == os.getpid() and getattr(
        os._exit, "_rtop", False) is True


def install(probe: Goodbye) -> bool:
    """Have ``os._exit(0)`` say goodbye through ``probe`` first (see the module doc);
    True when in place. A later probe of the process (or of a forked child that trains)
    takes the wrapper over. Never raises."""
    global _state
    try:
        with _lock:
            st = _state
            if st is not None and getattr(os._exit, "_rtop", False) is True:
                st.probe, st.pid = probe, os.getpid()
                return True
            real = os._exit
            st = _Installed(probe, real)

            @functools.wraps(real)
            def _exit(*args: Any, **kwargs: Any) -> NoReturn:
                try:
                    _goodbye(st, args, kwargs)
                finally:
                    real(*args, **kwargs)

            _exit._rtop = True  # type: ignore[attr-defined]
            os._exit = _exit
            _state = st
            return True
    except Exception as exc:  # never break the job because of rtop
        log.debug("rtop: could not wrap os._exit: %r", exc)
        return False


def _goodbye(st: _Installed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The goodbye, when due (code 0, this process's probe). A second thread that exits
    meanwhile waits for the same goodbye (``Probe.last_word`` once closed). Never
    raises."""
    try:
        code: Any = args[0] if args else kwargs.get("status")
        if operator.index(code) != 0 or os.getpid() != st.pid:
            return
        st.probe.last_word(None, GOODBYE_S, reason="exit")
    except BaseException:  # the real os._exit runs whatever happens here
        pass
