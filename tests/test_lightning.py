"""``collectors.lightning.RtopCallback`` in real Lightning jobs on CPU: a 2-rank DDP fit
(Lightning launches rank 1 itself) with one starved rank, reported by a real hub; and an
exception injected at each of the callback's guarded points, which never reaches
Lightning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning.pytorch")

from collectors import auth, wire
from collectors.schema import TABLES
from rtop.hub.service import ThreadedHub
from rtop.report import build_report
from rtop.run.recording import read
from tests import lightning_worker

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "lightning_worker.py"
MASTER = "lightning-test-token"
SLOW_S = 0.05  # rank 1's extra data wait per batch


def _run(args: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run([sys.executable, str(WORKER), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RTOP_HUB", "RTOP_TOKEN", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                                "MASTER_", "NODE_RANK", "PL_", "TORCHELASTIC"))}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra})
    return env


@pytest.fixture(scope="module")
def starved(tmp_path_factory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("lightning")
    record = tmp / "run.rtop"
    hub = ThreadedHub(record=str(record), token=MASTER).start()
    try:
        env = _env(RTOP_HUB=hub.address, RTOP_TOKEN=auth.role_token(MASTER, "ingest"))
        _run(["--mode", "starve", "--out", str(tmp), "--devices", "2", "--steps", "100",
              "--steps-per-epoch", "30", "--slow-s", str(SLOW_S)], env, timeout=240)
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


def test_ddp_fit_names_the_starved_rank_and_nothing_else(starved):
    report, ranks = starved
    assert [r["global_step"] for r in ranks] == [100, 100]
    assert all(r["epochs"] >= 3 for r in ranks)  # the loader re-iterated every epoch
    findings = [(f["kind"], f["ranks"]) for f in report["findings"]]
    assert findings == [("starved_rank", [1])], report["findings"]
    by_rank = {r["rank"]: r for r in report["ranks"]}
    assert sorted(by_rank) == [0, 1]
    for r in by_rank.values():
        assert r["status"] == "finished"
        assert r["steps"] == 100, r
        for figure in ("data_wait_s", "compute_s", "comm_s", "comm_bytes", "step_s"):
            assert r[figure] is not None, (r["rank"], figure)
        assert r["samples_per_step"] == 256
    slow, fast = by_rank[1], by_rank[0]
    # the sleep itself (one per batch) and the rest of the fetch, nothing more
    assert SLOW_S * 0.9 <= slow["data_wait_s"] <= SLOW_S * 1.6
    assert fast["data_wait_s"] < SLOW_S / 5
    # rank 0 waits for rank 1 inside the allreduce: the DDP model was watched
    assert fast["comm_s"] > slow["comm_s"]
    assert fast["comm_bytes"] > 0
    for r in ranks:  # every step of every epoch timed, the first one included
        rows = r["rows"]
        assert [x["step"] for x in rows] == list(range(100))
        assert all(x["data_wait_s"] is not None and x["comm_s"] is not None for x in rows)


def test_the_rank_notes_say_how_lightning_is_timed(starved):
    _, ranks = starved
    for r in ranks:
        assert any("on_train_batch_start" in n for n in r["notes"]), r["notes"]
        assert not any("rtop turned off" in n for n in r["notes"]), r["notes"]


@pytest.fixture(scope="module", params=["lightning.pytorch", "pytorch_lightning"])
def faults(request, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    pytest.importorskip(request.param)
    tmp = tmp_path_factory.mktemp("lightning-faults")
    _run(["--mode", "faults", "--package", request.param, "--out", str(tmp), "--steps", "8",
          "--steps-per-epoch", "5", "--batch", "32"], _env(), timeout=240)
    return request.param, json.loads((tmp / "faults.json").read_text())


def test_the_callback_is_a_callback_of_either_package(faults):
    package, results = faults
    assert all(r["isinstance"] for p, r in results.items() if p in lightning_worker.BODIES
               or p == "none"), package


def test_unharmed_run_times_every_step(faults):
    _, results = faults
    r = results["none"]
    assert r["global_step"] == 8 and r["steps"] == 8 and r["same"] and r["closed"]
    assert r["off"] == [] and r["warnings"] == []


@pytest.mark.parametrize("point", list(lightning_worker.BODIES))
def test_a_fault_in_the_callback_never_reaches_lightning(faults, point):
    from collectors.lightning import POINTS

    assert set(lightning_worker.BODIES) == set(POINTS)  # every guarded point injected
    _, results = faults
    r = results[point]
    assert r["fired"] == 1, "the fault was never injected"
    assert r["global_step"] == 8, "training stopped"
    assert r["same"], "parameters differ from the same fit without rtop"
    said = [m for m in r["warnings"] if point in m and "injected" in m]
    assert len(said) == 1, r["warnings"]  # warned once
    if point == "lightning.setup":
        assert r["notes"] == []  # no probe was started: only the warning
        return
    assert r["closed"], "the probe was not closed after the fault"
    notes = [n for n in r["notes"] if n.startswith("rtop turned off")]
    assert len(notes) == 1 and point in notes[0] and "injected" in notes[0]
    if point == "lightning.batch_start":
        assert r["steps"] == lightning_worker.FAULT_AT  # the steps before the fault
    if point == "lightning.batch_end":
        assert r["steps"] == lightning_worker.FAULT_AT + 1  # the step open is closed


def test_the_jobs_own_error_reaches_it_and_closes_the_probe(faults):
    _, results = faults
    r = results["job_raises"]
    assert r["caught"] == "the job's own error"  # unchanged, through Lightning
    assert r["closed"] and r["exit_error"] == "ValueError: the job's own error"
    assert r["steps"] == lightning_worker.FAULT_AT + 1  # the failing step is closed too


def test_a_clear_error_without_lightning():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('lightning', 'pytorch_lightning'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import collectors.lightning\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, env=_env())
    assert "ImportError: collectors.lightning needs Lightning" in out.stdout, out.stderr
    assert "pip install lightning" in out.stdout
