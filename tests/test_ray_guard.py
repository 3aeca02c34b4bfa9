"""``collectors.raytrain`` in one process: Ray Train's local mode (``num_workers=0``: the
real ``ray.train.report`` dispatch, run in this process) and Ray Data iterators in the
driver. The report wrapper's contract (a checkpoint timed, metrics alone not, nothing
timed twice, ``report`` given back at close) and its guard points: a failure in rtop's
part turns the feature off with one note, the user's call still runs exactly once and
its exceptions propagate unchanged; batches still flow."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import collectors  # noqa: E402
from collectors import probe as probe_module  # noqa: E402
from collectors import raytrain  # noqa: E402
from tests.never_raise_workers import FaultyClock  # noqa: E402

pytestmark = pytest.mark.ray


class Formatted:
    """A metric that counts how often Ray Train formats it (once per ``report`` call in
    local mode, which logs the metrics) and, with ``error``, raises that error then."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.n = 0
        self.error = error

    def __repr__(self) -> str:
        self.n += 1
        if self.error is not None:
            raise self.error
        return "formatted"


def run_local(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` as a Ray Train training function in local mode; return its result."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.train_fn_utils import set_train_fn_utils

    box: dict[str, Any] = {}

    def train_fn(config: dict[str, Any]) -> None:
        box["result"] = fn()

    try:
        TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=0)).fit()
    finally:  # local mode leaves its context set: later tests are no Ray Train worker
        set_train_fn_utils(None)
    return box["result"]


@pytest.fixture
def ckpt_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "model.pt"), "w") as f:
            f.write("weights")
        yield d


def _utils() -> Any:
    from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils

    return get_train_fn_utils()


def test_report_with_a_checkpoint_is_timed_once_and_given_back(listener, ckpt_dir):
    from ray.train import Checkpoint, report  # imported before the probe starts

    def train() -> dict[str, Any]:
        import ray.train

        probe = collectors.start(hub=listener.address, token=listener.token)
        assert isinstance(probe, collectors.Probe) and probe.identity.source == "ray"
        assert "report" in vars(_utils())
        checkpoint = Checkpoint.from_directory(ckpt_dir)
        for i in range(3):
            with probe.step():
                time.sleep(0.002)
            report({"i": i}, checkpoint=checkpoint)  # caught: imported before start
            ray.train.report({"i": i})  # metrics only: not a checkpoint
        with probe.step():
            pass
        with probe.checkpoint():  # the user times it too: not counted twice
            ray.train.report({"i": 3}, checkpoint=checkpoint)
        assert probe.raytrain is not None
        timed = probe.raytrain.checkpoints
        probe.close()  # flushes what the sender thread has not sent yet
        return {"timed": timed, "after": "report" in vars(_utils()),
                "notes": list(probe.notes)}

    got = run_local(train)
    assert got["timed"] == 3 and got["after"] is False, got
    assert not any("turned off" in n for n in got["notes"]), got["notes"]
    # the hub heard four checkpoints: three timed by the wrapper, one by the user's own
    # `with probe.checkpoint()` (the report inside it not timed twice)
    assert _byes(listener), "the rank never said goodbye: its records may be missing"
    sent = listener.records("events").get(0, [])
    assert [(e["kind"], e["step"]) for e in sent] == [
        ("checkpoint", 0), ("checkpoint", 1), ("checkpoint", 2), ("checkpoint", 3)], sent
    assert all(e["duration_s"] >= 0 for e in sent)


@pytest.mark.parametrize("where", ["enter", "exit"])
def test_a_fault_in_the_report_wrapper_turns_it_off(listener, ckpt_dir, monkeypatch, where):
    from ray.train import Checkpoint

    clock = FaultyClock()
    monkeypatch.setattr(probe_module, "time", clock)

    def train() -> dict[str, Any]:
        import ray.train

        probe = collectors.start(hub=listener.address, token=listener.token)
        assert isinstance(probe, collectors.Probe)
        checkpoint = Checkpoint.from_directory(ckpt_dir)
        metric = Formatted()
        clock.arm(skip=0 if where == "enter" else 1)  # the phase's first or second reading
        returned = ray.train.report({"m": metric}, checkpoint=checkpoint)
        calls_then, fired = metric.n, clock.fired
        # off for the rest of the run: later checkpoints still reported, not timed
        ray.train.report({"m": metric}, checkpoint=checkpoint)
        # the user's own exception goes through unchanged, the call made once
        error = ValueError("the user's own error")
        boom = Formatted(error)
        try:
            ray.train.report({"m": boom}, checkpoint=checkpoint)
            raised = None
        except ValueError as exc:
            raised = exc
        out = {"returned": returned, "calls_then": calls_then, "calls": metric.n,
               "fired": fired, "raised_same": raised is error, "boom_calls": boom.n,
               "phase": probe.activity.phase,
               "notes": list(probe.notes), "off": dict(probe.faults.off)}
        probe.close()  # flushes what the sender thread has not sent yet
        return out

    got = run_local(train)
    assert got["fired"] == 1, got
    assert got["returned"] is None and got["calls_then"] == 1 and got["calls"] == 2, got
    assert got["raised_same"] is True and got["boom_calls"] == 1, got
    assert got["phase"] == "idle", got
    assert _byes(listener), "the rank never said goodbye: its records may be missing"
    assert listener.records("events") == {}, "no checkpoint was timed"
    turned_off = [n for n in got["notes"] if n.startswith("rtop turned off")]
    assert len(turned_off) == 1 and "raytrain.report" in turned_off[0], got["notes"]
    assert list(got["off"]) == [raytrain.CHECKPOINT_FEATURE]


def _run_in_thread_runner(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` as Ray Train V2's worker runs the training function (its own
    ThreadRunner) inside a local-mode training function; return the runner."""
    from ray.train.v2._internal.execution.worker_group.thread_runner import ThreadRunner

    def train() -> Any:
        runner = ThreadRunner()
        runner.run(fn)
        deadline = time.monotonic() + 20
        while runner.is_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        return runner

    return run_local(train)


def _byes(listener: Any) -> list[dict[str, Any]]:
    from collectors import wire

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        byes = [f.payload for _, f in list(listener.frames) if f.kind == wire.KIND_BYE]
        if byes:
            return byes
        time.sleep(0.05)
    return []


def test_the_error_that_ends_the_training_function_reaches_the_hub(listener):
    """Ray Train catches it (no excepthook, no atexit before the group is torn down):
    the probe hears of it where Ray Train does, and says goodbye with it."""
    error = RuntimeError("the user's loop broke")
    seen: dict[str, Any] = {}

    def train_fn() -> None:
        probe = collectors.start(hub=listener.address, token=listener.token)
        seen["probe"] = probe
        for _ in probe.iter(range(3)):
            with probe.step():
                pass
        raise error

    runner = _run_in_thread_runner(train_fn)
    assert str(error) in str(runner.get_error())  # Ray Train still reports it
    probe = seen["probe"]
    assert probe._closed and probe.exit_error == "RuntimeError: the user's loop broke"
    byes = _byes(listener)
    assert [b["error"] for b in byes] == ["RuntimeError: the user's loop broke"]
    # closing gave Ray Train's error handling back
    from ray.train.v2._internal.execution.worker_group import thread_runner

    assert getattr(thread_runner.construct_user_exception_with_traceback, "_rtop_hooks",
                   None) is None


def test_a_fault_in_sending_that_error_leaves_ray_trains_handling_intact(listener):
    def broken_close(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected fault")

    seen: dict[str, Any] = {}
    error = ValueError("the user's own error")
    patch = pytest.MonkeyPatch()

    def train_fn() -> None:
        probe = collectors.start(hub=listener.address, token=listener.token)
        seen["probe"] = probe
        patch.setattr(collectors.Probe, "close", broken_close)
        raise error

    try:
        runner = _run_in_thread_runner(train_fn)
    finally:
        patch.undo()
    probe = seen["probe"]
    try:
        assert str(error) in str(runner.get_error())  # reported by Ray Train unchanged
        turned_off = [n for n in probe.notes if n.startswith("rtop turned off")]
        assert len(turned_off) == 1 and "raytrain.failed" in turned_off[0], probe.notes
        assert list(probe.faults.off) == [raytrain.FAILURE_FEATURE]
    finally:
        probe.close()


def _slow(batch: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.02)
    return batch


def test_ray_data_passes_are_cross_checked_outside_ray_train(listener, ray_cluster):
    """Two epochs over a plain dataset's iterator (its stats object is shared by both
    passes): the totals are per pass, added up."""
    probe = collectors.start(hub=listener.address, token=listener.token)
    assert isinstance(probe, collectors.Probe) and probe.raytrain is not None
    ds = ray.data.range(64, override_num_blocks=4).map_batches(_slow, batch_size=8)
    it = ds.iterator()
    try:
        seen = 0
        for _epoch in range(2):
            for batch in probe.iter(it.iter_torch_batches(batch_size=8)):
                with probe.step():
                    seen += len(batch["id"])
        figures = probe.figures["ray_data"]
    finally:
        probe.close()
    assert seen == 128
    assert figures["passes"] == 2 and figures["batches"] == 16, figures
    ray_s = figures["blocked_s"] + figures["init_s"]
    assert figures["blocked_s"] > 0 and figures["probe_data_wait_s"] > 0, figures
    assert raytrain.compare(ray_s, figures["probe_data_wait_s"]) and figures["agree"], figures
    said = [n for n in probe.notes if n.startswith("Ray Data cross-check")]
    assert len(said) == 1 and "over 2 passes" in said[0] and "they agree" in said[0]
    # the hub got the figures with the notes
    deadline = time.monotonic() + 10
    metas: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        metas = [b["meta"] for b in listener.batches() if "ray_data" in (b.get("meta") or {})]
        if metas and metas[-1]["ray_data"] == figures:
            break
        time.sleep(0.05)
    assert metas and metas[-1]["ray_data"] == figures


def test_a_fault_in_the_ray_data_check_turns_it_off_and_batches_flow(
        listener, ray_cluster, monkeypatch):
    class Broken:  # stands in for raytrain._Pass: catching a pass's stats fails
        def __init__(self, *args: Any) -> None:
            raise RuntimeError("injected fault")

    monkeypatch.setattr(raytrain, "_Pass", Broken)
    probe = collectors.start(hub=listener.address, token=listener.token)
    assert isinstance(probe, collectors.Probe)
    ds = ray.data.range(32, override_num_blocks=2)
    try:
        ids = [int(i) for batch in probe.iter(ds.iter_torch_batches(batch_size=8))
               for i in batch["id"]]
        again = [int(i) for batch in probe.iter(ds.iter_torch_batches(batch_size=8))
                 for i in batch["id"]]
    finally:
        probe.close()
    assert sorted(ids) == sorted(again) == list(range(32))
    assert "ray_data" not in probe.figures
    turned_off = [n for n in probe.notes if n.startswith("rtop turned off")]
    assert len(turned_off) == 1 and "raytrain.data" in turned_off[0], probe.notes
    assert "injected fault" in turned_off[0]
    assert list(probe.faults.off) == [raytrain.RAY_DATA_FEATURE]
