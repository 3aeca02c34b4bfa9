"""The records no hub took at a rank's end are spooled, taken in later, and reported.

A real 2-rank DDP job on gloo streams to a real hub (``rtop serve``, its own process);
the hub is SIGKILLed mid-run, the job trains thousands of steps more and ends with no
hub anywhere: each rank writes its unsent records to a spool file (0600, bounded) in
the runtime directory. A new hub started afterwards takes the spools in and records
them; ``rtop report`` on the first recording merges them: every step of every rank is
there exactly once. Then the spool's own bound (the oldest left out, counted, shown),
and damaged spools (a clear warning, nothing else lost).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors import auth, wire
from rtop.client import HubClient
from rtop.hub.service import ThreadedHub
from rtop.run.recording import read
from rtop.run.spool import read_header, read_spool, recorded_ranks, spool_key
from tests import reliability
from tests.spool_worker import train

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "spool-test-token-0123456789abcdef"
N_BEFORE, N_AFTER = 200, 3000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private runtime directory for this test's ranks and hubs (``$XDG_RUNTIME_DIR``)."""
    xdg = tmp_path / "xdg"  # (conftest makes it for every test; this one says so)
    xdg.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.setenv("RTOP_AUTOHUB", "0")
    return xdg / "rtop"


def _steps(paths: list[Path]) -> Counter[tuple[int, int]]:
    """``(rank, step)`` of every step record in these recordings, counted."""
    seen: Counter[tuple[int, int]] = Counter()
    for path in paths:
        for _, frame in read(path):
            if frame.kind == wire.KIND_BATCH:
                for row in frame.payload.get("steps") or []:
                    seen[(frame.payload["rank"], row[0])] += 1
    return seen


def _report(path: Path, *args: str, json_out: bool = True) -> Any:
    out = subprocess.run([sys.executable, "-m", "rtop", "report", str(path), *args,
                          *(["--json"] if json_out else [])], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout) if json_out else out.stdout


def _take_in(runtime: Path, record: Path, expect: int) -> dict[str, int]:
    """Start a new hub on the same runtime directory, told to take every spool (``rtop
    serve --take-spools``); wait until it has taken in ``expect`` spools; stop it; its
    counters, checked to be in its snapshot and its ``/metrics`` as viewers and
    Prometheus get them."""
    hub = ThreadedHub(record=str(record), spool_scan_s=0.2, spool_take_all=True).start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = list(runtime.glob("spool-*.ingested")) + list(runtime.glob("spool-*.bad"))
            if len(done) >= expect:
                break
            time.sleep(0.1)
        counters = dict(hub.hub.spools.counters) if hub.hub and hub.hub.spools else {}
        view = auth.role_token(hub.token, "view")
        with HubClient(hub.address, view) as client:
            shown = client.snapshot()["hub"]["counters"]
        req = urllib.request.Request(f"http://{hub.address}/metrics",
                                     headers={"Authorization": f"Bearer {view}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        hub.stop()
    assert {k: shown.get(k) for k in counters} == counters
    exported = {s.name: s.value for fam in text_string_to_metric_families(metrics)
                for s in fam.samples}
    assert {k: exported.get(f"rtop_hub_{k}_total") for k in counters} == counters
    return counters


def _serve(record: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "rtop", "serve", "--port", "0",
                             "--token", TOKEN, "--record", str(record)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=os.environ.copy())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("rtop hub "), line
    return proc, line.split()[2]


@pytest.mark.timeout(600)
def test_job_that_ends_without_its_hub_loses_no_step(runtime: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.multiprocessing as mp

    limit = 4 * 1024 * 1024
    monkeypatch.setenv("RTOP_SPOOL_MAX_BYTES", str(limit))
    first = tmp_path / "run.rtop"
    hub, address = _serve(first)
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    job = mp.spawn(train, args=(2, _free_port(), address, TOKEN, N_BEFORE, N_AFTER, go, out),
                   nprocs=2, join=False, start_method="spawn")
    try:
        assert {out.get(timeout=180)[1] for _ in range(2)} == {0, 1}
        # every step so far is in the recording (the hub flushes it every second) ...
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(_steps([first])[(r, N_BEFORE - 1)] for r in (0, 1)):
                break
            time.sleep(0.2)
        # ... when the hub dies; the ranks train on and end with no hub anywhere
        hub.send_signal(signal.SIGKILL)
        hub.wait(30)
        go.set()
        done = {}
        for _ in range(2):
            msg = out.get(timeout=300)
            done[msg[1]] = msg
        while not job.join(timeout=60):
            pass
    finally:
        if hub.poll() is None:
            hub.kill()
        for p in job.processes:
            if p.is_alive():
                p.kill()

    spools = sorted(runtime.glob("spool-*.rtop"))
    assert len(spools) == 2, spools
    for path in spools:
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size <= limit
        assert "-a0-p" in path.name and ("-r0-" in path.name or "-r1-" in path.name)
    spooled = {r: m[2]["spooled_records"] for r, m in done.items()}
    write_s = [m[3]["seconds"] for m in done.values()]
    close_s = [m[4] for m in done.values()]
    for _, _, stats, spool, _ in done.values():
        assert spool["error"] is None and spool["dropped_records"] == 0
        assert stats["spool_dropped"] == 0
        assert spool["records"] == stats["spooled_records"] >= N_AFTER
    assert max(write_s) < 1.0  # the spool's time bound (spool_timeout_s)
    assert max(close_s) < 1.0 + 0.5 + 1.0  # close_timeout_s, join slack, spool time

    # a hub restarted on the first recording would know them as its ranks' (by process)
    keys = {spool_key(read_header(p) or {}) for p in spools}
    assert None not in keys and keys <= recorded_ranks(first)

    # a new hub on the same runtime directory takes the spools in and records them
    second = tmp_path / "after.rtop"
    counters = _take_in(runtime, second, expect=2)
    assert counters["spools"] == 2 and counters["spool_records"] == sum(spooled.values())
    assert not list(runtime.glob("spool-*.rtop"))  # taken: none waits any more

    # every step of every rank exactly once, across the two recordings
    seen = _steps([first, second])
    for rank in (0, 1):
        got = sorted(s for (r, s) in seen if r == rank)
        assert got == list(range(N_BEFORE + N_AFTER)), (rank, len(got))
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1][:5]

    # the first recording's report merges the spools (found by its ranks' processes)
    rep = _report(first)
    assert [r["steps"] for r in rep["ranks"]] == [N_BEFORE + N_AFTER] * 2
    assert rep["run"]["spooled_records"] == sum(spooled.values())
    assert {s["source"] for s in rep["run"]["spools"]} == {"merged"}
    assert [r["spooled_records"] for r in rep["ranks"]] == [spooled[0], spooled[1]]
    text = _report(first, json_out=False)
    assert f"spooled: {sum(spooled.values())} records came from 2 spool files" in text
    # the second hub's recording holds them, and its report says so (and does not
    # merge them again)
    rep2 = _report(second)
    assert [r["steps"] for r in rep2["ranks"]] == [N_AFTER] * 2
    assert rep2["run"]["spooled_records"] == sum(spooled.values())
    assert {s["source"] for s in rep2["run"]["spools"]} == {"recording", "already recorded"}

    reliability.record(
        fault="hub SIGKILLed mid-run; the 2-rank job trains 3,000 more steps and ends "
              "with no hub; a new hub starts afterwards",
        outcome="unsent records spooled (0600, bounded) at close, taken in by the new "
                "hub, merged by rtop report: every step of both ranks once",
        lost=0, spooled_records=sum(spooled.values()),
        spool_write_s=round(max(write_s), 4), close_s=round(max(close_s), 3))


def _frame_starts(data: bytes) -> list[int]:
    """Where each frame of a spool starts (header, hello, batches..., bye, end)."""
    starts, off = [], 0
    while off < len(data):
        starts.append(off)
        off += wire.HEADER_BYTES + int.from_bytes(data[off + 3:off + 7], "big")
    return starts


def _plain_rank(rank: int, world: int, steps: int, env: dict[str, str] | None = None) -> None:
    """A plain process that takes ``steps`` steps with no hub reachable and exits."""
    e = os.environ.copy()
    e.update({"RTOP_HUB": f"127.0.0.1:{_free_port()}", "RTOP_TOKEN": TOKEN,
              "RTOP_JOB": "spooltest", **(env or {})})
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "spool_worker.py"),
                          str(rank), str(world), str(steps)], cwd=ROOT, env=e,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "spooled to" in out.stderr, out.stderr


@pytest.mark.timeout(300)
def test_spool_bound_drops_the_oldest_and_counts_them(runtime: Path, tmp_path: Path) -> None:
    limit = 16 * 1024 + 60_000  # room for about two batches past the header's share
    _plain_rank(0, 1, 4000, {"RTOP_SPOOL_MAX_BYTES": str(limit)})
    (path,) = runtime.glob("spool-*.rtop")
    assert path.stat().st_size <= limit
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    spool = read_spool(path)
    assert spool.error is None
    steps = [row[0] for _, f in spool.frames if f.kind == wire.KIND_BATCH
             for row in f.payload.get("steps") or []]
    assert steps and steps[-1] == 3999  # the newest kept ...
    assert steps == list(range(steps[0], 4000)) and steps[0] > 0  # ... the oldest left out
    dropped = spool.dropped_records
    assert dropped >= steps[0]  # every step left out is counted (samples too)

    # a hub that was not this rank's, nor told to take every spool, leaves it alone
    other = ThreadedHub(record=str(tmp_path / "other.rtop"), spool_scan_s=0.2).start()
    time.sleep(1.5)
    other.stop()
    assert path.exists() and other.hub is not None and other.hub.spools is not None
    assert other.hub.spools.counters["spools"] == 0

    record = tmp_path / "later.rtop"
    _take_in(runtime, record, expect=1)
    rep = _report(record)
    (rank,) = rep["ranks"]
    assert rank["steps"] == len(steps)
    assert rank["spool_dropped_records"] == dropped == rep["run"]["spool_dropped_records"]
    assert rank["dropped_records"] >= dropped  # the rank's own count says so too
    text = _report(record, json_out=False)
    assert f"spooled: {dropped} records did not fit the spools' bound" in text


@pytest.mark.timeout(300)
def test_damaged_spools_are_clear_and_lose_nothing_else(runtime: Path, tmp_path: Path
                                                        ) -> None:
    _plain_rank(0, 2, 1500)
    _plain_rank(1, 2, 1500)
    good, cut = sorted(runtime.glob("spool-*.rtop"))
    assert "-r0-" in good.name and "-r1-" in cut.name
    data = cut.read_bytes()
    starts = _frame_starts(data)
    cut.write_bytes(data[: (starts[-3] + starts[-2]) // 2])  # inside its last batch
    whole = read_spool(cut)
    assert whole.error and "truncated" in whole.error
    kept = [row[0] for _, f in whole.frames if f.kind == wire.KIND_BATCH
            for row in f.payload.get("steps") or []]
    junk = runtime / "spool-spooltest-r5-a0-p1.rtop"
    fd = os.open(junk, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"this is not a spool at all" * 10)
    os.close(fd)

    record = tmp_path / "later.rtop"
    counters = _take_in(runtime, record, expect=3)
    assert counters["spools"] == 2 and counters["spools_bad"] == 1
    assert counters["spools_damaged"] == 1
    assert (runtime / (junk.name + ".bad")).exists()
    rep = _report(record)
    steps = {r["rank"]: r["steps"] for r in rep["ranks"]}
    assert steps == {0: 1500, 1: len(kept)}  # all of the good one, the cut one's whole frames
    assert next(s for s in rep["run"]["spools"] if s.get("error"))["rank"] == 1
    text = _report(record, json_out=False)
    assert "is damaged: truncated after" in text

    # given by hand: a corrupt one (a frame's magic broken) is a warning, the rest stands
    bad = tmp_path / "corrupt.rtop"
    raw = bytearray(data)
    raw[starts[2]:starts[2] + 2] = b"XX"
    fd = os.open(bad, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, bytes(raw))
    os.close(fd)
    rep = _report(record, "--spool", str(bad), "--no-spools")
    assert any("corrupt after 2 whole frames" in w for w in rep["run"]["warnings"])
    assert {r["rank"]: r["steps"] for r in rep["ranks"]} == {0: 1500, 1: len(kept)}
    rep = _report(record, "--spool", str(runtime / (junk.name + ".bad")), "--no-spools")
    assert any("not an rtop spool" in w for w in rep["run"]["warnings"])
    assert {r["rank"]: r["steps"] for r in rep["ranks"]} == {0: 1500, 1: len(kept)}


def _batch(seq: int, steps: int, pad: int = 0) -> bytes:
    rows = [[seq * steps + i, 0.0] for i in range(steps)]
    return wire.encode(wire.KIND_BATCH, {"rank": 0, "seq": seq, "steps": rows, "pad": "x" * pad})


def test_finish_with_no_hub_spools_exactly_what_was_unsent(runtime: Path) -> None:
    from collectors.config import ProbeConfig
    from collectors.connection import HubConnection
    from collectors.identity import detect

    cfg = ProbeConfig(hub=f"127.0.0.1:{_free_port()}", token=TOKEN)
    conn = HubConnection(cfg, detect(rank=0, world_size=1))
    frames = [_batch(seq, 5) for seq in range(3)]
    for frame in frames:
        conn.send(frame, 5)
    conn.finish(time.monotonic() + 0.3, lambda: {"rank": 0, "reason": "closed", "dropped": 0})
    assert conn.dropped_unsent == 0 and conn.spooled_records == 15
    assert conn.spool is not None and conn.spool.path is not None
    spool = read_spool(conn.spool.path)
    assert spool.error is None
    assert [raw for raw, f in spool.frames if f.kind == wire.KIND_BATCH] == frames
    assert [f.kind for _, f in spool.frames] == ["hello", "batch", "batch", "batch", "bye"]
    assert "nonce" not in spool.frames[0][1].payload


def test_spool_write_is_bounded_in_time_and_cheap(runtime: Path) -> None:
    from collectors.config import ProbeConfig
    from collectors.connection import HubConnection
    from collectors.identity import detect

    # no time at all: nothing but the rank's hello and bye is written, all counted
    cfg = ProbeConfig(hub=f"127.0.0.1:{_free_port()}", token=TOKEN, spool_timeout_s=0.0)
    conn = HubConnection(cfg, detect(rank=0, world_size=1))
    conn.pump(time.monotonic())  # the hub is tried (and not reached) during the run
    for seq in range(3):
        conn.send(_batch(seq, 5), 5)
    time.sleep(0.01)
    conn.finish(time.monotonic(), lambda: {"rank": 0, "reason": "closed", "dropped": 0})
    assert conn.spool is not None and conn.spool.records == 0
    assert conn.dropped_unsent == conn.spool_dropped == 15
    bye = [f for _, f in read_spool(conn.spool.path).frames if f.kind == wire.KIND_BYE]
    assert bye[0].payload["dropped"] == 15
    # a full outbox (max_unsent_bytes, 8 MiB by default) costs little at close
    cfg = ProbeConfig(hub=f"127.0.0.1:{_free_port()}", token=TOKEN)
    conn = HubConnection(cfg, detect(rank=1, world_size=2))
    conn.pump(time.monotonic())
    for seq in range(200):
        conn.send(_batch(seq, 100, pad=40_000), 100)
    assert conn.unsent_bytes > 7_000_000
    t0 = time.monotonic()
    conn.finish(time.monotonic() + 0.1, dict)
    spent = time.monotonic() - t0
    assert conn.spool is not None and conn.spool.error is None
    # the outbox's own bound dropped the oldest (counted); all the rest was spooled
    assert conn.spool_dropped == 0 and conn.spooled_records > 15_000
    assert conn.spooled_records + conn.dropped_unsent == 200 * 100
    assert conn.spool.seconds < 1.0 and spent < 1.5, (conn.spool.seconds, spent)
    reliability.record(fault="8 MiB of batches unsent at close, no hub",
                       outcome="spooled within the close budget", lost=conn.dropped_unsent,
                       spool_bytes=conn.spool.bytes, spool_write_s=round(conn.spool.seconds, 4))


def test_stalled_hub_gets_whole_frames_and_the_spool_the_rest(runtime: Path) -> None:
    """A hub that stops reading mid-stream: what the sockets hold reaches it, the rest
    is spooled at the end (a frame cut mid-write whole, since the hub never applies half
    a frame): together every batch once, none twice."""
    from tests.test_connection import ScriptedHub, _conn, _pump_until

    hub = ScriptedHub()
    conn = _conn(hub.address)
    try:
        conn.pump(time.monotonic())
        hub.accept()
        assert hub.conn is not None
        expect = hub.challenge(hub.read())
        _pump_until(conn, "the hub's proof", lambda: conn.state.value == "auth")
        assert hub.read().payload["proof"] == expect
        hub.welcome()
        _pump_until(conn, "the welcome", lambda: conn.state.value == "up")
        n = 150  # 6 MB: more than the sockets take while the hub does not read
        for seq in range(n):
            conn.send(_batch(seq, 10, pad=40_000), 10)
            conn.pump(time.monotonic())
        conn.finish(time.monotonic() + 0.3, lambda: {"rank": 0, "reason": "closed"})
        conn.close()
        assert conn.dropped_unsent == 0 and conn.spool is not None
        # the hub reads on: whatever reached it whole
        got: list[int] = []
        dec = wire.FrameDecoder()
        while True:
            data = hub.conn.recv(1 << 20)
            if not data:
                break
            got += [f.payload["seq"] for f in dec.feed(data) if f.kind == wire.KIND_BATCH]
    finally:
        hub.close()
    assert conn.spool.path is not None
    spooled = [f.payload["seq"] for _, f in read_spool(conn.spool.path).frames
               if f.kind == wire.KIND_BATCH]
    assert got and spooled, (len(got), len(spooled))
    assert got + spooled == list(range(n))  # in order, each once
    assert conn.sent_records == 10 * len(got) and conn.spooled_records == 10 * len(spooled)


def test_no_hub_at_all_spools_nothing(runtime: Path) -> None:
    """With no hub configured or discovered (``RTOP_AUTOHUB=0``, no ``RTOP_HUB``), there
    is nobody to keep records for: dropped and counted, as before, no file left."""
    from collectors.config import ProbeConfig
    from collectors.connection import HubConnection
    from collectors.identity import detect

    conn = HubConnection(ProbeConfig(hub=None), detect(rank=0, world_size=1))
    conn.pump(time.monotonic())
    conn.send(_batch(0, 5), 5)
    conn.finish(time.monotonic() + 0.2, dict)
    assert conn.spool is None and conn.dropped_unsent == 5
    assert not list(runtime.glob("spool-*")) if runtime.exists() else True
