"""Each rank's distributions: p50, p95 and p99 of its step time, data wait and exposed
comm over its rolling window of steps (``collectors.figures.distribution``), in the
snapshot, the rank detail (one line each), Prometheus (Summary families) and ``rtop
report`` (over the run, in JSON and in text)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors import wire
from collectors.figures import FIGURES, QUANTILES
from collectors.schema import STEP_FIELDS
from rtop.analysis import Monitor
from rtop.fmt import fmt_ms
from rtop.hub.metrics import prometheus_text
from rtop.report import build_report, format_text
from rtop.run.recording import read
from rtop.run.ring import nanquantiles_rows
from rtop.run.state import RunState
from rtop.tui.app import make_app
from rtop.tui.detail import SERIES, RankScreen, Value
from rtop.tui.source import ReplaySource, StaticSource
from tests.rankclient import identity, step_row

FIXTURES = Path(__file__).parent / "fixtures"
FIELD = {f: STEP_FIELDS.index(f) for f in ("step_s", "data_wait_s", "comm_exposed_s")}
#: the distributions' figures by (step field, quantile)
DIST = {(f.of, f.quantile): f.name for f in FIGURES if f.of}


def steps_of(rank: int, n: int) -> list[list]:
    """Steps whose three figures each have a known, different distribution per rank."""
    rows = []
    for k in range(n):
        row = step_row(k, step_s=0.1 + 0.001 * (k % 50) + 0.01 * rank,
                       data=0.002 + (0.3 if k % 20 == 19 else 0.0) * (rank + 1), comm=0.02)
        row[FIELD["comm_exposed_s"]] = 0.001 * (k % 100) + 0.005 * rank
        rows.append(row)
    return rows


def fed(ranks: int = 3, n: int = 500, window: int = 400) -> RunState:
    st = RunState(window_steps=window, window_samples=60, recent_steps=20)
    for r in range(ranks):
        st.apply(wire.Frame("hello", {"identity": identity(r, world=ranks)}), 1.0)
    for r in range(ranks):
        rows = steps_of(r, n)
        if r == ranks - 1:  # no loader wrapped, no collective: not measured
            for row in rows:
                row[FIELD["data_wait_s"]] = row[FIELD["comm_exposed_s"]] = None
        st.apply(wire.Frame("batch", {"rank": r, "group": "g0", "steps": rows}), 2.0)
    return st


def window_quantile(rank: int, field: str, q: float, n: int = 500, window: int = 400
                    ) -> float:
    kept = np.array([row[FIELD[field]] for row in steps_of(rank, n)[-window:]],
                    dtype=np.float32).astype(np.float64)
    return float(np.quantile(kept, q))


def test_every_distribution_is_three_quantiles_of_a_step_field_the_window_keeps():
    assert QUANTILES == (0.5, 0.95, 0.99)
    assert set(DIST) == {(f, q) for f in FIELD for q in QUANTILES}
    # the data wait's p95 kept its public name and its gauge
    assert DIST[("data_wait_s", 0.95)] == "data_wait_p95_s"


def test_several_quantiles_from_one_sort_are_numpys():
    rng = np.random.default_rng(3)
    a = rng.random((30, 57)).astype(np.float32)
    a[rng.random(a.shape) < 0.4] = np.nan
    a[0] = np.nan
    got = nanquantiles_rows(a, QUANTILES)
    assert got.shape == (30, 3) and np.isnan(got[0]).all()
    for j, q in enumerate(QUANTILES):
        want = np.array([np.quantile(row[~np.isnan(row)].astype(np.float64), q)
                         for row in a[1:]])
        np.testing.assert_allclose(got[1:, j], want, rtol=1e-7)


def test_snapshot_and_detail_carry_each_ranks_quantiles_over_its_whole_window():
    st = fed()
    cols = st.view()["ranks"]
    for (field, q), name in DIST.items():
        for r in (0, 1):
            want = window_quantile(r, field, q)
            assert cols[name][r] == pytest.approx(want, rel=1e-6), (name, r)
            assert st.rank_detail(r)["stats"][name] == pytest.approx(want, rel=1e-6)
    # the stalls every 20th step show at p99 and p95, not at the median
    assert cols["data_wait_p50_s"][0] < 0.01 < 0.3 < cols["data_wait_p99_s"][0]
    # not measured: None, never 0; the step time is measured on every rank
    for field in ("data_wait_s", "comm_exposed_s"):
        assert all(cols[DIST[(field, q)]][2] is None for q in QUANTILES)
    assert cols["step_p99_s"][2] == pytest.approx(window_quantile(2, "step_s", 0.99),
                                                  rel=1e-6)


def test_prometheus_has_a_summary_per_distribution_and_keeps_the_p95_gauge():
    st = fed()
    text = prometheus_text(Monitor(st, diagnose=False).snapshot())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, field in (("rtop_step_window_seconds", "step_s"),
                        ("rtop_data_wait_window_seconds", "data_wait_s"),
                        ("rtop_comm_exposed_window_seconds", "comm_exposed_s")):
        fam = families[name]
        assert fam.type == "summary"
        got = {(s.labels["rank"], float(s.labels["quantile"])): s.value for s in fam.samples}
        ranks = ("0", "1", "2") if field == "step_s" else ("0", "1")
        assert set(got) == {(r, q) for r in ranks for q in QUANTILES}  # rank 2: left out
        for (r, q), v in got.items():
            assert v == pytest.approx(window_quantile(int(r), field, q), rel=1e-6)
        assert not [s for s in fam.samples if s.name.endswith(("_count", "_sum"))]
    assert "# TYPE rtop_step_window_seconds summary" in text
    # the older public gauge is still there, with the same value as the summary's p95
    p95 = families["rtop_data_wait_p95_seconds"]
    assert p95.type == "gauge"
    assert {s.labels["rank"]: s.value for s in p95.samples} == pytest.approx({
        r: window_quantile(int(r), "data_wait_s", 0.95) for r in ("0", "1")}, rel=1e-6)


def test_the_report_has_each_ranks_quantiles_over_the_run():
    report = build_report(FIXTURES / "starved.rtop", find_spools=False)
    seen: dict[int, dict[str, list[float]]] = {}
    for _, frame in read(FIXTURES / "starved.rtop"):
        if frame.kind == wire.KIND_BATCH:
            mine = seen.setdefault(frame.payload["rank"], {f: [] for f in FIELD})
            for row in frame.payload.get("steps") or []:
                for f, j in FIELD.items():
                    if row[j] is not None:
                        mine[f].append(row[j])
    for entry in report["ranks"]:
        for (field, q), name in DIST.items():
            want = float(np.quantile(seen[entry["rank"]][field], q))
            assert entry[name] == pytest.approx(want), (entry["rank"], name)
        assert entry["step_p50_s"] <= entry["step_p95_s"] <= entry["step_p99_s"]
    text = format_text(report)
    assert "Distributions over the run (ms: p50 / p95 / p99)" in text
    lines = text.splitlines()
    head = lines.index("Distributions over the run (ms: p50 / p95 / p99)") + 1
    assert lines[head].split() == ["rank", "step", "data", "wait", "exp", "comm"]
    row1 = next(line for line in lines[head + 2:] if line.split()[0] == "1")
    assert row1.count(" / ") == 6


async def test_the_rank_detail_shows_each_distribution_on_one_line():
    titles = [line[0] for line in SERIES if not line[1]]
    assert titles == ["step", "data wait", "exp comm"]
    assert all(len(line[2]) == 3 for line in SERIES if not line[1])
    snap, details = ReplaySource(FIXTURES / "starved.rtop").snapshot_at(22.0, (0, 1, 2))
    app = make_app(StaticSource([snap], details, title="starved"))
    async with app.run_test(size=(140, 48)) as pilot:
        deadline = time.monotonic() + 10
        while not app.snapshots_seen:
            assert time.monotonic() < deadline
            await pilot.pause(0.05)
        await pilot.press("enter")
        while not isinstance(app.screen, RankScreen) or not app.screen.query(Value):
            assert time.monotonic() < deadline
            await pilot.pause(0.05)
        screen = app.screen
        stats = details[screen.rank]["stats"]

        def shown() -> dict[str, str]:
            return {v.title: str(v.render()) for v in screen.query(Value)}

        while "·" not in shown().get("data wait", ""):
            assert time.monotonic() < deadline
            await pilot.pause(0.05)
        line = shown()["data wait"]
        values, note = line.split(" ms, ")
        assert values.count(" · ") == 2 and note.startswith("p50 · p95 · p99")
        assert values.endswith(fmt_ms(stats["data_wait_p99_s"]))
