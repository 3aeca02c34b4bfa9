"""collectors.steps on its own: raw steps in, step records out, no probe, no thread."""

from __future__ import annotations

import pytest

from collectors.cuda_events import EventPool
from collectors.schema import STEP_FIELDS
from collectors.steps import (
    ClockMap,
    PendingCudaStep,
    PendingCudaSteps,
    RawStep,
    StepRecords,
    ddp_comm,
    step_row,
)
from tests.test_probe import FakeGpu


def _row(raw: RawStep, gpu=None, world: int = 2, nbytes: int = 0) -> dict:
    clock = ClockMap()
    clock.wall0, clock.pc0 = 1000.0, 10.0  # perf_counter 10.0 is wall-clock 1000.0
    return dict(zip(STEP_FIELDS, step_row(raw, gpu, clock, world=world, nbytes=nbytes),
                    strict=True))


def _raw(buckets=None, cuda_pair=None, *, step=3, t_start=10.0, wait=0.02, t_enter=10.02,
         t_exit=10.12, samples=32, gap=0.005) -> RawStep:
    return (step, t_start, wait, t_enter, t_exit, samples, buckets, gap, cuda_pair)


def test_cpu_step_with_hook_buckets():
    # two overlapping buckets, the last one still in flight at step exit (done=None)
    buckets = [[10.05, 10.08, 1_000_000], [10.07, None, 3_000_000]]
    row = _row(_raw(buckets), world=4)
    assert row["step"] == 3
    assert row["t_wall"] == pytest.approx(1000.0)
    assert row["step_s"] == pytest.approx(0.12 + 0.005)  # start to exit, plus the gap
    assert row["data_wait_s"] == 0.02 and row["samples"] == 32 and row["gap_s"] == 0.005
    assert row["gpu_s"] is None
    assert row["comm_s"] == pytest.approx(0.07)  # union of [10.05, 10.08] and [10.07, 10.12]
    assert row["comm_exposed_s"] == pytest.approx(0.05)  # after the last launch
    assert row["comm_bytes"] == 4_000_000 and row["comm_calls"] == 2
    assert row["compute_s"] == pytest.approx(0.10 - 0.05)  # the body less the exposed part
    assert row["algbw_Bps"] == pytest.approx(4e6 / 0.07)
    assert row["busbw_Bps"] == pytest.approx(4e6 / 0.07 * 2 * 3 / 4)


def test_step_without_collective_timing_says_not_measured():
    row = _row(_raw(None))
    for key in ("comm_s", "comm_exposed_s", "comm_bytes", "comm_calls", "algbw_Bps",
                "busbw_Bps", "gpu_s"):
        assert row[key] is None, key
    assert row["compute_s"] == pytest.approx(0.10)


def test_ddp_stamps_to_figures():
    exit_ns = 5_000_000_000  # time.time_ns() at step exit, which is perf_counter 10.12
    ns = lambda perf: exit_ns - round((10.12 - perf) * 1e9)  # noqa: E731
    stamps = (ns(10.06), ns(10.09), ns(10.11), 3, exit_ns)
    row = _row(_raw(stamps), world=2, nbytes=8_000_000)
    assert row["comm_s"] == pytest.approx(0.05)  # first launch to last completion
    assert row["comm_exposed_s"] == pytest.approx(0.02)  # after backward's last gradient
    assert row["comm_bytes"] == 8_000_000 and row["comm_calls"] == 3
    assert row["busbw_Bps"] == pytest.approx(8e6 / 0.05)  # 2(n-1)/n = 1 for two ranks
    assert row["compute_s"] == pytest.approx(0.10 - 0.02)
    # the same through ddp_comm directly
    figures = ddp_comm(stamps, 10.02, 10.12, 8_000_000, 2)
    assert figures[:4] == (pytest.approx(0.05), pytest.approx(0.02), 8_000_000, 3)


def test_ddp_stamps_special_cases():
    exit_ns = 5_000_000_000
    # no synchronized backward in the step (no_sync): no collective, zero and not None
    assert ddp_comm((), 10.02, 10.12, 8, 2) == (0.0, 0.0, 0, 0, None, None)
    # stamps that end before this step began belong to an earlier one: no allreduce here
    old = (exit_ns - 900_000_000, exit_ns - 850_000_000, exit_ns - 800_000_000, 2, exit_ns)
    assert ddp_comm(old, 10.02, 10.12, 8, 2) == (0.0, 0.0, 0, 0, None, None)
    # unreadable stamps: not measured
    assert ddp_comm((0, 0, 0, 0, exit_ns), 10.02, 10.12, 8, 2) == (None,) * 6
    assert ddp_comm((exit_ns, 0, exit_ns - 1, 1, exit_ns), 10.02, 10.12, 8, 2) == (None,) * 6


def _cuda_step(gpu: FakeGpu, pool: EventPool, step: int, kernels_ms: float = 10.0,
               bucket_ms: float | None = 4.0) -> RawStep:
    start = pool.record()
    gpu.issued += kernels_ms
    buckets = None
    if bucket_ms is not None:
        launch = pool.record()
        gpu.issued += bucket_ms
        buckets = [[launch, pool.record(), 4_000_000]]
    gpu.issued += 1.0
    return _raw(buckets, (start, pool.record()), step=step)


def test_cuda_step_resolves_on_the_gpu_timeline():
    gpu = FakeGpu()
    pool = EventPool(gpu.event)
    raw = _cuda_step(gpu, pool, 0)
    pending = PendingCudaStep(raw, queued=0.0)
    assert len(pending.events()) == 4
    assert pending.resolve(pool) is None  # the GPU has not run it yet
    # an unread event stays out of the pool (reusing it would move a mark in flight)
    later = _cuda_step(gpu, pool, 1)
    assert pool.created == 8
    gpu.done = 1e9
    gpu_s, buckets = pending.resolve(pool)
    assert gpu_s == pytest.approx(0.015)
    assert buckets == [[pytest.approx(0.010), pytest.approx(0.014), 4_000_000]]
    row = _row(raw, (gpu_s, buckets), world=4)
    assert row["gpu_s"] == pytest.approx(0.015)
    assert row["comm_s"] == pytest.approx(0.004)
    assert row["compute_s"] == pytest.approx(0.011)
    assert row["busbw_Bps"] == pytest.approx(4e6 / 0.004 * 2 * 3 / 4)
    # read, its four events went back to the pool: the next step makes none
    assert PendingCudaStep(later, queued=0.0).resolve(pool) is not None
    _cuda_step(gpu, pool, 2)
    _cuda_step(gpu, pool, 3)
    assert pool.created == 8


def test_pending_steps_leave_in_order_and_time_out():
    gpu = FakeGpu()
    pool = EventPool(gpu.event)
    pending = PendingCudaSteps(timeout_s=30.0)
    for step in range(3):
        pending.add(_cuda_step(gpu, pool, step, bucket_ms=None), now=100.0)
    assert len(pending) == 3
    assert list(pending.ready(100.0, pool)) == []  # nothing done on the GPU
    gpu.done = 11.0  # the first step (0..11 ms) is done
    out = list(pending.ready(101.0, pool))
    assert [raw[0] for raw, _ in out] == [0] and out[0][1][0] == pytest.approx(0.011)
    assert len(pending) == 2
    # past the timeout, the oldest is given up (GPU figures not measured), one by one
    # while the GPU has not reached them
    out = list(pending.ready(130.0, pool))
    assert [(raw[0], times) for raw, times in out] == [(1, (None, None)), (2, (None, None))]
    assert len(pending) == 0


def test_pending_steps_wait_behind_the_oldest_until_final():
    gpu = FakeGpu()
    pool = EventPool(gpu.event)
    pending = PendingCudaSteps(timeout_s=30.0)
    first = _cuda_step(gpu, pool, 0, bucket_ms=None)
    pending.add(first, now=0.0)
    pending.add(_cuda_step(gpu, pool, 1, bucket_ms=None), now=0.0)
    first[8][1].t = None  # the first step's end event was never recorded: never completes
    gpu.done = 1e9
    assert list(pending.ready(1.0, pool)) == [], "a later step overtook the oldest"
    out = list(pending.ready(1.0, pool, final=True))  # closing: everything goes now
    assert [raw[0] for raw, _ in out] == [0, 1]
    assert out[0][1] == (None, None) and out[1][1][0] == pytest.approx(0.011)


def test_timed_out_step_still_has_host_figures():
    gpu = FakeGpu()
    pool = EventPool(gpu.event)
    raw = _cuda_step(gpu, pool, 0)
    row = _row(raw, (None, None))
    assert row["gpu_s"] is None  # missing, not zero
    assert row["comm_s"] is None
    assert row["compute_s"] == pytest.approx(0.10)  # the host's view of the step body


def test_clock_map_follows_perf_counter():
    clock = ClockMap()
    clock.wall0, clock.pc0 = 50.0, 2.0
    assert clock.wall(2.5) == pytest.approx(50.5)
    clock.refresh()
    import time

    assert abs(clock.wall(time.perf_counter()) - time.time()) < 0.1


def test_step_records_keep_the_order_steps_finished_in():
    from collections import deque

    gpu = FakeGpu()
    pool = EventPool(gpu.event)
    records = StepRecords(timeout_s=30.0)
    raws = deque([_raw(None, step=0), _cuda_step(gpu, pool, 1, bucket_ms=None)])
    rows = records.drain(raws, pool, world=1, nbytes=0, now=0.0)
    assert not raws, "raw steps left behind"
    assert [r[0] for r in rows] == [0]  # the host-timed step at once, the CUDA one waits
    assert len(records.pending) == 1
    gpu.done = 1e9
    raws.append(_cuda_step(gpu, pool, 2, bucket_ms=None))
    rows = records.drain(raws, pool, world=1, nbytes=0, now=1.0)
    assert [r[0] for r in rows] == [1, 2]
    assert [r[STEP_FIELDS.index("gpu_s")] for r in rows] == [pytest.approx(0.011)] * 2
    assert records.drain(raws, pool, world=1, nbytes=0, now=2.0, final=True) == []


def test_a_completion_marked_after_the_query_pass_does_not_turn_cuda_timing_off():
    """Finding 6's race: another thread (gloo's callback) may mark a collective's
    completion between the pass that asks the GPU whether the step's events are done and
    the reading of their times; ``elapsed_time`` raises on an event the GPU has not
    passed (tests/fakecuda.py: cudaErrorNotReady), and the sender then turned CUDA timing
    off for the rest of the run. The step is read from one copy of its entries now: the
    late completion counts as still in flight at the step's end."""
    from collections import deque

    from collectors.cuda_events import torch_cuda_pool
    from tests.fakecuda import FakeCuda

    fake = FakeCuda(devices=1)
    pool = torch_cuda_pool(0, cuda=fake)
    start = pool.record()
    fake.run(0, 2.0)
    entry = ["all_reduce", pool.record(), None, 4000, 2, 1]
    fake.run(0, 3.0)
    end = pool.record()
    raw = (*_raw(None, (start, end)), ([entry], [], True))
    asked = end.query

    def query_then_complete() -> bool:  # the GPU is asked, then gloo's thread completes
        done = asked()
        if entry[2] is None:
            fake.paused = True
            fake.run(0, 1.0)
            entry[2] = pool.record()  # an event the GPU has not reached
        return done

    end.query = query_then_complete
    errors: list[BaseException] = []

    def on_error(exc: BaseException) -> None:  # what the sender does (Sender._step_error)
        errors.append(exc)
        pool.fail(f"reading CUDA events failed: {exc}")

    records = StepRecords(30.0, on_error=on_error)
    rows = records.drain(deque([raw]), pool, world=2, nbytes=0, now=0.0)
    assert errors == [] and pool.failure is None
    row = dict(zip(STEP_FIELDS, rows[0], strict=True))
    assert row["gpu_s"] == pytest.approx(0.005)
    assert row["comm_s"] == pytest.approx(0.003)  # launch at 2 ms, in flight to the end


def test_host_timed_collectives_sit_on_a_cuda_steps_timeline():
    """A gloo collective in a GPU job is timed on the host: its entry is put on the
    step's GPU timeline by its offset from the step's start on the host."""
    gpu = FakeGpu()
    pool = EventPool(gpu.event)
    start = pool.record()
    gpu.issued += 10.0
    end = pool.record()
    gpu.done = 1e9
    # t_enter 10.02: a gloo all-reduce from 10.024 to 10.030, blocked throughout
    direct = ([["all_reduce", 10.024, 10.030, 400, 2, 1]], [(10.024, 10.030)], True)
    pending = PendingCudaStep((*_raw(None, (start, end)), direct), queued=0.0)
    times = pending.resolve(pool)
    assert times is not None and times[0] == pytest.approx(0.010)
    row = _row(pending.resolved(), times)
    assert row["comm_s"] == pytest.approx(0.006)
    assert row["comm_exposed_s"] == pytest.approx(0.006)
    assert row["compute_s"] == pytest.approx(0.004)
    # one that could not be timed (a device collective with no event pool): not measured
    direct = ([["all_reduce", None, None, 400, 2, 1]], [], True)
    start, end = pool.record(), pool.record()
    pending = PendingCudaStep((*_raw(None, (start, end)), direct), queued=0.0)
    row = _row(pending.resolved(), pending.resolve(pool))
    assert row["gpu_s"] == pytest.approx(0.0) and row["comm_s"] is None


def test_an_event_recorded_in_an_unseen_capture_costs_its_step_only():
    """Finding 3: an event recorded on a capturing stream can never be read (CUDA's
    cudaErrorCapturedEvent, tests/fakecuda.py). Where rtop did not see the capture begin
    (a pool that cannot ask, a capture on another thread), such an event turned CUDA
    timing off for the rest of the run; it costs that step's GPU figures now."""
    from collections import deque

    from collectors.cuda_events import EventPool
    from tests.fakecuda import FakeCuda

    fake = FakeCuda(devices=1)
    pool = EventPool(lambda: fake.Event(enable_timing=True))  # no capture check
    side = fake.Stream(0)
    graph = fake.CUDAGraph()
    with fake.stream(side):
        graph.capture_begin(capture_error_mode="relaxed")
        captured = (pool.record(), pool.record())  # a step inside the capture
        graph.capture_end()
    errors: list[BaseException] = []

    def on_error(exc: BaseException) -> None:  # what the sender does (Sender._step_error)
        errors.append(exc)
        pool.fail(str(exc))

    records = StepRecords(30.0, on_error=on_error)
    start = pool.record()
    fake.run(0, 2.0)
    later = (start, pool.record())
    rows = records.drain(deque([_raw(None, captured, step=0), _raw(None, later, step=1)]),
                         pool, world=1, nbytes=0, now=0.0)
    assert errors == [] and pool.failure is None
    assert [r[STEP_FIELDS.index("gpu_s")] for r in rows] == [None, pytest.approx(0.002)]
