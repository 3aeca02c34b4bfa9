"""rtop's wire format: versioned, length-prefixed msgpack frames. No pickle, ever.

One format for everything: the same bytes travel over TCP between ranks, hub and
viewers, are appended to a run's recording, and are replayed from it.

A frame is a 7-byte header followed by a msgpack body::

    b"RT"   version (1 byte)   body length (4 bytes, big-endian)   body

and the body is the msgpack array ``[kind, payload]`` where ``kind`` is a short string
(see the ``KIND_*`` constants) and ``payload`` a map with string keys. A frame larger
than ``MAX_FRAME_BYTES``, a header without the magic, a version other than ``VERSION``
or a body that is not ``[str, map]`` is refused with a :class:`WireError` that says
which; the connection that sent it is closed and nothing else is affected.
"""

from __future__ import annotations

import struct
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

# Rank -> hub
KIND_HELLO: Final = "hello"  # identity, token, clock, device; first frame of a rank
KIND_BATCH: Final = "batch"  # records of the tables in collectors.schema
KIND_PONG: Final = "pong"  # answer to a ping: clock-offset sample
KIND_BYE: Final = "bye"  # clean close, with final counters
# Hub -> rank / viewer
KIND_WELCOME: Final = "welcome"  # accepted; carries the hub's clock
KIND_PING: Final = "ping"  # asks for a pong (clock offset refresh)
KIND_ERROR: Final = "error"  # refused: wrong token, bad frame, ...
KIND_CONTROL: Final = "control"  # a command for the rank (profiling, probes)
# Viewer <-> hub
KIND_SUBSCRIBE: Final = "subscribe"
KIND_SNAPSHOT: Final = "snapshot"
KIND_REQUEST: Final = "request"
# Recording only
KIND_RUN: Final = "run"  # first frame of a recording: what wrote it and when


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
    if magic != MAGIC:
        raise BadMagic(f"bad frame magic {magic!r} (expected {MAGIC!r}): not an rtop peer?")
    if version != VERSION:
        raise UnsupportedVersion(
            f"wire version {version} not supported (this side speaks {VERSION})"
        )
    if length > max_bytes:
        raise FrameTooLarge(f"frame announces {length} bytes, limit is {max_bytes}")
    return int(length)


def decode_body(body: bytes | memoryview) -> Frame:
    """Decode a frame body (without its header)."""
    try:
        obj = msgpack.unpackb(body, raw=False, use_list=True)
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


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, get whole frames back.

    After a :class:`WireError` the stream cannot be resynchronised; the caller closes
    the connection. ``pending`` tells how many bytes of an incomplete frame are held.
    """

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_bytes

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
        buf += data
        out: list[tuple[bytes, Frame]] = []
        off, n = 0, len(buf)
        try:
            while n - off >= HEADER_BYTES:
                length = parse_header(bytes(buf[off:off + HEADER_BYTES]), self._max)
                end = off + HEADER_BYTES + length
                if n < end:
                    break
                raw = bytes(buf[off:end])
                out.append((raw, decode_body(memoryview(raw)[HEADER_BYTES:])))
                off = end
        except WireError as exc:
            exc.partial = out  # the whole frames before the bad one, for the caller
            raise
        finally:
            if off:
                del buf[:off]  # once per feed, not once per frame
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
    body = stream.read(length)
    if len(body) < length:
        raise TruncatedStream(f"stream ends inside a frame body ({len(body)} of {length} bytes)")
    return decode_body(body)


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
