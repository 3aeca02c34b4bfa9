"""``rtop spool``: the spool files of this node (records ranks kept when no hub took
them at their end, :mod:`rtop.run.spool`), listed and pruned by hand.

Listing reads each spool's header and end frame only (the frames between are skipped
by their lengths), so a directory at its byte budget lists at once; a spool without a
readable end (damaged, cut short) is read whole to say how much of it is usable. A
file that cannot be read at all is listed as ``bad``, with why.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from collectors import wire
from collectors.spool import KIND_SPOOL, KIND_SPOOL_END
from rtop.fmt import NA, fmt_age, fmt_size, safe_text
from rtop.run import spool as sp

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration(text: str) -> float:
    """``"2d"``, ``"6h"``, ``"30m"``, ``"45s"``, ``"1w"`` or plain seconds, in seconds;
    :class:`ValueError` otherwise."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a duration like 2d, 6h, 30m or 45s")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


@dataclass
class SpoolEntry:
    """One spool file as ``rtop spool list`` shows it (``--json``: these fields)."""

    file: str
    path: str
    state: str  # waiting, claimed, ingested, bad, partial (rtop.run.spool.spool_state)
    size_bytes: int
    age_s: float  # since it was last touched (what pruning goes by)
    job: str | None = None
    group: str | None = None
    rank: int | None = None
    attempt: int | None = None
    hostname: str | None = None
    pid: int | None = None
    t_wall: float | None = None  # when its rank wrote it
    reason: str | None = None  # why its rank spooled
    records: int | None = None
    dropped_records: int | None = None  # records its rank left out (its bounds)
    error: str | None = None  # why it is bad, damaged or incomplete


def _field(h: dict[str, Any], key: str, kind: type) -> Any:
    v = h.get(key)
    if kind is int:
        return v if isinstance(v, int) and not isinstance(v, bool) else None
    if kind is float:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return safe_text(v, 200) if isinstance(v, str) else None


def _peek(path: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
    """A spool's header and end frame, read without the frames between; or why it
    cannot be read. The file is checked as a hub checks it (a regular 0600 file of
    this user's, not a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        return None, None, f"cannot open it: {exc.strerror or exc}"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, None, "not a regular file"
        if st.st_uid != os.geteuid():
            return None, None, f"it belongs to uid {st.st_uid}, not to you"
        if stat.S_IMODE(st.st_mode) & 0o077:
            return None, None, f"others may read it (mode {stat.S_IMODE(st.st_mode):04o})"
        try:
            head = f.read(wire.HEADER_BYTES)
            if len(head) < wire.HEADER_BYTES:
                return None, None, "not an rtop spool (empty, or cut inside its header)"
            body = f.read(wire.parse_header(head, sp.HEADER_MAX_BYTES))
            first = wire.decode_body(body, sp.HEADER_MAX_BYTES)
        except (OSError, ValueError) as exc:  # WireError: whatever the bytes are
            return None, None, f"not an rtop spool ({str(exc)[:120]})"
        if first.kind != KIND_SPOOL:
            return None, None, "not an rtop spool (no spool header)"
        header = dict(first.payload)
        try:
            while True:
                at = f.tell()
                head = f.read(wire.HEADER_BYTES)
                if len(head) < wire.HEADER_BYTES:
                    break
                length = wire.parse_header(head)
                if at + wire.HEADER_BYTES + length < st.st_size:
                    f.seek(length, os.SEEK_CUR)
                    continue
                last = wire.decode_body(f.read(length))
                if last.kind == KIND_SPOOL_END:
                    return header, dict(last.payload), None
                break
        except (OSError, ValueError):
            pass  # damaged after its header: the caller reads it whole
        return header, None, None


def entry(path: Path, state: str, st: os.stat_result, now: float) -> SpoolEntry:
    """What ``rtop spool list`` says of one file. Never raises: a file that cannot be
    read is ``bad``, with why."""
    e = SpoolEntry(file=path.name, path=str(path), state=state, size_bytes=st.st_size,
                   age_s=max(0.0, now - st.st_mtime))
    header, end, error = _peek(path)
    if header is None:
        if state != sp.PARTIAL:
            e.state = sp.BAD_STATE
        e.error = "half-written (its rank died writing it)" if state == sp.PARTIAL \
            else error
        return e
    e.job, e.group, e.hostname, e.reason = (_field(header, k, str) for k in
                                            ("job", "group", "hostname", "reason"))
    e.job = e.job or _field(header, "job_key", str)  # a job with no name: its key
    e.rank, e.attempt, e.pid = (_field(header, k, int) for k in ("rank", "attempt", "pid"))
    e.t_wall = _field(header, "t_wall", float)
    if end is not None:
        e.records = _field(end, "records", int)
        e.dropped_records = _field(end, "dropped_records", int)
    elif state == sp.PARTIAL:
        e.error = "half-written (its rank died writing it)"
    else:  # damaged or cut short: what of it a hub would take
        try:
            whole = sp.read_spool(path)
        except sp.SpoolError as exc:
            e.state, e.error = sp.BAD_STATE, str(exc)
        else:
            e.records, e.dropped_records, e.error = (whole.records, whole.dropped_records,
                                                     whole.error)
    if state == sp.BAD_STATE and e.error is None:
        e.error = "a hub could not take it in"
    return e


def list_spools(directory: Path | None = None, now: float | None = None
                ) -> list[SpoolEntry]:
    """Every spool file of ``directory`` (default: the runtime directory), oldest
    first. Raises :class:`OSError` when the directory cannot be used."""
    t = time.time() if now is None else now
    return [entry(path, state, st, t) for path, state, st in sp.all_spools(directory)]


def to_json(directory: Path, entries: list[SpoolEntry]) -> dict[str, Any]:
    """``rtop spool list --json``."""
    return {"directory": str(directory), "budget_bytes": sp.SPOOLS_BUDGET_BYTES,
            "total_bytes": sum(e.size_bytes for e in entries),
            "spools": [asdict(e) for e in entries]}


def _who(e: SpoolEntry) -> str:
    if e.rank is None:
        return NA
    return f"{e.group}/{e.rank}" if e.group else str(e.rank)


def _count(n: int | None) -> str:
    return NA if n is None else str(n)


def format_list(directory: Path, entries: list[SpoolEntry]) -> str:
    """``rtop spool list``: a table, then where and how much."""
    if not entries:
        return f"no spool files in {directory}"
    total = sum(e.size_bytes for e in entries)
    foot = (f"{len(entries)} spool file{'s' if len(entries) != 1 else ''}, "
            f"{fmt_size(total)} of the {fmt_size(sp.SPOOLS_BUDGET_BYTES)} budget, in "
            f"{directory} (hubs remove ingested ones after "
            f"{fmt_age(sp.KEEP_INGESTED_S)}, those no hub took after "
            f"{fmt_age(sp.KEEP_UNCLAIMED_S)})")
    head = (f"{'STATE':<9} {'AGE':>5} {'SIZE':>9} {'RECORDS':>8} {'LEFT OUT':>8}  "
            f"{'JOB':<16} {'RANK':<10} {'HOST':<16} {'PID':>8}  FILE")
    lines = [head]
    for e in entries:
        lines.append(
            f"{e.state:<9} {fmt_age(e.age_s):>5} {fmt_size(e.size_bytes):>9} "
            f"{_count(e.records):>8} {_count(e.dropped_records):>8}  "
            f"{(e.job or NA)[:16]:<16} {_who(e)[:10]:<10} {(e.hostname or NA)[:16]:<16} "
            f"{_count(e.pid):>8}  {safe_text(e.file, 200)}")
        if e.error:
            lines.append(f"{'':<9} ! {e.error}")
    lines.append(foot)
    return "\n".join(lines)


def format_pruned(directory: Path, res: sp.PruneResult) -> str:
    """``rtop spool prune``: each file removed and why, then how many."""
    lines = [f"removed {safe_text(r.path.name, 200)}: {fmt_size(r.size_bytes)}, "
             f"{fmt_age(r.age_s)} old, {res.reason(r)}" for r in res.removed]
    lines.append(f"{res.summary()} in {directory}" if res.removed
                 else f"nothing to remove in {directory}")
    return "\n".join(lines)
