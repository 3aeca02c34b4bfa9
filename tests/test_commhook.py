"""The DDP comm hook: gradients bit-identical, user hooks kept working."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from rtop.workload import free_port
from tests import ddp_workers


def _run(fn, world, tmp_path: Path) -> list[str]:
    mp.start_processes(fn, args=(world, free_port(), str(tmp_path)), nprocs=world,
                       start_method="spawn")
    return [(tmp_path / f"rank{r}").read_text() for r in range(world)]


@pytest.mark.parametrize(
    ("world", "worker"),
    [(2, ddp_workers.compare_grads), (3, ddp_workers.compare_grads),
     (3, ddp_workers.compare_grads_bucket_view)],
    ids=["2-ranks", "3-ranks", "3-ranks-gradient-as-bucket-view"],
)
def test_gradients_bit_identical_to_unhooked_ddp(tmp_path, world, worker):
    for out in _run(worker, world, tmp_path):
        same, max_buckets, note = out.split(" ", 2)
        assert same == "1", "hooked DDP gradients differ from un-hooked DDP"
        assert int(max_buckets) >= 2, "expected several buckets once DDP rebuilt them (cap 0.1 MB)"
        assert "timed per bucket" in note


def test_user_hook_registered_after_watch_is_wrapped_and_timed(tmp_path):
    for out in _run(ddp_workers.user_hook_after_watch, 2, tmp_path):
        calls, timed, same = out.split()
        assert int(calls) >= 1, "the user's hook was not called"
        assert timed == "1", "the user's hook was not timed"
        assert same == "1"


def test_user_hook_registered_before_watch_keeps_working(tmp_path):
    for out in _run(ddp_workers.user_hook_before_watch, 2, tmp_path):
        calls, unmeasured, note = out.split(" ", 2)
        assert int(calls) >= 1
        assert unmeasured == "1", "comm must be reported as not measured, not as zero"
        assert "counting_hook" in note and "not measured" in note


def _rows(rows: list[list]) -> list[dict]:
    from collectors.schema import STEP_FIELDS

    return [dict(zip(STEP_FIELDS, r, strict=True)) for r in rows]


def test_ddp_timing_mode_times_the_allreduce_without_a_comm_hook(tmp_path):
    import json

    for out in _run(ddp_workers.ddp_timer_figures, 3, tmp_path):
        res = json.loads(out)
        assert res["hooks"] == 0, "rtop registered a comm hook on a CPU model"
        assert res["same"], "gradients differ from plain DDP"
        assert "DDP's own timer" in res["note"]
        rows = _rows(res["rows"])
        assert [r["step"] for r in rows] == list(range(8))
        for r in rows:
            if r["step"] == 5:  # no_sync: no allreduce ran, and none is reported
                assert r["comm_s"] == 0 and r["comm_bytes"] == 0
                continue
            assert r["comm_bytes"] == res["grad_bytes"]
            assert r["comm_calls"] >= 1
            assert 0 < r["comm_s"] < r["step_s"]
            assert 0 <= r["comm_exposed_s"] <= r["comm_s"]
            assert r["busbw_Bps"] > 0
            body = r["step_s"] - (r["gap_s"] or 0) - (r["data_wait_s"] or 0)
            assert r["compute_s"] == pytest.approx(body - r["comm_exposed_s"], abs=1e-6)
        # one post-accumulate-grad hook marks the heartbeat's comm phase; closing the
        # probe removes it, and a later probe times the same model again
        assert res["phase_hooks"] == 1
        assert res["released"], "the closed probe left its hook on the model"
        again = _rows([res["rewatched"]])[0]
        assert again["comm_s"] > 0 and again["comm_bytes"] == res["grad_bytes"]


def test_ddp_timing_mode_times_a_user_hook_registered_before_watch(tmp_path):
    import json

    for out in _run(ddp_workers.ddp_timer_with_user_hook, 2, tmp_path):
        res = json.loads(out)
        assert res["calls"] >= 3, "the user's hook stopped being called"
        for r in _rows(res["rows"]):
            assert r["comm_s"] > 0 and r["comm_bytes"] > 0
