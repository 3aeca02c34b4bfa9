"""Shared fixtures: a real TCP listener for rank frames, and one local Ray cluster for
the tests that run Ray in this process (they run last, together)."""

from __future__ import annotations

import statistics
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Ray tests run last, and those that share the in-process cluster after the others:
    the cluster is started once, and no other test runs beside its idle daemons."""
    def order(item: pytest.Item) -> int:
        if RAY_FIXTURE in getattr(item, "fixturenames", ()):
            return 2
        return 1 if item.get_closest_marker("ray") else 0

    items.sort(key=order)
