"""``rtop export RUN --parquet DIR``: a recorded run as Parquet files (see
:mod:`rtop.export` for what each file holds).

The recording is read twice, both times through :mod:`rtop.run.recording` only: once by
:func:`rtop.report.build_report` (the run, its ranks and the findings, exactly as
``rtop report --json`` gives them, spools merged the same way), once by
:func:`rtop.run.recording.replay` into a :class:`~rtop.export.rows.RowCollector` that
streams the measurement tables to their files in chunks. The spools the report merged
are applied after the recording, as the report applies them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors import wire
from collectors.figures import figures
from rtop import __version__
from rtop.analysis import AnalysisConfig
from rtop.export.columns import FINDINGS, Column, Kind, named_kind
from rtop.export.parquet import ParquetTables, partial_path, require_pyarrow
from rtop.export.rows import CHUNK_ROWS, TABLE_FILES, RowCollector
from rtop.report import build_report
from rtop.run.recording import ReadResult, replay
from rtop.run.spool import SpoolError, read_spool
from rtop.run.state import RankState, RunState
from rtop.run.validate import ProtocolError

#: The tables written beside the measurements, from the report.
REPORT_TABLES = ("findings", "ranks")
#: The run's header, beside the tables.
RUN_JSON = "run.json"
#: What the times in every table are.
TIME_DOC = ("float64 seconds since the Unix epoch (1970-01-01 UTC); t_hub, t_wall_hub, "
            "since and until on the hub's clock, t_wall on the rank's own clock")
#: The ranks table's first columns (the rest are the report's per-rank keys, in order).
_RANK_KEYS = ("rank", "attempt", "group", "job", "node")
#: Docs of the report's per-rank figures, by their key.
_REPORT_DOCS = {f.key: f"{f.report} over the run of {f.name}: {f.doc}"
                for f in figures() if f.report is not None}


class ExportError(Exception):
    """An export that cannot be made as asked; the message says why (nothing written)."""


@dataclass
class ExportResult:
    """What an export wrote, and what the reading found."""

    directory: Path
    files: list[Path]
    rows: dict[str, int]
    header: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def export_parquet(run: str | Path, directory: str | Path, *, force: bool = False,
                   thresholds: AnalysisConfig | None = None,
                   spools: Iterable[str | Path] = (), find_spools: bool = True,
                   spool_dir: Path | None = None,
                   chunk_rows: int = CHUNK_ROWS) -> ExportResult:
    """Export recording ``run`` as Parquet files in ``directory`` (made 0700 if new).

    Refuses (:class:`ExportError`, nothing written) when a file it would write is
    there already, unless ``force``. Raises :class:`rtop.export.parquet.MissingExtra`
    without pyarrow, :class:`ExportError` without the recording and
    :class:`collectors.wire.WireError` when it is not one. A recording cut short is
    exported up to its last whole frame, and ``warnings`` say so. A table's rows are
    written ``chunk_rows`` at a time (one Parquet row group each).
    """
    require_pyarrow()
    path = Path(run)
    if not path.is_file():
        raise ExportError(f"no such file: {path}")
    out = Path(directory)
    files = [*TABLE_FILES, *REPORT_TABLES]
    targets = [out / f"{name}.parquet" for name in files] + [out / RUN_JSON]
    _check_targets(out, targets, force)
    report = build_report(path, thresholds, spools=spools, find_spools=find_spools,
                          spool_dir=spool_dir)
    made = _make_directory(out, targets)
    tables = ParquetTables(out, {"rtop.version": __version__,
                                 "rtop.source": str(path.resolve())})
    try:
        collector = RowCollector(tables.write, chunk_rows)
        for name in collector.files:
            tables.open(name, collector.columns(name))
        # the rows need the ranks' identities and offsets, not their rolling windows
        state, res = replay(path, RunState(window_steps=2, window_samples=2),
                            on_frame=collector.on_frame, result=ReadResult())
        merged = _apply_spools(state, collector, report, res)
        collector.finish()
        nodes = _nodes(report)
        tables.write_table("findings", FINDINGS, _findings(report, nodes))
        rank_columns, rank_data = _ranks(report)
        tables.write_table("ranks", rank_columns, rank_data)
        rows = {**collector.rows, "findings": len(report["findings"]),
                "ranks": len(rank_data["rank"])}
        warnings = _warnings(report, res, collector)
        header = _header(path, report, state, res, rows, merged, warnings)
        tables.write_json(RUN_JSON, header)
        written = tables.finals()
        tables.commit()
    except BaseException:
        tables.abort()
        if made:
            with contextlib.suppress(OSError):  # not empty: someone else's files
                out.rmdir()
        raise
    return ExportResult(out, written, rows, header, warnings)


def _check_targets(out: Path, targets: list[Path], force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is there and is not a directory")
    if force:
        return
    there = [p for p in targets if p.exists() or p.is_symlink()]
    if there:
        names = ", ".join(p.name for p in there[:4]) + (" …" if len(there) > 4 else "")
        raise ExportError(f"{out} already holds {names}: nothing was written; pass --force "
                          f"to replace them, or export to another directory")
    stale = [partial_path(p) for p in targets if partial_path(p).exists()]
    if stale:
        raise ExportError(f"{out} holds {stale[0].name}, left by another export (running "
                          f"now, or killed): nothing was written; remove it or pass --force")


def _make_directory(out: Path, targets: list[Path]) -> bool:
    """The output directory, made 0700 (its parents as the umask says) if it is new:
    whether it was made."""
    if out.is_dir():
        for target in targets:  # --force: a killed export's leftovers
            partial_path(target).unlink(missing_ok=True)
        return False
    out.mkdir(mode=0o700, parents=True)
    os.chmod(out, 0o700)  # whatever the umask
    return True


def _apply_spools(state: RunState, collector: RowCollector, report: dict[str, Any],
                  res: ReadResult) -> list[str]:
    """Apply the spools the report merged (after the recording, at its last hub time,
    as the report applies them); their paths."""
    merged = [str(s["path"]) for s in report["run"].get("spools") or []
              if s.get("source") == "merged" and s.get("path")]
    for spool_path in merged:
        try:
            spool = read_spool(spool_path)
        except SpoolError as exc:  # gone since the report read it
            res.warnings.append(f"spool {spool_path}: {exc}")
            continue
        peer: RankState | None = None
        t = state.now
        for _, frame in spool.frames:
            try:
                rs = state.apply(frame, t, peer=peer)
            except ProtocolError:
                if frame.kind == wire.KIND_HELLO:
                    break
                continue
            if frame.kind == wire.KIND_HELLO:
                peer = rs
            collector.on_frame(t, frame, state)
    return merged


def _nodes(report: dict[str, Any]) -> dict[int, str]:
    """Each rank's node: the newest attempt's where a rank ran in several."""
    nodes: dict[int, str] = {}
    for attempt in report["attempts"]:
        for r in attempt["ranks"]:
            nodes[r["rank"]] = r["node"]
    return nodes


def _findings(report: dict[str, Any], nodes: dict[int, str]) -> dict[str, list[Any]]:
    data: dict[str, list[Any]] = {c.name: [] for c in FINDINGS}
    for f in report["findings"]:
        ranks = [r for r in f.get("ranks") or [] if isinstance(r, int)]
        evidence = f.get("evidence")
        cost = evidence.get("cost") if isinstance(evidence, dict) else None
        cost = cost if isinstance(cost, dict) else {}
        row = {**f, "ranks": ranks,
               "nodes": sorted({nodes[r] for r in ranks if r in nodes}),
               "cost_s_per_step": _number(cost.get("s_per_step")),
               "cost_share": _number(cost.get("share")),
               "evidence": _json(evidence)}
        for c in FINDINGS:
            data[c.name].append(row.get(c.name))
    return data


def _ranks(report: dict[str, Any]) -> tuple[tuple[Column, ...], dict[str, list[Any]]]:
    """Every rank of every attempt, with the report's per-rank keys: numbers and text
    as they are, maps and lists (collectives, hiccups, notes, ...) as JSON text."""
    entries = [{"group": a["group"], "job": a["job"], **r}
               for a in report["attempts"] for r in a["ranks"]]
    keys = list(_RANK_KEYS)
    for e in entries:
        keys += [k for k in e if k not in keys]
    columns = []
    data: dict[str, list[Any]] = {}
    for key in keys:
        values = [e.get(key) for e in entries]
        kind = _infer(key, values)
        if any(isinstance(v, (dict, list)) for v in values):
            values = [None if v is None else _json(v) for v in values]
        elif kind == "int":
            values = [None if v is None else int(v) for v in values]
        columns.append(Column(key, kind, _REPORT_DOCS.get(key, "")))
        data[key] = values
    return tuple(columns), data


def _infer(name: str, values: list[Any]) -> Kind:
    """A report column's kind: what its name says (``_s`` float, ``_bytes`` int, ...)
    where its values agree, else what its values are; maps and lists are JSON text."""
    present = [v for v in values if v is not None]
    if any(isinstance(v, (dict, list, str)) for v in present):
        return "text"
    if present and all(isinstance(v, bool) for v in present):
        return "bool"
    whole = all(isinstance(v, int) or (isinstance(v, float) and v.is_integer())
                for v in present)
    named = named_kind(name)
    if named == "int" and whole:
        return "int"
    if named is not None and named != "int":
        return named
    if not present:
        return "text"
    return "int" if all(type(v) is int for v in present) else "float"


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _json(obj: Any) -> str:
    return json.dumps(obj, allow_nan=False, default=str, sort_keys=True)


def _warnings(report: dict[str, Any], res: ReadResult, collector: RowCollector) -> list[str]:
    out = list(res.warnings)
    out += [w for w in report["run"]["warnings"] if w not in out]
    if report["run"]["frames"] != res.frames:
        out.append(f"the recording changed while it was exported: the findings were made "
                   f"from {report['run']['frames']} frames, the tables from {res.frames}")
    out += [f"{name}: {n} value{'s' if n != 1 else ''} not a whole number (or beyond int64) "
            f"written as null" for name, n in collector.bad_values.items()]
    return out


def _header(path: Path, report: dict[str, Any], state: RunState, res: ReadResult,
            rows: dict[str, int], merged: list[str], warnings: list[str]) -> dict[str, Any]:
    """The run's header (``run.json``)."""
    run = report["run"]
    return {
        "format": "rtop export 1",
        "rtop_version": __version__,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": str(path.resolve()),
        "name": run["name"],
        "job": run["job"],
        "world_size": run["world_size"],
        "attempts": run["attempts"],
        "started": state.started,
        "ended": res.last_t_hub,
        "duration_s": (state.now - state.started) if state.started else 0.0,
        "hub": run.get("hub"),
        "frames": res.frames,
        "truncated": res.truncated,
        "closed": res.closed,
        "cut": res.cut(),
        "warnings": warnings,
        "spools_merged": merged,
        "time": TIME_DOC,
        "tables": {name: {"file": f"{name}.parquet", "rows": n} for name, n in rows.items()},
    }
