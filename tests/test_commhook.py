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
