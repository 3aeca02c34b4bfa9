"""Communication per process group, and a diagnosis that compares a rank with the peers
of its own groups: a real 2x2 gloo job (two pipeline stages of two data-parallel ranks,
``tests/pp_workers.py``) streaming to a real hub, its recording read back by ``rtop
report``; and a simulated pipeline-parallel fleet (``rtop.fleetsim``'s stages)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp

from collectors import wire
from collectors.groups import ProcessGroups, ranks_text
from collectors.schema import STEP_FIELDS
from rtop.analysis import Monitor, detectors, roles, window
from rtop.analysis.config import AnalysisConfig
from rtop.fleetscore import named, score
from rtop.fleetsim import Fault, FleetSpec, Scenario, write_recording
from rtop.hub.service import ThreadedHub
from rtop.report import build_report, format_text
from rtop.run.recording import read, replay
from rtop.run.state import RunState
from rtop.workload import free_port
from tests import pp_workers

GROUPS = STEP_FIELDS.index("groups")
STEPS, SLOW_FROM, SLOW_RANK = 100, 60, 3
CFG = AnalysisConfig(inter_node_fabric="infiniband")


def test_ranks_text_is_short():
    assert ranks_text([0, 2]) == "0,2"
    assert ranks_text(range(8)) == "0-7"
    assert ranks_text(range(3, 1024, 8)) == "3-1019:8"
    assert ranks_text([]) == ""
    long = ranks_text([k * k for k in range(200)])
    assert len(long) == 200 and long.endswith("…")


def test_roles_read_a_ranks_stage_from_its_groups():
    def meta(*groups: tuple[str, int, int]) -> dict[str, Any]:
        return {"groups": [{"name": str(i), "desc": d, "rank": r, "size": n}
                           for i, (d, r, n) in enumerate(groups)]}

    assert roles.kind_of("mesh_pp") == "pipeline"
    assert roles.kind_of("PIPELINE_MODEL_PARALLEL_GROUP") == "pipeline"
    assert roles.kind_of("TENSOR_MODEL_PARALLEL_GROUP") == "tensor"
    assert roles.kind_of("TENSOR_AND_DATA_PARALLEL_GROUP") is None
    assert roles.kind_of("default_pg") is None and roles.kind_of(None) is None
    metas = [meta(("default_pg", r, 8), ("mesh_pp", r // 4, 2), ("mesh_tp", r % 2, 2))
             for r in range(8)]
    classes = roles.peer_classes(metas)
    assert classes.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # one rank per replica counts the samples: stage 0's, the first of its TP group
    assert roles.counted(metas, classes).tolist() == [True, False, True, False,
                                                      False, False, False, False]
    # the setting wins; a rank that said nothing is in no stage
    assert roles.stage_of({"pipeline_stage": 3, **metas[0]}) == 3
    assert roles.peer_classes([{}, {"groups": "bad"}]).tolist() == [roles.NO_STAGE] * 2


def test_a_process_group_is_named_by_torch_and_described_once():
    class Group:
        group_name, group_desc = "7", "mesh_pp"

        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 1

    groups = ProcessGroups()
    g = Group()
    assert groups.name(g) == "7" and groups.name(g) == "7" and groups.name(None) is None
    assert groups.generation == 1
    [d] = groups.described()
    assert d == {"name": "7", "desc": "mesh_pp", "size": 2, "rank": 1}


def run_pipeline(tmp: Path, pp_desc: str = "pipeline_parallel") -> tuple[Path, list[dict]]:
    hub = ThreadedHub(job="pp-2x2", record=str(tmp / "run.rtop")).start()
    try:
        mp.spawn(pp_workers.pipeline, nprocs=4, join=True, args=(
            4, free_port(), hub.address, hub.token, STEPS, SLOW_RANK, SLOW_FROM, 2.0,
            pp_desc, str(tmp)))
    finally:
        hub.stop()
    said = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]
    return Path(hub.record_path or ""), said


@pytest.mark.job
def test_a_2x2_job_is_measured_per_group_and_judged_within_its_stages(tmp_path: Path):
    record, said = run_pipeline(tmp_path)
    dp_name = {r: said[r]["groups"]["dp"] for r in range(4)}
    pp_name = {r: said[r]["groups"]["pp"] for r in range(4)}
    # torch names a group alike on every member, and differently from the other groups
    assert dp_name[0] == dp_name[1] != dp_name[2] == dp_name[3]
    assert pp_name[0] == pp_name[2] != pp_name[1] == pp_name[3]
    assert len({*dp_name.values(), *pp_name.values()}) == 4

    # every step says, per group, each collective's time, bytes, calls and bus bandwidth
    steps: dict[int, list[list[Any]]] = {}
    metas: dict[int, dict[str, Any]] = {}
    for _, frame in read(record):
        if frame.kind == wire.KIND_BATCH:
            r = frame.payload["rank"]
            steps.setdefault(r, []).extend(frame.payload.get("steps") or [])
            metas.setdefault(r, {}).update(frame.payload.get("meta") or {})
    for r in range(4):
        assert len(steps[r]) == STEPS
        for row in steps[r][2:]:
            by_group = row[GROUPS]
            assert set(by_group) == {dp_name[r], pp_name[r]}, by_group
            s, nbytes, calls, busbw = by_group[dp_name[r]]["all_reduce"]
            # nccl-tests: an allreduce of 2 ranks moves its buffer at a factor 2(n-1)/n = 1
            assert nbytes == 4 * pp_workers.GRADIENTS and calls == 1
            assert busbw == pytest.approx(nbytes / s)
            s, nbytes, calls, busbw = by_group[pp_name[r]]["broadcast"]
            assert nbytes == 4 * pp_workers.ACTIVATIONS and calls == 1
            assert busbw == pytest.approx(nbytes / s)
        described = {g["name"]: g for g in metas[r]["groups"]}
        assert described[dp_name[r]]["desc"] == "data_parallel"
        assert described[pp_name[r]] == {"name": pp_name[r], "desc": "pipeline_parallel",
                                          "size": 2, "rank": r // 2,
                                          "ranks": f"{r % 2},{r % 2 + 2}"}
        assert any(g.get("world") and g["desc"] == "default_pg" for g in described.values())

    # the report: each rank's stage and groups, the job's groups, and a straggler named
    # within its stage only
    report = build_report(record, CFG, find_spools=False)
    for entry in report["ranks"]:
        r = entry["rank"]
        assert entry["pipeline_stage"] == r // 2
        assert set(entry["groups"]) == {dp_name[r], pp_name[r]}
        assert entry["groups"][dp_name[r]]["collectives"]["all_reduce"]["bytes"] == \
            4 * pp_workers.GRADIENTS
        assert entry["tokens_per_step"] == 1024 and entry["samples_per_step"] == 8
        assert entry["flops_per_step"] == said[r]["flops"] == 3 * 2 * 8 * 4 * 4
    groups = report["process_groups"]
    assert sorted(groups[dp_name[0]]["members"]) == [0, 1]
    assert groups[pp_name[1]]["desc"] == "pipeline_parallel"
    assert groups[pp_name[1]]["collectives"]["broadcast"]["bytes"] == 4 * pp_workers.ACTIVATIONS
    text = format_text(report)
    assert "Communication per process group" in text and "pipeline_parallel (name" in text
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[SLOW_RANK]], report["findings"]
    ev = stragglers[0]["evidence"]["ranks"][str(SLOW_RANK)]
    assert ev["stage"] == 1 and ev["peers"] == "the ranks of pipeline stage 1"
    # samples count once per replica: stage 0's two ranks
    assert report["throughput"]["ranks_counted"] == 2

    # before rank 3 slowed down, stage 1 computed twice as long as stage 0 on every rank:
    # judged within its stage that is no straggler; judged against every rank it would be
    mon = Monitor(RunState(), CFG)
    checked: list[tuple[Any, Any]] = []

    def on_frame(t: float, frame: wire.Frame, st: RunState) -> None:
        mon.advance(t)
        if checked or frame.kind != wire.KIND_BATCH:
            return
        w = window.take(st, CFG, t)
        done = [r.last_step for r in w.ranks]
        # warm, a full recent window of steps, none of rank 3's slow ones yet
        if len(done) < 4 or min(done) < 45 or max(done) >= SLOW_FROM:
            return
        within = detectors.straggler(detectors.Context(w, CFG), set())
        w.peer_class = None
        everyone = detectors.straggler(detectors.Context(w, CFG), set())
        checked.append((within, everyone))

    replay(record, mon.state, on_frame=on_frame)
    [(within, everyone)] = checked
    assert within is None
    assert everyone is not None and sorted(everyone.ranks) == [2, 3]


def test_a_healthy_pipeline_fleet_gets_no_rank_fault(tmp_path: Path):
    """64 ranks in 4 stages: the last computes 1.4x as long (the loss head), the first
    waits 8x as long for data. Judged within their stages: no rank fault. The same fleet
    whose ranks do not say their groups names the last stage's 16 ranks stragglers."""
    for announce, false in ((True, 0), (False, 16)):
        spec = FleetSpec(ranks=64, stages=4, seed=3, duration_s=60.0,
                         announce_stages=announce)
        path = tmp_path / f"pp-{announce}.rtop"
        truth = write_recording(path, spec, "healthy")
        s = score(truth, named(path, CFG))
        assert len(s.false_rank_faults) == false, s.false_rank_faults
        if not announce:
            assert {k for k, _ in s.false_rank_faults} == {"straggler"}
            assert {r for _, r in s.false_rank_faults} == set(range(48, 64))


def test_a_straggler_within_the_slow_stage_is_still_named(tmp_path: Path):
    spec = FleetSpec(ranks=64, stages=4, seed=4, duration_s=60.0)
    scenario = Scenario("straggler", (Fault("straggler", 30.0, (53,), size=1.35),))
    truth = write_recording(tmp_path / "pp.rtop", spec, scenario)
    found = named(tmp_path / "pp.rtop", CFG)
    s = score(truth, found)
    assert ("straggler", 53) in found.ranks and s.false_rank_faults == []
    report = build_report(tmp_path / "pp.rtop", CFG, find_spools=False)
    assert report["ranks"][53]["pipeline_stage"] == 3
    assert set(report["process_groups"]) == {f"dp{k}" for k in range(4)}
    assert sorted(report["process_groups"]["dp3"]["members"]) == list(range(48, 64))
    assert math.isclose(report["throughput"]["ranks_counted"], 16)
    assert np.isclose(report["throughput"]["samples_per_s"],
                      sum(e["samples_per_s"] for e in report["ranks"][:16]))


def test_the_rank_detail_shows_its_collectives_per_group():
    from rich.console import Console

    from rtop.tui.detail import group_split
    from tests.rankclient import identity
    from tests.rankclient import step_row as make_row

    st = RunState()
    st.apply(wire.Frame("hello", {"identity": identity(0, world=4)}), 1.0)
    rows = []
    for k in range(10):
        row = make_row(k)
        row[GROUPS] = {"3": {"all_reduce": [0.004 + 0.001 * (k % 2), 16384, 1, 4e6]},
                       "5": {"broadcast": [0.002, 4096, 1, 2e6]}}
        rows.append(row)
    meta = {"groups": [{"name": "3", "desc": "data_parallel", "size": 2, "rank": 0,
                        "ranks": "0,1"},
                       {"name": "5", "desc": "pipeline_parallel", "size": 2, "rank": 0,
                        "ranks": "0,2"}]}
    st.apply(wire.Frame("batch", {"rank": 0, "group": "g0", "steps": rows, "meta": meta}),
             2.0)
    detail = st.rank_detail(0)
    groups = detail["groups"]
    assert list(groups) == ["3", "5"]  # the most time first
    assert groups["3"]["desc"] == "data_parallel" and groups["5"]["ranks"] == "0,2"
    assert groups["3"]["ops"]["all_reduce"]["s"] == pytest.approx(0.0045)
    assert groups["5"]["ops"]["broadcast"]["bytes"] == 4096
    console = Console(width=160, no_color=True)
    with console.capture() as cap:
        console.print(group_split(detail))
    text = cap.get()
    assert "pipeline_parallel (5: ranks 0,2, its rank 0 of 2)" in text
    assert "broadcast" in text and "4.1 kB" in text and "2 MB/s" in text
    # a malformed map from a peer is refused whole, nothing of it kept
    bad = make_row(10)
    bad[GROUPS] = {"3": [1, 2]}
    with pytest.raises(Exception, match="map of collectives"):
        st.apply(wire.Frame("batch", {"rank": 0, "group": "g0", "steps": [bad]}), 3.0)
