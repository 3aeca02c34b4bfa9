"""Shared fixtures: a real TCP listener for rank frames, and one local Ray cluster for
the tests that run Ray in this process (they run last, together); and the test tiers.

Every test says what it needs by its markers (declared in ``pyproject.toml``):

* ``job``: starts real training processes (torch.distributed on gloo, torchrun,
  ``rtop run`` of a training script, mp.spawn'd ranks, the HF or Lightning trainers);
* ``ray``: starts a real Ray Train job (or the in-process Ray cluster);
* ``fault``: a fault-suite test (a network cut, a killed hub, a frozen viewer, a full
  disk, an overloaded core) judged over tens of seconds;
* ``fuzz``: the fuzzers of ``tests/test_fuzz.py``;
* ``root``: network namespaces, tmpfs or loop mounts (root only);
* ``browser``: drives a headless Chromium;
* ``install``: builds a fresh virtualenv from the package registry;
* ``slow``: needs seconds of CPU in the test process itself (the simulated 256-rank
  fleets of ``test_fleet_diagnosis.py``, the 4,096-rank analysis).

A module's markers are in :data:`NEEDS` (one place, reviewed as a table), a single test's
beside it (``@pytest.mark.job``). ``make test-fast`` runs every test that needs none of
them; ``make test`` (and CI) runs everything.
"""

from __future__ import annotations

import os
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.listener import Listener


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener()
    yield lst
    lst.close()


def median(rows: list[dict[str, Any]], key: str) -> float:
    """Median of one field over rows, failing loudly if it was never measured."""
    values = [r[key] for r in rows if r[key] is not None]
    assert values, f"{key} was never measured"
    return statistics.median(values)


def _isolate(mp: pytest.MonkeyPatch, root: Any) -> None:
    """Point rtop's hub discovery, runs and runtime directory under ``root``."""
    mp.setenv("RTOP_AUTOHUB", "0")
    mp.setenv("RTOP_RUNS_DIR", str(root / "runs"))
    mp.setenv("XDG_RUNTIME_DIR", str(root / "xdg"))
    (root / "xdg").mkdir(mode=0o700, exist_ok=True)
    for name in ("RTOP_HUB", "RTOP_TOKEN"):
        mp.delenv(name, raising=False)


@pytest.fixture(scope="session", autouse=True)
def _isolated_rtop_session(tmp_path_factory) -> Iterator[None]:
    """The same isolation for module- and session-scoped fixtures, which are set up
    before any test's own: no job they start finds or leaves hubs and spools in the
    user's runtime directory."""
    with pytest.MonkeyPatch.context() as mp:
        _isolate(mp, tmp_path_factory.mktemp("rtop-session"))
        yield


@pytest.fixture(autouse=True)
def _isolated_rtop_env(tmp_path, monkeypatch):
    """No test starts a node-local hub by accident or writes outside its tmp dir."""
    _isolate(monkeypatch, tmp_path)


#: The fixture of the shared Ray cluster (its tests are ordered last).
RAY_FIXTURE = "ray_cluster"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One local Ray cluster (4 CPUs) shared by every test that uses Ray in-process:
    starting one costs 10-15 s here, so it is started once. Yields the environment its
    tasks and actors get: the suite's isolation (no node hub, runs and runtime directory
    under the session's tmp) and this checkout on ``PYTHONPATH``. A Ray Train job adds
    its own with ``RunConfig(worker_runtime_env=...)``: Ray merges the two."""
    ray = pytest.importorskip("ray")
    root = tmp_path_factory.mktemp("ray-cluster")
    (root / "xdg").mkdir(mode=0o700)
    env = {"RTOP_AUTOHUB": "0", "RTOP_RUNS_DIR": str(root / "runs"),
           "XDG_RUNTIME_DIR": str(root / "xdg"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield env
    finally:
        ray.shutdown()


#: What each module's tests need (see the module doc); tests of a module not listed need
#: none unless they are marked themselves.
NEEDS: dict[str, tuple[str, ...]] = {
    "test_collectives.py": ("job",),
    "test_commhook.py": ("job",),
    "test_ddp_collectors.py": ("job",),
    "test_demo.py": ("job", "ray"),
    "test_faults_disk.py": ("fault", "root"),
    "test_faults_network.py": ("fault", "root", "job"),
    "test_faults_overload.py": ("fault", "root", "job"),
    "test_faults_relay.py": ("fault", "job"),  # the cut link's test: root besides
    "test_faults_viewer.py": ("fault", "job"),
    "test_fleet_diagnosis.py": ("slow",),
    "test_fsdp.py": ("job",),
    "test_fuzz.py": ("fuzz",),
    "test_hf.py": ("job",),
    "test_hub_lifecycle.py": ("job",),
    "test_job_exit.py": ("job",),
    "test_lightning.py": ("job",),
    "test_linkprobe.py": ("job",),
    "test_linkprobe_netns.py": ("job", "root"),
    "test_lost_culprit.py": ("job",),
    "test_never_raise.py": ("job",),
    "test_probe_recheck.py": ("root",),
    "test_profile_capture.py": ("job",),
    "test_ray_guard.py": ("ray",),
    "test_ray_restarts.py": ("ray",),
    "test_ray_train.py": ("ray",),
    "test_rtop_run.py": ("job",),
    "test_scenarios.py": ("job",),
    "test_slow_link.py": ("job", "root"),
    "test_spool.py": ("job",),
    "test_stacks.py": ("job",),
    "test_web.py": ("job", "browser"),
    "test_viewer_install.py": ("install",),
}
#: The markers of the tiers (``make test-fast`` deselects them all).
TIER_MARKERS = ("job", "ray", "fault", "fuzz", "root", "browser", "install", "slow")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test gets its module's markers (:data:`NEEDS`). Ray tests run last, and those
    that share the in-process cluster after the others: the cluster is started once, and
    no other test runs beside its idle daemons."""
    for item in items:
        for name in NEEDS.get(Path(str(item.fspath)).name, ()):
            item.add_marker(getattr(pytest.mark, name))

    def order(item: pytest.Item) -> int:
        if RAY_FIXTURE in getattr(item, "fixturenames", ()):
            return 2
        return 1 if item.get_closest_marker("ray") else 0

    items.sort(key=order)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 kB tmpfs at ``tmp_path/tiny`` (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs",
                           str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
