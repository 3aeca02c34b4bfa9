"""``probe.watch`` on sharded models, in real 2-rank jobs on CPU over gloo, recorded by a
real hub: an FSDP2 model (``fully_shard`` on each block and on the root) and an FSDP1
model (``FullyShardedDataParallel``). Each step's ``comm_bytes`` must be what the
sharded model all-gathers and reduce-scatters, computed here from its parameters'
shapes and dtype, and the report's per-rank ``collectives`` must split it so."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from collectors import wire
from collectors.collectives import bus_factor
from collectors.schema import MEM_FIELDS, STEP_FIELDS
from rtop.report import build_report
from rtop.run.columns import MEASURE_BITS
from rtop.run.recording import read, replay
from rtop.run.state import RunState
from rtop.workload import free_port

WORLD = 2
STEPS = 20
TOKEN = "fsdp-test-token"


def _blocks() -> Any:
    """Three blocks; the root has no parameter of its own (FSDP2 then shards every
    parameter in a block's group)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU()),
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()),
        torch.nn.Sequential(torch.nn.Linear(64, 8)))


def sharded_bytes(model: Any, world: int) -> int:
    """What one all-gather of all the parameters moves (nccl-tests: the full output):
    each parameter sharded on its first dimension, padded to a multiple of ``world``."""
    total = 0
    for p in model.parameters():
        rows = math.ceil(p.shape[0] / world) * world
        total += rows * math.prod(p.shape[1:]) * p.element_size()
    return total


def job(rank: int, kind: str, port: int, hub: str, token: str, out: str) -> None:
    """One rank of an FSDP2 or FSDP1 job, watched, reporting to ``hub``."""
    import torch

    import collectors
    from collectors.identity import detect
    from tests.ddp_workers import _setup, _teardown

    _setup(rank, WORLD, port)
    plain = _blocks()
    expected = sharded_bytes(plain, WORLD)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in plain:
            fully_shard(block)
        model = fully_shard(plain)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(plain, device_id=torch.device("cpu"))
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=hub, token=token,
                                                              flush_interval_s=0.2))
    probe.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g))
            for _ in range(STEPS)]
    for x, y in probe.iter(data):
        with probe.step():
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    notes = list(probe.notes)
    probe.close()
    Path(out, f"rank{rank}").write_text(json.dumps(
        {"expected": expected, "type": type(model).__name__, "notes": notes}))
    del model, opt
    _teardown()


def _run(tmp: Path, kind: str) -> tuple[Path, list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    from collectors import auth
    from rtop.hub.service import ThreadedHub

    record = tmp / "run.rtop"
    hub = ThreadedHub(record=str(record), token=TOKEN).start()
    try:
        mp.start_processes(job, args=(kind, free_port(), hub.address,
                                      auth.role_token(TOKEN, "ingest"), str(tmp)),
                           nprocs=WORLD, start_method="spawn")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(_steps(record)) < WORLD * STEPS:
            time.sleep(0.2)
    finally:
        hub.stop()
    return record, [json.loads((tmp / f"rank{r}").read_text()) for r in range(WORLD)]


def _steps(record: Path) -> list[dict[str, Any]]:
    return [dict(zip(STEP_FIELDS, row, strict=True)) for _, frame in read(record)
            if frame.kind == wire.KIND_BATCH for row in frame.payload.get("steps", [])]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fsdp2"), "fsdp2")


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fsdp1"), "fsdp1")


def _quantum(seconds: float) -> float:
    """Three times what the recording's rounding may move a time of this size (a rank's
    measurements keep MEASURE_BITS significant bits, seconds 2**-20 s: rtop.run.columns)."""
    return 3 * (seconds * 2.0 ** -MEASURE_BITS + 2.0 ** -20)


def _rel(seconds: float) -> float:
    """The relative tolerance of a rate read back against bytes over a recorded time (each
    rounded once)."""
    return 2 * 2.0 ** -MEASURE_BITS + 2.0 ** -20 / seconds


def test_fsdp2_steps_count_the_sharded_models_all_gathers_and_reduce_scatters(fsdp2):
    record, ranks = fsdp2
    p = ranks[0]["expected"]
    assert p == (16 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8) * 4  # no padding at 2 ranks
    assert all("FSDPModule" in r["type"] or r["type"].startswith("FSDP") for r in ranks)
    assert all(any(n.startswith("FSDP2 model") for n in r["notes"]) for r in ranks)
    assert not any("could not" in n or "turned off" in n for r in ranks for n in r["notes"])
    rows = _steps(record)
    assert len(rows) == WORLD * STEPS
    for r in (r for r in rows if r["step"] > 0):  # after the first (lazy initialisation)
        # forward and backward each all-gather every parameter; backward reduce-scatters
        # every gradient once
        assert r["comm_bytes"] == 3 * p, r
        assert r["comm_calls"] == 3 * 3  # three blocks: 2 all-gathers + 1 reduce-scatter
        split = r["collectives"]
        assert split["all_gather"][1:3] == [2 * p, 6]
        assert split["reduce_scatter"][1:3] == [p, 3]
        assert 0 < r["comm_exposed_s"] <= r["comm_s"] <= r["step_s"]
        # compute excludes the time blocked in the collectives (all inside the step)
        # (to the recording's precision: MEASURE_BITS significant bits, 2**-20 s)
        assert r["compute_s"] + r["comm_exposed_s"] <= r["step_s"] + _quantum(r["step_s"])
        # nccl-tests: (n-1)/n for both, each collective's own figure
        for op, (s, nbytes, _, busbw) in split.items():
            assert busbw == pytest.approx(nbytes * bus_factor(op, WORLD) / s, rel=_rel(s))
        assert r["busbw_Bps"] == pytest.approx(3 * p * 0.5 / r["comm_s"], rel=_rel(r["comm_s"]))
    report = build_report(record)
    for r in report["ranks"]:
        assert r["comm_bytes"] == 3 * p
        coll = r["collectives"]
        assert set(coll) == {"all_gather", "reduce_scatter"}
        assert coll["all_gather"]["bytes"] == 2 * p and coll["all_gather"]["calls"] == 6
        assert coll["reduce_scatter"]["bytes"] == p and coll["reduce_scatter"]["calls"] == 3
        assert coll["all_gather"]["steps"] == STEPS
        assert coll["all_gather"]["s"] > 0 and coll["all_gather"]["busbw_Bps"] > 0
    # memory counts the rank's own shard of each DTensor parameter, not the global
    # shape a DTensor reports (that would overstate the static part WORLD times)
    held = [row[MEM_FIELDS.index("param_bytes")] for _, frame in read(record)
            if frame.kind == wire.KIND_BATCH for row in frame.payload.get("mem", [])]
    assert any(held), "no memory sample counted the watched model"
    assert {b for b in held if b} == {p // WORLD}
    state, _ = replay(record, RunState())
    detail = state.rank_detail(0)
    assert set(detail["collectives"]) == {"all_gather", "reduce_scatter"}
    assert detail["collectives"]["reduce_scatter"]["bytes"] == p


def test_fsdp1_steps_count_its_flat_parameters_collectives(fsdp1):
    record, ranks = fsdp1
    p = ranks[0]["expected"]
    assert all(r["type"] == "FullyShardedDataParallel" for r in ranks)
    assert all(any(n.startswith("FSDP1 model") for n in r["notes"]) for r in ranks)
    # one flat parameter for the whole model (the root): all-gathered once (the root
    # keeps it from forward to backward), its gradient reduce-scattered once
    rows = _steps(record)
    assert len(rows) == WORLD * STEPS
    for r in (r for r in rows if r["step"] > 0):
        assert r["comm_bytes"] == 2 * p, r
        assert r["collectives"]["all_gather"][1:3] == [p, 1]
        assert r["collectives"]["reduce_scatter"][1:3] == [p, 1]
    report = build_report(record)
    for r in report["ranks"]:
        coll = r["collectives"]
        assert coll["all_gather"]["bytes"] == p and coll["reduce_scatter"]["bytes"] == p
        assert r["comm_bytes"] == 2 * p
