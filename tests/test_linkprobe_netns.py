"""The link probe on a real four-"node" network, as a user runs it: four network
namespaces on one Linux bridge, one rank of a gloo DDP job in each (``RTOP_NODE`` names
its node, ``GLOO_SOCKET_IFNAME`` its link), streaming to a hub in this process, reached
over a fifth link into the bridge; ``rtop probe --json`` asks the hub, which runs the
probe on every rank at a common step and re-measures the links it first found slow.
Unthrottled the probe names nothing; with ``tbf`` throttling one node's link it names
exactly that node, after measuring its links twice. The job trains on after each."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import auth
from rtop.client import HubClient
from rtop.hub.service import ThreadedHub
from rtop.workload import WorkloadSpec

NODES = ("a", "b", "c", "d")
NS = tuple(f"rtop-lp-{x}" for x in NODES)  # one per node (not test_slow_link's rtop-node-*)
BRIDGE_NS, BRIDGE = "rtop-lp-br", "rlpbr"
DEV = tuple(f"rlp{x}" for x in NODES)  # each node's end of its veth pair
PORT_DEV = tuple(f"rlp{x}-br" for x in NODES)  # the bridge's end
IP = tuple(f"10.78.0.{k + 1}" for k in range(len(NODES)))
#: this process's own link into the bridge: where the hub listens
HUB_DEV, HUB_PORT_DEV, HUB_IP = "rlphub", "rlphub-br", "10.78.0.250"
MASTER = "netns-probe-master-token-0123456789"
ROOT = Path(__file__).resolve().parent.parent


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def teardown() -> None:
    for ns in (*NS, BRIDGE_NS):  # deleting a namespace deletes its ends of the veths
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", HUB_DEV], capture_output=True)  # if left alone


@contextlib.contextmanager
def network() -> Iterator[None]:
    """The four nodes, the bridge and the hub's link, torn down on the way out (raises
    ``subprocess.CalledProcessError`` if they cannot be built)."""
    teardown()
    try:
        sh("ip", "netns", "add", BRIDGE_NS)
        sh("ip", "-n", BRIDGE_NS, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", BRIDGE_NS, "link", "set", BRIDGE, "up")
        for ns, dev, port, ip in zip(NS, DEV, PORT_DEV, IP, strict=True):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "link", "set", port, "netns", BRIDGE_NS)
            sh("ip", "-n", BRIDGE_NS, "link", "set", port, "master", BRIDGE)
            sh("ip", "-n", BRIDGE_NS, "link", "set", port, "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "link", "add", HUB_DEV, "type", "veth", "peer", "name", HUB_PORT_DEV)
        sh("ip", "link", "set", HUB_PORT_DEV, "netns", BRIDGE_NS)
        sh("ip", "-n", BRIDGE_NS, "link", "set", HUB_PORT_DEV, "master", BRIDGE)
        sh("ip", "-n", BRIDGE_NS, "link", "set", HUB_PORT_DEV, "up")
        sh("ip", "addr", "add", f"{HUB_IP}/24", "dev", HUB_DEV)
        sh("ip", "link", "set", HUB_DEV, "up")
        yield
    finally:
        teardown()


@pytest.fixture(scope="module")
def four_nodes() -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.skip("needs root to build network namespaces")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            pytest.skip(f"needs the {tool!r} command (iproute2) to build the network")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(network())
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot build network namespaces here: {exc.stderr.strip()}")
        yield


def throttle(node: int, on: bool) -> None:
    """``tbf`` on both ends of a node's link: what it sends and what it is sent."""
    for ns, dev in ((NS[node], DEV[node]), (BRIDGE_NS, PORT_DEV[node])):
        if on:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", "80mbit", "burst", "64kb", "latency", "100ms")
        else:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev,
                            "root"], capture_output=True)


class Job:
    """The hub (in this process, on the bridge) and the 4-rank job, one rank per
    namespace, training until :meth:`close`."""

    def __init__(self, tmp: Path) -> None:
        self.hub = ThreadedHub(host=HUB_IP, port=0, record=str(tmp / "run.rtop"),
                               token=MASTER).start()
        self.stop_file = tmp / "stop"
        spec = WorkloadSpec(world_size=len(NS), duration_s=300.0, hub=self.hub.address,
                            token=auth.role_token(MASTER, "ingest"), dim=64, hidden=128,
                            stop_file=str(self.stop_file))
        out = tmp / "out"
        out.mkdir()
        self.ranks = []
        for rank, (ns, dev) in enumerate(zip(NS, DEV, strict=True)):
            env = {**os.environ, "RTOP_NODE": f"node-{NODES[rank]}",
                   "GLOO_SOCKET_IFNAME": dev, "RTOP_AUTOHUB": "0", "PYTHONPATH": str(ROOT),
                   "OMP_NUM_THREADS": "1"}
            self.ranks.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "rtop.workload", "--rank",
                 str(rank), "--master", f"{IP[0]}:29631", "--spec", spec.to_json(),
                 "--out", str(out)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, text=True))

    def steps(self) -> list[int]:
        with HubClient(self.hub.address, MASTER) as c:
            return [int(s) for s in c.snapshot()["ranks"]["step"]]

    def training(self, beyond: int, timeout: float) -> bool:
        """Every rank has reported a step beyond ``beyond`` within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = self.steps()
            if len(steps) == len(NS) and min(steps) > beyond:
                return True
            assert all(p.poll() is None for p in self.ranks), self.errors()
            time.sleep(0.5)
        return False

    def probe(self) -> dict[str, Any]:
        """``rtop probe --json`` against the hub: its result."""
        out: dict[str, Any] = json.loads(self.rtop_probe("--json").stdout)
        return out

    def rtop_probe(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``rtop probe`` against the hub, 1 MiB a transfer (what it prints)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT),
               "RTOP_TOKEN": auth.role_token(MASTER, "control")}
        done = subprocess.run([sys.executable, "-m", "rtop.cli", "probe", self.hub.address,
                               "--bytes", str(1 << 20), *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, (done.returncode, done.stderr[-3000:], self.errors())
        return done

    def errors(self) -> str:
        return "\n".join(f"rank {r}: exit {p.poll()}" for r, p in enumerate(self.ranks))

    def close(self) -> list[str]:
        """Stop the job (the stop file) and the hub; what each rank wrote to stderr if it
        did not exit 0."""
        self.stop_file.touch()
        failed = []
        for r, p in enumerate(self.ranks):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
            err = p.stderr.read() if p.stderr else ""
            if p.wait() != 0:
                failed.append(f"rank {r} exited {p.returncode}: {err[-2000:]}")
        self.hub.stop()
        return failed


@pytest.fixture(scope="module")
def job(four_nodes: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    j = Job(tmp_path_factory.mktemp("netns-probe"))
    try:
        assert j.training(beyond=5, timeout=120), f"the job never trained: {j.errors()}"
        yield j
    finally:
        failed = j.close()
    assert not failed, failed


def test_unthrottled_the_probe_names_nothing(job: Job) -> None:
    result = job.probe()
    m = result["matrix_Bps"]
    assert result["nodes"] == [f"node-{x}" for x in NODES]
    assert all(m[i][j] is not None and m[i][j] > 0 for i in range(4) for j in range(4)
               if i != j), m
    assert result["findings"] == [], (result["findings"], m, result.get("recheck"))
    # a link measured slow once (a busy core) was measured again, and healthy then
    assert result.get("recheck", {"confirmed": 0})["confirmed"] == 0, result["recheck"]
    step = max(job.steps())
    assert job.training(beyond=step + 5, timeout=30), "the job stopped after the probe"


def test_a_throttled_node_is_the_slow_link(job: Job) -> None:
    throttle(2, True)
    try:
        result = job.probe()
    finally:
        throttle(2, False)
    m = result["matrix_Bps"]
    through_c = [m[2][j] for j in (0, 1, 3)]
    others = [m[i][j] for i, j in ((0, 1), (0, 3), (1, 3))]
    # tbf holds node-c's links to 80 Mbit/s (10 MB/s), far below what the bridge gives
    assert max(through_c) < 0.5 * min(others), m
    assert max(through_c) < 11e6, m
    # named only after its links were measured twice, slow both times
    recheck = result["recheck"]
    assert recheck["error"] is None and recheck["confirmed"] == 3, recheck
    assert sorted(map(tuple, recheck["links"])) == [(0, 2), (1, 2), (2, 3)]
    assert len(result["findings"]) == 1, result["findings"]
    f = result["findings"][0]
    assert f["kind"] == "slow_link" and f["ranks"] == [2], f
    assert f["evidence"]["nodes"] == ["node-c"], f
    assert sorted(tuple(x[:2]) for x in f["evidence"]["links"]) == [(0, 2), (1, 2), (2, 3)]
    step = max(job.steps())
    assert job.training(beyond=step + 5, timeout=30), "the job stopped after the probe"
