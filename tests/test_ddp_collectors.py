"""Real 3-process gloo DDP jobs, instrumented, streaming to a real TCP listener."""

from __future__ import annotations

import pytest

from rtop.workload import Faults, WorkloadSpec, run_local
from tests.conftest import median


def test_starved_rank_measured_by_every_rank(listener):
    spec = WorkloadSpec(
        world_size=3, steps=60, batch=32, dim=128, hidden=256, hub=listener.address,
        token=listener.token, faults=Faults(loader_sleep_s={1: 0.030}),
    )
    results = run_local(spec, timeout_s=180)
    steps = listener.records("steps")
    assert sorted(steps) == [0, 1, 2]
    for rank in range(3):
        assert len(steps[rank]) == 60, f"rank {rank} sent {len(steps[rank])} of 60 steps"
        assert results[rank]["stats"]["dropped_unsent"] == 0
    warm = {r: rows[5:] for r, rows in steps.items()}
    starved_wait = median(warm[1], "data_wait_s")
    assert 0.024 <= starved_wait <= 0.036, starved_wait
    for peer in (0, 2):
        assert median(warm[peer], "data_wait_s") < 0.003
        # the peers wait for the starved rank inside the allreduce
        assert median(warm[peer], "comm_s") > median(warm[1], "comm_s") + 0.010
    # the step record is internally consistent
    for row in warm[1]:
        assert row["step_s"] >= row["data_wait_s"] + row["compute_s"] - 1e-6
        assert 0 <= row["comm_exposed_s"] <= row["comm_s"] + 1e-9
        assert row["samples"] == 32
    hello = listener.hellos[1]
    assert hello["identity"]["rank"] == 1 and hello["identity"]["world_size"] == 3
    assert hello["identity"]["source"] == "torch"


@pytest.mark.parametrize("world_size", [2, 3])
def test_comm_bytes_equal_gradient_bytes(listener, world_size):
    spec = WorkloadSpec(world_size=world_size, steps=12, dim=64, hidden=128, layers=2,
                        hub=listener.address, token=listener.token)
    run_local(spec, timeout_s=120)
    from rtop.workload import build_model

    grad_bytes = sum(p.numel() * p.element_size() for p in build_model(spec).parameters())
    for rank, rows in listener.records("steps").items():
        for row in rows:
            assert row["comm_bytes"] == grad_bytes, (rank, row)
            assert row["comm_calls"] >= 1
            assert row["busbw_Bps"] == pytest.approx(
                row["algbw_Bps"] * 2 * (world_size - 1) / world_size)
    # on CPU, by default, DDP's own timer measures this (no comm hook), and rtop says so
    notes = {b["rank"]: b["meta"]["notes"] for b in listener.batches() if "meta" in b}
    assert sorted(notes) == list(range(world_size))
    assert all(any("DDP's own timer" in n for n in ns) for ns in notes.values()), notes
