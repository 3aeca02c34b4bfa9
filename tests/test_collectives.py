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
    tensor_bytes,
)
from collectors.cuda_events import EventPool
from collectors.schema import COLLECTIVE_OPS, STEP_FIELDS
from collectors.steps import NOT_MEASURED, ClockMap, PendingCudaStep, StepRecords, step_row
from collectors.timeline import intersection
from rtop.report import build_report
from rtop.run.columns import MEASURE_BITS
from rtop.run.recording import read, replay
from rtop.run.state import RunState
from rtop.run.validate import ProtocolError, clean_split
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

    def rel(seconds: float) -> float:
        # the recording keeps a rank's measurements to MEASURE_BITS significant bits and
        # seconds to 2**-20 s (rtop.run.columns): a rate and the time it is checked
        # against are each rounded once. Factors differ by 2x (4/3 against 2/3).
        return 2 * 2.0 ** -MEASURE_BITS + 2.0 ** -20 / seconds

    for r in rows:
        weighted = 0.0
        for op, (s, nbytes, _, busbw) in r["collectives"].items():
            assert busbw == pytest.approx(nbytes * bus_factor(op, 3) / s, rel=rel(s)), op
            weighted += nbytes * bus_factor(op, 3)
        assert bus_factor("all_reduce", 3) == pytest.approx(4 / 3)
        assert bus_factor("all_gather", 3) == pytest.approx(2 / 3)
        assert r["busbw_Bps"] == pytest.approx(weighted / r["comm_s"], rel=rel(r["comm_s"]))
        assert r["algbw_Bps"] == pytest.approx(r["comm_bytes"] / r["comm_s"],
                                               rel=rel(r["comm_s"]))


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
    # each step: its start and end, and nothing for its collectives: gloo's run on the
    # host, which is where they are timed in a GPU job too (a CUDA event would mark a
    # point of a stream they never moved: issue 25, finding 6); none reused yet: every
    # step waited until the drain. NCCL's, on the model's device: the tests below.
    assert out["created"] == 3 * 2


# ---- on a GPU, faked (tests/fakecuda.py: CUDA's and NCCL's rules) ------------------------

from tests.fakecuda import FakeCuda, FakeNccl  # noqa: E402
from tests.test_gpu_path import gloo_world1  # noqa: E402,F401  (a one-rank gloo group here)


def _gpu_probe(fake: FakeCuda, device: int = 1, pool: bool = True, model=None):
    """A probe timing on the fake ``cuda:device`` (``pool=False``: no event pool, as
    after a CUDA error), watching a model once the process group is up."""
    import torch

    import collectors
    from collectors.cuda_events import torch_cuda_pool
    from collectors.identity import detect

    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None, comm_timing="hook"),
                             start_sender=False)
    if pool:
        probe.use_cuda_events(torch_cuda_pool(device, cuda=fake))
    probe.watch(model if model is not None else torch.nn.Linear(4, 4))
    return probe


def _drained(probe, fake: FakeCuda) -> list[dict[str, Any]]:
    """The probe's finished steps as records, once the fake GPU has run everything (read
    as the sender thread reads them: on the pool's device)."""
    fake.finish()
    if probe.cuda is not None:
        probe.cuda.bind_thread()
    rows = StepRecords(5.0).drain(probe.records, probe.cuda, world=1, nbytes=0, now=0.0,
                                  final=True)
    return [dict(zip(STEP_FIELDS, r, strict=True)) for r in rows]


def _meta(n: int):
    import torch

    return torch.empty(n, device="meta")  # stands for a CUDA tensor (tests/fakecuda.py)


def test_a_synchronous_nccl_collective_is_exposed_on_the_steps_stream(gloo_world1):  # noqa: F811
    """Finding 4: since torch 2.12 a synchronous NCCL collective runs on the caller's
    stream and returns no Work (FakeNccl's rule). rtop counted only the time blocked in
    ``Work.wait``, so a plain ``dist.all_reduce(t)`` read ``comm_exposed_s = 0`` and its
    time went into ``compute_s``; on the step's own stream it is exposed throughout."""
    import torch.distributed as dist

    fake = FakeCuda(devices=2)
    with FakeNccl(fake, device=1, ms=3.0):
        probe = _gpu_probe(fake)
        try:
            for _ in range(3):
                with probe.step():
                    fake.run(1, 5.0)
                    dist.all_reduce(_meta(256))
                    fake.run(1, 1.0)
            with probe.step():  # asynchronous, waited on: exposed while waited for only
                fake.run(1, 5.0)
                work = dist.all_reduce(_meta(256), async_op=True)
                fake.run(1, 1.0)  # NCCL's stream runs it from 5 to 8 ms beside this
                work.wait()
                fake.run(1, 1.0)
            rows = _drained(probe, fake)
        finally:
            probe.close(0.1)
    assert len(rows) == 4
    assert fake.context_devices() == {1}, fake.contexts  # every event on the model's GPU
    for r in rows[:3]:
        assert r["gpu_s"] == pytest.approx(0.009)
        assert r["comm_s"] == pytest.approx(0.003)
        assert r["comm_exposed_s"] == pytest.approx(0.003)  # was 0
        assert r["compute_s"] == pytest.approx(0.006)  # was 0.009
        assert r["comm_bytes"] == 1024
    last = rows[3]
    assert last["gpu_s"] == pytest.approx(0.009) and last["comm_s"] == pytest.approx(0.003)
    assert last["comm_exposed_s"] == pytest.approx(0.002)  # 6 to 8 ms: the wait
    assert last["compute_s"] == pytest.approx(0.007)


def test_fsdp2s_wait_for_its_all_gather_is_exposed(gloo_world1):  # noqa: F811
    """Finding 4: FSDP2 all-gathers synchronously on its own stream and makes the
    compute stream wait with ``wait_event`` (torch's ``foreach_all_gather`` and
    ``foreach_all_gather_copy_out``, step by step below). No ``Work.wait`` is ever
    called, so rtop read no exposed time and counted the stall as compute."""
    import torch.distributed as dist

    fake = FakeCuda(devices=2)
    with FakeNccl(fake, device=1, ms=4.0):
        probe = _gpu_probe(fake)
        try:
            for _ in range(2):
                with probe.step():
                    fake.run(1, 2.0)  # the previous layer
                    main = fake.current_stream(1)
                    all_gather_stream = fake.Stream(1)
                    all_gather_stream.wait_stream(main)
                    with fake.stream(all_gather_stream):  # async_op=False: no Work
                        dist.all_gather_into_tensor(_meta(512), _meta(512))
                        all_gather_event = all_gather_stream.record_event()
                    fake.run(1, 1.0)  # compute beside the all-gather (2 to 6 ms)
                    main.wait_event(all_gather_event)  # the copy-out waits: 3 to 6 ms
                    fake.run(1, 3.0)
            rows = _drained(probe, fake)
        finally:
            probe.close(0.1)
    assert len(rows) == 2
    for r in rows:
        assert r["gpu_s"] == pytest.approx(0.009)
        assert r["comm_s"] == pytest.approx(0.004)
        assert r["comm_exposed_s"] == pytest.approx(0.003)  # was 0
        assert r["compute_s"] == pytest.approx(0.006)  # was 0.009
        assert r["collectives"] == {"all_gather": [pytest.approx(0.004), 2048, 1, None]}


def test_nccl_timed_on_the_host_is_not_measured(gloo_world1):  # noqa: F811
    """Finding 5: with no CUDA event pool (CUDA timing off after an error, a model on the
    CPU), NCCL's collectives were timed on the host; NCCL futures complete at enqueue
    (FakeNccl's rule), so they read ~0. Not measured (None), never ~0."""
    import torch.distributed as dist

    fake = FakeCuda(devices=1)
    with FakeNccl(fake, device=0, ms=3.0):
        probe = _gpu_probe(fake, device=0, pool=False)
        try:
            for _ in range(3):
                with probe.step():
                    fake.run(0, 2.0)
                    dist.all_reduce(_meta(256))
                    work = dist.all_reduce(_meta(256), async_op=True)
                    work.wait()
            rows = _drained(probe, fake)
        finally:
            probe.close(0.1)
    assert len(rows) == 3
    for r in rows:
        for key in ("comm_s", "comm_exposed_s", "comm_bytes", "algbw_Bps", "busbw_Bps"):
            assert r[key] is None, (key, r[key])
        assert r["compute_s"] is not None


class _GpuBucket:
    """A DDP gradient bucket of a model on a GPU (a meta tensor stands for the CUDA one)."""

    def __init__(self, n: int) -> None:
        self._buffer = _meta(n)

    def buffer(self):
        return self._buffer

    def is_last(self) -> bool:
        return True

    def index(self) -> int:
        return 0


def test_a_ddp_bucket_on_a_gpu_timed_on_the_host_is_not_measured(gloo_world1):  # noqa: F811
    """Finding 5, DDP's side: rtop's comm hook with no event pool timed a GPU bucket's
    allreduce on the host, where NCCL's future completes at enqueue: ~0."""
    from tests.test_gpu_path import _ddp

    fake = FakeCuda(devices=1)
    model = _ddp()
    with FakeNccl(fake, device=0, ms=3.0):
        probe = _gpu_probe(fake, device=0, pool=False, model=model)
        hook = model._comm_hooks[-1][0]  # rtop's timing hook, as DDP calls it
        try:
            for _ in range(2):
                with probe.step():
                    hook(None, _GpuBucket(1024))
            rows = _drained(probe, fake)
        finally:
            probe.close(0.1)
    assert [r["comm_s"] for r in rows] == [None, None]
    assert [r["comm_bytes"] for r in rows] == [None, None]


def test_a_gloo_collective_in_a_gpu_job_is_timed_on_the_host(gloo_world1):  # noqa: F811
    """Finding 6: a gloo collective (host tensors) in a job timed with CUDA events was
    timed with events too; a CUDA event marks a point of a stream, and a host collective
    moves no stream, so it read 0. It is timed on the host's clock now."""
    import torch
    import torch.distributed as dist

    fake = FakeCuda(devices=2)
    probe = _gpu_probe(fake)
    spent = []
    try:
        for _ in range(3):
            with probe.step():
                fake.run(1, 2.0)
                t0 = time.perf_counter()
                dist.all_reduce(torch.ones(1 << 20))
                work = dist.broadcast(torch.ones(1 << 18), src=0, async_op=True)
                work.wait()
                spent.append(time.perf_counter() - t0)
                fake.run(1, 1.0)
        rows = _drained(probe, fake)
    finally:
        probe.close(0.1)
    assert len(rows) == 3
    for r, s in zip(rows, spent, strict=True):
        assert r["gpu_s"] == pytest.approx(0.003)
        assert 0 < r["comm_s"] <= s  # was 0.0
        assert 0 < r["comm_exposed_s"] <= r["comm_s"]
        assert set(r["collectives"]) == {"all_reduce", "broadcast"}
    assert probe.cuda is not None and probe.cuda.failure is None


def test_old_style_coalescing_is_timed_at_the_groups_launch(gloo_world1):  # noqa: F811
    """Finding 11: inside ``_coalescing_manager(device=...)`` NCCL launches nothing
    until ``_end_coalescing`` (FakeNccl's rule: an inner op's work completes at once), so
    each inner collective read ~0. They complete with the group's work now."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    fake = FakeCuda(devices=2)
    meta = torch.device("meta")
    with FakeNccl(fake, device=1, ms=3.0):
        probe = _gpu_probe(fake)
        group = dist.group.WORLD
        try:
            with probe.step():  # all_reduce: torch's fast path, one allreduce_coalesced
                fake.run(1, 2.0)
                with _coalescing_manager(group, meta):
                    dist.all_reduce(_meta(100))
                    dist.all_reduce(_meta(100))
                fake.run(1, 1.0)
            with probe.step():  # broadcast: each op goes to the group (the old style)
                fake.run(1, 2.0)
                with _coalescing_manager(group, meta, async_ops=True) as cm:
                    dist.broadcast(_meta(100), src=0)
                    dist.broadcast(_meta(100), src=0)
                fake.run(1, 1.0)
                cm.wait()
                fake.run(1, 1.0)
            rows = _drained(probe, fake)
        finally:
            probe.close(0.1)
    fast, old = rows
    assert fast["gpu_s"] == pytest.approx(0.006)
    assert fast["comm_s"] == pytest.approx(0.003)  # was 0
    assert fast["comm_exposed_s"] == pytest.approx(0.003) and fast["comm_bytes"] == 800
    assert old["gpu_s"] == pytest.approx(0.009)
    assert old["comm_s"] == pytest.approx(0.006)  # the group ran both: 8 to 14 ms
    assert old["comm_exposed_s"] == pytest.approx(0.005)  # waited for from 9 ms
    assert old["comm_calls"] == 2 and old["comm_bytes"] == 800


def test_a_step_that_replays_a_graph_with_collectives_says_not_measured(gloo_world1):  # noqa: F811
    """Finding 3: a collective captured in a CUDA graph runs, unseen, at each replay; a
    step that replays the graph said its collectives were measured and zero."""
    import torch.distributed as dist

    fake = FakeCuda(devices=2)
    fake.set_device(1)
    with FakeNccl(fake, device=1, ms=3.0):
        probe = _gpu_probe(fake)
        graph = fake.CUDAGraph()
        try:
            with fake.graph(graph):
                fake.run(1, 4.0)
                dist.all_reduce(_meta(64))  # synchronous: on the capturing stream
            with probe.step():
                fake.run(1, 1.0)
            for _ in range(2):
                with probe.step():
                    graph.replay()
            with probe.step():  # no replay: measured, and no collective ran
                fake.run(1, 1.0)
            rows = _drained(probe, fake)
        finally:
            probe.close(0.1)
    assert len(rows) == 4
    replays = rows[1:3]
    assert [r["gpu_s"] for r in replays] == [pytest.approx(0.007)] * 2
    assert [r["comm_s"] for r in replays] == [None, None]  # was 0.0
    assert rows[3]["comm_s"] == 0.0 and rows[3]["gpu_s"] == pytest.approx(0.001)
    assert probe.cuda is not None and probe.cuda.failure is None
