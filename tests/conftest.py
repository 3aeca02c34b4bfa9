"""Shared fixtures: a real TCP listener for rank frames."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
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
