"""Jumping anywhere in a recording of the block format at once.

Replaying every frame up to a moment costs about 40 µs a frame: an hour of 1,024 ranks
is minutes. A jump to hub time ``t`` applies instead:

1. the frames that make every rank's state before the last seconds
   (:mod:`rtop.run.facets`): found through the blocks' headers (:func:`index`), which say
   when each block's frames arrived and what kinds it holds (``blocks.RARE``,
   ``META``, ``FIRST``): the blocks holding hellos, goodbyes, closed connections, a
   ``meta``, a rank's first steps are read whole, front to back; then the blocks just
   before the last seconds are read back to front, each rank's latest batch, latest
   samples and latest clock offset taken from the first block that has them (only the
   frames wanted are built, of the groups that hold them);
2. then the last moments before ``t`` frame by frame, with the rolling windows: the
   blocks of at most :data:`HISTORY_FRAMES` frames (a second or so of a thousand ranks,
   half a minute of 64).

The state after a jump is the state a replay from the start reaches (every rank's
status, identity, last step, latest samples, clock offset, ...), but for the rolling
windows (the last moments only, filling as the replay plays on: the medians of recent
steps and the sparklines are those of fewer steps at first), the counts of steps and
frames received, the events a rank sent before its latest ones, and the diagnosis'
history (a replay's jump diagnoses the last second before its target, and its findings
come back as it plays on).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from collectors import wire
from rtop.run import blocks
from rtop.run.blocks import BlockError, BlockInfo, BlockView
from rtop.run.facets import Facets, Key, has_stack, name
from rtop.run.recording import index, started

#: Frames at most replayed with their history after a jump: with the frames that make
#: every rank's state, about 0.4 s of CPU for 1,024 ranks (benchmarks/recording_size.py),
#: half a second of their frames; minutes of a few ranks'.
HISTORY_FRAMES: Final = 4000
#: ... and never from further back than this (a replay's seek keeps as much history).
HISTORY_S: Final = 900.0
#: A rank's latest samples and clock offset are looked for this far back from its
#: latest batch (it sends samples every second, the hub measures its offset every 10 s).
SIDE_S: Final = 60.0

_FORWARD = blocks.RARE | blocks.META | blocks.FIRST
_SAMPLES = ("gpu", "host", "mem", "hb")


@dataclass
class Jump:
    """How to make the state at a hub time: apply ``frames`` (without the rolling
    windows), then read on from block ``start`` (None: from the recording's start, every
    frame: nothing to skip)."""

    frames: list[tuple[float, wire.Frame]]
    start: BlockInfo | None
    #: the hub time ``frames`` bring the state to
    t: float
    #: blocks of the recording read (whole or in part) to find ``frames``
    blocks_read: int = 0
    #: damaged blocks met (their frames left out)
    damaged: int = 0


class Seeker:
    """Jumps in one recording of the block format (see the module doc); its index of
    blocks is read once (:func:`rtop.run.recording.index`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.blocks = index(self.path)

    def refresh(self) -> None:
        """Read the index again (a recording still being written has grown)."""
        self.blocks = index(self.path)

    def block_at(self, t: float) -> int:
        """The index of the first block holding frames at or after hub time ``t`` (the
        last block when none does)."""
        for i, b in enumerate(self.blocks):
            if math.isfinite(b.t_end) and b.t_end >= t:
                return i
        return max(0, len(self.blocks) - 1)

    def frames_between(self, t0: float, t1: float) -> int:
        """About how many frames arrived between hub times ``t0`` and ``t1``."""
        return sum(b.frames for b in self.blocks
                   if math.isfinite(b.t_end) and b.t_end >= t0 and not b.t_start > t1)

    def time_of_step(self, step: int) -> float | None:
        """The hub time at the start of the first block whose steps reach ``step``."""
        for b in self.blocks:
            if b.step_max >= step:
                return b.t_start if math.isfinite(b.t_start) else b.t_end
        return None

    def jump(self, target: float, history_frames: int | None = None) -> Jump:
        """How to make the state at hub time ``target`` (see :class:`Jump`), replaying
        ``history_frames`` (default :data:`HISTORY_FRAMES`) frames before it."""
        history_frames = HISTORY_FRAMES if history_frames is None else history_frames
        bl = self.blocks
        if not bl:
            return Jump([], None, math.nan)
        end = self.block_at(target)
        h = end
        held = bl[end].frames
        while h > 1 and held + bl[h - 1].frames <= history_frames \
                and not bl[h - 1].t_start < target - HISTORY_S:
            h -= 1
            held += bl[h].frames
        if h <= 1:
            return Jump([], None, math.nan)
        return _Condenser(self.path, bl[:h]).run(bl[h])


class _Condenser:
    """The frames that make the state at the end of ``blocks`` (see the module doc)."""

    def __init__(self, path: Path, blocks_: list[BlockInfo]) -> None:
        self.path = path
        self.blocks = blocks_
        self.facets = Facets()
        self.read = 0
        self.damaged = 0
        self._f: Any = None

    def _view(self, i: int) -> BlockView | None:
        info = self.blocks[i]
        try:
            body = blocks.read_body(self._f, info)
            if body is None:
                raise BlockError("cut short")
            self.read += 1
            return BlockView(blocks.decompress(body, info), info)
        except (BlockError, ValueError):
            self.damaged += 1
            return None

    def run(self, start: BlockInfo) -> Jump:
        with open(self.path, "rb") as self._f:
            hello_at: dict[Key, int] = {}
            for i, info in enumerate(self.blocks):
                if i == 0 or info.flags & _FORWARD:
                    self._whole(i, hello_at)
            self._back(hello_at)
        frames = self.facets.frames()
        t = frames[-1][0] if frames else math.nan
        if math.isfinite(start.t_start):
            t = start.t_start if not t > start.t_start else t
        return Jump(frames, start, t, self.read, self.damaged)

    def _whole(self, i: int, hello_at: dict[Key, int]) -> None:
        """Every frame of block ``i`` seen, in order."""
        view = self._view(i)
        if view is None:
            return
        try:
            frames = view.frames()
        except BlockError:
            self.damaged += 1
            return
        t = view.info.t_start if math.isfinite(view.info.t_start) else 0.0
        see = self.facets.see
        for pos, frame in enumerate(frames):
            if frame.kind in (wire.KIND_CLOCK, wire.KIND_RUN):
                v = frame.payload.get("t_hub") if frame.kind == wire.KIND_CLOCK else \
                    started(frame)
                if isinstance(v, float) and math.isfinite(v):
                    t = v
            see((i, pos), t, frame)
            if frame.kind == wire.KIND_HELLO:
                ident = frame.payload.get("identity")
                if isinstance(ident, dict):
                    hello_at[(name(ident.get("group")), name(ident.get("rank")))] = i

    def _back(self, hello_at: dict[Key, int]) -> None:
        """Back from the last block: each rank's latest batch, samples and offset (and,
        on the way, its latest events and stack), until every rank has them, the walk is
        back before its hello, or (samples, offset) :data:`SIDE_S` before its latest
        batch."""
        need = {facet: set(hello_at) for facet in ("batch", "samples", "offset")}
        self._until: dict[Key, float] = {}  # samples and offset looked for until then
        for i in range(len(self.blocks) - 1, 0, -1):
            t_end = self.blocks[i].t_end
            for facet, keys in need.items():
                keys.difference_update([k for k in keys if hello_at[k] > i or (
                    facet != "batch" and self._until.get(k, -math.inf) > t_end)])
            if not any(need.values()):
                return
            view = self._view(i)
            if view is None:
                continue
            try:
                self._take(i, view, need)
            except (BlockError, ValueError):
                self.damaged += 1

    def _take(self, i: int, view: BlockView, need: dict[str, set[Key]]) -> None:
        """From one block (newest frames first), the frames ranks still need."""
        times = _Times(view)
        notes = view.info.flags & (blocks.EVENTS | blocks.STACK)
        for gi, g in enumerate(view.groups):
            if g.kind == wire.KIND_BATCH:
                wanted = ["batch"]
                if any(k in g.keys for k in _SAMPLES):
                    wanted.append("samples")
                extra = bool(notes) and ("events" in g.keys or "hb" in g.keys)
            elif g.kind == "offset":
                wanted, extra = ["offset"], False
            else:
                continue
            if not extra and not any(need[w] for w in wanted):
                continue
            ranks, groups = g.column("rank"), g.column("group")
            if ranks is None:
                continue
            groups = groups if groups is not None else [None] * g.n
            positions = view.positions(gi)
            payloads: list[dict[Any, Any]] | None = None
            for j in range(g.n - 1, -1, -1):
                key = (name(groups[j]), name(ranks[j]))
                takes = [w for w in wanted if key in need[w]]
                if not takes and not extra:
                    continue
                if payloads is None:
                    payloads = g.payloads()
                p = payloads[j]
                if not takes and not ("events" in p or has_stack(p)):
                    continue
                pos = positions[j]
                t = times.at(pos)
                self.facets.see((i, pos), t, wire.Frame(g.kind, p))
                for w in takes:
                    need[w].discard(key)
                if "batch" in takes:
                    self._until[key] = t - SIDE_S


class _Times:
    """The hub time at each place of a block (from its clock frames)."""

    def __init__(self, view: BlockView) -> None:
        self.start = view.info.t_start if math.isfinite(view.info.t_start) else 0.0
        self.pos: list[int] = []
        self.t: list[float] = []
        for gi, g in enumerate(view.groups):
            if g.kind == wire.KIND_CLOCK and g.keys == ["t_hub"]:
                values = g.column("t_hub") or []
                for pos, v in zip(view.positions(gi), values, strict=True):
                    if isinstance(v, float) and math.isfinite(v):
                        self.pos.append(pos)
                        self.t.append(v)
        pairs = sorted(zip(self.pos, self.t, strict=True))
        self.pos = [p for p, _ in pairs]
        self.t = [t for _, t in pairs]

    def at(self, pos: int) -> float:
        """The hub time in effect at place ``pos``."""
        k = bisect.bisect_right(self.pos, pos) - 1
        return self.t[k] if k >= 0 else self.start
