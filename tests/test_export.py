"""``rtop export RUN --parquet DIR``: real recordings (a real job through a real hub, and a
simulated fleet written through the hub's recorder) exported by the real CLI, read back
with pyarrow (which wrote them) and pandas, and checked against ``rtop report --json``
of the same recording."""

from __future__ import annotations

import json
import shutil
import stat
import statistics
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from collectors.figures import FIGURES
from collectors.schema import TABLES
from rtop.export.columns import FILE_NAMES, TEXT
from rtop.fleetsim import FleetSpec, with_noise, write_recording
from rtop.run.validate import ProtocolError, check_rows

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FIXTURES = Path(__file__).parent / "fixtures"
RTOP = [sys.executable, "-m", "rtop"]
#: Every file an export writes.
TABLE_FILES = ("steps", "gpu", "host", "mem", "heartbeats", "events", "collectives",
               "findings", "ranks")


def export(run: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RTOP, "export", str(run), "--parquet", str(out), *extra],
                          capture_output=True, text=True, timeout=120)


def report(run: Path) -> dict[str, Any]:
    out = subprocess.run([*RTOP, "report", str(run), "--json"], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def table(out: Path, name: str) -> Any:
    return pq.read_table(out / f"{name}.parquet")


def rows(out: Path, name: str) -> list[dict[str, Any]]:
    return table(out, name).to_pylist()  # type: ignore[no-any-return]


def by_rank(records: list[dict[str, Any]], attempt: int = 0) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if r["attempt"] == attempt:
            out[r["rank"]].append(r)
    return out


def median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def check_against_report(out: Path, rep: dict[str, Any]) -> None:
    """Every table read back agrees with what the report says of the same recording."""
    if not rep["attempts"]:  # cut before any rank's batch
        assert table(out, "steps").num_rows == table(out, "ranks").num_rows == 0
        return
    attempt = rep["attempts"][-1]["attempt"]
    steps = by_rank(rows(out, "steps"), attempt)
    assert sorted(steps) == sorted(r["rank"] for r in rep["ranks"])
    for r in rep["ranks"]:
        mine = steps[r["rank"]]
        assert len(mine) == r["steps"] > 0
        assert {x["node"] for x in mine} == {r["node"]}
        assert min(x["step"] for x in mine) == r["first_step"]
        assert max(x["step"] for x in mine) == r["last_step"]
        for key in ("step_s", "data_wait_s", "compute_s", "comm_s", "comm_bytes"):
            assert median([x[key] for x in mine]) == pytest.approx(r[key], rel=1e-12), key
        assert all(x["t_hub"] >= rep["run"]["hub"]["started"] for x in mine)
        # the rank's time on the hub's clock: its own minus its clock offset
        off = r["clock_offset_s"]
        assert off is not None
        last = mine[-1]
        assert last["t_wall_hub"] == pytest.approx(last["t_wall"] - off, abs=1e-6)
        # its collectives: one row per step and collective, as the report sums them up
        coll = [c for c in rows(out, "collectives")
                if c["rank"] == r["rank"] and c["attempt"] == attempt
                and c["process_group"] is None]
        for op, fig in r["collectives"].items():
            ops = [c for c in coll if c["op"] == op]
            assert len(ops) == fig["steps"]
            assert median([c["comm_s"] for c in ops]) == pytest.approx(fig["s"], rel=1e-12)
            assert median([c["comm_bytes"] for c in ops]) == fig["bytes"]
        # and per process group, where the job ran several: as the report has them
        grouped = [c for c in rows(out, "collectives") if c["rank"] == r["rank"]
                   and c["attempt"] == attempt and c["process_group"] is not None]
        assert {c["process_group"] for c in grouped} == set(r["groups"])
        for group, g in r["groups"].items():
            for op, fig in g["collectives"].items():
                ops = [c for c in grouped
                       if c["process_group"] == group and c["op"] == op]
                assert len(ops) == fig["steps"] > 0
                assert median([c["comm_s"] for c in ops]) == pytest.approx(fig["s"],
                                                                         rel=1e-12)
    # the ranks table is the report's, every attempt's
    ranks = rows(out, "ranks")
    assert [(x["rank"], x["attempt"], x["node"], x["status"], x["steps"]) for x in ranks] == [
        (r["rank"], a["attempt"], r["node"], r["status"], r["steps"])
        for a in rep["attempts"] for r in a["ranks"]]
    for x, r in zip(ranks, (r for a in rep["attempts"] for r in a["ranks"]), strict=True):
        assert x["step_s"] == r["step_s"] and x["peak_bytes"] == r["peak_bytes"]
        assert json.loads(x["collectives"]) == r["collectives"]
    # the findings are the report's: kind, ranks, when, what they cost
    found = rows(out, "findings")
    assert [(f["kind"], f["ranks"], f["severity"], f["since"], f["until"], f["active"],
             f["impact"], f["summary"]) for f in found] == [
        (f["kind"], f["ranks"], f["severity"], f["since"], f["until"], f["active"],
         f["impact"], f["summary"]) for f in rep["findings"]]
    assert [json.loads(f["evidence"]) for f in found] == [f["evidence"]
                                                          for f in rep["findings"]]
    assert [(f["cost_s_per_step"], f["cost_share"]) for f in found] == [
        ((f["evidence"].get("cost") or {}).get("s_per_step"),
         (f["evidence"].get("cost") or {}).get("share")) for f in rep["findings"]]
    nodes = {r["rank"]: r["node"] for r in rep["ranks"]}
    assert [f["nodes"] for f in found] == [sorted({nodes[r] for r in f["ranks"]})
                                           for f in rep["findings"]]


def test_a_real_run_exports_what_the_report_says(tmp_path: Path) -> None:
    """tests/fixtures/starved.rtop: a real 3-rank DDP job on gloo through a real hub, rank
    1's loader 30 ms slow; every table read back with pyarrow and pandas."""
    run, out = FIXTURES / "starved.rtop", tmp_path / "out"
    proc = export(run, out)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    rep = report(run)
    check_against_report(out, rep)
    [starved] = rows(out, "findings")
    assert (starved["kind"], starved["ranks"], starved["nodes"]) == ("starved_rank", [1], ["vm"])
    assert starved["cost_s_per_step"] == pytest.approx(0.030, rel=0.3)  # its loader's 30 ms
    # a CPU job: no GPU samples (an empty table with its columns), memory and host ones
    assert table(out, "gpu").num_rows == 0 and "gpu_util_pct" in table(out, "gpu").schema.names
    assert table(out, "mem").num_rows > 0 and table(out, "host").num_rows > 0
    assert {r["mem_device"] for r in rows(out, "mem")} == {"cpu"}
    assert all(r["gpu_s"] is None for r in rows(out, "steps"))  # not measured: null, not 0
    header = json.loads((out / "run.json").read_text())
    assert header["source"] == str(run.resolve())
    assert header["name"] == rep["run"]["name"] == "starved-run"
    assert header["job"] == rep["run"]["job"]
    assert header["truncated"] is False and header["frames"] == rep["run"]["frames"]
    assert {k: v["rows"] for k, v in header["tables"].items()} == {
        name: table(out, name).num_rows for name in TABLE_FILES}
    assert header["rtop_version"] == pq.read_schema(out / "steps.parquet").metadata[
        b"rtop.version"].decode()
    # private: the directory 0700, every file 0600
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{n}.parquet" for n in TABLE_FILES] + ["run.json"])
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o600}
    # what a notebook does
    pd = pytest.importorskip("pandas")
    df = pd.read_parquet(out / "steps.parquet")
    med = df.groupby("rank")["step_s"].median()
    assert {int(k): float(v) for k, v in med.items()} == pytest.approx(
        {r["rank"]: r["step_s"] for r in rep["ranks"]}, rel=1e-12)
    assert str(df["step"].dtype) == "int64" and str(df["t_hub"].dtype) == "float64"
    findings = pd.read_parquet(out / "findings.parquet")
    assert list(findings["kind"]) == ["starved_rank"]
    assert list(findings["ranks"].iloc[0]) == [1]


def test_a_simulated_fleet_exports_what_the_report_says(tmp_path: Path) -> None:
    """16 simulated ranks on two nodes, written through the hub's recorder with clocks
    tens of ms apart, GPU samples, checkpoints, a starved rank and a throttled GPU."""
    run, out = tmp_path / "fleet.rtop", tmp_path / "out"
    spec = with_noise(FleetSpec(ranks=16, seed=1, duration_s=60.0), checkpoint_every=20)
    truth = write_recording(run, spec, "two_faults")
    proc = export(run, out)
    assert proc.returncode == 0, proc.stderr
    rep = report(run)
    check_against_report(out, rep)
    kinds = {(f["kind"], tuple(f["ranks"])) for f in rows(out, "findings")}
    for fault in truth.faults:
        assert any(kind in fault.kinds and list(ranks) == fault.ranks
                   for kind, ranks in kinds), (fault, kinds)
    offsets = {r["rank"]: r["clock_offset_s"] for r in rep["ranks"]}
    assert len({round(o, 6) for o in offsets.values()}) == 16  # clocks apart
    for name in ("steps", "gpu", "host", "mem", "heartbeats", "events"):
        got = rows(out, name)
        assert got, name
        assert all(r["t_wall_hub"] == pytest.approx(r["t_wall"] - offsets[r["rank"]],
                                                    abs=1e-6) for r in got), name
    gpu = by_rank(rows(out, "gpu"))
    mem = by_rank(rows(out, "mem"))
    events = by_rank(rows(out, "events"))
    for r in rep["ranks"]:
        rank = r["rank"]
        assert median([g["gpu_util_pct"] for g in gpu[rank]]) == pytest.approx(
            r["gpu_util_pct"], rel=1e-12)
        assert max(m["mem_peak_bytes"] for m in mem[rank]) == r["peak_bytes"]
        assert len(events[rank]) == r["checkpoints"] >= 2
        assert median([e["duration_s"] for e in events[rank]]) == r["checkpoint_s"]
        assert {e["kind"] for e in events[rank]} == {"checkpoint"}
        assert {g["node"] for g in gpu[rank]} == {r["node"]}
    assert {f["nodes"][0] for f in rows(out, "findings") if f["ranks"]} <= {
        "node-00000", "node-00001"}


def test_collectives_per_process_group_are_rows_of_their_group(tmp_path: Path) -> None:
    """A simulated 2-stage pipeline (16 ranks): each step's allreduce split by process
    group (the stage's data-parallel group) is exported as rows of that group, and
    agrees with the report's per-group medians (check_against_report)."""
    run, out = tmp_path / "pp.rtop", tmp_path / "out"
    write_recording(run, FleetSpec(ranks=16, seed=2, duration_s=30.0, stages=2), "healthy")
    proc = export(run, out)
    assert proc.returncode == 0, proc.stderr
    rep = report(run)
    check_against_report(out, rep)
    grouped = [c for c in rows(out, "collectives") if c["process_group"] is not None]
    assert grouped and all(r["groups"] for r in rep["ranks"])
    # a rank's groups are its own stage's: ranks of the two stages name different ones
    first = {c["process_group"] for c in grouped if c["rank"] < 8}
    second = {c["process_group"] for c in grouped if c["rank"] >= 8}
    assert first and second and not first & second, (first, second)


@pytest.mark.parametrize("source", ["real", "simulated"])
def test_a_cut_recording_exports_up_to_the_cut_and_says_so(tmp_path: Path, source: str
                                                           ) -> None:
    """Cut mid-way: a real run's recording (tests/fixtures, as an earlier rtop wrote it:
    frame by frame), and a simulated one as the hub's recorder writes it now."""
    whole = tmp_path / "whole.rtop"
    if source == "real":
        shutil.copyfile(FIXTURES / "starved.rtop", whole)
    else:
        write_recording(whole, FleetSpec(ranks=8, seed=2, duration_s=90.0), "starved")
    data = whole.read_bytes()
    cut = tmp_path / "cut.rtop"
    cut.write_bytes(data[: int(len(data) * 0.7) + 3])
    out = tmp_path / "out"
    proc = export(cut, out)
    assert proc.returncode == 0, proc.stderr
    assert "warning" in proc.stderr and "truncated" in proc.stderr
    assert "Traceback" not in proc.stderr
    rep = report(cut)
    assert rep["run"]["truncated"]
    check_against_report(out, rep)
    header = json.loads((out / "run.json").read_text())
    assert header["truncated"] is True and header["closed"] is False
    assert header["cut"] and any("truncated" in w for w in header["warnings"])
    full = report(whole)
    steps = table(out, "steps").num_rows
    assert steps < sum(r["steps"] for r in full["ranks"])
    if source == "real":  # frame by frame: everything before the cut is there
        assert "mid-frame" in header["cut"] and steps > 0


def test_without_pyarrow_it_says_which_extra_to_install(tmp_path: Path) -> None:
    """The same entry point as ``python -m rtop``, in an interpreter where importing
    pyarrow fails as it does when it is not installed."""
    out = tmp_path / "out"
    code = ("import runpy, sys; sys.modules['pyarrow'] = None; "
            "sys.argv = ['rtop', 'export', sys.argv[1], '--parquet', sys.argv[2]]; "
            "runpy.run_module('rtop', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, str(FIXTURES / "starved.rtop"),
                           str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert 'pip install "rtop-train[export]"' in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_existing_files_are_not_overwritten_without_force(tmp_path: Path) -> None:
    run, out = FIXTURES / "healthy.rtop", tmp_path / "out"
    assert export(run, out).returncode == 0
    before = {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.iterdir()}
    other = tmp_path / "straggler.rtop"
    shutil.copyfile(FIXTURES / "straggler.rtop", other)
    proc = export(other, out)
    assert proc.returncode == 2
    assert "--force" in proc.stderr and "nothing was written" in proc.stderr
    assert {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.iterdir()} == before
    proc = export(other, out, "--force")
    assert proc.returncode == 0, proc.stderr
    after = {p.name: p.stat().st_ino for p in out.iterdir()}
    assert sorted(after) == sorted(before)  # the same files, no partial one left
    assert all(after[name] != ino for name, (_, ino) in before.items())
    assert json.loads((out / "run.json").read_text())["source"] == str(other.resolve())
    check_against_report(out, report(other))


def test_bad_input_is_refused_and_nothing_written(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.rtop"
    garbage.write_bytes(b"this is not a recording")
    for run in (garbage, tmp_path / "missing.rtop"):
        proc = export(run, tmp_path / "out")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "not an rtop recording" in proc.stderr or "no such file" in proc.stderr
        assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("x")
    proc = export(FIXTURES / "healthy.rtop", tmp_path / "file")
    assert proc.returncode == 2 and "not a directory" in proc.stderr


def test_columns_follow_the_wire_and_figure_tables(tmp_path: Path) -> None:
    """Every field of every wire table is a column, named and documented as the figures
    table says (a figure added there is exported with no change to the exporter); text
    columns are the wire's text fields, as the run state's checks accept them."""
    out = tmp_path / "out"
    assert export(FIXTURES / "healthy.rtop", out).returncode == 0
    for key, fields in TABLES.items():
        sch = pq.read_schema(out / f"{FILE_NAMES.get(key, key)}.parquet")
        for name in fields:
            if name in ("collectives", "groups"):
                assert name not in sch.names  # maps: the collectives their own table
                continue
            figure = next((f for f in FIGURES if f.table == key and f.source == name
                           and not f.of), None)
            column = figure.name if figure else name
            assert column in sch.names, (key, name)
            field = sch.field(column)
            if figure is not None:
                assert field.metadata[b"doc"].decode() == figure.doc
            assert (field.type == pa.string()) == (name in TEXT), (key, name)
            # the run state takes text only where the export writes text
            row = [None] * len(fields)
            row[fields.index(name)] = "text"
            try:
                check_rows(key, [row])
                accepted = True
            except ProtocolError:
                accepted = False
            assert accepted == (name in TEXT), (key, name)
        assert sch.names[:6] == ["rank", "attempt", "group", "job", "node", "t_hub"]


def test_long_tables_are_written_in_chunks_of_bounded_rows(tmp_path: Path) -> None:
    """Rows go to their files a chunk at a time (memory bounded by the chunk, not the
    run): in chunks of 100 rows, every table holds what one chunk of all holds."""
    from rtop.export.exporter import export_parquet

    run = tmp_path / "fleet.rtop"
    write_recording(run, FleetSpec(ranks=16, seed=4, duration_s=40.0), "healthy")
    one, chunked = tmp_path / "one", tmp_path / "chunked"
    assert export(run, one).returncode == 0
    result = export_parquet(run, chunked, chunk_rows=100, find_spools=False)
    assert result.rows["steps"] > 300 and result.rows["heartbeats"] > 300
    for name in TABLE_FILES:
        a, b = table(one, name), table(chunked, name)
        assert a.num_rows == b.num_rows == result.rows[name]
        assert a.equals(b), name
        if b.num_rows > 100 and name not in ("findings", "ranks"):
            assert pq.ParquetFile(chunked / f"{name}.parquet").num_row_groups >= 3, name


def test_a_rank_spool_is_merged_as_the_report_merges_it(tmp_path: Path) -> None:
    """Rank 3's last batches never reached the hub: its spool (written by the collectors'
    own writer into the runtime directory) is merged by the export as by the report."""
    from collectors import wire
    from collectors.identity import Identity
    from collectors.spool import write_spool
    from rtop.fleetsim import frames
    from rtop.hub.recorder import Recorder

    spec = FleetSpec(ranks=4, per_node=2, seed=5, duration_s=30.0)
    held: list[tuple[bytes, int]] = []
    hello: dict[str, Any] = {}
    run = tmp_path / "fleet.rtop"
    rec = Recorder(run, {"hub": {"version": "test", "address": "simulated", "pid": 0,
                                 "started": 1_800_000_000.0}, "job": spec.job})
    try:
        for t_hub, kind, payload in frames(spec, "healthy"):
            if kind == wire.KIND_HELLO and payload["identity"]["rank"] == 3:
                hello = payload
            if kind == wire.KIND_BATCH and payload["rank"] == 3 and t_hub > 1_800_000_020.0:
                held.append((wire.encode(kind, payload), len(payload.get("steps") or [])))
                continue
            rec.raw(wire.encode(kind, payload), t_hub)
    finally:
        rec.close()
    spooled_steps = sum(n for _, n in held)
    assert spooled_steps > 5
    res = write_spool(Identity(**hello["identity"]), held, hello, {"reason": "exit"},
                      max_bytes=1 << 24, timeout_s=10.0)
    assert res.error is None and res.path
    rep = report(run)
    assert [s["source"] for s in rep["run"]["spools"]] == ["merged"]
    out = tmp_path / "out"
    proc = export(run, out)
    assert proc.returncode == 0, proc.stderr
    check_against_report(out, rep)
    header = json.loads((out / "run.json").read_text())
    assert header["spools_merged"] == [res.path]
    without = tmp_path / "without"
    assert export(run, without, "--no-spools").returncode == 0
    steps = Counter(r["rank"] for r in rows(out, "steps"))
    fewer = Counter(r["rank"] for r in rows(without, "steps"))
    assert steps[3] - fewer[3] == spooled_steps
    assert all(steps[r] == fewer[r] for r in (0, 1, 2))
