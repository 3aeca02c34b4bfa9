"""Issue 24, the rank's side: what an action may cost a rank (D, E), which token a rank
holds in the default flow (I), and a squatted runtime directory (J).

Each test replays the attack or the measurement of the issue against real processes (a
real 2-rank gloo job, a real hub over TCP, ``rtop`` as a user runs it) and fails on the
code before the fix:

* D: ``rtop probe --bytes 1073741824`` was accepted without a word (+2.1 GB resident per
  rank); now a rank refuses what it cannot afford, before anything is allocated.
* E: ``rtop profile --steps 1000`` left hundreds of MB in the rank and wrote its traces
  0644 in 0755 folders; now steps and what a capture may grow are bounded, what it held
  is given back, and traces are 0600 in 0700 folders.
* I: the node-local hub's file gave every rank the master token; now ranks get the
  ingest token and the master token is in a private key file viewers read.
* J: another user creating ``/tmp/rtop-<uid>`` first silently cost the victim its hub,
  discovery and spools; now it is reported and a private fallback is shared by the
  user's processes. Other users are played by ``nobody`` (these tests run as root).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from collectors import auth, cuda_events, linkprobe
from collectors import discovery as cdisc
from collectors.config import ProbeConfig
from collectors.identity import Identity
from rtop.client import HubClient, HubError
from rtop.workload import Faults, WorkloadSpec, run_local
from tests.fakecuda import FakeCuda
from tests.test_control import MASTER, Job, rtop
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
UID = os.geteuid()
GiB, MiB = 1 << 30, 1 << 20

needs_root = pytest.mark.skipif(UID != 0, reason="plays another user with chown (root)")


def _rss(pids: dict[int, int]) -> dict[int, int]:
    return {r: psutil.Process(p).memory_info().rss for r, p in pids.items()}


class _PeakRss:
    """The highest resident memory of each process, sampled every 20 ms until stopped."""

    def __init__(self, pids: dict[int, int]) -> None:
        self.pids = pids
        self.peak = _rss(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for r, v in _rss(self.pids).items():
                self.peak[r] = max(self.peak[r], v)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join(5)
        return self.peak


# ---- D: a link probe bounded by what the rank can afford ----------------------------------


def test_a_probe_footprint_and_what_a_rank_can_afford():
    assert linkprobe.probe_footprint(GiB) == 2 * GiB + 2  # sent and received buffers
    assert linkprobe.affordable(16 * MiB, 8 * GiB) is None
    why = linkprobe.affordable(GiB, 6 * GiB, where="host memory")
    assert why is not None
    assert "1073741824 bytes" in why and "2.0 GiB" in why and "6.0 GiB free in host memory" \
        in why and "25%" in why
    most = int(why.rsplit("at most ", 1)[1].split()[0])
    assert linkprobe.affordable(most, 6 * GiB) is None  # what it suggests is accepted
    assert linkprobe.affordable(most + 1024, 6 * GiB) is not None
    # host memory: every rank of the node allocates its own buffers at once
    assert linkprobe.affordable(256 * MiB, 6 * GiB) is None
    assert "with the 4 ranks sharing it" in str(linkprobe.affordable(256 * MiB, 6 * GiB,
                                                                     sharing=4))
    assert linkprobe.affordable(GiB, None) is None  # nothing measured: nothing to refuse on
    assert linkprobe.REFUSE_SHARE > linkprobe.WARN_SHARE > 0


def test_a_cuda_probe_is_judged_by_the_devices_free_memory_and_torchs_cache(monkeypatch,
                                                                            caplog):
    import torch

    fake = FakeCuda(devices=2, total_memory=80 * GiB)
    fake.others_use[1] = 74 * GiB  # other processes on the GPU
    fake.reserved[1], fake.allocated[1] = 4 * GiB, 3 * GiB  # 1 GiB cached, unused
    monkeypatch.setattr(cuda_events, "cuda_module", lambda: fake)
    monkeypatch.setattr(linkprobe, "_warned_share", False)
    device = torch.device("cuda", 1)
    # cudaMemGetInfo says 2 GiB free; torch hands the probe its unused 1 GiB cache first
    assert linkprobe.probe_memory(device) == ("cuda:1", 3 * GiB)
    with pytest.raises(ValueError, match=r"2\.0 GiB on this rank.*3\.0 GiB free in cuda:1"):
        linkprobe.check_affordable(GiB, device)
    with caplog.at_level(logging.WARNING, logger="collectors"):
        linkprobe.check_affordable(256 * MiB, device)  # 17%: runs, with a warning
        linkprobe.check_affordable(256 * MiB, device)
        linkprobe.check_affordable(64 * MiB, device)  # 4%: nothing to say
    warned = [r.getMessage() for r in caplog.records if "link probe" in r.getMessage()]
    assert len(warned) == 1 and "cuda:1" in warned[0], warned


def test_the_probe_share_is_a_setting(monkeypatch, caplog):
    monkeypatch.setenv("RTOP_PROBE_MEMORY_SHARE", "0.05")
    assert ProbeConfig.from_env().probe_memory_share == 0.05
    monkeypatch.setenv("RTOP_PROBE_MEMORY_SHARE", "3")
    with caplog.at_level(logging.WARNING, logger="collectors"):
        assert ProbeConfig.from_env().probe_memory_share == linkprobe.REFUSE_SHARE
    assert any("RTOP_PROBE_MEMORY_SHARE" in r.getMessage() for r in caplog.records)


@pytest.mark.job
def test_a_probe_the_ranks_cannot_afford_is_refused_before_anything_is_allocated(
        tmp_path: Path) -> None:
    """The issue's figure: ``rtop probe --bytes 1073741824`` on a 2-rank gloo job. The
    ranks here may give a probe 5% of their host's available memory (this machine has
    24 GiB; the default share, 25%, stands for a machine of 8): each refuses at once, the
    hub cancels the probe everywhere, the user reads why, and no rank's memory moves.
    Before: the probe ran, +2.1 GB resident in each rank."""
    available = psutil.virtual_memory().available
    share = 0.05
    assert 2 * GiB > share * available, "this test needs a host with < 40 GiB available"
    job = Job(tmp_path, probe_settings={"probe_memory_share": share})
    try:
        assert wait_for(job.running, 90), "the job never reached the hub"
        pids = job.pids()
        before = _rss(pids)
        peak = _PeakRss(pids)
        ctl = auth.role_token(MASTER, "control")
        out = rtop("probe", job.hub.address, "--bytes", str(GiB), "--json", token=ctl)
        grown = {r: v - before[r] for r, v in peak.stop().items()}
        assert out.returncode != 0, out.stdout + out.stderr
        said = out.stdout + out.stderr
        assert "1073741824 bytes per transfer would allocate 2.0 GiB on this rank" in said, said
        assert "free in host memory" in said and "5%" in said and "at most" in said, said
        assert max(grown.values()) < 200 * MiB, grown  # nothing allocated
        # the job goes on, and a probe it can afford still runs
        steps = min(job.steps())
        small = rtop("probe", job.hub.address, "--bytes", str(MiB), "--json", token=ctl)
        assert small.returncode == 0, small.stdout + small.stderr
        assert json.loads(small.stdout)["matrix_Bps"][0][1] > 1e6
        assert wait_for(lambda: min(job.steps()) > steps + 10, 60)
    finally:
        job.close()


# ---- E: a profile bounded, released, and private ------------------------------------------


def _tree_modes(top: Path, below: Path) -> dict[str, int]:
    return {str(p.relative_to(top)): stat.S_IMODE(p.stat().st_mode)
            for p in [below, *below.parents] if p != top and top in p.parents}


@pytest.mark.job
def test_a_profile_gives_back_what_it_took_and_writes_privately(tmp_path: Path) -> None:
    """``rtop profile`` of 100 steps (the most allowed) on a real job: the ranks' resident
    memory afterwards is back near where it was (before: +150 MB kept per 100 steps,
    +1.6 GB for 1,000), the traces are 0600 and every folder rtop made is 0700, the
    user's own folder untouched."""
    os.chmod(tmp_path, 0o755)  # the user's: rtop leaves it as it is
    job = Job(tmp_path)
    try:
        assert wait_for(job.running, 90), "the job never reached the hub"
        pids = job.pids()
        time.sleep(3)  # past the job's own warm-up
        before = _rss(pids)
        out_dir = tmp_path / "made" / "by" / "rtop"
        ctl = auth.role_token(MASTER, "control")
        out = rtop("profile", job.hub.address, "--ranks", "0,1", "--steps", "100",
                   "--out", str(out_dir), "--json", "--timeout", "300", token=ctl)
        assert out.returncode == 0, out.stdout + out.stderr
        time.sleep(3)
        after = _rss(pids)
        kept = {r: after[r] - before[r] for r in pids}
        prof = json.loads(out.stdout)
        traces = [Path(t["path"]) for t in prof["traces"]]
        assert len(traces) == 2
        for t in traces:
            assert t.parent == out_dir and stat.S_IMODE(t.stat().st_mode) == 0o600
        assert _tree_modes(tmp_path, out_dir) == {"made": 0o700, "made/by": 0o700,
                                                  "made/by/rtop": 0o700}
        assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755
        assert not [p for p in out_dir.iterdir() if p.name.startswith(".")]  # no staging left
        sizes = {t.stat().st_size for t in traces}
        for r in prof["summary"]["ranks"]:
            assert r["steps_asked"] == 100 and r["trace_bytes"] in sizes
            assert r["steps"][1] - r["steps"][0] + 1 == 100 and r["note"] is None
        print(f"rank RSS before {before}, after {after}, kept {kept}")
        assert max(kept.values()) < 40 * MiB, kept
    finally:
        job.close()


def test_profile_steps_beyond_the_bound_are_refused() -> None:
    from collectors.control import MAX_PROFILE_STEPS

    assert MAX_PROFILE_STEPS == 100
    proc = subprocess.run([sys.executable, "-m", "rtop", "profile", "127.0.0.1:9",
                           "--steps", "1000"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 2 and "--steps must be 1 to 100" in proc.stderr


GROWING_LOOP = """
import json, sys
import torch
from collectors.profiler import ProfileCapture
MiB = 1 << 20
model = torch.nn.Linear(32, 32)
answers = []
cap = ProfileCapture(sys.argv[1], "rank0", 100, 0, answers.append)
held = []
step = 0
while not cap.at_boundary(step):
    model(torch.randn(8, 32)).sum().backward()
    grown = bytearray(2 * MiB)
    grown[::4096] = b"\\1" * (len(grown) // 4096)  # resident: each page written
    held.append(grown)
    step += 1
print(json.dumps(answers))
"""


@pytest.mark.job
def test_a_capture_stops_early_when_the_rank_grows_past_its_bound(tmp_path: Path) -> None:
    """A real capture on a real (one-process) training loop whose memory grows 2 MiB a
    step: it stops at the first boundary past the bound and says so, with the trace of
    the steps it has; before, it ran the 100 steps asked, however the rank grew. (The
    loop runs in a process of its own: in the test's process, memory other tests left
    behind can be freed during the capture and hide the growth.)"""
    from collectors.profiler import MAX_CAPTURE_GROWTH_BYTES

    proc = subprocess.run([sys.executable, "-c", GROWING_LOOP, str(tmp_path / "p")],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RTOP_AUTOHUB": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (a,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in a, a
    captured = a["steps"][1] - a["steps"][0] + 1
    bound_steps = MAX_CAPTURE_GROWTH_BYTES // (2 * MiB)
    # the bound's worth of steps at most (the profiler's own start takes some of it)
    assert 1 <= captured <= bound_steps + 1, (captured, a["note"])
    assert a["steps_asked"] == 100 and "stopped after" in a["note"] and "MiB" in a["note"]
    assert Path(a["trace"]).is_file() and a["trace_bytes"] == Path(a["trace"]).stat().st_size


# ---- I: ranks hold the ingest token only ------------------------------------------------


@pytest.mark.job
def test_the_auto_hub_gives_ranks_the_ingest_token_and_viewers_the_master(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job with no settings (the node-local hub): its hub file gives ranks the ingest
    token, which the hub refuses for control; ``rtop stacks`` by the same user, with no
    token, still acts on the job through discovery (the master token from the private
    key file). Before: the hub file, and so every rank, held the master token."""
    monkeypatch.setenv("RTOP_AUTOHUB", "1")
    stop = tmp_path / "stop"
    spec = WorkloadSpec(world_size=2, duration_s=120, dim=64, hidden=128,
                        faults=Faults(all_loader_sleep_s=0.01), stop_file=str(stop))
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(run_local(spec, timeout_s=300)),
                              daemon=True)
    runner.start()
    rdir = cdisc.runtime_dir()
    info: dict[str, Any] | None = None
    try:
        assert wait_for(lambda: [p for p in rdir.glob("hub-*.json")
                                 if cdisc.read_hub_file(p)], 60), "no node-local hub"
        (path,) = rdir.glob("hub-*.json")
        info = cdisc.read_hub_file(path)
        assert info is not None
        key_file = cdisc.hub_key_path(path)
        assert key_file.name.endswith(".key") and stat.S_IMODE(key_file.stat().st_mode) \
            == 0o600
        master = json.loads(key_file.read_text())["token"]
        assert auth.token_role(master) is None
        assert info["token"] == auth.role_token(master, "ingest")
        assert master not in path.read_text()
        # what a rank of this job resolves
        key = path.stem[len("hub-"):]
        rank = Identity(rank=1, local_rank=1, world_size=2, hostname="n", ip="127.0.0.1",
                        pid=os.getpid(), job=key, source="torch")
        assert cdisc.job_key(rank) == key
        found = cdisc.resolve(rank, None, None)
        assert found is not None and found[2] is not None
        assert auth.token_role(found[2]) == "ingest"
        # it cannot act: the client will not try, and the hub refuses one that does
        with pytest.raises(HubError, match="another role"):
            HubClient(info["address"], found[2], role="control")
        real = auth.key_for
        monkeypatch.setattr(auth, "key_for", lambda token, role: real(token, "ingest"))
        # (whichever side proves first, the two proofs cannot agree: no control session)
        with pytest.raises(HubError, match=r"refused|could not prove"):
            HubClient(info["address"], found[2], role="control")
        monkeypatch.setattr(auth, "key_for", real)
        # the user acts through discovery alone
        def both_ranks() -> bool:
            with HubClient(info["address"], master) as c:
                return len(c.snapshot()["ranks"]["rank"]) == 2

        assert wait_for(both_ranks, 60)
        env = {k: v for k, v in os.environ.items() if k not in ("RTOP_HUB", "RTOP_TOKEN")}
        out = subprocess.run([sys.executable, "-m", "rtop", "stacks", "--json"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        assert [r["rank"] for r in json.loads(out.stdout)["ranks"]] == [0, 1]
    finally:
        stop.touch()
        runner.join(120)
        if info is not None:
            os.kill(info["pid"], signal.SIGTERM)
    assert wait_for(lambda: not list(rdir.glob("hub-*.json"))
                    and not list(rdir.glob("hub-*.key")), 20), list(rdir.iterdir())
    assert done and all(r.get("times") for r in done[0])


def test_a_newer_viewer_reads_an_older_hubs_file_and_its_ranks_take_the_ingest_token():
    """An older hub's file holds the master token and has no key file: viewers still
    get the master, ranks only the ingest token derived from it."""
    from rtop.discovery import from_files
    from rtop.hub.service import ThreadedHub

    old_master = "an-older-hubs-master-token-0123456789"
    hub = ThreadedHub(token=old_master, record="").start()
    try:
        rdir = cdisc.runtime_dir()
        path = rdir / "hub-oldjob.json"
        path.write_text(json.dumps({"address": hub.address, "token": old_master,
                                    "pid": os.getpid(), "job": "oldjob"}))
        path.chmod(0o600)
        (found,) = [h for h in from_files() if h.job == "oldjob"]
        assert found.token == old_master
        with HubClient(found.address, found.token, role="control"):
            pass
        rank = Identity(rank=0, local_rank=0, world_size=2, hostname="n", ip="127.0.0.1",
                        pid=os.getpid(), job="oldjob", source="torch")
        got = cdisc.local_hub(rank, spawn=False)
        assert got is not None and got[2] == auth.role_token(old_master, "ingest")
    finally:
        hub.stop()


def test_the_key_file_goes_with_the_hub_file(tmp_path: Path) -> None:
    from rtop.discovery import find_hubs
    from rtop.hub.service import ThreadedHub

    rdir = cdisc.runtime_dir()
    path = rdir / "hub-keyjob.json"
    hub = ThreadedHub(job="keyjob", record="", discovery_file=str(path)).start()
    try:
        key = cdisc.hub_key_path(path)
        assert key == rdir / "hub-keyjob.key"
        assert [h.token for h in find_hubs(ray=False)] == [hub.token]  # one hub, not two
        assert json.loads(path.read_text())["token"] == hub.hub.role_token("ingest")
    finally:
        hub.stop()
    assert not path.exists() and not key.exists()


# ---- J: a squatted runtime directory ----------------------------------------------------


@pytest.fixture
def squat_base(tmp_path, monkeypatch) -> Path:
    """A stand-in for /tmp (sticky, world-writable), no $XDG_RUNTIME_DIR, and a home of
    the test's own for the pointer file."""
    base = tmp_path / "tmp"
    base.mkdir()
    base.chmod(0o1777)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setattr(cdisc, "FALLBACK_BASE", base)
    monkeypatch.setattr(cdisc, "_fallbacks", {})
    monkeypatch.setattr(cdisc, "_warned", set())
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    return base


def _fallback_ok(got: Path, base: Path) -> None:
    st = os.lstat(got)
    assert got.parent == base and got.name.startswith(f"rtop-{UID}-") and got.name != \
        f"rtop-{UID}-"
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == UID and stat.S_IMODE(st.st_mode) == 0o700


@needs_root
def test_someone_elses_tmp_runtime_dir_is_reported_and_a_private_one_used(squat_base,
                                                                          caplog):
    squatted = squat_base / f"rtop-{UID}"
    squatted.mkdir(mode=0o777)
    os.chown(squatted, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="collectors"):
        got = cdisc.runtime_dir()
        assert cdisc.runtime_dir() == got  # the same, and said once
    _fallback_ok(got, squat_base)
    (msg,) = [r.getMessage() for r in caplog.records if "squatting" in r.getMessage()]
    assert str(squatted) in msg and "uid 65534" in msg and str(got) in msg, msg
    pointer = cdisc.pointer_path()
    assert pointer is not None and pointer.read_text().strip() == str(got)
    assert stat.S_IMODE(pointer.stat().st_mode) == 0o600
    assert stat.S_IMODE(pointer.parent.stat().st_mode) == 0o700
    assert not list(squatted.iterdir())  # nothing of ours went there


def test_a_linked_tmp_runtime_dir_falls_back_and_a_stale_pointer_is_replaced(
        squat_base, tmp_path, caplog):
    target = tmp_path / "looks-private"
    target.mkdir(mode=0o700)
    (squat_base / f"rtop-{UID}").symlink_to(target)
    first = cdisc.runtime_dir()
    _fallback_ok(first, squat_base)
    assert not list(target.iterdir())
    # the fallback was cleaned away (a tmp cleaner), and a pointer left naming a folder
    # that is no longer a private one of ours: both replaced, never followed
    shutil.rmtree(first)
    cdisc._fallbacks.clear()
    second = cdisc.runtime_dir()
    _fallback_ok(second, squat_base)
    assert second != first
    second.chmod(0o755)
    cdisc._fallbacks.clear()
    third = cdisc.runtime_dir()
    _fallback_ok(third, squat_base)
    assert third != second
    assert cdisc.pointer_path().read_text().strip() == str(third)


_WHERE = """
import sys, time
from pathlib import Path
import collectors.discovery as d
d.FALLBACK_BASE = Path(sys.argv[1])  # the test's stand-in for /tmp
time.sleep(float(sys.argv[2]) - time.time())  # all start together
print(d.runtime_dir())
"""


def test_separate_processes_agree_on_the_fallback(squat_base):
    (squat_base / f"rtop-{UID}").write_text("not a directory")
    start = f"{time.time() + 2.0}"
    procs = [subprocess.Popen([sys.executable, "-c", _WHERE, str(squat_base), start],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT) for _ in range(4)]
    outs = [p.communicate(timeout=60) for p in procs]
    dirs = {o.strip() for o, _ in outs}
    assert len(dirs) == 1, outs
    (got,) = dirs
    _fallback_ok(Path(got), squat_base)
    assert all("not a directory" in e and got in e for _, e in outs), outs
    assert len([p for p in squat_base.iterdir() if p.name.startswith(f"rtop-{UID}-")]) == 1


_SQUATTED_JOB = r"""
set -e
mount --bind "$FAKE_TMP" /tmp
mkdir -m 0777 /tmp/rtop-{uid}
chown {nobody}:{nobody} /tmp/rtop-{uid}
mkdir -m 0700 /tmp/home
export HOME=/tmp/home
unset XDG_RUNTIME_DIR XDG_CACHE_HOME RTOP_HUB RTOP_TOKEN
# a rank with no settings: starts this node's hub (discovery) and streams to it
RTOP_AUTOHUB=1 "$PY" tests/spool_worker.py 0 1 3000 2> /tmp/rank1.err
# a viewer finds that hub
"$PY" -m rtop list > /tmp/list.out
exec "$PY" -c "$CHECK"
"""

_SQUATTED_CHECK = r"""
import json, os, signal, subprocess, sys, time
import collectors.discovery as d
from rtop.discovery import from_files
from rtop.hub.service import ThreadedHub

rdir = d.runtime_dir()
hubs = from_files()
res = {"rdir": str(rdir), "mode": oct(os.stat(rdir).st_mode & 0o777),
       "uid": os.stat(rdir).st_uid, "hubs": [h.address for h in hubs],
       "list": open("/tmp/list.out").read()}
for h in hubs:  # end the node's hub; what it recorded is reported
    pid = d.read_hub_file(rdir / f"hub-{h.job}.json")["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.path.exists(rdir / f"hub-{h.job}.json"):
        time.sleep(0.1)


def report(path):
    out = subprocess.run([sys.executable, "-m", "rtop", "report", path, "--json"],
                         capture_output=True, text=True)
    return [[r["rank"], r["steps"]] for r in json.loads(out.stdout)["ranks"]] \
        if out.returncode == 0 else out.stderr


res["node_hub"] = report(hubs[0].record) if hubs else None
# a rank whose hub is gone: its records go to a spool, which a later hub takes in
env = dict(os.environ, RTOP_AUTOHUB="0", RTOP_HUB="127.0.0.1:9", RTOP_TOKEN="x")
res["rank2_err"] = subprocess.run([sys.executable, "tests/spool_worker.py", "1", "2", "30"],
                                  env=env, capture_output=True, text=True).stderr[-2000:]
res["spools"] = sorted(p.name for p in rdir.glob("spool-*"))
hub = ThreadedHub(record="/tmp/later.rtop", spool_scan_s=0.2, spool_take_all=True).start()
deadline = time.monotonic() + 30
while time.monotonic() < deadline and not [p for p in rdir.glob("spool-*.ingested")
                                           if "-r1-" in p.name]:
    time.sleep(0.1)
hub.stop()
res["later_hub"] = report("/tmp/later.rtop")
res["rank1_err"] = open("/tmp/rank1.err").read()[-2000:]
res["squatted"] = os.listdir("/tmp/rtop-{uid}")
print(json.dumps(res))
"""


@needs_root
@pytest.mark.job
@pytest.mark.root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
@pytest.mark.skipif(any(Path(p).resolve().is_relative_to("/tmp")
                        for p in (sys.executable, ROOT)),
                    reason="the checkout or its interpreter lies under /tmp, which this "
                           "test replaces with a fresh one (a clone made there)")
def test_under_a_real_squat_of_tmp_discovery_and_spools_still_work(tmp_path):
    """The attack as it happens: another user (``nobody``) owns ``/tmp/rtop-<uid>``, in a
    mount namespace of the test's own whose ``/tmp`` is fresh. A rank with no settings
    starts its node's hub and streams to it, ``rtop list`` finds that hub, ``rtop report``
    has every step the rank took; a rank with no hub spools its records, and a later hub
    takes the spool in. Before: no hub, no discovery, no spool, and one warning."""
    fake = tmp_path / "fake-tmp"
    fake.mkdir()
    fake.chmod(0o1777)
    env = dict(os.environ, FAKE_TMP=str(fake), PY=sys.executable, PYTHONPATH=str(ROOT),
               CHECK=_SQUATTED_CHECK.replace("{uid}", str(UID)))
    script = _SQUATTED_JOB.replace("{uid}", str(UID)).replace("{nobody}", str(NOBODY))
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c",
                          script], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    rdir = res["rdir"]
    assert rdir.startswith(f"/tmp/rtop-{UID}-") and res["mode"] == "0o700" \
        and res["uid"] == UID, res
    for err in (res["rank1_err"], res["rank2_err"]):
        assert f"/tmp/rtop-{UID} belongs to uid {NOBODY}" in err and "squatting" in err \
            and rdir in err, err
    assert len(res["hubs"]) == 1 and res["hubs"][0] in res["list"], res
    assert res["node_hub"] == [[0, 3000]], res  # what the rank sent its node's hub
    assert any("-r1-" in name for name in res["spools"]), res
    assert [1, 30] in res["later_hub"], res  # the spool, taken in by a later hub
    assert res["squatted"] == [], res  # nothing of ours in the squatter's folder
