"""The recording's writer: chunks of frames in, blocks on disk out, in a process of its
own (``python -m rtop.hub.record_proc FD``, started by :class:`rtop.hub.recorder.
Recorder`) or in the hub's.

:class:`RecordCore` is all of the recording's work: each chunk the hub hands it (wire
frames one after another, as :class:`~rtop.hub.recorder.Recorder` gathered them between
two flushes) has its secrets taken out (see :mod:`rtop.hub.recorder`), is decoded, laid
out column by column, rounded, compressed and written as one block of
:mod:`rtop.run.blocks` (or, in the older format, written as it is), with one ``write``
to the file. The same code runs in both places, so a recording is the same file
whichever wrote it.

In its own process it reads messages from its standard input (a pipe from the hub) and
answers on its standard output; the recording's descriptor is inherited (the hub opened
it, privately: :func:`collectors.discovery.open_private`). A message is a kind byte, a
length (4 bytes, big-endian) and a body:

``S``  start: msgpack map of :meth:`RecordCore.__init__`'s arguments (the hub's secrets
       among them: never in the arguments or the environment), the first message
``K``  a secret to take out from now on (its bytes)
``D``  a chunk of frames, written as one block; answered
``Y``  make the file's data durable (``fsync``); answered
``E``  msgpack ``[t, chunk]``: a last chunk, with the ``end`` frame; answered

An answer is a length (4 bytes) and a msgpack ``[number, state, notes]``: how many
messages it answers so far, :meth:`RecordCore.state` and the log lines the hub should
write (``[level, text]``: the process logs nothing itself). At the end of its input (the
hub closed the pipe, or was killed) it has written every whole chunk it was given and
exits: a killed hub loses nothing it handed over.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Any, Final, cast

import msgpack

from collectors import wire
from rtop.run import blocks
from rtop.run.columns import MEASURE_BITS
from rtop.run.recording import KIND_END, may_hold_secret, scrub

log = logging.getLogger("rtop.hub")

#: A message to the writer's process: its kind and its body's length.
MESSAGE: Final = struct.Struct(">cI")
#: An answer's length.
ANSWER: Final = struct.Struct(">I")
START, SECRET, DATA, SYNC, END = b"S", b"K", b"D", b"Y", b"E"

#: Notes (``(level, text)``) for the hub's log.
Note = Callable[[int, str], None]


def _log_note(level: int, text: str) -> None:
    log.log(level, "%s", text)


class RecordCore:
    """Writes chunks of wire frames to the recording open as ``fd`` (in the block format
    if ``blocked``, else one frame after another), one block a chunk.

    ``secrets``: values never written (a frame holding one is re-encoded without it, or
    dropped); ``rounded``: the records' measurements rounded (:mod:`rtop.run.columns`);
    ``path``: the file's name, for messages. The rest carries on from another writer of
    the same file (the hub's, when this process takes over): ``t``, the hub's time in
    effect; ``stepped``, the ranks seen with steps; the counters; ``told``, the warnings
    given. ``note(level, text)`` takes what is worth logging."""

    def __init__(self, fd: int, *, blocked: bool, rounded: bool = True, path: str = "",
                 secrets: Iterable[bytes] = (), t: float = math.nan,
                 stepped: Iterable[Any] = (), frames: int = 0, written: int = 0,
                 secrets_dropped: int = 0, undecodable: int = 0,
                 told: Iterable[str] = (), note: Note | None = None) -> None:
        self.fd = fd
        self.blocked = blocked
        self.path = path
        self._bits = MEASURE_BITS if rounded else None
        self._secrets: list[bytes] = []
        for s in secrets:
            self.add_secret(s)
        self._writer = blocks.BlockWriter() if blocked else None
        self._t = t
        self._stepped: set[Any] = {tuple(k) if isinstance(k, list) else k for k in stepped}
        self.frames = frames
        #: bytes written to the file
        self.bytes = written
        self.secrets_dropped = secrets_dropped
        #: frames that could not be decoded again to be laid out (never from a hub)
        self.undecodable = undecodable
        self._told = set(told)
        self._note = note or _log_note
        #: why recording stopped (the disk filled, the file became unwritable), if it did
        self.failed: str | None = None

    def state(self, full: bool = False) -> dict[str, Any]:
        """What another writer carries on from (``full``: with the ranks seen with
        steps and the warnings given, which :meth:`__init__` takes too)."""
        out: dict[str, Any] = {
            "t": self._t, "frames": self.frames, "written": self.bytes,
            "secrets_dropped": self.secrets_dropped, "undecodable": self.undecodable}
        if full:
            out.update(stepped=list(self._stepped), told=list(self._told))
        return out

    def add_secret(self, secret: bytes) -> None:
        """A value that must never be written, under any name."""
        if secret and secret not in self._secrets:
            self._secrets.append(secret)

    # ---- taking secrets out ------------------------------------------------------------

    def _clean(self, data: bytes) -> bytes | None:
        """``data`` (a whole frame) fit to record: as it is when it holds no secret,
        re-encoded without them when it does, None when that cannot be done."""
        named = may_hold_secret(data)
        valued = any(s in data for s in self._secrets)
        if not named and not valued:
            return data
        try:
            frame = wire.decode_body(memoryview(data)[wire.HEADER_BYTES:])
            removed: list[str] = []
            payload = scrub(frame.payload, self._secrets, removed)
            if not removed:
                return data  # a secret-like word, but no secret: as received
            out = wire.encode(frame.kind, payload)
            if any(s in out for s in self._secrets):  # in a key, a kind: give up
                raise ValueError("a secret in the frame's structure")
        except (ValueError, TypeError):
            self._tell("drop", "rtop hub: a frame that holds a secret was not recorded")
            self.secrets_dropped += 1
            return None
        self.secrets_dropped += len(removed)
        names = ", ".join(repr(r) for r in removed[:5])
        self._tell(frame.kind, f"rtop hub: secret fields of a {frame.kind[:20]!r} frame were "
                   f"not recorded: {names}")
        return out

    def _tell(self, key: str, msg: str) -> None:
        if key not in self._told and len(self._told) < 32:
            self._told.add(key)
            self._note(logging.WARNING, msg)

    def _frames(self, chunk: bytes | bytearray) -> list[bytes | memoryview]:
        """The chunk's frames (whole, header and body), secrets taken out."""
        view = memoryview(chunk)
        out: list[bytes | memoryview] = []
        hb, unpack = wire.HEADER_BYTES, wire.HEADER.unpack_from
        at, n = 0, len(chunk)
        # one look at the whole chunk: most hold nothing that looks like a secret
        suspect = may_hold_secret(cast(bytes, chunk)) or any(s in chunk for s in self._secrets)
        while at + hb <= n:
            end = at + hb + unpack(chunk, at)[2]
            if end > n:
                break  # never from a hub: its chunks hold whole frames
            if suspect:
                clean = self._clean(bytes(view[at:end]))
                if clean is not None:
                    out.append(clean)
            else:
                out.append(view[at:end])
            at = end
        return out

    # ---- writing -----------------------------------------------------------------------

    def write(self, chunk: bytes | bytearray, end_t: float | None = None) -> None:
        """Write the chunk's frames as one block (and, with ``end_t``, the ``end`` frame
        after them: the hub closed the recording at ``end_t``). After a failure (see
        :attr:`failed`), nothing."""
        if self.failed is not None:
            return
        frames = self._frames(chunk)
        self.frames += len(frames)
        if end_t is not None:
            self.frames += 1
            frames.append(wire.encode(KIND_END, {"t_hub": end_t, "frames": self.frames}))
        if not frames:
            return
        data = b"".join(frames) if self._writer is None else self._block(frames)
        try:
            self._write_all(data)
        except OSError as exc:  # the disk filled, the file became unwritable
            self._stop(exc)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            self.bytes += n
            view = view[n:]

    def _block(self, frames: list[bytes | memoryview]) -> bytes:
        assert self._writer is not None
        decoded: list[tuple[str, dict[str, Any]]] = []
        unpackb = msgpack.unpackb
        hb = wire.HEADER_BYTES
        t0 = t = self._t
        for data in frames:
            try:
                obj = unpackb(data[hb:], raw=False, strict_map_key=False)
            except Exception:  # msgpack raises several types: a frame that never decoded
                obj = None
            if type(obj) is list and len(obj) == 2 and type(obj[0]) is str \
                    and type(obj[1]) is dict:
                decoded.append((obj[0], obj[1]))
                if obj[0] == wire.KIND_CLOCK:
                    v = obj[1].get("t_hub")
                    if isinstance(v, float) and math.isfinite(v):
                        t = v
            else:
                self.undecodable += 1
        self._t = t
        if len(self._stepped) > blocks.MAX_STEPPED:
            self._stepped.clear()  # a forged flood of ranks: flag their first steps again
        try:
            enc = blocks.encode_body(decoded, self._bits, stepped=self._stepped)
        except Exception as exc:  # never lose the frames: kept as msgpack rows instead
            self._note(logging.ERROR, f"rtop hub: laying out a block failed ({exc!r}); its "
                       "frames are kept as rows")
            enc = blocks.encode_body(decoded, columnar=False)
        return self._writer.block(enc, t0, t)

    def sync(self) -> None:
        """Have the system write the file to disk."""
        if self.failed is None:
            try:
                os.fsync(self.fd)
            except OSError as exc:
                self._stop(exc)

    def _stop(self, exc: BaseException) -> None:
        self.failed = str(exc) or type(exc).__name__
        self._note(logging.ERROR, f"rtop hub: recording to {self.path} stopped: {exc}")


# ---- the process -------------------------------------------------------------------------


def read_exactly(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``, or None at the end of the input before them."""
    parts, got = [], 0
    while got < n:
        part = os.read(fd, min(n - got, 1 << 20))
        if not part:
            return None
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def serve(fd: int, inp: int, out: int) -> int:
    """Write the recording open as ``fd`` as the messages read from ``inp`` say,
    answering on ``out`` (see the module doc); returns the exit status."""
    notes: list[list[Any]] = []
    core: RecordCore | None = None
    answered = 0
    while True:
        head = read_exactly(inp, MESSAGE.size)
        if head is None:
            break
        kind, length = MESSAGE.unpack(head)
        body = read_exactly(inp, length) if length else b""
        if body is None:
            break  # the hub died while handing a chunk over: it never counted on it
        if kind == START:
            args = msgpack.unpackb(body, raw=False)
            core = RecordCore(fd, **args, note=lambda level, text: notes.append([level, text]))
            continue
        if core is None:
            print("rtop recorder: no start message", file=sys.stderr)
            return 2
        if kind == SECRET:
            core.add_secret(body)
            continue
        if kind == DATA:
            core.write(body)
        elif kind == SYNC:
            core.sync()
        elif kind == END:
            t, chunk = msgpack.unpackb(body, raw=False)
            core.write(chunk, end_t=t)
        else:
            print(f"rtop recorder: unknown message {kind!r}", file=sys.stderr)
            return 2
        answered += 1
        state = core.state()
        state["failed"] = core.failed
        answer = msgpack.packb([answered, state, notes], use_bin_type=True)
        notes.clear()
        with contextlib.suppress(BrokenPipeError):  # the hub is gone: write on all the same
            os.write(out, ANSWER.pack(len(answer)) + answer)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m rtop.hub.record_proc FD``: the recorder's process (see the module
    doc)."""
    args = sys.argv[1:] if argv is None else argv
    fd = int(args[0])
    # the hub says when to end, by closing the pipe (or by dying): not a terminal's ^C,
    # nor the hangup of an orphaned process group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    out = os.dup(1)
    os.dup2(2, 1)  # nothing printed by accident gets in the answers
    try:
        return serve(fd, 0, out)
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
