"""slow_link on a real two-"node" network: two network namespaces joined by a veth pair,
one rank in each, the link throttled with tbf in the middle of the run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectors.schema import STEP_FIELDS
from collectors.wire import WireError
from rtop.analysis import AnalysisConfig
from rtop.report import build_report
from rtop.run.recording import read
from rtop.workload import WorkloadSpec

NS = ("rtop-node-a", "rtop-node-b")
DEV = ("rtva", "rtvb")
IP = ("10.77.0.1", "10.77.0.2")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def teardown() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def two_nodes():
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("needs root, ip and tc to build network namespaces")
    teardown()
    try:
        for ns in NS:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", DEV[0], "type", "veth", "peer", "name", DEV[1])
        for ns, dev, ip in zip(NS, DEV, IP, strict=True):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
    except subprocess.CalledProcessError as exc:
        teardown()
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    yield
    teardown()


def training_seconds(record: Path) -> dict[int, float]:
    """Per rank, seconds from its first to its last recorded step (the hub's recording,
    read up to its last whole frame while it is being written)."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    t_index = STEP_FIELDS.index("t_wall")
    with contextlib.suppress(OSError, WireError):
        for _, frame in read(record):
            if frame.kind != "batch":
                continue
            rank = frame.payload["rank"]
            for row in frame.payload.get("steps") or []:
                first.setdefault(rank, row[t_index])
                last[rank] = row[t_index]
    return {r: last[r] - first[r] for r in first}


def wait_for_training(record: Path, ranks: int, seconds: float, timeout: float) -> bool:
    """Wait until every one of ``ranks`` ranks has trained ``seconds`` (see above)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = training_seconds(record)
        if len(done) == ranks and min(done.values()) >= seconds:
            return True
        time.sleep(0.5)
    return False


def in_ns(ns: str, *cmd: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, **kw)


def test_throttled_inter_node_link_is_a_slow_link(two_nodes, tmp_path):
    thresholds = tmp_path / "thresholds.json"
    # the veth link carries this job's 1.3 MB allreduce at a few hundred MB/s; call
    # anything under half of 100 MB/s slow
    thresholds.write_text(json.dumps({"fabric_busbw": {"ethernet": 100e6}}))
    record, disc = tmp_path / "run.rtop", tmp_path / "hub.json"
    hub = in_ns(NS[0], sys.executable, "-m", "rtop", "serve", "--host", IP[0], "--port", "7790",
                "--token", "slow-link-test-Kq8vT2mX9zLp4wRc", "--record", str(record),
                "--discovery-file", str(disc), "--thresholds", str(thresholds),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not disc.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert disc.exists(), "the hub did not start in its namespace"
        # compute well above the unthrottled allreduce: the healthy part is efficient
        spec = WorkloadSpec(world_size=2, duration_s=24.0, batch=768, dim=128, hidden=512,
                            layers=2, hub=f"{IP[0]}:7790", token="slow-link-test-Kq8vT2mX9zLp4wRc")
        out = tmp_path / "out"
        out.mkdir()
        ranks = []
        for rank, (ns, dev) in enumerate(zip(NS, DEV, strict=True)):
            env = {**os.environ, "RTOP_NODE": f"node-{'ab'[rank]}", "GLOO_SOCKET_IFNAME": dev,
                   "RTOP_AUTOHUB": "0"}
            ranks.append(in_ns(ns, sys.executable, "-m", "rtop.workload", "--rank", str(rank),
                               "--master", f"{IP[0]}:29611", "--spec", spec.to_json(),
                               "--out", str(out), env=env))
        # spawn, rendezvous, warm-up, then ~8 s of healthy training before the throttle
        assert wait_for_training(record, ranks=2, seconds=8.0, timeout=90.0), \
            f"the ranks did not train 8 s within 90 s: {training_seconds(record)}"
        throttled_at = time.time()
        for ns, dev in zip(NS, DEV, strict=True):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", "80mbit", "burst", "32kbit", "latency", "100ms")
        for proc in ranks:
            assert proc.wait(timeout=120) == 0
    finally:
        hub.send_signal(signal.SIGINT)
        try:
            hub.wait(timeout=15)
        except subprocess.TimeoutExpired:
            hub.kill()
    report = build_report(record, AnalysisConfig.load(thresholds))
    assert sorted(r["node"] for r in report["ranks"]) == ["node-a", "node-b"]
    kinds = [(f["kind"], f["ranks"]) for f in report["findings"]]
    assert kinds == [("slow_link", [0, 1])], report["findings"]
    link = report["findings"][0]
    assert link["since"] > throttled_at, "slow_link before the link was throttled"
    assert link["since"] - throttled_at < 10.0
    ev = link["evidence"]
    assert ev["fabric"] == "ethernet" and ev["nodes"] == ["node-a", "node-b"]
    assert ev["busbw_best_Bps"] < 0.5 * ev["expected_busbw_Bps"]
    assert "scaling" in ev  # the efficiency it costs, folded in
    Path(record).unlink()
