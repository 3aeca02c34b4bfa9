"""The wording of findings as plain functions: a finding's ranks and evidence in, its
summary and fix out (the detectors decide; ``rtop.analysis.wording`` only says it)."""

from __future__ import annotations

import math
import time

import pytest

from rtop.analysis import wording
from rtop.analysis.kinds import KINDS


def test_every_kind_has_a_summary_and_every_fix_fills_in():
    assert set(wording.SUMMARIES) == set(KINDS)
    for kind in KINDS:
        # nothing measured: the sentence still reads, with n/a where a figure is missing
        assert wording.summary(kind, [3], {}).endswith(".")
        fix = wording.fix(kind, [3], {})
        assert "{" not in fix and "}" not in fix, (kind, fix)


@pytest.mark.parametrize(("x", "text"), [
    (0.25, "250 ms"), (0.0095, "10 ms"), (0.0027, "2.7 ms"), (None, "n/a"), (math.nan, "n/a")])
def test_milliseconds(x, text):
    assert wording.ms(x) == text


@pytest.mark.parametrize(("s", "text"), [
    (45.0, "45 s"), (600.0, "10 min"), (73480.0, "20.4 h"), (None, "n/a")])
def test_durations(s, text):
    assert wording.duration(s) == text


def test_rank_names():
    assert wording.names([4]) == "Rank 4"
    assert wording.names([4, 0]) == "Ranks 4 and 0"
    assert wording.names([6, 0, 9]) == "Ranks 6, 0, 9"
    assert wording.names(list(range(7))) == "Ranks 0, 1, 2, 3, 4 and others"


def test_starved_rank():
    ev = {"ranks": {"1": {"node": "node-b", "data_wait_s": 0.025, "peers_data_wait_s": 0.0027,
                          "comm_s": 0.01}},
          "peers_comm_s_median": 0.014}
    assert wording.summary("starved_rank", [1], ev) == (
        "Rank 1 waits 25 ms per step for data, 9x its peers (2.7 ms); the others then wait "
        "for it inside the allreduce (14 ms vs 10 ms).")
    fix = wording.fix("starved_rank", [1], ev)
    assert fix.startswith("Give rank 1's input more throughput")
    assert "check node node-b's CPU and disk" in fix
    # peers that barely wait, peers not measured, the starved rank's own comm not measured
    ev["ranks"]["1"].update(peers_data_wait_s=0.0001, comm_s=None)
    assert wording.summary("starved_rank", [1], ev) == \
        "Rank 1 waits 25 ms per step for data, while its peers wait 0.1 ms."
    ev["ranks"]["1"]["peers_data_wait_s"] = None
    assert wording.summary("starved_rank", [1], ev) == \
        "Rank 1 waits 25 ms per step for data, while its peers do not wait."
    assert "check node n/a's" in wording.fix("starved_rank", [1], {})


def test_input_bound():
    ev = {"data_wait_s_median": 0.05, "data_wait_share_median": 0.5, "ranks": 1}
    assert wording.summary("input_bound", [0], ev) == (
        "The rank waits 50 ms per step for data (50% of the step): the input pipeline, not "
        "any one rank, sets the pace.")
    ev.update(ranks=4, data_wait_share_median=None)
    assert wording.summary("input_bound", [0, 1, 2, 3], ev).startswith(
        "Every rank waits 50 ms per step for data (n/a of the step)")


def test_straggler_and_its_causes():
    counters = {"sm_clock_mhz": 1200.0, "sm_clock_max_mhz": 1980.0,
                "throttle_reasons": ["sw_power_cap", "sw_thermal_slowdown"],
                "power_w": 699.0, "power_limit_w": 700.0, "temp_c": 90.0,
                "gpu": "NVIDIA H100 80GB HBM3", "peers_gpu": "NVIDIA H200",
                "host_cpu_pct": 99.0, "load_avg_1m": 33.3}
    assert wording.straggler_cause(["clocks", "power_cap", "hot", "gpu_model", "host_cpu"],
                                   counters) == (
        "its GPU clocks are held at 1200 of 1980 MHz (sw_power_cap, sw_thermal_slowdown); "
        "it runs at its power cap (699 of 700 W); it is hot (90 °C); it has a different GPU "
        "(NVIDIA H100 80GB HBM3, the others NVIDIA H200); its host's CPUs are saturated (99%)")
    assert wording.straggler_cause(["host_cpu_shared"], counters) == \
        "its host's CPUs are saturated (99%, load 33.3): the processes there compete for cores"
    assert wording.straggler_cause(["host_cpu_shared"], {"host_cpu_pct": 95.0}) == \
        "its host's CPUs are saturated (95%): the processes there compete for cores"
    assert wording.straggler_cause([], counters).startswith("nothing in its own counters")
    ev = {"ranks": {"1": {"compute_s": 0.1, "peers_compute_s": 0.07036}},
          "cause": "its GPU clocks are held at 345 of 1980 MHz"}
    assert wording.summary("straggler", [1], ev) == (
        "Rank 1 computes 100 ms per step, 1.4x its peers (70 ms), and they wait for it in the "
        "allreduce; its GPU clocks are held at 345 of 1980 MHz.")
    # no worded cause in the evidence: worded from the causes and counters
    ev = {"ranks": {"1": {"compute_s": 0.1, "peers_compute_s": None}},
          "causes": ["hot"], "rank_counters": {"temp_c": 88.0}}
    assert wording.summary("straggler", [1], ev) == (
        "Rank 1 computes 100 ms per step, its peers n/a, and they wait for it in the "
        "allreduce; it is hot (88 °C).")
    assert wording.summary("straggler", [1, 3], ev).startswith(
        "Ranks 1 and 3 compute up to 100 ms per step, their peers n/a, and they wait for them")


def test_gpu_throttled():
    ev = {"ranks": {"2": {"sm_clock_mhz": 1500.0, "sm_clock_max_mhz": 1980.0,
                          "reasons": ["hw_power_brake_slowdown"]}}}
    assert wording.summary("gpu_throttled", [2], ev) == \
        "Rank 2's GPU runs at 1500 of 1980 MHz, held down by hw power brake slowdown."
    ev["ranks"]["2"].update(sm_clock_mhz=None, reasons=[])
    assert wording.summary("gpu_throttled", [2], ev) == \
        "Rank 2's GPU runs at n/a of 1980 MHz, held down by n/a."


def test_slow_link_counts_every_node_not_only_those_listed():
    ev = {"fabric": "ethernet", "expected_busbw_Bps": 10e9, "busbw_best_Bps": 3.18e9,
          "nodes": [f"n{i}" for i in range(32)], "node_count": 40}
    assert wording.summary("slow_link", [0, 1], ev) == (
        "The allreduce runs at 3.18 GB/s bus bandwidth between 40 nodes, 32% of what "
        "ethernet should give (10 GB/s); a slow link slows every rank of the ring alike.")
    ev = {"fabric": "nvlink", "expected_busbw_Bps": 300e9, "busbw_best_Bps": None,
          "nodes": ["a"]}
    assert wording.summary("slow_link", [0, 1], ev).startswith(
        "The allreduce runs at n/a GB/s bus bandwidth within the node, n/a of what nvlink "
        "should give (300 GB/s)")


def test_low_scaling_efficiency():
    ev = {"efficiency": 0.587, "compute_s": 0.03553, "comm_exposed_s": 0.025,
          "what_if": [{"ranks": 5, "efficiency": 0.9995}, {"ranks": 20, "efficiency": 0.45}]}
    assert wording.summary("low_scaling_efficiency", [0, 1], ev) == (
        "Only 59% of each step is compute: 25 ms of communication is not hidden behind 36 ms of "
        "compute (at 20 ranks, 45%).")
    ev["what_if"] = []
    assert wording.summary("low_scaling_efficiency", [0, 1], ev).endswith("of compute.")


def test_memory_wall_three_ways():
    rank = {"capacity_bytes": 141e9, "used_bytes": 145.3e9, "headroom_bytes": -1.41e9,
            "steps_to_oom": None, "growth_Bps": None}
    ev = {"ranks": {"4": rank}}
    assert wording.summary("memory_wall", [4, 0], ev) == (
        "Ranks 4 and 0 use up to 145 GB, more than the 141 GB each has: out of memory or "
        "about to be.")
    rank.update(used_bytes=54.5e9, capacity_bytes=80e9, growth_Bps=0.5e9, steps_to_oom=255.0)
    assert wording.summary("memory_wall", [4], ev) == \
        "Rank 4's memory grows 500 MB/s and fills its 80 GB in about 255 steps."
    rank.update(used_bytes=120e9, capacity_bytes=141e9, headroom_bytes=7e9, steps_to_oom=None)
    assert wording.summary("memory_wall", [4], ev) == (
        "Rank 4 has 7 GB of 141 GB left at its peak (5%): the next larger batch or sequence "
        "will not fit.")
    rank.update(used_bytes=None, headroom_bytes=None)
    assert wording.summary("memory_wall", [4], ev).startswith("Rank 4 has n/a GB of 141 GB")


def test_hung_rank():
    ev = {"median_step_s": 0.063, "peers_waiting_in_collective": [0, 2],
          "peers_waiting_count": 2,
          "ranks": {"1": {"phase": "compute", "phase_s": 41.2}}}
    assert wording.summary("hung_rank", [1], ev) == (
        "Rank 1 has been stuck in compute for 41 s (a step takes 63 ms); 2 peers wait for it "
        "in the allreduce.")
    ev.update(median_step_s=None, peers_waiting_in_collective=[], peers_waiting_count=0)
    assert wording.summary("hung_rank", [1, 5], ev) == \
        "Ranks 1 and 5 have been stuck in compute for 41 s (a step takes n/a)."


def test_lost_rank_counts_every_follower():
    ev = {"ranks": {"1": {"last_step": 24, "silent_s": 13.0}},
          "lost_after_them": list(range(64)), "lost_after_count": 100}
    assert wording.summary("lost_rank", [1], ev) == (
        "Rank 1 stopped reporting (last step 24, 13 s ago): the process likely died or its "
        "node went away; the others will block in the next collective. 100 more ranks went "
        "after it.")
    ev = {"ranks": {"1": {"last_step": None, "silent_s": None}}, "lost_after_them": [3]}
    assert wording.summary("lost_rank", [1], ev) == (
        "Rank 1 stopped reporting (no step reported, n/a s ago): the process likely died or its "
        "node went away; the others will block in the next collective. 1 more rank went "
        "after it.")


def test_checkpoint_interval():
    ev = {"checkpoint_s": 120.0, "interval_s": 30000.0, "ranks": 8, "gpu_mtbf_h": 50000.0,
          "job_mtbf_s": 22500000.0, "optimal_interval_s": 73480.0, "overhead_now": 0.004667,
          "overhead_at_optimum": 0.003266}
    assert wording.summary("checkpoint_interval", [0, 1], ev) == (
        "Checkpoints take 120.0 s every 30000 s: too often for 8 GPUs (job MTBF 6250 h); "
        "every 20.4 h would cost 0.3% of the run instead of 0.5%.")
    assert wording.fix("checkpoint_interval", [0, 1], ev).startswith(
        "Checkpoint about every 20.4 h (Young/Daly")
    ev.update(gpu_mtbf_h=None, interval_s=None)
    assert wording.summary("checkpoint_interval", [0, 1], ev).startswith(
        "Checkpoints take 120.0 s every n/a s: off the optimum for 8 GPUs (job MTBF 6250 h)")


def test_lost_rank_names_the_culprit_and_how_its_followers_went():
    t = 1796104137.514
    at = time.strftime("%H:%M:%S", time.localtime(t)) + ".514"
    ev = {"ranks": {"1": {"last_step": 24, "how": "reset", "lost_at": t}},
          "whole_node": None, "lost_after_them": [2, 0, 3], "lost_after_count": 3,
          "followers": {"2": {"how": "SIGTERM"}, "0": {"how": "SIGTERM"},
                        "3": {"how": "no goodbye"}}}
    assert wording.summary("lost_rank", [1], ev) == (
        f"Rank 1 died (connection reset at {at}, no goodbye, last step 24); ranks 0 and 2 "
        "were torn down after it (SIGTERM); rank 3 went after it (no goodbye).")
    ev.update(whole_node="b", followers={"0": {"how": "exit"}}, lost_after_them=[0],
              lost_after_count=1, ranks={"2": {"last_step": 9, "how": "eof", "lost_at": t}})
    assert wording.summary("lost_rank", [2, 3], ev) == (
        f"Ranks 2 and 3 died together, every rank of node b (connection closed at {at}, "
        "no goodbye, last step 9): the node or its container likely went away; rank 0 "
        "exited after them.")
