"""A hub takes in the spools ranks left when no hub took their last records.

Every ``spool_scan_s`` (the first time that long after it started, so that the live
ranks of a job starting with it say hello first) the hub looks in its spool directory (the
runtime directory, where the ranks of this node write theirs: :mod:`collectors.spool`)
and, when it records, takes a spool when it is this hub's to take:

* the hub holds the rank that wrote it (same group, rank, host and process): one of
  its own ranks could not reach it at the end (the hub was stalled); a spool of a rank
  whose place in its group another process holds (another run that reused the group's
  name) is never taken: its own recording's report merges it;
* or that rank process is in the hub's recording from before the hub started (a hub
  restarted on the same recording path: ``rtop serve --record RUN.rtop`` again);
* or the spool's job is the hub's job name (the node's hub of that job, ``rtop serve
  --job NAME``);
* or the hub was told to take every spool (``rtop serve --take-spools``:
  ``HubConfig.spool_take_all``), as long as no live rank has come yet, only spools.

Any other spool waits for its own hub, or for ``rtop report`` on its recording (which
finds it by its rank process).

Taking one: claim it (an atomic rename, so of several hubs one records it), read it
(off the event loop), apply its frames to the run's state and record them like frames
from a live rank, between a ``spool`` frame (the spool's ``id``, rank, counts, damage)
and a ``spool_end`` frame; the recording is written to disk, and only then is the file
renamed ``.ingested`` (kept a day for ``rtop report`` on another recording; a report
never counts a spool whose id the recording already holds). A spool that is not one
(no header) is renamed ``.bad`` with one warning; a damaged one gives the whole frames
before the damage, and the damage is recorded and logged.

Every scan, recording or not, ends with :func:`rtop.run.spool.prune`: spools past
their time (ingested ones a day, those no hub took a week) and the oldest beyond the
budget of all spools go, in one log line per pass that removed any (a warning when
some were never recorded: their records are lost, and counted in ``spools_pruned``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collectors import wire
from collectors.discovery import safe_name
from rtop.run.spool import (
    BAD,
    INGESTED,
    KIND_SPOOL_BEGIN_REC,
    KIND_SPOOL_END_REC,
    SpoolError,
    SpoolFile,
    base_name,
    claim,
    mark,
    prune,
    rank_key,
    read_header,
    read_spool,
    recorded_ranks,
    spool_files,
)
from rtop.run.state import RunState
from rtop.run.validate import ProtocolError, clean_identity

if TYPE_CHECKING:
    from rtop.hub.server import Hub

log = logging.getLogger("rtop.hub")

_NOT_READ: set[tuple[str, int, str, int]] = set()  # the recording not read yet


class SpoolIngest:
    """Takes in the spools that are ``hub``'s (see the module doc); on its event loop."""

    def __init__(self, hub: Hub, directory: Path | None, every_s: float) -> None:
        self.hub = hub
        self.directory = directory
        self.every_s = every_s
        self._next = 0.0
        self._task: asyncio.Task[Any] | None = None
        self._spool_groups: set[str] = set()  # attempts that spools made
        #: the rank processes the recording held when this hub started (rank_key)
        self._recorded: set[tuple[str, int, str, int]] = _NOT_READ
        #: spools taken in, records they held, records their ranks had left out,
        #: spools that could not be read, and spools no hub recorded that it removed
        self.counters = {"spools": 0, "spool_records": 0, "spool_dropped_records": 0,
                         "spools_bad": 0, "spools_damaged": 0, "spools_pruned": 0}

    def tick(self, mono: float) -> None:
        """From the hub's housekeeping: start a scan when one is due (the first one
        ``every_s`` after the hub started, so that live ranks say hello first)."""
        if not self._next:
            self._next = mono + self.every_s
        if mono < self._next or (self._task is not None and not self._task.done()):
            return
        self._next = mono + self.every_s
        self._task = self.hub.spawn(self.scan())

    async def scan(self) -> None:
        """Take in the spools that are this hub's (when it records), then prune."""
        try:
            recorder = self.hub.recorder
            if recorder is not None and not recorder.failed:
                await self._take_in()
            # (a hub that does not record keeps no spool, but bounds them all the same)
            res = await asyncio.to_thread(prune, self.directory, time.time())
            if res.removed:
                self.counters["spools_pruned"] += res.unrecorded
                log.log(logging.WARNING if res.unrecorded else logging.INFO,
                        "rtop hub: spools in %s: %s", res.removed[0].path.parent,
                        res.summary())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("rtop hub: looking for spools failed")

    async def _take_in(self) -> None:
        recorder = self.hub.recorder
        assert recorder is not None
        if self._recorded is _NOT_READ:  # once: the rank processes recorded before
            self._recorded = await asyncio.to_thread(recorded_ranks, recorder.path)
        paths = await asyncio.to_thread(spool_files, self.directory)
        for path in paths:
            header = await asyncio.to_thread(read_header, path)
            if header is None:
                if path.exists():  # not one taken by another hub meanwhile
                    await self._bad(path, "no readable spool header")
                continue
            if not self.wanted(header):
                continue
            claimed = claim(path)
            if claimed is None:
                continue  # another hub took it
            try:
                spool = await asyncio.to_thread(read_spool, claimed)
            except SpoolError as exc:
                await self._bad(claimed, str(exc))
                continue
            if self.hub.recorder is None or self.hub.recorder.failed:
                mark(claimed, "")  # nowhere to keep it now: left for a later hub
                continue
            self.take(spool)
            mark(claimed, INGESTED)

    async def _bad(self, path: Path, why: str) -> None:
        self.counters["spools_bad"] += 1
        log.warning("rtop hub: %s is not a spool this hub can read (%s); renamed %s",
                    path, why, BAD)
        mark(path, BAD)

    def wanted(self, header: dict[str, Any]) -> bool:
        """Whether a spool with this header is this hub's to take (module doc)."""
        state: RunState = self.hub.state
        job = self.hub.cfg.job
        try:
            ident = clean_identity(header.get("identity"))
        except ProtocolError:
            return False
        group = RunState.group_of(ident)
        for att in [*state.attempts, *state.pending.values()]:
            rs = att.ranks.get(ident.rank) if att.group == group else None
            if rs is not None:
                # this hub's own rank came back; another process in its place is
                # another run that reused the group's name: never mixed into it
                return rs.identity.pid == ident.pid and rs.identity.hostname == ident.hostname
        key = rank_key(ident)
        if key in self._recorded:
            return True  # a rank process of this recording, from before a restart
        if job and (header.get("job_key") == safe_name(job) or header.get("job") == job):
            return True
        # asked to take every spool: as long as no live rank has come (only spools)
        return self.hub.cfg.spool_take_all and \
            all(att.group in self._spool_groups for att in state.attempts)

    def take(self, spool: SpoolFile) -> None:
        """Apply a spool's frames to the run and record them (see the module doc)."""
        hub = self.hub
        rec = hub.recorder
        assert rec is not None
        now = time.time()
        summary = spool.summary()
        summary["path"] = str(spool.path.with_name(base_name(spool.path) + INGESTED))
        rec.frame(KIND_SPOOL_BEGIN_REC, summary, now)
        peer = None
        applied = bad = 0
        for raw, frame in spool.frames:
            if hub.state.is_duplicate(frame, peer):
                # a batch this hub got after all (its ack did not reach the rank in time)
                hub.state.duplicate_frames += 1
                continue
            try:
                rs = hub.monitor.apply(frame, now, peer=peer)
            except ProtocolError as exc:
                bad += 1
                if bad == 1:
                    log.warning("rtop hub: spool %s: a %s frame refused: %s", spool.path,
                                frame.kind[:20], str(exc)[:200])
                if frame.kind == wire.KIND_HELLO:
                    break  # nothing after a refused hello can be attributed
                continue
            if frame.kind == wire.KIND_HELLO:
                peer = rs
                if rs is not None:
                    self._spool_groups.add(RunState.group_of(rs.identity))
                clean = {k: v for k, v in frame.payload.items()
                         if k not in ("nonce", "token", "proof")}
                raw = wire.encode(wire.KIND_HELLO, clean)
            rec.raw(raw, now)
            applied += 1
        rec.frame(KIND_SPOOL_END_REC, {"id": spool.id, "frames": applied,
                                       "refused": bad, "records": spool.records}, now)
        rec.sync()
        hub.state.bad_frames += bad
        self.counters["spools"] += 1
        self.counters["spool_records"] += spool.records
        self.counters["spool_dropped_records"] += spool.dropped_records
        if spool.error:
            self.counters["spools_damaged"] += 1
            log.warning("rtop hub: spool %s is damaged: %s; its %d records before the "
                        "damage are recorded", spool.path, spool.error, spool.records)
        log.info("rtop hub: took in the spool of rank %s (%s): %d records, %d its rank "
                 "left out", summary.get("rank"), base_name(spool.path), spool.records,
                 spool.dropped_records)
