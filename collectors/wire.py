"""rtop's wire format: versioned, length-prefixed msgpack frames. No pickle, ever.

One format for everything: the same bytes travel over TCP between ranks, hub and
viewers, are appended to a run's recording, and are replayed from it.

A frame is a 7-byte header followed by a msgpack body::

    b"RT"   version (1 byte)   body length (4 bytes, big-endian)   body

and the body is the msgpack array ``[kind, payload]`` where ``kind`` is a short string
(see the ``KIND_*`` constants) and ``payload`` a map with string keys. A frame larger
than the reader's limit (at most ``MAX_FRAME_BYTES``), a header without the magic, a
version other than ``VERSION`` or a body that is not ``[str, map]`` is refused with a
:class:`WireError` that says which; the connection that sent it is closed and nothing
else is affected. Bodies are walked first without building anything (a container
must hold what its header claims before msgpack allocates for it) and decoded with
msgpack's ``max_*_len`` limits scaled to its length (or, for the small bodies a
:class:`FrameDecoder` reads, by one unpacker per thread that a body's walk has
shown claims no more than it holds), and the reader's limit is small
until a peer has proved itself: a hub reads
``PREAUTH_FRAME_BYTES`` before a peer has authenticated, a rank or viewer
``UNPROVEN_HUB_FRAME_BYTES`` before the hub has, and a rank ``RANK_FRAME_BYTES`` after.

A connection starts with the handshake of :mod:`collectors.auth` (``hello``,
``challenge``, ``auth``, ``welcome``); no token ever travels. Each role may then send
only its own kinds (``RANK_KINDS``, ``VIEWER_KINDS``, ``CONTROL_KINDS``,
``RELAY_KINDS``).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, Final

import msgpack

MAGIC: Final = b"RT"
VERSION: Final = 1
HEADER: Final = struct.Struct(">2sBI")
HEADER_BYTES: Final = HEADER.size
#: The largest body accepted. A 4,096-rank snapshot is about 2 MB; a rank's batch a few kB.
MAX_FRAME_BYTES: Final = 32 * 1024 * 1024
#: The largest body a hub accepts from a peer that has not authenticated yet: a hello
#: with a full identity is under 1 kB (hostnames of 255 characters included).
PREAUTH_FRAME_BYTES: Final = 16 * 1024
#: The largest body a rank or viewer accepts before the hub has proved it holds the
#: token (a challenge is about 100 bytes, an error a few hundred).
UNPROVEN_HUB_FRAME_BYTES: Final = 4 * 1024
#: The largest body a rank accepts from its hub (welcome, ping, control, error).
RANK_FRAME_BYTES: Final = 64 * 1024

# Handshake (collectors.auth): hello -> challenge -> auth -> welcome, no secret sent
KIND_HELLO: Final = "hello"  # role, nonce; a rank's identity, clock, collector
KIND_CHALLENGE: Final = "challenge"  # hub -> peer: the hub's nonce and its proof
KIND_AUTH: Final = "auth"  # peer -> hub: the peer's proof
KIND_WELCOME: Final = "welcome"  # accepted; carries the hub's clock
KIND_ERROR: Final = "error"  # refused: wrong token, bad frame, forbidden kind, ...
# Rank -> hub
KIND_BATCH: Final = "batch"  # records of the tables in collectors.schema
KIND_PONG: Final = "pong"  # answer to a ping: clock-offset sample
KIND_BYE: Final = "bye"  # clean close, with final counters
KIND_RESULT: Final = "result"  # an action's progress or answer (rank -> hub -> control peer)
# Hub -> rank
KIND_PING: Final = "ping"  # asks for a pong (clock offset refresh)
KIND_CONTROL: Final = "control"  # an action: to a rank, or from a control peer to the hub
#: the batches up to ``seq`` are the hub's (recorded and flushed): the rank forgets them
KIND_ACK: Final = "ack"
# Viewer <-> hub
KIND_SNAPSHOT: Final = "snapshot"
KIND_REQUEST: Final = "request"
# Relay <-> hub (rtop.hub.relay, rtop.hub.relayed): a node's ranks over one connection
#: relay -> hub: the bytes each of its ranks sent, as sent, per stream, and the streams
#: that opened and closed since the last one
KIND_RELAY: Final = "relay"
#: hub -> relay: the bytes for each stream (the hub's frames to that rank), streams to close
KIND_DOWN: Final = "down"
# Recording only
KIND_RUN: Final = "run"  # first frame of a recording: what wrote it and when
KIND_CLOCK: Final = "clock"  # the hub's time, written to a recording every cycle

#: What an authenticated rank may send (hello again: its own, e.g. after a restart).
RANK_KINDS: Final = frozenset({KIND_HELLO, KIND_BATCH, KIND_PONG, KIND_BYE, KIND_RESULT})
#: What an authenticated viewer may send.
VIEWER_KINDS: Final = frozenset({KIND_REQUEST})
#: What an authenticated control peer may send: a viewer's kinds and control frames.
CONTROL_KINDS: Final = VIEWER_KINDS | {KIND_CONTROL}
#: What an authenticated relay may send: its ranks' bytes, and pongs to the hub's pings.
RELAY_KINDS: Final = frozenset({KIND_RELAY, KIND_PONG})


class WireError(ValueError):
    """A frame could not be decoded. The message says what was wrong with it.

    From :meth:`FrameDecoder.feed_raw`, ``partial`` holds the whole frames that came
    before the bad one in the same read.
    """

    partial: list[tuple[bytes, Frame]] = []  # noqa: RUF012 - replaced per instance


class BadMagic(WireError):
    """The bytes do not start with rtop's frame magic (not an rtop peer, or garbage)."""


class UnsupportedVersion(WireError):
    """The frame uses a wire version this side does not speak."""


class FrameTooLarge(WireError):
    """The length prefix announces a body larger than the limit."""


class MalformedFrame(WireError):
    """The body is not a msgpack ``[kind, payload-map]`` array."""


class TruncatedStream(WireError):
    """A stream (a recording being written, or cut short) ends inside a frame."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: its kind and its payload map."""

    kind: str
    payload: dict[str, Any]


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) to ``(host, port)``, brackets removed.

    Raises :class:`ValueError` naming the address when it is not ``host:port`` with a
    port from 0 to 65535. The one parser of hub and rendezvous addresses, collectors'
    and the application's alike.
    """
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    # an IPv6 host without brackets ("::1:9000", as a hub bound to "::1" writes its
    # address) is taken as it always was: the port is after the last colon
    if not sep or not host or "[" in host or "]" in host or not port.isdigit() \
            or int(port) > 65535:
        raise ValueError(f"address {address!r} is not host:port (or [IPv6]:port)")
    return host, int(port)


def encode(kind: str, payload: Mapping[str, Any]) -> bytes:
    """Encode one frame (header and body) ready to be written to a socket or a file.

    Raises :class:`FrameTooLarge` if the body would exceed ``MAX_FRAME_BYTES``.
    """
    body: bytes = msgpack.packb([kind, payload], use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame body of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(MAGIC, VERSION, len(body)) + body


def parse_header(header: bytes, max_bytes: int = MAX_FRAME_BYTES) -> int:
    """Check a frame header and return the body length it announces."""
    magic, version, length = HEADER.unpack(header)
    return _check_header(magic, version, length, max_bytes)


def _check_header(magic: bytes, version: int, length: int, max_bytes: int) -> int:
    """:func:`parse_header` of a header already unpacked."""
    if magic != MAGIC:
        raise BadMagic(f"bad frame magic {magic!r} (expected {MAGIC!r}): not an rtop peer?")
    if version != VERSION:
        raise UnsupportedVersion(
            f"wire version {version} not supported (this side speaks {VERSION})"
        )
    if length > max_bytes:
        raise FrameTooLarge(f"frame announces {length} bytes, limit is {max_bytes}")
    return int(length)


def unpack_limits(max_bytes: int) -> dict[str, int]:
    """msgpack's ``max_*_len`` limits for a body of ``max_bytes`` bytes (decoding uses
    the body's own length, at most the reader's limit): no string, bytes, array, map or
    extension may claim more than the body could hold."""
    return {"max_str_len": max_bytes, "max_bin_len": max_bytes,
            "max_array_len": max_bytes, "max_map_len": max_bytes // 2,
            "max_ext_len": max_bytes}


def _check_complete(body: bytes | memoryview, limits: dict[str, int]) -> None:
    """Walk the body's structure in C without building a thing: it must be one whole
    msgpack object. msgpack preallocates each array and map for the count its header
    claims, so a few bytes of nested headers that claim thousands of elements each
    would cost megabytes before the body is found to hold none; once this walk has
    seen every claimed element present, decoding allocates for what the body holds."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(body), 1), **limits)
    unpacker.feed(body)
    unpacker.skip()
    if unpacker.tell() != len(body):
        raise ValueError(f"{len(body) - unpacker.tell()} bytes after the body's object")


def decode_body(body: bytes | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """Decode a frame body (without its header) with limits for ``max_bytes`` bodies.

    The body is first walked without decoding (:func:`_check_complete`), so what
    decoding allocates is in proportion to the bytes received, whatever they claim.
    """
    if len(body) > max_bytes:
        raise FrameTooLarge(f"frame body of {len(body)} bytes exceeds {max_bytes}")
    limits = unpack_limits(max(len(body), 1))  # nothing in it can claim more than it has
    try:
        _check_complete(body, limits)
        obj = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True,
                              **limits)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedFrame(f"frame body is not valid msgpack: {exc}") from None
    if (
        not isinstance(obj, list)
        or len(obj) != 2
        or not isinstance(obj[0], str)
        or not isinstance(obj[1], dict)
    ):
        raise MalformedFrame("frame body is not a [kind, payload-map] array")
    return Frame(obj[0], obj[1])


#: Bodies at most this long are decoded with a reused unpacker (:func:`_decode_reused`);
#: a longer one (rare: a snapshot, a stack) with a fresh one, as :func:`decode_body`.
REUSE_BYTES: Final = 64 * 1024


class _Reused(threading.local):
    """One unpacker per thread, fed one body at a time (see :func:`_decode_reused`)."""

    unpacker: msgpack.Unpacker | None = None


_reused = _Reused()


def _decode_reused(body: bytes | memoryview, max_bytes: int) -> Frame:
    """:func:`decode_body`, for a body of at most :data:`REUSE_BYTES`, without making
    an unpacker per body (that costs more than decoding a small one).

    The same checks in the same order: the body is walked first (``skip``: every
    element it claims must be there, so decoding allocates in proportion to it) and
    must be one whole object, then decoded. Its limits are :data:`REUSE_BYTES`'s, not
    the body's own: a body whose elements are all there claims no more than it holds,
    so it passes either; anything that goes wrong is decoded again by
    :func:`decode_body`, whose error (or result) is the answer, and the thread's
    unpacker, in an unknown state, is made afresh next time."""
    unpacker = _reused.unpacker
    if unpacker is None:
        unpacker = _reused.unpacker = msgpack.Unpacker(
            raw=False, use_list=True, strict_map_key=True, read_size=4096,
            max_buffer_size=2 * REUSE_BYTES, **unpack_limits(REUSE_BYTES))
    try:
        start = unpacker.tell()
        unpacker.feed(body)
        unpacker.skip()
        whole = unpacker.tell() - start == len(body)
        if whole:
            unpacker.feed(body)
            obj = unpacker.unpack()
    except Exception:  # msgpack raises several unrelated types
        whole = False
    if not whole or type(obj) is not list or len(obj) != 2 or type(obj[0]) is not str \
            or type(obj[1]) is not dict:
        _reused.unpacker = None
        return decode_body(body, max_bytes)
    return Frame(obj[0], obj[1])


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, get whole frames back.

    After a :class:`WireError` the stream cannot be resynchronised; the caller closes
    the connection. ``pending`` tells how many bytes of an incomplete frame are held.
    ``max_bytes``, the largest body accepted, may be changed between feeds (raised
    once the peer has authenticated).
    """

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self.max_bytes = max_bytes

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        """Add received bytes; return the frames they complete (possibly none)."""
        return [frame for _, frame in self.feed_raw(data)]

    def feed_raw(self, data: bytes) -> list[tuple[bytes, Frame]]:
        """Like :meth:`feed`, with each frame's exact bytes (header and body) beside it,
        for a recorder that stores frames as received."""
        buf = self._buf
        src: bytes | bytearray
        if buf:
            buf += data
            src = buf
        else:  # nothing held (the usual case): read ``data`` itself, no copy
            src = data if type(data) is bytes else bytes(data)
        out: list[tuple[bytes, Frame]] = []
        off, n = 0, len(src)
        max_bytes = self.max_bytes
        try:
            while n - off >= HEADER_BYTES:
                magic, version, length = HEADER.unpack_from(src, off)
                length = _check_header(magic, version, length, max_bytes)
                end = off + HEADER_BYTES + length
                if n < end:
                    break
                # a whole ``data`` is itself (bytes slices of all of it are not copies)
                raw = bytes(src[off:end])
                body = memoryview(raw)[HEADER_BYTES:]
                out.append((raw, _decode_reused(body, max_bytes) if length <= REUSE_BYTES
                            else decode_body(body, max_bytes)))
                off = end
        except WireError as exc:
            exc.partial = out  # the whole frames before the bad one, for the caller
            raise
        finally:
            if src is buf:
                if off:
                    del buf[:off]  # once per feed, not once per frame
            elif off < n:
                buf += src[off:]  # the start of a frame: held for the next feed
        return out


def read_frame(stream: IO[bytes], max_bytes: int = MAX_FRAME_BYTES) -> Frame | None:
    """Read one whole frame from a blocking stream; ``None`` at a clean end of stream.

    A stream that ends inside a frame raises :class:`TruncatedStream`.
    """
    header = stream.read(HEADER_BYTES)
    if not header:
        return None
    if len(header) < HEADER_BYTES:
        raise TruncatedStream(f"stream ends inside a frame header ({len(header)} bytes)")
    length = parse_header(header, max_bytes)
    body = _read_up_to(stream, length)
    if len(body) < length:
        raise TruncatedStream(f"stream ends inside a frame body ({len(body)} of {length} bytes)")
    return decode_body(body, max_bytes)


def _read_up_to(stream: IO[bytes], length: int) -> bytes:
    """Up to ``length`` bytes of ``stream``, read in growing chunks: what this allocates
    is in proportion to what the stream holds, not to what a header claims (a file's
    ``read(n)`` allocates ``n`` bytes first)."""
    chunks: list[bytes] = []
    got, chunk = 0, 1 << 16
    while got < length:
        part = stream.read(min(chunk, length - got))
        if not part:
            break
        chunks.append(part)
        got += len(part)
        chunk *= 2
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def iter_frames(stream: IO[bytes], max_bytes: int = MAX_FRAME_BYTES) -> Iterator[Frame]:
    """Yield every whole frame of a stream; raise :class:`TruncatedStream` on a cut tail.

    Frames before the cut are yielded first, so a caller that catches the error has
    lost nothing but the partial frame.
    """
    while True:
        frame = read_frame(stream, max_bytes)
        if frame is None:
            return
        yield frame
