"""Ray Train: what the probe measures in a Ray Train worker with no extra line in the loop.

Both parts start by themselves; nothing here is called by the training loop directly.

* **Checkpoint cost.** When :func:`collectors.start` finds it runs in a Ray Train worker
  (Ray Train V2), it wraps the worker's ``report`` dispatcher (the ``TrainFnUtils``
  object that ``ray.train.report`` calls, so ``from ray.train import report`` imported
  before the probe started is caught too). A call given a checkpoint is timed as the
  ``"checkpoint"`` phase, exactly as ``with probe.checkpoint():`` around it would: the
  heartbeat shows the phase, and the event feeds the hub's ``checkpoint_interval``
  finding (Young/Daly). A report with metrics only is not timed. Inside
  ``with probe.checkpoint():`` the call is not timed twice. ``probe.close()`` puts the
  dispatcher back as it was.
* **The error that ended the training function.** Ray Train catches it in the worker
  (no ``sys.excepthook``, no ``atexit``: the worker group is then torn down and its
  processes killed). The probe hears of it as Ray Train does (where Ray Train turns it
  into the error it reports), closes with it, and the hub shows the rank ``failed``
  with the error, before a restart replaces the worker group.
* **Ray Data cross-check.** ``probe.iter`` over an iterable from a Ray Data iterator's
  ``iter_torch_batches`` or ``iter_batches`` (a Ray Train dataset shard, a dataset)
  returns a :class:`RayDataIterable`: the same timing as any loader, plus, at the end of
  each pass (exhausted, ``break`` or an exception), Ray Data's own account of the pass
  read from the iterator's ``DatasetStats``: the time the loop was blocked in the
  iterator (``iter_total_blocked_s``), and the time it took to set the pass up
  (``iter_initialize_s``, inside the probe's first wait of the pass). Their sum is
  compared with the probe's data wait summed over the pass (every ``next()``, the one
  that ended the pass included). The rank sends the totals over all passes as
  ``meta["ray_data"]`` (:data:`RAY_DATA_FIELDS`) and a note in words saying whether
  they agree within :data:`TOLERANCE_REL` (or :data:`TOLERANCE_ABS_S`, whichever is
  larger). A wide gap means one of the two misses time: another wrapper between Ray
  Data and the loop, or batches taken from the iterator outside ``probe.iter``.

rtop never raises into the job from here: both parts are guarded points
(:data:`POINTS`, registered with :mod:`collectors.guard`). A failure turns that part off
for the rest of the run with one note; the user's ``report`` call still runs exactly
once, and its own exceptions propagate unchanged; batches still flow.

This module never imports Ray: it uses the Ray modules the worker has already imported.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Final, TypeVar

from collectors import guard
from collectors.probe import TimedIterable

if TYPE_CHECKING:
    from collectors.probe import Probe

log = logging.getLogger("collectors")

T = TypeVar("T")

__all__ = ["POINTS", "RAY_DATA_FIELDS", "RayDataIterable", "RayTrainHooks", "compare",
           "data_iterable", "install"]

#: What a failure in the ``report`` wrapper turns off.
CHECKPOINT_FEATURE: Final = "checkpoint timing of ray.train.report"
#: What a failure in the Ray Data cross-check turns off.
RAY_DATA_FEATURE: Final = "the Ray Data cross-check"
#: What a failure in sending the training function's error turns off.
FAILURE_FEATURE: Final = "sending the error that ended Ray Train's training function"

#: Where Ray Train V2 turns the exception that ended the training function into the
#: error it reports (looked up there at call time, on the training thread).
_RUNNER: Final = "ray.train.v2._internal.execution.worker_group.thread_runner"
_RUNNER_FN: Final = "construct_user_exception_with_traceback"

#: Where this module runs rtop's code on the training thread (``collectors.guard``'s
#: shape): point -> (where it runs, the feature a failure there turns off).
POINTS: Final[dict[str, tuple[str, str]]] = {
    "raytrain.report": ("the wrapper around ray.train.report, timing a checkpoint it is "
                        "given", CHECKPOINT_FEATURE),
    "raytrain.data": ("probe.iter over a Ray Data iterator, reading Ray Data's own stats "
                      "as a pass starts and ends", RAY_DATA_FEATURE),
    "raytrain.failed": ("Ray Train's handling of the exception that ended the training "
                        "function: the rank's error sent to the hub", FAILURE_FEATURE),
}

guard.register(POINTS)

#: Relative tolerance of the cross-check: the two figures agree when they differ by at
#: most this share of the larger one ...
TOLERANCE_REL: Final = 0.2
#: ... or by at most this many seconds, whichever is larger.
TOLERANCE_ABS_S: Final = 0.1

#: What ``meta["ray_data"]`` holds (totals over every pass of a Ray Data iterator that
#: ``probe.iter`` wrapped on this rank).
RAY_DATA_FIELDS: Final = (
    "blocked_s",  # Ray Data's time blocked in the iterator's next() (iter_total_blocked_s)
    "init_s",  # Ray Data's time setting each pass up (iter_initialize_s)
    "probe_data_wait_s",  # the probe's data wait over the same passes
    "batches",  # batches the probe saw
    "passes",  # passes that ended
    "agree",  # blocked_s + init_s within the tolerance of probe_data_wait_s
)


def compare(ray_s: float, probe_s: float) -> bool:
    """Whether Ray Data's figure and the probe's agree (see :data:`TOLERANCE_REL`)."""
    return abs(ray_s - probe_s) <= max(TOLERANCE_ABS_S, TOLERANCE_REL * max(ray_s, probe_s))


class RayTrainHooks:
    """What the probe hooks in a Ray Train worker (see the module doc); one per probe,
    made by :func:`install`, released by ``probe.close()``.

    Everything here runs on the training thread.
    """

    def __init__(self, probe: Probe) -> None:
        self._p = probe
        self._utils: Any = None  # the TrainFnUtils whose report is wrapped
        self._previous: Any = None  # its instance attribute "report" before, if any
        self._wrapper: Callable[..., Any] | None = None
        #: The checkpoint timing is off (after a failure in rtop's part of it).
        self.report_off = False
        #: Checkpoints timed so far.
        self.checkpoints = 0
        self._data: _RayDataCheck | None = None  # the Ray Data cross-check's totals
        self._runner: Any = None  # Ray Train's thread_runner module, once hooked
        self._runner_fn: Any = None  # its function as it was

    # ---- the report wrapper -------------------------------------------------------

    def wrap_report(self) -> str | None:
        """Wrap Ray Train V2's ``report`` dispatcher of this worker; returns a note when
        it cannot be (not Ray Train V2)."""
        module = sys.modules.get("ray.train.v2._internal.execution.train_fn_utils")
        if module is None:
            return ("the checkpoint cost of ray.train.report is measured under Ray Train "
                    "V2 only: put `with probe.checkpoint():` around the call")
        try:
            utils = module.get_train_fn_utils()
        except Exception:
            return ("Ray Train's report is not set up in this process: its checkpoint "
                    "cost is not measured (`with probe.checkpoint():` measures it)")
        # an earlier probe's wrapper, if one is still there, is wrapped in turn: a closed
        # probe's passes the call through
        previous = vars(utils).get("report")
        original = utils.report
        hooks = self

        def report(*args: Any, **kwargs: Any) -> Any:
            return hooks.call_report(original, args, kwargs)

        functools.update_wrapper(report, original)
        report._rtop_hooks = self  # type: ignore[attr-defined]
        utils.report = report
        self._utils, self._previous, self._wrapper = utils, previous, report
        return None

    def watch_failure(self) -> None:
        """Hear of the exception that ends the training function (see the module doc)."""
        module = sys.modules.get(_RUNNER)
        original = getattr(module, _RUNNER_FN, None)
        if module is None or not callable(original):
            return
        hooks = self

        def construct(error: BaseException, *args: Any, **kwargs: Any) -> Any:
            hooks.train_fn_failed(error)
            return original(error, *args, **kwargs)

        functools.update_wrapper(construct, original)
        construct._rtop_hooks = self  # type: ignore[attr-defined]
        setattr(module, _RUNNER_FN, construct)
        self._runner, self._runner_fn = module, original

    def train_fn_failed(self, error: BaseException) -> None:
        """The training function ended with ``error``: the probe closes with it, so the
        hub shows the rank failed and why (guard point ``raytrain.failed``). Never
        raises."""
        try:
            p = self._p
            if p.closed or isinstance(error, KeyboardInterrupt):
                return
            p.exit_error = f"{type(error).__name__}: {error}"[:500]
            p.close(reason="exit")
        except Exception as exc:
            self._p.fault("raytrain.failed", exc)

    def call_report(self, original: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """Call Ray Train's ``report`` once, timed as a checkpoint when it is given one
        (guard point ``raytrain.report``); its exceptions propagate unchanged."""
        timer: Any = None
        if not self.report_off:
            try:
                checkpoint = kwargs["checkpoint"] if "checkpoint" in kwargs else (
                    args[1] if len(args) > 1 else None)
                p = self._p
                if checkpoint is not None and not p.closed \
                        and p.activity.phase != "checkpoint":
                    timer = p.checkpoint()
                    timer.__enter__()
            except Exception as exc:
                self._report_failed(exc)
                timer = None
        if timer is None:
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            try:
                timer.__exit__(None, None, None)
                self.checkpoints += 1
            except Exception as exc:
                self._report_failed(exc)

    @property
    def probe(self) -> Probe:
        """The probe these hooks belong to."""
        return self._p

    def data_check(self) -> _RayDataCheck:
        """The totals of the Ray Data cross-check (made at the first Ray Data pass)."""
        if self._data is None:
            self._data = _RayDataCheck(self._p)
        return self._data

    def iter(self, iterable: Any) -> RayDataIterable[Any] | None:
        """``probe.iter``'s wrapper for a Ray Data iterable, else None (see
        :func:`data_iterable`)."""
        return data_iterable(self, iterable)

    def _report_failed(self, error: BaseException) -> None:
        self.report_off = True
        try:
            p = self._p
            if p.activity.phase == "checkpoint":
                p.activity.phase = "idle"
            p.fault("raytrain.report", error)
        except Exception:
            pass

    def release(self) -> None:
        """Put what was wrapped back as it was (``probe.close()``)."""
        runner, self._runner = self._runner, None
        try:
            if runner is not None and getattr(getattr(runner, _RUNNER_FN, None),
                                              "_rtop_hooks", None) is self:
                setattr(runner, _RUNNER_FN, self._runner_fn)
        except Exception as exc:
            log.debug("rtop: could not put Ray Train's error handling back: %r", exc)
        utils, self._utils = self._utils, None
        if utils is None:
            return
        try:
            if vars(utils).get("report") is self._wrapper:
                if self._previous is not None:
                    utils.report = self._previous
                else:
                    del utils.report
        except Exception as exc:
            log.debug("rtop: could not put Ray Train's report back: %r", exc)


def install(probe: Probe) -> RayTrainHooks | None:
    """The hooks of a probe in a process that has imported Ray (None otherwise): in a
    Ray Train worker (the probe's identity came from Ray Train), ``report`` is wrapped
    (see the module doc). Never raises."""
    if "ray" not in sys.modules:
        return None
    try:
        hooks = RayTrainHooks(probe)
        if probe.identity.source != "ray":
            return hooks
        try:
            note = hooks.wrap_report()
        except Exception as exc:
            note = f"rtop could not wrap ray.train.report to time its checkpoints: {exc!r}"
        try:
            hooks.watch_failure()
        except Exception as exc:
            log.debug("rtop: Ray Train's error handling not hooked: %r", exc)
        if note is not None and note not in probe.notes:
            probe.notes.append(note)
        return hooks
    except Exception as exc:
        log.debug("rtop: Ray hooks not installed: %r", exc)
        return None


# ---- the Ray Data cross-check -------------------------------------------------------

def _data_iterator(iterable: Any) -> Any:
    """The Ray Data ``DataIterator`` behind an ``iter_batches``/``iter_torch_batches``
    iterable, or None for anything else."""
    data = sys.modules.get("ray.data")
    gen = getattr(iterable, "iterator_gen", None)
    if data is None or gen is None:
        return None
    code, cells = getattr(gen, "__code__", None), getattr(gen, "__closure__", None)
    if code is None or not cells:
        return None
    for name, cell in zip(code.co_freevars, cells, strict=False):
        if name == "self":
            it = cell.cell_contents
            kind = getattr(data, "DataIterator", None)
            if kind is not None and isinstance(it, kind) \
                    and callable(getattr(it, "_to_ref_bundle_iterator", None)):
                return it
    return None


class _RayDataCheck:
    """One probe's totals of the cross-check over its Ray Data passes."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.off = False
        self.blocked_s = 0.0
        self.init_s = 0.0
        self.probe_s = 0.0
        self.batches = 0
        self.passes = 0
        self._note: str | None = None

    def failed(self, error: BaseException) -> None:
        self.off = True
        self.probe.fault("raytrain.data", error)  # never raises

    def publish(self) -> None:
        """Send the totals (``meta["ray_data"]``) and the note in words."""
        ray_s, probe_s = self.blocked_s + self.init_s, self.probe_s
        agree = compare(ray_s, probe_s)
        self.probe.figures["ray_data"] = {
            "blocked_s": self.blocked_s, "init_s": self.init_s, "probe_data_wait_s": probe_s,
            "batches": self.batches, "passes": self.passes, "agree": agree}
        passes = f"{self.passes} pass{'es' if self.passes != 1 else ''}"
        said = (f"Ray Data cross-check: Ray Data counts {ray_s:.3f} s blocked in the "
                f"iterator over {passes} ({self.blocked_s:.3f} s waiting for batches, "
                f"{self.init_s:.3f} s setting it up), the probe measured {probe_s:.3f} s "
                f"of data wait over {self.batches} batches: ")
        if agree:
            said += "they agree."
        else:
            said += (f"they disagree by {abs(ray_s - probe_s):.3f} s (more than "
                     f"{TOLERANCE_REL:.0%}). ")
            said += ("The probe saw more: something between Ray Data and the loop takes "
                     "time (another wrapper around the iterator)." if probe_s > ray_s else
                     "Ray Data saw more: batches were also taken from the iterator "
                     "outside probe.iter.")
        notes = self.probe.notes
        for i in range(len(notes) - 1, -1, -1):  # replace this check's note in place
            if notes[i] is self._note:
                notes[i] = said
                break
        else:
            notes.append(said)
        self._note = said


class _Pass:
    """Ray Data's stats object of one pass, caught as the pass sets itself up, with
    its figures then (the stats object may be shared by all passes of an iterator)."""

    __slots__ = ("before", "blocked0", "catch", "init0", "it", "stats")

    def __init__(self, it: Any) -> None:
        self.it = it  # the DataIterator
        self.before: Any = vars(it).get("_to_ref_bundle_iterator")  # its own, if any
        self.catch: Any = None  # what stands in for its _to_ref_bundle_iterator meanwhile
        self.stats: Any = None
        self.blocked0 = 0.0
        self.init0 = 0.0

    def restore(self) -> None:
        """Give the iterator its ``_to_ref_bundle_iterator`` back, if ours is there."""
        it = self.it
        if self.catch is not None and vars(it).get("_to_ref_bundle_iterator") is self.catch:
            if self.before is None:
                del it._to_ref_bundle_iterator
            else:
                it._to_ref_bundle_iterator = self.before
        self.catch = None


class RayDataIterable(TimedIterable[T]):
    """``probe.iter`` over a Ray Data iterable: times each wait like any loader, and
    cross-checks each pass with Ray Data's own stats (see the module doc)."""

    def __init__(self, probe: Probe, iterable: Any, data_iterator: Any,
                 check: _RayDataCheck) -> None:
        super().__init__(probe, iterable)
        self._data_iterator = data_iterator
        self._check = check

    def _begin(self) -> _Pass | None:
        """Catch the stats object of the pass about to start: the iterator's
        ``_to_ref_bundle_iterator`` (called once, as the pass starts) is wrapped for
        that one call."""
        it = self._data_iterator
        one = _Pass(it)
        original = it._to_ref_bundle_iterator
        check = self._check

        def catch() -> Any:
            try:
                one.restore()
            except Exception as exc:
                check.failed(exc)
            result = original()
            try:
                stats = result[1]
                if stats is not None:
                    one.blocked0 = float(stats.iter_total_blocked_s.get())
                    one.init0 = float(stats.iter_initialize_s.get())
                    one.stats = stats
            except Exception as exc:
                check.failed(exc)
            return result

        one.catch = catch
        it._to_ref_bundle_iterator = catch
        return one

    def _end(self, one: _Pass, probe_s: float, batches: int) -> None:
        """The pass ended: add Ray Data's figures and the probe's, and publish them."""
        one.restore()  # if the pass never started
        stats = one.stats
        if stats is None or self._probe.iter_off:  # no pass, or the probe's wait is off
            return
        check = self._check
        check.blocked_s += max(0.0, float(stats.iter_total_blocked_s.get()) - one.blocked0)
        check.init_s += max(0.0, float(stats.iter_initialize_s.get()) - one.init0)
        check.probe_s += probe_s
        check.batches += batches
        check.passes += 1
        check.publish()

    def __iter__(self) -> Iterator[T]:
        check = self._check
        one = None
        if not check.off and not self._probe.iter_off:
            try:
                one = self._begin()
            except Exception as exc:
                check.failed(exc)
        if one is None:
            yield from super().__iter__()
            return
        waited, seen = self.wait_s, self.batches
        try:
            yield from super().__iter__()
        finally:
            if not check.off:
                try:
                    self._end(one, self.wait_s - waited, self.batches - seen)
                except Exception as exc:
                    check.failed(exc)


def data_iterable(hooks: RayTrainHooks, iterable: Any) -> RayDataIterable[Any] | None:
    """``probe.iter``'s wrapper for a Ray Data ``iter_batches``/``iter_torch_batches``
    iterable; None for anything else, or once the cross-check is off. Never raises."""
    probe = hooks.probe
    try:
        it = _data_iterator(iterable)
        if it is None:
            return None
        check = hooks.data_check()
        if check.off:
            return None
        return RayDataIterable(probe, iterable, it, check)
    except Exception as exc:
        probe.fault("raytrain.data", exc)  # never raises
        return None
