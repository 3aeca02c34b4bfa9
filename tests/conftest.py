"""Shared fixtures: a real TCP listener for rank frames."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import pytest

from rtop.listener import Listener


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
