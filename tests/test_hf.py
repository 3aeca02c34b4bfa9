"""``collectors.hf.RtopCallback`` in real Hugging Face Trainer jobs on CPU: a 2-rank
torchrun job (gloo) training a tiny randomly initialised GPT-2 with one starved rank,
reported by a real hub; and an exception injected at each of the callback's guarded
points, which never reaches the Trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from collectors import auth, wire
from collectors.schema import TABLES
from rtop.hub.service import ThreadedHub
from rtop.report import build_report
from rtop.run.recording import read
from rtop.workload import free_port
from tests import hf_worker

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "hf_worker.py"
MASTER = "hf-test-token"
SLOW_S = 0.05  # rank 1's extra data wait per optimizer step
STEPS, BATCH, ACCUMULATE = 60, 8, 2


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RTOP_HUB", "RTOP_TOKEN", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                                "MASTER_", "TORCHELASTIC", "ACCELERATE_"))}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **extra})
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def starved(tmp_path_factory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("hf")
    record = tmp / "run.rtop"
    hub = ThreadedHub(record=str(record), token=MASTER).start()
    try:
        env = _env(RTOP_HUB=hub.address, RTOP_TOKEN=auth.role_token(MASTER, "ingest"))
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
              str(WORKER), "--mode", "starve", "--out", str(tmp), "--steps", str(STEPS),
              "--batch", str(BATCH), "--accumulate", str(ACCUMULATE),
              "--steps-per-epoch", "25", "--slow-s", str(SLOW_S)], env, timeout=300)
    finally:
        hub.stop()
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        r["rows"] = _steps(record, r["rank"])
    return build_report(record), ranks


def _steps(record: Path, rank: int) -> list[dict[str, Any]]:
    """Every step record of ``rank`` in the recording, as dicts."""
    fields = TABLES["steps"]
    return [dict(zip(fields, row, strict=True)) for _, frame in read(record)
            if frame.kind == wire.KIND_BATCH and frame.payload.get("rank") == rank
            for row in frame.payload.get("steps", [])]


def test_torchrun_trainer_names_the_starved_rank_and_nothing_else(starved):
    report, ranks = starved
    assert [r["global_step"] for r in ranks] == [STEPS, STEPS]
    assert all(r["epoch"] > 2 for r in ranks)  # several epochs: a new iterator each
    assert all(r["ddp"] == "DistributedDataParallel" for r in ranks)
    assert all(r["restored"] for r in ranks)  # get_batch_samples is the class's again
    findings = [(f["kind"], f["ranks"]) for f in report["findings"]]
    assert findings == [("starved_rank", [1])], report["findings"]
    by_rank = {r["rank"]: r for r in report["ranks"]}
    assert sorted(by_rank) == [0, 1]
    for r in by_rank.values():
        assert r["status"] == "finished"
        assert r["steps"] == STEPS  # one step per optimizer step
        for figure in ("data_wait_s", "compute_s", "comm_s", "comm_bytes", "step_s"):
            assert r[figure] is not None, (r["rank"], figure)
        assert r["comm_bytes"] > 0  # the DDP-wrapped model was watched
        assert r["samples_per_step"] == BATCH * ACCUMULATE  # every micro-batch's wait
    slow, fast = by_rank[1], by_rank[0]
    # the sleep itself (one per batch) and the rest of the fetch, nothing more
    assert SLOW_S * 0.9 <= slow["data_wait_s"] <= SLOW_S * 1.6
    assert fast["data_wait_s"] < SLOW_S / 5
    for r in ranks:  # every step of every epoch timed, the first one included
        rows = r["rows"]
        assert [x["step"] for x in rows] == list(range(STEPS))
        assert all(x["data_wait_s"] is not None and x["comm_s"] is not None for x in rows)
        assert all(x["samples"] == BATCH * ACCUMULATE for x in rows)


def test_each_step_says_its_tokens(starved):
    """The callback counts each optimizer step's tokens from its micro-batches'
    ``input_ids`` (as the Trainer's ``num_input_tokens_seen`` does): every micro-batch
    of the accumulation cycle, padding included."""
    report, ranks = starved
    for r in ranks:
        assert all(x["tokens"] == BATCH * ACCUMULATE * hf_worker.SEQ for x in r["rows"])
    for entry in report["ranks"]:
        assert entry["tokens_per_step"] == BATCH * ACCUMULATE * hf_worker.SEQ
        assert entry["tokens_per_s"] == pytest.approx(
            entry["tokens_per_step"] / entry["step_s"])
    assert report["throughput"]["tokens_per_s"] == pytest.approx(
        sum(e["tokens_per_s"] for e in report["ranks"]))


def test_the_rank_notes_say_how_the_trainer_is_timed(starved):
    _, ranks = starved
    for r in ranks:
        assert any("on_step_begin" in n for n in r["notes"]), r["notes"]
        assert not any("rtop turned off" in n or "not measured" in n for n in r["notes"]), \
            r["notes"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hf-faults")
    _run([sys.executable, str(WORKER), "--mode", "faults", "--out", str(tmp), "--steps", "8",
          "--steps-per-epoch", "5"], _env(), timeout=300)
    return json.loads((tmp / "faults.json").read_text())


def test_unharmed_run_times_every_step(faults):
    r = faults["none"]
    assert r["global_step"] == 8 and r["steps"] == 8 and r["same"] and r["closed"]
    assert r["isinstance"] and r["restored"]
    assert r["off"] == [] and r["warnings"] == []


@pytest.mark.parametrize("point", list(hf_worker.BODIES))
def test_a_fault_in_the_callback_never_reaches_the_trainer(faults, point):
    from collectors.hf import POINTS

    assert set(hf_worker.BODIES) == set(POINTS)  # every guarded point injected
    r = faults[point]
    assert r["fired"] == 1, "the fault was never injected"
    assert r["global_step"] == 8, "training stopped"
    assert r["same"], "parameters differ from the same run without rtop"
    assert r["restored"], "get_batch_samples was left wrapped"
    said = [m for m in r["warnings"] if point in m and "injected" in m]
    assert len(said) == 1, r["warnings"]  # warned once
    if point == "hf.train_begin":
        assert r["notes"] == []  # no probe was started: only the warning
        return
    assert r["closed"], "the probe was not closed after the fault"
    notes = [n for n in r["notes"] if n.startswith("rtop turned off")]
    assert len(notes) == 1 and point in notes[0] and "injected" in notes[0]
    if point in ("hf.batches", "hf.step_begin"):
        assert r["steps"] == hf_worker.FAULT_AT  # the steps before the fault
    if point == "hf.step_end":
        assert r["steps"] == hf_worker.FAULT_AT + 1  # the step open is closed


def test_a_clear_error_without_transformers():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import collectors.hf\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, env=_env())
    assert "ImportError: collectors.hf needs Hugging Face transformers" in out.stdout, \
        out.stderr
    assert "pip install transformers" in out.stdout
