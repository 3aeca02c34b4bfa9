"""Fault suite: the recording's disk fills up under a live job.

``rtop serve`` records to a 64 kB tmpfs that the test mounts and fills but for 16 kB;
a real 2-rank DDP job streams to it. The disk fills within seconds. Checked: the hub
logs one clear error (not one per frame), the live view keeps updating, the diagnosis
goes on (a rank starved only after the disk filled is found), the ranks lose nothing,
and the recording reads up to where the disk filled, its report saying so.

(A read-only remount is not tried: Linux refuses to remount a file system read-only
while the hub holds its recording open for writing, so a full disk is how a recording
becomes unwritable under a running hub.)
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from rtop.client import HubClient
from rtop.report import build_report
from rtop.workload import Faults, WorkloadSpec, free_port
from tests import reliability
from tests.faultkit import BackgroundJob, recorded, start_serve, stop_serve, twice, wait_for

TOKEN = "disk-fault-token"


@pytest.fixture
def tiny_disk(tmp_path: Path):
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


def _full(mnt: Path) -> bool:
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize < 4096


def test_full_disk_stops_the_recording_not_the_hub(tiny_disk: Path, tmp_path: Path):
    port, record = free_port(), tiny_disk / "run.rtop"
    st = os.statvfs(tiny_disk)  # leave the recording 16 kB: a few seconds of the job
    (tiny_disk / "filler").write_bytes(b"x" * (st.f_bavail * st.f_frsize - (16 << 10)))
    hub = start_serve(port, TOKEN, record)
    duration = 40.0 if reliability.long_run() else 18.0
    # rank 1 starts to starve at step 2500 (several seconds in): after the disk is full
    spec = WorkloadSpec(world_size=2, duration_s=duration, dim=64, hidden=128,
                        hub=f"127.0.0.1:{port}", token=TOKEN,
                        faults=Faults(loader_sleep_s={1: 0.03}, start_step=2500),
                        fault_mark_dir=str(tmp_path / "marks"))
    (tmp_path / "marks").mkdir()
    job = BackgroundJob(spec)
    log = ""
    try:
        assert wait_for(lambda: _full(tiny_disk), 90, every=0.05), "the disk never filled"
        filled = time.time()
        with HubClient(f"127.0.0.1:{port}", TOKEN) as viewer:
            at_fill = viewer.snapshot()
            assert not any(f["kind"] == "starved_rank" for f in at_fill["findings"])
            step_at_fill = min(at_fill["ranks"]["step"])
            fault = job.wait_started(120)
            assert fault > filled, "the fault began before the disk was full"
            # the live view goes on: snapshots keep coming, steps keep moving ...
            seen = 0
            starved = None
            last: dict = {}
            for snap in viewer.subscribe(rate_hz=2.0):
                seen += 1
                last = snap
                starved = starved or next((f for f in snap["findings"]
                                           if f["kind"] == "starved_rank"), None)
                if (starved and seen >= 6) or not job.alive() or seen > 240:
                    break
        # ... and so does the diagnosis: a finding that began after the disk filled
        assert starved is not None and starved["ranks"] == [1], \
            [(f["kind"], f["ranks"]) for f in last.get("findings", [])]
        assert min(last["ranks"]["step"]) > step_at_fill + 50
        print(f"disk full at step {step_at_fill}, {fault - filled:.1f} s before the fault")
        results = job.join(180)
        with HubClient(f"127.0.0.1:{port}", TOKEN) as viewer:
            final = viewer.snapshot()
    finally:
        job.stop.set()
        log = stop_serve(hub)
    # the ranks lost nothing: the hub read everything, whatever its disk did
    for rank, res in enumerate(results):
        assert res["stats"]["dropped_unsent"] == 0, res["stats"]
        assert final["ranks"]["step"][rank] == len(res["times"]) - 1
    # one clear error, naming the file and the cause, not one per frame
    errors = [ln for ln in log.splitlines() if "recording to" in ln and "stopped" in ln]
    assert len(errors) == 1, log[-3000:]
    assert str(record) in errors[0] and "No space left" in errors[0], errors[0]
    # what was written reads back, up to where the disk filled, and the report says so
    report = build_report(record)
    assert not report["run"]["closed"] and report["run"]["cut"]
    assert "without closing it" in report["run"]["cut"]
    steps, _, _ = recorded(record)
    assert steps and all(not twice(s) for s in steps.values())
    assert report["run"]["end_t_hub"] <= filled + 1.0
    total = sum(len(r["times"]) for r in results)
    reliability.record(
        "recording's disk fills (64 kB tmpfs) under a live job",
        "one error logged; live view, diagnosis and ranks unaffected; the recording "
        "reads up to the fill and the report says where it ends",
        f"0 records at the ranks and in the live view; the recording holds "
        f"{sum(len(s) for s in steps.values())} of {total} steps (the disk was full)",
        errors_logged=len(errors), snapshots_after_fill=seen,
        steps_after_fill=min(last["ranks"]["step"]) - step_at_fill)
