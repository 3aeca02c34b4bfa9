"""The probe's own logic: identity, batch sizes, disabled mode, CUDA event resolution."""

from __future__ import annotations

import subprocess
import sys
import time
from functools import partial

import pytest

import collectors
from collectors.cuda_events import EventPool
from collectors.identity import Identity, detect
from collectors.probe import batch_size
from tests import waiting

#: This module's pace: polled every 20 ms, given 20 s by default.
wait_for = partial(waiting.wait_for, timeout=20.0, every=0.02)


def test_import_collectors_pulls_in_no_heavy_or_app_modules():
    code = (
        "import sys, collectors, collectors.wire, collectors.schema; "
        "bad = [m for m in ('torch', 'ray', 'textual', 'rtop', 'pynvml', 'numpy') "
        "if m in sys.modules]; print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "", f"import collectors imported {out.stdout.strip()}"


@pytest.mark.parametrize("module", ["collectors", "collectors.probe", "collectors.sender",
                                    "collectors.steps", "collectors.connection",
                                    "collectors.samplers", "collectors.nvml",
                                    "collectors.commhook", "rtop", "rtop.workload",
                                    "rtop.hub.server", "rtop.hub.ray_actor", "rtop.report"])
def test_each_public_module_imports_alone(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)


def test_identity_from_torchrun_environment(monkeypatch):
    for k, v in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                 "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job42"}.items():
        monkeypatch.setenv(k, v)
    ident = detect()
    assert (ident.rank, ident.world_size, ident.local_rank) == (5, 8, 1)
    assert (ident.attempt, ident.job, ident.source) == (2, "job42", "env")
    assert ident.group == "job42#2"
    assert Identity.from_wire(ident.to_wire() | {"future": 1}) == ident


def test_identity_single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ident = detect()
    assert (ident.rank, ident.world_size, ident.source) == (0, 1, "single")
    assert ident.pid > 0 and ident.hostname and ident.ip


def test_batch_size_of_common_batch_shapes():
    torch = pytest.importorskip("torch")
    x = torch.zeros(32, 3)
    assert batch_size(x) == 32
    assert batch_size((x, torch.zeros(32))) == 32
    assert batch_size({"image": x, "label": torch.zeros(32)}) == 32
    assert batch_size([1, 2, 3]) is None
    assert batch_size(torch.tensor(1.0)) is None
    assert batch_size("text") is None


def test_disabled_probe_is_inert(monkeypatch):
    monkeypatch.setenv("RTOP_DISABLE", "1")
    monkeypatch.setattr(collectors, "_probe", None)
    probe = collectors.start()
    assert isinstance(probe, collectors.NullProbe)
    data = [1, 2, 3]
    assert probe.iter(data) is data
    with probe.step():
        pass
    monkeypatch.setattr(collectors, "_probe", None)


def test_start_returns_the_same_probe(monkeypatch):
    monkeypatch.setattr(collectors, "_probe", None)
    a = collectors.start(hub=None)
    try:
        assert collectors.start() is a and collectors.current() is a
    finally:
        a.close(0.1)
        monkeypatch.setattr(collectors, "_probe", None)


def test_unknown_setting_is_a_clear_error():
    with pytest.raises(TypeError, match="unknown probe setting"):
        collectors.ProbeConfig.from_env(flush_every=3)


def test_comm_timing_takes_ddp_or_hook_and_ignores_anything_else(monkeypatch, caplog):
    """``auto``, the earlier name of ``ddp``, is retired: like any unknown value it is
    logged and ignored (the default, ``ddp``, is used)."""
    for value, want in (("hook", "hook"), ("DDP", "ddp"), ("auto", "ddp"), ("x", "ddp")):
        monkeypatch.setenv("RTOP_COMM_TIMING", value)
        caplog.clear()
        assert collectors.ProbeConfig.from_env().comm_timing == want
        assert ("ignored" in caplog.text) == (value in ("auto", "x")), caplog.text


def test_loader_length_passes_through():
    probe = collectors.Probe(detect(), collectors.ProbeConfig(), start_sender=False)
    assert len(probe.iter([1, 2, 3])) == 3


class FakeGpu:
    """A GPU timeline: events complete when the fake GPU's clock passes them."""

    def __init__(self) -> None:
        self.issued = 0.0  # where the CPU has enqueued work up to (ms)
        self.done = 0.0  # where the GPU has executed up to (ms)
        self.synchronize_calls = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.t: float | None = None

    def record(self) -> None:
        self.t = self.gpu.issued

    def query(self) -> bool:
        return self.t is not None and self.gpu.done >= self.t

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an incomplete event"
        return end.t - self.t


def test_cuda_steps_resolve_later_without_synchronising(listener):
    gpu = FakeGpu()
    probe = collectors.Probe(detect(), collectors.ProbeConfig(
        hub=listener.address, token=listener.token, flush_interval_s=0.05))
    probe.use_cuda_events(EventPool(gpu.event))
    probe.comm.use_hook(world=4)
    pool = probe.cuda
    assert pool is not None

    def steps() -> list[dict]:
        return listener.records("steps").get(0, [])

    for _ in range(3):
        with probe.step():
            gpu.issued += 10.0  # forward+backward kernels: 10 ms of GPU work
            launch = pool.record()
            gpu.issued += 4.0  # a 4 MB bucket's allreduce takes 4 ms
            probe.comm.buckets.append([launch, pool.record(), 4_000_000])
            gpu.issued += 1.0  # optimizer
    try:
        # the sender drains every flush interval (0.05 s) and connects at once: give it
        # many rounds; nothing may come before the GPU has finished the first step
        wait_for(lambda: probe.stats()["connected"], what="the rank to connect")
        time.sleep(0.5)
        assert not steps(), "steps were emitted before the GPU finished them"
        gpu.done = 15.0  # the first step is complete on the GPU
        wait_for(steps, what="the first step")
        time.sleep(0.3)
        rows = steps()
        assert len(rows) == 1
        row = rows[0]
        assert row["gpu_s"] == pytest.approx(0.015)
        assert row["comm_s"] == pytest.approx(0.004)
        assert row["comm_exposed_s"] == pytest.approx(0.004)
        assert row["compute_s"] == pytest.approx(0.011)
        assert row["busbw_Bps"] == pytest.approx(4e6 / 0.004 * 2 * 3 / 4)
        gpu.done = 1e9
        wait_for(lambda: len(steps()) == 3, what="all three steps")
        # events go back to the pool and are reused: 4 per step, not 4 more each step
        with probe.step():
            gpu.issued += 1
        assert pool.created == 12
    finally:
        probe.close(1.0)


def test_cuda_step_given_up_after_timeout(listener):
    gpu = FakeGpu()  # never runs anything: the step's events never complete
    probe = collectors.Probe(detect(), collectors.ProbeConfig(
        hub=listener.address, token=listener.token, flush_interval_s=0.05,
        cuda_resolve_timeout_s=1.0))
    probe.use_cuda_events(EventPool(gpu.event))
    t_step = time.monotonic()  # the sender queues the step after this
    with probe.step():
        gpu.issued += 5
    try:
        time.sleep(0.5)
        assert time.monotonic() - t_step >= 1.0 or not listener.records("steps"), \
            "the step was given up before its timeout"
        wait_for(lambda: listener.records("steps").get(0), what="the step, given up")
        assert time.monotonic() - t_step >= 1.0
        [row] = listener.records("steps")[0]
        assert row["gpu_s"] is None  # missing, not zero
        assert row["compute_s"] is not None
    finally:
        probe.close(1.0)


def test_training_buffer_full_drops_and_counts():
    probe = collectors.Probe(detect(), collectors.ProbeConfig(buffer_records=10),
                             start_sender=False)
    for _ in range(25):
        with probe.step():
            pass
    assert len(probe.records) == 10 and probe.dropped_buffer == 15
    assert probe.stats()["dropped_buffer"] == 15


def test_nested_and_unbalanced_steps_do_not_break():
    probe = collectors.Probe(detect(), collectors.ProbeConfig(), start_sender=False)
    with probe.step(), probe.step():
        pass
    assert probe.step_count == 1
    probe.step().__exit__(None, None, None)  # exit without enter
    assert probe.step_count == 1
    with pytest.raises(ValueError), probe.step():
        raise ValueError("the user's error propagates")
    assert probe.step_count == 2
