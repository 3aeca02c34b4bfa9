"""Ray Train through the contract API: the ranks' identities and steps, checkpoints
reported through ``ray.train.report`` timed with no extra line, a worker-group restart,
and Ray Data's own figures beside the probe's, all in one real Ray Train job (2 CPU
workers on gloo) reporting to a real hub over TCP that records the run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from collectors import wire  # noqa: E402
from collectors.schema import TABLES  # noqa: E402
from rtop.client import HubClient  # noqa: E402
from rtop.hub.service import ThreadedHub  # noqa: E402
from rtop.report import build_report  # noqa: E402
from rtop.run.recording import read  # noqa: E402
from tests import ray_restart_worker as worker  # noqa: E402

pytestmark = pytest.mark.ray

TOKEN = "ray-restart-token"


class Job:
    """What the module's one job left behind: the hub (still up), its recording, the
    ranks' own results and what the trainer returned."""

    def __init__(self, hub: ThreadedHub, record: Path, out: Path, result: Any) -> None:
        self.hub = hub
        self.record = record
        self.out = out
        self.result = result

    def rank_result(self, rank: int) -> dict[str, Any]:
        """What rank ``rank`` of the last attempt wrote as it finished."""
        data: dict[str, Any] = json.loads((self.out / f"rank{rank}.json").read_text())
        return data

    def report(self) -> dict[str, Any]:
        """``rtop report --json`` of the recording."""
        return json.loads(json.dumps(build_report(self.record)))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, ray_cluster: dict[str, str]) -> Any:
    import numpy as np
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tmp = tmp_path_factory.mktemp("ray_restart")
    record, out = tmp / "run.rtop", tmp / "out"
    out.mkdir()
    hub = ThreadedHub(job="ray-restart", record=str(record), token=TOKEN).start()
    (tmp / "xdg").mkdir(mode=0o700)
    env = {"RTOP_HUB": hub.address, "RTOP_TOKEN": TOKEN, "RTOP_RUNS_DIR": str(tmp / "runs"),
           "XDG_RUNTIME_DIR": str(tmp / "xdg")}
    rows = 2 * worker.STEPS * worker.BATCH
    rng = np.random.default_rng(0)
    dataset = ray.data.from_items(
        [{"x": rng.random(worker.DIM).astype("float32"), "y": float(i % 5)}
         for i in range(rows)],
        override_num_blocks=4,  # not a task per 2 rows: Ray Data's own cost is not tested
    ).map_batches(worker.slow_batch, batch_size=worker.BATCH)
    trainer = TorchTrainer(
        worker.train_loop,
        datasets={"train": dataset},
        train_loop_config={"marker": str(tmp / "failed-once"), "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp / "storage"), name="rtop-restart",
                             failure_config=FailureConfig(max_failures=1),
                             worker_runtime_env={"env_vars": env}),
    )
    try:
        result = trainer.fit()
    except BaseException:
        hub.stop()
        raise
    assert (tmp / "failed-once").exists(), "rank 1 never failed: no restart was tested"
    # the ranks closed their probes: wait until the hub has heard both say goodbye
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        snap = _snapshot(hub)
        if snap["ranks"]["status"] == ["finished", "finished"]:
            break
        time.sleep(0.2)
    yield Job(hub, record, out, result)
    hub.stop()


def _snapshot(hub: ThreadedHub) -> dict[str, Any]:
    with HubClient(hub.address, TOKEN) as viewer:
        return dict(viewer.snapshot())


def test_ray_train_ranks_report_with_ray_world_ranks(job: Job) -> None:
    """The contract API in a Ray Train job (``collectors.start()`` with no arguments, the
    hub from the runtime env): each rank says it is Ray's, with Ray's world rank and
    size, the run's id as the job and the worker group's id; its steps carry the
    allreduce's bytes, the wait for Ray Data's iterator and the batch's samples."""
    fields = TABLES["steps"]
    group = job.rank_result(0)["group"]  # the second attempt's, which ran to the end
    hellos: dict[int, dict[str, Any]] = {}
    steps: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for _, frame in read(job.record):
        if frame.kind == wire.KIND_HELLO and frame.payload.get("role") == "rank":
            ident = frame.payload["identity"]
            if ident["group"] == group:
                hellos[ident["rank"]] = ident
        elif frame.kind == wire.KIND_BATCH and frame.payload.get("group") == group:
            steps[frame.payload["rank"]] += [dict(zip(fields, row, strict=True))
                                             for row in frame.payload.get("steps", [])]
    assert sorted(hellos) == [0, 1]
    for rank in (0, 1):
        hello = hellos[rank]
        assert hello["source"] == "ray"
        assert hello["rank"] == rank and hello["world_size"] == 2
        assert hello["job"] and hello["job"] == hellos[0]["job"], "Ray Train's run id"
        assert [r["step"] for r in steps[rank]] == list(range(worker.STEPS))
        assert all(r["comm_bytes"] and r["comm_bytes"] > 0 for r in steps[rank])
        # the probe wrapped Ray Data's iter_torch_batches iterator
        assert all(r["data_wait_s"] is not None for r in steps[rank])
        assert all(r["samples"] == worker.BATCH for r in steps[rank])


def test_checkpoints_reported_to_ray_train_are_timed_with_no_extra_line(job: Job) -> None:
    report = job.report()
    expected = worker.STEPS // worker.CHECKPOINT_EVERY
    for rank in (0, 1):
        mine = job.rank_result(rank)
        # the probe wrapped Ray Train's report while it was open, and gave it back
        assert mine["wrapped_while_open"] is True and mine["wrapped_after_close"] is False
        assert mine["checkpoints_timed"] == expected
        assert not any("turned off" in n for n in mine["notes"]), mine["notes"]
        entry = next(r for r in report["ranks"] if r["rank"] == rank)
        assert entry["checkpoints"] == expected, entry
        assert entry["checkpoint_s"] is not None and entry["checkpoint_s"] > 0
    # the hub's live window has them as "checkpoint" events of the current attempt
    with HubClient(job.hub.address, TOKEN) as viewer:
        for rank in (0, 1):
            events = dict(viewer.rank(rank))["events"]
            cps = [e for e in events if e[1] == "checkpoint"]
            assert len(cps) == expected and all(e[2] > 0 for e in cps), events
            # each taken after a multiple of CHECKPOINT_EVERY steps (steps count from 0)
            assert [e[3] + 1 for e in cps] == list(range(
                worker.CHECKPOINT_EVERY, worker.STEPS + 1, worker.CHECKPOINT_EVERY))
    # and they feed Young/Daly's checkpoint interval
    found = [f for f in report["findings"] if f["kind"] == "checkpoint_interval"]
    assert found, [f["kind"] for f in report["findings"]]
    assert found[0]["evidence"]["checkpoint_s"] > 0
    assert found[0]["evidence"]["checkpoints_seen"] >= 2


def test_a_restart_is_a_new_attempt_and_the_first_keeps_its_history(job: Job) -> None:
    snap = _snapshot(job.hub)
    assert snap["run"]["attempts"] == 2 and snap["run"]["attempt"] == 1, snap["run"]
    assert snap["ranks"]["rank"] == [0, 1]
    assert snap["ranks"]["step"] == [worker.STEPS - 1] * 2
    groups = {job.rank_result(r)["group"] for r in (0, 1)}
    assert len(groups) == 1  # both ranks of the second attempt: one worker group

    def first_attempt(hub: Any) -> list[tuple[int, str, int, int, list[float]]]:
        state = hub.state
        first, second = state.attempts
        assert second.group in groups and first.group not in groups
        return [(rs.rank, rs.status, rs.steps_seen, rs.last_step,
                 state.steps.history("step", rs.slot).tolist() if rs.slot is not None
                 else [])
                for rs in sorted(first.ranks.values(), key=lambda r: r.rank)]

    kept = job.hub.call(first_attempt)
    assert [k[0] for k in kept] == [0, 1]
    # rank 1 said why it failed (Ray Train caught its exception; the probe heard of it);
    # rank 0 was torn down with the group (or failed on its own, with another error)
    assert kept[1][1] == "failed" and kept[0][1] in ("ended", "failed"), kept
    for rank, _status, seen, last, history in kept:
        if rank == 1:  # it failed after FAIL_AFTER steps and said so, sending every one
            assert seen == worker.FAIL_AFTER, kept
        else:
            # rank 0 ran as far, and its next allreduce waits for rank 1, which waits
            # FAIL_DELAY_S before it fails: rank 0's sender sends its steps meanwhile.
            # Ray then tears it down with a kill, which takes any record not sent yet
            # with it (a step that closed within the last flush interval, 0.5 s).
            assert 1 <= seen <= worker.FAIL_AFTER + 1, kept
        # its step history is kept: every step it ran, in the hub's window
        assert last == seen - 1 and history == list(range(seen)), kept
    # the report of the recording shows both attempts
    report = job.report()
    assert report["run"]["attempts"] == 2
    attempts = report["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1]
    assert attempts[0]["ended"] == "replaced" and attempts[1]["ended"] == "finished"
    assert attempts[0]["group"] != attempts[1]["group"]
    first = attempts[0]["ranks"]
    assert first[1]["status"] == "failed", first
    assert first[1]["error"] == "RuntimeError: rank 1 fails in the first attempt"
    assert first[0]["status"] == "ended" or first[0]["error"] != first[1]["error"], first
    assert [r["status"] for r in attempts[1]["ranks"]] == ["finished", "finished"]
    for r in attempts[0]["ranks"]:
        assert r["steps"] == worker.FAIL_AFTER if r["rank"] == 1 else \
            1 <= r["steps"] <= worker.FAIL_AFTER + 1, r
        assert r["first_step"] == 0 and r["step_s"] is not None
    assert [r["steps"] for r in attempts[1]["ranks"]] == [worker.STEPS] * 2
    assert report["previous_attempts"] == attempts[:1]
    assert report["ranks"] == attempts[1]["ranks"]


def test_ray_data_blocked_time_agrees_with_the_probes_data_wait(job: Job) -> None:
    report = job.report()
    for rank in (0, 1):
        figures = job.rank_result(rank)["figures"]["ray_data"]
        entry = next(r for r in report["ranks"] if r["rank"] == rank)
        assert entry["ray_data"] == figures  # sent to the hub, in the report as measured
        ray_s = figures["blocked_s"] + figures["init_s"]
        wait_s = figures["probe_data_wait_s"]
        assert figures["blocked_s"] > 0 and wait_s > 0, figures
        assert figures["passes"] == 1 and figures["batches"] == worker.STEPS, figures
        # the data is slow: the wait is real time, not noise
        assert wait_s > 0.2 * worker.STEPS * worker.SLOW_S, figures
        assert abs(ray_s - wait_s) <= max(0.1, 0.2 * max(ray_s, wait_s)), figures
        assert figures["agree"] is True
        # the probe's figure is its data wait: the steps' data_wait_s add up to it (the
        # loop stopped after its last step: no next() ended the pass)
        with HubClient(job.hub.address, TOKEN) as viewer:
            waits = dict(viewer.rank(rank))["steps"]["data_wait_s"]
        assert len(waits) == worker.STEPS and sum(waits) == pytest.approx(wait_s, rel=1e-6)
        notes = job.rank_result(rank)["notes"]
        said = [n for n in notes if n.startswith("Ray Data cross-check")]
        assert len(said) == 1 and "they agree" in said[0], notes
        assert any(n.startswith("Ray Data cross-check") for n in entry["notes"])

