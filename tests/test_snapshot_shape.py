"""The snapshot that reaches viewers has exactly the keys ``rtop/run/snapshot.py``
declares: the columns are generated from the wire's tables, the declaration is written
by hand, and mypy only checks the code against the declaration. These tests check the
declaration against what is really built, from a recording and from a live hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from collectors import wire
from rtop.analysis import AnalysisConfig, Monitor
from rtop.client import HubClient
from rtop.hub.service import ThreadedHub
from rtop.run import snapshot as shape
from rtop.run.recording import read
from tests.rankclient import RankClient, gpu_row, hb_row, step_row

FIXTURES = Path(__file__).parent / "fixtures"


def keys(td: Any) -> set[str]:
    return set(td.__required_keys__) | set(td.__optional_keys__)


def check_snapshot(snap: dict[str, Any]) -> None:
    assert set(snap) - {"replay"} == keys(shape.Snapshot) - {"replay"}
    assert shape.RunInfo.__required_keys__ <= set(snap["run"]) <= keys(shape.RunInfo)
    assert set(snap["ranks"]) == keys(shape.RankColumns), \
        set(snap["ranks"]) ^ keys(shape.RankColumns)
    n = len(snap["ranks"]["rank"])
    assert n > 0 and all(len(col) == n for col in snap["ranks"].values())
    assert set(snap["nodes"]) == keys(shape.NodeColumns)
    assert set(snap["hub"]) == keys(shape.HubInfo)
    assert set(snap["overview"]) <= keys(shape.Overview)
    for f in snap["findings"]:
        assert set(f) == keys(shape.EpisodeDict), f
    scaling = snap["overview"].get("scaling")
    if scaling is not None:
        assert set(scaling) == keys(shape.Scaling)
        for w in scaling["what_if"]:
            assert set(w) == keys(shape.WhatIf)


def test_a_replayed_run_builds_the_declared_snapshot():
    monitor = Monitor(config=AnalysisConfig())
    for t, frame in read(FIXTURES / "starved.rtop"):
        monitor.apply(frame, t)
        monitor.advance(t)
        if monitor.findings:  # the run while its finding is active
            break
    snap = monitor.snapshot(replay=shape.ReplayInfo(
        position_s=1.0, duration_s=2.0, speed=1.0, paused=False, finished=True, warnings=[]))
    check_snapshot(dict(snap))
    assert set(snap["replay"]) == keys(shape.ReplayInfo)
    assert [f["kind"] for f in snap["findings"]] == ["starved_rank"]
    assert snap["overview"]["scaling"] is not None
    detail = monitor.rank_detail(snap["ranks"]["rank"][0])
    assert detail["found"] and set(detail) == keys(shape.RankDetail)
    assert set(monitor.rank_detail(999)) == shape.RankDetail.__required_keys__


def test_a_live_hub_sends_the_declared_snapshot(tmp_path):
    hub = ThreadedHub(job="shape", record=str(tmp_path / "run.rtop"), token="t").start()
    try:
        rank = RankClient(hub.address, hub.token, 0, world=1)
        assert rank.recv().kind == wire.KIND_WELCOME
        rank.batch(steps=[step_row(k) for k in range(3)], gpu=[gpu_row()], hb=[hb_row()])
        with HubClient(hub.address, hub.token) as viewer:
            snap: dict[str, Any] = dict(viewer.snapshot())
            for _ in range(100):
                if snap["ranks"]["step"] == [2]:
                    break
                snap = dict(viewer.snapshot())
            assert snap["ranks"]["step"] == [2]
            check_snapshot(snap)
            assert snap["hub"]["address"] == hub.address
            assert snap["ranks"]["gpu_util_pct"] == [95.0]
            detail = dict(viewer.rank(0))
            assert set(detail) == keys(shape.RankDetail)
        rank.close()
    finally:
        hub.stop()
