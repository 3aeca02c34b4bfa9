"""The link probe over NCCL (issue 25, findings 1, 2 and 7), on the fake of CUDA and NCCL
in ``tests/fakecuda.py`` ("the link probe's runtime"), whose rules are the runtime's: a
posted operation completes only when its peer posts the matching one, a pair's first
operation creates its communicator inside the call, a communicator lives until its
group is shut down or aborted, the host sees a completion at least 100 µs after the GPU
finished it while CUDA events read the GPU's time, and ``current_device()`` is 0 on a
thread that never called ``set_device``.

Each rank is a thread with its own fake GPUs and ``torch.distributed``; they share one
real ``HashStore``. Also here, because ``tests/test_never_raise.py`` has no probe
section and is another engineer's: a fault at any step of the probe never reaches the
job and leaves nothing posted, no communicator alive and the job's device and streams
as they were."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import collectors
from collectors import control as control_mod
from collectors import cuda_events, linkprobe
from collectors.cuda_events import torch_cuda_pool
from collectors.identity import detect
from collectors.linkprobe import LinkProbe, cuda_probe_index, plan
from tests.fakecuda import FakeCuda, FakeLinkJob

MiB = 1 << 20


def probes(job: FakeLinkJob, ranks: list[int], nbytes: int, *, device: int | None = 1,
           reps: int = 3, timeout_s: float = 5.0, bound: int | None = None,
           runtimes: dict[int, Any] | None = None
           ) -> dict[int, tuple[LinkProbe, list[dict[str, Any]]]]:
    """One probe per rank of ``ranks`` over every pair of ``job``'s ranks, on the
    rank's ``cuda:device`` (None: not given)."""
    rounds = plan(["node"] * job.ranks)
    out = {}
    for r in ranks:
        got: list[dict[str, Any]] = []
        rt = (runtimes or {}).get(r) or job.runtime(r, bound=bound)
        dev = None if device is None else torch.device("cuda", device)
        out[r] = (LinkProbe(r, rounds, nbytes, got.append, reps=reps, timeout_s=timeout_s,
                            device=dev, probe_id=25, runtime=rt), got)
    return out


def run(ps: dict[int, tuple[LinkProbe, list[dict[str, Any]]]], limit_s: float = 60.0
        ) -> dict[int, dict[str, Any]]:
    """Run each probe on a thread of its own (its rank's training thread, which never
    called ``set_device``); each rank's answers, seconds and what its thread saw."""
    out: dict[int, dict[str, Any]] = {}

    def rank(r: int) -> None:
        probe, got = ps[r]
        cuda = probe._rt.cuda if probe._rt is not None else None
        t0 = time.monotonic()
        try:
            finished = probe.at_boundary(0)
            raised = None
        except BaseException as exc:  # must never happen
            finished, raised = False, exc
        out[r] = {"answers": got, "seconds": time.monotonic() - t0, "finished": finished,
                  "raised": raised,
                  "device_after": cuda.current_device() if cuda is not None else None,
                  "stream_after": cuda.current_stream() if cuda is not None else None}

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}", daemon=True)
               for r in ps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
    assert not any(t.is_alive() for t in threads), "a rank's probe never returned"
    return out


def nothing_left(job: FakeLinkJob) -> None:
    """No operation left posted, no probe communicator alive, nothing on the job's own
    group, nothing a real run would have hung on."""
    assert job.left_posted() == [], job.left_posted()
    assert all(job.live(r) == 0 for r in range(job.ranks))
    assert job.job_ops == 0
    assert job.problems == []


# ---- finding 1: both post or neither; drained; communicators freed -------------------


def test_a_healthy_probe_measures_every_link_on_pair_groups_it_frees():
    """Four ranks over fake NCCL: every link measured from CUDA events at the link's
    bandwidth, each pair on a process group of its own, made after both ranks joined and
    freed after the pair (never more than one alive on a rank), nothing posted on the
    job's group, every buffer, stream and event on the model's GPU (cuda:1) though the
    training threads are on cuda:0, and the job's device and streams as they were.
    Before: transfers went over the job's own group (``dist.isend``), whose per-pair
    communicators stay in GPU memory (up to 63 a rank), and were timed on the host."""
    job = FakeLinkJob(4, bandwidth_Bps=2e9)
    # the fastest of 6: the fake's ranks are threads that a loaded machine preempts
    # between posting two transfers (the GPU then idles, as a real one would)
    ps = probes(job, [0, 1, 2, 3], 4 * MiB, reps=6)
    out = run(ps)
    for r in range(4):
        o = out[r]
        assert o["raised"] is None and o["finished"]
        (a,) = o["answers"]
        assert set(a) == {"rank", "links", "seconds", "nbytes"}, a
        assert sorted(p for p, _ in a["links"]) == [p for p in range(4) if p != r]
        for _, bps in a["links"]:
            assert bps == pytest.approx(2e9, rel=0.05), a
        gpu = job.gpus[r]
        assert gpu.contexts() == {1}, {d: gpu.why(d) for d in gpu.contexts()}
        assert o["device_after"] == 0 and o["stream_after"] is gpu.default[0]
        assert all(s.waits == 0 for s in gpu.default), "the job's stream waited on the probe"
        assert job.groups_made[r] == 3 and job.max_live[r] == 1
        counts = ps[r][0].counts
        assert counts["posted"] == counts["completed"] > 0 and counts["drained"] == 0
        assert counts["groups"] == counts["groups_freed"] == 3
    nothing_left(job)


def test_a_peer_that_never_joins_costs_one_timeout_and_nothing_is_posted():
    """Rank 1 never runs the probe: rank 0 gives up after its timeout having posted
    nothing (no communicator was even made), so nothing waits on rank 1 for NCCL's
    watchdog to find. Before: rank 0's 1-byte token send to rank 1 was posted at once and
    left posted when it gave up."""
    job = FakeLinkJob(2)
    ps = probes(job, [0], MiB, timeout_s=0.5)
    out = run(ps)
    (a,) = out[0]["answers"]
    assert a["peer"] == 1 and "nothing from rank 1" in a["error"], a
    assert 0.5 <= out[0]["seconds"] < 3.0
    assert job.ops == [] and job.groups_made[0] == 0
    nothing_left(job)


def test_a_cancel_mid_transfer_finishes_what_was_posted_and_the_peer_learns_at_once():
    """The hub cancels rank 0 while its operations of a transfer are posted: it carries
    that transfer to its end (its peer posted the other half), stops at the next
    agreement and rank 1 learns there, well within its timeout; nothing stays posted and
    nothing needed aborting. Before: rank 0 stopped polling with its receive posted (a
    send of rank 1's that never completes), and rank 1 waited out its timeout."""
    job = FakeLinkJob(2, bandwidth_Bps=1e9)
    ps = probes(job, [0, 1], 2 * MiB, reps=20, timeout_s=20.0)
    cancelled: list[float] = []

    def on_post(op: Any) -> None:
        if op.rank == 0 and op.kind == "recv" and op.nbytes > 1 and not cancelled \
                and len([o for o in job.ops if o.rank == 0]) > 12:
            cancelled.append(time.monotonic())
            t = threading.Thread(target=ps[0][0].abort, args=("cancelled by the hub",))
            t.start()
            t.join()

    job.on_post = on_post
    out = run(ps)
    assert cancelled, "the cancel never came"
    assert out[0]["answers"] == [{"rank": 0, "error": "cancelled by the hub"}]
    (a,) = out[1]["answers"]
    assert a["peer"] == 0 and "rank 0 is not coming" in a["error"], a
    assert out[1]["seconds"] < 5.0  # not its 20 s timeout
    assert job.aborted() == []  # every posted transfer completed: nothing to drain
    nothing_left(job)


def test_a_peer_that_hangs_mid_transfer_is_drained_by_aborting_the_pairs_communicator():
    """Rank 1 hangs after posting the ready byte of a transfer it sends, before its data
    (its process froze): rank 0's posted receives cannot complete, so after its timeout
    it aborts the pair's own communicator, which ends them; the job's communicators
    carry nothing of the probe. Once rank 1 wakes it does the same with what it posted.
    Before: rank 0 gave up with its receives posted on the job's group, for the
    watchdog to find."""
    job = FakeLinkJob(2, bandwidth_Bps=4e9)
    wake = threading.Event()
    readies: list[int] = []

    def on_post(op: Any) -> None:
        if op.rank == 1 and op.kind == "send" and op.nbytes == 1:
            readies.append(1)
            if len(readies) == 2:  # the first is the join's exchange
                wake.wait(20)

    job.on_post = on_post
    ps = probes(job, [0, 1], MiB, timeout_s=0.5)
    threading.Timer(3.0, wake.set).start()
    out = run(ps)
    (a0,) = out[0]["answers"]
    assert a0["peer"] == 1 and "aborted" in a0["error"], a0
    assert out[0]["seconds"] < 3.0  # rank 0 did not wait for rank 1 to wake
    drained = job.aborted()
    assert drained and {op.rank for op in drained if op.rank == 0} == {0}
    assert ps[0][0].counts["drained"] > 0 and ps[0][0].counts["groups_freed"] == 1
    (a1,) = out[1]["answers"]
    assert "error" in a1
    nothing_left(job)


# ---- finding 7: GPU transfers timed with CUDA events -----------------------------------


def test_gpu_transfers_are_timed_by_cuda_events_not_the_host_clock():
    """A transfer takes 2 ms on the GPU and the host sees its completion 1.5 ms later
    (the fake's rule: launch and polling overhead of at least 100 µs; scaled up here, as
    the transfer is, so that the fake's ranks, Python threads that share a GIL, post
    faster than the fake GPU carries): the probe's figures are the link's within 5 %,
    where the host's clock around one transfer reads at most 2 / 3.5 of it. The fake
    itself shows what the host clock reads. Before: the probe timed each transfer on
    the host."""
    bw = 1e9
    nbytes = 2_000_000  # 2 ms at 1 GB/s
    job = FakeLinkJob(2, bandwidth_Bps=bw, host_lag_s=1.5e-3)
    out = run(probes(job, [0, 1], nbytes, reps=6))
    for r in (0, 1):
        (a,) = out[r]["answers"]
        ((_, bps),) = a["links"]
        assert bps == pytest.approx(bw, rel=0.05), a
    nothing_left(job)
    # the rule the probe is up against: a host clock around a transfer on the same fake
    host = FakeLinkJob(2, bandwidth_Bps=bw, host_lag_s=1.5e-3)
    rts = {r: host.runtime(r) for r in (0, 1)}
    pgs: dict[int, Any] = {}
    bufs = {r: rts[r].torch.full((nbytes,), r, dtype=torch.uint8, device="cuda:1")
            for r in (0, 1)}
    seen: dict[int, float] = {}

    def side(r: int) -> None:
        dist = rts[r].dist
        pgs[r] = dist.ProcessGroupNCCL(dist.PrefixStore("host/", host.store), r, 2,
                                       dist.ProcessGroupNCCL.Options())
        for _ in range(3):
            t0 = time.perf_counter()
            work = (pgs[r].send if r == 0 else pgs[r].recv)([bufs[r]], 1 - r, 0)
            while not work.is_completed():
                pass
            seen[r] = min(seen.get(r, 1.0), time.perf_counter() - t0)

    threads = [threading.Thread(target=side, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert nbytes / seen[1] < 0.6 * bw, seen  # the host clock reads the link 40 % slow


# ---- finding 2: the model's device --------------------------------------------------


def test_cuda_probe_index_is_the_models_device_never_a_guess():
    at = cuda_probe_index
    assert at(model=3, bound=1, devices=8, thread=0, local_rank="5") == 3
    assert at(model=None, bound=1, devices=8, thread=0, local_rank="5") == 1
    assert at(model=None, bound=None, devices=1, thread=None, local_rank=None) == 0
    assert at(model=None, bound=None, devices=8, thread=2, local_rank="7") == 2  # set_device
    assert at(model=None, bound=None, devices=8, thread=0, local_rank="0") == 0
    for thread, local in ((0, "1"), (0, None), (None, "0"), (None, None)):
        with pytest.raises(ValueError, match=r"never calls torch\.cuda\.set_device"):
            at(model=None, bound=None, devices=8, thread=thread, local_rank=local)


class TwoGpus(FakeCuda):
    """``FakeCuda`` with what ``torch.cuda.is_available()`` and ``device_count()`` say."""

    def is_available(self) -> bool:
        return self.devices > 0

    def device_count(self) -> int:
        return self.devices


@pytest.fixture
def nccl_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A rank of an NCCL job on a machine of two fake GPUs whose training thread never
    called ``set_device`` (it is on cuda:0), unbound process group, LOCAL_RANK 1."""
    import torch.distributed as dist

    fake = TwoGpus(devices=2)
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
    probe.cuda_device = 0  # what the training thread said: cuda:0, never set
    monkeypatch.setattr(cuda_events, "cuda_module", lambda: fake)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group",
                        lambda: type("PG", (), {"bound_device_id": None})())
    monkeypatch.setenv("LOCAL_RANK", "1")
    yield probe, fake
    probe.close(0.1)


def arm(probe: Any) -> Any:
    ctl = control_mod.Control(probe, wake=lambda: None)
    return ctl._probe("p1", {"bytes": MiB, "pairs": [[0, 0, 1]], "rounds": 1},
                      lambda answer: None)


def test_control_gives_the_probe_the_models_gpu_not_the_current_one(nccl_rank):
    """The model lives on cuda:1 (its CUDA event pool is tied there) while the training
    thread is on cuda:0: the probe is armed on cuda:1. Before: ``_probe_device`` took the
    training thread's current device (cuda:0), and the probe was handed no device at
    all, so it allocated on ``torch.cuda.current_device()``: GPU 0 in every rank."""
    probe, fake = nccl_rank
    probe.use_cuda_events(torch_cuda_pool(1, cuda=fake))
    action = arm(probe)
    assert isinstance(action, LinkProbe)
    assert action.device == torch.device("cuda", 1)
    assert fake.context_devices() <= {1}  # judging its memory opened nothing on GPU 0


def test_control_refuses_a_probe_whose_gpu_it_cannot_tell(nccl_rank):
    """No CUDA model watched, the thread on cuda:0 and LOCAL_RANK 1 of two GPUs: the arm
    is refused with the reason (the hub cancels it everywhere). Before: armed on cuda:0."""
    probe, fake = nccl_rank
    with pytest.raises(ValueError, match=r"never calls torch\.cuda\.set_device"):
        arm(probe)
    assert fake.context_devices() == set()


def test_a_probe_given_no_device_takes_the_groups_bound_one_or_refuses():
    """Under NCCL with no device given: the device the default group is bound to, else an
    answer that says so (nothing allocated). Before: ``torch.cuda.current_device()``,
    which is 0 on every rank of a job that never calls ``set_device``."""
    job = FakeLinkJob(2, bandwidth_Bps=4e9)
    out = run(probes(job, [0, 1], MiB, device=None, bound=1))
    assert all("links" in out[r]["answers"][0] for r in (0, 1)), out
    assert all(job.gpus[r].contexts() == {1} for r in (0, 1))
    lonely = FakeLinkJob(2)
    out = run(probes(lonely, [0], MiB, device=None))
    (a,) = out[0]["answers"]
    assert "needs the device the model lives on" in a["error"]
    assert lonely.gpus[0].contexts() == set()


# ---- never raises, leaves nothing behind (test_never_raise.py's promise, for the probe) --

#: (where, at which of its calls) a fault is injected on rank 0
FAULTS = [("store.add", 3), ("store.set", 2), ("ProcessGroupNCCL", 1), ("send", 3),
          ("recv", 3), ("is_completed", 5), ("block_current_stream", 2),
          ("Event.record", 2), ("elapsed_time", 1), ("alloc", 3), ("Stream", 1),
          ("shutdown", 1)]


class Faulty:
    """Rank 0's runtime with a fault injected at ``point`` (its ``nth`` call)."""

    def __init__(self, job: FakeLinkJob, point: str, nth: int = 3) -> None:
        self.rt = job.runtime(0)
        self.point = point
        self.nth = nth
        self.calls = 0
        self.fired = 0

    def hit(self, point: str) -> None:
        if point == self.point:
            self.calls += 1
            if self.calls >= self.nth and not self.fired:
                self.fired += 1
                raise RuntimeError(f"injected fault at {point}")

    def runtime(self) -> Any:
        from types import SimpleNamespace

        rt, f = self.rt, self
        real_pg = rt.dist.ProcessGroupNCCL
        real_event = rt.cuda.Event
        real_full = rt.torch.full
        real_stream = rt.cuda.Stream
        real_prefix = rt.dist.PrefixStore

        class Store:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __getattr__(self, name: str) -> Any:
                fn = getattr(self.inner, name)

                def call(*args: Any, **kwargs: Any) -> Any:
                    f.hit(f"store.{name}")
                    return fn(*args, **kwargs)
                return call

        class Work:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def is_completed(self) -> bool:
                f.hit("is_completed")
                return bool(self.inner.is_completed())

            def block_current_stream(self) -> None:
                f.hit("block_current_stream")
                self.inner.block_current_stream()

        class PG:
            Options = real_pg.Options

            def __init__(self, *args: Any) -> None:
                f.hit("ProcessGroupNCCL")
                self.inner = real_pg(*args)

            def send(self, *args: Any) -> Any:
                f.hit("send")
                return Work(self.inner.send(*args))

            def recv(self, *args: Any) -> Any:
                f.hit("recv")
                return Work(self.inner.recv(*args))

            def shutdown(self) -> None:
                f.hit("shutdown")
                self.inner.shutdown()

            def abort(self) -> None:
                f.hit("abort")
                self.inner.abort()

        class Event:
            def __init__(self, **kwargs: Any) -> None:
                self.inner = real_event(**kwargs)

            def record(self, stream: Any = None) -> None:
                f.hit("Event.record")
                self.inner.record(stream)

            def query(self) -> bool:
                return bool(self.inner.query())

            def elapsed_time(self, end: Any) -> float:
                f.hit("elapsed_time")
                return float(self.inner.elapsed_time(end.inner))

        def full(*args: Any, **kwargs: Any) -> Any:
            f.hit("alloc")
            return real_full(*args, **kwargs)

        def stream(*args: Any, **kwargs: Any) -> Any:
            f.hit("Stream")
            return real_stream(*args, **kwargs)

        def prefix_store(prefix: str, inner: Any) -> Store:
            return Store(real_prefix(prefix, inner.inner if isinstance(inner, Store)
                                     else inner))

        dist = SimpleNamespace(**{k: getattr(rt.dist, k) for k in (
            "is_available", "is_initialized", "get_backend", "get_global_rank", "group",
            "distributed_c10d")})
        dist.ProcessGroupNCCL, dist.PrefixStore = PG, prefix_store
        cuda = SimpleNamespace(**{k: getattr(rt.cuda, k) for k in (
            "is_available", "device", "stream", "current_device", "current_stream")})
        cuda.Event, cuda.Stream = Event, stream
        torch_ = SimpleNamespace(full=full, uint8=rt.torch.uint8, device=rt.torch.device)
        return SimpleNamespace(torch=torch_, dist=dist, cuda=cuda)


@pytest.mark.parametrize(("point", "nth"), FAULTS)
def test_a_fault_at_any_step_of_the_probe_never_reaches_the_job(point, nth):
    """An exception at each call the probe makes into torch (rank 0's): the probe
    returns, answers exactly once on each rank, leaves its training thread on the device
    and stream it found, and nothing posted, alive or on the job's group — rank 1, whose
    peer failed, included, within its timeout."""
    job = FakeLinkJob(2, bandwidth_Bps=4e9)
    faulty = Faulty(job, point, nth)
    ps = probes(job, [0, 1], MiB, timeout_s=0.5, runtimes={0: faulty.runtime()})
    out = run(ps)
    assert faulty.fired == 1, f"the fault at {point} was never injected"
    for r in (0, 1):
        o = out[r]
        assert o["raised"] is None and o["finished"], o
        assert len(o["answers"]) == 1, o
        assert o["device_after"] == 0 and o["stream_after"] is job.gpus[r].default[0]
        assert o["seconds"] < 4.0, o
    answer = out[0]["answers"][0]
    if point == "store.add":  # a store error while waiting: withdrawn, or went on
        assert "links" in answer or "injected fault" in answer["error"], answer
    elif point != "shutdown":  # a failed shutdown is logged, the group aborted instead
        assert "injected fault" in answer["error"], answer
    nothing_left(job)
    assert len(linkprobe._ABANDONED) <= linkprobe._ABANDONED.maxlen  # bounded
