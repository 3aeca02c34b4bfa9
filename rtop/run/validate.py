"""What a peer's frame may hold, checked before the run state keeps anything of it.

Nothing a peer sends is trusted: every frame is checked before anything of it is kept
(:class:`ProtocolError` says what is wrong, and nothing of that frame is applied), and
what is kept is bounded:

* identity: integers in range (``0 <= rank < world_size <= 2**20``), strings of at most
  255 characters (hostname, job, group, node id), no map where a string belongs;
* rows: as many values as their table (``collectors.schema``) has fields, numbers where
  numbers belong, at most ``MAX_ROWS`` per table per batch; a number that is not
  finite (inf, nan) or beyond ±2**64 is "not measured" (None), like a missing one; a
  step's ``collectives`` a map of at most ``MAX_OPS`` collectives (names made safe),
  each with its four figures, its ``groups`` a map of at most ``MAX_GROUPS`` process
  groups, each such a map;
* names and other strings (hostnames, job and node names, the phase, notes, errors):
  control characters, Unicode format characters and line separators are replaced with
  U+FFFD and lengths are capped (:func:`rtop.fmt.safe_text`), so a name cannot retitle a
  terminal, move its cursor or hide text; stacks and error messages keep their newlines
  and tabs. Markup characters (``[``, ``]``) stay: names are text and every view draws
  them as text, never as markup;
* ``meta`` and the collector's info: maps of at most 64 entries with string keys,
  lists of at most 64 items (the newest kept), nesting at most 4 deep.

What the state itself holds at most (ranks, waiting groups) is bounded there. The run
state (:mod:`rtop.run.state`) calls these on every frame it applies, live or
replayed; the hub calls :func:`clean_identity` on a hello before the state sees it,
and spool ingestion on a spool's header.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Final, cast

from collectors.identity import Identity
from collectors.schema import (
    ADDED_FIELDS,
    COLLECTIVE_FIGURES,
    EVENT_FIELDS,
    GPU_FIELDS,
    HEARTBEAT_FIELDS,
    HOST_FIELDS,
    MEM_FIELDS,
    STEP_FIELDS,
)
from rtop.fmt import safe_text


class ProtocolError(ValueError):
    """A frame is well-formed msgpack but not what the protocol says it should hold."""


#: The most ranks a world may claim (a claim costs nothing: windows come as ranks do).
MAX_WORLD: Final = 1 << 20
#: The most rows of one table in one batch (a collector sends at most a few thousand).
MAX_ROWS: Final = 1 << 16
#: The most collectives a step's ``collectives`` map may name.
MAX_OPS: Final = 16
#: The most process groups a step's ``groups`` map may name (``collectors.groups``).
MAX_GROUPS: Final = 16
#: Strings: names (hostname, job, group, node id), short words (a phase, a device), the
#: notes and other strings of ``meta``, an error message, a Python stack.
MAX_NAME: Final = 255
MAX_WORD: Final = 64
MAX_NOTE: Final = 1024
MAX_ERROR: Final = 4096
MAX_STACK: Final = 20000
#: ``meta`` and the collector's info: entries of a map, items of a list, nesting.
MAX_ENTRIES: Final = 64
MAX_DEPTH: Final = 4
#: Numbers beyond this magnitude are not measurements: "not measured", like inf and nan.
MAX_MAGNITUDE: Final = float(1 << 64)

_INT_FIELDS: Final = {  # identity integers: (lowest, highest)
    "rank": (0, MAX_WORLD - 1), "local_rank": (0, MAX_WORLD - 1),
    "world_size": (1, MAX_WORLD), "pid": (0, (1 << 32) - 1),
    "attempt": (-(1 << 31), (1 << 31) - 1)}
_STR_FIELDS: Final = {"hostname": MAX_NAME, "ip": MAX_WORD, "job": MAX_NAME,
                      "group": MAX_NAME, "node_id": MAX_NAME, "source": MAX_WORD}
_REQUIRED: Final = ("rank", "local_rank", "world_size", "hostname", "ip", "pid")

# Per table, per field: None for a number, else (limit, multiline, keep_end) of a string.
_StrSpec = tuple[int, bool, bool]
_WORD: Final = (MAX_WORD, False, False)
_TABLES: Final[dict[str, tuple[tuple[str, ...], tuple[_StrSpec | None, ...]]]] = {
    name: (fields, tuple(strings.get(f) for f in fields))
    for name, fields, strings in (
        ("steps", STEP_FIELDS, {}),
        ("gpu", GPU_FIELDS, {}),
        ("host", HOST_FIELDS, {}),
        ("mem", MEM_FIELDS, {"device": _WORD}),
        ("hb", HEARTBEAT_FIELDS, {"phase": _WORD, "stack": (MAX_STACK, True, True)}),
        ("events", EVENT_FIELDS, {"kind": _WORD}),
    )}


#: Per table, the indices of its string fields.
_STRINGS: Final = {name: frozenset(j for j, k in enumerate(kinds) if k is not None)
                   for name, (_, kinds) in _TABLES.items()}
#: Per table, the indices of its map fields (a step's ``collectives``, and its
#: ``groups``: a map of such maps).
_MAPS: Final = {name: frozenset(j for j, f in enumerate(fields) if f == "collectives")
                for name, (fields, _) in _TABLES.items()}
_GROUP_MAPS: Final = {name: frozenset(j for j, f in enumerate(fields) if f == "groups")
                      for name, (fields, _) in _TABLES.items()}


def described(x: Any) -> str:
    """A value named for an error message: its type, and a short repr."""
    r = repr(x)
    return f"{type(x).__name__} {r if len(r) <= 40 else r[:39] + '…'}"


def check_text(where: str, x: Any, limit: int, *, multiline: bool = False,
               keep_end: bool = False) -> str:
    """A string made safe (:func:`rtop.fmt.safe_text`, at most ``limit`` characters);
    refused if ``x`` is not a string."""
    if not isinstance(x, str):
        raise ProtocolError(f"{where} must be a string, got {described(x)}")
    return safe_text(x, limit, multiline=multiline, keep_end=keep_end)


def check_opt_text(where: str, x: Any, limit: int, *, multiline: bool = False
                   ) -> str | None:
    """:func:`check_text`, with None (absent) kept as None."""
    return None if x is None else check_text(where, x, limit, multiline=multiline)


def check_number(where: str, x: Any) -> float | int | None:
    """A number as measured: None for missing, non-finite or absurd; refused if not a
    number at all."""
    if x is None:
        return None
    if type(x) is int:
        return x
    if type(x) is float:
        return x if -MAX_MAGNITUDE <= x <= MAX_MAGNITUDE else None  # NaN compares false: None too
    raise ProtocolError(f"{where} must be a number, got {described(x)}")


def check_count(where: str, x: Any) -> int | None:
    """A non-negative integer counter (None when absent)."""
    if x is None:
        return None
    if type(x) is not int or x < 0:
        raise ProtocolError(f"{where} must be a non-negative integer, got {described(x)}")
    return x


def clean_value(where: str, x: Any, depth: int = 0) -> Any:
    """A free-form value (``meta``, the collector's info, a run header) made safe:
    strings capped and stripped of control characters, numbers finite or None, maps of
    string keys and lists bounded (see the module doc); anything else is refused."""
    if x is None or type(x) in (bool, int):
        return x
    if type(x) is float:
        return x if -MAX_MAGNITUDE <= x <= MAX_MAGNITUDE else None
    if isinstance(x, str):
        return safe_text(x, MAX_NOTE)
    if depth >= MAX_DEPTH and isinstance(x, (list, dict)):
        raise ProtocolError(f"{where} is nested more than {MAX_DEPTH} deep")
    if isinstance(x, list):
        return [clean_value(where, v, depth + 1) for v in x[-MAX_ENTRIES:]]
    if isinstance(x, dict):
        if len(x) > MAX_ENTRIES:
            raise ProtocolError(f"{where} has {len(x)} entries (at most {MAX_ENTRIES})")
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise ProtocolError(f"{where} has a key that is not a string: {described(k)}")
            out[safe_text(k, MAX_WORD)] = clean_value(f"{where}.{safe_text(k, MAX_WORD)}", v,
                                                      depth + 1)
        return out
    raise ProtocolError(f"{where} holds {described(x)}, which is not a number, string, list "
                        "or map")


def clean_identity(raw: Any) -> Identity:
    """A hello's identity, checked field by field (see the module doc)."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"hello without an identity map (got {described(raw)})")
    for k in _REQUIRED:
        if k not in raw:
            raise ProtocolError(f"hello identity has no '{k}'")
    out: dict[str, Any] = {}
    for k, (lo, hi) in _INT_FIELDS.items():
        if k in raw:
            v = raw[k]
            if type(v) is not int or not lo <= v <= hi:
                raise ProtocolError(f"hello identity: '{k}' must be an integer from {lo} "
                                    f"to {hi}, got {described(v)}")
            out[k] = v
    for k, limit in _STR_FIELDS.items():
        if k in raw:
            out[k] = check_text(f"hello identity: '{k}'", raw[k], limit)
    if out["rank"] >= out["world_size"]:
        raise ProtocolError(f"hello identity: rank {out['rank']} is outside its world of "
                            f"{out['world_size']} ranks")
    return Identity(**out)


def clean_meta(meta: Any) -> dict[str, Any]:
    """A batch's ``meta`` (the collector's notes, the device, ...), made safe; the
    fields the views read must have their types."""
    if not isinstance(meta, dict):
        raise ProtocolError(f"'meta' must be a map, got {described(meta)}")
    out: dict[str, Any] = clean_value("meta", meta)
    notes = out.get("notes")
    if notes is not None and not (isinstance(notes, list)
                                  and all(isinstance(n, str) for n in notes)):
        raise ProtocolError("meta.notes must be a list of strings")
    for k in ("device_reason", "mem_device"):
        if out.get(k) is not None and not isinstance(out[k], str):
            raise ProtocolError(f"meta.{k} must be a string, got {described(out[k])}")
    if out.get("device") is not None and not isinstance(out["device"], dict):
        raise ProtocolError(f"meta.device must be a map, got {described(out['device'])}")
    return out


def clean_split(where: str, x: Any) -> dict[str, list[float | int | None]] | None:
    """A step's ``collectives`` map (``{op: [s, bytes, calls, busbw_Bps]}``), checked:
    at most ``MAX_OPS`` names made safe, each with its four figures as numbers or None
    (a non-finite one is "not measured"); None stays None."""
    if x is None:
        return None
    if not isinstance(x, dict):
        raise ProtocolError(f"{where} must be a map of collectives, got {described(x)}")
    if len(x) > MAX_OPS:
        raise ProtocolError(f"{where} names {len(x)} collectives (at most {MAX_OPS})")
    out: dict[str, list[float | int | None]] = {}
    for op, figures in x.items():
        if not isinstance(op, str):
            raise ProtocolError(f"{where} has a key that is not a string: {described(op)}")
        if type(figures) is not list or len(figures) != len(COLLECTIVE_FIGURES):
            raise ProtocolError(f"{where}: '{safe_text(op, MAX_WORD)}' must be a list of "
                                f"{len(COLLECTIVE_FIGURES)} numbers")
        name = safe_text(op, MAX_WORD)
        out[name] = [check_number(f"{where}: '{name}'", v) for v in figures]
    return out


def clean_groups(where: str, x: Any) -> dict[str, dict[str, list[float | int | None]]] | None:
    """A step's ``groups`` map (``{group: {op: [s, bytes, calls, busbw_Bps]}}``), checked:
    at most ``MAX_GROUPS`` group names made safe, each a ``collectives`` map
    (:func:`clean_split`); None stays None."""
    if x is None:
        return None
    if not isinstance(x, dict):
        raise ProtocolError(f"{where} must be a map of process groups, got {described(x)}")
    if len(x) > MAX_GROUPS:
        raise ProtocolError(f"{where} names {len(x)} process groups (at most {MAX_GROUPS})")
    out: dict[str, dict[str, list[float | int | None]]] = {}
    for group, split in x.items():
        if not isinstance(group, str):
            raise ProtocolError(f"{where} has a key that is not a string: {described(group)}")
        name = safe_text(group, MAX_WORD)
        cleaned = clean_split(f"{where}: '{name}'", split)
        if cleaned is None:
            raise ProtocolError(f"{where}: '{name}' must be a map of collectives")
        out[name] = cleaned
    return out


#: Per table, what :func:`check_rows` needs of it: its fields, its width, the width of
#: its oldest rows (before its ``ADDED_FIELDS``), its string fields (index, limit,
#: multiline, keep_end), the indices of its ``collectives`` and ``groups`` fields, and
#: the indices that hold no number.
_ROWS: Final = {
    name: (fields, len(fields), len(fields) - len(ADDED_FIELDS.get(name, ())),
           tuple((j, *cast(_StrSpec, kinds[j])) for j in sorted(_STRINGS[name])),
           tuple(sorted(_MAPS[name])), tuple(sorted(_GROUP_MAPS[name])),
           _STRINGS[name] | _MAPS[name] | _GROUP_MAPS[name])
    for name, (fields, kinds) in _TABLES.items()}
#: Per table, its number fields' values of a row (None: all its fields are numbers).
_NUMBERS: Final = {
    name: None if not other else itemgetter(*(j for j in range(full) if j not in other))
    for name, (_, full, _, _, _, _, other) in _ROWS.items()}


def _absurd(row: list[Any], j: int) -> bool:
    """Whether ``row[j]`` is a float beyond :data:`MAX_MAGNITUDE` (inf, nan, absurd):
    then made None (not measured), in whichever field of the row it is."""
    v = row[j]
    if type(v) is float and not -MAX_MAGNITUDE <= v <= MAX_MAGNITUDE:
        row[j] = None
        return True
    return False


def check_rows(name: str, rows: Any, width: int | None = None) -> list[list[Any]]:
    """Rows of a table (``collectors.schema``), each as long as the table (``width``,
    if given, must say so), numbers where numbers belong (a non-finite one becomes
    None) and strings made safe, in place; rows from an older collector, shorter by the
    table's ``ADDED_FIELDS``, are padded with None (not measured). Raises
    :class:`ProtocolError` saying what is wrong."""
    fields, full, oldest, strings, splits, groups, other = _ROWS[name]
    numbers = _NUMBERS[name]
    assert width is None or width == full, (name, width)
    if not isinstance(rows, list):
        raise ProtocolError(f"'{name}' must be a list of rows, got {described(rows)}")
    if len(rows) > MAX_ROWS:
        raise ProtocolError(f"'{name}' has {len(rows)} rows in one batch (at most "
                            f"{MAX_ROWS})")
    for i, r in enumerate(rows):
        if type(r) is not list or not oldest <= len(r) <= full:
            n = len(r) if type(r) is list else described(r)
            raise ProtocolError(f"malformed '{name}' rows: row {i} is not a list of "
                                f"{full} values (got {n})")
        if len(r) < full:
            r.extend([None] * (full - len(r)))
        # first a look at the number fields alone: nothing to change or refuse (the
        # usual), nothing more to do for them; else value by value
        plain = True
        for v in r if numbers is None else numbers(r):
            t = type(v)
            if t is float:
                if not -MAX_MAGNITUDE <= v <= MAX_MAGNITUDE:
                    plain = False
                    break
            elif t is not int and v is not None:
                plain = False
                break
        if not plain:
            for j, v in enumerate(r):
                t = type(v)
                if t is float:
                    if not -MAX_MAGNITUDE <= v <= MAX_MAGNITUDE:  # inf, nan, absurd:
                        r[j] = None  # not measured
                elif t is not int and v is not None and j not in other:
                    raise ProtocolError(f"'{name}' row {i}: '{fields[j]}' must be a "
                                        f"number, got {described(v)}")
        for j in splits:  # None (not split) stays None
            if r[j] is not None and not _absurd(r, j):
                r[j] = clean_split(f"'{name}' row {i}: '{fields[j]}'", r[j])
        for j in groups:
            if r[j] is not None and not _absurd(r, j):
                r[j] = clean_groups(f"'{name}' row {i}: '{fields[j]}'", r[j])
        for j, limit, multiline, keep_end in strings:
            v = r[j]
            # a string already safe (short enough, nothing to replace) stays as it is,
            # as safe_text would leave it
            if v is not None and not (type(v) is str and len(v) <= limit
                                      and v.isprintable()) and not _absurd(r, j):
                r[j] = check_text(f"'{name}' row {i}: '{fields[j]}'", v, limit,
                                  multiline=multiline, keep_end=keep_end)
    return rows
