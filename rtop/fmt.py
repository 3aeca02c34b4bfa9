"""How figures print, in every view: the terminal UI, ``rtop report`` and ``rtop status``.

A figure that was not measured is ``None`` (or NaN) and prints as :data:`NA`, never as
0. This module imports nothing of rtop's, so any layer may use it.
"""

from __future__ import annotations

import math
from typing import Final

#: What a figure that was not measured prints as.
NA: Final = "n/a"


def num(x: object) -> float | None:
    """A number or None (NaN, missing and non-numbers are None)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) else float(x)


def fmt_num(x: object, spec: str, scale: float = 1.0) -> str:
    """``x × scale`` in the format ``spec`` (``".3g"``, ``".0%"``, ...)."""
    v = num(x)
    return NA if v is None else f"{v * scale:{spec}}"


def fixed(x: object, scale: float = 1.0, digits: int = 1) -> str:
    """``x × scale`` with ``digits`` decimals (a table column of one unit)."""
    return fmt_num(x, f".{digits}f", scale)


def fmt_ms(x: object) -> str:
    """Seconds as milliseconds, 3 significant figures."""
    v = num(x)
    if v is None:
        return NA
    ms = v * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def fmt_bytes(x: object) -> str:
    """Bytes with a decimal unit people read at a glance (GB, MB)."""
    v = num(x)
    if v is None:
        return NA
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.3g} {unit}"
    return f"{v:.0f} B"


def fmt_rate(x: object) -> str:
    """Bytes per second as GB/s (or MB/s when small)."""
    v = num(x)
    if v is None:
        return NA
    return f"{v / 1e9:.3g} GB/s" if v >= 1e9 else f"{v / 1e6:.3g} MB/s"


def fmt_pct(x: object, scale: float = 1.0) -> str:
    """A percentage (``scale`` 100 for a fraction)."""
    v = num(x)
    return NA if v is None else f"{v * scale:.0f}%"


def fmt_duration(seconds: object) -> str:
    """Whole seconds as h:mm:ss, or m:ss under an hour."""
    v = num(seconds)
    if v is None:
        return NA
    s = int(v)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"
