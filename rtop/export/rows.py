"""The rows of an exported run, from the frames of a replay (:func:`rtop.run.recording.
replay`), column by column, handed on in chunks so that memory stays bounded whatever
the recording's length.

Rows are taken as the run state applied them: checked and cleaned by
:mod:`rtop.run.validate` (a frame it refused is not exported, a batch a rank sent again
after a reconnect is exported once), each with the rank's identity and clock offset as
the state knew them when the batch arrived.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from collectors import wire
from collectors.schema import STEP_FIELDS, TABLES
from rtop.export.columns import COLLECTIVES, MEASUREMENTS, WHO, Column, TableSpec
from rtop.fmt import safe_text
from rtop.run.state import RankState, RunState, step_split
from rtop.run.validate import MAX_NAME

#: Rows a table holds before they are handed on (one Parquet row group each).
CHUNK_ROWS: Final = 16_384
#: The file name of the collectives table.
COLLECTIVES_FILE: Final = "collectives"
_INT64_MAX: Final = (1 << 63) - 1
_INT64_MIN: Final = -(1 << 63)
_STEP: Final = STEP_FIELDS.index("step")
_T_WALL: Final = STEP_FIELDS.index("t_wall")
_GROUPS: Final = STEP_FIELDS.index("groups")

#: The measurement tables' file names (without ``.parquet``), then the collectives'.
TABLE_FILES: Final = (*(spec.file for spec in MEASUREMENTS), COLLECTIVES_FILE)
#: Where chunks go: ``(file, {column: values})``, every column as long as the others.
Sink = Callable[[str, dict[str, list[Any]]], None]


@dataclass(frozen=True, slots=True)
class _Who:
    """Who sent a batch, as the state knew it when it arrived (shared by its rows)."""

    rank_state: RankState
    group: str
    job: str
    node: str
    t_hub: float
    offset_s: float | None


@dataclass
class _Buffer:
    """One table's rows not yet handed on: its own columns, and who sent each row."""

    file: str
    columns: tuple[Column, ...]
    who: list[_Who] = field(default_factory=list)
    data: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data = {c.name: [] for c in self.columns if c not in WHO}

    def take(self) -> dict[str, list[Any]]:
        """Every column's values (who first), and an empty buffer again."""
        out: dict[str, list[Any]] = {
            "rank": [w.rank_state.rank for w in self.who],
            # a group still waiting to become the job's attempt is numbered below 0
            "attempt": [w.rank_state.attempt if w.rank_state.attempt >= 0 else None
                        for w in self.who],
            "group": [w.group for w in self.who],
            "job": [w.job for w in self.who],
            "node": [w.node for w in self.who],
            "t_hub": [w.t_hub for w in self.who],
        }
        for name, values in self.data.items():  # emptied in place: plans hold these lists
            out[name] = values.copy()
            values.clear()
        self.who = []
        return out


def _plan(spec: TableSpec, buf: _Buffer) -> list[tuple[list[Any], int, str | None]]:
    """Per wire field: the list its values go to, its index in a row, and, for a
    whole-number column, its name (None: taken as it is)."""
    cols = [c for c in spec.columns if c not in WHO and c.name != "t_wall_hub"]
    wire = TABLES[spec.key]  # a map field (collectives, groups) is not exported: skip it
    return [(buf.data[col.name], wire.index(wire_field),
             f"{spec.file}.{col.name}" if col.kind == "int" else None)
            for col, wire_field in zip(cols, spec.fields, strict=True)]


class RowCollector:
    """Turns the frames a replay applies into rows of the exported tables; pass
    :meth:`on_frame` as ``replay``'s ``on_frame``, then call :meth:`finish`.

    ``rows`` counts the rows of each table (by file name); ``bad_values`` counts the
    numbers left out (null) of a whole-number column because they were not whole, or
    beyond int64, by ``file.column`` (a collector sends neither; a hostile recording
    might).
    """

    def __init__(self, sink: Sink, chunk_rows: int = CHUNK_ROWS) -> None:
        self.sink = sink
        self.chunk_rows = chunk_rows
        self._tables = [(spec, _Buffer(spec.file, spec.columns)) for spec in MEASUREMENTS]
        self._coll = _Buffer(COLLECTIVES_FILE, COLLECTIVES)
        self._coll_plan = [(self._coll.data[c.name], f"{COLLECTIVES_FILE}.{c.name}"
                            if c.kind == "int" else None)
                           for c in COLLECTIVES[len(WHO) + 5:]]  # after step, times, op, group
        self.rows: dict[str, int] = {f: 0 for f in self.files}
        self.bad_values: dict[str, int] = {}
        self._plans = [(spec, buf, _plan(spec, buf)) for spec, buf in self._tables]
        self._duplicates = 0

    @property
    def files(self) -> tuple[str, ...]:
        """The tables' file names (:data:`TABLE_FILES`)."""
        return TABLE_FILES

    @staticmethod
    def columns(file: str) -> tuple[Column, ...]:
        """The columns of the table written to ``file``."""
        if file == COLLECTIVES_FILE:
            return COLLECTIVES
        return next(spec.columns for spec in MEASUREMENTS if spec.file == file)

    def on_frame(self, t_hub: float, frame: wire.Frame, st: RunState) -> None:
        """Take the rows of one applied frame (a batch; other frames hold none)."""
        if st.duplicate_frames != self._duplicates:  # a batch the state did not apply
            self._duplicates = st.duplicate_frames
            return
        if frame.kind != wire.KIND_BATCH:
            return
        p = frame.payload
        group = p.get("group")
        rs = st.rank_state(p["rank"], safe_text(group, MAX_NAME) if group else None)
        if rs is None:
            return
        who = _Who(rs, RunState.group_of(rs.identity), rs.identity.job, rs.node, t_hub,
                   rs.offset_s)
        for spec, buf, plan in self._plans:
            rows = p.get(spec.key)
            if rows:
                self._add(spec, buf, plan, rows, who)
                if spec.key == "steps":
                    self._add_collectives(rows, who)

    def _add(self, spec: TableSpec, buf: _Buffer, plan: list[tuple[list[Any], int, str | None]],
             rows: list[list[Any]], who: _Who) -> None:
        if len(rows) == 1:  # the usual batch: a flush interval's one row of each table
            self._add_row(spec, buf, plan, rows[0], who)
            return
        cols = list(zip(*rows, strict=True))  # the batch column by column
        buf.who.extend([who] * len(rows))
        for values, j, whole in plan:
            if whole is None:
                values.extend(cols[j])
            else:
                values.extend(v if v is None or (type(v) is int and _INT64_MIN <= v <= _INT64_MAX)
                              else self._whole(v, whole) for v in cols[j])
        if spec.has_t_wall:
            off = who.offset_s
            buf.data["t_wall_hub"].extend(_on_hub_clock(t, off)
                                          for t in cols[spec.t_wall_index])
        self.rows[buf.file] += len(rows)
        self._spill(buf)

    def _add_row(self, spec: TableSpec, buf: _Buffer,
                 plan: list[tuple[list[Any], int, str | None]], row: list[Any],
                 who: _Who) -> None:
        buf.who.append(who)
        for values, j, whole in plan:
            v = row[j]
            if whole is not None and v is not None and not (
                    type(v) is int and _INT64_MIN <= v <= _INT64_MAX):
                v = self._whole(v, whole)
            values.append(v)
        t = spec.t_wall_index
        if t >= 0:
            buf.data["t_wall_hub"].append(_on_hub_clock(row[t], who.offset_s))
        self.rows[buf.file] += 1
        self._spill(buf)

    def _add_collectives(self, rows: list[list[Any]], who: _Who) -> None:
        buf = self._coll
        d = buf.data
        for row in rows:
            split = step_split(row)
            if not split:
                continue
            step = self._whole(row[_STEP], f"{COLLECTIVES_FILE}.step")
            t_wall = row[_T_WALL]
            on_hub = _on_hub_clock(t_wall, who.offset_s)
            splits = [(None, split), *(row[_GROUPS] or {}).items()]
            for group, ops in splits:
                for op, figures in ops.items():
                    buf.who.append(who)
                    d["step"].append(step)
                    d["t_wall"].append(t_wall)
                    d["t_wall_hub"].append(on_hub)
                    d["op"].append(op)
                    d["process_group"].append(group)
                    for (values, whole), v in zip(self._coll_plan, figures, strict=True):
                        values.append(v if whole is None else self._whole(v, whole))
                    self.rows[COLLECTIVES_FILE] += 1
        self._spill(buf)

    def _whole(self, v: Any, name: str) -> int | None:
        """A whole-number column's value: an int, or None (counted) if it is not one."""
        if v is None:
            return None
        if type(v) is int and _INT64_MIN <= v <= _INT64_MAX:
            return v
        if type(v) is float and v.is_integer() and abs(v) <= _INT64_MAX:
            return int(v)
        self.bad_values[name] = self.bad_values.get(name, 0) + 1
        return None

    def _spill(self, buf: _Buffer) -> None:
        if len(buf.who) >= self.chunk_rows:
            self.sink(buf.file, buf.take())

    def finish(self) -> None:
        """Hand on the rows still held, every table's (an empty chunk for one that has
        none left)."""
        for _, buf in self._tables:
            self.sink(buf.file, buf.take())
        self.sink(COLLECTIVES_FILE, self._coll.take())


def _on_hub_clock(t_wall: Any, offset_s: float | None) -> float | None:
    """A rank's time on the hub's clock (None when either is unknown)."""
    if offset_s is None or not isinstance(t_wall, (int, float)) or isinstance(t_wall, bool):
        return None
    t = float(t_wall) - offset_s
    return t if math.isfinite(t) else None
