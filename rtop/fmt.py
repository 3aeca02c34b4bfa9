"""How figures print, in every view: the terminal UI, ``rtop report`` and ``rtop status``.

A figure that was not measured is ``None`` (or NaN) and prints as :data:`NA`, never as
0. This module imports nothing of rtop's, so any layer may use it.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Final

#: What a figure that was not measured prints as.
NA: Final = "n/a"
#: What a control or format character in a name is replaced with (visibly).
REPLACEMENT: Final = "\ufffd"


def safe_text(text: str, limit: int = 255, *, multiline: bool = False,
              keep_end: bool = False) -> str:
    """``text`` made safe to print on a terminal, log or draw in the UI.

    At most ``limit`` characters (longer: cut, with "…" where it was cut: at the end,
    or at the start with ``keep_end``, for a stack whose innermost frames are last).
    Control characters (escape sequences, BEL, carriage return, ...), Unicode format
    characters (bidirectional overrides, zero-width ones) and line or paragraph
    separators become :data:`REPLACEMENT`; with ``multiline`` newlines and tabs stay
    (``\r\n`` reads as a newline). Markup (``[bold]``, ``[@click=...]``) is left as
    it is: it is text, and every view draws names as text, never as markup.
    """
    if len(text) > limit:
        text = ("…" + text[len(text) - limit + 1:]) if keep_end else (text[:limit - 1] + "…")
    if text.isprintable():
        return text
    if multiline:
        text = text.replace("\r\n", "\n")
    return "".join(
        ch if ch.isprintable() or (multiline and ch in "\n\t")
        or unicodedata.category(ch) == "Zs" else REPLACEMENT for ch in text)


def num(x: object) -> float | None:
    """A number or None (NaN, infinities, missing and non-numbers are None)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


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


def fmt_scaled(v: float, units: Sequence[tuple[str, float]], figure: Callable[[float], str],
               base: str) -> str:
    """``v`` in the largest of ``units`` (``(suffix, size)``, largest first) its magnitude
    reaches, its figure written by ``figure``; below them all, whole, with ``base``."""
    for suffix, size in units:
        if abs(v) >= size:
            return figure(v / size) + suffix
    return f"{v:.0f}{base}"


def short_figure(v: float) -> str:
    """A figure as few characters as read well: ``12``, ``1.5``, ``2``."""
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}".removesuffix(".0")


#: Decimal byte units (``fmt_bytes``) and binary ones (``fmt_size``), largest first.
DECIMAL_BYTES: Final = ((" TB", 1e12), (" GB", 1e9), (" MB", 1e6), (" kB", 1e3))
BINARY_BYTES: Final = ((" GiB", float(1 << 30)), (" MiB", float(1 << 20)),
                       (" KiB", float(1 << 10)))
#: Units of an age, largest first (``fmt_age``).
AGE_UNITS: Final = (("d", 86400.0), ("h", 3600.0), ("m", 60.0))


def fmt_bytes(x: object) -> str:
    """Bytes with a decimal unit people read at a glance (GB, MB)."""
    v = num(x)
    if v is None:
        return NA
    return fmt_scaled(v, DECIMAL_BYTES, lambda f: f"{f:.3g}", " B")


def fmt_size(n: float) -> str:
    """Bytes in binary units (limits set in them, like the spools' bounds): ``64 MiB``,
    ``1 GiB``."""
    return fmt_scaled(n, BINARY_BYTES, short_figure, " B")


def fmt_age(seconds: float) -> str:
    """A duration the way ``rtop spool`` takes one: ``45s``, ``12m``, ``6h``, ``7d``."""
    return fmt_scaled(max(0.0, seconds), AGE_UNITS, short_figure, "s")


def fmt_rate(x: object) -> str:
    """Bytes per second as GB/s (or MB/s when small)."""
    v = num(x)
    if v is None:
        return NA
    return f"{v / 1e9:.3g} GB/s" if v >= 1e9 else f"{v / 1e6:.3g} MB/s"


def fmt_flops(x: object) -> str:
    """FLOPs per second as TFLOPS, 3 significant figures, never in exponent form:
    ``1,600 TFLOPS``, ``412 TFLOPS``, ``0.0213 TFLOPS``."""
    v = num(x)
    if v is None:
        return NA
    t = v / 1e12
    return f"{t:,.0f} TFLOPS" if t >= 100 else f"{t:.3g} TFLOPS"


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


def fmt_ranks(ranks: Iterable[int]) -> str:
    """Rank numbers as compact ranges: ``[0, 1, 2, 5, 7, 8]`` → ``"0-2,5,7-8"``."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)
