"""Where rtop's code runs on the training thread or inside autograd, and what a failure
there does: rtop never raises into training.

:data:`ENTRY_POINTS` lists every such place. Each is guarded where it is written (a
``try`` around rtop's own work, never around the job's: an exception from the user's
loader, model or hook still propagates unchanged). A failure turns that point's
feature off for the rest of the run, warns once and leaves a note that the rank sends
to the hub with its metadata (shown in the rank's detail in the UI):

========================  =============================================  =================
point                     where it runs                                  feature turned off
========================  =============================================  =================
``iter``                  ``probe.iter``: around each ``next()``         data-wait timing
``step.enter``            ``with probe.step():`` entry                   step timing
``step.exit``             ``with probe.step():`` exit                    step timing
``cuda.record``           recording a step's or a bucket's CUDA event    CUDA timing
``cuda.capture``          a CUDA graph's capture begin/end or replay     CUDA timing
``commhook.launch``       the comm hook, as DDP launches a bucket        collective timing
``commhook.done``         the comm hook's completion callback            collective timing
``ddptimer.read``         reading DDP's own timer at step exit           collective timing
``ddptimer.backward``     the hook on the last gradient (phase "comm")   collective timing
``collectives.launch``    a process group's collective, as it launches   direct collective timing
``collectives.done``      that collective's completion callback          direct collective timing
``collectives.wait``      ``Work.wait()`` on a collective                direct collective timing
``control.boundary``      running a hub's action at a step boundary      control actions
========================  =============================================  =================

A framework integration (a Lightning or Hugging Face callback) adds its callbacks here,
guarded the same way, and the suite then covers them too.

With a feature off, the job runs exactly as without rtop at that point: a disabled step
timer is a no-op context, a disabled loader wrapper yields the loader's items, a
disabled comm hook only calls the allreduce it wraps, a disabled collective wrapper
(``collectors.collectives``: every collective but DDP's, FSDP's and a user's own) only
calls the process group's own method, and step records say the affected figures are
not measured (None), never zero. ``tests/test_never_raise.py``
injects an exception at each point and checks that a real DDP job runs to completion
with gradients identical to an unwatched one.
"""

from __future__ import annotations

import logging
from typing import Final, Protocol

log = logging.getLogger("collectors")

#: Every place rtop's code runs on the training thread or inside autograd:
#: point -> (where it runs, the feature a failure there turns off).
ENTRY_POINTS: Final[dict[str, tuple[str, str]]] = {
    "iter": ("probe.iter, around each next() of the wrapped loader", "data-wait timing"),
    "step.enter": ("the entry of `with probe.step()`", "step timing"),
    "step.exit": ("the exit of `with probe.step()`", "step timing"),
    "cuda.record": ("recording a step's or a bucket's CUDA event", "CUDA timing"),
    "cuda.capture": ("a CUDA graph's capture_begin, capture_end or replay, as rtop watches "
                     "them", "CUDA timing"),
    "commhook.launch": ("the DDP comm hook, as a bucket's allreduce is launched",
                        "collective timing"),
    "commhook.done": ("the DDP comm hook's completion callback", "collective timing"),
    "ddptimer.read": ("reading DDP's own timer at step exit", "collective timing"),
    "ddptimer.backward": ("the hook on the last gradient of backward", "collective timing"),
    "collectives.launch": ("a process group's collective (FSDP's, a user's own), as it "
                           "is launched", "direct collective timing"),
    "collectives.done": ("a process group collective's completion callback",
                         "direct collective timing"),
    "collectives.wait": ("Work.wait() on a process group collective",
                         "direct collective timing"),
    "control.boundary": ("running a hub's action (profile, probe) at a step boundary",
                         "control actions"),
}

#: The guarded points of framework integrations (``collectors.lightning``,
#: ``collectors.hf``), registered by each when it is imported (:func:`register`); their
#: own tests fault-inject them, since they need their framework.
CALLBACK_POINTS: dict[str, tuple[str, str]] = {}


def register(points: dict[str, tuple[str, str]]) -> None:
    """Add a framework integration's guarded points (point -> (where, feature))."""
    CALLBACK_POINTS.update(points)


class _Faulting(Protocol):
    def fault(self, point: str, error: BaseException | str) -> None: ...


def integration_failed(probe: _Faulting | None, point: str, error: BaseException,
                       feature: str, scope: str = "run") -> None:
    """An integration's guarded ``point`` failed (a framework callback's, ``rtop run``'s
    automatic instrumentation's): its probe turns the feature off
    (:meth:`collectors.probe.Probe.fault`: warned once, noted for the hub); before there
    is a probe, one warning that ``feature`` is off for this ``scope``."""
    if probe is not None:
        probe.fault(point, error)
    else:
        log.warning("rtop: %s is off for this %s after an error in %s: %s: %s",
                    feature, scope, point, type(error).__name__, error)


class Faults:
    """One probe's record of the features turned off after a failure (see module doc).

    ``notes`` is the probe's list of notes (sent to the hub); each feature is reported
    there, and logged as a warning, once.
    """

    def __init__(self, notes: list[str]) -> None:
        self._notes = notes
        #: feature -> the note saying why it is off.
        self.off: dict[str, str] = {}

    def failed(self, point: str, error: BaseException | str) -> bool:
        """``point`` failed with ``error``: turn its feature off. True the first time
        the feature goes off (the caller then does what turning it off takes)."""
        where, feature = ENTRY_POINTS.get(point) or CALLBACK_POINTS.get(point, (point, point))
        if feature in self.off:
            return False
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        note = (f"rtop turned off {feature} for the rest of the run after an error in "
                f"{where} ({point}): {error}"[:600])
        self.off[feature] = note
        try:
            log.warning("rtop: %s", note)
            self._notes.append(note)
        except Exception:  # a broken logging handler must not be what breaks the job
            pass
        return True
