"""The sender against real sockets: hub absent, late, refusing, stalled; exit flush."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import collectors
from collectors.identity import detect
from rtop.workload import Faults, WorkloadSpec, free_port, run_local
from tests.listener import Listener


def _probe(**settings) -> collectors.Probe:
    cfg = collectors.ProbeConfig.from_env(**settings)
    return collectors.Probe(detect(), cfg)


def _train(probe: collectors.Probe, steps: int, step_s: float = 0.005) -> None:
    for _ in probe.iter(range(steps)):
        with probe.step():
            time.sleep(step_s)


#: How long the job trains with its hub absent before the hub appears: connect attempts
#: fail (backoff up to 0.5 s) and the 2-frame backlog overflows (a frame per 0.25 s).
ABSENT_WHILE_TRAINING_S = 3.0


@pytest.mark.job
def test_hub_absent_from_start_then_appears(tmp_path):
    port = free_port()
    spec = WorkloadSpec(
        world_size=2, duration_s=8.0, dim=64, hidden=128, layers=2,
        hub=f"127.0.0.1:{port}", token="late-token",
        probe_settings={"backlog_frames": 2, "flush_interval_s": 0.25,
                        "backoff_max_s": 0.5},
        fault_mark_dir=str(tmp_path),  # each rank writes its wall time at its first step
    )
    holder: dict = {}
    job_over = threading.Event()

    def late_hub():
        # wait for the ranks (spawn + imports take seconds) to start training ...
        marks = [tmp_path / f"fault-rank{rank}" for rank in (0, 1)]
        deadline = time.monotonic() + 90
        while not all(m.exists() for m in marks):
            if job_over.is_set() or time.monotonic() > deadline:
                holder["error"] = "the ranks never started training (no step-0 marks)"
                return
            time.sleep(0.02)
        started = max(float(m.read_text()) for m in marks)
        # ... and to train for a while with no hub, then appear
        while time.time() < started + ABSENT_WHILE_TRAINING_S:
            time.sleep(0.02)
        holder["listener"] = Listener(port=port, token="late-token")

    t = threading.Thread(target=late_hub, daemon=True)
    t.start()
    try:
        results = run_local(spec, timeout_s=120)
    finally:
        job_over.set()
        t.join(100)
    assert "listener" in holder, holder.get("error", "the late hub never started")
    listener = holder["listener"]
    try:
        steps = listener.records("steps")
        for rank in (0, 1):
            stats = results[rank]["stats"]
            assert stats["connect_failures"] >= 1, stats
            assert stats["connects"] >= 1, stats
            assert stats["dropped_unsent"] > 0, "records made while the hub was away"
            rows = steps[rank]
            assert rows, f"rank {rank}: no frames once the hub appeared"
            # the backlog was 2 frames: the first steps were dropped, the last arrived
            seen = [r["step"] for r in rows]
            assert seen[0] > 0
            assert seen[-1] == len(results[rank]["times"]) - 1
            assert seen == list(range(seen[0], seen[-1] + 1)), "a gap after reconnecting"
            received = sum(
                sum(len(b.get(k, [])) for k in ("steps", "gpu", "host", "mem", "hb", "events"))
                for b in listener.batches() if b["rank"] == rank)
            assert received == stats["sent_records"]
            # the hub is told how much was lost
            assert max(b["dropped"] for b in listener.batches() if b["rank"] == rank) > 0
    finally:
        listener.close()


def test_wrong_token_is_refused_and_training_goes_on():
    listener = Listener(token="right")
    try:
        probe = _probe(hub=listener.address, token="wrong", flush_interval_s=0.1)
        _train(probe, 100)
        probe.close(0.5)
        # the proofs cannot match: the hub refuses the rank's proof (the peer proves
        # first), and the rank sends it nothing more
        assert probe.stats()["refusals"] >= 1
        assert probe.stats()["sent_records"] == 0
        assert probe.step_count == 100
        assert not listener.hellos and not listener.frames and not listener.records()
    finally:
        listener.close()


def test_close_is_bounded_with_an_unroutable_hub():
    probe = _probe(hub="10.255.255.1:9", connect_timeout_s=1.0, flush_interval_s=0.1)
    _train(probe, 20)
    t0 = time.monotonic()
    probe.close(timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    assert probe.stats()["sent_records"] == 0


def test_stalled_hub_costs_frames_not_training():
    """A hub that welcomes the rank and then never reads: frames pile up, then drop."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    conns = []

    def accept():
        from collectors import auth, wire

        conn, _ = srv.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conns.append(conn)
        dec = wire.FrameDecoder()
        [hello] = dec.feed(conn.recv(4096))
        key, nonce = auth.key_for("stall-token", "ingest"), auth.new_nonce()
        conn.sendall(wire.encode(wire.KIND_CHALLENGE, {"nonce": nonce}))
        conn.recv(4096)  # the rank's proof, roughly
        conn.sendall(wire.encode(wire.KIND_WELCOME, {"t_hub": time.time(), "proof":
                                 auth.hub_proof(key, "rank", hello.payload["nonce"], nonce)}))
        # ... and never read again

    threading.Thread(target=accept, daemon=True).start()
    # spool off: this is about the bound while the job runs and at close; what a spool
    # keeps of a stalled hub's backlog is tests/test_spool.py's
    probe = _probe(hub=f"127.0.0.1:{port}", token="stall-token", flush_interval_s=0.05,
                   backlog_frames=4, spool=False)
    # ~25 MB of step records in a few seconds: more than the kernel's socket buffers
    for i in probe.iter(range(200_000)):
        with probe.step():
            pass
        if i % 500 == 0:
            time.sleep(0.002)
    t0 = time.monotonic()
    probe.close(timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    stats = probe.stats()
    assert stats["connects"] == 1
    assert stats["dropped_unsent"] > 0
    assert probe.step_count == 200_000
    srv.close()


EXIT_SCRIPT = """
import collectors, time
probe = collectors.start(flush_interval_s=30)   # only the exit flush can send
for _ in probe.iter(range(40)):
    with probe.step():
        time.sleep(0.001)
# no probe.close(): the interpreter's exit must flush
"""


@pytest.mark.job
def test_interpreter_exit_flushes(listener):
    env = {"RTOP_HUB": listener.address, "RTOP_TOKEN": listener.token, "PATH": "/usr/bin"}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT)], env=env,
                   check=True, timeout=60)
    assert time.monotonic() - t0 < 30
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(listener.records().get(0, [])) < 40:
        time.sleep(0.05)
    assert [r["step"] for r in listener.records()[0]] == list(range(40))
    assert any(f.kind == "bye" for _, f in listener.frames)


def test_stack_of_a_long_phase_is_sent(listener):
    probe = _probe(hub=listener.address, token=listener.token, flush_interval_s=0.1,
                   sample_interval_s=0.1, stack_after_s=0.4)

    def slow_function_in_training_loop():
        time.sleep(1.2)

    for _ in probe.iter(range(2)):
        with probe.step():
            slow_function_in_training_loop()
    probe.close(1.0)
    beats = listener.records("hb")[0]
    stacks = [b for b in beats if b["stack"]]
    assert stacks, "no stack sent for a 1.2 s phase with stack_after_s=0.4"
    assert all(b["phase"] == "compute" and b["phase_s"] >= 0.4 for b in stacks)
    assert "slow_function_in_training_loop" in stacks[0]["stack"]
    assert not any(b["stack"] for b in beats if b["phase_s"] < 0.4)


def test_checkpoint_cost_is_an_event(listener):
    probe = _probe(hub=listener.address, token=listener.token, flush_interval_s=0.1)
    for i in probe.iter(range(5)):
        with probe.step():
            pass
        if i == 2:
            with probe.checkpoint():
                time.sleep(0.3)
    probe.close(1.0)
    events = listener.records("events")[0]
    assert len(events) == 1
    assert events[0]["kind"] == "checkpoint" and events[0]["step"] == 2
    assert 0.28 <= events[0]["duration_s"] < 0.6
    # the checkpoint shows as the gap before the next iteration
    steps = {r["step"]: r for r in listener.records()[0]}
    assert steps[3]["gap_s"] >= 0.28


@pytest.mark.job
def test_loader_workers_cpu_is_sampled(listener):
    spec = WorkloadSpec(world_size=1, steps=400, batch=64, loader="torch",
                        loader_workers=2, hub=listener.address, token=listener.token,
                        probe_settings={"sample_interval_s": 0.2},
                        faults=Faults())
    run_local(spec, timeout_s=120)
    host = listener.records("host")[0]
    assert max(h["loader_procs"] for h in host) == 2
    assert all(h["rss_bytes"] > 0 and h["sys_mem_total_bytes"] > 0 for h in host)


def test_unreachable_hub_bounds_unsent_bytes_while_training():
    """max_unsent_bytes drops the oldest frames while the hub is away (backlog_frames
    alone would keep them all until close)."""
    probe = _probe(hub=f"127.0.0.1:{free_port()}", flush_interval_s=0.05,
                   backlog_frames=100_000, max_unsent_bytes=20_000)
    try:
        deadline = time.monotonic() + 30
        while probe.stats()["dropped_unsent"] == 0:
            assert time.monotonic() < deadline, "nothing dropped beyond max_unsent_bytes"
            _train(probe, 500, step_s=0)
        assert probe.stats()["connect_failures"] >= 1
        assert probe.stats()["sent_records"] == 0
    finally:
        probe.close(0.2)


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0
        self.closed = False

    def sample(self, t_wall: float) -> list:
        self.calls += 1
        raise RuntimeError("a sampler's bug")

    def close(self) -> None:
        self.closed = True


def test_a_failing_sampler_is_logged_once_and_skipped(listener, caplog):
    cfg = collectors.ProbeConfig.from_env(hub=listener.address, token=listener.token,
                                          flush_interval_s=0.05, sample_interval_s=0.05)
    probe = collectors.Probe(detect(), cfg, start_sender=False)
    broken = _Broken()
    probe.sender.samplers.insert(0, broken)
    probe.sender.start()
    with caplog.at_level("WARNING", logger="collectors"):
        deadline = time.monotonic() + 20
        while broken.calls < 5 or len(listener.records("hb").get(0, [])) < 5:
            assert time.monotonic() < deadline, "the sender stopped sampling"
            _train(probe, 5)
        probe.close(1.0)
    assert probe.sender.is_alive() is False and broken.closed
    failures = [r for r in caplog.records if "broken sampling failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]
    # the samplers after it ran every time: heartbeats and memory kept coming
    assert len(listener.records("mem")[0]) >= 5
    assert listener.records("steps")[0], "steps stopped flowing"


def test_flush_interval_follows_world_size(monkeypatch):
    """Unless told, a rank sends every 0.5 s, and every 1 s in a world of 1,024 ranks or
    more (a hub's cost is mostly per frame); RTOP_FLUSH_S or the setting win."""
    from collectors.config import LARGE_WORLD, ProbeConfig

    monkeypatch.delenv("RTOP_FLUSH_S", raising=False)
    cfg = ProbeConfig.from_env()
    assert cfg.flush_every(8) == 0.5 and cfg.flush_every(LARGE_WORLD - 1) == 0.5
    assert cfg.flush_every(LARGE_WORLD) == 1.0 and cfg.flush_every(16384) == 1.0
    assert ProbeConfig.from_env(flush_interval_s=0.2).flush_every(16384) == 0.2
    monkeypatch.setenv("RTOP_FLUSH_S", "0.3")
    assert ProbeConfig.from_env().flush_every(16384) == 0.3
    monkeypatch.setenv("RTOP_FLUSH_S", "-1")  # not a positive number: ignored
    assert ProbeConfig.from_env().flush_every(16384) == 1.0


@pytest.mark.parametrize("world, most", [(2, 9), (2048, 5)])
def test_big_world_sends_fewer_frames(monkeypatch, listener, world, most):
    """A rank of a big world sends about one batch a second, not two (real sockets)."""
    import dataclasses

    monkeypatch.delenv("RTOP_FLUSH_S", raising=False)
    monkeypatch.setenv("RTOP_RELAY", "0")  # to the listener itself, not a node's relay
    ident = dataclasses.replace(detect(), rank=0, local_rank=0, world_size=world)
    probe = collectors.Probe(ident, collectors.ProbeConfig.from_env(
        hub=listener.address, token=listener.token))
    t0 = time.monotonic()
    for _ in probe.iter(range(1000)):
        with probe.step():
            time.sleep(0.01)
        if time.monotonic() - t0 > 3.6:
            break
    n_before_close = sum(1 for _, f in listener.frames if f.kind == "batch")
    probe.close(1.0)
    # 3.6 s of training: 7 sends every 0.5 s, 3 every 1 s (+1 for the first, early one)
    assert (6 if world < 1024 else 2) <= n_before_close <= most, n_before_close
    assert len(listener.records()[0]) >= 100  # every step still arrives
