"""rtop never raises into training: an exception injected at each of
``collectors.guard.ENTRY_POINTS``, in a real 2-rank DDP job on gloo (CUDA faked where
needed), leaves the training loop running to completion with parameters identical to
the same job unwatched; the point's feature is turned off, with one note."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import collectors
from collectors.guard import ENTRY_POINTS
from collectors.identity import detect
from rtop.workload import free_port
from tests import never_raise_workers


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("never-raise")
    mp.start_processes(never_raise_workers.every_point, args=(2, free_port(), str(out)),
                       nprocs=2, start_method="spawn")
    return [json.loads(Path(out, f"rank{r}").read_text()) for r in range(2)]


@pytest.mark.parametrize("point", list(ENTRY_POINTS))
def test_a_fault_at_each_point_never_reaches_the_job(results, point):
    steps = never_raise_workers.STEPS
    at = never_raise_workers.FAULT_AT
    _, feature = ENTRY_POINTS[point]
    for rank, by_point in enumerate(results):
        r = by_point[point]
        assert r["fired"] >= 1, f"rank {rank}: the fault at {point} was never injected"
        assert r["steps"] == steps, f"rank {rank}: training stopped at step {r['steps']}"
        assert r["same"], f"rank {rank}: parameters differ from the unwatched job"
        assert r["off"] == [feature]
        notes = [n for n in r["notes"] if n.startswith("rtop turned off")]
        assert len(notes) == 1 and point in notes[0] and "injected" in notes[0]
        if point.startswith("step."):
            # step timing off from the fault on: the steps before it were recorded
            assert r["records"] == at
        else:
            assert r["records"] == steps  # every step still recorded
        if feature == "collective timing":
            # measured before, not measured (None, never zero) from the faulty step on
            assert r["comm"][:at] == [True] * at
            assert not any(r["comm"][at + 1:])
        if point == "cuda.record":
            assert r["cuda"][:at] == [True] * at and not any(r["cuda"][at:])
        if point == "cuda.capture":
            # the user's capture succeeds; CUDA timing is off from the faulty step on
            assert r["captured"] is True
            assert r["cuda"][:at] == [True] * at and not any(r["cuda"][at:])
        assert r["graph_restored"], "CUDAGraph's methods were not given back"
        if feature == "direct collective timing":
            # the user's own collectives timed before the fault, untimed from it on
            assert r["direct"][:at] == [True] * at and not any(r["direct"][at + 1:])


@pytest.fixture(scope="module")
def profile_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("never-raise-profile")
    mp.start_processes(never_raise_workers.profile_faults, args=(2, free_port(), str(out)),
                       nprocs=2, start_method="spawn")
    return [json.loads(Path(out, f"rank{r}").read_text()) for r in range(2)]


@pytest.mark.parametrize("fault", list(never_raise_workers.PROFILE_FAULTS))
def test_a_failing_profile_never_reaches_the_job_nor_its_communicators(profile_results,
                                                                       fault):
    """``rtop profile`` failing at each stage (the profiler's start, step, stop, the
    trace's export, reading the events, rtop's summary) in a real 2-rank DDP job: the
    job runs every step with parameters identical to the unwatched job, the hub gets one
    error, the profiler is off afterwards (a failed stop included: torch synchronises the
    GPU there, and a CUDA error used to leave the profiler running for good), and the
    job's communicators are as the job made them: the same process groups, no
    coalescing left open, torch's own methods, and a collective and a barrier that
    complete."""
    for rank, by_fault in enumerate(profile_results):
        r = by_fault[fault]
        assert r["fired"] == 1, f"rank {rank}: the fault was never injected"
        assert r["steps"] == never_raise_workers.STEPS
        assert r["same"], f"rank {rank}: parameters differ from the unwatched job"
        assert len(r["answers"]) == 1 and "injected fault" in r["answers"][0]["error"]
        assert not r["enabled"], f"rank {rank}: the profiler is still running"
        assert r["comm_same"] and r["sum"] == [3.0] * 4


def test_the_jobs_own_errors_still_reach_it():
    """Guarding rtop's code must not swallow the job's: a loader's exception and an
    exception inside a step propagate unchanged."""
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)

    def loader():
        yield 1
        raise ValueError("the loader's own error")

    with pytest.raises(ValueError, match="the loader's own error"):
        for _ in probe.iter(loader()):
            pass
    with pytest.raises(KeyError), probe.step():
        raise KeyError("the step's own error")
    assert probe.faults.off == {}
    probe.close(0.1)
