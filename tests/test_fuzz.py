"""Fuzzing what rtop reads from others (issue 12): frames, recordings, a hub's frames.

Every target here feeds hostile or broken input to code that must take it calmly:

* the frame decoder (:class:`collectors.wire.FrameDecoder`, and ``read_frame`` /
  ``iter_frames`` beside it): any bytes in any chunks at every limit the code uses;
  frames of any msgpack payload round-trip exactly; what it buffers and what it
  allocates stay bounded;
* the recording reader (:mod:`rtop.run.recording`, what ``rtop replay`` and
  ``rtop report`` read recordings with, and ``recording_span``, ``rtop replay``'s first
  look): any file, real recordings cut short or corrupted, and recordings of hostile
  frames; a truncated recording yields every whole frame before the cut;
* the rank's side of its hub connection (:class:`collectors.connection.HubConnection`):
  whatever a listener on the hub's port sends, before and after the handshake;
* the hub's side of the control channel, where a rank's answers enter
  (:mod:`rtop.hub.answers`, :class:`rtop.hub.control.Actions`): whatever a rank (or
  whoever holds the ingest token) answers an action with, on its connection or
  another's, with the action's id or any other: checked, bounded, never a frame to a
  rank beyond what a rank reads, and the requester always answered.

The only exceptions allowed are the documented ones: ``WireError`` and its subclasses
from the decoder, and from the reader only the ``WireError`` that says a file is not
an rtop recording. Each case must finish within the deadline (an endless loop fails
through pytest-timeout).

How cases are made: hypothesis draws one byte string per case and a small interpreter
(:class:`Draw`, like a fuzzer's data provider) turns it into frames, payloads, chunk
boundaries, edits. Hypothesis' own composite strategies cost about 2 ms of drawing per
case here, 20 s per 10,000 before the code under test runs; a byte string costs
0.3 ms, and hypothesis still searches, mutates and shrinks it (a shorter string is a
smaller case). The interpreter favours what a hostile peer likes: the edges of every
limit, non-finite floats, markup and escape sequences, and repetition.

Case counts come from ``HYPOTHESIS_PROFILE``: ``ci`` (the default, ``make test``: 10,000
per target, shared among that target's properties), ``full`` (``make reliability``'s
bad-input suite: 10,000 per property), ``fuzz`` (``make fuzz``: 1,000,000 per property)
or ``dev`` (300 per property, to iterate). Every failing case ever found is kept as an
``@example``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import itertools
import logging
import math
import os
import select
import signal
import socket
import struct
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from collectors import auth, wire
from collectors.config import ProbeConfig
from collectors.connection import ConnState, HubConnection
from collectors.identity import detect
from rtop.report import build_report
from rtop.run.recording import ReadResult, is_secret_key, read, replay
from rtop.run.state import RunState
from rtop.tui.source import recording_span

# ---- profiles -------------------------------------------------------------------------

#: cases by ``HYPOTHESIS_PROFILE``: per target for ``ci``, per property for the others
PROFILES = {"ci": 10_000, "full": 10_000, "fuzz": 1_000_000, "dev": 300}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE={PROFILE!r}: tests/test_fuzz.py knows "
                            f"{', '.join(PROFILES)}")
EXAMPLES = PROFILES[PROFILE]
#: the targets and how many properties each has here (checked by
#: test_every_target_gets_its_cases): under ``ci`` a property gets its share of
#: EXAMPLES, so that each target still gets EXAMPLES cases
PROPERTIES = {"decoder": 3, "reader": 6, "connection": 2, "results": 2}
_declared: dict[str, int] = dict.fromkeys(PROPERTIES, 0)
#: per case: far above what any case takes (a few ms), far below a hang
DEADLINE = timedelta(seconds=2)
#: CPU seconds after which a case that still runs is a hang (hypothesis' deadline only
#: judges a case once it returns; one that never does is stopped by this, and one
#: blocked without spinning by pytest-timeout)
HANG_CPU_S = 10.0


class CaseHung(AssertionError):
    """A case spun for HANG_CPU_S seconds of CPU."""


def no_hang(test: Callable[..., None]) -> Callable[..., None]:
    """Fail each case of TEST that spins for HANG_CPU_S of CPU time (SIGVTALRM: not
    pytest-timeout's SIGALRM)."""
    def fire(_signum: int, _frame: Any) -> None:
        raise CaseHung(f"a case ran {HANG_CPU_S:.0f} s of CPU without returning: a hang")

    @functools.wraps(test)
    def guarded(*args: Any, **kwargs: Any) -> None:
        old = signal.signal(signal.SIGVTALRM, fire)
        signal.setitimer(signal.ITIMER_VIRTUAL, HANG_CPU_S)
        try:
            test(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            signal.signal(signal.SIGVTALRM, old)

    return guarded


def cases(target: str) -> int:
    """How many cases one property of ``target`` runs under this profile."""
    if PROFILE != "ci":
        return EXAMPLES
    return math.ceil(EXAMPLES / PROPERTIES[target])


def fuzz(target: str) -> settings:
    """The settings of one property of ``target``: its case count, a deadline per case."""
    _declared[target] += 1
    return settings(max_examples=cases(target), deadline=DEADLINE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                    print_blob=True)


@pytest.fixture(autouse=True, scope="module")
def _quiet_logs() -> Iterator[None]:
    """A corrupt recording or a bad hub logs a warning; 10,000 of them are noise."""
    loggers = [logging.getLogger(name) for name in ("rtop", "collectors")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    yield
    for lg, level in zip(loggers, levels, strict=True):
        lg.setLevel(level)


# ---- turning hypothesis' bytes into cases ---------------------------------------------

EDGE_INTS = (0, 1, -1, 2, 15, 16, 31, 32, -32, -33, 127, 128, -128, -129, 255, 256,
             1023, 1024, 4095, 4096, 16_384, 65_535, 65_536, 2**20, 2**31 - 1, 2**31,
             -(2**31), 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1)
EDGE_FLOATS = (0.0, -0.0, math.inf, -math.inf, math.nan, 1e308, -1e308, 5e-324, 0.5,
               1e-9, 1e18, 1.7976931348623157e308)
EDGE_TEXT = ("", "0", "rank", "-1", "[/]", "[@click=app.quit]", "[bold]x", "\x1b]0;pwned\x07",
             "\x1b[2J", "\x00", "\r\n", "é", "\U0001d11e", "\u202e", "a" * 300, "token",
             "../../x", "127.0.0.1:1")
#: lengths a hostile peer likes: the edges of every limit
EDGE_COUNTS = (0, 1, 2, 15, 16, 31, 32, 255, 256, 4095, 4096, 4097, 10_000, 16_383, 16_384,
               65_535, 65_536, 2**31, 2**32 - 1)
KNOWN_KINDS = tuple(sorted({
    wire.KIND_HELLO, wire.KIND_CHALLENGE, wire.KIND_AUTH, wire.KIND_WELCOME, wire.KIND_ERROR,
    wire.KIND_BATCH, wire.KIND_PONG, wire.KIND_BYE, wire.KIND_PING, wire.KIND_CONTROL,
    "subscribe", wire.KIND_SNAPSHOT, wire.KIND_REQUEST, wire.KIND_RUN,
    "clock", "offset", "conn", "finding"}))
#: field names the application reads, so that hostile payloads reach its code
FIELDS = ("rank", "group", "world_size", "local_rank", "node", "hostname", "job", "attempt",
          "run_id", "identity", "clock", "collector", "t_hub", "t_rank", "t_wall", "seq",
          "offset_s", "rtt_s", "event", "steps", "gpu", "host", "mem", "hb", "ckpt", "meta",
          "counters", "dropped", "records", "started", "hub", "version", "kind", "ranks",
          "command", "code", "message", "nonce", "proof", "role", "summary", "evidence")
#: the limits the code reads with: before a hub proved itself, before a peer
#: authenticated, a rank after the welcome, and the largest
LIMITS = (wire.UNPROVEN_HUB_FRAME_BYTES, wire.PREAUTH_FRAME_BYTES, wire.RANK_FRAME_BYTES,
          wire.MAX_FRAME_BYTES)
#: msgpack headers announcing a count: (first byte, struct format of the count)
#: the most bytes repetition grows a soup to
SOUP_BYTES = 1 << 16
_COUNTED = ((b"\xdc", ">H"), (b"\xdd", ">I"), (b"\xde", ">H"), (b"\xdf", ">I"),
            (b"\xd9", ">B"), (b"\xda", ">H"), (b"\xdb", ">I"), (b"\xc4", ">B"),
            (b"\xc5", ">H"), (b"\xc6", ">I"), (b"\xc7", ">B"), (b"\xc8", ">H"),
            (b"\xc9", ">I"))
_CONTAINERS = _COUNTED[:4]


class Draw:
    """Reads choices from one byte string, sequentially; zeros once it runs out (so a
    shorter string is a smaller, simpler case)."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def uint(self, nbytes: int) -> int:
        return int.from_bytes(self.take(nbytes).ljust(nbytes, b"\0"), "big")

    def below(self, n: int) -> int:
        """A number in ``[0, n)``."""
        return self.uint(1 if n <= 256 else 2 if n <= 65_536 else 4) % n if n > 1 else 0

    def pick(self, seq: tuple[Any, ...] | list[Any]) -> Any:
        return seq[self.below(len(seq))]

    def count(self) -> int:
        """A length or count: an edge value, or any 32-bit number."""
        return self.pick(EDGE_COUNTS) if self.below(2) else self.uint(4)

    def text(self) -> str:
        if self.below(3) == 0:
            return str(self.pick(EDGE_TEXT))
        codes = (self.uint(3) % 0x110000 for _ in range(self.below(10)))
        return "".join(chr(c) for c in codes if not 0xD800 <= c <= 0xDFFF)

    def kind(self) -> str:
        return self.text() if self.below(4) == 0 else str(self.pick(KNOWN_KINDS))

    def key(self) -> str:
        return self.text() if self.below(3) == 0 else str(self.pick(FIELDS))

    def value(self, depth: int = 0) -> Any:
        """Any msgpack-able value (containers nest at most 5 deep)."""
        k = self.below(13 if depth < 5 else 10)
        if k == 0:
            return None
        if k == 1:
            return bool(self.below(2))
        if k == 2:
            return self.pick(EDGE_INTS)
        if k == 3:
            return int.from_bytes(self.take(8).ljust(8, b"\0"), "big",
                                  signed=bool(self.below(2)))
        if k == 4:
            return float(struct.unpack(">d", self.take(8).ljust(8, b"\0"))[0])  # any bits
        if k == 5:
            return self.pick(EDGE_FLOATS)
        if k in (6, 7):
            return self.text()
        if k == 8:
            return self.take(self.below(24))
        if k == 9:
            return msgpack.ExtType(self.below(128), self.take(self.below(8)))
        if k == 10:
            return [self.value(depth + 1) for _ in range(self.below(5))]
        if k == 11:  # rows, as batches carry them
            width = self.below(8)
            return [[self.value(depth + 2) for _ in range(width)] for _ in range(self.below(4))]
        return self.payload(depth + 1)

    def payload(self, depth: int = 0) -> dict[str, Any]:
        return {self.key(): self.value(depth) for _ in range(self.below(6))}

    def soup(self) -> bytes:
        """msgpack "token soup": headers announcing hostile counts, single bytes and
        well-formed values, in any order, with repetition."""
        out: list[bytes] = []
        size = 0
        for _ in range(self.below(24)):
            k = self.below(9)
            if k == 0:  # fixarray, fixmap, fixstr
                out.append(bytes([self.pick((0x90, 0x80, 0xA0)) | self.below(32) % 16]))
            elif k in (1, 2):
                out.append(self.counted(_COUNTED))
            elif k == 7:  # deep nesting: a container header, many times over
                head = self.counted(_CONTAINERS)
                out.append(head * min(self.below(2048), max(0, SOUP_BYTES - size) // len(head)))
            elif k == 3:
                out.append(self.take(1 + self.below(4)))
            elif k in (4, 5):
                out.append(msgpack.packb(self.value(2), use_bin_type=True))
            elif k == 6 and out:  # repeat what came last: nesting, floods (to 64 kB)
                room = max(0, SOUP_BYTES - size) // max(1, len(out[-1]))
                out.append(out[-1] * min(self.below(2048), room))
            else:
                out.append(bytes([self.below(256)]))
            size += len(out[-1])
        return b"".join(out)

    def counted(self, codes: tuple[tuple[bytes, str], ...]) -> bytes:
        """A msgpack header (one of CODES) announcing a hostile count."""
        code, fmt = self.pick(codes)
        return code + struct.pack(fmt, self.count() % (1 << (8 * struct.calcsize(fmt))))

    def body(self) -> bytes:
        """A frame body: soup, soup after ``[kind,`` or inside ``[kind, {`` (so that the
        payload's decoding is fuzzed), or a valid one."""
        k = self.below(4)
        if k == 0:
            return self.soup()
        if k == 1:
            return b"\x92" + msgpack.packb(self.kind()) + self.soup()
        if k == 2:
            return b"\x92" + msgpack.packb(self.kind()) + b"\xde\x7f\xff" + self.soup()
        return msgpack.packb([self.kind(), self.payload()], use_bin_type=True)

    def segment(self) -> bytes:
        """A piece of a byte stream: a good frame, a frame of a hostile body, a header
        with any magic, version and length, or garbage."""
        k = self.below(5)
        if k == 0:
            return wire.encode(self.kind(), self.payload())
        if k == 1:
            return frame_of(self.body())
        if k == 2:
            body = self.body()
            return frame_of(body, length=max(0, len(body) + self.below(9) - 4))
        if k == 3:
            magic = wire.MAGIC if self.below(2) else self.take(2).ljust(2, b"\0")
            version = wire.VERSION if self.below(2) else self.below(256)
            return frame_of(self.take(self.below(40)), magic, version, self.count())
        return self.take(self.below(40))

    def stream(self) -> bytes:
        return b"".join(self.segment() for _ in range(self.below(5)))

    def points(self) -> tuple[int, ...]:
        return tuple(self.uint(2) for _ in range(self.below(9)))


def frame_of(body: bytes, magic: bytes = wire.MAGIC, version: int = wire.VERSION,
             length: int | None = None) -> bytes:
    """A frame header (any fields) and BODY."""
    return wire.HEADER.pack(magic, version, len(body) if length is None else length) + body


def chunks(data: bytes, points: tuple[int, ...]) -> list[bytes]:
    """DATA split at POINTS (taken modulo its length): chunks that join back to it."""
    marks = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(marks)] or [b""]


def repack(frame: wire.Frame) -> bytes:
    """The body that encodes FRAME again (equal bytes = an exact round trip, NaN too)."""
    return msgpack.packb([frame.kind, frame.payload], use_bin_type=True)


def bytes_for(max_size: int) -> st.SearchStrategy[Draw]:
    return st.binary(max_size=max_size).map(Draw)


# ---- the frame decoder ---------------------------------------------------------------


@dataclass(frozen=True)
class RoundTrip:
    frames: tuple[tuple[str, dict[str, Any]], ...]
    points: tuple[int, ...]


def round_trip_case(d: Draw) -> RoundTrip:
    return RoundTrip(tuple((d.kind(), d.payload()) for _ in range(1 + d.below(3))),
                     d.points())


@fuzz("decoder")
@given(bytes_for(512).map(round_trip_case))
@example(RoundTrip((("x", {"f": math.nan, "e": msgpack.ExtType(0, b""), "b": b"",
                           "i": 2**64 - 1, "n": -(2**63)}),), ()))
@no_hang
def test_frames_round_trip_in_any_chunks(case: RoundTrip) -> None:
    """Frames of any msgpack payload, fed in any chunks, come back exactly, each with
    its exact bytes; the stream reader agrees."""
    encoded = [wire.encode(kind, payload) for kind, payload in case.frames]
    data = b"".join(encoded)
    dec = wire.FrameDecoder()
    got: list[tuple[bytes, wire.Frame]] = []
    for chunk in chunks(data, case.points):
        got += dec.feed_raw(chunk)
    assert [raw for raw, _ in got] == encoded
    assert [repack(f) for _, f in got] \
        == [msgpack.packb([k, p], use_bin_type=True) for k, p in case.frames]
    assert dec.pending == 0
    streamed = list(wire.iter_frames(io.BytesIO(data)))
    assert [repack(f) for f in streamed] == [repack(f) for _, f in got]


@dataclass(frozen=True)
class Stream:
    data: bytes
    points: tuple[int, ...]
    limit: int


def stream_case(d: Draw) -> Stream:
    return Stream(d.stream(), d.points(), d.pick(LIMITS))


@fuzz("decoder")
@given(bytes_for(1024).map(stream_case))
@example(Stream(b"RT\x01\x00\x00\x00\x05\x92\xa1k\x81\xa1", (), wire.PREAUTH_FRAME_BYTES))
@example(Stream(b"RT\x01\xff\xff\xff\xff", (3,), wire.UNPROVEN_HUB_FRAME_BYTES))
@example(Stream(b"RT\x02\x00\x00\x00\x00", (), wire.MAX_FRAME_BYTES))
@example(Stream(b"GET / HTTP/1.1\r\n\r\n", (1, 2, 3), wire.PREAUTH_FRAME_BYTES))
@no_hang
def test_decoder_takes_any_bytes_in_any_chunks(case: Stream) -> None:
    """Any bytes, in any chunks, at every limit: whole frames or a WireError, the same
    whatever the chunking and what ``iter_frames`` says; the buffer stays bounded."""
    data, limit = case.data, case.limit
    whole = wire.FrameDecoder(limit)
    try:
        expected, error = whole.feed_raw(data), None
    except wire.WireError as exc:
        expected, error = exc.partial, type(exc)
    # in chunks: the same frames before the same error
    dec = wire.FrameDecoder(limit)
    got: list[tuple[bytes, wire.Frame]] = []
    chunk_error = None
    for chunk in chunks(data, case.points):
        try:
            got += dec.feed_raw(chunk)
        except wire.WireError as exc:
            got += exc.partial
            chunk_error = type(exc)
            break
        assert dec.pending < wire.HEADER_BYTES + limit, "the decoder buffers past its limit"
    assert chunk_error is error
    assert [raw for raw, _ in got] == [raw for raw, _ in expected]
    consumed = sum(len(raw) for raw, _ in got)
    assert data[:consumed] == b"".join(raw for raw, _ in got)
    for raw, frame in got:
        assert isinstance(frame.kind, str) and isinstance(frame.payload, dict)
        assert len(raw) - wire.HEADER_BYTES <= limit
    # the blocking stream reader: the same frames, then the same error, or a
    # TruncatedStream exactly when the decoder still holds part of a frame
    streamed: list[bytes] = []
    stream_error = None
    try:
        for frame in wire.iter_frames(io.BytesIO(data), limit):
            streamed.append(repack(frame))
    except wire.WireError as exc:
        stream_error = type(exc)
    assert streamed == [repack(f) for _, f in expected]
    if stream_error is wire.TruncatedStream:
        assert error is None and whole.pending > 0
    else:
        assert stream_error is error
        assert error is not None or whole.pending == 0


#: what decoding may allocate: Python objects are bigger than their msgpack bytes (an
#: empty map is 1 byte and a 64-byte dict), so a generous multiple of the input, plus
#: a constant; a decoder that allocates for what a body claims, not for what it holds,
#: breaks it
MEMORY_PER_BYTE = 128
MEMORY_SLACK = 1 << 20


def nested_arrays(limit: int) -> bytes:
    """A frame of ``limit`` bytes: ``[kind, {"a": [[[...`` where each array claims as many
    elements as the limit allows and holds none (34 MB for 4 kB, 82 MB for 16 kB, before
    the fix of what this fuzzer found)."""
    head = b"\x92\xa1k\x81\xa1a"
    level = b"\xdc" + struct.pack(">H", min(limit, 65_535))
    return frame_of(head + level * ((limit - len(head)) // len(level)))


@fuzz("decoder")
@given(bytes_for(1024).map(lambda d: Stream(d.segment(), (), d.pick(LIMITS))))
@example(Stream(b"RT\x01\x00\x00\x00\x03\x91\x91\x90", (), wire.PREAUTH_FRAME_BYTES))
# found by this fuzzer (shrunk): 1.6 MB for 2.3 kB before collectors/wire.py checked
# what a body claims against what it holds
@example(Stream(frame_of(b"\xdc\x01\x00" * 768), (), wire.UNPROVEN_HUB_FRAME_BYTES))
@example(Stream(nested_arrays(wire.UNPROVEN_HUB_FRAME_BYTES), (),
                wire.UNPROVEN_HUB_FRAME_BYTES))
@example(Stream(nested_arrays(wire.PREAUTH_FRAME_BYTES), (), wire.PREAUTH_FRAME_BYTES))
@example(Stream(nested_arrays(1 << 20), (), wire.MAX_FRAME_BYTES))
@no_hang
def test_decoding_allocates_in_proportion_to_the_input(case: Stream) -> None:
    """Decoding N bytes never allocates more than a small multiple of N (tracemalloc,
    on for the decoding only): a hostile peer cannot make a small frame cost a lot of
    memory."""
    dec = wire.FrameDecoder(case.limit)
    tracemalloc.start()
    try:
        with contextlib.suppress(wire.WireError):
            dec.feed(case.data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= MEMORY_PER_BYTE * len(case.data) + MEMORY_SLACK, \
        f"{len(case.data)} bytes made the decoder allocate {peak:,} bytes"


# ---- the recording reader ------------------------------------------------------------

FIXTURE = Path(__file__).parent / "fixtures" / "starved.rtop"


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """One file that each case overwrites, in memory where there is a tmpfs (on this
    project's ext4 ``/tmp`` each truncating open costs 1.6 ms, on tmpfs 11 µs)."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="rtop-fuzz-", dir=shm) as d:
        yield Path(d) / "run.rtop"


def _real_frames() -> tuple[bytes, ...]:
    """The first frames of a real recording as recorded: its run header, then up to four
    of each kind (clock, hello, offset, batch, finding, bye) of a real 3-rank job."""
    with FIXTURE.open("rb") as f:
        frames = list(wire.iter_frames(f))
    picked = frames[:1]
    seen: dict[str, int] = {}
    for frame in frames[1:]:
        if seen.get(frame.kind, 0) < 4:
            seen[frame.kind] = seen.get(frame.kind, 0) + 1
            picked.append(frame)
    return tuple(wire.encode(f.kind, f.payload) for f in picked)


REAL = _real_frames()
HEADER_FRAME, REAL_FRAMES = REAL[0], REAL[1:]


def mutated(d: Draw, raw: bytes) -> bytes:
    """A real frame with one to three of its fields (at any depth) replaced by any
    value, deleted, or joined by a new one: what a hostile recorder or hub writes."""
    frame = wire.decode_body(raw[wire.HEADER_BYTES:])
    payload = copy.deepcopy(frame.payload)
    for _ in range(1 + d.below(3)):
        spots: list[tuple[Any, Any]] = []
        _walk(payload, spots)
        op = d.below(4)
        if not spots or op == 3:
            payload[d.key()] = d.value()
            continue
        node, k = d.pick(spots)
        if op == 2 and isinstance(node, dict):
            del node[k]
        else:
            node[k] = d.value(2)
    return wire.encode(d.kind() if d.below(16) == 0 else frame.kind, payload)


def _walk(node: Any, spots: list[tuple[Any, Any]]) -> None:
    """Every (container, key) under NODE, depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        spots.append((node, k))
        if isinstance(v, dict | list):
            _walk(v, spots)


def recorded_frame(d: Draw) -> bytes:
    """A frame a recording may hold: a real one, a real one with hostile fields, or
    any frame."""
    k = d.below(4)
    if k == 0:
        return d.pick(REAL_FRAMES)
    if k in (1, 2):
        return mutated(d, d.pick(REAL_FRAMES))
    return wire.encode(d.kind(), d.payload())


def _small_state() -> RunState:
    """A RunState with short windows: the same code, cheaper to make 10,000 times."""
    return RunState(window_steps=16, window_samples=8)


def public(obj: Any) -> Any:
    """OBJ without secret-named fields at any depth: what the reader hands on of a
    frame (it drops the token older recordings hold; see ``recording.scrub``)."""
    if isinstance(obj, dict):
        return {k: public(v) for k, v in obj.items() if not is_secret_key(k)}
    if isinstance(obj, list):
        return [public(v) for v in obj]
    return obj


def seen_as(raw: bytes) -> bytes:
    """How a whole recorded frame should come out of the reader."""
    frame = wire.decode_body(raw[wire.HEADER_BYTES:])
    return repack(wire.Frame(frame.kind, public(frame.payload)))


def read_all(path: Path) -> tuple[list[bytes], ReadResult, type[Exception] | None]:
    """What ``read`` yields (as :func:`seen_as` would), its result, and what it raised
    (None, or the WireError of a file that is not a recording: nothing else may)."""
    res = ReadResult()
    out: list[bytes] = []
    try:
        for t_hub, frame in read(path, res):
            assert isinstance(t_hub, float)
            out.append(repack(wire.Frame(frame.kind, public(frame.payload))))
    except wire.WireError as exc:
        return out, res, type(exc)
    return out, res, None


def check_span(path: Path) -> None:
    """``recording_span`` (``rtop replay``'s first look) answers floats or None."""
    start, end = recording_span(path)
    assert start is None or isinstance(start, float)
    assert end is None or isinstance(end, float)


@fuzz("reader")
@given(bytes_for(1024).map(lambda d: HEADER_FRAME + d.stream()))
@example(HEADER_FRAME + frame_of(b"\x92\xa5clock" + b"\xdc\x10\x00" * 3000))
# found by this fuzzer: a header claiming a 16 MB body made read_frame's read(n)
# allocate 16 MB for a 108-byte file (wire now reads in growing chunks)
@example(HEADER_FRAME + b"RT\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00")
@no_hang
def test_reading_a_recording_allocates_in_proportion_to_the_file(scratch: Path,
                                                                 blob: bytes) -> None:
    """Opening a recording (``rtop replay``'s first look, then its reader) never
    allocates more than a small multiple of the file: a recording shared by someone
    else cannot exhaust memory."""
    scratch.write_bytes(blob)
    tracemalloc.start()
    try:
        recording_span(scratch)
        with contextlib.suppress(wire.WireError):
            for _ in read(scratch):
                pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= MEMORY_PER_BYTE * len(blob) + MEMORY_SLACK, \
        f"a {len(blob)}-byte recording made its reader allocate {peak:,} bytes"


@dataclass(frozen=True)
class Cut:
    frames: tuple[bytes, ...]  # after the run header
    cut: int


@fuzz("reader")
@given(bytes_for(512).map(lambda d: Cut(
    tuple(recorded_frame(d) for _ in range(d.below(9))), d.uint(3))))
@example(Cut(REAL_FRAMES[:3], 7))
@no_hang
def test_a_truncated_recording_yields_every_whole_frame_before_the_cut(
        scratch: Path, case: Cut) -> None:
    """A recording cut anywhere (a hub killed mid-write, a copy cut short) reads up to
    its last whole frame: every frame before the cut, nothing after, and a warning."""
    frames = [HEADER_FRAME, *case.frames]
    blob = b"".join(frames)
    cut = case.cut % (len(blob) + 1)
    scratch.write_bytes(blob[:cut])
    got, res, error = read_all(scratch)
    assert error is None
    ends = list(itertools.accumulate(len(f) for f in frames))
    whole = [seen_as(f) for f, end in zip(frames, ends, strict=True) if end <= cut]
    assert got == whole
    assert res.frames == len(whole)
    assert res.truncated == (cut not in (0, *ends))
    assert bool(res.warnings) == res.truncated
    replay(scratch, _small_state())
    check_span(scratch)


@dataclass(frozen=True)
class Damage:
    frames: tuple[bytes, ...]  # after the run header
    edits: tuple[tuple[int, int, bytes], ...]  # (0 overwrite / 1 insert / 2 delete, at, bytes)


def damage_case(d: Draw) -> Damage:
    frames = tuple(d.pick(REAL_FRAMES) for _ in range(d.below(9)))
    edits = tuple((d.below(3), d.uint(3), d.take(1 + d.below(16)) or b"\0")
                  for _ in range(1 + d.below(4)))
    return Damage(frames, edits)


def damaged(blob: bytes, edits: tuple[tuple[int, int, bytes], ...]) -> tuple[bytes, int]:
    """BLOB with EDITS applied, and the first position any of them touched."""
    out = bytearray(blob)
    first = len(blob)
    for op, at, chunk in edits:
        at %= len(out) + 1
        first = min(first, at)
        if op == 0:
            out[at:at + len(chunk)] = chunk
        elif op == 1:
            out[at:at] = chunk
        else:
            del out[at:at + len(chunk)]
    return bytes(out), first


@fuzz("reader")
@given(bytes_for(256).map(damage_case))
@example(Damage(REAL_FRAMES[:2], ((0, 0, b"X"),)))
@example(Damage(REAL_FRAMES[:2], ((0, 3, b"\x7f\xff\xff\xff"),)))
@no_hang
def test_a_corrupted_recording_reads_the_frames_before_the_damage(
        scratch: Path, case: Damage) -> None:
    """Bytes overwritten, inserted or deleted anywhere: the reader yields the frames
    before the damage unchanged and stops calmly; only a recording whose first frame
    is broken is refused (the WireError "not an rtop recording"). Replaying it into a
    RunState raises nothing at all."""
    frames = [HEADER_FRAME, *case.frames]
    blob, first = damaged(b"".join(frames), case.edits)
    scratch.write_bytes(blob)
    got, _res, error = read_all(scratch)
    ends = itertools.accumulate(len(f) for f in frames)
    intact = [seen_as(f) for f, end in zip(frames, ends, strict=True) if end <= first]
    assert got[:len(intact)] == intact
    if error is not None:
        assert not intact, "a recording with a whole first frame was refused"
    else:
        replay(scratch, _small_state())
    check_span(scratch)


@fuzz("reader")
@given(bytes_for(1024).map(lambda d: d.stream() if d.below(2) else d.take(d.left)))
@example(b"")
@example(b"RT\x01\x00\x00\x00\x02\x92\xa3run")
@example(frame_of(msgpack.packb(["run", {"hub": {"started": math.inf}}])))
@example(frame_of(msgpack.packb(["run", {"hub": {"started": 1e308}}]))
         + frame_of(msgpack.packb(["clock", {"t_hub": math.nan}])))
@no_hang
def test_any_file_is_read_or_refused_as_not_a_recording(scratch: Path, data: bytes) -> None:
    """Any file: frames, or the WireError that says it is not an rtop recording, and
    never another exception, whether read, replayed or spanned."""
    scratch.write_bytes(data)
    _got, _res, error = read_all(scratch)
    if error is None:
        replay(scratch, _small_state())
    check_span(scratch)


@fuzz("reader")
@given(bytes_for(1024).map(lambda d: tuple(recorded_frame(d) for _ in range(d.below(13)))))
@example(REAL_FRAMES)
@no_hang
def test_a_recording_of_hostile_frames_replays_without_error(
        scratch: Path, frames: tuple[bytes, ...]) -> None:
    """Whole frames with hostile content (a recording made by someone else): real
    frames with fields replaced, deleted or added, and any frames. ``rtop replay``'s
    reader and state take them all: a broken frame is skipped and counted, never
    raised, and the state still gives the UI its view."""
    scratch.write_bytes(HEADER_FRAME + b"".join(frames))
    state, res = replay(scratch, _small_state())
    assert res.frames == 1 + len(frames) and not res.truncated
    state.view()


@fuzz("reader")
@given(bytes_for(1024).map(lambda d: tuple(recorded_frame(d) for _ in range(d.below(13)))))
@example((*REAL_FRAMES, frame_of(msgpack.packb(["clock", {"t_hub": math.inf}]))))
@example((frame_of(msgpack.packb(["clock", {"t_hub": -1e308}])), *REAL_FRAMES))
@no_hang
def test_rtop_report_takes_a_recording_of_hostile_frames(
        scratch: Path, frames: tuple[bytes, ...]) -> None:
    """``rtop report``'s whole path (reader, state, diagnosis, report) over a recording
    of hostile frames: a report, never an exception."""
    scratch.write_bytes(HEADER_FRAME + b"".join(frames))
    report = build_report(scratch)
    assert isinstance(report["findings"], list)


# ---- the rank's side of the hub connection ---------------------------------------------

TOKEN = "fuzz-token"


class FakeHub:
    """A listener on the hub's port, driven by the test: one connection per case."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(5)
        self.port = self.srv.getsockname()[1]
        self.identity = detect()
        self.key = auth.key_for(TOKEN, "ingest")

    def connect(self, on_control: Any) -> tuple[HubConnection, socket.socket, wire.Frame]:
        """A rank's HubConnection once it said hello: it, the hub's socket, the hello."""
        cfg = ProbeConfig(hub=f"127.0.0.1:{self.port}", token=TOKEN,
                          backoff_initial_s=0.01, backoff_max_s=0.05)
        conn = HubConnection(cfg, self.identity, on_control=on_control,
                             resolve=lambda _spawn: ("127.0.0.1", self.port, TOKEN))
        conn.pump(time.monotonic())
        assert conn.state is ConnState.HELLO
        peer, _ = self.srv.accept()
        peer.settimeout(5)
        [hello] = recv_frames(peer, wire.FrameDecoder(), 1)
        assert hello.kind == wire.KIND_HELLO
        return conn, peer, hello

    def prove(self, conn: HubConnection, peer: socket.socket, hello: wire.Frame) -> None:
        """The hub's side of the handshake, done right: the rank welcomed (UP)."""
        assert self.key is not None
        nonce = auth.new_nonce()
        peer.sendall(wire.encode(wire.KIND_CHALLENGE, {"nonce": nonce}))
        pump_until(conn, lambda: conn.state is not ConnState.HELLO)
        [proof] = recv_frames(peer, wire.FrameDecoder(), 1)
        assert proof.kind == wire.KIND_AUTH
        peer.sendall(wire.encode(wire.KIND_WELCOME, {
            "t_hub": 1.0,
            "proof": auth.hub_proof(self.key, "rank", hello.payload["nonce"], nonce)}))
        pump_until(conn, lambda: conn.state is ConnState.UP)


def pump_until(conn: HubConnection, cond: Any) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, f"stuck in {conn.state}"
        conn.pump(time.monotonic())


def recv_frames(peer: socket.socket, dec: wire.FrameDecoder, want: int) -> list[wire.Frame]:
    """Read until WANT frames arrived from the rank."""
    frames: list[wire.Frame] = []
    while len(frames) < want:
        frames += dec.feed(peer.recv(65536))
    return frames


def send_all(conn: HubConnection, peer: socket.socket, data: bytes) -> None:
    """Send DATA to the rank, pumping it meanwhile, until it has read it all or closed
    the connection."""
    peer.setblocking(False)
    view = memoryview(data)
    deadline = time.monotonic() + 5
    while view and conn.socket is not None:
        assert time.monotonic() < deadline, "the rank stopped reading"
        try:
            view = view[peer.send(view):]
        except BlockingIOError:
            pass
        except OSError:  # the rank closed the connection
            return
        conn.pump(time.monotonic())
    while conn.socket is not None and select.select([conn.socket], [], [], 0)[0]:
        conn.pump(time.monotonic())  # what is still in flight


@pytest.fixture(scope="module")
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub()
    yield hub
    hub.srv.close()


def hub_frame(d: Draw) -> bytes:
    """What a hub (or whoever listens on its port) may send a rank."""
    if d.below(2):
        kind = d.pick((wire.KIND_PING, wire.KIND_CONTROL, wire.KIND_ERROR, wire.KIND_WELCOME,
                       wire.KIND_CHALLENGE, wire.KIND_SNAPSHOT)) if d.below(2) else d.kind()
        return wire.encode(kind, d.payload())
    return d.segment()


def hub_bytes(d: Draw) -> bytes:
    return b"".join(hub_frame(d) for _ in range(d.below(7)))


@fuzz("connection")
@given(bytes_for(1024).map(hub_bytes))
@example(wire.encode(wire.KIND_CHALLENGE, {"nonce": b"n" * 16, "proof": b"p" * 32}))
@example(wire.encode(wire.KIND_WELCOME, {}) + wire.encode(wire.KIND_CONTROL, {}))
@example(nested_arrays(wire.UNPROVEN_HUB_FRAME_BYTES))
@no_hang
def test_a_hub_that_has_not_proved_itself_gets_nothing(fake_hub: FakeHub, data: bytes) -> None:
    """Whatever a listener on the hub's port answers a rank's hello with, short of the
    proof that it holds the token: no exception on the sender thread, never welcomed,
    no control frame handed on, and nothing sent after the hello but the rank's own
    proof (the peer proves first: collectors.auth)."""
    controls: list[wire.Frame] = []
    conn, peer, _hello = fake_hub.connect(controls.append)
    try:
        send_all(conn, peer, data)
        assert conn.state in (ConnState.HELLO, ConnState.AUTH, ConnState.DOWN)
        assert not controls
        sent = b""
        with contextlib.suppress(BlockingIOError, ConnectionResetError):
            sent = peer.recv(65536)
        assert all(f.kind == wire.KIND_AUTH for f in wire.FrameDecoder().feed(sent)), \
            "the rank spoke to an unproven hub"
    finally:
        conn.close()
        peer.close()


@fuzz("connection")
@given(bytes_for(1024).map(hub_bytes))
@example(wire.encode(wire.KIND_PING, {"t_hub": math.nan, "seq": [{}]}))
@example(wire.encode(wire.KIND_CONTROL, {"command": {"x": []}}))
@example(wire.encode(wire.KIND_WELCOME, {"t_hub": "x"}) + wire.encode(wire.KIND_ERROR, {}))
@no_hang
def test_a_proven_hub_s_frames_are_handled_calmly(fake_hub: FakeHub, data: bytes) -> None:
    """After a real handshake, whatever the hub sends: no exception on the sender
    thread, control frames (and only they) handed on, the connection up or closed."""
    controls: list[wire.Frame] = []
    conn, peer, hello = fake_hub.connect(controls.append)
    try:
        fake_hub.prove(conn, peer, hello)
        send_all(conn, peer, data)
        assert conn.state in (ConnState.UP, ConnState.DOWN)
        assert all(c.kind == wire.KIND_CONTROL for c in controls)
    finally:
        conn.close()
        peer.close()


# ---- the hub's side of the control channel: a rank's answers ---------------------------

RESULT_STATES = ("armed", "ready", "late", "done", "error")


def result_payload(d: Draw) -> dict[str, Any]:
    """What a rank (or a holder of the ingest token) may answer an action with."""
    p = d.payload()
    if d.below(4):
        p["state"] = d.pick(RESULT_STATES)
    if d.below(2):
        p[d.pick(("step", "error", "links", "threads", "top_ops", "trace", "peer"))] = \
            d.value() if d.below(2) else d.text() * d.below(4096)
    return p


@fuzz("results")
@given(bytes_for(2048).map(lambda d: (d.pick(("stacks", "profile", "probe")),
                                       result_payload(d))))
@example(("probe", {"state": "late", "step": "9" * 100_000}))
@example(("stacks", {"state": "done", "threads": [[[[[[[["x"]]]]]]]]}))
@no_hang
def test_a_rank_s_answer_is_typed_and_bounded(case: tuple[str, dict[str, Any]]) -> None:
    """:func:`rtop.hub.answers.clean_result` on any payload: a ``(state, body)`` of
    known shape, strings cut, numbers finite, msgpack-encodable; else ``BadAnswer``."""
    from rtop.hub.answers import MAX_ERROR, MAX_TEXT, STATES, BadAnswer, clean_result

    action, payload = case
    try:
        state, body = clean_result(action, payload)
    except BadAnswer:
        return
    assert state in STATES and isinstance(body, dict)
    msgpack.packb(body, use_bin_type=True)

    def walk(v: Any) -> None:
        if isinstance(v, str):
            assert len(v) <= MAX_TEXT
        elif isinstance(v, float):
            assert math.isfinite(v)
        elif isinstance(v, list):
            for e in v:
                walk(e)
        elif isinstance(v, dict):
            for e in v.values():
                walk(e)
        else:
            assert v is None or isinstance(v, (bool, int))

    walk(body)
    if state == "error":
        assert isinstance(body["error"], str) and len(body["error"]) <= MAX_ERROR
    if state == "late":
        assert body["step"] is None or type(body["step"]) is int


class _Peer:
    """A connection the hub's actions talk to, in memory: what it is sent is kept."""

    def __init__(self) -> None:
        self.closing = False
        self.rank: Any = None
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, kind: str, payload: dict[str, Any]) -> None:
        data = wire.encode(kind, payload)  # raises as the hub's own send would
        self.sent.append((kind, wire.decode_body(data[wire.HEADER_BYTES:]).payload))

    def close(self) -> None:
        self.closing = True


@dataclass(frozen=True)
class ActionCase:
    action: str
    answers: tuple[tuple[int, bool, dict[str, Any], int], ...]  # rank, own id, payload, size


def action_case(d: Draw) -> ActionCase:
    return ActionCase(d.pick(("stacks", "profile", "probe")), tuple(
        (d.below(2), bool(d.below(4)), result_payload(d),
         d.pick((0, 1000, 300_000, 40_000_000))) for _ in range(1 + d.below(5))))


@pytest.fixture(scope="module")
def action_hub() -> Any:
    """A real hub (not listening: its actions are driven in memory) with two ranks."""
    from rtop.hub.server import Hub, HubConfig

    hub = Hub(HubConfig(record="", spool_dir=""))
    for r in (0, 1):
        hub.monitor.apply(wire.Frame(wire.KIND_HELLO, {"identity": {
            "rank": r, "local_rank": r, "world_size": 2, "hostname": f"n{r}", "ip": "",
            "pid": 10 + r, "attempt": 0, "job": "j", "group": "g", "node_id": "",
            "source": "env"}}), time.time())
    return hub


@fuzz("results")
@given(bytes_for(2048).map(action_case))
@example(ActionCase("probe", ((1, True, {"state": "late", "step": "9" * 1_000_000}, 0),)))
@example(ActionCase("stacks", ((0, True, {"state": "done", "threads": "x" * 70_000}, 0),)))
@no_hang
def test_the_hub_takes_any_answer_calmly(action_hub: Any, case: ActionCase) -> None:
    """The hub's real :class:`~rtop.hub.control.Actions` over two ranks and a requester
    (in memory): whatever the ranks answer, with the action's id or another, of any
    size: no exception; every frame to a rank within what a rank reads
    (``wire.RANK_FRAME_BYTES``); the requester answered once, by the deadline at the
    latest, its answer a frame."""
    hub = action_hub
    ranks = {r: _Peer() for r in (0, 1)}
    for r, peer in ranks.items():
        peer.rank = hub.state.rank_state(r)
        hub._rank_conns[("g", r)] = peer
    requester = _Peer()
    hub.actions.request(requester, {"id": "c1", "action": case.action, "timeout_s": 30})
    if not requester.sent or requester.sent[0][1].get("state") != "started":
        return  # refused (a probe's plan, say): nothing more to answer
    sent = {r: [p for k, p in peer.sent if k == wire.KIND_CONTROL] for r, peer in ranks.items()}
    for rank, own, payload, size in case.answers:
        if sent[rank]:
            payload = {**payload, "id": sent[rank][0]["id"] if own else payload.get("id")}
        hub.actions.result(ranks[rank], rank, payload, size=size)
    for act in list(hub.actions.running.values()):
        act.deadline = 0.0
    hub.actions.tick(time.monotonic())
    assert not hub.actions.running
    for peer in ranks.values():
        for kind, payload in peer.sent:
            assert len(wire.encode(kind, payload)) <= wire.RANK_FRAME_BYTES
    done = [p for k, p in requester.sent if k == wire.KIND_RESULT and p.get("state") == "done"]
    assert len(done) == 1


def test_every_target_gets_its_cases() -> None:
    """Each target's properties are as many as PROPERTIES says, so that under ``ci``
    their shares add up to at least 10,000 cases per target."""
    assert _declared == PROPERTIES
    if PROFILE == "ci":
        assert all(cases(t) * n >= EXAMPLES for t, n in PROPERTIES.items())
