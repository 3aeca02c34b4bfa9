"""What a fault test measured, for ``docs/reliability.md``.

Each test of the fault suite calls :func:`record` once it has asserted its outcome,
with the fault it tried, what happened, what was lost (the target is zero records) and
any figures it measured (step times, memory, delays). Under ``make test`` nothing is
written; ``make reliability`` (``benchmarks/reliability.py``) sets
``RTOP_RELIABILITY_OUT`` to a JSON-lines file, runs the suite with its long parts
(``RTOP_RELIABILITY_LONG=1``, see :func:`long_run`) and turns the lines into the table.
"""

from __future__ import annotations

import json
import os
from typing import Any


def long_run() -> bool:
    """True under ``make reliability``: a test may then run its fault for longer or at
    a larger scale than ``make test`` affords."""
    return os.environ.get("RTOP_RELIABILITY_LONG") == "1"


def record(fault: str, outcome: str, lost: int | str, **figures: Any) -> None:
    """Append one row: ``fault`` tried, its ``outcome`` in words, records ``lost``
    (a count, or words such as ``"0 (3 dropped, counted)"``), and named ``figures``
    (numbers or short strings; a figure named ``*_ratio`` is shown as ``1.01×``)."""
    out = os.environ.get("RTOP_RELIABILITY_OUT")
    if not out:
        return
    row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
           "fault": fault, "outcome": outcome, "lost": lost, "figures": figures}
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str) + "\n")
