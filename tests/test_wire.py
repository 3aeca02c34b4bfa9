"""The wire format: round trips, every refusal, incremental decoding, fuzzing."""

from __future__ import annotations

import contextlib
import io
import struct
import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors import wire


def test_round_trip_and_header():
    frame = wire.encode(wire.KIND_BATCH, {"rank": 3, "steps": [[1, 0.5, None]]})
    assert frame[:2] == b"RT" and frame[2] == wire.VERSION
    (length,) = struct.unpack(">I", frame[3:7])
    assert length == len(frame) - wire.HEADER_BYTES
    [decoded] = wire.FrameDecoder().feed(frame)
    assert decoded == wire.Frame("batch", {"rank": 3, "steps": [[1, 0.5, None]]})


def test_byte_by_byte_feeding_yields_each_frame_once():
    frames = [wire.encode("batch", {"i": i, "pad": "x" * i}) for i in range(50)]
    dec = wire.FrameDecoder()
    out = []
    for byte in b"".join(frames):
        out += dec.feed(bytes([byte]))
    assert [f.payload["i"] for f in out] == list(range(50))
    assert dec.pending == 0


def test_garbage_is_bad_magic():
    with pytest.raises(wire.BadMagic, match="not an rtop peer"):
        wire.FrameDecoder().feed(b"GET / HTTP/1.1\r\n\r\n")


def test_other_version_is_refused():
    frame = bytearray(wire.encode("hello", {}))
    frame[2] = 9
    with pytest.raises(wire.UnsupportedVersion, match="wire version 9"):
        wire.FrameDecoder().feed(bytes(frame))


def test_oversized_length_prefix_is_refused_before_reading_the_body():
    header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.MAX_FRAME_BYTES + 1)
    with pytest.raises(wire.FrameTooLarge):
        wire.FrameDecoder().feed(header)
    with pytest.raises(wire.FrameTooLarge):
        wire.FrameDecoder(max_bytes=100).feed(wire.encode("x", {"pad": "y" * 200}))


def test_encode_refuses_a_frame_over_the_limit(monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 64)
    with pytest.raises(wire.FrameTooLarge):
        wire.encode("batch", {"pad": "z" * 100})


@pytest.mark.parametrize("body", [
    msgpack.packb([1, {}]),               # kind not a string
    msgpack.packb(["batch", [1, 2]]),     # payload not a map
    msgpack.packb({"kind": "batch"}),     # not an array
    msgpack.packb(["a", {}, "extra"]),    # wrong arity
    b"\xc1",                               # never-used msgpack byte
    msgpack.packb(["a", {}])[:-1] + b"\xdc",  # truncated inside the body
])
def test_malformed_bodies_are_refused(body):
    frame = wire.HEADER.pack(wire.MAGIC, wire.VERSION, len(body)) + body
    with pytest.raises(wire.MalformedFrame):
        wire.FrameDecoder().feed(frame)


def test_no_pickle_or_extension_types():
    body = msgpack.packb(["batch", {"x": msgpack.ExtType(42, b"\x80\x04K\x01.")}])
    frame = wire.HEADER.pack(wire.MAGIC, wire.VERSION, len(body)) + body
    [decoded] = wire.FrameDecoder().feed(frame)
    # an ext type is never executed or unpickled: it stays an opaque value
    assert isinstance(decoded.payload["x"], msgpack.ExtType)


def test_every_decoder_takes_a_limit_which_can_be_raised_later():
    frame = wire.encode(wire.KIND_BATCH, {"pad": "x" * 5000})
    body = frame[wire.HEADER_BYTES:]
    with pytest.raises(wire.FrameTooLarge):
        wire.FrameDecoder(max_bytes=4096).feed(frame)
    with pytest.raises(wire.FrameTooLarge):
        wire.decode_body(body, max_bytes=4096)
    with pytest.raises(wire.FrameTooLarge):
        wire.read_frame(io.BytesIO(frame), max_bytes=4096)
    dec = wire.FrameDecoder(max_bytes=4096)  # e.g. until the peer has authenticated
    dec.max_bytes = 8192
    assert dec.feed(frame)[0].payload["pad"] == "x" * 5000


def test_msgpack_limits_follow_the_decoders_limit():
    assert wire.unpack_limits(1000) == {"max_str_len": 1000, "max_bin_len": 1000,
                                        "max_array_len": 1000, "max_map_len": 500,
                                        "max_ext_len": 1000}
    # containers that claim more entries than a body of the limit could hold: refused
    # before anything is allocated for them
    for header in (b"\xdd" + struct.pack(">I", 10**6),  # array32
                   b"\xdf" + struct.pack(">I", 10**6),  # map32
                   b"\xdb" + struct.pack(">I", 10**6),  # str32
                   b"\xc6" + struct.pack(">I", 10**6)):  # bin32
        body = b"\x92\xa1k" + header + b"\x80" * 600
        with pytest.raises(wire.MalformedFrame):
            wire.decode_body(body, max_bytes=1000)


@pytest.mark.parametrize("limit", [wire.PREAUTH_FRAME_BYTES, wire.MAX_FRAME_BYTES])
def test_what_a_body_claims_costs_nothing_until_it_is_there(limit):
    """Nested array headers that each claim 4,000 elements (less than the body's
    length) and hold none: msgpack would preallocate each of its 1,024 levels (32 MB for
    these 15 kB); refused after a walk that builds nothing."""
    level = b"\xdc" + struct.pack(">H", 4000)
    body = b"\x92\xa1k\x81\xa1a" + level * 5000
    frame = wire.HEADER.pack(wire.MAGIC, wire.VERSION, len(body)) + body
    tracemalloc.start()
    try:
        with pytest.raises(wire.MalformedFrame):
            wire.FrameDecoder(limit).feed(frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{len(frame)} bytes made the decoder allocate {peak:,}"


def test_stream_reader_reports_a_truncated_tail_after_the_whole_frames():
    data = b"".join(wire.encode("batch", {"i": i}) for i in range(3))
    cut = io.BytesIO(data[:-4])
    got = []
    with pytest.raises(wire.TruncatedStream):
        for frame in wire.iter_frames(cut):
            got.append(frame.payload["i"])
    assert got == [0, 1]
    assert [f.payload["i"] for f in wire.iter_frames(io.BytesIO(data))] == [0, 1, 2]


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=5),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=12), st.dictionaries(st.text(max_size=8), json_like,
                                                          max_size=6),
       st.integers(1, 64))
def test_fuzz_round_trip_any_chunking(kind, payload, chunk):
    data = wire.encode(kind, payload) * 2
    dec = wire.FrameDecoder()
    out = []
    for i in range(0, len(data), chunk):
        out += dec.feed(data[i:i + chunk])
    assert out == [wire.Frame(kind, payload)] * 2


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes_decode_or_raise_wire_error(data):
    dec = wire.FrameDecoder(max_bytes=1 << 16)
    try:
        frames = dec.feed(data)
    except wire.WireError:
        return
    for frame in frames:
        assert isinstance(frame.kind, str) and isinstance(frame.payload, dict)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 200))
def test_fuzz_corrupted_valid_frames(noise, pos):
    data = bytearray(wire.encode("batch", {"steps": [[1, 2.5, None, "x"]] * 3}))
    pos %= len(data)
    data[pos:pos + len(noise)] = noise
    with contextlib.suppress(wire.WireError):
        wire.FrameDecoder(max_bytes=1 << 16).feed(bytes(data))


@pytest.mark.parametrize(("address", "expected"), [
    ("127.0.0.1:9000", ("127.0.0.1", 9000)),
    (" node-a:1 ", ("node-a", 1)),
    ("[::1]:9000", ("::1", 9000)),
    ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
    ("::1:9000", ("::1", 9000)),  # unbracketed IPv6, as a hub bound to ::1 writes it
])
def test_parse_address(address, expected):
    assert wire.parse_address(address) == expected


@pytest.mark.parametrize("address", ["", "node", "node:", ":9000", "node:http", "node:-1",
                                     "node:65536", "[::1]", "[::1:9000", "[a]b:1"])
def test_parse_address_refuses_malformed_with_a_clear_error(address):
    with pytest.raises(ValueError, match=r"is not host:port"):
        wire.parse_address(address)
