"""The sender against real sockets: hub absent, late, refusing, stalled; exit flush."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

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


def test_hub_absent_from_start_then_appears():
    port = free_port()
    spec = WorkloadSpec(
        world_size=2, duration_s=8.0, dim=64, hidden=128, layers=2,
        hub=f"127.0.0.1:{port}", token="late-token",
        probe_settings={"backlog_frames": 2, "flush_interval_s": 0.25,
                        "backoff_max_s": 0.5},
    )
    holder: dict = {}

    def late_hub():
        time.sleep(8.0)  # spawn + imports take ~4 s: the job has trained for a while
        holder["listener"] = Listener(port=port, token="late-token")

    t = threading.Thread(target=late_hub)
    t.start()
    results = run_local(spec, timeout_s=120)
    t.join()
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
        assert probe.stats()["refusals"] >= 1
        assert probe.stats()["sent_records"] == 0
        assert probe.step_count == 100
        assert listener.refused >= 1 and not listener.records()
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
        from collectors import wire

        conn, _ = srv.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conns.append(conn)
        conn.recv(4096)  # the hello, roughly
        conn.sendall(wire.encode(wire.KIND_WELCOME, {"t_hub": time.time()}))
        # ... and never read again

    threading.Thread(target=accept, daemon=True).start()
    probe = _probe(hub=f"127.0.0.1:{port}", token="", flush_interval_s=0.05,
                   backlog_frames=4)
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


def test_loader_workers_cpu_is_sampled(listener):
    spec = WorkloadSpec(world_size=1, steps=400, batch=64, loader="torch",
                        loader_workers=2, hub=listener.address, token=listener.token,
                        probe_settings={"sample_interval_s": 0.2},
                        faults=Faults())
    run_local(spec, timeout_s=120)
    host = listener.records("host")[0]
    assert max(h["loader_procs"] for h in host) == 2
    assert all(h["rss_bytes"] > 0 and h["sys_mem_total_bytes"] > 0 for h in host)
