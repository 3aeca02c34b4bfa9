"""Running a real job with an injected fault against a real hub, watching the findings."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtop.analysis import AnalysisConfig
from rtop.hub.service import ThreadedHub
from rtop.workload import Faults, WorkloadSpec, run_local

#: A job whose healthy step is mostly compute: on 2 ranks ~33 ms of compute against ~5 ms
#: of exposed allreduce (2.6 MB of gradients); on 3 ranks sharing 2 cores ~47 ms against
#: ~12 ms. Efficiency stays near 0.8 with room for a noisy CI machine (the finding's
#: threshold is 0.6): a healthy run here is genuinely healthy.
BASE = {"batch": 768, "dim": 256, "hidden": 512, "layers": 3}


@dataclass
class Outcome:
    """What a scenario saw."""

    results: list[dict[str, Any]]
    first_seen: dict[tuple[str, tuple[int, ...]], float]  # (kind, ranks) -> wall time
    findings: dict[str, dict[str, Any]]  # kind -> the finding as last seen
    onset: float | None  # wall time the fault started (earliest rank)
    record: Path
    job_started: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kinds(self) -> set[str]:
        return {k for k, _ in self.first_seen}

    def latency(self, kind: str) -> float:
        """Seconds from the fault's onset to the finding's first appearance."""
        assert self.onset is not None, "the fault never started"
        times = [t for (k, _), t in self.first_seen.items() if k == kind]
        assert times, f"no {kind} finding"
        return min(times) - self.onset


def run_scenario(tmp: Path, faults: Faults, *, world: int = 2, duration_s: float = 12.0,
                 thresholds: AnalysisConfig | None = None, timeout_s: float = 120.0,
                 until: Callable[[Outcome], bool] | None = None, grace_s: float = 3.0,
                 check: bool = True, job: str = "scenario", **spec: Any) -> Outcome:
    """Run a DDP job with ``faults`` against a hub; poll its findings at 10 Hz.

    ``until`` ends the job early (after ``grace_s`` more seconds, to catch anything
    spurious that follows) once it returns True.
    """
    marks = tmp / "marks"
    marks.mkdir(exist_ok=True)
    record = tmp / "run.rtop"
    hub = ThreadedHub(job=job, record=str(record),
                      thresholds=thresholds or AnalysisConfig()).start()
    settings = {**BASE, **spec}
    job_spec = WorkloadSpec(world_size=world, duration_s=duration_s, hub=hub.address,
                            token=hub.token, faults=faults, fault_mark_dir=str(marks),
                            **settings)
    out = Outcome([], {}, {}, None, record)
    stop = threading.Event()
    box: dict[str, Any] = {}

    def job() -> None:
        try:
            box["results"] = run_local(job_spec, timeout_s=timeout_s, check=check, stop=stop)
        except BaseException as exc:  # reported below
            box["error"] = exc

    thread = threading.Thread(target=job)
    out.job_started = time.time()
    thread.start()
    done_at = None
    ended: float | None = None
    try:
        while ended is None or time.time() - ended < grace_s:
            if ended is None and not thread.is_alive():
                ended = time.time()  # keep watching: the hub still analyses
            time.sleep(0.1)
            now = time.time()
            if stop.is_set():
                continue  # we are killing the job: what follows is our doing
            for f in hub.call(lambda h: list(h.monitor.findings)):
                key = (f["kind"], tuple(f["ranks"]))
                out.first_seen.setdefault(key, now)
                out.findings[f["kind"]] = f
            if out.onset is None:
                stamps = [float(p.read_text()) for p in marks.glob("fault-rank*")]
                out.onset = min(stamps) if stamps else None
            if until is not None and done_at is None and until(out):
                done_at = now
            if done_at is not None and now - done_at > grace_s:
                stop.set()
        thread.join()
    finally:
        stop.set()
        thread.join(timeout=30)
        hub.stop()
    if "error" in box:
        raise box["error"]
    out.results = box.get("results", [])
    if out.onset is None:
        stamps = [float(p.read_text()) for p in marks.glob("fault-rank*")]
        out.onset = min(stamps) if stamps else None
    return out
