"""Reading the spool files ranks leave when no hub took their last records.

A spool (written by :mod:`collectors.spool`, whose doc gives the format) lies in the
user's runtime directory under one of these names:

* ``spool-<job>-r<rank>-a<attempt>-p<pid>-<id>.rtop``: waiting for a hub;
* ``...rtop.claim-<pid>``: a hub (that process) is recording it now; one whose hub is
  gone is waiting again;
* ``...rtop.ingested``: a hub recorded it (kept a day for ``rtop report`` on the
  recording the rank was sending to; never recorded twice in one recording: the hub
  writes the spool's ``id`` beside its frames, see :func:`spool_ids`);
* ``...rtop.bad``: not a spool a hub can read (kept for a person to look at).

Reading checks the file as the hub files are checked (a regular file of this user's,
0600, not a link: :func:`collectors.discovery.read_private_file`), and reads every
whole frame up to damage: a truncated or corrupt spool gives what it holds before the
damage, with an ``error`` that says where it stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors import wire
from collectors.discovery import pid_alive, read_private_file, runtime_dir
from collectors.identity import Identity
from collectors.spool import KIND_SPOOL, KIND_SPOOL_END, SPOOL_PREFIX, SPOOL_SUFFIX
from rtop.run.state import ProtocolError, RankState, RunState, clean_identity

#: The largest spool file read (the collectors' bound is 64 MiB by default).
MAX_SPOOL_BYTES = 1 << 30
#: Frame kinds a spool may carry besides its header and end.
SPOOL_KINDS = frozenset({wire.KIND_HELLO, wire.KIND_BATCH, wire.KIND_BYE})
#: The frame a hub writes to a recording before a spool's frames, and the one after.
KIND_SPOOL_BEGIN_REC = "spool"
KIND_SPOOL_END_REC = "spool_end"
#: Suffixes of a spool's states (see the module doc).
INGESTED = ".ingested"
BAD = ".bad"
_CLAIM = re.compile(r"\.claim-(\d+)$")
#: The names of a rank's table rows in a batch, counted as its records.
RECORD_TABLES = ("steps", "gpu", "host", "mem", "hb", "events")


class SpoolError(ValueError):
    """A file that is not a spool at all (no header): nothing in it can be used."""


@dataclass
class SpoolFile:
    """What one spool holds: its header, the frames after it, and any damage."""

    path: Path
    header: dict[str, Any]
    #: ``(raw bytes, frame)`` of its hello, batches and bye, in order
    frames: list[tuple[bytes, wire.Frame]] = field(default_factory=list)
    #: its ``spool_end`` frame's payload (None: missing, the spool is incomplete)
    end: dict[str, Any] | None = None
    #: what was wrong with it (truncated, corrupt, an unexpected frame), else None
    error: str | None = None

    @property
    def id(self) -> str:
        """The spool's own random name."""
        return str(self.header.get("id") or self.path.name)

    @property
    def records(self) -> int:
        """Records in its batch frames."""
        return sum(batch_records(f.payload) for _, f in self.frames
                   if f.kind == wire.KIND_BATCH)

    @property
    def dropped_records(self) -> int:
        """Records the rank left out of it (its size or time bound)."""
        src = self.end if self.end is not None else self.header
        n = src.get("dropped_records")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0

    def summary(self) -> dict[str, Any]:
        """A short description for a report or a recording's marker frame."""
        h = self.header
        return {"id": self.id, "path": str(self.path), "job": h.get("job"),
                "group": h.get("group"), "rank": h.get("rank"), "attempt": h.get("attempt"),
                "hostname": h.get("hostname"), "pid": h.get("pid"), "t_wall": h.get("t_wall"),
                "reason": h.get("reason"), "records": self.records,
                "dropped_records": self.dropped_records, "error": self.error}


def _int(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else -1


def batch_records(payload: dict[str, Any]) -> int:
    """Records (table rows) a batch frame holds."""
    n = 0
    for table in RECORD_TABLES:
        rows = payload.get(table)
        if isinstance(rows, list):
            n += len(rows)
    return n


def read_spool(path: str | Path, max_bytes: int = MAX_SPOOL_BYTES) -> SpoolFile:
    """Read a spool file. Raises :class:`SpoolError` when it is not one (unreadable,
    not private, no header); a damaged tail is reported in ``error`` instead."""
    p = Path(path)
    data = read_private_file(p, max_bytes)
    if data is None:
        raise SpoolError(f"{p}: cannot read it as a spool (missing, not a private file "
                         f"of yours, or larger than {max_bytes} bytes)")
    dec = wire.FrameDecoder()
    error: str | None = None
    try:
        frames = dec.feed_raw(data)
    except wire.WireError as exc:
        frames = exc.partial
        error = f"corrupt after {len(frames)} whole frames ({exc})"
    if error is None and dec.pending:
        error = (f"truncated after {len(frames)} whole frames ({dec.pending} bytes of a "
                 "frame at the end)")
    if not frames or frames[0][1].kind != KIND_SPOOL:
        raise SpoolError(f"{p} is not an rtop spool (no spool header)"
                         + (f": {error}" if error else ""))
    sf = SpoolFile(p, dict(frames[0][1].payload))
    for i, (raw, frame) in enumerate(frames[1:], start=1):
        if frame.kind == KIND_SPOOL_END:
            sf.end = dict(frame.payload)
            break
        if frame.kind not in SPOOL_KINDS or (i == 1) != (frame.kind == wire.KIND_HELLO):
            error = error or f"unexpected {frame.kind[:20]!r} frame at frame {i}"
            break
        sf.frames.append((raw, frame))
    if sf.end is None and error is None:
        error = "incomplete: no end frame"
    sf.error = error
    return sf


#: The most a spool's header frame may hold.
HEADER_MAX_BYTES = 64 * 1024


def read_header(path: Path) -> dict[str, Any] | None:
    """A spool's header (its first frame) alone, read as :func:`read_spool` reads the
    whole file; None when it is not a spool a hub can read. Never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                or stat.S_IMODE(st.st_mode) & 0o077:
            return None
        data = os.read(fd, wire.HEADER_BYTES + HEADER_MAX_BYTES)
        length = wire.parse_header(data[:wire.HEADER_BYTES], HEADER_MAX_BYTES)
        body = data[wire.HEADER_BYTES:wire.HEADER_BYTES + length]
        if len(body) < length:
            return None
        frame = wire.decode_body(body, HEADER_MAX_BYTES)
    except (OSError, wire.WireError, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return dict(frame.payload) if frame.kind == KIND_SPOOL else None


def prune(directory: Path | None, older_than_s: float, now: float) -> int:
    """Remove ingested spools (and half-written ones) last touched over
    ``older_than_s`` seconds before ``now`` (wall clock); returns how many. Never
    raises."""
    removed = 0
    try:
        rdir = directory or runtime_dir()
        paths = list(rdir.glob(f"{SPOOL_PREFIX}*{SPOOL_SUFFIX}{INGESTED}"))
        # and what a rank killed while writing its spool left (never renamed into place)
        paths += list(rdir.glob(f".{SPOOL_PREFIX}*.tmp"))
    except OSError:
        return 0
    for path in paths:
        try:
            if now - path.stat().st_mtime > older_than_s:
                path.unlink()
                removed += 1
        except OSError:
            continue
    return removed


def claim_pid(path: Path) -> int | None:
    """The pid of the hub that claimed this spool (None: not a claimed spool)."""
    m = _CLAIM.search(path.name)
    return int(m.group(1)) if m else None


def spool_files(directory: Path | None = None, *, ingested: bool = False) -> list[Path]:
    """Spools in ``directory`` (default: the runtime directory) waiting for a hub
    (claims of hubs that are gone included), oldest first; with ``ingested``, the ones
    already recorded and those being recorded too. Never raises."""
    try:
        rdir = directory or runtime_dir()
        names = sorted(rdir.glob(f"{SPOOL_PREFIX}*{SPOOL_SUFFIX}*"))
    except OSError:
        return []
    out: list[tuple[float, Path]] = []
    for path in names:
        name = path.name
        pid = claim_pid(path)
        waiting = name.endswith(SPOOL_SUFFIX) or (pid is not None and not pid_alive(pid))
        done = name.endswith(INGESTED) or (pid is not None and pid_alive(pid))
        if waiting or (ingested and done):
            try:
                out.append((path.stat().st_mtime, path))
            except OSError:
                continue
    return [p for _, p in sorted(out)]


def base_name(path: Path) -> str:
    """The spool's own name (``spool-...rtop``), whatever state its suffix says."""
    name = path.name
    return name[: name.index(SPOOL_SUFFIX) + len(SPOOL_SUFFIX)] if SPOOL_SUFFIX in name \
        else name


def claim(path: Path) -> Path | None:
    """Take a waiting spool for this process (an atomic rename: of several hubs, one
    wins); None when another took it first."""
    target = path.with_name(f"{base_name(path)}.claim-{os.getpid()}")
    try:
        os.rename(path, target)
    except OSError:
        return None
    return target


def mark(path: Path, suffix: str) -> Path | None:
    """Rename a claimed spool to its final state (``.ingested`` or ``.bad``)."""
    target = path.with_name(base_name(path) + suffix)
    try:
        os.replace(path, target)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.utime(target)  # kept a day from now (see prune)
    return target


def rank_key(ident: Identity) -> tuple[str, int, str, int]:
    """``(group, rank, hostname, pid)`` of a cleaned identity: one rank process."""
    return (RunState._group_of(ident), ident.rank, ident.hostname, ident.pid)


def spool_key(header: dict[str, Any]) -> tuple[str, int, str, int] | None:
    """The rank process that wrote a spool (see :func:`rank_key`); None if its header
    does not say."""
    try:
        return rank_key(clean_identity(header.get("identity")))
    except ProtocolError:
        return None


class SpoolTally:
    """What reading a recording learns about spools (fed every frame after it is
    applied): the spools a hub recorded (between its ``spool`` and ``spool_end``
    frames), whether a frame read now came from one, and which rank processes said
    hello (whose leftover spools belong to this run)."""

    def __init__(self) -> None:
        #: the summary of the spool whose frames are being read, else None
        self.current: dict[str, Any] | None = None
        #: ids of the spools the recording holds
        self.ids: set[str] = set()
        #: every spool seen, as ``SpoolFile.summary`` and its ``source``
        self.spools: list[dict[str, Any]] = []
        #: the rank processes that said hello (:func:`rank_key`)
        self.ranks: set[tuple[str, int, str, int]] = set()

    def see(self, frame: wire.Frame, st: RunState) -> RankState | None:
        """Note one frame; for a hello read from a spool, the rank it introduced."""
        p = frame.payload
        if frame.kind == KIND_SPOOL_BEGIN_REC:
            self.current = {**p, "source": "recording"}
            self.ids.add(str(p.get("id")))
            self.spools.append(self.current)
        elif frame.kind == KIND_SPOOL_END_REC:
            self.current = None
        elif frame.kind == wire.KIND_HELLO:
            try:
                ident = clean_identity(p.get("identity"))
            except ProtocolError:
                return None
            self.ranks.add(rank_key(ident))
            if self.current is not None:
                return st.rank_state(ident.rank, RunState._group_of(ident))
        return None


#: How a hello frame's body starts (msgpack: a 2-array, then the 5-character kind).
_HELLO_BODY = b"\x92\xa5hello"


def recorded_ranks(path: str | Path) -> set[tuple[str, int, str, int]]:
    """The rank processes (:func:`rank_key`) that said hello in a recording, found by
    decoding its hello frames only (every other frame is skipped by its length), up to
    its end or the first damage. Never raises."""
    found: set[tuple[str, int, str, int]] = set()
    try:
        with open(path, "rb") as f:
            while True:
                head = f.read(wire.HEADER_BYTES)
                if len(head) < wire.HEADER_BYTES:
                    break
                length = wire.parse_header(head)
                start = f.read(len(_HELLO_BODY))
                if start != _HELLO_BODY:
                    f.seek(length - len(start), os.SEEK_CUR)
                    continue
                rest = f.read(length - len(start))
                if len(rest) < length - len(start):
                    break
                frame = wire.decode_body(start + rest)
                try:
                    found.add(rank_key(clean_identity(frame.payload.get("identity"))))
                except ProtocolError:
                    continue
    except (OSError, ValueError):
        pass
    return found

