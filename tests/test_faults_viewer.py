"""Fault suite: a viewer freezes.

A real viewer process connects with the view token, asks for 10 snapshots a second and
keeps asking for the ranks' full windows (as the TUI's detail pane does) without reading
them; once the hub holds half its high-water mark for it (the kernel's socket buffers
take the first megabytes), it is frozen (SIGSTOP). Checked: the hub holds at most its
high-water mark for it (it skips the frozen viewer's snapshots and counts them), its
memory stays bounded, the job's steps keep their pace (against the steps before the
freeze and after the frozen viewer is gone), and another viewer keeps getting its 2
snapshots a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from collectors import auth
from rtop.client import HubClient, HubError
from rtop.hub.service import ThreadedHub
from rtop.workload import WorkloadSpec
from tests import reliability
from tests.faultkit import ROOT, BackgroundJob, kept_pace, median_between, rss_mb, wait_for
from tests.waiting import snapshots

MASTER = "viewer-fault-master-token-0123456789"
#: the hub's high-water mark per viewer in this test (the default is 8 MB: a frozen
#: viewer would take minutes to reach it with a 2-rank job's snapshots)
HIGH_WATER = 512 << 10

VIEWER = """
import socket, sys, time
from collectors import wire
from rtop.client import HubClient, HubError

c = HubClient(sys.argv[1], sys.argv[2])
c._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
print("asking", flush=True)
n = 0
while True:  # 10 snapshots a second and the detail pane's requests, never read, until
    if n % 5 == 0:  # the test freezes it
        c._send(wire.KIND_REQUEST, {"what": "snapshot"})
    for rank in (0, 1):
        c._send(wire.KIND_REQUEST, {"what": "rank", "rank": rank})
    n += 1
    time.sleep(0.02)
"""


def _buffered(hub: Any) -> int:
    """The most bytes the hub holds for any one viewer, unsent."""
    return max((c.transport.get_write_buffer_size() for c in hub._conns
                if c.role == "viewer" and c.transport is not None), default=0)


def test_a_frozen_viewer_costs_the_hub_bounded_memory_and_no_one_else_anything(
        tmp_path: Path):
    hub = ThreadedHub(record=str(tmp_path / "run.rtop"), token=MASTER,
                      viewer_high_water=HIGH_WATER).start()
    view = auth.role_token(MASTER, "view")
    frozen_s = 40.0 if reliability.long_run() else 12.0
    after_s = 6.0  # the job's steps once the frozen viewer is gone, to compare with
    stop_file = tmp_path / "stop"
    spec = WorkloadSpec(world_size=2, duration_s=frozen_s + 120.0, dim=64, hidden=128,
                        hub=hub.address, token=auth.role_token(MASTER, "ingest"),
                        fault_mark_dir=str(tmp_path), stop_file=str(stop_file))
    job = BackgroundJob(spec)
    viewer = None
    counts: list[float] = []
    stop = threading.Event()

    def other_viewer() -> None:
        with HubClient(hub.address, view) as c:
            try:
                for _ in snapshots(c, rate_hz=2.0):
                    counts.append(time.monotonic())
                    if stop.is_set():
                        return
            except HubError:  # the hub stopped at the end of the test
                return

    try:
        started = job.wait_started()
        assert wait_for(lambda: hub.call(lambda h: len(h.rank_connections())) == 2, 60)
        time.sleep(3.0)  # steps before the freeze, to compare with
        other = threading.Thread(target=other_viewer, daemon=True)
        other.start()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        viewer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(VIEWER),
                                   hub.address, view], env=env, stdout=subprocess.PIPE,
                                  text=True)
        assert viewer.stdout is not None and viewer.stdout.readline().strip() == "asking"
        # the viewer has fallen behind: the hub holds what the kernel could not take,
        # and skips what it asks for beyond its high-water mark
        assert wait_for(lambda: hub.call(_buffered) > HIGH_WATER / 2
                        and hub.call(lambda h: h.counters["snapshots_skipped"]) > 0, 30), \
            f"the viewer never fell behind: the hub holds {hub.call(_buffered)} bytes"
        viewer.send_signal(signal.SIGSTOP)
        froze, froze_mono = time.time(), time.monotonic()
        rss0 = rss_mb(os.getpid())  # the hub runs in this process (the job does not)
        peak_buf = peak_rss = 0.0
        while time.monotonic() < froze_mono + frozen_s:
            peak_buf = max(peak_buf, hub.call(_buffered))
            peak_rss = max(peak_rss, rss_mb(os.getpid()))
            time.sleep(0.2)
        thawed = time.time()
        counters = hub.call(lambda h: dict(h.counters))
        got = [t for t in counts if froze_mono + 1.0 <= t < froze_mono + frozen_s]
        viewer.kill()  # the frozen viewer goes: its connection closes, the job runs on
        viewer.wait(5)
        gone = time.time()
        time.sleep(after_s)
        stop_file.touch()
        results = job.join(120)
    finally:
        stop.set()
        stop_file.touch()
        if viewer is not None and viewer.poll() is None:
            viewer.kill()
            viewer.wait(5)
        job.stop.set()
        hub.stop()
    # the hub held at most its high-water mark (plus the frame that crossed it) ...
    detail = 2 * 1024 * 1024  # a rank's full window is well under this
    assert peak_buf <= HIGH_WATER + detail, peak_buf
    assert peak_buf > HIGH_WATER / 2, peak_buf  # and it stayed behind, frozen
    # ... by skipping the frozen viewer's snapshots, counted
    assert counters["snapshots_skipped"] > 0, counters
    assert peak_rss - rss0 < 64, (rss0, peak_rss)
    # the other viewer kept its 2 Hz
    expected = 2.0 * (frozen_s - 1.0)
    assert len(got) >= 0.85 * expected, (len(got), expected)
    # and the job kept its pace
    pace = kept_pace("the freeze", median_between(job, started, froze),
                     median_between(job, froze, thawed, skip=0),
                     median_between(job, gone + 1.0, gone + after_s, skip=0))
    assert all(r["stats"]["dropped_unsent"] == 0 for r in results)
    reliability.record(
        "a viewer freezes (SIGSTOP) after asking for 10 snapshots/s and rank windows it "
        "never reads",
        "hub holds at most its high-water mark for it and skips its snapshots; the other "
        "viewer kept 2 Hz; the job kept its pace",
        0, frozen_s=frozen_s, hub_buffered_kB=round(peak_buf / 1024),
        high_water_kB=HIGH_WATER >> 10, hub_rss_growth_MB=round(peak_rss - rss0, 1),
        snapshots_skipped=counters["snapshots_skipped"],
        other_viewer_hz=round(len(got) / (frozen_s - 1.0), 2),
        **pace)
