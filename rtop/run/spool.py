"""Reading the spool files ranks leave when no hub took their last records.

A spool (written by :mod:`collectors.spool`, whose doc gives the format) lies in the
user's runtime directory under one of these names:

* ``spool-<job>-r<rank>-a<attempt>-p<pid>-<id>.rtop``: waiting for a hub;
* ``...rtop.claim-<pid>``: a hub (that process) is recording it now; one whose hub is
  gone is waiting again;
* ``...rtop.ingested``: a hub recorded it (kept a day for ``rtop report`` on the
  recording the rank was sending to; never recorded twice in one recording: the hub
  writes the spool's ``id`` beside its frames, see :class:`SpoolTally`);
* ``...rtop.bad``: not a spool a hub can read (kept a week for a person to look at).

They are bounded (:func:`prune`, run by every hub's scan and by ``rtop spool prune``):
ingested ones go after a day, spools no hub took after a week, and beyond 1 GiB for
all of them together the oldest go first; never one a live hub is recording.

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
from rtop.fmt import fmt_age, fmt_size
from rtop.run.recording import is_blocks, rare_frames
from rtop.run.state import RankState, RunState
from rtop.run.validate import ProtocolError, clean_identity

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


#: Ingested spools are kept this long for ``rtop report`` on other recordings.
KEEP_INGESTED_S = 24 * 3600.0
#: Spools no hub took (waiting, or ``.bad``) are removed this long after they were
#: last touched: their hub never came (see :func:`prune`).
KEEP_UNCLAIMED_S = 7 * 24 * 3600.0
#: The most all the spools of a directory may hold together; beyond it the oldest are
#: removed (see :func:`prune`).
SPOOLS_BUDGET_BYTES = 1 << 30
#: No spool younger than this is removed for the budget, nor a half-written one: its
#: rank may be writing it, or its hub about to take it.
MIN_PRUNE_AGE_S = 300.0

#: A spool's states (see the module doc); ``partial``: a ``.spool-*.tmp`` file a rank
#: was writing (one killed meanwhile leaves it).
WAITING, CLAIMED, INGESTED_STATE, BAD_STATE, PARTIAL = (
    "waiting", "claimed", "ingested", "bad", "partial")


def spool_state(path: Path) -> str | None:
    """The state of a file named as a spool (waiting, claimed, ingested, bad, partial;
    the claim of a hub that is gone is waiting again), or None for any other name."""
    name = path.name
    if name.startswith(f".{SPOOL_PREFIX}") and name.endswith(".tmp"):
        return PARTIAL
    if not name.startswith(SPOOL_PREFIX) or SPOOL_SUFFIX not in name:
        return None
    if name.endswith(SPOOL_SUFFIX):
        return WAITING
    if name.endswith(INGESTED):
        return INGESTED_STATE
    if name.endswith(BAD):
        return BAD_STATE
    pid = claim_pid(path)
    if pid is None:
        return None
    return CLAIMED if pid_alive(pid) else WAITING


def all_spools(directory: Path | None = None) -> list[tuple[Path, str, os.stat_result]]:
    """Every file of ``directory`` (default: the runtime directory) named as a spool,
    whatever its state, with its state and ``lstat``, oldest first. Raises
    :class:`OSError` when the directory cannot be read."""
    rdir = directory or runtime_dir()
    out: list[tuple[Path, str, os.stat_result]] = []
    for path in list(rdir.glob(f"{SPOOL_PREFIX}*{SPOOL_SUFFIX}*")) + \
            list(rdir.glob(f".{SPOOL_PREFIX}*.tmp")):
        state = spool_state(path)
        if state is None:
            continue
        try:
            st = path.lstat()
        except OSError:
            continue  # taken or removed meanwhile
        out.append((path, state, st))
    out.sort(key=lambda e: (e[2].st_mtime, e[0].name))
    return out


@dataclass(frozen=True)
class Removed:
    """One file a prune pass removed."""

    path: Path
    state: str  # as :func:`spool_state` says
    why: str  # "age", "budget", or "asked" (every ingested one, ``--all-ingested``)
    size_bytes: int
    age_s: float  # since it was last touched


@dataclass
class PruneResult:
    """What a prune pass removed, and the bounds it applied."""

    keep_ingested_s: float
    keep_unclaimed_s: float
    budget_bytes: int
    removed: list[Removed] = field(default_factory=list)
    #: files it could not remove, or the directory it could not read: one line each
    errors: list[str] = field(default_factory=list)

    @property
    def unrecorded(self) -> int:
        """Spools removed that no hub recorded (waiting or bad): records lost."""
        return sum(r.state in (WAITING, BAD_STATE) for r in self.removed)

    def reason(self, r: Removed) -> str:
        """Why one was removed, in words that follow a count ("2 waiting over 7d ...")."""
        if r.why == "budget":
            return f"{r.state} beyond the {fmt_size(self.budget_bytes)} budget of all spools"
        if r.why == "asked":
            return "ingested (all asked for)"
        if r.state == INGESTED_STATE:
            return f"ingested over {fmt_age(self.keep_ingested_s)} ago"
        if r.state == PARTIAL:
            return "half-written (their rank died writing)"
        if r.state == BAD_STATE:
            return f"bad (unreadable) over {fmt_age(self.keep_unclaimed_s)} old"
        return f"waiting over {fmt_age(self.keep_unclaimed_s)} (no hub took them)"

    def summary(self) -> str:
        """One line: how many were removed, and why."""
        whys: dict[str, int] = {}
        for r in self.removed:
            text = self.reason(r)
            whys[text] = whys.get(text, 0) + 1
        size = sum(r.size_bytes for r in self.removed)
        n = len(self.removed)
        return (f"removed {n} spool file{'s' if n != 1 else ''} ({fmt_size(size)}): "
                + ", ".join(f"{k} {w}" for w, k in whys.items()))


def prune(directory: Path | None, now: float, *, keep_ingested_s: float | None = None,
          keep_unclaimed_s: float | None = None, budget_bytes: int | None = None,
          all_ingested: bool = False) -> PruneResult:
    """Remove the spools of ``directory`` (default: the runtime directory) past their
    time, then the oldest beyond the budget; ``now`` is the wall clock. Never raises.

    * ingested ones last touched over ``keep_ingested_s`` (:data:`KEEP_INGESTED_S`)
      ago, or every one with ``all_ingested``;
    * waiting and ``.bad`` ones (no hub took them) over ``keep_unclaimed_s``
      (:data:`KEEP_UNCLAIMED_S`);
    * half-written ones over the shorter of the two (never one younger than
      :data:`MIN_PRUNE_AGE_S`);
    * then, while all the spools together hold over ``budget_bytes``
      (:data:`SPOOLS_BUDGET_BYTES`): ingested ones first, then the others, oldest first,
      never one younger than :data:`MIN_PRUNE_AGE_S`.

    A spool a live hub has claimed is never removed: it is being recorded.
    """
    res = PruneResult(
        KEEP_INGESTED_S if keep_ingested_s is None else keep_ingested_s,
        KEEP_UNCLAIMED_S if keep_unclaimed_s is None else keep_unclaimed_s,
        SPOOLS_BUDGET_BYTES if budget_bytes is None else budget_bytes)
    try:
        found = all_spools(directory)
    except OSError as exc:
        res.errors.append(f"cannot read the spool directory: {exc}")
        return res
    keep = {INGESTED_STATE: res.keep_ingested_s, WAITING: res.keep_unclaimed_s,
            BAD_STATE: res.keep_unclaimed_s,
            PARTIAL: max(MIN_PRUNE_AGE_S, min(res.keep_ingested_s, res.keep_unclaimed_s))}
    left: list[tuple[Path, str, os.stat_result]] = []
    for path, state, st in found:
        age = now - st.st_mtime
        if state == INGESTED_STATE and all_ingested:
            why = "asked"
        elif state != CLAIMED and age > keep[state]:
            why = "age"
        else:
            left.append((path, state, st))
            continue
        _remove(res, path, state, why, st, age)
    total = sum(st.st_size for _, _, st in left)
    if total > res.budget_bytes:
        order = sorted((e for e in left if e[1] != CLAIMED
                        and now - e[2].st_mtime >= MIN_PRUNE_AGE_S),
                       key=lambda e: (e[1] != INGESTED_STATE, e[2].st_mtime))
        for path, state, st in order:
            if total <= res.budget_bytes:
                break
            if _remove(res, path, state, "budget", st, now - st.st_mtime):
                total -= st.st_size
    return res


def _remove(res: PruneResult, path: Path, state: str, why: str, st: os.stat_result,
            age_s: float) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False  # claimed, taken in or removed meanwhile
    except OSError as exc:
        res.errors.append(f"cannot remove {path}: {exc.strerror or exc}")
        return False
    res.removed.append(Removed(path, state, why, st.st_size, age_s))
    return True


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
        os.utime(target)  # kept from now on (see prune)
    return target


def rank_key(ident: Identity) -> tuple[str, int, str, int]:
    """``(group, rank, hostname, pid)`` of a cleaned identity: one rank process."""
    return (RunState.group_of(ident), ident.rank, ident.hostname, ident.pid)


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
                return st.rank_state(ident.rank, RunState.group_of(ident))
        return None


#: How a hello frame's body starts (msgpack: a 2-array, then the 5-character kind).
_HELLO_BODY = b"\x92\xa5hello"


def recorded_ranks(path: str | Path) -> set[tuple[str, int, str, int]]:
    """The rank processes (:func:`rank_key`) that said hello in a recording, found by
    decoding its hello frames only (every other frame is skipped by its length; in the
    block format, only the blocks that hold hellos are read), up to its end or the first
    damage. Never raises."""
    found: set[tuple[str, int, str, int]] = set()
    try:
        if is_blocks(path):  # the block format: the blocks that hold hellos
            for frame in rare_frames(path):
                with contextlib.suppress(ProtocolError):
                    if frame.kind == wire.KIND_HELLO:
                        found.add(rank_key(clean_identity(frame.payload.get("identity"))))
            return found
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

