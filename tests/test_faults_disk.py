"""Fault suite: the recording's disk fills up, or becomes unwritable, under a live job.

``rtop serve`` records to a disk that breaks while a real 2-rank DDP job streams to it:

- a 64 kB tmpfs that the test mounts and fills but for 16 kB: the disk fills within
  seconds (``No space left on device``);
- an ext4 file system on a loop device, mounted with ``errors=remount-ro``: a few
  seconds into the job the test writes to ``/sys/fs/ext4/<loop>/trigger_fs_error``, the
  kernel takes that for a file system error and remounts it read-only on the spot
  (``emergency_ro``), with the hub's recording open for writing: its next write gets
  ``Read-only file system``. (``mount -o remount,ro`` cannot do this: Linux refuses to
  remount read-only a file system that a process holds a file open on for writing.)

Checked in both: the hub logs one clear error (not one per frame), the live view keeps
updating, the diagnosis goes on (a rank starved only after the disk broke is found), the
ranks lose nothing, and the recording reads up to where the disk broke, its report
saying so. Both need root (mount; loop devices and ``mkfs.ext4`` for the second) and
are skipped without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rtop.client import HubClient
from rtop.report import build_report
from rtop.workload import Faults, WorkloadSpec, free_port
from tests import reliability
from tests.faultkit import BackgroundJob, recorded, start_serve, stop_serve, twice, wait_for
from tests.waiting import snapshots

TOKEN = "disk-fault-token"


@pytest.fixture
def ext4_disk(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A 16 MB ext4 file system on a loop device, mounted at ``tmp_path/ext4`` with
    ``errors=remount-ro`` (root only): ``(mount point, loop device's name)``."""
    if os.geteuid() != 0:
        pytest.skip("needs root to attach a loop device and mount it")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if not shutil.which(tool):
            pytest.skip(f"needs {tool}")
    image, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    done = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed here: {done.stderr.strip()}")
    done = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"no loop device here: {done.stderr.strip()}")
    dev = done.stdout.strip()
    try:
        done = subprocess.run(["mount", "-t", "ext4", "-o", "errors=remount-ro", dev,
                               str(mnt)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount ext4 on a loop device here: {done.stderr.strip()}")
        try:
            name = Path(dev).name
            if not Path(f"/sys/fs/ext4/{name}/trigger_fs_error").exists():
                pytest.skip("this kernel's ext4 has no trigger_fs_error")
            mnt.chmod(0o700)
            yield mnt, name
        finally:  # the file system may have been marked as having errors: unmount all the same
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def _full(mnt: Path) -> bool:
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize < 4096


def _mount_options(mnt: Path) -> list[str]:
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[1] == str(mnt):
            return fields[3].split(",")
    return []


@dataclass
class _Outcome:
    """What a job whose hub's recording disk broke came to (checked by
    :func:`_run_through_disk_fault`)."""

    errors: list[str]  # the hub's log lines saying the recording stopped
    recorded_steps: int  # steps the recording holds
    total_steps: int  # steps the ranks took
    snapshots: int  # live-view snapshots taken after the disk broke
    steps_after: int  # steps the live view moved on after the disk broke


def _run_through_disk_fault(tmp_path: Path, record: Path, break_disk: Callable[[str], float],
                            cause: str, what: str) -> _Outcome:
    """``rtop serve`` recording to ``record``, a real 2-rank job streaming to it, and
    ``break_disk(hub address)`` (returning the wall time the disk broke) while the job
    runs; rank 1 starves only after that. Checks that the hub logged one error naming
    ``record`` and ``cause``, that the live view and the diagnosis went on, that the
    ranks lost nothing, and that the recording reads up to the break (``what``: the
    break in words, for messages)."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    hub = start_serve(port, TOKEN, record)
    # rank 1 starves once the test says so (after the disk broke), and the job runs
    # until the test has seen what it needs: neither depends on the pace of the steps
    starve, stop = tmp_path / "starve", tmp_path / "stop"
    spec = WorkloadSpec(world_size=2, duration_s=240.0, dim=64, hidden=128,
                        hub=addr, token=TOKEN, stop_file=str(stop),
                        faults=Faults(loader_sleep_s={1: 0.03}, start_file=str(starve)),
                        fault_mark_dir=str(tmp_path / "marks"))
    (tmp_path / "marks").mkdir()
    job = BackgroundJob(spec)
    log = ""
    try:
        broke = break_disk(addr)
        with HubClient(addr, TOKEN) as viewer:
            at_break = viewer.snapshot()
            assert not any(f["kind"] == "starved_rank" for f in at_break["findings"])
            step_at_break = min(at_break["ranks"]["step"])
            # the live view runs on for a while with the disk broken, then rank 1 starves
            time.sleep(20.0 if reliability.long_run() else 3.0)
            starve.touch()
            fault = job.wait_started(120)
            assert fault > broke, f"the fault began before the disk was {what}"
            # the live view goes on: snapshots keep coming, steps keep moving ...
            seen = 0
            starved = None
            last: dict[str, Any] = {}
            for snap in snapshots(viewer, rate_hz=2.0):
                seen += 1
                last = snap
                starved = starved or next((f for f in snap["findings"]
                                           if f["kind"] == "starved_rank"), None)
                if (starved and seen >= 6) or not job.alive() or seen > 240:
                    break
        stop.touch()
        # ... and so does the diagnosis: a finding that began after the disk broke
        assert starved is not None and starved["ranks"] == [1], \
            [(f["kind"], f["ranks"]) for f in last.get("findings", [])]
        assert min(last["ranks"]["step"]) > step_at_break + 50
        print(f"disk {what} at step {step_at_break}, {fault - broke:.1f} s before the fault")
        results = job.join(180)
        with HubClient(addr, TOKEN) as viewer:
            final = viewer.snapshot()
    finally:
        stop.touch()
        job.stop.set()
        log = stop_serve(hub)
    # the ranks lost nothing: the hub read everything, whatever its disk did
    for rank, res in enumerate(results):
        assert res["stats"]["dropped_unsent"] == 0, res["stats"]
        assert final["ranks"]["step"][rank] == len(res["times"]) - 1
    # one clear error, naming the file and the cause, not one per frame; nothing raised
    errors = [ln for ln in log.splitlines() if "recording to" in ln and "stopped" in ln]
    assert len(errors) == 1, log[-3000:]
    assert str(record) in errors[0] and cause in errors[0], errors[0]
    assert "Traceback" not in log, log[-3000:]
    # what was written reads back, up to where the disk broke, and the report says so
    report = build_report(record)
    assert not report["run"]["closed"] and report["run"]["cut"]
    assert "without closing it" in report["run"]["cut"]
    steps, _, _ = recorded(record)
    assert steps and all(not twice(s) for s in steps.values())
    end = report["run"]["end_t_hub"]
    print(f"the recording ends {broke - end:.2f} s before the disk was {what}")
    assert broke - 3.0 <= end <= broke + 1.0, (end, broke)
    return _Outcome(errors=errors, recorded_steps=sum(len(s) for s in steps.values()),
                    total_steps=sum(len(r["times"]) for r in results), snapshots=seen,
                    steps_after=min(last["ranks"]["step"]) - step_at_break)


def test_full_disk_stops_the_recording_not_the_hub(tiny_disk: Path, tmp_path: Path):
    record = tiny_disk / "run.rtop"
    st = os.statvfs(tiny_disk)  # leave the recording 16 kB: a few seconds of the job
    (tiny_disk / "filler").write_bytes(b"x" * (st.f_bavail * st.f_frsize - (16 << 10)))

    def fill(addr: str) -> float:
        assert wait_for(lambda: _full(tiny_disk), 90, every=0.05), "the disk never filled"
        return time.time()

    out = _run_through_disk_fault(tmp_path, record, fill, "No space left", "full")
    reliability.record(
        "recording's disk fills (64 kB tmpfs) under a live job",
        "one error logged; live view, diagnosis and ranks unaffected; the recording "
        "reads up to the fill and the report says where it ends",
        f"0 records at the ranks and in the live view; the recording holds "
        f"{out.recorded_steps} of {out.total_steps} steps (the disk was full)",
        errors_logged=len(out.errors), snapshots_after_fill=out.snapshots,
        steps_after_fill=out.steps_after)


def test_read_only_remount_stops_the_recording_not_the_hub(
        ext4_disk: tuple[Path, str], tmp_path: Path):
    mnt, dev = ext4_disk
    record = mnt / "run.rtop"

    def remount_read_only(addr: str) -> float:
        # the recording holds steps, and a few seconds pass
        assert wait_for(lambda: record.exists() and any(recorded(record)[0].values()), 90,
                        every=0.2), "the recording never held a step"
        time.sleep(3.0)
        Path(f"/sys/fs/ext4/{dev}/trigger_fs_error").write_text("rtop fault test\n")
        broke = time.time()
        assert wait_for(lambda: {"ro", "emergency_ro"} & set(_mount_options(mnt)), 10,
                        every=0.05), f"not remounted read-only: {_mount_options(mnt)}"
        return broke

    out = _run_through_disk_fault(tmp_path, record, remount_read_only,
                                  "Read-only file system", "remounted read-only")
    reliability.record(
        "recording's disk remounted read-only (ext4 error, emergency_ro) under a live job",
        "one error logged; live view, diagnosis and ranks unaffected; the recording "
        "reads up to the remount and the report says where it ends",
        f"0 records at the ranks and in the live view; the recording holds "
        f"{out.recorded_steps} of {out.total_steps} steps (the disk was read-only)",
        errors_logged=len(out.errors), snapshots_after_remount=out.snapshots,
        steps_after_remount=out.steps_after)
