"""The recording format the hub writes: columnar, compressed blocks of frames.

A file starts with :data:`FILE_MAGIC` (8 bytes; a recording of the older format starts
with a wire frame's ``RT`` and version 1 instead) and holds blocks, one after another,
each self-delimiting::

    header (48 bytes, big-endian)                           body (body_len bytes)
    b"RTBK" version flags 0 body_len raw_len frames          zstandard frame of the
    t_start t_end step_max crc32                             msgpack body below

``crc32`` covers the header before it and the body, so a block cut short (a killed hub,
a full disk) or damaged is found and dropped, and reading goes on from the next whole
block. ``t_start`` is the hub's time in effect at the block's first frame and ``t_end``
at its last (NaN before the hub's first clock), ``step_max`` the highest training step a
step record of the block holds (-1: none): a reader finds a time or a step from the
headers alone (:func:`scan`). ``flags`` say what the block holds (:data:`RARE`,
:data:`META`, :data:`EVENTS`, :data:`STACK`, :data:`FIRST`): a replay that jumps reads
those it needs (:mod:`rtop.run.seek`).

The body holds frames as the wire format decodes them (``[kind, payload]``) in their
order, the frames of one kind and one set of payload keys in one *group* whose keys are
laid out column by column (:mod:`rtop.run.columns`); a batch's tables of records
(``collectors.schema.TABLES``: its steps, GPU, host, memory and heartbeat samples, events)
are laid out column by column too, over all the batches of the group, so the step times
of every rank of the block sit together. Frames that fit no column (more kinds of
payload than a block keeps apart) are kept as msgpack rows in the same block::

    [1, order, groups]           order: the group of each frame, as a column
    group  ["c", kind, keys, n, columns, tables] | ["p", [[kind, payload], ...]]
    tables [[key's index, row lengths (a column), columns of the rows], ...]

Reading gives back the very payloads written, but for the float measurements of the
record tables (every field but ``t_wall``), which the writer rounds to
:data:`rtop.run.columns.MEASURE_BITS` significant bits, no finer than their unit's
:data:`FLOORS`, unless told not to. A reader of a recording from someone else
decompresses a block to at most :data:`MAX_EXPANSION` times its size (or
:data:`SMALL_BODY_BYTES`) and decodes at most :data:`VALUES_PER_BYTE` values per byte
of it: a forged block is refused as damaged, never a memory bomb.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import IO, Any, Final

import msgpack

from collectors import wire
from collectors.schema import TABLES
from rtop.run import columns

#: The first bytes of a recording in this format (the last one is its version).
FILE_MAGIC: Final = b"rtopblk\x01"
BLOCK_MAGIC: Final = b"RTBK"
BLOCK_VERSION: Final = 1
HEADER: Final = struct.Struct(">4sBBHIIIddqI")
HEADER_BYTES: Final = HEADER.size
#: Flags, what a block holds, for a reader that looks for them (:mod:`rtop.run.seek`):
#: frames that make a rank's state other than batches and clock offsets (a hello, a
#: bye, a connection closed, a job exit, a link probe, ...); ...
RARE: Final = 1
#: ... batches with a ``meta``; ...
META: Final = 2
#: ... batches with ``events``; ...
EVENTS: Final = 4
#: ... a heartbeat with the training thread's stack; ...
STACK: Final = 8
#: ... the first batch with steps of a rank (its group and rank) the writer had not
#: seen steps from (see ``encode_body``'s ``stepped``).
FIRST: Final = 16
#: The largest body a reader takes, compressed or not (a writer flushes far below).
MAX_BODY_BYTES: Final = 256 * 1024 * 1024
#: The most frame groups a block keeps apart; frames beyond go in a msgpack group.
MAX_GROUPS: Final = 1024
#: The most ranks a writer remembers having seen steps from (:data:`FIRST`).
MAX_STEPPED: Final = 1 << 17
#: A reader decodes at most this many values per byte of a block's body (its own take
#: at least 2 bytes a value: a number takes 8) ...
VALUES_PER_BYTE: Final = 2
#: ... and decompresses a body to at most this many times its compressed size (the
#: hub's data take 3 to 20), or :data:`SMALL_BODY_BYTES` (a second of goodbyes from
#: every rank, alike, compresses a thousandfold): a forged block of a few bytes costs
#: its reader tens of megabytes at most.
MAX_EXPANSION: Final = 256
SMALL_BODY_BYTES: Final = 1 << 20
#: zstandard's level: 3 (its default) measured best in CPU per byte saved
#: (benchmarks/recording_size.py).
LEVEL: Final = 3
#: Fields of the record tables that are time stamps: kept exact, never rounded.
EXACT_FIELDS: Final = frozenset({"t_wall"})
#: The finest a measurement is kept, by its unit (the end of its name), as a power of
#: two: what the collectors' clocks and counters resolve is coarser (CUDA events
#: 0.5 µs; NVML whole percent, milliwatts, whole degrees and megahertz; psutil 0.1 %).
FLOORS: Final = {"_s": -20, "_pct": -7, "_w": -10, "_c": -7, "_mhz": -4, "_bytes": 0,
                 "_Bps": 0}

_COMMON = frozenset({wire.KIND_BATCH, wire.KIND_CLOCK, "offset", "finding"})
_HB_STACK = TABLES["hb"].index("stack")


def _floor(name: str) -> int | None:
    return next((e for unit, e in FLOORS.items() if name.endswith(unit)), None)


#: Per table, per field: None (kept exact) or ``(bits?, floor)``: rounded, no finer than
#: ``2**floor`` (None: no floor).
_ROUNDING: Final = {table: tuple(None if name in EXACT_FIELDS else _floor(name)
                                 for name in fields) for table, fields in TABLES.items()}
_EXACT: Final = {table: tuple(name in EXACT_FIELDS for name in fields)
                 for table, fields in TABLES.items()}


class BlockError(ValueError):
    """A block that cannot be read: damaged, or not a block at all. Says which."""


@dataclass(frozen=True)
class BlockInfo:
    """A block's header, and where it lies in the file."""

    offset: int
    flags: int
    frames: int
    t_start: float
    t_end: float
    step_max: int
    body_len: int
    raw_len: int
    crc: int

    @property
    def end(self) -> int:
        """Where the next block starts."""
        return self.offset + HEADER_BYTES + self.body_len



def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - the app extra declares it
        raise BlockError("this recording is compressed with zstandard, which is not "
                         "installed: pip install 'rtop-train[app]'") from None
    return zstandard


def available() -> bool:
    """Whether this format can be written here (zstandard is installed)."""
    try:
        _zstd()
    except BlockError:  # pragma: no cover - the app extra declares it
        return False
    return True


# ---- writing ---------------------------------------------------------------------------


class _Group:
    __slots__ = ("index", "keys", "kind", "lists", "rows")

    def __init__(self, index: int, kind: str, keys: tuple[Any, ...]) -> None:
        self.index, self.kind, self.keys = index, kind, keys
        self.rows: list[list[Any]] = []
        #: per key that names a table of records: each frame's value (its rows)
        self.lists: dict[int, list[Any]] = {} if kind != wire.KIND_BATCH else {
            i: [] for i, k in enumerate(keys) if k in TABLES}


def _as_rows(values: list[Any]) -> list[Any] | None:
    """The rows of every frame's table, one after another; None unless each is a list
    of lists (a forged frame's: the values are then kept as they are)."""
    if set(map(type, values)) != {list}:
        return None
    rows = list(chain.from_iterable(values))
    return rows if not rows or set(map(type, rows)) == {list} else None


def _table_columns(table: str, rows: list[Any], bits: int | None) -> list[Any]:
    """``[lengths, columns]`` of a table's rows (column j: the j-th value of every row
    that has one), its measurements rounded to ``bits`` (None: exact)."""
    lens = list(map(len, rows))
    widths = set(lens)
    if len(widths) == 1:
        cols: list[Any] = list(zip(*rows, strict=True)) if lens[0] else []
    else:
        cols = [[r[j] for r in rows if len(r) > j] for j in range(max(widths, default=0))]
    exact, floors = _EXACT[table], _ROUNDING[table]
    out = []
    for j, c in enumerate(cols):
        if bits is None or j >= len(exact) or exact[j]:
            out.append(columns.encode(c))
        else:
            out.append(columns.encode(c, bits, floors[j]))
    return [columns.encode(lens), out]


@dataclass
class Encoded:
    """A block's body, before compression, and what its header says of it."""

    body: bytes
    frames: int
    flags: int
    step_max: int


def _firsts(g: _Group, counts: list[int], stepped: set[Any]) -> bool:
    """Whether a batch group's frames hold a rank's first steps (``counts``: each one's
    steps; ``stepped``: the ranks seen with steps before, updated)."""
    at_group = g.keys.index("group") if "group" in g.keys else None
    at_rank = g.keys.index("rank") if "rank" in g.keys else None
    first = False
    for vals, n in zip(g.rows, counts, strict=True):
        if n:
            key = (vals[at_group] if at_group is not None else None,
                   vals[at_rank] if at_rank is not None else None)
            try:
                if key not in stepped:
                    stepped.add(key)
                    first = True
            except TypeError:  # an unhashable group: a forged frame; looked for all along
                first = True
    return first


def encode_body(frames: Sequence[tuple[str, dict[str, Any]]],
                bits: int | None = columns.MEASURE_BITS, *, columnar: bool = True,
                stepped: set[Any] | None = None) -> Encoded:
    """The body of a block holding ``frames`` (see the module doc): the records'
    measurements rounded to ``bits`` significant bits (None: kept exact; see
    :mod:`rtop.run.columns`); ``columnar=False``: every frame as a msgpack row.
    ``stepped``: the ranks (``(group, rank)``) the writer has seen steps from, updated:
    a block with a rank's first steps is flagged :data:`FIRST` (every block with steps
    when it is not given)."""
    groups: dict[tuple[Any, ...], _Group] = {}
    packed: list[list[Any]] = []
    order: list[int] = []
    for kind, p in frames:
        gk = (kind, tuple(p))
        g = groups.get(gk)
        if g is None:
            if len(groups) >= MAX_GROUPS or not columnar:
                order.append(MAX_GROUPS)
                packed.append([kind, p])
                continue
            g = groups[gk] = _Group(len(groups), kind, gk[1])
        vals = list(p.values())
        for i, lst in g.lists.items():
            lst.append(vals[i])
        g.rows.append(vals)
        order.append(g.index)
    out: list[Any] = []
    step_max = -1
    flags = 0
    for g in groups.values():
        if g.kind not in _COMMON:
            flags |= RARE
        elif g.kind == wire.KIND_BATCH:
            flags |= (META if "meta" in g.keys else 0) | (EVENTS if "events" in g.keys else 0)
        cols: list[Any] = list(zip(*g.rows, strict=True)) if g.keys else []
        tables = []
        for i, values in g.lists.items():
            rows = _as_rows(values)
            if rows is None:
                continue  # not records: kept in the column as they are
            counts = list(map(len, values))
            cols[i] = counts
            name = g.keys[i]
            tables.append([i, *_table_columns(name, rows, bits)])
            if name == "steps" and rows:
                steps = [r[0] for r in rows if r and type(r[0]) is int]
                step_max = max(step_max, max(steps, default=-1))
                if stepped is None or _firsts(g, counts, stepped):
                    flags |= FIRST
            elif name == "hb" and any(len(r) > _HB_STACK and r[_HB_STACK] is not None
                                      for r in rows):
                flags |= STACK
        out.append(["c", g.kind, list(g.keys), len(g.rows),
                    [columns.encode(c) for c in cols], tables])
    if packed:
        out.append(["p", packed])
        flags |= RARE | META | EVENTS | STACK | FIRST  # what it holds is not looked at
    body = msgpack.packb([1, columns.encode(order), out], use_bin_type=True)
    return Encoded(body, len(order), flags, min(step_max, (1 << 63) - 1))


class BlockWriter:
    """Compresses bodies into blocks (one zstandard context, reused)."""

    def __init__(self, level: int = LEVEL) -> None:
        self._cctx = _zstd().ZstdCompressor(level=level)

    def block(self, enc: Encoded, t_start: float, t_end: float) -> bytes:
        """The bytes of one block (header and compressed body)."""
        body: bytes = self._cctx.compress(enc.body)
        head = HEADER.pack(BLOCK_MAGIC, BLOCK_VERSION, enc.flags, 0, len(body),
                           len(enc.body), enc.frames, t_start, t_end, enc.step_max, 0)
        crc = zlib.crc32(body, zlib.crc32(head[:-4]))
        return head[:-4] + crc.to_bytes(4, "big") + body


# ---- reading ---------------------------------------------------------------------------


def parse_header(head: bytes, offset: int) -> BlockInfo:
    """A block's header (the :data:`HEADER_BYTES` at ``offset``); raises
    :class:`BlockError` when it is not one."""
    magic, version, flags, _, body_len, raw_len, frames, t0, t1, step_max, crc = \
        HEADER.unpack(head)
    if magic != BLOCK_MAGIC:
        raise BlockError(f"no block at byte {offset:,} (found {magic!r})")
    if version != BLOCK_VERSION:
        raise BlockError(f"block version {version} at byte {offset:,} is not one this "
                         f"rtop reads ({BLOCK_VERSION})")
    if body_len > MAX_BODY_BYTES or raw_len > MAX_BODY_BYTES or frames > raw_len \
            or raw_len > max(MAX_EXPANSION * body_len, SMALL_BODY_BYTES):
        raise BlockError(f"block at byte {offset:,} claims {body_len:,} bytes holding "
                         f"{raw_len:,} ({frames:,} frames): more than a block may")
    return BlockInfo(offset, flags, frames, t0, t1, step_max, body_len, raw_len, crc)


def read_body(f: IO[bytes], info: BlockInfo) -> bytes | None:
    """The block's compressed body, checked against its crc; None when the file ends
    inside it. Raises :class:`BlockError` when it is damaged."""
    f.seek(info.offset)
    head = f.read(HEADER_BYTES)
    body = f.read(info.body_len)
    if len(body) < info.body_len:
        return None
    if zlib.crc32(body, zlib.crc32(head[:-4])) != info.crc:
        raise BlockError(f"block at byte {info.offset:,} is damaged (its checksum "
                         f"does not match)")
    return body


def decompress(body: bytes, info: BlockInfo) -> bytes:
    """A block's body, decompressed (no larger than its header says)."""
    zstd = _zstd()
    try:
        if zstd.frame_content_size(body) != info.raw_len:
            raise BlockError(f"block at byte {info.offset:,}: its compressed body does "
                             f"not say the size its header does")
        raw: bytes = zstd.ZstdDecompressor().decompress(body, max_output_size=info.raw_len)
    except zstd.ZstdError as exc:
        raise BlockError(f"block at byte {info.offset:,} does not decompress: {exc}") \
            from None
    if len(raw) != info.raw_len:
        raise BlockError(f"block at byte {info.offset:,} holds {len(raw):,} bytes, not "
                         f"{info.raw_len:,}")
    return raw


def _rows(lens: list[Any], cols: list[list[Any]]) -> list[list[Any]]:
    """A table's rows from its lengths and columns."""
    if not lens:
        return []
    widths = set(lens)
    if len(widths) == 1:
        w = lens[0]
        if w == 0:
            return [[] for _ in lens]
        return list(map(list, zip(*cols, strict=False)))
    its = [iter(c) for c in cols]
    return [[next(its[j]) for j in range(n)] for n in lens]


class _Budget:
    """The values a block may decode: in proportion to its bytes (a column of Nones or
    of one string repeated takes almost none, so a forged block could claim millions
    of values in a few bytes)."""

    def __init__(self, raw_len: int) -> None:
        self.left = VALUES_PER_BYTE * raw_len + 4096

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise BlockError("it claims more values than its bytes could hold")


class Group:
    """One group of a block's frames: their kind and keys; its columns are decoded when
    first asked for."""

    def __init__(self, raw: Any, budget: _Budget) -> None:
        if not (isinstance(raw, list) and len(raw) == 6 and isinstance(raw[1], str)
                and isinstance(raw[2], list) and type(raw[3]) is int and raw[3] >= 0
                and isinstance(raw[4], list) and isinstance(raw[5], list)
                and len(raw[4]) == len(raw[2])):
            raise BlockError("a malformed group")
        _, self.kind, self.keys, self.n, self._cols, self._tables = raw
        self._budget = budget
        self._values: dict[int, list[Any]] = {}
        self._payloads: list[dict[Any, Any]] | None = None

    def _decode(self, col: Any, n: int) -> list[Any]:
        self._budget.take(n)
        return columns.decode(col, n)

    def column(self, key: Any) -> list[Any] | None:
        """The values of one key of the payloads, in order (a table's: its row counts);
        None when the group's payloads have no such key."""
        try:
            i = self.keys.index(key)
        except ValueError:
            return None
        return self._column(i)

    def _column(self, i: int) -> list[Any]:
        values = self._values.get(i)
        if values is None:
            values = self._values[i] = self._decode(self._cols[i], self.n)
        return values

    def payloads(self) -> list[dict[Any, Any]]:
        """Every payload of the group, in order."""
        if self._payloads is None:
            self._payloads = self._build()
        return self._payloads

    def _build(self) -> list[dict[Any, Any]]:
        values = [self._column(i) for i in range(len(self.keys))]
        for t in self._tables:
            if not (isinstance(t, list) and len(t) == 3 and type(t[0]) is int
                    and 0 <= t[0] < len(self.keys) and isinstance(t[2], list)):
                raise BlockError("a malformed table")
            i, lens_col, tcols = t
            counts = values[i]
            if counts and (set(map(type, counts)) != {int} or min(counts) < 0):
                raise BlockError("a table's row counts are not counts")
            total = sum(counts)
            lens = self._decode(lens_col, total)
            if lens and (set(map(type, lens)) != {int} or min(lens) < 0):
                raise BlockError("a table's row lengths are not lengths")
            widest = max(lens, default=0)
            if len(tcols) != widest:
                raise BlockError("a table whose columns do not match its rows")
            if lens and min(lens) == widest:  # rows of one width: every column full
                held = [total] * widest
            else:
                held = [sum(1 for w in lens if w > j) for j in range(widest)]
            rows = _rows(lens, [self._decode(c, k) for c, k in zip(tcols, held, strict=True)])
            split = []
            at = 0
            for c in counts:
                split.append(rows[at:at + c])
                at += c
            values[i] = split
        if not self.keys:
            self._budget.take(self.n)
            return [{} for _ in range(self.n)]
        keys = self.keys
        return [dict(zip(keys, vals, strict=False)) for vals in zip(*values, strict=False)]


class BlockView:
    """A block's decompressed body: its frames' order and groups, each group decoded
    only when asked for (a reader looking for some frames decodes those alone)."""

    def __init__(self, raw: bytes, info: BlockInfo) -> None:
        self.info = info
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False,
                                  **wire.unpack_limits(max(len(raw), 1)))
            if not (isinstance(obj, list) and len(obj) == 3 and obj[0] == 1
                    and isinstance(obj[2], list)):
                raise BlockError("not a block body")
            budget = _Budget(len(raw))
            budget.take(info.frames)
            order = columns.decode(obj[1], info.frames)
            self.groups: list[Group] = []
            self.packed: list[Any] = []
            for g in obj[2]:
                if isinstance(g, list) and len(g) == 2 and g[0] == "p" \
                        and isinstance(g[1], list):
                    self.packed = g[1]
                else:
                    self.groups.append(Group(g, budget))
            count = [0] * (len(self.groups) + 1)
            for k in order:
                if type(k) is not int or not 0 <= k <= MAX_GROUPS \
                        or (k >= len(self.groups) and k != MAX_GROUPS):
                    raise BlockError("a frame of no group")
                count[min(k, len(self.groups))] += 1
            if count != [g.n for g in self.groups] + [len(self.packed)]:
                raise BlockError("its groups do not hold the frames it orders")
        except BlockError as exc:
            raise BlockError(f"block at byte {info.offset:,}: {exc}") from None
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise BlockError(f"block at byte {info.offset:,} is damaged: {exc}") from None
        self.order: list[int] = order

    def positions(self, group: int) -> list[int]:
        """Where the frames of one group stand in the block, in order."""
        return [i for i, k in enumerate(self.order) if k == group]

    def frames(self) -> list[wire.Frame]:
        """Every frame of the block, in order; raises :class:`BlockError` for one that
        does not decode."""
        try:
            built = [g.payloads() for g in self.groups]
            cursors = [0] * len(self.groups)
            packed = iter(self.packed)
            out = []
            for k in self.order:
                if k == MAX_GROUPS:
                    item = next(packed)
                    if not (isinstance(item, list) and len(item) == 2
                            and isinstance(item[0], str) and isinstance(item[1], dict)):
                        raise BlockError("a packed frame that is not [kind, payload]")
                    out.append(wire.Frame(item[0], item[1]))
                else:
                    i = cursors[k]
                    cursors[k] = i + 1
                    out.append(wire.Frame(self.groups[k].kind, built[k][i]))
            return out
        except BlockError as exc:
            raise BlockError(f"block at byte {self.info.offset:,}: {exc}") from None
        except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as exc:
            raise BlockError(f"block at byte {self.info.offset:,} is damaged: {exc}") \
                from None


def decode_body(raw: bytes, info: BlockInfo) -> list[wire.Frame]:
    """The frames of a block's decompressed body, in order; raises :class:`BlockError`
    for a body that does not hold what it should."""
    return BlockView(raw, info).frames()


def scan(f: IO[bytes], size: int, start: int = len(FILE_MAGIC)) -> Iterator[BlockInfo]:
    """The headers of the whole blocks from ``start`` on, read without their bodies
    (neither checked nor decompressed); stops at the first byte that is not a block
    header, or at a block the file ends inside."""
    at = start
    while at + HEADER_BYTES <= size:
        f.seek(at)
        try:
            info = parse_header(f.read(HEADER_BYTES), at)
        except BlockError:
            return
        if info.end > size:
            return
        yield info
        at = info.end


def find_next(f: IO[bytes], size: int, after: int) -> BlockInfo | None:
    """The first whole, undamaged block that starts after byte ``after`` (where reading
    picks up after a damaged block), or None."""
    at = after + 1
    chunk = 1 << 20
    while at < size:
        f.seek(at)
        data = f.read(chunk + len(BLOCK_MAGIC))
        i = data.find(BLOCK_MAGIC)
        while i >= 0:
            pos = at + i
            f.seek(pos)
            head = f.read(HEADER_BYTES)
            try:
                info = parse_header(head, pos) if len(head) == HEADER_BYTES else None
                if info is not None and info.end <= size and read_body(f, info) is not None:
                    return info
            except BlockError:
                pass
            i = data.find(BLOCK_MAGIC, i + 1)
        at += chunk
    return None


def finite(t: float) -> float | None:
    """A header's time, None when it holds none (NaN)."""
    return t if math.isfinite(t) else None
