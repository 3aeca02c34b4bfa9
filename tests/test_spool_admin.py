"""Spools are bounded on disk, listed and pruned by hand, and counted where people look.

Real spool files (written by ``collectors.spool.write_spool``) in a real runtime
directory: pruning by age (``os.utime``) and by the byte budget (a small budget
monkeypatched), a real hub that prunes and says so in one line, ``rtop spool list`` and
``rtop spool prune`` run as a user runs them, and the hub's spool counters in the
header and the Prometheus text.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors import wire
from collectors.identity import detect
from collectors.spool import OVERHEAD_BYTES, write_spool
from rtop.hub.metrics import HUB_COUNTERS, prometheus_text
from rtop.hub.service import ThreadedHub
from rtop.run import spool as sp
from rtop.run.snapshot import HubInfo

ROOT = Path(__file__).resolve().parents[1]
DAY = 86400.0


def _batch(rank: int, seq: int, steps: int, pad: int) -> bytes:
    rows = [[seq * steps + i, 0.0] for i in range(steps)]
    return wire.encode(wire.KIND_BATCH, {"rank": rank, "seq": seq, "steps": rows,
                                         "pad": "x" * pad})


def _spool(directory: Path, rank: int, *, age_s: float = 0.0, state: str = "",
           batches: int = 4, pad: int = 0, max_bytes: int = 1 << 26) -> Path:
    """A real spool of ``rank`` (``batches`` of 5 steps) in ``directory``, renamed to a
    state's suffix (``.ingested``, ``.bad``, ``.claim-PID``) and last touched ``age_s``
    ago."""
    ident = detect(rank=rank, world_size=16)
    frames = [(_batch(rank, s, 5, pad), 5) for s in range(batches)]
    res = write_spool(ident, frames, {"identity": ident.to_wire()},
                      {"rank": rank, "reason": "closed", "dropped": 0},
                      max_bytes=max_bytes, timeout_s=10.0, directory=directory)
    assert res.path is not None, res.error
    path = Path(res.path)
    if state:
        path = path.rename(path.with_name(path.name + state))
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _file(directory: Path, name: str, data: bytes, age_s: float = 0.0,
          mode: int = 0o600) -> Path:
    path = directory / name
    path.write_bytes(data)
    os.chmod(path, mode)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


# ---- pruning ------------------------------------------------------------------------


def test_prune_by_age_keeps_what_is_young_or_being_recorded(tmp_path: Path) -> None:
    d = tmp_path / "spools"
    old_waiting = _spool(d, 0, age_s=8 * DAY)
    young_waiting = _spool(d, 1, age_s=6 * DAY)
    old_ingested = _spool(d, 2, age_s=2 * DAY, state=sp.INGESTED)
    new_ingested = _spool(d, 3, age_s=3600, state=sp.INGESTED)
    old_bad = _file(d, "spool-x-r4-a0-p1.rtop.bad", b"junk", 8 * DAY)
    recording = _spool(d, 5, age_s=30 * DAY, state=f".claim-{os.getpid()}")  # a live hub
    orphan = _spool(d, 6, age_s=8 * DAY, state=f".claim-{_dead_pid()}")  # its hub is gone
    old_tmp = _file(d, ".spool-x-r7-a0-p1-abc.rtop.123.tmp", b"half", 2 * DAY)
    new_tmp = _file(d, ".spool-x-r8-a0-p1-abc.rtop.456.tmp", b"half", 10)
    other = _file(d, "hub-job.json", b"{}", 30 * DAY)

    res = sp.prune(d, time.time())
    assert not res.errors
    assert {r.path for r in res.removed} == {old_waiting, old_ingested, old_bad, orphan,
                                              old_tmp}
    assert all(r.why == "age" for r in res.removed)
    assert {r.path: r.state for r in res.removed}[orphan] == sp.WAITING
    for kept in (young_waiting, new_ingested, recording, new_tmp, other):
        assert kept.exists(), kept
    assert res.unrecorded == 3  # the waiting, the orphaned claim, the bad one
    summary = res.summary()
    assert summary.startswith("removed 5 spool files (")
    assert "2 waiting over 7d (no hub took them)" in summary
    assert "1 ingested over 1d ago" in summary and "1 bad (unreadable) over 7d old" in summary
    assert "1 half-written" in summary
    # nothing left past its time: a second pass removes nothing
    assert not sp.prune(d, time.time()).removed


def test_prune_by_budget_oldest_first_never_the_young_or_claimed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "spools"
    w1 = _spool(d, 0, age_s=3 * 3600, pad=2000)
    w2 = _spool(d, 1, age_s=2 * 3600, pad=2000)
    ingested = _spool(d, 2, age_s=600, state=sp.INGESTED, pad=2000)  # recorded: first
    w3 = _spool(d, 3, age_s=1800, pad=2000)
    claimed = _spool(d, 4, age_s=4 * 3600, state=f".claim-{os.getpid()}", pad=2000)
    young = _spool(d, 5, age_s=10, pad=2000)  # its hub may be about to take it
    size = {p: p.stat().st_size for p in (w1, w2, ingested, w3, claimed, young)}
    # room for three: the ingested one goes first, then the oldest waiting ones
    monkeypatch.setattr(sp, "SPOOLS_BUDGET_BYTES", size[w3] + size[claimed] + size[young]
                        + 100)
    res = sp.prune(d, time.time())
    assert [r.path for r in res.removed] == [ingested, w1, w2]
    assert all(r.why == "budget" for r in res.removed)
    assert "waiting beyond the" in res.summary() and "budget of all spools" in res.summary()
    assert w3.exists() and claimed.exists() and young.exists()
    # no room at all: still never the claimed one, nor one younger than a few minutes
    monkeypatch.setattr(sp, "SPOOLS_BUDGET_BYTES", 0)
    res = sp.prune(d, time.time())
    assert [r.path for r in res.removed] == [w3]
    assert claimed.exists() and young.exists()
    monkeypatch.setattr(sp, "MIN_PRUNE_AGE_S", 5.0)
    assert [r.path for r in sp.prune(d, time.time()).removed] == [young]
    assert claimed.exists()


def test_prune_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not sp.prune(tmp_path / "missing", time.time()).removed
    f = _file(tmp_path, "not-a-dir", b"x")
    assert not sp.prune(f, time.time()).removed
    # the runtime directory unusable (a symbolic link planted in its place)
    xdg = tmp_path / "xdg2"
    xdg.mkdir(mode=0o700)
    (xdg / "rtop").symlink_to(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    res = sp.prune(None, time.time())
    assert not res.removed and "symbolic link" in res.errors[0]


@pytest.mark.timeout(60)
def test_hub_prunes_and_says_so_in_one_line(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Even a hub that does not record bounds the spools of its directory: one log line
    per pass that removed any, a warning when records no hub recorded went."""
    d = tmp_path / "spools"
    lost = _spool(d, 0, age_s=8 * DAY)  # another job's, never taken: its hub never came
    done = _spool(d, 1, age_s=2 * DAY, state=sp.INGESTED)
    kept = _spool(d, 2, age_s=60)
    caplog.set_level(logging.INFO, logger="rtop.hub")
    hub = ThreadedHub(record="", spool_dir=str(d), spool_scan_s=0.2).start()
    try:
        deadline = time.monotonic() + 20
        while (lost.exists() or done.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # a few passes more, which remove nothing
        assert hub.hub is not None and hub.hub.spools is not None
        counters = dict(hub.hub.spools.counters)
    finally:
        hub.stop()
    assert not lost.exists() and not done.exists() and kept.exists()
    lines = [r for r in caplog.records if "spools in" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.WARNING  # records no hub recorded are gone
    msg = lines[0].getMessage()
    assert str(d) in msg and "removed 2 spool files" in msg
    assert "1 waiting over 7d (no hub took them)" in msg and "1 ingested over 1d ago" in msg
    assert counters["spools_pruned"] == 1 and counters["spools"] == 0


# ---- rtop spool -----------------------------------------------------------------------


def _rtop(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rtop", "spool", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=env or os.environ.copy())


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    """The runtime directory ``rtop spool`` looks in (conftest points XDG_RUNTIME_DIR at
    this test's own)."""
    return Path(os.environ["XDG_RUNTIME_DIR"]) / "rtop"


def test_spool_list_says_what_each_holds(runtime: Path) -> None:
    out = _rtop("list")
    assert out.returncode == 0 and out.stdout.startswith("no spool files in"), out
    waiting = _spool(runtime, 0, age_s=3 * 3600)
    # a spool whose bound left its oldest batches out (counted)
    frame = len(_batch(1, 0, 5, 3000))
    cut = _spool(runtime, 1, batches=6, pad=3000, max_bytes=OVERHEAD_BYTES + 2 * frame + 10)
    ingested = _spool(runtime, 2, state=sp.INGESTED)
    claimed = _spool(runtime, 3, state=f".claim-{os.getpid()}")
    damaged = _spool(runtime, 4, batches=6)
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) - 30])  # inside its end frame
    junk = _file(runtime, "spool-x-r5-a0-p1.rtop.bad", b"not a spool at all")
    open_to_all = _file(runtime, "spool-x-r6-a0-p2.rtop", b"whatever", mode=0o644)
    half = _file(runtime, ".spool-x-r7-a0-p3-abc.rtop.9.tmp", b"")

    out = _rtop("list", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["directory"] == str(runtime) and got["budget_bytes"] == 1 << 30
    by = {s["file"]: s for s in got["spools"]}
    assert set(by) == {p.name for p in (waiting, cut, ingested, claimed, damaged, junk,
                                        open_to_all, half)}
    assert got["total_bytes"] == sum(s["size_bytes"] for s in got["spools"])
    w = by[waiting.name]
    assert (w["state"], w["rank"], w["records"], w["dropped_records"], w["error"]) == \
        ("waiting", 0, 20, 0, None)
    assert w["hostname"] == detect(rank=0).hostname and w["pid"] == os.getpid()
    assert 3 * 3600 - 5 < w["age_s"] < 3 * 3600 + 60
    c = by[cut.name]
    assert c["records"] == 10 and c["dropped_records"] == 20  # 2 of 6 batches kept
    assert by[ingested.name]["state"] == "ingested" and by[claimed.name]["state"] == "claimed"
    dm = by[damaged.name]
    assert dm["state"] == "waiting" and "truncated" in dm["error"]
    assert dm["records"] == 30  # read whole: what a hub would take of it
    assert by[junk.name]["state"] == "bad" and "not an rtop spool" in by[junk.name]["error"]
    assert by[open_to_all.name]["state"] == "bad"
    assert "others may read it (mode 0644)" in by[open_to_all.name]["error"]
    assert by[half.name]["state"] == "partial"

    out = _rtop("list")
    assert out.returncode == 0 and not out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:5] == ["STATE", "AGE", "SIZE", "RECORDS", "LEFT"]
    row = next(line for line in lines if line.endswith(waiting.name)).split()
    assert row[:2] == ["waiting", "3h"] and row[4:6] == ["20", "0"]
    assert str(os.getpid()) in row
    row = next(line for line in lines if line.endswith(cut.name)).split()
    assert row[4:6] == ["10", "20"]
    bad = lines.index(next(line for line in lines if line.endswith(open_to_all.name)))
    assert "others may read it" in lines[bad + 1]
    assert lines[-1].startswith("8 spool files, ") and "of the 1 GiB budget" in lines[-1]


def test_spool_prune_removes_and_says_which(runtime: Path) -> None:
    old = _spool(runtime, 0, age_s=3 * DAY)
    new = _spool(runtime, 1, age_s=3600)
    ingested = _spool(runtime, 2, age_s=600, state=sp.INGESTED)
    claimed = _spool(runtime, 3, age_s=30 * DAY, state=f".claim-{os.getpid()}")

    out = _rtop("prune")  # the week: nothing is that old but the one being recorded
    assert out.returncode == 0 and out.stdout.startswith("nothing to remove in"), out
    out = _rtop("prune", "--older-than", "2d")
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.splitlines()
    assert first.startswith(f"removed {old.name}: ") and "3d old" in first
    assert first.endswith("waiting over 2d (no hub took them)")
    assert last.startswith("removed 1 spool file (") and last.endswith(f"in {runtime}")
    assert not old.exists() and new.exists() and ingested.exists() and claimed.exists()

    out = _rtop("prune", "--all-ingested")
    assert out.returncode == 0
    assert out.stdout.splitlines()[0].endswith("ingested (all asked for)")
    assert not ingested.exists() and new.exists() and claimed.exists()


def test_spool_errors_are_one_line(tmp_path: Path) -> None:
    out = _rtop("prune", "--older-than", "soon")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == ("rtop spool prune: error: argument --older-than: "
                                           "'soon' is not a duration like 2d, 6h, 30m or 45s")
    # a runtime directory that is not the user's own: refused, said in one line
    xdg = tmp_path / "elsewhere"
    xdg.mkdir(mode=0o700)
    (xdg / "rtop").symlink_to(tmp_path)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg)}
    for args in (("list",), ("prune",)):
        out = _rtop(*args, env=env)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        (line,) = out.stderr.splitlines()
        assert line.startswith("rtop spool: ") and "symbolic link" in line


@pytest.mark.parametrize(("text", "seconds"), [
    ("2d", 2 * DAY), ("6h", 6 * 3600), ("30m", 1800), ("45s", 45), ("90", 90), ("1w", 7 * DAY),
    ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    from rtop.run.spool_admin import parse_duration

    assert parse_duration(text) == seconds


# ---- the counts where people look -----------------------------------------------------


def _snapshot(counters: dict[str, int]) -> Any:
    from rtop.analysis import Monitor

    return Monitor(diagnose=False).snapshot(hub=HubInfo(address="127.0.0.1:1",
                                                        counters=counters, record=None))


def test_header_shows_records_from_spools_only_when_some_came() -> None:
    from tests.faultkit import header_text

    assert "from spools" not in header_text(_snapshot({"spool_records": 0}))
    assert "from spools" not in header_text(_snapshot({}))
    text = header_text(_snapshot({"spool_records": 6030, "spools": 2}))
    assert "rtop 0 dropped, 6030 from spools" in text


def test_spool_counters_are_exported_with_their_help() -> None:
    counts = {"spools": 2, "spool_records": 6030, "spool_dropped_records": 7,
              "spools_bad": 1, "spools_damaged": 1, "spools_pruned": 3}
    families = {f.name: f for f in text_string_to_metric_families(
        prometheus_text(_snapshot(counts)))}
    for key, n in counts.items():
        fam = families[f"rtop_hub_{key}"]
        assert fam.type == "counter" and fam.documentation == HUB_COUNTERS[key]
        assert [s.value for s in fam.samples if s.name.endswith("_total")] == [n]
