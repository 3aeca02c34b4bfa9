"""What rtop's framework callbacks share (:mod:`collectors.lightning`,
:mod:`collectors.hf`): the probe a callback starts, the step it drives from one hook to
another, and the guard around each hook's own work.

A callback's hooks run on the rank's training thread. Each hook's body runs through
:meth:`CallbackHooks._run`: an error in it never reaches the framework; it turns the
callback off for the rest of the run (warned once, noted for the hub through the probe's
faults, :meth:`collectors.probe.Probe.fault`), and a step left open is ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import collectors
from collectors import guard
from collectors.probe import Probe

H = TypeVar("H", bound="CallbackHooks")


def callback_class(hooks: type[H], bases: tuple[type, ...], module: str, doc: str
                   ) -> type[H]:
    """The ``RtopCallback`` class of ``module``: ``hooks`` (first, so its hooks win) on
    the framework's callback ``bases``, made as the module is imported."""
    cls = type("RtopCallback", (hooks, *bases), {
        "__module__": module, "__qualname__": "RtopCallback", "__doc__": doc})
    return cast("type[H]", cls)


#: The keys of a batch (a mapping) whose tensor holds the token ids: its elements are the
#: step's tokens (padding included, as transformers' ``num_input_tokens_seen`` counts).
TOKEN_KEYS = ("input_ids",)


def tokens_in(batch: Any) -> int | None:
    """The tokens in a batch: the elements of its ``input_ids`` tensor (a mapping's, or a
    ``BatchEncoding``'s), else None (not known). Reads shapes only: no device sync."""
    getter = getattr(batch, "get", None)
    if getter is None:
        return None
    for key in TOKEN_KEYS:
        try:
            ids = getter(key)
        except Exception:
            return None
        numel = getattr(ids, "numel", None)
        if numel is not None:
            return int(numel())
    return None


class Resume:
    """Iterating it continues ``it`` where it is (``iter()`` on the framework's loader
    or epoch iterator would restart it, or is not allowed)."""

    __slots__ = ("_it",)

    def __init__(self, it: Any) -> None:
        self._it = it

    def __iter__(self) -> Resume:
        return self

    def __next__(self) -> Any:
        return next(self._it)


class CallbackHooks:
    """The framework-neutral half of a callback: its probe, its open step, its guard.

    A subclass names what a failure turns off (:attr:`feature`), adds its own state in
    :meth:`_reset` (calling this one), and runs each hook's body through :meth:`_run`.
    """

    #: What a failure in this callback turns off (named in the warning).
    feature = "the callback"

    def __init__(self, **settings: Any) -> None:
        """``settings``: ``hub``, ``token`` and :class:`collectors.ProbeConfig` fields,
        passed to :func:`collectors.start`."""
        self._settings = settings
        self._reset()

    def _reset(self) -> None:
        self._probe: Probe | None = None
        self._owned = False  # this callback started the probe (so it closes it)
        self._off = False  # turned off after an error in its own code
        self._step: Any = None  # the open step's context manager
        self._noted: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        # a launcher that pickles the trainer and its callbacks: nothing of a run travels
        return {"_settings": self._settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._settings = state.get("_settings", {})
        self._reset()

    # ---- the probe and the step ------------------------------------------------------

    def _start_probe(self, rank: int, world_size: int, local_rank: int) -> Probe | None:
        """Start (or join) the process's probe as the framework set the rank up, and
        return it; with rtop disabled (``RTOP_DISABLE=1``) the callback is off (None)."""
        before = collectors.current()
        probe = collectors.start(rank=rank, world_size=world_size, local_rank=local_rank,
                                 **self._settings)
        if not isinstance(probe, Probe):  # RTOP_DISABLE=1: nothing to do
            self._off = True
            return None
        self._owned = probe is not before
        self._probe = probe
        return probe

    def _begin_step(self, tokens: int | None = None) -> None:
        """A step starts: the probe's step is entered (a step still open, one that never
        reached its end hook, is ended first), with the tokens of its batch when known."""
        probe = self._probe
        if probe is None:
            return
        self._end_step()
        step = probe.step(tokens=tokens)
        step.__enter__()
        self._step = step

    def _end_step(self, error: BaseException | None = None) -> None:
        """The open step, if any, ends (with ``error``, the run's, if it failed)."""
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(type(error) if error is not None else None, error,
                          error.__traceback__ if error is not None else None)

    def _note(self, key: str, text: str) -> None:
        """A note for the hub, once per ``key``."""
        if key not in self._noted and self._probe is not None:
            self._noted.add(key)
            self._probe.notes.append(text)

    # ---- guarding --------------------------------------------------------------------

    def _run(self, point: str, body: Callable[..., None], *args: Any) -> None:
        """Run rtop's ``body`` for a hook; an error never reaches the framework."""
        if self._off:
            return
        try:
            body(*args)
        except Exception as exc:  # guarded point: never raise into the job
            self._failed(point, exc)

    def _failed(self, point: str, error: BaseException) -> None:
        """``point`` failed: the callback is off for the rest of the run (warned once,
        noted for the hub through the probe's faults)."""
        try:
            self._off = True
            guard.integration_failed(self._probe, point, error, self.feature)
            self._end_step()
        except Exception:
            pass
