"""The spool: a rank's unsent records, kept on local disk when no hub can take them.

A rank that ends (``probe.close``, the interpreter's exit) while its hub is
unreachable would lose the records still queued for it, often the very evidence of
what went wrong. :func:`write_spool` puts them in a *spool file* instead, in the
user's runtime directory (:func:`collectors.discovery.runtime_dir`: 0700, the user's
own), named after the job, rank, attempt and process::

    spool-<job>-r<rank>-a<attempt>-p<pid>-<id>.rtop

It is written as a fresh 0600 file of an unpredictable name (``mkstemp``: ``O_EXCL``,
no planted link followed) and renamed into place once whole, so a spool is either
complete or absent. It holds frames of the wire format (:mod:`collectors.wire`):

1. ``spool``: the header (``id``, a random name of this spool; the rank's ``job``,
   ``job_key``, ``group``, ``rank``, ``attempt``, ``hostname``, ``pid`` and whole
   ``identity``; ``t_wall``; ``dropped_records``: records left out by the size bound);
2. ``hello``: the rank's identity, as it says hello to a hub (no nonce, no token);
3. the ``batch`` frames that were never delivered, oldest first, byte for byte as they
   would have been sent;
4. ``bye``: why the rank ended, and the records it lost for good;
5. ``spool_end``: the counts (``frames``, ``records``, ``dropped_records``).

It is bounded: at most ``max_bytes`` bytes (the oldest batches are left out first and
their records counted), and written within ``timeout_s`` seconds (batches not written
by then are counted too). Frames a hub has received are never in it: only frames not
yet handed whole to the socket are. A later hub (``rtop serve``) or ``rtop report``
reads it back (``rtop.run.spool``). Writing it never raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors import wire
from collectors.discovery import job_key, private_dir, runtime_dir
from collectors.identity import Identity

log = logging.getLogger("collectors")

#: Names of spool files (pending ones); see the module doc.
SPOOL_PREFIX = "spool-"
SPOOL_SUFFIX = ".rtop"
#: The first frame of a spool: who wrote it.
KIND_SPOOL = "spool"
#: The last frame of a spool: what it holds.
KIND_SPOOL_END = "spool_end"
#: Format version of a spool's header.
SPOOL_VERSION = 1
#: Room kept for the header, hello, bye and end frames within the size bound.
OVERHEAD_BYTES = 16 * 1024


@dataclass
class SpoolResult:
    """What writing a spool did: where, how much, how long, and what it left out."""

    path: str | None = None
    frames: int = 0
    records: int = 0
    #: records left out: the size bound (oldest first) or the time bound
    dropped_records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


def spool_name(identity: Identity, spool_id: str) -> str:
    """The file name of this rank's spool: job, rank, attempt, process, and the start
    of the spool's id (a process that spools twice never overwrites its first)."""
    return (f"{SPOOL_PREFIX}{job_key(identity)}-r{int(identity.rank)}"
            f"-a{int(identity.attempt)}-p{int(identity.pid)}-{spool_id[:6]}{SPOOL_SUFFIX}")


def _newest_within(frames: list[tuple[bytes, int]], budget: int
                   ) -> tuple[list[tuple[bytes, int]], int]:
    """The newest frames whose bytes fit ``budget`` (kept in order), and the records
    of the older ones left out."""
    kept: list[tuple[bytes, int]] = []
    used = 0
    dropped = 0
    full = False
    for frame, n in reversed(frames):
        if not full and used + len(frame) <= budget:
            kept.append((frame, n))
            used += len(frame)
        else:
            full = True  # older frames than one that did not fit: left out too
            dropped += n
    kept.reverse()
    return kept, dropped


def write_spool(
    identity: Identity,
    frames: list[tuple[bytes, int]],
    hello: dict[str, Any],
    bye: dict[str, Any] | None,
    *,
    max_bytes: int,
    timeout_s: float,
    directory: Path | None = None,
    reason: str = "no hub reachable",
) -> SpoolResult:
    """Write ``frames`` (encoded batch frames and their record counts, oldest first)
    to this rank's spool file; see the module doc. ``bye`` (its ``dropped`` count
    raised by what the bounds leave out) is written after them. Never raises: a
    failure is in the result's ``error`` (and every record is then counted as
    dropped)."""
    t0 = time.monotonic()
    total = sum(n for _, n in frames)
    res = SpoolResult()
    tmp: str | None = None
    fd = -1
    try:
        rdir = private_dir(directory) if directory is not None else runtime_dir()
        kept, res.dropped_records = _newest_within(frames, max(0, max_bytes - OVERHEAD_BYTES))
        spool_id = secrets.token_hex(8)
        header = {
            "version": SPOOL_VERSION, "id": spool_id,
            "job": identity.job, "job_key": job_key(identity), "group": identity.group,
            "rank": identity.rank, "attempt": identity.attempt,
            "hostname": identity.hostname, "pid": identity.pid, "t_wall": time.time(),
            "identity": identity.to_wire(),
            "reason": reason, "dropped_records": res.dropped_records,
        }
        name = spool_name(identity, spool_id)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=rdir)
        os.fchmod(fd, 0o600)
        deadline = t0 + max(0.0, timeout_s)
        out = [wire.encode(KIND_SPOOL, header), wire.encode(wire.KIND_HELLO, hello)]
        written = 0
        for chunk in out:
            written += _write_all(fd, chunk)
        for i, (frame, n) in enumerate(kept):
            if time.monotonic() > deadline:  # bounded in time: the rest is counted
                res.dropped_records += sum(k for _, k in kept[i:])
                break
            written += _write_all(fd, frame)
            res.frames += 1
            res.records += n
        if bye is not None:
            bye = {**bye, "dropped": int(bye.get("dropped") or 0) + res.dropped_records}
            written += _write_all(fd, wire.encode(wire.KIND_BYE, bye))
        written += _write_all(fd, wire.encode(KIND_SPOOL_END, {
            "id": spool_id, "frames": res.frames, "records": res.records,
            "dropped_records": res.dropped_records}))
        os.close(fd)
        fd = -1
        final = rdir / name
        os.replace(tmp, final)
        tmp = None
        res.path, res.bytes = str(final), written
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        res.dropped_records, res.frames, res.records = total, 0, 0
    finally:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    res.seconds = time.monotonic() - t0
    return res


def _write_all(fd: int, data: bytes) -> int:
    """Write all of ``data`` to ``fd``; the bytes written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return len(data)


__all__ = ["KIND_SPOOL", "KIND_SPOOL_END", "SPOOL_PREFIX", "SPOOL_SUFFIX", "SpoolResult",
           "spool_name", "write_spool"]
