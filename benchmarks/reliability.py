"""``make reliability``: what rtop does when things go wrong, and what it costs the job
meanwhile, written to ``docs/reliability.md``.

1. **The fault suite** (``tests/test_faults_*.py``, the spool and lost-culprit tests,
   the hub-killed, hub-absent and stalled-hub tests, the control actions that meet a
   dying rank), run with ``RTOP_RELIABILITY_LONG=1`` (longer faults) and
   ``RTOP_RELIABILITY_OUT`` (each test's :func:`tests.reliability.record` rows: the
   fault, the outcome, what was lost, its figures). A test that records nothing is
   listed after the table, by its name and its result (a failed one gets a row).
2. **The bad-input suite** (``tests/test_security_*.py``, ``tests/test_fuzz.py``): one
   row per test, the input it tries (the test's name) and the result.
3. **The overhead under faults**: the same real 2-rank gloo DDP job (``rtop.workload``'s
   MLP) run whole, again and again, in shuffled rounds: without rtop (twice: the second
   is an A/A control, the noise floor), with the hub up, with it unreachable, with it
   overloaded (``rtop serve`` SIGSTOPped 3 s of every 4), and during a control action
   (a profile of 30 steps; a link probe). Medians of the step time and each one's ratio
   to the same round's job without rtop; for the actions, the steps the action touched
   too.

The fault suite includes the relay faults (``tests/test_faults_relay.py``: a node's
relay killed, cut off from the hub, impersonated by hostile relays, overloaded).

    python benchmarks/reliability.py [--rounds 5] [--job-s 6] [--no-tests]
        [--no-overhead] [--out docs/reliability.md]
    python benchmarks/reliability.py --only tests/test_faults_relay.py [...]

``--only`` runs just those tests of the fault suite (no bad-input suite, no overhead)
and updates the document in place: their rows replace the ones the last run gave them,
rows of tests that no longer exist are removed, the rest is kept as it was, and the
header says what was run when.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collectors import auth  # noqa: E402
from rtop.client import HubClient  # noqa: E402
from rtop.workload import WorkloadSpec, free_port, run_local  # noqa: E402

#: The fault suite: every test of these files, and these tests of others.
FAULT_FILES = ("tests/test_faults_*.py", "tests/test_spool.py", "tests/test_acks.py",
               "tests/test_lost_culprit.py")
FAULT_TESTS = (
    "tests/test_hub_lifecycle.py::test_hub_killed_and_restarted_under_a_live_job",
    "tests/test_hub_lifecycle.py::test_truncated_recording_replays_up_to_the_last_whole_frame",
    "tests/test_sender.py::test_hub_absent_from_start_then_appears",
    "tests/test_sender.py::test_stalled_hub_costs_frames_not_training",
    "tests/test_sender.py::test_unreachable_hub_bounds_unsent_bytes_while_training",
    "tests/test_sender.py::test_close_is_bounded_with_an_unroutable_hub",
    "tests/test_control.py::test_a_rank_killed_during_a_probe_ends_it_for_everyone",
    "tests/test_control.py::test_a_rank_killed_during_a_profile_is_named_and_rtop_holds_no_one",
    "tests/test_control.py::test_a_hung_rank_answers_stacks_and_a_probe_starts_nowhere",
    "tests/test_control.py::test_a_rank_that_never_answers_is_named_by_the_deadline",
    "tests/test_ingest_pause.py::test_the_hub_pauses_its_ranks_for_a_recorder_behind_and_loses_none",
)
BAD_INPUT_FILES = ("tests/test_security_*.py", "tests/test_fuzz.py")
MASTER = "reliability-benchmark-master-token-0123456789"
WARMUP = 20  # steps of each job not counted (start-up)
PROFILE_STEPS = 30


# ---- 1 and 2: the suites ---------------------------------------------------------------


def _files(patterns: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for pat in patterns:
        out += sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / pat)))
    return out


def run_pytest(targets: list[str], junit: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run pytest on ``targets``; its exit status and how long it took."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *targets], cwd=ROOT, env=env)
    return proc.returncode, time.monotonic() - t0


def junit_cases(path: Path) -> list[dict[str, Any]]:
    """Each test case of a JUnit XML file: id, result, seconds, message."""
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        file = cls.replace(".", "/") + ".py"
        result, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                result = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                message = (el.get("message") or "").splitlines()[0][:160] if \
                    el.get("message") else ""
                break
        out.append({"id": f"{file}::{name}", "file": file, "name": name, "result": result,
                    "seconds": float(case.get("time") or 0.0), "message": message})
    return out


def _humanize(name: str) -> str:
    base, _, param = name.partition("[")
    words = base.removeprefix("test_").replace("_", " ")
    return words + (f" [{param.rstrip(']')}]" if param else "")


# ---- 3: overhead ---------------------------------------------------------------------


def _serve(port: int, record: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "rtop", "serve", "--port", str(port),
                             "--token", MASTER, "--record", str(record)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("rtop serve did not start")


class _Job:
    """A job on a thread; the wall time its ranks began training."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self.results: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.results = run_local(self.spec, timeout_s=600)

    def started(self, timeout: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout
        marks = [Path(self.spec.fault_mark_dir or "", f"fault-rank{r}") for r in (0, 1)]
        while time.monotonic() < deadline and self.thread.is_alive():
            if all(m.exists() for m in marks):
                return True
            time.sleep(0.05)
        return False


def run_config(name: str, job_s: float, hub: subprocess.Popen[str], address: str,
               dead: str, base: dict[str, Any]) -> dict[str, Any]:
    """One job in one configuration: its step times and, for an action, which steps
    the action touched."""
    marks = tempfile.mkdtemp(prefix="rtop-rel-")
    ingest = auth.role_token(MASTER, "ingest")
    kw: dict[str, Any] = {"duration_s": job_s, "fault_mark_dir": marks, **base}
    if name.startswith("no rtop"):
        spec = WorkloadSpec(instrument=False, **kw)
    elif name == "collectors, hub unreachable":
        spec = WorkloadSpec(hub=dead, token=ingest, **kw)
    else:
        spec = WorkloadSpec(hub=address, token=ingest, **kw)
    job = _Job(spec)
    touched: list[int] = []
    if not job.started():
        job.thread.join()
        raise RuntimeError(f"{name}: the job never started")
    if name == "collectors, hub overloaded":
        while job.thread.is_alive():
            hub.send_signal(signal.SIGSTOP)
            job.thread.join(3.0)
            hub.send_signal(signal.SIGCONT)
            job.thread.join(1.0)
    elif name.startswith("during a "):
        time.sleep(min(3.0, job_s / 3))
        control = auth.role_token(MASTER, "control")
        with HubClient(address, control, role="control") as c:
            if name == "during a profile":
                out = c.act("profile", args={"steps": PROFILE_STEPS,
                                             "dir": tempfile.mkdtemp(prefix="rtop-prof-")},
                            timeout_s=120)
                touched = list(range(out["at_step"], out["at_step"] + PROFILE_STEPS))
            else:
                out = c.act("probe", args={"bytes": 1 << 20}, timeout_s=120)
                touched = [out["at_step"]]
        if out["errors"] or out["missing"]:
            raise RuntimeError(f"{name}: {out['errors']} {out['missing']}")
    job.thread.join()
    times = [t for r in job.results for t in r["times"][WARMUP:]]
    at = [t for r in job.results for i, t in enumerate(r["times"]) if i in set(touched)]
    dropped = sum(r.get("stats", {}).get("dropped_unsent", 0) for r in job.results)
    return {"median": statistics.median(times), "touched": at, "dropped": dropped,
            "steps": len(times)}


CONFIGS = ("no rtop", "no rtop (A/A control)", "collectors, hub up",
           "collectors, hub unreachable", "collectors, hub overloaded", "during a profile",
           "during a probe")


def overhead(rounds: int, job_s: float) -> dict[str, Any]:
    """Every configuration, ``rounds`` times in shuffled order; per configuration the
    median step time of each round and its ratio to that round's job without rtop."""
    port = free_port()
    address, dead = f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"
    tmp = Path(tempfile.mkdtemp(prefix="rtop-rel-hub-"))
    # what the ranks leave behind (a spool when the hub is unreachable) stays in tmp
    (tmp / "xdg").mkdir(mode=0o700)
    os.environ.update(XDG_RUNTIME_DIR=str(tmp / "xdg"), RTOP_RUNS_DIR=str(tmp / "runs"),
                      RTOP_AUTOHUB="0")
    hub = _serve(port, tmp / "bench.rtop")
    rng = random.Random(15)
    per: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    base = {"world_size": 2}
    try:
        for r in range(rounds):
            order = list(CONFIGS)
            rng.shuffle(order)
            for name in order:
                res = run_config(name, job_s, hub, address, dead, base)
                per[name].append(res)
                print(f"round {r + 1}/{rounds}  {name:<30} median "
                      f"{res['median'] * 1e3:7.2f} ms", flush=True)
    finally:
        hub.send_signal(signal.SIGCONT)
        hub.send_signal(signal.SIGINT)
        try:
            hub.wait(15)
        except subprocess.TimeoutExpired:
            hub.kill()
    rows = []
    for name in CONFIGS:
        meds = [x["median"] for x in per[name]]
        ratios = [x["median"] / b["median"] for x, b in zip(per[name], per["no rtop"],
                                                              strict=True)]
        row: dict[str, Any] = {"config": name, "median_ms": statistics.median(meds) * 1e3,
                               "ratio": statistics.median(ratios),
                               "ratio_min": min(ratios), "ratio_max": max(ratios),
                               "dropped": sum(x["dropped"] for x in per[name])}
        touched = [t for x in per[name] for t in x["touched"]]
        if touched:
            bare = statistics.median(x["median"] for x in per["no rtop"])
            row["touched_ms"] = statistics.median(touched) * 1e3
            row["touched_ratio"] = statistics.median(touched) / bare
            row["touched_n"] = len(touched)
        rows.append(row)
        print(f"{name:<30} {row['median_ms']:7.2f} ms  ratio {row['ratio']:.3f} "
              f"[{row['ratio_min']:.3f}-{row['ratio_max']:.3f}]"
              + (f"  touched steps {row['touched_ms']:.1f} ms ({row['touched_ratio']:.2f}x)"
                 if touched else ""), flush=True)
    return {"rows": rows, "rounds": rounds, "job_s": job_s}


# ---- the document --------------------------------------------------------------------


def _md(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _figures(fig: dict[str, Any]) -> str:
    parts = []
    for k, v in fig.items():
        if k.endswith("_ratio") and isinstance(v, (int, float)):
            parts.append(f"{k.removesuffix('_ratio').replace('_', ' ')} {v:.3f}×")
        else:
            parts.append(f"{k.replace('_', ' ')} {v}")
    return "; ".join(parts)


def _fault_row(f: dict[str, Any]) -> str:
    """A measured fault's row of the table."""
    return (f"| {_md(f['fault'])} | {_md(f['outcome'])} | {_md(f['lost'])} | "
            f"{_md(_figures(f['figures']))} | `{_md(f['test'])}` | "
            f"{_md(f['result'])} ({f['seconds']:.0f} s) |")


def _asserted_item(f: dict[str, Any]) -> str:
    """A fault test that measured nothing for the table: its line after it."""
    return f"- {_md(f['fault'])}: {f['result']} ({f['seconds']:.0f} s), `{_md(f['test'])}`"


def _also(n: int) -> str:
    return (f"Also in the fault suite: {n} tests that assert their outcome and measure no "
            "figure for this table.")


def write_doc(out: Path, command: str, started: float, took: float,
              faults: list[dict[str, Any]], bad: list[dict[str, Any]],
              suite_rc: dict[str, tuple[int, float]], over: dict[str, Any] | None,
              missing: list[str]) -> None:
    """``docs/reliability.md`` from what this run measured."""
    load = os.getloadavg()
    lines = [
        "# rtop under faults: what happens, what is lost, what it costs",
        "",
        "Written by `make reliability` (`benchmarks/reliability.py`); every figure below "
        "comes from the run it describes. Do not edit by hand: run it again.",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{took / 60:.1f} minutes",
        f"- machine: {os.cpu_count()} cores ({_md(_cpu_model())}), {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}; load average at the "
        f"end {load[0]:.1f} (the cores are shared with other work: read medians and "
        f"ratios, not single figures)",
        f"- command: `{command}`",
        "",
        "## Faults",
        "",
        "Each fault is a real job (real processes, real sockets, real network namespaces "
        "and file systems where it says so), run with `RTOP_RELIABILITY_LONG=1`. *Lost* "
        "is what did not reach the hub or the recording and was not counted (the target "
        "is zero); what the ranks' bounded buffers dropped is counted and shown.",
        "",
    ]
    for label, (rc, secs) in suite_rc.items():
        lines.append(f"- {label}: pytest exit status {rc}, {secs:.0f} s")
    if missing:
        lines.append(f"- not found (not run): {', '.join(missing)}")
    # a row for each fault that measured something (or failed); the suite's smaller
    # tests, which assert their outcome without figures, listed after the table
    measured = [f for f in faults if f["outcome"] is not None]
    asserted = [f for f in faults if f["outcome"] is None]
    lines += ["", "| fault | outcome | lost | figures | test | result |",
              "|---|---|---|---|---|---|"]
    lines += [_fault_row(f) for f in measured]
    if asserted:
        lines += ["", _also(len(asserted)), ""]
        lines += [_asserted_item(f) for f in asserted]
    lines += ["", "## Bad input", "",
              "The security issue's tests: each sends a hub, a rank or a reader something "
              "hostile or malformed and asserts what rtop does with it (refuse, bound, "
              "redact, survive). The fuzzers run 10,000 cases per property here "
              "(`make test`: 10,000 per target, shared among its properties; `make fuzz`: "
              "1,000,000 per property).", "",
              "| input | outcome | test |", "|---|---|---|"]
    for b in bad:
        outcome = b["result"] + (f": {b['message']}" if b["message"] else "")
        lines.append(f"| {_md(b['input'])} | {_md(outcome)} ({b['seconds']:.1f} s) | "
                     f"`{_md(b['id'])}` |")
    if over is not None:
        lines += [
            "", "## What rtop costs the job under faults", "",
            f"A real 2-rank gloo DDP job (`rtop.workload`'s MLP: 256 → 512 → 512 → 1, "
            f"batch 64), run whole for {over['job_s']:.0f} s per configuration, "
            f"{over['rounds']} rounds in shuffled order; the hub is `rtop serve` in its own "
            f"process (not niced) on the same 2 cores. Median step time over both ranks "
            f"(the first {WARMUP} steps of each job left out), and the median over rounds "
            f"of its ratio to the same round's job without rtop, with the lowest and "
            f"highest round. \"Touched steps\": for an action, the steps it ran in (a "
            f"profile's {PROFILE_STEPS} captured steps; the probe's one step).", "",
            "| configuration | median step | ratio to no rtop [range] | touched steps | "
            "records dropped |", "|---|---|---|---|---|"]
        for r in over["rows"]:
            touched = (f"{r['touched_ms']:.1f} ms ({r['touched_ratio']:.2f}×, "
                       f"{r['touched_n']} steps)") if "touched_ms" in r else "—"
            lines.append(f"| {r['config']} | {r['median_ms']:.2f} ms | {r['ratio']:.3f}× "
                         f"[{r['ratio_min']:.3f}–{r['ratio_max']:.3f}] | {touched} | "
                         f"{r['dropped']} |")
        lines += ["", "The A/A control's distance from 1.000× (and its range) is this "
                  "machine's noise for a job of this length; a difference smaller than it "
                  "is not resolved here. A profile's captured steps carry torch.profiler's "
                  "own cost and a probe's step its transfers, by design: the touched-steps "
                  "column shows how much, the median step the whole job's share."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def test_exists(test_id: str) -> bool:
    """Whether a test id (``tests/f.py::name[param]``) names a test function that is
    still in its file."""
    file, _, name = test_id.partition("::")
    path = ROOT / file
    return path.exists() and f"def {name.partition('[')[0]}(" in path.read_text()


def update_doc(out: Path, command: str, started: float, targets: list[str],
               rc: tuple[int, float], faults: list[dict[str, Any]]) -> None:
    """Put the rows of the fault tests just run (``targets``) into the document a full
    run wrote: they replace that run's rows of the same tests; rows of tests that no
    longer exist go; everything else stays as it was."""
    lines = out.read_text().splitlines()

    def test_of(line: str) -> str | None:
        ids = [t for t in line.split("`") if t.startswith("tests/") and "::" in t]
        return ids[-1] if ids else None

    def stale(line: str) -> bool:
        test = test_of(line)
        if test is None or not (line.startswith("| ") or line.startswith("- ")):
            return False
        return not test_exists(test) or any(test == t or test.startswith(t + "::")
                                            for t in targets)

    end = lines.index("## Bad input") if "## Bad input" in lines else len(lines)
    head = [ln for ln in lines[:end] if not stale(ln)]
    rows = [i for i, ln in enumerate(head) if ln.startswith("| ") and test_of(ln)]
    at = (rows[-1] + 1) if rows else head.index("|---|---|---|---|---|---|") + 1
    head[at:at] = [_fault_row(f) for f in faults if f["outcome"] is not None]
    items = [i for i, ln in enumerate(head) if ln.startswith("- ") and test_of(ln)]
    new_items = [_asserted_item(f) for f in faults if f["outcome"] is None]
    if items:
        head[items[-1] + 1:items[-1] + 1] = new_items
    elif new_items:
        head += ["", _also(0), "", *new_items, ""]
    n = sum(1 for ln in head if ln.startswith("- ") and test_of(ln))
    head = [_also(n) if ln.startswith("Also in the fault suite:") else ln for ln in head]
    ran = f"ran {', '.join(f'`{t}`' for t in targets)} again"
    head = [ln for ln in head if not (ln.startswith("- updated ") and ran in ln)]
    at = next(i for i, ln in enumerate(head) if ln.startswith("- command:")) + 1
    head.insert(at, f"- updated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}"
                f": `{command}` {ran} (pytest "
                f"exit status {rc[0]}, {rc[1]:.0f} s; load average at the end "
                f"{os.getloadavg()[0]:.1f}): their rows below are from that run, the rest "
                f"from the run above")
    out.write_text("\n".join(head + lines[end:]) + "\n")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def fault_rows(junit: Path, rows_path: Path) -> list[dict[str, Any]]:
    """Each fault test's rows: what it recorded (:mod:`tests.reliability`), else its
    name and result (its failure's message, if it failed)."""
    recorded: dict[str, list[dict[str, Any]]] = {}
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            row = json.loads(line)
            recorded.setdefault(row["test"], []).append(row)
    faults = []
    for case in junit_cases(junit):
        rows = recorded.get(case["id"]) or [{
            "fault": _humanize(case["name"]), "outcome": None
            if case["result"] == "passed" else case["message"],
            "lost": "not measured", "figures": {}}]
        for row in rows:
            faults.append({**row, "test": case["id"], "result": case["result"],
                           "seconds": case["seconds"]})
    return faults


def main() -> None:
    """Run the suites and the overhead benchmark; write the document."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--job-s", type=float, default=6.0)
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    ap.add_argument("--only", nargs="+", metavar="TEST",
                    help="run just these tests of the fault suite and update the "
                         "document's rows for them")
    args = ap.parse_args()
    command = "make reliability" if os.environ.get("MAKELEVEL") else \
        "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    started, t0 = time.time(), time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="rtop-reliability-"))
    faults: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    suite_rc: dict[str, tuple[int, float]] = {}
    missing: list[str] = []
    rows_path = work / "rows.jsonl"
    env = dict(os.environ, RTOP_RELIABILITY_OUT=str(rows_path), RTOP_RELIABILITY_LONG="1")
    if args.only:
        rc = run_pytest(args.only, work / "faults.xml", env)
        update_doc(Path(args.out), command, started, args.only, rc,
                   fault_rows(work / "faults.xml", rows_path))
        print(f"updated {args.out} ({(time.monotonic() - t0) / 60:.1f} minutes)")
        return
    if not args.no_tests:
        fault_targets = _files(FAULT_FILES)
        for pat in FAULT_FILES:
            if not glob.glob(str(ROOT / pat)):
                missing.append(pat)
        fault_targets += [t for t in FAULT_TESTS if (ROOT / t.split("::")[0]).exists()]
        suite_rc["fault suite"] = run_pytest(fault_targets, work / "faults.xml", env)
        bad_targets = _files(BAD_INPUT_FILES)
        # the fuzzers at 10,000 cases per property (make test: 10,000 per target)
        suite_rc["bad-input suite"] = run_pytest(bad_targets, work / "bad.xml",
                                                 dict(env, HYPOTHESIS_PROFILE="full"))
        faults = fault_rows(work / "faults.xml", rows_path)
        for case in junit_cases(work / "bad.xml"):
            bad.append({"input": _humanize(case["name"]), **case})
    over = None if args.no_overhead else overhead(args.rounds, args.job_s)
    write_doc(Path(args.out), command, started, time.monotonic() - t0, faults, bad,
              suite_rc, over, missing)
    print(f"wrote {args.out} ({(time.monotonic() - t0) / 60:.1f} minutes)")


if __name__ == "__main__":
    main()
