"""One column of a recording block: a list of values stored by their type, so that alike
values sit together and compress well.

A column is ``[code, blob]``; reading it back gives the very values written (same types,
same numbers), except that measurements are first rounded to :data:`MEASURE_BITS`
significant bits when the writer asks (:func:`encode` with ``bits``):

* ``NONE``: every value is None (no blob);
* ``F64``: every value is a float: little-endian doubles, byte-shuffled (all first bytes,
  then all second bytes, ...: the sign, exponent and high mantissa bytes of like numbers
  are alike, and zstandard finds them);
* ``I64``: every value is an int that fits 64 bits: zig-zag deltas, byte-shuffled;
* ``STR``: every value is a string: the distinct strings and one index per value;
* ``NUM``: ints, floats and Nones mixed: a type tag per value, then the floats as
  ``F64`` and the ints as ``I64``;
* ``PACK``: anything else (bools, bytes, lists, maps, huge ints), as one msgpack list.

Rounding keeps the nearest number with :data:`MEASURE_BITS` significant bits (ties to
even), and no finer than the resolution of what measured it (a power of two the caller
gives: about a microsecond for seconds): a relative error of at most
2**-MEASURE_BITS, 61 parts per million. A measurement that is an integer (bytes of
memory from torch or NVML, clocks, counts) is never rounded: only floats are. Only what
a rank measured is rounded (step times, rates, utilisation, watts ...); time stamps,
counters, identities and whatever the hub writes stay exact (the caller says which
column is which: :mod:`rtop.run.blocks`).
"""

from __future__ import annotations

from typing import Any, Final

import msgpack
import numpy as np

from collectors.wire import unpack_limits

#: Significant bits a rounded measurement keeps (the leading one included): within
#: 2**-14 of the value measured (61 ppm: 31 µs of a 0.5 s step, 6 MB/s of 100 GB/s,
#: 0.006 % of a utilisation). What rtop shows has 3 or 4 digits, what its diagnosis
#: judges differs by percents; the hub's own rolling windows keep 24 bits (float32).
#: Chosen as the most that keeps an hour of 4,096 ranks under 1 GB
#: (``benchmarks/recording_size.py`` prints the bytes for 12 to 24 bits and exact).
MEASURE_BITS: Final = 14

NONE: Final = 0
F64: Final = 1
I64: Final = 2
STR: Final = 3
NUM: Final = 4
PACK: Final = 5
CODES: Final = frozenset({NONE, F64, I64, STR, NUM, PACK})

_T_NONE, _T_INT, _T_FLOAT = 0, 1, 2
_NUMERIC = frozenset({int, float, type(None)})


class ColumnError(ValueError):
    """A column's bytes do not hold what its header says (a damaged block)."""


def round_bits(a: np.ndarray, bits: int = MEASURE_BITS, floor: int | None = None
               ) -> np.ndarray:
    """Finite doubles of ``a`` rounded to ``bits`` significant bits (ties to even), and
    never finer than ``2**floor`` (the resolution of what measured them), in a new
    array; infinities, NaN and the doubles that would round to infinity as they are.
    Rounding to a power of two is exact: what is kept is the nearest such number."""
    _, exp = np.frexp(a)
    quantum_exp = exp - bits
    if floor is not None:
        np.maximum(quantum_exp, floor, out=quantum_exp)
    quantum = np.ldexp(1.0, quantum_exp)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = np.round(a / quantum) * quantum
    keep = np.isfinite(out)
    return out if keep.all() else np.where(keep, out, a)


def _shuffle(a: np.ndarray) -> bytes:
    """The bytes of a little-endian 8-byte array, plane by plane (all first bytes, then
    all second bytes, ...)."""
    return a.astype("<u8", copy=False).view(np.uint8).reshape(-1, 8).T.tobytes()


def _unshuffle(blob: bytes, n: int) -> np.ndarray:
    """The uint64 array :func:`_shuffle` wrote for ``n`` values."""
    if len(blob) != 8 * n:
        raise ColumnError(f"{len(blob)} bytes for {n} 8-byte values")
    planes = np.frombuffer(blob, dtype=np.uint8).reshape(8, n)
    return np.ascontiguousarray(planes.T).view("<u8").reshape(n).astype(np.uint64,
                                                                        copy=False)


def _f64(values: Any, bits: int | None, floor: int | None = None) -> bytes:
    a = np.array(values, dtype=np.float64)
    if bits is not None:
        a = round_bits(a, bits, floor)
    return _shuffle(a.view(np.uint64))


def _i64(values: Any) -> bytes:
    """Zig-zag deltas (wrapping, so any int64 goes), byte-shuffled; raises
    OverflowError for an int beyond 64 bits."""
    a = np.array(values, dtype=np.int64).view(np.uint64)
    d = a.copy()
    d[1:] -= a[:-1]  # deltas, wrapping
    zz = d << np.uint64(1)  # zig-zag: small deltas of either sign, small numbers
    zz ^= np.uint64(0) - (d >> np.uint64(63))
    return _shuffle(zz)


def _from_i64(blob: bytes, n: int) -> list[int]:
    zz = _unshuffle(blob, n)
    d = (zz >> np.uint64(1)) ^ (np.uint64(0) - (zz & np.uint64(1)))
    return np.cumsum(d.view(np.int64), dtype=np.int64).tolist()  # type: ignore[no-any-return]


def encode(values: list[Any] | tuple[Any, ...], bits: int | None = None,
           floor: int | None = None) -> list[Any]:
    """``[code, blob]`` for a column; ``bits``: its floats are measurements, to be
    rounded to that many significant bits and no finer than ``2**floor``
    (:func:`round_bits`; see the module doc)."""
    types = set(map(type, values))
    try:
        if types == {float}:
            return [F64, _f64(values, bits, floor)]
        if types == {int}:
            return [I64, _i64(values)]
        if not types or types == {type(None)}:
            return [NONE, b""]
        if types == {str}:
            uniq: dict[str, int] = {}
            idx = [uniq.setdefault(v, len(uniq)) for v in values]
            return [STR, msgpack.packb([list(uniq), _i64(idx)], use_bin_type=True)]
        if types <= _NUMERIC:
            tags = bytes(_T_NONE if v is None else _T_INT if type(v) is int else _T_FLOAT
                         for v in values)
            floats = [v for v in values if type(v) is float]
            ints = [v for v in values if type(v) is int]
            return [NUM, msgpack.packb([tags, _f64(floats, bits, floor), _i64(ints)],
                                       use_bin_type=True)]
    except OverflowError:  # an int beyond 64 bits
        pass
    return [PACK, msgpack.packb(list(values), use_bin_type=True)]


def decode(col: Any, n: int) -> list[Any]:
    """The ``n`` values of a column :func:`encode` made; raises :class:`ColumnError`
    when it does not hold ``n`` values of its kind."""
    if not isinstance(col, list) or len(col) != 2 or col[0] not in CODES \
            or not isinstance(col[1], bytes):
        raise ColumnError("not a column")
    code, blob = col
    try:
        if code == F64:
            return _unshuffle(blob, n).view(np.float64).tolist()  # type: ignore[no-any-return]
        if code == I64:
            return _from_i64(blob, n)
        if code == NONE:
            if blob:
                raise ColumnError("an empty column with bytes")
            return [None] * n
        parts = msgpack.unpackb(blob, raw=False, strict_map_key=False,
                                **unpack_limits(max(len(blob), 1)))
        if code == PACK:
            if not isinstance(parts, list) or len(parts) != n:
                raise ColumnError(f"a packed column of {len(parts)} values, not {n}"
                                  if isinstance(parts, list) else "a packed column")
            return parts
        if code == STR:
            uniq, blob_idx = parts
            idx = _from_i64(blob_idx, n)
            if not isinstance(uniq, list) or any(not 0 <= i < len(uniq) for i in idx):
                raise ColumnError("a string index out of range")
            return [uniq[i] for i in idx]
        tags, blob_f, blob_i = parts
        n_f, n_i = tags.count(_T_FLOAT), tags.count(_T_INT)
        if len(tags) != n or n_f + n_i + tags.count(_T_NONE) != n:
            raise ColumnError("a mixed column's tags do not match its length")
        floats = iter(_unshuffle(blob_f, n_f).view(np.float64).tolist())
        ints = iter(_from_i64(blob_i, n_i))
        return [None if t == _T_NONE else next(ints) if t == _T_INT else next(floats)
                for t in tags]
    except ColumnError:
        raise
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ColumnError(f"a damaged column: {exc}") from None
