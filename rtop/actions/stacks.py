"""Every rank's Python stacks, grouped like a distributed ``py-spy dump``.

The ranks' answers (:func:`collectors.stacks.stacks_answer`) are gathered by the hub;
:func:`assemble` turns them into the result that ``rtop stacks --json`` prints,

    {"ranks": [{"rank": R, "pid": ..., "threads_omitted": N, "threads": [
        {"name": "MainThread", "ident": ..., "daemon": False, "training": True,
         "rtop": False, "truncated": 0,
         "frames": [{"file": ..., "line": ..., "function": ...}, ...]}]}],
     "missing": [ranks that did not answer in time], "errors": {"R": "what went wrong"}}

frames **outermost first**. Everything in an answer comes from a rank and is treated as
untrusted: names and paths are cleaned of control characters (:func:`rtop.fmt.safe_text`)
and cut, and fields of the wrong type are dropped.

:func:`group` puts identical stacks (same ``(file, function, line)`` frames) of
different ranks together, so that the rank that differs from the rest stands out;
:func:`format_text` prints the groups as ``py-spy dump`` prints a process, innermost
frame first, one group per header (``ranks 0-6 (7 ranks) — Thread "MainThread"``).

Order of groups: each rank's main thread (its training thread, else ``MainThread``)
comes before the ranks' other threads, and rtop's own threads come last. Within each,
**the smallest group comes first** (ties: the lowest rank first): when one rank hangs
while the others wait for it in a collective, the hung rank's stack leads, alone, and
the ranks that wait follow as one group.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rtop.actions import MAX_ERROR, answer_problems
from rtop.fmt import fmt_ranks, safe_text

#: Which threads :func:`group` looks at: each rank's main thread, every thread but
#: rtop's own, or every thread.
Which = Literal["main", "user", "all"]
#: Thread classes, in the order groups are listed.
MAIN, OTHER, RTOP = 0, 1, 2
#: Bounds on what one rank's answer may bring (a rank is not trusted with the viewer's
#: memory).
MAX_THREADS = 256
MAX_FRAMES = 512
MAX_PATH = 400
MAX_NAME = 200
#: A frame as a grouping key: (file, function, line).
FrameKey = tuple[str, str, int | None]

_LIB = re.compile(r".*/(?:site-packages|dist-packages|lib/python\d+\.\d+)/")


def short_path(path: str) -> str:
    """A file path as ``py-spy`` shows it: relative to ``site-packages`` or the
    standard library when it lies there, else whole."""
    return _LIB.sub("", path, count=1)


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _frame(f: object) -> dict[str, Any] | None:
    if not isinstance(f, Mapping):
        return None
    return {"file": safe_text(str(f.get("file") or ""), MAX_PATH, keep_end=True),
            "line": _int(f.get("line")),
            "function": safe_text(str(f.get("function") or "?"), MAX_NAME)}


def _thread(t: object) -> dict[str, Any] | None:
    if not isinstance(t, Mapping):
        return None
    raw = t.get("frames")
    frames = [f for f in (_frame(x) for x in (raw if isinstance(raw, list) else [])
                          [-MAX_FRAMES:]) if f is not None]
    name = t.get("name")
    name = safe_text(name, MAX_NAME) if isinstance(name, str) else None
    daemon = t.get("daemon")
    return {"name": name, "ident": _int(t.get("ident")),
            "daemon": daemon if isinstance(daemon, bool) else None,
            "training": t.get("training") is True,
            "rtop": t.get("rtop") is True or (name or "").startswith("rtop"),
            "truncated": _int(t.get("truncated")) or 0,
            "frames": frames}


def assemble(answers: Mapping[int, Mapping[str, Any]], missing: Iterable[int],
             errors: Mapping[int, str]) -> dict[str, Any]:
    """The result of ``rtop stacks`` from each rank's answer (by rank), the ranks that
    did not answer in time and the ranks that answered with an error.

    A rank's answer that carries an ``error`` is listed under ``errors`` too. Ranks are
    sorted; ``errors`` is keyed by the rank as a string (as JSON keeps it).
    """
    ranks: list[dict[str, Any]] = []
    errs = {int(r): safe_text(str(m), MAX_ERROR) for r, m in errors.items()}
    for r in sorted(answers):
        a = answers[r]
        if not isinstance(a, Mapping):
            errs.setdefault(r, "the answer is not a mapping")
            continue
        raw = a.get("threads")
        threads = [t for t in (_thread(x) for x in (raw if isinstance(raw, list) else [])
                               [:MAX_THREADS]) if t is not None]
        if a.get("error"):
            errs.setdefault(r, safe_text(str(a["error"]), MAX_ERROR))
        t_wall = a.get("time")
        ranks.append({"rank": r, "pid": _int(a.get("pid")),
                      "time": t_wall if isinstance(t_wall, (int, float))
                      and not isinstance(t_wall, bool) else None,
                      "threads_omitted": _int(a.get("threads_omitted")) or 0,
                      "threads": threads})
    return {"ranks": ranks, "missing": sorted({int(m) for m in missing} - set(answers)),
            "errors": {str(r): errs[r] for r in sorted(errs)}}


@dataclass
class Group:
    """Threads of one or more ranks whose stacks are identical."""

    #: :data:`MAIN`, :data:`OTHER` or :data:`RTOP`.
    kind: int
    #: The stack, outermost frame first (the first member's frames).
    frames: list[dict[str, Any]]
    #: ``(rank, thread)`` for each thread in the group, by rank.
    members: list[tuple[int, dict[str, Any]]]
    #: The ranks' process ids, by rank (None: not sent).
    pids: dict[int, int | None]

    @property
    def ranks(self) -> list[int]:
        """The distinct ranks in the group, sorted."""
        return sorted({r for r, _ in self.members})

    @property
    def ranges(self) -> str:
        """The ranks as a compact range string (``0-3,5``)."""
        return fmt_ranks(self.ranks)

    @property
    def names(self) -> list[str]:
        """The threads' distinct names (``""``: a thread ``threading`` did not know)."""
        return sorted({t.get("name") or "" for _, t in self.members})

    def header(self) -> str:
        """``ranks 0-2,4 (4 ranks) — Thread "MainThread"``, as py-spy heads a thread.

        One thread alone shows its rank's pid and the thread's ident (hex, like
        py-spy); a group does not (each rank has its own)."""
        ranks = self.ranks
        n = len(self.members)
        if len(ranks) == 1:
            pid = self.pids.get(ranks[0])
            who = f"rank {ranks[0]}" + (f" (pid {pid})" if pid is not None else "")
            if n > 1:
                who += f" ({n} threads)"
        else:
            count = f"{len(ranks)} ranks" + (f", {n} threads" if n > len(ranks) else "")
            who = f"ranks {self.ranges} ({count})"
        names = self.names
        quoted = ", ".join(f'"{x}"' for x in names[:3] if x)
        if len(names) > 3:
            quoted += f" and {len(names) - 3} more"
        ident = self.members[0][1].get("ident") if n == 1 else None
        thread = "Thread" + (f" 0x{ident:X}" if isinstance(ident, int) else "")
        if quoted:
            thread += (": " if ident is not None else " ") + quoted
        tags = [tag for tag, on in (("training thread", all(
            t.get("training") for _, t in self.members)), ("rtop", self.kind == RTOP)) if on]
        return f"{who} — {thread}" + (f" ({', '.join(tags)})" if tags else "")

    @property
    def innermost(self) -> str:
        """The innermost frame's function (where the threads are), or ``""``."""
        return str(self.frames[-1]["function"]) if self.frames else ""


def main_thread(threads: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A rank's thread that matters most: the training thread, else ``MainThread``,
    else its first thread that is not rtop's (None: no thread)."""
    for pick in (lambda t: t.get("training"), lambda t: t.get("name") == "MainThread",
                 lambda t: not t.get("rtop")):
        for t in threads:
            if pick(t):
                return t
    return None


def _key(frames: list[dict[str, Any]]) -> tuple[FrameKey, ...]:
    return tuple((str(f.get("file")), str(f.get("function")), _int(f.get("line")))
                 for f in frames)


def group(result: Mapping[str, Any], *, which: Which = "main") -> list[Group]:
    """Identical stacks across ranks as groups, in the module's order (main threads
    first, the smallest group first).

    ``which``: ``"main"`` each rank's main thread only (:func:`main_thread`);
    ``"user"`` every thread but rtop's own; ``"all"`` every thread.
    """
    groups: dict[tuple[int, tuple[FrameKey, ...]], Group] = {}
    for entry in result.get("ranks") or []:
        r = entry["rank"]
        threads = entry.get("threads") or []
        main = main_thread(threads)
        for t in threads:
            kind = MAIN if t is main else RTOP if t.get("rtop") else OTHER
            if (which == "main" and kind != MAIN) or (which == "user" and kind == RTOP):
                continue
            frames = t.get("frames") or []
            k = (kind, _key(frames))
            g = groups.get(k)
            if g is None:
                g = groups[k] = Group(kind, frames, [], {})
            g.members.append((r, t))
            g.pids[r] = entry.get("pid")
    return sorted(groups.values(),
                  key=lambda g: (g.kind, len(g.ranks), g.ranks[0], len(g.members), g.names))


def frame_line(f: Mapping[str, Any]) -> str:
    """One frame as py-spy prints it: ``function (file:line)`` (the path shortened)."""
    fn, path, line = str(f.get("function")), str(f.get("file") or ""), f.get("line")
    if not path:
        return fn
    where = short_path(path) + (f":{line}" if isinstance(line, int) and line else "")
    return f"{fn} ({where})"


def problems(result: Mapping[str, Any]) -> list[str]:
    """Lines on what is missing: ranks that did not answer, errors, ranks with no
    thread, threads left out or cut."""
    out = answer_problems(result)
    empty = [e["rank"] for e in result.get("ranks") or [] if not e.get("threads")]
    if empty:
        out.append(f"no Python thread from rank(s) {fmt_ranks(empty)}")
    omitted = {e["rank"]: e.get("threads_omitted") or 0 for e in result.get("ranks") or []}
    if any(omitted.values()):
        n = sum(omitted.values())
        out.append(f"{n} thread(s) left out to keep the answers small, on rank(s) "
                   f"{fmt_ranks(r for r, k in omitted.items() if k)}")
    return out


def format_text(result: Mapping[str, Any], *, all_threads: bool = False) -> str:
    """The result as text, like ``py-spy dump`` run on every rank at once.

    One block per group (its header, then its frames innermost first, as py-spy prints
    them): the ranks' main threads first, then their other threads; rtop's own threads
    are folded into one line unless ``all_threads``. Everything from a rank is printed
    cleaned of control characters."""
    ranks = result.get("ranks") or []
    groups = group(result, which="all")
    shown = [g for g in groups if all_threads or g.kind != RTOP]
    folded = [g for g in groups if g not in shown]
    mains = [g for g in groups if g.kind == MAIN]
    lines = [f"Python stacks of {len(ranks)} rank{'s' if len(ranks) != 1 else ''}: "
             f"{len(mains)} distinct main-thread stack{'s' if len(mains) != 1 else ''} "
             "(the smallest group first)"]
    lines += [f"  {p}" for p in problems(result)]
    kind = -1
    for g in shown:
        if g.kind != kind:
            kind = g.kind
            lines += ["", {MAIN: "Main threads", OTHER: "Other threads",
                           RTOP: "rtop's own threads"}[kind]]
        lines += ["", safe_text(g.header(), 1024)]
        lines += [f"    {safe_text(frame_line(f), 1024)}" for f in reversed(g.frames)]
        if not g.frames:
            lines.append("    (no Python frame)")
    if folded:
        n = sum(len(g.members) for g in folded)
        on = {r for g in folded for r in g.ranks}
        lines += ["", f"(rtop's own threads folded: {n} on {len(on)} "
                      f"rank{'s' if len(on) != 1 else ''}; all threads shows them)"]
    return "\n".join(lines) + "\n"
