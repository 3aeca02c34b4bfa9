"""``rtop run [--record PATH] [--hub HOST:PORT] [--token-file F] -- CMD ARGS...``: run a
command with every Python process it starts instrumented, without changing its code.

What it does, in order:

1. **A hub.** Without ``--hub`` (or ``RTOP_HUB``), one of its own, on a thread of this
   process (:class:`rtop.hub.service.ThreadedHub`, niced like the hub the collectors
   start), recording to ``--record`` or the default runs directory, and found by
   ``rtop`` in another shell through its discovery file. With one given, that hub, which
   records where it was told.
2. **The command's environment.** ``RTOP_HUB`` and ``RTOP_TOKEN`` (the hub's *ingest*
   token, never the master; in the environment, never on a command line), ``RTOP_AUTO=1``
   and ``collectors/_autoload`` first on ``PYTHONPATH``: every Python process of the
   command, torchrun's workers included, runs ``collectors/_autoload/sitecustomize.py``
   at start-up, which instruments it once it trains (``collectors.autoinstrument``).
   ``RTOP_AUTO=0`` in rtop run's own environment leaves the code alone: it then only
   provides the hub, for code that calls ``collectors.start()`` itself.
3. **The command**, in a process group of its own. SIGINT, SIGTERM and SIGHUP sent to
   ``rtop run`` are forwarded to that group. On a terminal, the group is made the
   terminal's foreground while it runs, as a shell does for a job: Ctrl-C reaches the
   command directly (once), it can read the terminal (``pdb``), and Ctrl-Z stops it and
   ``rtop run`` together (``fg`` continues both).
4. **At the end**, the ranks' last frames are taken in, its own hub is told the
   command's exit code (a ``job_exit`` frame, recorded: with code 0, ranks whose
   connections closed without a goodbye as the command ended, such as a script's
   ``os._exit(0)`` that skips the collectors' own, ended with the job and are not
   lost; see ``rtop.run.state.RunState.on_job_exit``), the hub stops, the recording's
   path is printed on stderr, and ``rtop run`` exits with the command's exit code
   (128 + N for a command killed by signal N, as a shell does; 127 for a command that
   is not found, 126 for one that cannot be run). A hub given with ``--hub`` is not
   told: it may watch more than this command.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import collectors
from collectors import auth
from collectors.discovery import safe_name

#: Signals forwarded to the command's process group.
FORWARDED: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: How long the ranks' last frames (their goodbyes) may take to reach the hub after the
#: command has exited.
DRAIN_S = 5.0
#: The hub's niceness: ranks on this node come first.
HUB_NICE = 10


def say(message: str) -> None:
    """One line on stderr (the command's stdout stays its own)."""
    print(f"rtop run: {message}", file=sys.stderr, flush=True)


def autoload_dir() -> Path:
    """The directory whose ``sitecustomize.py`` instruments a Python process."""
    return Path(collectors.__file__).resolve().parent / "_autoload"


def job_name(argv: list[str]) -> str:
    """A name for the job from its command: the first script's stem (``train`` for
    ``torchrun ... train.py``), else the program's name."""
    for arg in argv:
        if arg.endswith(".py"):
            return safe_name(Path(arg).stem, "run", 60)
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":  # python -m package.module
            return safe_name(argv[i + 1].rpartition(".")[2], "run", 60)
    return safe_name(Path(argv[0]).name, "run", 60)


def command_env(base: Mapping[str, str], address: str, ingest_token: str) -> dict[str, str]:
    """The command's environment: ``base`` with the hub and, unless ``RTOP_AUTO=0``, the
    automatic instrumentation."""
    env = {k: v for k, v in base.items() if k != "RTOP_TOKEN_FILE"}
    env["RTOP_HUB"] = address
    env["RTOP_TOKEN"] = ingest_token
    if env.get("RTOP_AUTO") != "0":
        env["RTOP_AUTO"] = "1"
        paths = [str(autoload_dir())]
        if base.get("PYTHONPATH"):
            paths.append(base["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def exit_code(returncode: int) -> int:
    """A shell's exit status for a process's: 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


# ---- the hub ---------------------------------------------------------------------------


class _OwnHub:
    """A hub for this command, on a thread of this process."""

    def __init__(self, name: str, record: str | None, token: str | None) -> None:
        from rtop.discovery import hub_file_path
        from rtop.hub.service import ThreadedHub

        discovery: str | None = None
        try:  # `rtop` in another shell finds the hub through it
            discovery = str(hub_file_path(f"{name}-{os.getpid()}"))
        except (OSError, ValueError) as exc:
            say(f"no discovery file, `rtop` will not find this hub by itself: {exc}")
        self.hub = ThreadedHub(job=name, record=record, token=token, nice=HUB_NICE,
                               discovery_file=discovery)

    def start(self) -> tuple[str, str]:
        """Start it; its address and the ranks' (ingest) token."""
        self.hub.start()
        return self.hub.address, auth.role_token(self.hub.token, "ingest")

    @property
    def record(self) -> str | None:
        return self.hub.record_path

    def finish(self, code: int | None = None, exited_at: float | None = None) -> int | None:
        """Take in the ranks' last frames, tell the hub the command's exit ``code`` (at
        ``exited_at``, wall-clock time; None: it did not run), stop the hub; how many
        ranks it heard from."""
        seen: int | None = None
        try:
            deadline = time.monotonic() + DRAIN_S
            while time.monotonic() < deadline:
                if not self.hub.call(lambda h: len(h.rank_connections())):
                    break
                time.sleep(0.05)
            if code is not None:
                self.hub.call(lambda h: h.job_exited(code, exited_at))
            seen = int(self.hub.call(lambda h: h.snapshot()["run"]["ranks_seen"]))
        except Exception as exc:  # the hub's thread ended: the recording says what it got
            say(f"the hub ended early: {exc}")
        self.hub.stop()
        return seen


class _GivenHub:
    """A hub that runs elsewhere (``--hub``, ``RTOP_HUB``): it records where it was told."""

    def __init__(self, address: str, token: str) -> None:
        self.address = address
        self.token = token
        self.record: str | None = None

    def start(self) -> tuple[str, str]:
        held = auth.token_role(self.token)
        return self.address, self.token if held else auth.role_token(self.token, "ingest")

    def finish(self, code: int | None = None, exited_at: float | None = None) -> int | None:
        """What the hub says of the run, if this token may view it (the command's exit
        is not told: that hub may watch more than this command)."""
        if auth.token_role(self.token) == "ingest":
            return None
        from rtop.client import HubClient, HubError

        try:
            with HubClient(self.address, self.token, timeout=5.0) as client:
                run = client.snapshot()["run"]
        except HubError as exc:
            say(f"could not ask the hub at {self.address} about the run: {exc}")
            return None
        self.record = run.get("record")
        return int(run["ranks_seen"])


def _hub(argv: list[str], record: str | None, hub: str | None, token: str | None
         ) -> _OwnHub | _GivenHub | str:
    """The hub for this command, or why not (a usage error)."""
    if hub:
        if record:
            return ("--record needs rtop run's own hub: the hub at "
                    f"{hub} records where it was told (drop --hub, or --record)")
        if not token:
            return (f"the hub at {hub} needs its token (master or ingest): set RTOP_TOKEN "
                    "or give --token-file")
        held = auth.token_role(token)
        if held not in (None, "ingest"):
            return (f"a {held} token cannot send ranks' records; give the hub's master "
                    "or ingest token")
        return _GivenHub(hub, token)
    if token and auth.token_role(token) is not None:
        return (f"a hub of rtop run's own needs a master token, not a "
                f"{auth.token_role(token)} token (is RTOP_TOKEN meant for another hub? "
                f"then set RTOP_HUB too)")
    return _OwnHub(job_name(argv), record, token or None)


# ---- the command -----------------------------------------------------------------------


class _Terminal:
    """While the command runs, its process group is the terminal's foreground, as a shell
    does for a job: only when ``rtop run`` itself is the foreground of its terminal."""

    def __init__(self) -> None:
        self.fd: int | None = None
        with contextlib.suppress(OSError):
            if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp():
                self.fd = 0

    def give(self, pgid: int) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.tcsetpgrp(self.fd, pgid)

    def take_back(self) -> None:
        if self.fd is None:
            return
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # we are in the background
        try:
            with contextlib.suppress(OSError):
                os.tcsetpgrp(self.fd, os.getpgrp())
        finally:
            signal.signal(signal.SIGTTOU, old)

    def stopped(self, pgid: int) -> None:
        """The command stopped (Ctrl-Z): stop too, so the shell sees its job stopped;
        once continued, continue the command (in the foreground if we are)."""
        self.take_back()
        os.kill(os.getpid(), signal.SIGSTOP)
        with contextlib.suppress(OSError):
            if self.fd is not None and os.tcgetpgrp(self.fd) == os.getpgrp():
                self.give(pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)


class _Forwarder:
    """Forwards :data:`FORWARDED` signals to the command's process group (remembered
    until there is one)."""

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        self._send(signum)

    def _send(self, signum: int) -> None:
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signum)

    def started(self, pgid: int) -> None:
        self.pgid = pgid
        for signum in self.received:
            self._send(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Forwarder]:
        for sig in FORWARDED:
            self._old[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for signum, old in self._old.items():
                signal.signal(signum, old)


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                             else {"preexec_fn": os.setpgrp})
    return subprocess.Popen(argv, env=env, **group)


def run_command(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv`` in a process group of its own, forwarding signals, and return its
    exit status as a shell would."""
    terminal = _Terminal()
    with _Forwarder().installed() as forward:
        if forward.received:  # interrupted before the command started
            return 128 + forward.received[0]
        try:
            proc = _spawn(argv, env)
        except FileNotFoundError:
            say(f"{argv[0]}: command not found")
            return 127
        except OSError as exc:
            say(f"cannot run {argv[0]}: {exc.strerror or exc}")
            return 126
        terminal.give(proc.pid)
        forward.started(proc.pid)
        try:
            while True:
                _, status = os.waitpid(proc.pid, os.WUNTRACED if terminal.fd is not None else 0)
                if os.WIFSTOPPED(status):
                    terminal.stopped(proc.pid)
                    continue
                proc.returncode = os.waitstatus_to_exitcode(status)
                return exit_code(proc.returncode)
        finally:
            terminal.take_back()


def main(argv_after_dashdash: list[str], *, record: str | None, hub: str | None,
         token: str | None) -> int:
    """``rtop run``: run the command instrumented, with a hub; return its exit status
    (2: a usage error, 1: the hub could not start)."""
    argv = list(argv_after_dashdash)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        say("give a command to run: rtop run [--record PATH] -- CMD ARGS...")
        return 2
    picked = _hub(argv, record, hub or os.environ.get("RTOP_HUB") or None, token)
    if isinstance(picked, str):
        say(picked)
        return 2
    try:
        address, ingest = picked.start()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        say(f"could not start a hub: {exc}")
        return 1
    where = picked.record or ("kept by the hub" if isinstance(picked, _GivenHub) else "off")
    say(f"hub {address} for `{shlex.join(argv)}` (watch it: rtop"
        f"{' attach ' + address if isinstance(picked, _GivenHub) else ''}); "
        f"recording: {where}")
    code = 130
    exited_at: float | None = None
    try:
        code = run_command(argv, command_env(os.environ, address, ingest))
        exited_at = time.time()
    finally:
        seen = picked.finish(code if exited_at is not None else None, exited_at)
        if picked.record:
            say(f"recording: {picked.record}  (rtop report {shlex.quote(picked.record)})")
        elif isinstance(picked, _GivenHub):
            say(f"recording: kept by the hub at {address}")
        if seen == 0 and os.environ.get("RTOP_AUTO") != "0":
            say("no process of the command was instrumented: none trained with torch "
                "(a DataLoader, an optimizer step, a DDP or FSDP model), or its Python "
                "ignores PYTHONPATH (-E, -I) or could not load rtop's collectors (a "
                "warning above says why)")
    return code

