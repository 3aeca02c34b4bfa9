"""One benchmark, an earlier revision against this one, side by side in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_revisions.py --before /tmp/before --repeat 3 -- \\
        tui_speed.py --quick

runs ``benchmarks/<script> ARGS`` from the earlier checkout and from this one, in turn
(before, after, before, after, ...: a noisy neighbour hits both alike), with the same
interpreter, each on its own code (``PYTHONPATH`` set to its checkout). Every figure a
benchmark prints as ``label   number unit`` (a number after two spaces or a colon,
with a unit: us, ms, s, Hz, MB, GB, %) is collected; the table gives each figure's
median over the runs for both revisions and their ratio (after / before). Which
direction is better depends on the figure: times lower, rates higher.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
UNITS = r"(?P<unit>us|µs|ms|s|Hz|MB|GB|%|x)(?=[\s,;)]|$)"
NUMBER = r"(?P<value>[-+]?\d[\d,]*(?:\.\d+)?)\s?"
#: up to two lower-case words may stand between a label and its number ("hub CPU   median
#: 32% of one core", "snapshot  build median 32 ms"): they are part of the label
FIGURE = re.compile(r"^\s*(?P<label>\S.*?)(?::\s+|\s{2,})(?P<words>(?:[a-z]+ ){0,2})" + NUMBER
                    + UNITS)
MORE = re.compile(r"(?<=\s)" + NUMBER + UNITS)


def figures(output: str) -> dict[str, tuple[float, str]]:
    """``label -> (value, unit)`` for each figure line of a benchmark's output (the first
    line of a label). A line's first figure is named by its label, the next ones by the
    label and their place (``label [2]``, ...); a range such as ``0.98-1.05x`` is not a
    figure."""
    out: dict[str, tuple[float, str]] = {}
    for line in output.splitlines():
        m = FIGURE.match(line)
        if m is None:
            continue
        label = " ".join((m["label"].rstrip(":") + " " + m["words"]).split())
        if not label or label in out:
            continue
        out[label] = (float(m["value"].replace(",", "")), m["unit"])
        for i, more in enumerate(MORE.finditer(line, m.end()), 2):
            out[f"{label} [{i}]"] = (float(more["value"].replace(",", "")), more["unit"])
    return out


def run(tree: Path, script: str, args: list[str], timeout: float) -> tuple[str, float]:
    """The output of ``benchmarks/SCRIPT ARGS`` run on the code of ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{tree}: {script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                 f"\n{proc.stderr[-2000:]}")
    return proc.stdout, took


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, type=Path,
                    help="a checkout of the earlier revision (git worktree add DIR COMMIT)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per revision (default 3)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="also write each run's output to DIR")
    ap.add_argument("script", help="a benchmark in benchmarks/, e.g. tui_speed.py")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    opts = ap.parse_args(argv)
    args = [a for a in opts.args if a != "--"]
    trees = {"before": opts.before.resolve(), "after": HERE}
    seen: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    units: dict[str, str] = {}
    for i in range(opts.repeat):
        for name, tree in trees.items():
            out, took = run(tree, opts.script, args, opts.timeout)
            print(f"run {i + 1}/{opts.repeat} {name:6} {took:6.0f} s", flush=True)
            if opts.keep is not None:
                opts.keep.mkdir(parents=True, exist_ok=True)
                (opts.keep / f"{name}-{i + 1}.txt").write_text(out)
            for label, (value, unit) in figures(out).items():
                seen[name].setdefault(label, []).append(value)
                units[label] = unit
    labels = [k for k in seen["after"] if k in seen["before"]]
    width = max((len(k) for k in labels), default=10)
    print(f"\n{opts.script} {' '.join(args)}: medians of {opts.repeat} runs each, "
          f"before = {trees['before']}, after = {trees['after']}")
    print(f"{'figure':<{width}}  {'before':>12}  {'after':>12}  {'after/before':>12}")
    for k in labels:
        b, a = statistics.median(seen["before"][k]), statistics.median(seen["after"][k])
        ratio = f"{a / b:.3f}" if b else "n/a"
        print(f"{k:<{width}}  {b:>9.4g} {units[k]:<2}  {a:>9.4g} {units[k]:<2}  {ratio:>12}")
    gone = [k for k in seen["before"] if k not in seen["after"]]
    if gone:
        print(f"(only before: {', '.join(gone)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
