"""``collectors.collectives``: every collective timed at the process group, whoever calls
it. The figures on their own (bytes and bus-bandwidth factors after nccl-tests, union,
exposure, the per-collective split, merging with DDP's allreduce, GPU events resolved
later); then real gloo jobs: a 3-rank DDP job whose loop also calls its own
``all_reduce``, ``broadcast``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``
and ``all_to_all_single``, recorded by a real hub and reported; DDP's own allreduce
through a comm hook (rtop's or the user's) counted once; and nothing installed while
no probe watches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from collectors import wire
from collectors.collectives import (
    METHODS,
    StepCollectives,
    bus_factor,
    intersection,
    tensor_bytes,
)
from collectors.cuda_events import EventPool
from collectors.schema import COLLECTIVE_OPS, STEP_FIELDS
from collectors.steps import NOT_MEASURED, ClockMap, PendingCudaStep, StepRecords, step_row
from rtop.report import build_report
from rtop.run.recording import read, replay
from rtop.run.state import ProtocolError, RunState, clean_split
from rtop.workload import free_port
from tests.test_probe import FakeGpu

ROOT = Path(__file__).resolve().parent.parent


def _row(raw, gpu=None, world: int = 2, nbytes: int = 0) -> dict[str, Any]:
    clock = ClockMap()
    clock.wall0, clock.pc0 = 1000.0, 10.0
    return dict(zip(STEP_FIELDS, step_row(raw, gpu, clock, world=world, nbytes=nbytes),
                    strict=True))


def _raw(buckets=None, direct=None, *, t_enter=10.02, t_exit=10.12, cuda_pair=None):
    return (3, 10.0, 0.02, t_enter, t_exit, 32, buckets, 0.0, cuda_pair, direct)


# ---- the figures -----------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_bus_factors_are_nccl_tests(n):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        assert bus_factor(op, n) == pytest.approx((n - 1) / n), op
    assert bus_factor("broadcast", n) == 1.0 and bus_factor("reduce", n) == 1.0
    assert bus_factor("barrier", n) == 0.0
    assert bus_factor("all_reduce", 1) == 0.0  # one rank: nothing crosses a link


def test_every_method_names_a_known_collective_and_counts_bytes():
    torch = pytest.importorskip("torch")
    assert {op for op, *_ in METHODS.values()} <= set(COLLECTIVE_OPS)
    t = torch.zeros(10, 3, dtype=torch.float16)
    assert tensor_bytes(t) == 60
    assert tensor_bytes([t, t]) == 120 and tensor_bytes([[t], [t, t]]) == 180
    assert tensor_bytes(None) == 0
    # every method of this torch's ProcessGroup that runs a collective is wrapped
    import torch.distributed as dist

    names = {n for n in vars(dist.ProcessGroup) if not n.startswith("_")}
    runs = {"allreduce", "broadcast", "reduce", "allgather", "alltoall", "gather", "scatter",
            "barrier", "reduce_scatter", "all_gather_single", "reduce_scatter_single",
            "all_to_all_single", "alltoall_base", "allreduce_coalesced",
            "allgather_coalesced", "allgather_into_tensor_coalesced",
            "reduce_scatter_tensor_coalesced", "all_gather_single_coalesced",
            "reduce_scatter_single_coalesced"}
    assert runs & names <= set(METHODS)


def test_intervals():
    assert intersection([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert intersection([(0, 1)], [(2, 3)]) == []
    assert intersection([(0, 2), (1, 3)], [(0, 10)]) == [(0, 3)]


def test_step_collectives_union_exposure_and_split():
    calls = [("all_gather", 0.0, 0.4, 800, 4, 1), ("all_gather", 0.2, 0.6, 800, 4, 1),
             ("reduce_scatter", 0.8, 1.0, 400, 4, 1)]
    exposed = [(0.5, 0.6), (0.8, 1.0)]
    f = StepCollectives(calls, exposed, lo=0.0, hi=0.9)
    comm_s, exp_s, nbytes, n, algbw, busbw = f.comm
    assert comm_s == pytest.approx(0.8)  # [0, 0.6] and [0.8, 1.0]
    assert exp_s == pytest.approx(0.3) and f.exposed_in == pytest.approx(0.2)
    assert nbytes == 2000 and n == 3
    assert algbw == pytest.approx(2000 / 0.8)
    assert busbw == pytest.approx(2000 * 0.75 / 0.8)
    assert f.split == [["all_gather", pytest.approx(0.6), 1600, 2, pytest.approx(1200 / 0.6)],
                       ["reduce_scatter", pytest.approx(0.2), 400, 1, pytest.approx(300 / 0.2)]]


def test_direct_collectives_in_a_host_step():
    # a sync all-gather (blocked throughout), an async reduce-scatter done while computing,
    # and one still in flight at step exit (ends there)
    entries = [["all_gather", 10.03, 10.05, 1000, 2, 1],
               ["reduce_scatter", 10.06, 10.08, 500, 2, 1],
               ["broadcast", 10.11, None, 100, 2, 1]]
    blocked = [(10.03, 10.05), (10.115, 10.12)]
    row = _row(_raw(None, (entries, blocked, True)))
    assert row["comm_s"] == pytest.approx(0.02 + 0.02 + 0.01)
    assert row["comm_exposed_s"] == pytest.approx(0.02 + 0.005)
    assert row["compute_s"] == pytest.approx(0.10 - 0.025)
    assert row["comm_bytes"] == 1600 and row["comm_calls"] == 3
    assert row["busbw_Bps"] == pytest.approx((1000 * 0.5 + 500 * 0.5 + 100) / 0.05)
    split = row["collectives"]
    assert list(split) == ["all_gather", "reduce_scatter", "broadcast"]
    assert split["broadcast"] == [pytest.approx(0.01), 100, 1, pytest.approx(100 / 0.01)]


def test_direct_collectives_merge_with_ddp_buckets_and_stamps():
    buckets = [[10.05, 10.08, 1_000_000], [10.07, 10.10, 3_000_000]]
    own = [["all_reduce", 10.11, 10.115, 4000, 4, 1]]
    row = _row(_raw(buckets, (own, [(10.11, 10.115)], True)), world=4)
    assert row["comm_s"] == pytest.approx(0.05 + 0.005)
    # DDP's exposed part (after its last launch) plus the user's blocked allreduce
    assert row["comm_exposed_s"] == pytest.approx(0.03 + 0.005)
    assert row["comm_bytes"] == 4_004_000 and row["comm_calls"] == 3
    assert row["busbw_Bps"] == pytest.approx(4_004_000 * 1.5 / 0.055)
    assert row["collectives"] is None  # allreduces only: the step's own figures are theirs
    # DDP's own timer (a span) with a user's broadcast
    exit_ns = 5_000_000_000
    ns = lambda perf: exit_ns - round((10.12 - perf) * 1e9)  # noqa: E731
    stamps = (ns(10.06), ns(10.09), ns(10.11), 3, exit_ns)
    row = _row(_raw(stamps, ([["broadcast", 10.03, 10.04, 100, 2, 1]], [(10.03, 10.04)],
                             True)), world=2, nbytes=8_000_000)
    assert row["comm_s"] == pytest.approx(0.05 + 0.01)
    assert row["comm_exposed_s"] == pytest.approx(0.02 + 0.01)
    assert row["comm_calls"] == 4 and row["comm_bytes"] == 8_000_100
    assert row["collectives"] == {
        "all_reduce": [pytest.approx(0.05), 8_000_000, 3, pytest.approx(8e6 / 0.05)],
        "broadcast": [pytest.approx(0.01), 100, 1, pytest.approx(100 / 0.01)]}


def test_not_measured_is_never_zero():
    # direct timing failed: the step's total is unknown, DDP's own part still split out
    buckets = [[10.05, 10.08, 1000]]
    row = _row(_raw(buckets, ()))
    assert all(row[k] is None for k in ("comm_s", "comm_exposed_s", "comm_bytes",
                                        "busbw_Bps"))
    assert row["collectives"] == {"all_reduce": [pytest.approx(0.03), 1000, 1,
                                                 pytest.approx(1000 / 0.03)]}
    # a DDP model's timing failed: the direct ones are split out, the total is unknown
    row = _row(_raw(None, ([["all_gather", 10.03, 10.05, 10, 2, 1]], [], False)))
    assert row["comm_s"] is None and list(row["collectives"]) == ["all_gather"]
    # timed, and none ran: zero, measured
    row = _row(_raw(None, ([], [], True)))
    assert row["comm_s"] == 0.0 and row["comm_bytes"] == 0 and row["collectives"] is None
    # not timed at all (no process group): not measured
    row = _row(_raw(None, None))
    assert tuple(row[k] for k in ("comm_s", "comm_exposed_s", "comm_bytes", "comm_calls",
                                  "algbw_Bps", "busbw_Bps")) == NOT_MEASURED


def test_cuda_direct_collectives_resolve_on_the_gpu_timeline():
    gpu = FakeGpu()
    pool = EventPool(gpu.event)
    start = pool.record()
    gpu.issued += 2.0
    launch = pool.record()
    w0 = pool.record()
    gpu.issued += 3.0  # the compute stream waits for the all-gather
    done = pool.record()
    w1 = pool.record()
    gpu.issued += 5.0
    end = pool.record()
    entries = [["all_gather", launch, done, 8000, 2, 1]]
    raw = _raw(None, (entries, [(w0, w1)], True), cuda_pair=(start, end))
    pending = PendingCudaStep(raw, queued=0.0)
    assert len(pending.events()) == 6
    assert pending.resolve(pool) is None  # the GPU has not got there
    gpu.done = 1e9
    times = pending.resolve(pool)
    assert times is not None and times[0] == pytest.approx(0.010)
    row = _row(pending.resolved(), times)
    assert row["gpu_s"] == pytest.approx(0.010)
    assert row["comm_s"] == pytest.approx(0.003) and row["comm_exposed_s"] == \
        pytest.approx(0.003)
    assert row["compute_s"] == pytest.approx(0.007)
    assert row["collectives"] == {"all_gather": [pytest.approx(0.003), 8000, 1,
                                                 pytest.approx(4000 / 0.003)]}
    # a step timed on the host whose entries hold events: not measured, events returned
    records = StepRecords(5.0)
    e = pool.record()
    raw = _raw(None, ([["all_gather", e, None, 8, 2, 1]], [], True))
    made = pool.created
    rows = records.drain(deque([raw]), pool, world=2, nbytes=0,
                         now=0.0)
    assert dict(zip(STEP_FIELDS, rows[0], strict=True))["comm_s"] is None
    pool.record()
    assert pool.created == made  # the event went back to the pool


def test_the_hub_checks_the_split():
    assert clean_split("x", None) is None
    assert clean_split("x", {"all_gather": [0.1, 8, 2, float("inf")]}) == \
        {"all_gather": [0.1, 8, 2, None]}
    assert list(clean_split("x", {"a\x1b[2Jb": [0, 0, 0, 0]}) or {}) == ["a\ufffd[2Jb"]
    for bad in ([1, 2], {"all_gather": [1, 2]}, {"all_gather": ["1", 2, 3, 4]}, {1: [0] * 4},
                {f"op{i}": [0] * 4 for i in range(17)}):
        with pytest.raises(ProtocolError):
            clean_split("x", bad)


# ---- real jobs --------------------------------------------------------------------------

OWN = {  # what the loop's own collectives move per step on 3 ranks (nccl-tests bytes)
    "all_reduce": 1000 * 4, "broadcast": 256 * 4, "all_gather": 3 * 100 * 4,
    "reduce_scatter": 3 * 100 * 4, "all_to_all": 300 * 4}
STEPS = 24


def own_collectives(rank: int, world: int, step: int) -> None:
    """One step's own collectives, each by its public name."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.full((1000,), float(rank)))
    dist.broadcast(torch.zeros(256), src=0)
    out = torch.empty(world * 100)
    work = dist.all_gather_into_tensor(out, torch.full((100,), float(rank)), async_op=True)
    time.sleep(0.002)  # compute while it runs: overlapped, not exposed
    work.wait()
    dist.reduce_scatter_tensor(torch.empty(100), torch.ones(world * 100))
    dist.all_to_all_single(torch.empty(world * 100), torch.ones(world * 100))


def ddp_job(rank: int, world: int, port: int, hub: str, token: str, out: str) -> None:
    """A DDP job whose loop also calls its own collectives, reporting to a hub."""
    import torch

    import collectors
    from collectors.identity import detect
    from tests.ddp_workers import _model, _setup, _teardown

    _setup(rank, world, port)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=hub, token=token,
                                                              flush_interval_s=0.2))
    probe.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(32, 40, generator=g), torch.randn(32, 7, generator=g))
            for _ in range(STEPS)]
    for x, y in probe.iter(data):
        with probe.step():
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            own_collectives(rank, world, probe.step_count)
    nbytes = probe.comm.nbytes
    probe.close()
    Path(out, f"rank{rank}").write_text(json.dumps({"ddp_bytes": nbytes}))
    del model
    _teardown()


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    import torch.multiprocessing as mp

    from collectors import auth
    from rtop.hub.service import ThreadedHub

    tmp = tmp_path_factory.mktemp("own-collectives")
    record = tmp / "run.rtop"
    hub = ThreadedHub(record=str(record), token="own-collectives-token").start()
    try:
        mp.start_processes(ddp_job, args=(3, free_port(), hub.address,
                                          auth.role_token("own-collectives-token", "ingest"),
                                          str(tmp)), nprocs=3, start_method="spawn")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(_steps(record)) < 3 * STEPS:
            time.sleep(0.2)
    finally:
        hub.stop()
    ddp_bytes = json.loads((tmp / "rank0").read_text())["ddp_bytes"]
    return record, ddp_bytes


def _steps(record: Path) -> list[dict[str, Any]]:
    return [dict(zip(STEP_FIELDS, row, strict=True)) for _, frame in read(record)
            if frame.kind == wire.KIND_BATCH for row in frame.payload.get("steps", [])]


def test_a_users_own_collectives_are_counted_beside_ddps(ddp_run):
    record, ddp_bytes = ddp_run
    assert ddp_bytes == 104_707 * 4  # the model's gradients, DDP's own count
    report = build_report(record)
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2]
    for r in report["ranks"]:
        assert r["steps"] == STEPS
        assert r["comm_bytes"] == ddp_bytes + sum(OWN.values())
        coll = r["collectives"]
        assert set(coll) == set(OWN), coll
        assert coll["all_reduce"]["bytes"] == ddp_bytes + OWN["all_reduce"]
        for op in ("broadcast", "all_gather", "reduce_scatter", "all_to_all"):
            assert coll[op]["bytes"] == OWN[op], op
            assert coll[op]["calls"] == 1 and coll[op]["steps"] == STEPS
        assert coll["all_reduce"]["calls"] >= 2  # DDP's buckets and the loop's own
        assert 0 < r["comm_exposed_s"] <= r["comm_s"] < r["step_s"]


def test_bus_bandwidth_uses_each_collectives_factor(ddp_run):
    record, _ = ddp_run
    rows = [r for r in _steps(record) if r["collectives"]]
    assert len(rows) == 3 * STEPS
    for r in rows:
        weighted = 0.0
        for op, (s, nbytes, _, busbw) in r["collectives"].items():
            assert busbw == pytest.approx(nbytes * bus_factor(op, 3) / s, rel=1e-9), op
            weighted += nbytes * bus_factor(op, 3)
        assert bus_factor("all_reduce", 3) == pytest.approx(4 / 3)
        assert bus_factor("all_gather", 3) == pytest.approx(2 / 3)
        assert r["busbw_Bps"] == pytest.approx(weighted / r["comm_s"], rel=1e-9)
        assert r["algbw_Bps"] == pytest.approx(r["comm_bytes"] / r["comm_s"], rel=1e-9)


def test_the_rank_detail_shows_the_split(ddp_run):
    record, ddp_bytes = ddp_run
    state, _ = replay(record, RunState())
    detail = state.rank_detail(1)
    coll = detail["collectives"]
    assert set(coll) == set(OWN)
    assert coll["all_to_all"]["bytes"] == OWN["all_to_all"]
    assert coll["all_reduce"]["bytes"] == ddp_bytes + OWN["all_reduce"]
    from rtop.tui.detail import collective_split

    text = collective_split(detail).plain
    for op in OWN:
        assert op in text


def hooked_job(rank: int, world: int, port: int, out: str) -> None:
    """DDP's allreduce through a comm hook, rtop's or the user's, beside one own
    allreduce: DDP's buckets are counted once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import collectors
    from collectors.identity import detect
    from collectors.steps import StepRecords
    from tests.ddp_workers import _model, _setup, _teardown

    _setup(rank, world, port)
    result = {}
    for mode in ("ddp", "hook"):
        model = torch.nn.parallel.DistributedDataParallel(_model())
        if mode == "ddp":  # the user's hook, before watch: DDP's timer times it
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None, comm_timing=mode),
                                 start_sender=False)
        probe.watch(model)
        if mode == "hook":  # the user's hook, after watch: inside rtop's
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        for _ in range(4):
            with probe.step():
                model(torch.randn(8, 40)).sum().backward()
                dist.all_reduce(torch.ones(250))
        time.sleep(0.05)
        rows = StepRecords(5.0).drain(probe.records, None, world=probe.comm.world,
                                      nbytes=probe.comm.nbytes, now=0.0)
        result[mode] = [dict(zip(STEP_FIELDS, r, strict=True))["comm_bytes"] for r in rows]
        probe.close(0.1)
        del model
    Path(out, f"rank{rank}").write_text(json.dumps(result))
    _teardown()


def test_ddps_own_allreduce_through_a_comm_hook_is_counted_once(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(hooked_job, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}").read_text())
        assert result["ddp"] == [104_707 * 4 + 1000] * 4
        assert result["hook"] == [104_707 * 4 + 1000] * 4


IDLE = r"""
import os, sys, json
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
import collectors
from collectors import collectives
from collectors.identity import detect

names = [n for n in collectives.METHODS if n in vars(dist.ProcessGroup)]
def torch_own():
    return [vars(dist.ProcessGroup)[n] for n in names] + [vars(dist.Work)["wait"]]
before = torch_own()
out = {"methods": len(names)}
probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
dist.all_reduce(torch.ones(4))
out["started_not_watching"] = torch_own() == before and not collectives.installed()
model = torch.nn.Linear(4, 4)
probe.watch(model)
during = torch_own()
out["watching"] = all(a is not b for a, b in zip(during, before)) and collectives.installed()
with probe.step():
    dist.all_reduce(torch.ones(4))
probe.close(0.1)
out["closed"] = all(a is b for a, b in zip(torch_own(), before)) \
    and not collectives.installed()
out["recorded"] = [bool(r[9] and r[9][0]) for r in probe.records]
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_nothing_is_installed_while_no_probe_watches():
    proc = subprocess.run([sys.executable, "-c", IDLE, str(free_port())], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["methods"] >= 15
    assert out["started_not_watching"]  # a probe that watches nothing installs nothing
    assert out["watching"]
    assert out["closed"]  # torch's own methods back, the very same objects
    assert out["recorded"] == [True]


ON_GPU = r"""
import os, sys, json
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from collections import deque
import collectors
from collectors.cuda_events import torch_cuda_pool
from collectors.identity import detect
from collectors.schema import STEP_FIELDS
from collectors.steps import StepRecords
from tests.fakecuda import FakeCuda

fake = FakeCuda(devices=2)
probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
probe.watch(torch.nn.Linear(4, 4))
probe.use_cuda_events(torch_cuda_pool(1, cuda=fake))
for _ in range(3):
    with probe.step():
        fake.run(1, 2.0)
        work = dist.all_gather_into_tensor(torch.empty(100), torch.ones(100), async_op=True)
        fake.run(1, 3.0)
        work.wait()
        dist.broadcast(torch.ones(10), src=0)
        fake.run(1, 1.0)
fake.finish()
probe.cuda.bind_thread()  # as the sender thread does before its first query
records = StepRecords(5.0)
rows = records.drain(probe.records, probe.cuda, world=1, nbytes=0, now=0.0, final=True)
out = [dict(zip(STEP_FIELDS, r)) for r in rows]
print(json.dumps({"rows": out, "contexts": sorted(fake.context_devices()),
                  "why": [list(c) for c in fake.contexts],
                  "created": probe.cuda.created}))
probe.close(0.1)
dist.destroy_process_group()
"""


def test_on_a_gpu_each_collective_is_timed_with_the_models_devices_events():
    proc = subprocess.run([sys.executable, "-c", ON_GPU, str(free_port())], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out["rows"]
    assert len(rows) == 3
    for r in rows:
        assert r["gpu_s"] == pytest.approx(0.006)
        assert r["comm_bytes"] == 400 + 40 and r["comm_calls"] == 2
        assert r["comm_s"] is not None and 0 <= r["comm_exposed_s"] <= r["comm_s"]
        assert set(r["collectives"]) == {"all_gather", "broadcast"}
        assert r["busbw_Bps"] is None  # one rank: nothing crosses a link
    assert out["contexts"] == [1], out["why"]  # every event on the model's device, none on GPU 0
    # each step: its start and end, each collective's launch and completion, two around
    # each wait (the broadcast's, which torch.distributed waits on, too); none reused
    # yet: every step waited until the drain
    assert out["created"] == 3 * (2 + 2 * 2 + 2 * 2)
