"""What a rank answers to an action, typed and bounded where it enters the hub.

A rank's ``result`` frame (``collectors.control``) is the one thing a holder of the
ingest token can make the hub copy: into the requester's answer, into every target's
``cancel``, into the log. So nothing of it is kept as it came: :func:`clean_result`
checks its ``state``, types each field the hub reads (a late rank's ``step``, an error's
text, a probe's ``links``), and bounds everything else it passes on to the requester
(:func:`bounded`: strings cut and made safe to print, at most :data:`MAX_ITEMS` values
in all, nested at most :data:`MAX_DEPTH` deep, numbers finite or None, no bytes). A
frame bigger than :data:`MAX_RESULT_BYTES` is not read at all. What does not check out
is a :class:`BadAnswer`: an error for that rank only, saying why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from rtop.fmt import safe_text

#: The states a rank's result may have (``collectors.control``).
STATES: Final = ("armed", "ready", "late", "done", "error")
#: The most bytes of one rank's result frame. A stacks answer is at most 48 kB
#: (``collectors.stacks``), a profile's summary a few kB, a probe's one link per peer.
MAX_RESULT_BYTES: Final = 256 * 1024
#: The most values (strings, numbers, maps, lists, map keys) in one answer ...
MAX_ITEMS: Final = 20_000
#: ... nested at most this deep (a stacks answer: answer → threads → thread → frames
#: → frame → value).
MAX_DEPTH: Final = 6
#: Characters of a string in an answer (a path, a source line, a function's name).
MAX_TEXT: Final = 4096
#: Characters of an error message, and of a map's key.
MAX_ERROR: Final = 300
MAX_KEY: Final = 64
#: Keys of a result that are the envelope, not the answer (the hub sets its own).
ENVELOPE: Final = frozenset({"id", "state", "rank", "t_wall"})


class BadAnswer(ValueError):
    """A rank's result that is not what its action answers; the message says why."""


def _number(x: Any) -> float | int | None:
    if isinstance(x, bool):
        return x
    if isinstance(x, int):
        return x if -(1 << 63) <= x < (1 << 64) else None
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return None


def bounded(x: Any, *, items: int = MAX_ITEMS, depth: int = MAX_DEPTH) -> Any:
    """``x`` with every string cut to :data:`MAX_TEXT` characters and made safe to print
    (newlines kept), numbers finite or None, bytes dropped (None), at most ``items``
    values in all and ``depth`` levels; raises :class:`BadAnswer` beyond either."""
    budget = [items]

    def walk(v: Any, level: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise BadAnswer(f"the answer holds more than {items} values")
        if v is None or isinstance(v, (bool, int, float)):
            return _number(v)
        if isinstance(v, str):
            return safe_text(v, MAX_TEXT, multiline=True)
        if level >= depth:
            raise BadAnswer(f"the answer is nested more than {depth} levels deep")
        if isinstance(v, (list, tuple)):
            return [walk(e, level + 1) for e in v]
        if isinstance(v, dict):
            out: dict[str, Any] = {}
            for k, e in v.items():
                if not isinstance(k, str):
                    raise BadAnswer("the answer has a map key that is not a string")
                budget[0] -= 1
                out[safe_text(k, MAX_KEY)] = walk(e, level + 1)
            return out
        return None  # bytes, extension types: nothing the requester could use

    return walk(x, 0)


def error_text(x: Any, default: str = "failed") -> str:
    """A rank's error message, cut to :data:`MAX_ERROR` characters *before* anything
    else is done with it, and made safe to print."""
    if not isinstance(x, str) or not x:
        return default
    return safe_text(x[:MAX_ERROR + 1], MAX_ERROR, multiline=True)


def _int_or_none(x: Any) -> int | None:
    return x if type(x) is int and -(1 << 63) <= x < (1 << 63) else None


def _links(x: Any) -> list[list[float | int | None]]:
    """A probe's ``links``: ``[[peer, Bps], ...]``, peers rank numbers."""
    if not isinstance(x, list):
        raise BadAnswer("a probe's links must be a list")
    out: list[list[float | int | None]] = []
    for item in x:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and 0 <= item[0] < (1 << 20)):
            raise BadAnswer("a probe's link must be [peer rank, bytes per second]")
        bps = _number(item[1])
        out.append([item[0], None if isinstance(bps, bool) or bps is None or bps < 0
                    else bps])
    return out


def clean_result(action: str, payload: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(state, body)`` of a rank's result frame for ``action`` (``stacks``,
    ``profile`` or ``probe``), typed and bounded (see the module doc); raises
    :class:`BadAnswer`. ``body`` holds, by state: ``late``: ``step`` (int or None);
    ``error``: ``error`` (text), ``peer`` and ``round`` (int or None); ``done``: the
    answer without its envelope (:data:`ENVELOPE`); ``armed``/``ready``: nothing."""
    state = payload.get("state")
    if not isinstance(state, str) or state not in STATES:
        raise BadAnswer(f"a result's state must be one of {', '.join(STATES)}")
    if state == "late":
        return state, {"step": _int_or_none(payload.get("step"))}
    if state == "error":
        return state, {"error": error_text(payload.get("error")),
                       "peer": _int_or_none(payload.get("peer")),
                       "round": _int_or_none(payload.get("round"))}
    if state != "done":
        return state, {}
    body = {k: v for k, v in payload.items() if isinstance(k, str) and k not in ENVELOPE}
    if action == "probe" and "links" in body:
        body["links"] = _links(body["links"])
    clean = bounded(body)
    if body.get("error"):
        return "error", {"error": error_text(body.get("error")),
                         "peer": _int_or_none(body.get("peer")),
                         "round": _int_or_none(body.get("round"))}
    return state, clean
