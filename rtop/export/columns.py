"""The columns of an exported run, derived from the wire tables and the figures table.

Each measurement table of :mod:`collectors.schema` (``steps``, ``gpu``, ``host``,
``mem``, ``hb``, ``events``) becomes one exported table: who sent the row and when it
reached the hub (:data:`WHO`), then the table's own fields in wire order, each named as
:mod:`collectors.figures` names it (``util_pct`` of the ``gpu`` table is
``gpu_util_pct``, as in the report, the snapshot and the UI), with the figure's ``doc``
kept in the Parquet field's metadata. A field no figure reads keeps its wire name
(``t_wall``, a heartbeat's ``step``, an event's ``kind``). A step's ``collectives`` map
is its own table (:data:`COLLECTIVES`), one row per step and collective. A figure added
to the wire tables and to the figures table is exported without a change here.

Types (:func:`kind_of`): text fields are strings; a name whose unit says seconds, a
rate, a percentage, watts, degrees or megahertz (``_s``, ``_Bps``, ``_pct``, ``_w``,
``_c``, ``_mhz``) and any other number are float64; bytes (``_bytes``) and counts
(:data:`WHOLE`) are int64. Times are float64 seconds since the Unix epoch (``t_wall``
on the rank's clock, ``t_hub`` and ``t_wall_hub`` on the hub's). ``None`` (not
measured) is a null, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from collectors.figures import FIGURES
from collectors.schema import COLLECTIVE_FIGURES, TABLES

#: How a column is stored: int64, float64, string, bool, or a list of int64 / strings.
Kind = Literal["int", "float", "text", "bool", "ints", "texts"]

#: Wire fields that hold text (a memory sample's device, a heartbeat's phase and stack,
#: an event's kind); every other wire field is a number (``rtop.run.validate``
#: refuses anything else there, and ``tests/test_export.py`` checks this list against it).
TEXT: Final = frozenset({"device", "phase", "stack", "kind"})
#: Unit suffixes of float figures (seconds, bytes per second, percent, watts, degrees
#: Celsius, megahertz).
FLOAT_UNITS: Final = ("_s", "_Bps", "_pct", "_w", "_c", "_mhz")
#: Whole numbers without a unit suffix: step counters and counts (int64 like ``_bytes``).
WHOLE: Final = frozenset({"step", "samples", "tokens", "comm_calls", "loader_procs",
                          "clock_event_reasons"})
#: Wire fields that hold maps, not exported as columns of their table: a step's
#: ``collectives`` and its ``groups`` (the same split by process group) are rows of the
#: collectives table (:data:`COLLECTIVES`).
MAPS: Final = frozenset({"collectives", "groups"})
#: Tables exported under another file name than their wire key.
FILE_NAMES: Final = {"hb": "heartbeats"}


@dataclass(frozen=True)
class Column:
    """One exported column: its name, how it is stored, and what it means."""

    name: str
    kind: Kind
    doc: str = ""


def kind_of(name: str) -> Kind:
    """How a wire field or figure of this name is stored (see the module doc)."""
    return named_kind(name) or "float"


def named_kind(name: str) -> Kind | None:
    """What the name alone says of a column's kind (None: nothing)."""
    if name in TEXT:
        return "text"
    if name == "t_wall" or name.endswith(FLOAT_UNITS):
        return "float"
    if name.endswith("_bytes") or name in WHOLE:
        return "int"
    return None


#: Who sent a row and when the hub had it: the first columns of every measurement table.
WHO: Final = (
    Column("rank", "int", "the rank's world rank"),
    Column("attempt", "int", "the attempt (worker group) it belongs to, numbered from 0 as "
                             "`rtop report` numbers them; null for a group that was not "
                             "the job's attempt (a stray, or one still waiting to take "
                             "over when its rows were written)"),
    Column("group", "text", "the worker group's id (a restart starts a new one)"),
    Column("job", "text", "the job's own id (Ray Train run id, torchrun run id, ...)"),
    Column("node", "text", "the node (hostname) the rank ran on"),
    Column("t_hub", "float", "when the hub received the batch that held the row: seconds "
                             "since the Unix epoch, on the hub's clock"),
)
#: Beside a row's ``t_wall``: the same instant on the hub's clock.
T_WALL: Final = Column("t_wall", "float", "the rank's own time.time() when the record "
                                          "began: seconds since the Unix epoch, on the "
                                          "rank's clock")
T_WALL_HUB: Final = Column("t_wall_hub", "float", "t_wall on the hub's clock: t_wall minus "
                                                  "the rank's clock offset as the hub last "
                                                  "estimated it before the batch (null: no "
                                                  "estimate yet)")


def _figure_of(table: str, wire_field: str) -> tuple[str, str]:
    """The exported name and doc of a wire field: its figure's, else its own name."""
    for f in FIGURES:
        if f.table == table and f.source == wire_field and not f.of:
            return f.name, f.doc
    return wire_field, ""


@dataclass(frozen=True)
class TableSpec:
    """One exported measurement table: the wire table it comes from, and its columns."""

    key: str  # the wire table's key in a batch (``collectors.schema.TABLES``)
    file: str  # its file name, without ``.parquet``
    fields: tuple[str, ...]  # the wire fields exported, in wire order
    columns: tuple[Column, ...]  # WHO, then each field's column (t_wall with t_wall_hub)
    t_wall_index: int  # where a row holds ``t_wall`` (-1: nowhere)

    @property
    def has_t_wall(self) -> bool:
        """Whether its rows carry the rank's time (then ``t_wall_hub`` is added)."""
        return self.t_wall_index >= 0


def _table_spec(key: str) -> TableSpec:
    fields = tuple(f for f in TABLES[key] if f not in MAPS)
    cols: list[Column] = list(WHO)
    for wire_field in fields:
        name, doc = _figure_of(key, wire_field)
        if wire_field == "t_wall":
            cols += [Column(name, "float", doc or T_WALL.doc), T_WALL_HUB]
            continue
        cols.append(Column(name, kind_of(wire_field), doc))
    return TableSpec(key, FILE_NAMES.get(key, key), fields, tuple(cols),
                     fields.index("t_wall") if "t_wall" in fields else -1)


#: The measurement tables, in the wire's order.
MEASUREMENTS: Final = tuple(_table_spec(key) for key in TABLES)
#: One row per step and collective it ran (a step without a ``collectives`` map that
#: ran collectives ran allreduces only: one ``all_reduce`` row with the step's figures),
#: ``process_group`` null; and, for a job whose collectives ran on several process
#: groups, one row per step, group and collective, ``process_group`` its name
#: (``collectors.groups``).
COLLECTIVES: Final = (
    *WHO,
    Column("step", "int", "the rank's step counter, from 0"),
    T_WALL, T_WALL_HUB,
    Column("op", "text", "the collective (all_reduce, all_gather, reduce_scatter, ...)"),
    Column("process_group", "text", "the process group it ran on (torch's group_name; the "
                            "rank's meta describes it), or null: the step's collectives "
                            "on every group together"),
    *(Column(f"comm_{name}", kind_of(f"comm_{name}"),
             f"the collective's {name} in the step (collectors.schema.COLLECTIVE_FIGURES)")
      for name in COLLECTIVE_FIGURES),
)
#: One row per finding the diagnosis made over the run (``rtop report``'s findings).
FINDINGS: Final = (
    Column("kind", "text", "the finding's kind (starved_rank, straggler, ...)"),
    Column("severity", "text", "info, warning or critical: the worst it reached"),
    Column("ranks", "ints", "the ranks it names (of the attempt running then)"),
    Column("nodes", "texts", "the nodes of those ranks"),
    Column("since", "float", "when it started: seconds since the Unix epoch, hub clock"),
    Column("until", "float", "when it ended, or was last seen if still active at the end"),
    Column("duration_s", "float", "until - since"),
    Column("active", "bool", "still active when the recording ends"),
    Column("impact", "float", "the share of the job's step time it costs (0 to 1): how "
                              "findings are ordered"),
    Column("cost_s_per_step", "float", "what it costs the job per step, in seconds "
                                       "(evidence.cost; null where not measured)"),
    Column("cost_share", "float", "that cost as a share of the step (evidence.cost)"),
    Column("summary", "text", "what is wrong, in words, with the numbers"),
    Column("fix", "text", "what usually fixes it"),
    Column("evidence", "text", "the numbers behind it, as JSON (unit-named keys)"),
)
