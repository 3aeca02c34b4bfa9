"""Step-record arithmetic: unions, exposure, bus bandwidth."""

from __future__ import annotations

import pytest

from collectors.timeline import bus_bandwidth, clipped_union, comm_figures, union_length


def test_union_counts_overlaps_once():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([(5, 6), (0, 1), (0.5, 0.75)]) == 2
    assert union_length([]) == 0
    assert union_length([(1, 1), (2, 1)]) == 0


def test_clipped_union():
    assert clipped_union([(0, 2), (1, 3)], 2.5) == 0.5
    assert clipped_union([(0, 1)], 2) == 0


def test_bus_bandwidth_nccl_tests_convention():
    assert bus_bandwidth(100.0, 2) == 100.0
    assert bus_bandwidth(100.0, 4) == 150.0
    assert bus_bandwidth(100.0, 8) == pytest.approx(175.0)
    assert bus_bandwidth(100.0, 1) is None


def test_comm_figures_overlapping_buckets():
    # three buckets launched during backward; backward ends at the last launch (t=4)
    buckets = [(1.0, 3.0, 100), (2.0, 5.0, 200), (4.0, 6.0, 300)]
    comm_s, exposed, nbytes, calls, algbw, busbw = comm_figures(buckets, 4)
    assert comm_s == 5.0           # union of [1, 6]
    assert exposed == 2.0          # [4, 6]: nothing left to overlap with
    assert nbytes == 600 and calls == 3
    assert algbw == 120.0 and busbw == 180.0


def test_no_collective_in_a_step_is_zero_not_missing():
    assert comm_figures([], 2) == (0.0, 0.0, 0, 0, None, None)
