"""What ``rtop export --parquet`` costs beside ``rtop report`` on the same recording.

Writes a simulated fleet (``rtop.fleetsim``, through the hub's recorder) of ``--ranks``
ranks for ``--duration`` seconds, then times, alternately and ``--repeat`` times each,
``build_report`` (what ``rtop report`` runs) and ``export_parquet`` (the report, then a
second replay that streams the tables to Parquet), and prints the medians side by side,
their ratio, the rows exported per second and the size of the files against the
recording's.

    python benchmarks/export_speed.py [--ranks 256] [--duration 120] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtop.export.exporter import export_parquet
from rtop.fleetsim import FleetSpec, write_recording
from rtop.report import build_report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "fleet.rtop"
        write_recording(run, FleetSpec(ranks=args.ranks, seed=1, duration_s=args.duration),
                        "starved")
        report_s, export_s = [], []
        rows = 0
        size = 0
        for i in range(args.repeat):
            t = time.perf_counter()
            build_report(run, find_spools=False)
            report_s.append(time.perf_counter() - t)
            out = Path(tmp) / f"out{i}"
            t = time.perf_counter()
            result = export_parquet(run, out, find_spools=False)
            export_s.append(time.perf_counter() - t)
            rows = sum(result.rows.values())
            size = sum(p.stat().st_size for p in result.files)
            shutil.rmtree(out)
        rep, exp = statistics.median(report_s), statistics.median(export_s)
        print(f"recording: {args.ranks} ranks x {args.duration:.0f} s, "
              f"{run.stat().st_size / 1e6:.1f} MB")
        print(f"rtop report  median {rep:6.2f} s  ({', '.join(f'{x:.2f}' for x in report_s)})")
        print(f"rtop export  median {exp:6.2f} s  ({', '.join(f'{x:.2f}' for x in export_s)})")
        print(f"export / report: {exp / rep:.2f}x; {rows:,} rows, {rows / exp:,.0f} rows/s; "
              f"Parquet {size / 1e6:.1f} MB ({size / run.stat().st_size:.2f}x the recording)")


if __name__ == "__main__":
    main()
