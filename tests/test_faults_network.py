"""Fault suite: the ranks' network to the hub is cut, then restored.

Both ranks of a real 2-rank DDP job run in one network namespace (their gloo traffic
stays on its loopback); the hub listens on the host's end of a veth pair into it. The
test brings the link down (``ip link set ... down``) for 8 s (30 s under
``RTOP_RELIABILITY_LONG=1``), then up. Checked: the ranks train at their normal pace
through it, the hub shows them lost and then back, what the ranks could not keep is
counted and shown (snapshot and header), nothing is recorded twice, and every record
the ranks did not drop arrived. The ranks are :mod:`rtop.workload`'s own
(``python -m rtop.workload``), started inside the namespace.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from collectors import auth
from rtop.client import HubClient
from rtop.hub.service import ThreadedHub
from rtop.workload import WorkloadSpec
from tests import reliability
from tests.faultkit import (
    JobNetns,
    finish_ranks,
    header_text,
    kept_pace,
    kill_ranks,
    recorded,
    twice,
    wait_for,
)

MASTER = "network-fault-master-token-0123456789"
NET = JobNetns("rtop-fn-job", "rfn0", "rfn0h", "10.79.0.1", "10.79.0.2")


@pytest.fixture
def job_netns():
    """A namespace for the job, joined to this one by a veth pair (root only)."""
    NET.build()
    try:
        yield NET
    finally:
        NET.teardown()


def steps_in(out: Path, marks: Path, rank: int, t0: float, t1: float) -> list[float]:
    """Rank ``rank``'s step times for the steps that began in ``[t0, t1)``."""
    times = json.loads((out / f"rank{rank}.json").read_text())["times"]
    t = float((marks / f"fault-rank{rank}").read_text())
    got = []
    for i, d in enumerate(times):
        if i >= 5 and t0 <= t < t1:
            got.append(d)
        t += d
    return got


def test_link_to_the_hub_cut_then_restored(job_netns, tmp_path: Path):
    import statistics

    cut_s = 30.0 if reliability.long_run() else 8.0
    hub = ThreadedHub(record=str(tmp_path / "run.rtop"), token=MASTER, host=NET.hub_ip,
                      lost_after_s=3.0).start()
    out, marks = tmp_path / "out", tmp_path / "marks"
    out.mkdir()
    marks.mkdir()
    # a small backlog (16 frames of 0.1 s) and socket send buffer (16 kB: the kernel
    # may give twice that) so that the cut costs records
    # after a long cut TCP's retransmission backoff may hold the data back for up to
    # another ~cut_s: the job trains long enough after the restore to see them back
    back_s = 12.0 if cut_s <= 10 else cut_s + 15.0
    spec = WorkloadSpec(world_size=2, duration_s=cut_s + back_s + 6.0, dim=64, hidden=128,
                        hub=hub.address, token=auth.role_token(MASTER, "ingest"),
                        probe_settings={"backlog_frames": 16, "flush_interval_s": 0.1,
                                        "backoff_max_s": 1.0,
                                        "send_buffer_bytes": 16 * 1024},
                        fault_mark_dir=str(marks))
    procs = NET.start_ranks(spec, out, 29650)
    statuses: dict[str, Any] = {}
    try:
        assert wait_for(lambda: all((marks / f"fault-rank{r}").exists() for r in (0, 1)),
                        120), "the ranks never started training"
        with HubClient(hub.address, MASTER) as viewer:
            assert wait_for(lambda: viewer.snapshot()["ranks"]["status"] ==
                            ["active", "active"], 30)
            time.sleep(3.0)
            cut = time.time()
            NET.sh("ip", "link", "set", NET.host_dev, "down")
            time.sleep(cut_s)
            snap = viewer.snapshot()
            statuses["during"] = snap["ranks"]["status"]
            step_during = snap["ranks"]["step"]
            NET.sh("ip", "link", "set", NET.host_dev, "up")
            restored = time.time()
            assert wait_for(lambda: viewer.snapshot()["ranks"]["status"] ==
                            ["active", "active"] and
                            min(viewer.snapshot()["ranks"]["step"]) > max(step_during),
                            back_s), \
                viewer.snapshot()["ranks"]
            back = time.time()
        results = finish_ranks(procs, out)
        with HubClient(hub.address, MASTER) as viewer:
            final = viewer.snapshot()
    finally:
        subprocess.run(["ip", "link", "set", NET.host_dev, "up"], capture_output=True)
        kill_ranks(procs)
        hub.stop()
    # the hub saw them go and come back
    assert statuses["during"] == ["lost", "lost"], statuses
    # the job kept its pace while its hub was out of reach
    def median_in(t0: float, t1: float) -> float:
        return statistics.median([d for r in (0, 1) for d in steps_in(out, marks, r, t0, t1)])

    before, during = median_in(0, cut), median_in(cut, restored)
    after = median_in(back + 1.0, float("inf"))
    pace = kept_pace("the cut", before, during, after)
    # drops: counted by the ranks, told to the hub, shown in the snapshot and header
    dropped = [r["stats"]["dropped_unsent"] + r["stats"]["dropped_buffer"] for r in results]
    assert all(d > 0 for d in dropped), [r["stats"] for r in results]
    assert final["ranks"]["dropped"] == dropped, (final["ranks"]["dropped"], dropped)
    header = header_text(final)
    assert f" {sum(dropped)} dropped" in header, header
    # nothing recorded twice; everything the ranks did not drop arrived: what the hub
    # acknowledged, and what it had not acknowledged when the job ended (spooled, and
    # the hub took the spool or had it from the socket already)
    steps, records, _ = recorded(tmp_path / "run.rtop")
    lost_steps = 0
    for rank, res in enumerate(results):
        stats = res["stats"]
        assert not twice(steps[rank]), twice(steps[rank])
        assert records[rank] == stats["sent_records"] + stats["spooled_records"], \
            (records[rank], stats)
        missing = set(range(len(res["times"]))) - set(steps[rank])
        assert len(missing) <= dropped[rank]
        lost_steps += len(missing)
    reliability.record(
        f"the ranks' link to the hub is cut ({cut_s:.0f} s, `ip link set down`), then "
        "restored",
        "ranks trained at their pace; the hub showed them lost, then active again; "
        "drops counted and shown; nothing recorded twice",
        f"0 records not counted: {sum(dropped)} dropped by the ranks' bounded backlog "
        f"(16 frames here; {lost_steps} steps), every other record arrived",
        **pace, step_before_ms=round(before * 1e3, 2),
        step_during_ms=round(during * 1e3, 2), step_after_ms=round(after * 1e3, 2),
        back_after_restore_s=round(back - restored, 1),
        dropped=sum(dropped))
