"""The diagnosis on real CPU jobs with injected faults: the exact kind, the exact ranks,
nothing spurious, and how long from the fault's onset to the finding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rtop.analysis import RANK_FAULTS, AnalysisConfig
from rtop.report import build_report
from rtop.workload import Faults
from tests.scenarios import run_scenario

START = 40  # healthy steps before the fault


def only(out, kind, ranks):
    """The run produced exactly this finding and no other."""
    assert out.kinds == {kind}, f"findings: {sorted(out.first_seen)}"
    assert out.findings[kind]["ranks"] == ranks, out.findings[kind]


def test_healthy_run_has_no_findings(tmp_path):
    out = run_scenario(tmp_path, Faults(), world=2, duration_s=12.0)
    assert out.first_seen == {}, f"spurious findings on a healthy run: {out.findings}"
    report = build_report(out.record)
    assert report["findings"] == []
    assert all(r["status"] == "finished" for r in report["ranks"])


def test_starved_rank(tmp_path):
    out = run_scenario(tmp_path, Faults(loader_sleep_s={1: 0.030}, start_step=START), world=3,
                       duration_s=12.0)
    only(out, "starved_rank", [1])
    latency = out.latency("starved_rank")
    assert latency <= 3.0, f"named {latency:.1f} s after onset"
    f = out.findings["starved_rank"]
    ev = f["evidence"]["ranks"]["1"]
    assert ev["data_wait_s"] == pytest.approx(0.030, rel=0.25)
    assert f["evidence"]["peers_comm_s_median"] > ev["comm_s"]
    assert "Rank 1 waits" in f["summary"] and "num_workers" in f["fix"]
    # the recording tells the same story
    report = build_report(out.record)
    assert [(x["kind"], x["ranks"]) for x in report["findings"]] == [("starved_rank", [1])]


def test_every_rank_slow_is_input_bound_not_starvation(tmp_path):
    out = run_scenario(tmp_path, Faults(all_loader_sleep_s=0.030, start_step=START), world=2,
                       duration_s=12.0)
    only(out, "input_bound", [0, 1])
    assert out.latency("input_bound") <= 3.0


def test_straggler_is_named_and_not_called_starved(tmp_path):
    out = run_scenario(tmp_path, Faults(extra_compute_s={1: 0.030}, start_step=START), world=2,
                       duration_s=12.0)
    only(out, "straggler", [1])
    latency = out.latency("straggler")
    assert latency <= 3.0, f"named {latency:.1f} s after onset"
    f = out.findings["straggler"]
    assert "nothing in its own counters" in f["evidence"]["cause"]  # no GPU here to blame


def test_hung_rank_with_its_stack_and_not_its_waiting_peers(tmp_path):
    cfg = AnalysisConfig(hung_min_s=6.0)
    out = run_scenario(tmp_path, Faults(hang_at_step={1: START}, start_step=START), world=3,
                       duration_s=60.0, thresholds=cfg, check=False, timeout_s=90,
                       probe_settings={"stack_after_s": 2.0},
                       until=lambda o: "hung_rank" in o.kinds)
    assert ("hung_rank", (1,)) in out.first_seen, out.findings
    latency = out.latency("hung_rank")
    assert latency <= cfg.hung_min_s + 10.0, f"named {latency:.1f} s after onset"
    f = out.findings["hung_rank"]
    assert f["ranks"] == [1]
    assert sorted(f["evidence"]["peers_waiting_in_collective"]) == [0, 2]
    stack = f["evidence"]["ranks"]["1"]["stack"]
    assert stack and "train_loop" in stack and "sleep" in stack
    assert out.kinds <= {"hung_rank"}, f"spurious: {sorted(out.first_seen)}"


def test_killed_rank_is_lost(tmp_path):
    out = run_scenario(tmp_path, Faults(die_at_step={1: START}, start_step=START), world=3,
                       duration_s=30.0, check=False, timeout_s=60,
                       until=lambda o: "lost_rank" in o.kinds)
    assert out.findings["lost_rank"]["ranks"] == [1], out.findings
    assert out.latency("lost_rank") <= 3.0
    assert out.kinds <= {"lost_rank"}, f"spurious: {sorted(out.first_seen)}"


def test_memory_growing_towards_a_small_capacity(tmp_path):
    capacity = 1_000_000_000  # RSS starts near 0.3-0.5 GB; 0.5 MB more per step fills it
    grow = 512 << 10
    out = run_scenario(tmp_path, Faults(mem_grow_bytes_per_step={1: grow},
                                        start_step=START),
                       world=2, duration_s=60.0, check=False, timeout_s=90,
                       probe_settings={"memory_capacity_bytes": capacity},
                       until=lambda o: "memory_wall" in o.kinds)
    f = out.findings["memory_wall"]
    assert f["ranks"] == [1]
    ev = f["evidence"]["ranks"]["1"]
    assert ev["capacity_bytes"] == capacity
    # the truth at the moment it was found: what is left of the capacity over the growth
    # per step (the estimate is a fitted bytes/s slope times a measured step rate)
    truth = (capacity - ev["used_bytes"]) / grow
    assert ev["steps_to_oom"] is not None
    assert 0.6 * truth <= ev["steps_to_oom"] <= 1.5 * truth, (ev["steps_to_oom"], truth)
    assert ev["param_bytes"] > 0 and ev["optim_bytes"] > 0
    assert "activation checkpointing" in f["fix"]
    assert out.kinds <= {"memory_wall"}, f"spurious: {sorted(out.first_seen)}"


def test_slow_checkpoints_against_young_daly(tmp_path):
    out = run_scenario(tmp_path, Faults(checkpoint_every=15, checkpoint_s=1.5,
                                        start_step=START), world=2, duration_s=16.0)
    only(out, "checkpoint_interval", [0, 1])
    ev = out.findings["checkpoint_interval"]["evidence"]
    assert ev["checkpoint_s"] == pytest.approx(1.5, rel=0.2)
    assert ev["interval_s"] < ev["optimal_interval_s"] / 2
    assert "too often" in out.findings["checkpoint_interval"]["summary"]


def test_findings_are_rank_faults_only_when_they_blame_ranks():
    assert set(RANK_FAULTS) == {"starved_rank", "straggler", "hung_rank", "lost_rank",
                                "gpu_throttled", "memory_wall"}


def test_report_json_lists_findings_worst_first(tmp_path):
    out = run_scenario(tmp_path, Faults(loader_sleep_s={1: 0.030}, checkpoint_every=15,
                                        checkpoint_s=1.0, start_step=START), world=2,
                       duration_s=14.0)
    assert {"starved_rank", "checkpoint_interval"} <= out.kinds
    proc = subprocess.run([sys.executable, "-m", "rtop", "report", str(out.record), "--json"],
                          capture_output=True, text=True, check=True)
    findings = json.loads(proc.stdout)["findings"]
    kinds = [f["kind"] for f in findings]
    assert set(kinds) == {"starved_rank", "checkpoint_interval"}
    for f in findings:
        assert set(f) >= {"kind", "ranks", "severity", "summary", "evidence", "fix"}
    # worst first: by severity, then by the share of the step time each costs
    rank = {"critical": 3, "warning": 2, "info": 1}
    keys = [(-rank[f["severity"]], -f["impact"]) for f in findings]
    assert keys == sorted(keys)
    text = subprocess.run([sys.executable, "-m", "rtop", "report", str(out.record)],
                          capture_output=True, text=True, check=True).stdout
    first, second = kinds
    assert text.index(first) < text.index(second) < text.index("rank node")
