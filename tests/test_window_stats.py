"""A statistic over each rank's whole rolling window of steps, declared in the table of
figures (``collectors.figures``: ``of`` and ``quantile``): the data wait's p95, in the
snapshot, the rank's detail, Prometheus and ``rtop report`` (over the run there)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from collectors import wire
from collectors.schema import STEP_FIELDS
from rtop.analysis import Monitor
from rtop.hub.metrics import prometheus_text
from rtop.report import build_report, format_text
from rtop.run import state as state_mod
from rtop.run.recording import read
from rtop.run.ring import nanquantile_rows
from rtop.run.state import RunState
from tests.rankclient import identity, step_row

FIXTURES = Path(__file__).parent / "fixtures"
DATA = STEP_FIELDS.index("data_wait_s")


def waits(n: int, rank: int) -> list[float]:
    """A loader that is fast but stalls now and then (every 10th batch waits long)."""
    return [(0.2 if k % 10 == 9 else 0.002 + 0.0001 * (k % 7)) * (rank + 1)
            for k in range(n)]


def fed(ranks: int, steps: int, window: int, no_loader: set[int] | None = None) -> RunState:
    st = RunState(window_steps=window, window_samples=60, recent_steps=20)
    for r in range(ranks):
        st.apply(wire.Frame("hello", {"identity": identity(r, world=ranks)}), 1.0)
    for r in range(ranks):
        rows = [step_row(k, step_s=0.5, data=w, comm=0.01)
                for k, w in enumerate(waits(steps, r))]
        if r in (no_loader or set()):
            for row in rows:
                row[DATA] = None
        st.apply(wire.Frame("batch", {"rank": r, "group": "g0", "steps": rows}), 2.0)
    return st


def test_the_quantile_of_rows_is_numpys():
    rng = np.random.default_rng(7)
    a = rng.random((40, 33)).astype(np.float32)
    a[rng.random(a.shape) < 0.3] = np.nan
    a[0] = np.nan
    a[1] = np.nan
    a[1, 4] = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the all-NaN row
        want = np.nanquantile(a.astype(np.float64), 0.95, axis=1)
    got = nanquantile_rows(a, 0.95)
    assert np.isnan(got[0]) and got[1] == 0.5
    np.testing.assert_allclose(got, want, rtol=1e-7, equal_nan=True)
    assert nanquantile_rows(np.empty((0, 5)), 0.95).shape == (0,)


def test_a_ranks_data_wait_p95_is_over_its_whole_window_not_its_recent_steps():
    st = fed(ranks=3, steps=400, window=300, no_loader={2})
    snap = st.view()
    cols = snap["ranks"]
    for r in (0, 1):
        window = np.array(waits(400, r)[-300:], dtype=np.float32).astype(np.float64)
        want = float(np.percentile(window, 95))
        assert cols["data_wait_p95_s"][r] == pytest.approx(want, rel=1e-6)
        # the median of the recent steps hides the stalls; the p95 of the window does not
        assert cols["data_wait_s"][r] < 0.01 * (r + 1) < cols["data_wait_p95_s"][r]
        assert st.rank_detail(r)["stats"]["data_wait_p95_s"] == pytest.approx(want, rel=1e-6)
    # no loader wrapped: not measured, never 0
    assert cols["data_wait_p95_s"][2] is None
    assert {k: v for k, v in st.rank_detail(2)["stats"].items()
            if k.startswith("data_wait_")} == {
        "data_wait_p50_s": None, "data_wait_p95_s": None, "data_wait_p99_s": None}
    text = prometheus_text(Monitor(st, diagnose=False).snapshot())
    series = [line for line in text.splitlines()
              if line.startswith("rtop_data_wait_p95_seconds{")]
    assert len(series) == 2 and all('rank="2"' not in line for line in series)


def test_past_its_budget_a_snapshot_refreshes_a_share_of_the_ranks(monkeypatch):
    """Every rank's p95 reads its whole window: past STATS_BUDGET rank-steps a snapshot
    refreshes a share of the ranks in turn, and after as many snapshots as shares every
    rank has its own, right, figure."""
    monkeypatch.setattr(state_mod, "STATS_BUDGET", 200)
    st = fed(ranks=8, steps=100, window=100)  # 800 rank-steps: 4 shares of 2 ranks
    first = st.view()["ranks"]["data_wait_p95_s"]
    assert sum(v is not None for v in first) == 2
    for _ in range(3):
        last = st.view()["ranks"]["data_wait_p95_s"]
    for r, v in enumerate(last):
        want = float(np.percentile(np.array(waits(100, r), dtype=np.float32), 95))
        assert v == pytest.approx(want, rel=1e-6), r


def test_the_report_has_each_ranks_data_wait_p95_over_the_run():
    report = build_report(FIXTURES / "starved.rtop", find_spools=False)
    seen: dict[int, list[float]] = {}
    for _, frame in read(FIXTURES / "starved.rtop"):
        if frame.kind == wire.KIND_BATCH:
            seen.setdefault(frame.payload["rank"], []).extend(
                row[DATA] for row in frame.payload.get("steps") or []
                if row[DATA] is not None)
    for entry in report["ranks"]:
        want = float(np.percentile(seen[entry["rank"]], 95))
        assert entry["data_wait_p95_s"] == pytest.approx(want)
        assert entry["data_wait_p95_s"] >= entry["data_wait_s"]
    starved = next(e for e in report["ranks"] if e["rank"] == 1)
    assert starved["data_wait_p95_s"] > 0.02
    head = next(line for line in format_text(report).splitlines()
                if line.lstrip().startswith("rank "))
    assert "data ms data p95 comp ms" in " ".join(head.split())
