"""``rtop run -- CMD``: real commands, real processes, real hubs. A plain training loop
and a plain torchrun DDP job (nothing of rtop in either) instrumented through the
environment; exit codes and signals passed through; a terminal handed to the command;
processes that cannot be instrumented run unharmed with one warning; an error at each
of ``collectors.autoinstrument``'s guarded points never reaches the job."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from collectors import auth, wire
from collectors.schema import TABLES
from rtop.hub.service import ThreadedHub
from rtop.launch import command_env, exit_code, job_name
from rtop.report import build_report
from rtop.run.recording import read
from rtop.workload import free_port

ROOT = Path(__file__).resolve().parent.parent
RTOP_RUN = [sys.executable, "-m", "rtop", "run"]
TORCHRUN = Path(sys.executable).with_name("torchrun")
WARNING = "rtop: warning: process"


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no hub, token or rank of the test's own; private dirs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RTOP_", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_",
                                "TORCHELASTIC", "PYTHONPATH"))}
    xdg = tmp / "xdg"
    xdg.mkdir(mode=0o700, exist_ok=True)
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RTOP_AUTOHUB": "0",
                "RTOP_RUNS_DIR": str(tmp / "runs"), "XDG_RUNTIME_DIR": str(xdg), **extra})
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 180
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RTOP_RUN, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _steps(record: Path) -> dict[int, list[dict[str, Any]]]:
    """Every step record in a recording, by rank."""
    fields = TABLES["steps"]
    out: dict[int, list[dict[str, Any]]] = {}
    for _, frame in read(record):
        if frame.kind == wire.KIND_BATCH:
            rows = out.setdefault(frame.payload["rank"], [])
            rows += [dict(zip(fields, row, strict=True)) for row in frame.payload.get("steps", [])]
    return out


def _notes(record: Path) -> list[str]:
    """Every note the ranks sent (their batches' meta), in a recording."""
    return [note for _, frame in read(record) if frame.kind == wire.KIND_BATCH
            for note in (frame.payload.get("meta") or {}).get("notes", [])]


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(WARNING)]


# ---- a plain loop, one process ------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                              Path]:
    tmp = tmp_path_factory.mktemp("plain")
    record = tmp / "plain.rtop"
    proc = _run(["--record", str(record), "--", sys.executable, "tests/plain_train.py",
                 "--steps", "30", "--slow-s", "0.02"], _env(tmp))
    return proc, record


def test_plain_loop_is_instrumented_without_code(plain):
    proc, record = plain
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "done 30 steps"  # the command's stdout is its own
    assert f"rtop run: recording: {record}" in proc.stderr  # printed at the end
    assert _warnings(proc.stderr) == []
    rows = _steps(record)
    assert list(rows) == [0]
    steps = rows[0]
    assert [r["step"] for r in steps] == list(range(30))  # every step, the first too
    for r in steps:
        assert 0.018 <= r["data_wait_s"] <= 0.2, r  # the loader's 20 ms per batch
        assert r["compute_s"] is not None and r["samples"] == 8
    # no wait counted as compute: that would make every step's compute 20 ms or more
    # (the median, since a step of a tiny MLP can take 20 ms on a busy machine)
    compute = sorted(r["compute_s"] for r in steps)
    assert compute[len(compute) // 2] < 0.018, compute
    report = build_report(record)
    (rank,) = report["ranks"]
    assert rank["steps"] == 30 and rank["comm_s"] is None  # no DDP: not measured, not 0


def test_the_rank_says_it_was_instrumented_by_rtop_run(plain):
    from collectors.autoinstrument import NOTE

    _, record = plain
    notes = _notes(record)
    assert NOTE in notes


def test_micro_batches_validation_and_persistent_workers(tmp_path):
    """Each micro-batch is a step; a loader under no_grad is not training; a reused
    (persistent workers') iterator is timed every epoch."""
    record = tmp_path / "loops.rtop"
    proc = _run(["--record", str(record), "--", sys.executable, "tests/plain_train.py",
                 "--steps", "6", "--epochs", "2", "--accumulate", "2", "--validate",
                 "--workers", "1", "--persistent", "--slow-s", "0.01"], _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout == "done 12 steps\n" and _warnings(proc.stderr) == []
    steps = _steps(record)[0]
    assert [r["step"] for r in steps] == list(range(12))  # 12 batches, 6 optimizer steps
    assert all(r["data_wait_s"] is not None and r["samples"] == 8 for r in steps)


@pytest.mark.parametrize("via", ["start", "current"])
def test_steps_timed_by_the_code_from_a_late_start_are_recorded_once(tmp_path, via):
    """Code that starts timing its own steps once rtop run's probe runs (a Hugging Face
    or Lightning callback calls ``collectors.start()`` after the model is built) gets
    that probe: the automatic timing stands aside and each batch is one step, once.
    Through ``collectors.start()`` it is told, and leaves the step the fetch just began
    to the code (with its wait); through ``collectors.current()`` it is not, and sees
    the code's step inside its own at the next boundary."""
    record = tmp_path / "own.rtop"
    proc = _run(["--record", str(record), "--", sys.executable, "tests/plain_train.py",
                 "--steps", "12", "--own-steps-from", "4", "--own-steps-via", via,
                 "--slow-s", "0.01"], _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout == "done 12 steps\n" and _warnings(proc.stderr) == []
    steps = _steps(record)[0]
    assert [r["step"] for r in steps] == list(range(12))
    # the automatic steps (a fetch begins each) carry the data wait, and so does the
    # code's first (it got the automatic step's wait, or ran inside that step); the
    # code's later steps do not (its loop does not time the loader)
    assert all(r["data_wait_s"] is not None for r in steps[:5]), steps[:5]
    assert all(r["data_wait_s"] is None for r in steps[5:]), steps[5:]
    notes = _notes(record)
    assert any("stands aside: the code records steps of its own" in n for n in notes), notes


NO_LOADER = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 4)
for _ in range(10):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_without_a_dataloader_a_step_runs_from_optimizer_step_to_optimizer_step(tmp_path):
    record = tmp_path / "noloader.rtop"
    proc = _run(["--record", str(record), "--", sys.executable, "-c", NO_LOADER],
                _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = _steps(record)[0]
    assert len(steps) == 9  # the first optimizer step starts the probe (and the next step)
    assert all(r["data_wait_s"] is None and r["compute_s"] is not None for r in steps)


# ---- torchrun DDP with a starved rank -----------------------------------------------------


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                            Path]:
    tmp = tmp_path_factory.mktemp("ddp")
    record = tmp / "ddp.rtop"
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m",
                                                         "torch.distributed.run"]
    proc = _run(["--record", str(record), "--", *launcher, "--nproc-per-node", "2",
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                 "tests/plain_ddp_train.py", "--steps", "60", "--slow-s", "0.05"],
                _env(tmp), timeout=300)
    return proc, record


def test_torchrun_job_names_the_starved_rank_and_nothing_else(ddp):
    proc, record = ddp
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"rtop run: recording: {record}" in proc.stderr
    report = build_report(record)
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("starved_rank", [1])], \
        report["findings"]
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert sorted(ranks) == [0, 1]  # the launcher is not a rank
    assert not report.get("previous_attempts")
    for r in ranks.values():
        assert r["steps"] == 60
        assert r["comm_bytes"] and r["comm_bytes"] > 0  # DDP watched when it was built
        for figure in ("data_wait_s", "compute_s", "comm_s", "step_s"):
            assert r[figure] is not None, (r["rank"], figure)
    assert 0.045 <= ranks[1]["data_wait_s"] <= 0.08
    assert ranks[0]["data_wait_s"] < 0.01


def test_only_the_workers_connected(ddp):
    _, record = ddp
    hellos = [frame.payload for _, frame in read(record) if frame.kind == wire.KIND_HELLO]
    identities = sorted((h["identity"]["rank"], h["identity"]["world_size"],
                         h["identity"]["source"]) for h in hellos)
    assert identities == [(0, 2, "torch"), (1, 2, "torch")]


def test_fsdp2_is_watched_without_code(tmp_path):
    """``fully_shard`` on each layer and on the root: the root is watched, and FSDP's own
    collectives are measured (``collectors.collectives``)."""
    record = tmp_path / "fsdp.rtop"
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m",
                                                         "torch.distributed.run"]
    proc = _run(["--record", str(record), "--", *launcher, "--nproc-per-node", "2",
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                 "tests/plain_fsdp_train.py", "--steps", "10"], _env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "param_bytes" in proc.stdout
    ranks = {r["rank"]: r for r in build_report(record)["ranks"]}
    assert sorted(ranks) == [0, 1]
    for r in ranks.values():
        assert r["steps"] == 10
        assert r["comm_bytes"] and r["comm_bytes"] > 0, r  # FSDP's all-gathers and more


# ---- exit codes and signals ---------------------------------------------------------------


def test_a_failing_command_exit_code_is_passed_through(tmp_path):
    proc = _run(["--", sys.executable, "-c", "import sys; print('out'); sys.exit(7)"],
                _env(tmp_path))
    assert proc.returncode == 7 and proc.stdout == "out\n"
    assert "no process of the command was instrumented" in proc.stderr
    assert _warnings(proc.stderr) == []  # no torch: nothing to instrument, no warning


def test_a_missing_command_and_no_command(tmp_path):
    proc = _run(["--", "no-such-command-rtop"], _env(tmp_path))
    assert proc.returncode == 127 and "command not found" in proc.stderr
    proc = _run([], _env(tmp_path))
    assert proc.returncode == 2 and "give a command" in proc.stderr


def _start_forever(tmp: Path, record: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*RTOP_RUN, "--record", str(record), "--", sys.executable, "tests/plain_train.py",
         "--forever", "--slow-s", "0.01"], cwd=ROOT, env=_env(tmp), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # after its first steps
    assert line == "training\n", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_rtop_run_reaches_the_command(tmp_path, sig, code):
    record = tmp_path / "forever.rtop"
    proc = _start_forever(tmp_path, record)
    deadline = time.monotonic() + 30  # the hub has recorded steps (SIGTERM leaves no flush)
    while time.monotonic() < deadline and len(_steps(record).get(0, [])) < 5:
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-3000:]
    assert f"rtop run: recording: {record}" in err  # still printed
    rows = _steps(record)
    assert list(rows) == [0] and len(rows[0]) >= 5


CTTY = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
        "os.execvp(sys.argv[1], sys.argv[1:])")


def _on_terminal(tmp: Path, argv: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    """``rtop run ARGV`` as the foreground job of a new pseudo-terminal."""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-c", CTTY, *RTOP_RUN, *argv], cwd=ROOT,
                            env=_env(tmp), stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)
    return proc, master


def _read_until(master: int, want: bytes, timeout: float = 60) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while want not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every process on the terminal closed it
                break
            if not chunk:
                break
            seen += chunk
    return seen


def test_on_a_terminal_the_command_is_the_foreground_job(tmp_path):
    """It reads the terminal (without the terminal it would be stopped, SIGTTIN)."""
    proc, master = _on_terminal(tmp_path, ["--", sys.executable, "-c",
                                           "print('got', input('name? '))"])
    try:
        assert b"name? " in _read_until(master, b"name? ")
        os.write(master, b"bob\n")
        out = _read_until(master, b"recording:")
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(master)
    assert b"got bob" in out


def test_on_a_terminal_ctrl_c_stops_the_command(tmp_path):
    record = tmp_path / "tty.rtop"
    proc, master = _on_terminal(tmp_path, ["--record", str(record), "--", sys.executable,
                                           "tests/plain_train.py", "--forever",
                                           "--slow-s", "0.01"])
    try:
        assert b"training" in _read_until(master, b"training")
        os.write(master, b"\x03")  # Ctrl-C: the terminal signals its foreground job
        out = _read_until(master, b"(rtop report")
        assert proc.wait(timeout=60) == 130, out.decode(errors="replace")[-3000:]
    finally:
        os.close(master)
    assert f"recording: {record}".encode() in out


def test_on_a_terminal_ctrl_z_stops_the_command_and_rtop_run_together(tmp_path):
    code = "import time\nfor i in range(30):\n    print('tick', i, flush=True); time.sleep(0.1)"
    proc, master = _on_terminal(tmp_path, ["--", sys.executable, "-c", code])
    try:
        assert b"tick 3" in _read_until(master, b"tick 3")
        os.write(master, b"\x1a")  # Ctrl-Z: the terminal stops its foreground job
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline and state != "T":
            time.sleep(0.1)
            state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "T", "rtop run did not stop with its command"
        _read_until(master, b"never", timeout=0.5)
        os.kill(proc.pid, signal.SIGCONT)  # what the shell's fg does (besides the terminal)
        out = _read_until(master, b"(rtop report", timeout=60)
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(master)
    assert b"tick 29" in out  # the command went on where it stopped


# ---- what cannot be instrumented runs unharmed ----------------------------------------------


def _fake_package(root: Path, name: str, code: str) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(code)
    return root


def test_a_torch_that_cannot_be_patched_warns_once(tmp_path):
    fake = _fake_package(tmp_path / "fake", "torch", "__version__ = '0.0-fake'\n")
    env = _env(tmp_path, PYTHONPATH=f"{fake}{os.pathsep}{ROOT}")
    proc = _run(["--", sys.executable, "-c",
                 "import torch, torch; print('ran', torch.__version__)"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ran 0.0-fake\n"
    (warning,) = _warnings(proc.stderr)
    assert "cannot be patched" in warning and "as it would without rtop" in warning


def test_a_process_that_cannot_load_the_collectors_still_trains(tmp_path):
    broken = _fake_package(tmp_path / "broken", "msgpack",
                           "raise ImportError('no msgpack in this interpreter')\n")
    # only the command's interpreter lacks it (rtop run's own needs msgpack)
    proc = _run(["--", "sh", "-c", f'PYTHONPATH="$PYTHONPATH:{broken}" exec "$0" "$@"',
                 sys.executable, "tests/plain_train.py", "--steps", "3", "--slow-s", "0"],
                _env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done 3 steps\n"
    (warning,) = _warnings(proc.stderr)
    assert "collectors cannot be imported" in warning and "no msgpack" in warning
    assert "no process of the command was instrumented" in proc.stderr


def test_the_users_sitecustomize_still_runs(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("MARK = 'the user sitecustomize'\n")
    env = _env(tmp_path, PYTHONPATH=f"{mine}{os.pathsep}{ROOT}")
    proc = _run(["--", sys.executable, "-c",
                 "import os, sitecustomize; print(sitecustomize.MARK, os.environ['RTOP_AUTO'])"],
                env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "the user sitecustomize 1\n"


def test_rtop_auto_0_only_provides_the_hub(tmp_path):
    code = ("import os, sys; print(os.environ['RTOP_HUB'] != '', "
            "os.environ['RTOP_TOKEN'].startswith('rtop-ingest-'), 'RTOP_AUTO' in os.environ "
            "and os.environ['RTOP_AUTO'], 'sitecustomize' in sys.modules and "
            "'_autoload' in (sys.modules['sitecustomize'].__file__ or ''))")
    proc = _run(["--", sys.executable, "-c", code], _env(tmp_path, RTOP_AUTO="0"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "True True 0 False\n"
    assert "no process of the command was instrumented" not in proc.stderr


# ---- a hub given --------------------------------------------------------------------------


def test_a_given_hub_is_used_and_told_the_ingest_token_only(tmp_path):
    record = tmp_path / "given.rtop"
    master = "a-master-token-for-the-test"
    hub = ThreadedHub(record=str(record), token=master).start()
    try:
        env = _env(tmp_path, RTOP_TOKEN=master)
        check = ("import os; t = os.environ['RTOP_TOKEN']; "
                 f"assert t != {master!r} and t.startswith('rtop-ingest-'), t")
        proc = _run(["--hub", hub.address, "--", sys.executable, "-c", check], env)
        assert proc.returncode == 0, proc.stderr
        proc = _run(["--hub", hub.address, "--", sys.executable, "tests/plain_train.py",
                     "--steps", "5", "--slow-s", "0.005"], env)
        assert proc.returncode == 0, proc.stderr
        assert f"rtop run: recording: {record}" in proc.stderr
        refused = _run(["--hub", hub.address, "--record", str(tmp_path / "x.rtop"), "--",
                        "true"], env)
        assert refused.returncode == 2 and "--record" in refused.stderr
        view = _run(["--hub", hub.address, "--", "true"],
                    _env(tmp_path, RTOP_TOKEN=auth.role_token(master, "view")))
        assert view.returncode == 2 and "view token" in view.stderr
    finally:
        hub.stop()
    assert len(_steps(record)[0]) == 5


# ---- never into the job ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "bare.json"
    subprocess.run([sys.executable, "tests/auto_faults.py", "--bare", "--out", str(out),
                    "--port", str(free_port())], cwd=ROOT, env=_env(tmp), check=True,
                   timeout=120)
    return json.loads(out.read_text())


@pytest.mark.parametrize("point", ["none", "auto.start", "auto.fetch", "auto.optimizer",
                                   "auto.model"])
def test_a_fault_in_the_instrumentation_never_reaches_the_job(tmp_path, reference, point):
    from collectors.autoinstrument import POINTS

    assert {"auto.start", "auto.fetch", "auto.optimizer", "auto.model"} == set(POINTS)
    out = tmp_path / "out.json"
    proc = _run(["--record", str(tmp_path / "r.rtop"), "--", sys.executable,
                 "tests/auto_faults.py", "--fault", point, "--out", str(out), "--port",
                 str(free_port())], _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["steps"] == reference["steps"] == 8
    assert got["params"] == reference["params"], "the job's result differs"
    said = [line for line in proc.stderr.splitlines() if "injected" in line]
    if point == "none":
        assert said == [] and got["off"] is False and got["recorded"] == 8
        return
    assert len(said) == 1 and point in said[0], proc.stderr[-3000:]  # warned once
    assert got["off"] is True
    if point == "auto.start":
        assert got["notes"] == []  # no probe was started
        return
    noted = [n for n in got["notes"] if n.startswith("rtop turned off")]
    assert len(noted) == 1 and point in noted[0]


# ---- small pieces -------------------------------------------------------------------------


def test_job_name_and_exit_code():
    assert job_name(["torchrun", "--nproc-per-node", "2", "path/train.py"]) == "train"
    assert job_name(["python", "-m", "pkg.trainer"]) == "trainer"
    assert job_name(["/usr/bin/my job"]) == "my_job"
    assert exit_code(-2) == 130 and exit_code(3) == 3 and exit_code(0) == 0


def test_command_env_carries_no_master_token_and_keeps_pythonpath():
    env = command_env({"PYTHONPATH": "/a", "RTOP_TOKEN_FILE": "/secret", "X": "1"},
                      "127.0.0.1:1", "rtop-ingest-abc")
    assert env["RTOP_TOKEN"] == "rtop-ingest-abc" and "RTOP_TOKEN_FILE" not in env
    first, rest = env["PYTHONPATH"].split(os.pathsep, 1)
    assert first.endswith(os.path.join("collectors", "_autoload")) and rest == "/a"
    assert env["RTOP_AUTO"] == "1" and env["X"] == "1"
    assert "" not in command_env({}, "h:1", "t")["PYTHONPATH"].split(os.pathsep)
