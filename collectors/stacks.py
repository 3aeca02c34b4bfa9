"""Every Python thread's stack in this process, taken at once, for ``rtop stacks``.

It runs on rtop's sender thread, never on the training thread, so that a rank whose
training thread hangs (in a collective, a lock, a C call) still answers. What it reads
takes no lock that the job's threads may hold: :func:`sys._current_frames` (the
interpreter's own thread list) and a copy of :mod:`threading`'s table of threads, made
in one step under the GIL rather than through :func:`threading.enumerate`, which waits
for the module's lock. It is fast (a walk of frame pointers) and it never raises: a
failure becomes the answer's ``error``.

A thread is ``{"name", "ident", "daemon", "frames": [{"file", "line", "function"}],
"rtop", "training", "truncated"}`` with its frames **outermost first** (as
:func:`traceback.extract_stack` lists them; ``py-spy dump`` prints the other way
round). ``name`` and ``daemon`` are None for a thread that :mod:`threading` does not know
(one started with :mod:`_thread`, or by C++ code that runs Python). ``rtop`` marks rtop's
own threads (their names start with ``rtop``), which a viewer folds; ``training`` marks
the training thread.

Bounds, so that one answer stays small whatever the job does:

* A stack deeper than ``max_frames`` keeps its innermost frames (where it is stuck) and
  its ``KEEP_OUTER`` outermost ones (how it got there), with one marker frame between
  them, ``{"file": "", "line": None, "function": "... N frames not sent ..."}``; the
  thread's ``truncated`` says N (0: whole).
* Strings are cut: file paths to ``MAX_PATH_CHARS`` (keeping their end, the file's
  name), function and thread names to ``MAX_NAME_CHARS``. They are not cleaned of
  control characters here: a viewer treats every name from a rank as untrusted.
* At most ``max_threads`` threads, and the answer msgpack-encoded stays under
  ``max_bytes``: threads go in order of interest (the training thread, the main thread,
  the job's other threads, rtop's own last); a stack that does not fit in what is left
  is cut further, and threads that still do not fit are left out and counted in the
  answer's ``threads_omitted``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from types import FrameType
from typing import Any

import msgpack

#: Outermost frames kept when a stack is cut (the rest of ``max_frames`` is innermost).
KEEP_OUTER = 8
#: Longest file path sent (its end is kept).
MAX_PATH_CHARS = 400
#: Longest function or thread name sent.
MAX_NAME_CHARS = 200
#: Frames walked at most per thread (a runaway recursion is counted up to here).
MAX_WALK = 1_000_000
#: Bytes reserved in ``max_bytes`` for the answer's envelope (rank, pid, time, counts).
ENVELOPE_BYTES = 200
#: The fewest innermost frames a thread is cut down to before it is left out.
MIN_INNER = 4


def _text(s: object, limit: int, *, keep_end: bool = False) -> str:
    """``s`` as a string of at most ``limit`` characters that msgpack can encode."""
    t = s if isinstance(s, str) else str(s)
    if len(t) > limit:
        t = ("…" + t[len(t) - limit + 1:]) if keep_end else (t[:limit - 1] + "…")
    if not t.isascii():  # lone surrogates (undecodable file names) cannot be encoded
        t = t.encode("utf-8", "replace").decode("utf-8", "replace")
    return t


def _frame(f: FrameType) -> dict[str, Any]:
    code = f.f_code
    name = getattr(code, "co_qualname", None) or code.co_name
    line = f.f_lineno
    return {"file": _text(code.co_filename, MAX_PATH_CHARS, keep_end=True),
            "line": line if isinstance(line, int) else None,
            "function": _text(name, MAX_NAME_CHARS)}


def _marker(n: int) -> dict[str, Any]:
    return {"file": "", "line": None, "function": f"... {n} frames not sent ..."}


def _walk(top: FrameType, inner: int, outer: int) -> tuple[list[FrameType], list[FrameType], int]:
    """The ``inner`` innermost frames (innermost first), the ``outer`` outermost ones
    (innermost first) and the stack's depth."""
    head: list[FrameType] = []
    tail: deque[FrameType] = deque(maxlen=outer)
    depth = 0
    f: FrameType | None = top
    while f is not None and depth < MAX_WALK:
        if depth < inner:
            head.append(f)
        elif outer:
            tail.append(f)
        depth += 1
        f = f.f_back
    return head, list(tail), depth


def _frames(head: list[dict[str, Any]], tail: list[dict[str, Any]], depth: int,
            inner: int, outer: int) -> tuple[list[dict[str, Any]], int]:
    """Outermost-first frames keeping ``inner`` innermost and ``outer`` outermost of a
    stack of ``depth`` (``head``/``tail``: innermost first), and how many were cut."""
    inner = min(inner, len(head))
    outer = min(outer, len(tail))
    kept_tail = tail[len(tail) - outer:] if outer else []
    cut = depth - inner - outer
    out = list(reversed(kept_tail))
    if cut > 0:
        out.append(_marker(cut))
    out.extend(reversed(head[:inner]))
    return out, max(0, cut)


def _size(obj: object) -> int:
    return len(msgpack.packb(obj, use_bin_type=True))


def _threads_table() -> dict[int, threading.Thread]:
    """``threading``'s threads by ident, copied without taking its lock."""
    active = getattr(threading, "_active", None)
    if isinstance(active, dict):
        try:
            return dict(active)  # one C-level copy under the GIL: no lock, no iteration
        except Exception:
            pass
    return {t.ident: t for t in threading.enumerate() if t.ident is not None}


def _collect(max_frames: int, max_threads: int, max_bytes: int, skip_ident: int | None,
             training_ident: int | None) -> tuple[list[dict[str, Any]], int]:
    frames = sys._current_frames()
    table = _threads_table()
    main = threading.main_thread().ident
    max_frames = max(1, max_frames)
    outer = min(KEEP_OUTER, max_frames // 4)
    inner = max_frames - outer
    raw: list[tuple[tuple[int, int], dict[str, Any], FrameType]] = []
    for ident, top in frames.items():
        if ident == skip_ident:
            continue
        t = table.get(ident)
        name = _text(t.name, MAX_NAME_CHARS) if t is not None else None
        is_rtop = name is not None and name.startswith("rtop")
        training = training_ident is not None and ident == training_ident
        rank = 0 if training else 1 if ident == main else 3 if is_rtop else 2
        info: dict[str, Any] = {"name": name, "ident": ident,
                                "daemon": bool(t.daemon) if t is not None else None,
                                "rtop": is_rtop, "training": training}
        raw.append(((rank, ident), info, top))
    raw.sort(key=lambda r: r[0])
    omitted = max(0, len(raw) - max(0, max_threads))
    room = max_bytes - ENVELOPE_BYTES
    out: list[dict[str, Any]] = []
    for _, info, top in raw[:max(0, max_threads)]:
        head_f, tail_f, depth = _walk(top, inner, outer)
        head = [_frame(f) for f in head_f]
        tail = [_frame(f) for f in tail_f]
        k = inner
        while True:
            fr, cut = _frames(head, tail, depth, k, outer)
            thread = {**info, "frames": fr, "truncated": cut}
            size = _size(thread)
            if size <= room:
                out.append(thread)
                room -= size
                break
            if k <= MIN_INNER:
                omitted += 1
                break
            k = max(MIN_INNER, k // 2)
    return out, omitted


def all_stacks(*, max_frames: int = 128, max_threads: int = 64, max_bytes: int = 48_000,
               skip_ident: int | None = None,
               training_ident: int | None = None) -> list[dict[str, Any]]:
    """Every Python thread of this process with its stack, outermost frame first.

    Safe to call from any thread while others hang: it takes no lock that they may
    hold, and it never raises (on an error it returns what it has, possibly nothing).
    ``skip_ident``: a thread to leave out (e.g. the calling one); ``training_ident``:
    the training thread, marked ``"training": True`` and listed first. Bounds
    (``max_frames`` per thread, ``max_threads``, ``max_bytes`` msgpack-encoded) as in
    the module's doc; :func:`stacks_answer` also says how many threads were left out.
    """
    try:
        return _collect(max_frames, max_threads, max_bytes, skip_ident, training_ident)[0]
    except Exception:
        return []


def stacks_answer(rank: int, *, max_frames: int = 128, max_threads: int = 64,
                  max_bytes: int = 48_000, skip_ident: int | None = None,
                  training_ident: int | None = None) -> dict[str, Any]:
    """This rank's answer to a ``stacks`` action, msgpack-encoded under ``max_bytes``.

    ``{"rank", "pid", "time" (wall clock), "threads": [...], "threads_omitted": N}``
    with the threads of :func:`all_stacks`; on an error (which it never raises)
    ``threads`` is empty and ``error`` says what went wrong.
    """
    answer: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "time": time.time()}
    try:
        threads, omitted = _collect(max_frames, max_threads, max_bytes, skip_ident,
                                    training_ident)
        answer.update(threads=threads, threads_omitted=omitted)
    except Exception as exc:
        answer.update(threads=[], threads_omitted=0,
                      error=_text(f"{type(exc).__name__}: {exc}", 300))
    return answer
