"""Issue 12, findings 3 (the recorder side), 9 and 10: secrets and files.

Each test plays the attack (a planted link or file, a name that climbs out of its
directory, a token where others can read it, a Ray caller without the token) and
checks that it now fails. Another local user is played by ``nobody`` (uid 65534):
these tests run as root, so files are chowned to it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from collectors import discovery as cdisc
from collectors import wire
from collectors.config import ProbeConfig, TokenFileError, read_token_file
from collectors.identity import Identity
from rtop.client import HubClient
from rtop.hub.recorder import Recorder
from rtop.hub.service import ThreadedHub
from rtop.run.recording import is_secret_key, plain_bytes, read
from rtop.workload import free_port
from tests import waiting

#: This module's pace: files and processes polled every 50 ms, given 20 s by default.
_wait_for = partial(waiting.wait_for, timeout=20.0, every=0.05)

RTOP = [sys.executable, "-m", "rtop"]
NOBODY = 65534
UID = os.geteuid()

needs_root = pytest.mark.skipif(UID != 0, reason="plays another user with chown (root)")


def _ident(job: str = "secjob") -> Identity:
    return Identity(rank=0, local_rank=0, world_size=2, hostname="node-a", ip="127.0.0.1",
                    pid=os.getpid(), job=job, source="env")


def _hub_info(address: str = "127.0.0.1:9", token: str = "attacker-token") -> str:
    # names a live pid (ours), as a planted file would, so only owner/mode can refuse it
    return json.dumps({"address": address, "token": token, "pid": os.getpid(), "job": "x"})


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def fallback(tmp_path, monkeypatch) -> Path:
    """A private stand-in for /tmp (sticky, world-writable) and no $XDG_RUNTIME_DIR, so
    runtime_dir() takes the /tmp/rtop-<uid> path, there; a home of the test's own (where
    the pointer to a fallback directory is kept)."""
    base = tmp_path / "tmp"
    base.mkdir()
    base.chmod(0o1777)
    (tmp_path / "home").mkdir(mode=0o700)
    monkeypatch.setattr(cdisc, "FALLBACK_BASE", base)
    monkeypatch.setattr(cdisc, "_fallbacks", {})
    monkeypatch.setattr(cdisc, "_warned", set())
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return base / f"rtop-{os.getuid()}"


# ---- finding 10: the runtime directory ------------------------------------------------


def test_a_planted_symlink_runtime_dir_is_refused(fallback, tmp_path, caplog):
    # another user makes /tmp/rtop-<uid> a link before we do (to a directory of ours:
    # the old check, which followed it, was satisfied; the link's owner can re-point it)
    target = tmp_path / "looks-private"
    target.mkdir(mode=0o700)
    fallback.symlink_to(target)
    with pytest.raises(PermissionError, match="symbolic link"):
        cdisc.private_dir(fallback)
    # runtime_dir() never uses it: it says so once and goes to a private directory
    with caplog.at_level(logging.WARNING, logger="collectors"):
        used = cdisc.runtime_dir()
        assert cdisc.local_hub(_ident(), spawn=False) is None  # inside a job: no exception
        assert cdisc.local_hub(_ident(), spawn=False) is None
    assert used != fallback and used.parent == fallback.parent and not used.is_symlink()
    assert _mode(used) == 0o700
    assert sum("symbolic link" in r.getMessage() for r in caplog.records) == 1
    assert not list(target.iterdir()), "nothing was written through the link"
    from rtop.discovery import from_files

    assert from_files() == []


@needs_root
def test_someone_elses_runtime_dir_is_refused(fallback, caplog):
    fallback.mkdir(mode=0o700)
    os.chown(fallback, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        cdisc.private_dir(fallback)
    with caplog.at_level(logging.WARNING, logger="collectors"):
        used = cdisc.runtime_dir()
    assert used != fallback and _mode(used) == 0o700 and used.stat().st_uid == UID
    assert any("belongs to uid 65534" in r.getMessage() for r in caplog.records)
    assert cdisc.local_hub(_ident(), spawn=False) is None


def test_our_runtime_dir_open_to_others_is_made_private(fallback):
    fallback.mkdir()
    fallback.chmod(0o755)
    assert cdisc.runtime_dir() == fallback
    assert _mode(fallback) == 0o700
    assert cdisc.runtime_dir() == fallback  # idempotent


def test_xdg_runtime_dir_must_be_ours_and_private(tmp_path, fallback, monkeypatch):
    shared = tmp_path / "shared-xdg"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could swap its rtop/ entry: not used
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
    assert cdisc.runtime_dir() == fallback
    shared.chmod(0o700)
    assert cdisc.runtime_dir() == shared / "rtop"
    assert _mode(shared / "rtop") == 0o700


# ---- finding 10: hub files --------------------------------------------------------------


@needs_root
def test_a_planted_hub_file_is_ignored(caplog):
    rdir = cdisc.runtime_dir()
    planted = rdir / f"hub-{cdisc.job_key(_ident())}.json"
    planted.write_text(_hub_info())
    planted.chmod(0o600)
    os.chown(planted, NOBODY, NOBODY)  # another user's file (root could plant it)
    with caplog.at_level(logging.WARNING, logger="collectors"):
        assert cdisc.read_hub_file(planted) is None
        # the ranks find no hub: they do not connect (and send proofs) to the planter's
        assert cdisc.local_hub(_ident(), spawn=False) is None
    assert sum("belongs to uid 65534" in r.getMessage() for r in caplog.records) == 1
    from rtop.discovery import find_hubs

    assert find_hubs(ray=False) == []


def test_hub_files_open_to_others_or_linked_are_ignored(tmp_path):
    rdir = cdisc.runtime_dir()
    good = rdir / "hub-good.json"
    good.write_text(_hub_info("127.0.0.1:7"))
    good.chmod(0o600)
    assert cdisc.read_hub_file(good) is not None  # the user's own 0600 file: used
    loose = rdir / "hub-loose.json"
    loose.write_text(_hub_info())
    loose.chmod(0o644)
    assert cdisc.read_hub_file(loose) is None
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(_hub_info())
    elsewhere.chmod(0o600)
    link = rdir / "hub-link.json"
    link.symlink_to(elsewhere)
    assert cdisc.read_hub_file(link) is None
    fifo = rdir / "hub-fifo.json"
    os.mkfifo(fifo, 0o600)
    assert cdisc.read_hub_file(fifo) is None  # and does not block on it
    from rtop.discovery import from_files

    assert [h.address for h in from_files()] == ["127.0.0.1:7"]


# ---- finding 10: names in paths -------------------------------------------------------


def test_names_are_made_safe_for_paths():
    safe = cdisc.safe_name
    assert safe("a/../../../x") == "a_.._.._.._x"
    assert safe("..") == "__" and safe(".hidden") == "_hidden"
    assert safe("") == "default" and safe("", "run") == "run"
    assert safe("ü/\x00\n") == "____"
    assert len(safe("x" * 500)) == 80 and len(safe("x" * 500, max_len=60)) == 60
    from rtop.discovery import hub_file_path

    rdir = cdisc.runtime_dir()
    assert hub_file_path("a/../../../x").parent == rdir
    from rtop.hub.recorder import default_record_path

    path = default_record_path("../../etc/x")
    assert path.parent == Path(os.environ["RTOP_RUNS_DIR"]) and "/" not in path.name


def test_serve_with_a_climbing_job_name_writes_inside_the_runtime_dir(tmp_path):
    rdir = cdisc.runtime_dir()
    proc = subprocess.Popen([*RTOP, "serve", "--job", "a/../../../x", "--no-record"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        inside = rdir / "hub-a_.._.._.._x.json"
        assert _wait_for(inside.exists), proc.poll()
        info = cdisc.read_hub_file(inside)
        assert info is not None and info["job"] == "a/../../../x"
        assert _mode(inside) == 0o600
        # where the old code wrote it: <rdir>/hub-a/../../../x.json
        assert not (rdir.parent.parent / "x.json").exists()
        assert not (rdir / "hub-a").exists()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
    assert not inside.exists(), "the hub removes its file when it ends"


# ---- finding 10: how files are written ---------------------------------------------------


def test_the_discovery_file_is_written_without_following_a_planted_temp_link(tmp_path):
    rdir = cdisc.runtime_dir()
    path = rdir / "hub-tmpjob.json"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    # the old temp name was predictable: <file>.<pid>.tmp, opened O_CREAT|O_TRUNC
    (rdir / f"hub-tmpjob.json.{os.getpid()}.tmp").symlink_to(victim)
    hub = ThreadedHub(job="tmpjob", record="", token="tmp-token",
                      discovery_file=str(path)).start()
    try:
        assert victim.read_text() == "precious"
        assert not path.is_symlink() and _mode(path) == 0o600
        # the ranks' ingest token in the hub file, the master in the key file beside it
        from collectors import auth

        assert json.loads(path.read_text())["token"] == auth.role_token("tmp-token", "ingest")
        key = cdisc.hub_key_path(path)
        assert not key.is_symlink() and _mode(key) == 0o600
        assert json.loads(key.read_text())["token"] == "tmp-token"
        assert [p.name for p in rdir.iterdir() if ".tmp" in p.name] == \
            [f"hub-tmpjob.json.{os.getpid()}.tmp"]  # only the planted link: no leftovers
    finally:
        hub.stop()
    assert not path.exists() and not cdisc.hub_key_path(path).exists()


def test_the_recorder_does_not_follow_links_nor_take_others_files(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "run.rtop"
    link.symlink_to(victim)
    with pytest.raises(PermissionError, match="symbolic link"):
        Recorder(link, {"job": "x"})
    assert victim.read_text() == "precious"
    fifo = tmp_path / "fifo.rtop"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(PermissionError, match="not a regular file"):
        Recorder(fifo, {"job": "x"})  # and does not block opening it
    loose = tmp_path / "loose.rtop"
    loose.write_bytes(b"")
    loose.chmod(0o644)
    Recorder(loose, {"job": "x"}).close()
    assert _mode(loose) == 0o600
    if UID == 0:
        theirs = tmp_path / "theirs.rtop"
        theirs.write_bytes(b"")
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(PermissionError, match="belongs to uid 65534"):
            Recorder(theirs, {"job": "x"})
        assert theirs.read_bytes() == b""


def test_rtop_serve_refuses_a_planted_recording_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "run.rtop"
    link.symlink_to(victim)
    proc = subprocess.run([*RTOP, "serve", "--record", str(link)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "symbolic link" in proc.stderr
    assert victim.read_text() == "precious"


# ---- finding 3: no secret in a recording --------------------------------------------------


def test_the_recorder_never_writes_a_secret(tmp_path):
    token = "tok-3f9a0c51-never-recorded"
    path = tmp_path / "run.rtop"
    rec = Recorder(path, {"job": "x", "token": token}, secrets=[token])
    clean = wire.encode("batch", {"rank": 0, "tables": {}, "note": "a tokenizer"})
    hello = wire.encode("hello", {
        "role": "rank", "token": token, "identity": {"rank": 0, "world_size": 1},
        "auth": {"proof": "ab" * 16, "nonce": "cd" * 8, "clientSecret": "s"},
        "collector": {"hub_token": "other", "tokens_per_s": 5.0}})
    leak = wire.encode("batch", {"rank": 0, "node": f"host {token}", "tables": {}})
    for data in (clean, hello, leak):
        rec.raw(data, 1.0)
    rec.frame("finding", {"kind": "x", "evidence": {"password": "p"}}, 2.0)
    rec.close()
    data = path.read_bytes() + plain_bytes(path)  # as stored, and decompressed
    assert token.encode() not in data
    for word in (b"proof", b"nonce", b"clientSecret", b"hub_token", b"password"):
        assert word not in data, word
    frames = [f for _, f in read(path)]
    assert wire.encode(frames[2].kind, frames[2].payload) == clean, \
        "a frame without secrets is recorded as it came"
    assert [f.kind for f in frames] == ["run", "clock", "batch", "hello", "batch", "clock",
                                        "finding", "end"]  # end: the recorder closed it
    hello_back = frames[3].payload
    assert hello_back["identity"] == {"rank": 0, "world_size": 1}
    assert hello_back["collector"] == {"tokens_per_s": 5.0}  # a metric, not a secret
    assert frames[4].payload["node"] == "[redacted]"
    assert rec.secrets_dropped == 8


def test_secret_names():
    for name in ("token", "Token", "hub_token", "authToken", "client-proof", "nonce",
                 "secret", "SECRET_KEY", "password"):
        assert is_secret_key(name), name
    for name in ("tokens_per_s", "step", "data_wait_s", "node", "tokenizer", "kind"):
        assert not is_secret_key(name), name


def test_no_file_of_a_real_run_holds_the_token(tmp_path):
    """A real hub, a real collector, a viewer: then every file under the test's
    directory (recording, hub files, logs) is searched for the token."""
    import collectors
    from collectors.identity import detect

    token = "tok-e2e-5b1d77aa-never-written"
    rdir = cdisc.runtime_dir()
    hub = ThreadedHub(job="e2e", record=str(tmp_path / "runs" / "e2e.rtop"), token=token,
                      discovery_file=str(rdir / "hub-e2e.json")).start()
    try:
        cfg = ProbeConfig.from_env(hub=hub.address, token=token, flush_interval_s=0.1)
        probe = collectors.Probe(detect(), cfg)
        for _ in probe.iter(range(20)):
            with probe.step():
                time.sleep(0.005)
        probe.close()
        with HubClient(hub.address, token) as client:
            assert client.snapshot()["ranks"]["rank"] == [0]
    finally:
        hub.stop()
    from collectors import auth

    secrets = [token.encode()] + [auth.role_token(token, r).encode() for r in auth.ROLES]
    found = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()
             and any(s in p.read_bytes() + plain_bytes(p) for s in secrets)]
    assert found == []
    assert (tmp_path / "runs" / "e2e.rtop").stat().st_size > 0


# ---- finding 9: the node hub's log ------------------------------------------------------


def test_an_auto_started_hub_logs_privately_and_without_its_token(monkeypatch):
    monkeypatch.setenv("RTOP_AUTOHUB", "1")
    rdir = cdisc.runtime_dir()
    ident = _ident("autolog")
    log_path = rdir / "hub-autolog.log"
    log_path.write_text("from an older rtop\n")
    log_path.chmod(0o644)
    found = cdisc.local_hub(ident, spawn=True)
    assert found is not None, log_path.read_text()
    info = cdisc.read_hub_file(rdir / "hub-autolog.json")
    assert info is not None and found[2] == info["token"]
    try:
        assert _wait_for(lambda: "RTOP_HUB=" in log_path.read_text())
        assert _mode(log_path) == 0o600
        assert _mode(rdir / "hub-autolog.lock") == 0o600
        text = log_path.read_text()
        master = cdisc.read_hub_key(rdir / "hub-autolog.json", info["pid"])
        assert master is not None and master != info["token"]  # the rank got the ingest token
        assert info["token"] not in text and master not in text
        assert "token in" in text  # it says where the token is instead
    finally:
        os.kill(info["pid"], signal.SIGTERM)
    assert _wait_for(lambda: not (rdir / "hub-autolog.json").exists())
    assert info["token"] not in log_path.read_text()


def test_the_node_hub_log_is_not_opened_through_a_link(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RTOP_AUTOHUB", "1")
    rdir = cdisc.runtime_dir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (rdir / "hub-linked.log").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="collectors"):
        assert cdisc.local_hub(_ident("linked"), spawn=True) is None
    assert victim.read_text() == "precious"
    assert any("symbolic link" in r.getMessage() for r in caplog.records)


# ---- finding 9: tokens on command lines and in files ---------------------------------------


def _token_file(tmp_path: Path, mode: int, token: str = "file-token-1234") -> Path:
    path = tmp_path / f"token-{mode:o}"
    path.write_text(token + "\n")
    path.chmod(mode)
    return path


def test_token_files_readable_by_others_are_refused(tmp_path):
    assert read_token_file(_token_file(tmp_path, 0o600)) == "file-token-1234"
    assert read_token_file(_token_file(tmp_path, 0o400)) == "file-token-1234"
    for mode in (0o640, 0o604, 0o644):
        with pytest.raises(TokenFileError, match="readable by other users"):
            read_token_file(_token_file(tmp_path, mode))
    empty = _token_file(tmp_path, 0o600, token="")
    with pytest.raises(TokenFileError, match="empty"):
        read_token_file(empty)
    if UID == 0:
        theirs = _token_file(tmp_path, 0o600, token="planted")
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(TokenFileError, match="belongs to uid 65534"):
            read_token_file(theirs)


@pytest.mark.parametrize("command", [["status", "127.0.0.1:9"], ["attach", "127.0.0.1:9"],
                                     ["serve", "--no-record"]])
def test_the_cli_refuses_a_token_file_others_can_read(tmp_path, command):
    loose = _token_file(tmp_path, 0o644)
    proc = subprocess.run([*RTOP, *command, "--token-file", str(loose)],
                          capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "readable by other users" in proc.stderr and "chmod 600" in proc.stderr


def test_a_token_on_the_command_line_is_warned_about(tmp_path):
    proc = subprocess.run([*RTOP, "status", f"127.0.0.1:{free_port()}", "--token", "t"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "--token is visible to every user of this machine" in proc.stderr
    assert "--token-file" in proc.stderr


def test_serve_and_status_with_a_token_file(tmp_path):
    token = "served-from-a-file-77"
    tfile = _token_file(tmp_path, 0o600, token)
    port = free_port()
    proc = subprocess.Popen([*RTOP, "serve", "--port", str(port), "--token-file", str(tfile),
                             "--no-record"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        assert _wait_for(up, timeout=30)
        with HubClient(f"127.0.0.1:{port}", token) as client:
            assert client.snapshot()["run"] is not None
        status = subprocess.run([*RTOP, "status", f"127.0.0.1:{port}", "--token-file",
                                 str(tfile), "--json"], capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        assert "visible" not in status.stderr
        env = dict(os.environ, RTOP_TOKEN_FILE=str(tfile))
        status = subprocess.run([*RTOP, "status", f"127.0.0.1:{port}", "--json"],
                                capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode == 0, status.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=15)[0]
    assert token not in out, "a token the user gave is not echoed"
    assert f"RTOP_HUB=127.0.0.1:{port}" in out


def test_a_collector_with_a_bad_token_file_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RTOP_TOKEN_FILE", str(_token_file(tmp_path, 0o644)))
    with caplog.at_level(logging.WARNING, logger="collectors"):
        cfg = ProbeConfig.from_env()
    assert cfg.token is None
    assert any("readable by other users" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("RTOP_TOKEN_FILE", str(tmp_path / "missing"))
    assert ProbeConfig.from_env().token is None
    monkeypatch.setenv("RTOP_TOKEN_FILE", str(_token_file(tmp_path, 0o600)))
    assert ProbeConfig.from_env().token == "file-token-1234"
    monkeypatch.setenv("RTOP_TOKEN", "env-wins")
    assert ProbeConfig.from_env().token == "env-wins"


# ---- finding 9: the Ray hub actor -------------------------------------------------------------


def test_the_ray_hub_actor_needs_the_token_to_shut_down(tmp_path):
    """The actor's methods, as any client of the Ray cluster would call them (the real
    actor under Ray: tests/test_ray_train.py)."""
    from collectors import auth
    from rtop.hub.ray_actor import RayHubActor

    actor = RayHubActor("ray-job", record=str(tmp_path / "ray.rtop"), host="127.0.0.1")
    try:
        master = actor._hub.token
        host, port, ingest = actor.address()
        view = actor.view_token()
        # what the actor hands out is what ranks and viewers need, nothing more
        assert ingest == auth.role_token(master, "ingest")
        assert view == auth.role_token(master, "view")
        info = actor.info()
        assert f"{host}:{port}" == info["address"] and info["token_given"] is False
        assert master not in json.dumps(info) and ingest not in json.dumps(info)
        for wrong in (None, "", "wrong", master[:-1], ingest, view):
            with pytest.raises(PermissionError, match="master or control token"):
                actor.shutdown(wrong)
        with HubClient(f"{host}:{port}", view) as client:  # still serving
            assert client.snapshot()["run"]["name"] == "ray-job"
        assert actor.shutdown(auth.role_token(master, "control")) == str(tmp_path / "ray.rtop")
    finally:
        actor._hub.stop()
    given = RayHubActor("ray-job2", record="", token="job-token-0123456789", host="127.0.0.1")
    try:
        assert given.address()[2] is None and given.view_token() is None
        assert given.info()["token_given"] is True
        with pytest.raises(PermissionError):
            given.shutdown("wrong")
        assert given.shutdown("job-token-0123456789") is None
    finally:
        given._hub.stop()
    # a job whose token cannot be a hub's (a role token): the actor makes its own
    role = RayHubActor("ray-job3", record="", host="127.0.0.1",
                       token=auth.role_token("x" * 20, "ingest"))
    try:
        assert role.info()["token_given"] is False and role.address()[2]
    finally:
        role._hub.stop()
