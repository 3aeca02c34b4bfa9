"""The GPU path, on CPU: real probes, real sender threads, a real listener over TCP and
real DDP (gloo) models, with CUDA faked where this machine cannot reach it
(``tests/fakecuda.py`` behaves like torch's runtime where rtop went wrong before).

Each test reproduces one bug that the first multi-GPU job would have hit."""

from __future__ import annotations

import logging
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import collectors
from collectors import cuda_events, wire
from collectors.cuda_events import torch_cuda_pool
from collectors.identity import detect
from collectors.memory import MemorySampler
from tests import waiting
from tests.fakecuda import FakeCuda

#: This module's pace: polled every 20 ms, given 20 s by default.
wait_for = partial(waiting.wait_for, timeout=20.0, every=0.02)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(devices=2)
    monkeypatch.setattr(cuda_events, "cuda_module", lambda: fake)
    return fake


@pytest.fixture
def gloo_world1():
    """A real one-rank gloo process group in this process (DDP runs its reducer and
    comm hook as with more ranks)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    import gc

    gc.collect()
    dist.destroy_process_group()


def _ddp(seed: int = 0) -> torch.nn.parallel.DistributedDataParallel:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 4))
    # small buckets: several allreduces per step, as in a real model
    return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)


def _probe(listener, **settings) -> collectors.Probe:
    cfg = collectors.ProbeConfig(hub=listener.address, token=listener.token,
                                 flush_interval_s=0.05, sample_interval_s=0.1, **settings)
    return collectors.Probe(detect(), cfg)


def _byes(listener) -> list[dict]:
    with listener._lock:
        return [f.payload for _, f in listener.frames if f.kind == wire.KIND_BYE]


def _train(probe, model, fake: FakeCuda, x: torch.Tensor, steps: int, device: int = 1,
           optimizer=None) -> None:
    """A training loop that never calls set_device: the training thread stays on
    cuda:0 while the model lives on cuda:``device``; backward runs on autograd's
    cuda:``device`` thread (there, the comm hook records its bucket events)."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with probe.step():
            fake.run(device, 5.0)  # forward kernels
            out = model(x)
            out.register_hook(lambda g: fake.as_autograd_thread(device))
            out.square().mean().backward()
            fake.as_autograd_thread(0)  # back on the training thread's own device
            fake.run(device, 1.0)  # optimizer
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()


def test_events_go_on_the_models_device_without_set_device(listener, fake_cuda,
                                                           gloo_world1):
    """Bugs 1 and 2: a model on cuda:1, no ``torch.cuda.set_device`` (PyTorch's DDP
    tutorial). Before: step events went on GPU 0 (a context there in every rank) and,
    mixed in one pool with the comm hook's cuda:1 events, ``record()`` raised "Event
    device ... does not match recording stream's device" inside backward; the sender's
    ``query()`` opened a context on GPU 0 too."""
    model, ref = _ddp(), _ddp()
    probe = _probe(listener, comm_timing="hook")
    probe.use_cuda_events(torch_cuda_pool(1))  # what watch() does for a model on cuda:1
    probe.watch(model)
    x = torch.randn(16, 32)
    try:
        _train(probe, model, fake_cuda, x, steps=12)
        for _ in range(12):  # the same steps, unwatched: the gradients must match
            ref.zero_grad(set_to_none=True)
            ref(x).square().mean().backward()
        wait_for(lambda: len(listener.records("steps").get(0, [])) == 12, what="12 steps")
    finally:
        probe.close(2.0)
    assert fake_cuda.context_devices() == {1}, fake_cuda.contexts  # nothing on GPU 0
    rows = listener.records("steps")[0]
    assert all(r["gpu_s"] == pytest.approx(0.006) for r in rows)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(r["comm_bytes"] == grad_bytes and r["comm_s"] is not None for r in rows)
    assert all(r["comm_calls"] > 1 for r in rows[1:])  # DDP's first step: one bucket
    assert not [n for n in probe.notes if "turned off" in n]
    assert probe.cuda is not None and probe.cuda.failure is None
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _CudaModel(torch.nn.Module):
    """Looks, to rtop's watch(), like a model whose parameters live on ``cuda:index``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def parameters(self, recurse: bool = True):
        yield SimpleNamespace(device=SimpleNamespace(type="cuda", index=self.index),
                              numel=lambda: 1000, element_size=lambda: 4, requires_grad=True)


def test_watch_ties_the_pool_and_the_gpu_to_the_models_device(fake_cuda):
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
    probe.watch(_CudaModel(1))
    assert probe.cuda is not None and probe.cuda.device == 1
    assert probe.sender._gpu._args["uuid"] == fake_cuda.uuids[1]  # found by UUID
    with probe.step():
        fake_cuda.run(1, 3.0)
    assert fake_cuda.context_devices() == {1}


def test_a_failure_to_record_turns_cuda_timing_off_once(listener, fake_cuda, caplog):
    """Any failure to record an event turns CUDA timing off with one warning and a note
    for the hub; the job never sees an exception, and steps go on, timed on the host."""
    probe = _probe(listener)
    pool = torch_cuda_pool(1)
    probe.use_cuda_events(pool)
    broken = fake_cuda.Event(enable_timing=True)
    broken.record(fake_cuda.current_stream(0))  # an event that belongs to GPU 0
    pool.release(broken)  # ... in the pool of GPU 1: the next record() raises
    caplog.set_level(logging.WARNING, logger="collectors")
    try:
        for _ in range(6):
            with probe.step():
                fake_cuda.run(1, 2.0)
        wait_for(lambda: len(listener.records("steps").get(0, [])) == 6, what="6 steps")
        wait_for(lambda: any(
            "CUDA timing" in n for b in listener.batches()
            for n in (b.get("meta") or {}).get("notes", [])), what="the note at the hub")
    finally:
        probe.close(2.0)
    assert probe.cuda is None and pool.failure is not None
    assert "does not match recording stream's device" in pool.failure
    warnings = [r for r in caplog.records if "turned off CUDA timing" in r.getMessage()]
    assert len(warnings) == 1
    rows = listener.records("steps")[0]
    assert all(r["gpu_s"] is None and r["compute_s"] is not None for r in rows)
    assert [r["step"] for r in rows] == list(range(6))


def test_a_sticky_cuda_error_keeps_the_sender_going_and_the_goodbye_carries_the_error(
        listener, fake_cuda, caplog):
    """Bug 3: a CUDA error while resolving events (a device-side assert, the driver
    shutting down) used to end the sender thread: no more steps or heartbeats, no
    goodbye (the rank showed "lost"), and the failed events went back to the pool."""
    probe = _probe(listener)
    pool = torch_cuda_pool(0)
    probe.use_cuda_events(pool)
    caplog.set_level(logging.WARNING, logger="collectors")
    for _ in range(3):
        with probe.step():
            fake_cuda.run(0, 2.0)
    wait_for(lambda: len(listener.records("steps").get(0, [])) == 3, what="3 measured steps")
    fake_cuda.paused = True  # the GPU falls behind: the next steps wait for it
    for _ in range(3):
        with probe.step():
            fake_cuda.run(0, 2.0)
    time.sleep(0.3)
    assert len(listener.records("steps")[0]) == 3
    fake_cuda.sticky = RuntimeError("CUDA error: device-side assert triggered")
    try:
        wait_for(lambda: len(listener.records("steps")[0]) == 6, what="the 3 waiting steps, sent")
        hb_before = len(listener.records("hb")[0])
        for _ in range(3):  # the job goes on (here: its host code), rtop with it
            with probe.step():
                pass
        wait_for(lambda: len(listener.records("steps")[0]) == 9, what="steps after the error")
        wait_for(lambda: len(listener.records("hb")[0]) >= hb_before + 3,
                 what="heartbeats after the error")
        assert probe.sender.is_alive()
        # the goodbye carries the job's exit error, through a final drain that fails too
        with probe.step():
            pass
        probe.exit_error = "RuntimeError: CUDA error: device-side assert triggered"
    finally:
        probe.close(2.0, reason="exit")
    rows = listener.records("steps")[0]
    assert [r["step"] for r in rows] == list(range(10))
    assert all(r["gpu_s"] is not None for r in rows[:3])
    assert all(r["gpu_s"] is None for r in rows[3:])
    wait_for(lambda: len(_byes(listener)) == 1, what="the goodbye")  # the listener's thread
    [bye] = _byes(listener)
    assert bye["error"] == "RuntimeError: CUDA error: device-side assert triggered"
    assert bye["reason"] == "exit"
    assert pool.failure is not None and not pool._free  # failed events never reused
    step_warnings = [r for r in caplog.records if "reading a step's CUDA events" in
                     r.getMessage()]
    assert len(step_warnings) == 1


def test_watch_inside_the_first_step(listener, fake_cuda, gloo_world1):
    """Bug 5: ``watch`` inside the first ``with probe.step()``: that step has no CUDA
    start event, yet its bucket list holds events; comparing them with host times raised
    TypeError on the sender thread and stopped it."""
    model = _ddp()
    probe = _probe(listener, comm_timing="hook")
    x = torch.randn(16, 32)
    try:
        with probe.step():
            probe.use_cuda_events(torch_cuda_pool(1))
            probe.watch(model)
            fake_cuda.run(1, 5.0)
            model(x).square().mean().backward()
        _train(probe, model, fake_cuda, x, steps=5)
        wait_for(lambda: len(listener.records("steps").get(0, [])) == 6, what="6 steps")
    finally:
        probe.close(2.0)
    rows = listener.records("steps")[0]
    first, rest = rows[0], rows[1:]
    assert first["gpu_s"] is None and first["comm_s"] is None  # not measured, not zero
    assert first["compute_s"] is not None
    assert all(r["gpu_s"] is not None and r["comm_s"] is not None for r in rest)
    assert probe.sender.is_alive() is False  # closed normally, not crashed
    assert probe.cuda is not None and probe.cuda.failure is None


def test_a_hung_collective_on_the_gpu_is_reported_as_comm(listener, fake_cuda):
    """On a GPU the host does not wait in the comm hook: a hung allreduce showed as
    "compute" or "idle". The bucket events say the GPU is inside the collective."""
    probe = _probe(listener)
    pool = torch_cuda_pool(0)
    probe.use_cuda_events(pool)
    probe.comm.use_hook(world=2)
    fake_cuda.paused = True
    try:
        with probe.step():
            fake_cuda.run(0, 10.0)  # backward
            launch = pool.record()
            fake_cuda.run(0, 4.0)  # the allreduce, which never finishes
            probe.comm.buckets.append([launch, pool.record(), 1 << 20])
            fake_cuda.run(0, 1.0)
        fake_cuda.done[0] = launch.t  # the GPU has reached the collective, and stays
        wait_for(lambda: any(
            h["phase"] == "comm" for h in listener.records("hb").get(0, [])), timeout=10,
            what="a comm heartbeat")
        hb = [h for h in listener.records("hb")[0] if h["phase"] == "comm"][-1]
        assert hb["phase_s"] >= 1.0
        assert probe.activity.phase == "idle"  # what the host alone would have said
    finally:
        fake_cuda.finish()
        probe.close(2.0)


def test_device_memory_counts_what_the_allocator_does_not_see(fake_cuda):
    """Headroom must count the CUDA context and NCCL buffers: NVML's per-process
    figure beside the allocator's, and the peak rebased onto the device."""
    gib = 2**30
    fake_cuda.allocated[1], fake_cuda.reserved[1] = 50 * gib, 60 * gib
    fake_cuda.peak_reserved[1] = 70 * gib
    mem = MemorySampler()
    mem.watch(_CudaModel(1))
    mem.process_bytes = lambda: 63 * gib  # 3 GiB of context, NCCL, cuBLAS workspace
    row = mem.sample(time.time())
    from collectors.schema import MEM_FIELDS

    m = dict(zip(MEM_FIELDS, row, strict=True))
    assert m["device"] == "cuda:1"
    assert m["process_bytes"] == 63 * gib
    assert m["peak_bytes"] == 73 * gib  # 70 GiB allocator peak + 3 GiB outside it
    assert m["capacity_bytes"] - m["peak_bytes"] == 7 * gib  # not the 10 GiB it seemed
    mem.process_bytes = lambda: None  # NVML cannot tell: the allocator's figures alone
    m = dict(zip(MEM_FIELDS, mem.sample(time.time()), strict=True))
    assert m["process_bytes"] is None and m["peak_bytes"] == 70 * gib


def test_an_older_collectors_memory_rows_still_read():
    """``process_bytes`` was added at the end of the memory table: rows from an older
    collector (and older recordings) read it as not measured."""
    from collectors.schema import MEM_FIELDS
    from rtop.run.validate import check_rows

    old = [[time.time(), "cuda:0", 1, 2, 3, 4, 5, 6, 7]]
    assert check_rows("mem", old, len(MEM_FIELDS))[0][-1] is None
    with pytest.raises(Exception, match="malformed 'mem' rows"):
        check_rows("mem", [[1, 2, 3]], len(MEM_FIELDS))


def test_without_a_cuda_model_the_gpu_is_the_training_threads_device(
        listener, fake_cuda, monkeypatch):
    """Bug 6: with no CUDA model watched, NVML's GPU was picked by ``local_rank``: wrong
    under SLURM's per-task binding (``CUDA_VISIBLE_DEVICES=3``, ``LOCAL_RANK=3``: the
    rank's only visible device is cuda:0, physical GPU 3). Now it is the training
    thread's current CUDA device, mapped to NVML through its UUID."""
    from tests.test_nvml import UUIDS, FakeNvml

    nvml = FakeNvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    fake_cuda.uuids[0] = UUIDS[3].removeprefix("GPU-")  # torch's bare UUID of cuda:0
    probe = collectors.Probe(
        detect(rank=3, local_rank=3, world_size=8),
        collectors.ProbeConfig(hub=listener.address, token=listener.token,
                               flush_interval_s=0.05, sample_interval_s=0.1),
        nvml=nvml.module)

    def device_uuid() -> str | None:
        for batch in listener.batches():
            info = (batch.get("meta") or {}).get("device")
            if info:
                return info.get("uuid")
        return None

    try:
        deadline = time.monotonic() + 20
        while device_uuid() is None and time.monotonic() < deadline:
            with probe.step():  # the job's own CUDA work; rtop watches no model
                fake_cuda.run(0, 1.0)
            time.sleep(0.05)
    finally:
        probe.close(2.0)
    assert device_uuid() == UUIDS[3]
    assert probe.cuda_device == 0
    rows = listener.records("gpu")[3]
    assert rows and all(r["mem_total_bytes"] for r in rows)


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_a_cuda_graph_capture_is_never_disturbed_and_replays_are_timed(listener, fake_cuda,
                                                                       mode):
    """Finding 3: while a CUDA graph is captured, the sender thread's ``cudaEventQuery``
    invalidated the user's capture in the default "global" mode (its ``capture_end``
    raised into the job), and events rtop recorded inside the capture (a step inside it)
    could never be read, which turned CUDA timing off for the rest of the run. Now
    nothing is recorded or queried during a capture, and each replay is a timed step."""
    fake_cuda.set_device(1)
    probe = _probe(listener)
    probe.use_cuda_events(torch_cuda_pool(1))
    graph = fake_cuda.CUDAGraph()
    side = fake_cuda.Stream(1)
    try:
        fake_cuda.paused = True  # the GPU runs behind: the sender asks about these steps
        for _ in range(3):
            with probe.step():
                fake_cuda.run(1, 2.0)
        with fake_cuda.stream(side):  # the user's capture (torch.cuda.graph's own steps)
            graph.capture_begin(capture_error_mode=mode)
            try:
                with probe.step():  # a graphed training step
                    fake_cuda.run(1, 4.0)
                time.sleep(0.5)  # ten of the sender's rounds
            finally:
                graph.capture_end()  # raises if the capture was invalidated
        fake_cuda.finish()
        for _ in range(4):
            with probe.step():
                graph.replay()
        wait_for(lambda: len(listener.records("steps").get(0, [])) == 8, what="8 steps")
    finally:
        fake_cuda.finish()
        probe.close(2.0)
    assert fake_cuda.invalidated == 0
    rows = sorted(listener.records("steps")[0], key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(8))
    assert [r["gpu_s"] for r in rows[:3]] == [pytest.approx(0.002)] * 3
    assert rows[3]["gpu_s"] is None and rows[3]["compute_s"] is not None  # on the host
    assert [r["gpu_s"] for r in rows[4:]] == [pytest.approx(0.004)] * 4  # the replays
    assert probe.cuda is not None and probe.cuda.failure is None
    assert not [n for n in probe.notes if "turned off" in n]
    # the graph's own methods are back once the probe is closed
    assert all(vars(type(graph))[n].__module__ == "tests.fakecuda"
               for n in ("capture_begin", "capture_end", "replay"))
