"""``rtop export RUN --parquet DIR``: a recorded run as Parquet files, for notebooks
(pandas, polars, DuckDB). Needs pyarrow: ``pip install "rtop-train[export]"``.

One file per table in ``DIR`` (made 0700 if new; files 0600; an existing file is
replaced only with ``--force``), and ``run.json``, the run's header (job, hub, start,
rtop version, the source recording, whether it was cut short, each table's rows):

* ``steps``, ``gpu``, ``host``, ``mem``, ``heartbeats``, ``events``: one row per record
  a rank sent (``collectors.schema``): ``rank``, ``attempt``, ``group``, ``job``,
  ``node``, ``t_hub`` (when the hub had it), then the record's fields named as
  ``collectors.figures`` names them (``gpu_util_pct``, ``mem_peak_bytes``, ``step_s``),
  with ``t_wall_hub`` (the rank's ``t_wall`` on the hub's clock) after ``t_wall``;
* ``collectives``: one row per step and collective it ran (op, its time, bytes, calls,
  bus bandwidth), ``process_group`` null; where the job's collectives ran on several
  process groups (tensor, pipeline, data parallel), also one row per step, group and
  collective, ``process_group`` the group's name;
* ``ranks``: one row per rank of each attempt, with what ``rtop report --json`` says of
  it (node, status, steps, the medians over the run, clock offset, ...);
* ``findings``: every finding of the diagnosis over the run, as ``rtop report`` makes
  them (kind, severity, ranks, nodes, since, until, impact, summary, fix, evidence).

Times are float64 seconds since the Unix epoch; durations float64 seconds; bytes and
counts int64; not measured is null, never 0 (:mod:`rtop.export.columns`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "main"]


def add_parser(sub: Any) -> None:
    """Declare ``rtop export`` on the CLI's subparsers (``sub``)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "export", help="write a recorded run as Parquet files (pandas, polars, DuckDB)",
        description="Write a recorded run as one Parquet file per table (steps, gpu, host, "
                    "mem, heartbeats, events, collectives, ranks, findings) and run.json, "
                    "for notebooks. Needs pyarrow: pip install \"rtop-train[export]\".")
    p.add_argument("run", help="a recording (.rtop); may still be being written")
    p.add_argument("--parquet", required=True, metavar="DIR",
                   help="the directory to write to (made 0700 if it does not exist)")
    p.add_argument("--force", action="store_true",
                   help="replace files a previous export left in DIR")
    p.add_argument("--spool", action="append", default=[], metavar="PATH",
                   help="merge this spool file, as `rtop report --spool` does; repeatable")
    p.add_argument("--no-spools", action="store_true",
                   help="do not look for this run's spools in the runtime directory")
    p.add_argument("--thresholds", default=None, metavar="FILE",
                   help="JSON file of diagnosis thresholds (for the findings)")


def main(args: argparse.Namespace) -> int:
    """Run ``rtop export``: 0 when written (a recording cut short too, with a warning),
    1 without pyarrow, 2 for a missing or bad recording, bad thresholds or files that
    would be overwritten without ``--force``."""
    from rtop.export.parquet import MissingExtra, require_pyarrow

    try:
        require_pyarrow()
    except MissingExtra as exc:
        print(f"rtop export: {exc}", file=sys.stderr)
        return 1
    from collectors.wire import WireError
    from rtop.analysis import AnalysisConfig
    from rtop.export.exporter import ExportError, export_parquet

    try:
        thresholds = AnalysisConfig.load(args.thresholds)
    except (OSError, ValueError) as exc:
        print(f"rtop export: bad thresholds: {exc}", file=sys.stderr)
        return 2
    try:
        result = export_parquet(args.run, args.parquet, force=args.force,
                                thresholds=thresholds, spools=args.spool,
                                find_spools=not args.no_spools)
    except (WireError, ExportError) as exc:
        print(f"rtop export: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the directory cannot be made or written
        print(f"rtop export: {exc}", file=sys.stderr)
        return 2
    for warning in result.warnings:
        print(f"rtop export: warning: {warning}", file=sys.stderr)
    cut = result.header.get("cut")
    if cut:
        print(f"rtop export: note: {cut}; exported up to there", file=sys.stderr)
    rows = ", ".join(f"{name} {n:,}" for name, n in result.rows.items())
    print(f"rtop export: wrote {len(result.files)} files to {result.directory} "
          f"(rows: {rows})")
    return 0
