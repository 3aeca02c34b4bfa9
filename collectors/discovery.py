"""Finding the hub without configuration, from inside a rank.

In order:

1. ``RTOP_HUB`` / ``RTOP_TOKEN`` (or ``collectors.start(hub=..., token=...)``).
2. Inside a Ray Train worker: a detached named actor, ``rtop-hub-<run id>`` in the
   ``rtop`` namespace with zero CPUs, runs the hub; whichever rank comes first creates
   it (``get_if_exists`` makes that race-free) and every rank asks it for its address
   (and, when the job gave no token, the token the actor made).
3. Otherwise (torchrun, a single process): the hub of this job on this node is found
   through a file in the user's runtime directory; the first rank to take the lock
   beside it starts one (``python -m rtop serve --auto``, its own process, so it can
   never slow a rank down) and the others wait for the file. The directory must be
   the user's own (0700, not a link) and the file 0600 and the user's: anything
   else is ignored with a warning, so another local user cannot plant a file that
   sends the ranks to their hub. The hub's file holds its address and the *ingest*
   token (all a rank needs); the master token, for viewers and actions, is in a
   private file beside it (:func:`hub_key_path`), which ranks never read.

**Relays.** A job of ``RTOP_RELAY_MIN_WORLD`` ranks or more (:data:`RELAY_MIN_WORLD`,
256; ``RTOP_RELAY=0``: never) sends through one relay per node and job. On Ray, the
job's hub actor makes it (a relay actor on the rank's node, zero CPUs) and the rank asks
it for its address (:func:`ray_relay`). Otherwise, when the hub is named
(``RTOP_HUB``), it is a process per node (``rtop relay``, :mod:`rtop.hub.relay`). A relay
is a byte multiplexer on loopback that carries the node's ranks to the hub over one
connection. The rank speaks
to the hub through it exactly as it would directly (the same handshake, token and
acknowledgements), so this module only picks where to connect: the relay of
``relay-<job>-<node>-<hub>.json`` in the runtime directory (same checks as a hub's file,
and its process must be alive), started by the first rank to take the lock beside it
(its own process, in a session of its own; the token reaches it through its
environment, never its command line). A relay the hub refused leaves a ``.off`` marker
beside its file: for :data:`RELAY_OFF_S` the node's ranks go to the hub directly, as
they do whenever the relay cannot be found or started, and as every third try of a
rank that did not get in through it does (``relay=False``, from
:mod:`collectors.connection`).

**The runtime directory** is ``$XDG_RUNTIME_DIR/rtop`` when that base is the user's own,
else ``/tmp/rtop-<uid>``. Anyone can create ``/tmp/rtop-<uid>`` first (a directory of
theirs, or a link): then rtop says so, with the owner's uid, and goes to an
unpredictable directory of its own (``mkdtemp``: ``/tmp/rtop-<uid>-XXXXXXXX``) whose
path it keeps in a private pointer file under the user's home
(``~/.cache/rtop/runtime-<host>``), so every process of the user on this node, ranks,
hubs and viewers, finds the same one (:func:`runtime_dir`).

This runs on the collector's sender thread, never on the training thread. It imports
Ray only when the process already has it. The hub always runs in another process (the
Ray actor's, or its own), and the application (``rtop``) is named in one place only,
"the seam" below: the command that starts a node's hub, and the Ray actor's class,
imported there lazily when a rank has to create the actor
(``tests/test_import_seam.py`` keeps it that way).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from collectors import auth
from collectors.identity import Identity
from collectors.wire import parse_address

log = logging.getLogger("collectors")

HubAddress = tuple[str, int, "str | None"]
RAY_NAMESPACE = "rtop"
_warned: set[str] = set()
SPAWN_WAIT_S = 15.0
#: A job of this many ranks or more sends through a relay per node (when its hub is
#: named); ``RTOP_RELAY_MIN_WORLD`` sets it, ``RTOP_RELAY=0`` turns relays off.
RELAY_MIN_WORLD = 256
#: How long the ranks of a node go to the hub directly after its relay was refused.
RELAY_OFF_S = 600.0
#: How long the first rank waits for the relay it started to listen.
RELAY_SPAWN_WAIT_S = 10.0


#: Where the runtime directory goes when ``$XDG_RUNTIME_DIR`` is unset or unusable.
FALLBACK_BASE = Path("/tmp")
#: The most a hub file may hold (a few hundred bytes in practice).
HUB_FILE_MAX_BYTES = 65536
_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def safe_name(name: str, default: str = "default", max_len: int = 80) -> str:
    """``name`` made safe as one component of a file name: characters other than
    ``[A-Za-z0-9._-]`` become ``_``, so do leading dots (no hidden files, no ``..``),
    and it is cut to ``max_len``; ``default`` if nothing is left. Every name that
    reaches a path (a job's, a run's) goes through here first."""
    safe = _SAFE_CHARS.sub("_", str(name))[:max_len]
    dots = len(safe) - len(safe.lstrip("."))
    return ("_" * dots + safe[dots:]) or default


def private_dir(path: Path) -> Path:
    """``path`` as this user's private directory: created 0700 if missing; an existing
    one must be a real directory (not a symbolic link) that this user owns, and is
    made 0700 if it was open to others. Raises :class:`PermissionError`, saying why,
    for one planted by someone else.

    Checked with ``lstat``, then chmod-ed by name: the name cannot be swapped in
    between, since only its owner (we) may rename or remove it in a sticky ``/tmp``
    or in our own ``$XDG_RUNTIME_DIR``.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise PermissionError(
            f"{path} is {what}, not a private directory: rtop will not use it (someone "
            f"may be squatting it; remove it, or set XDG_RUNTIME_DIR to a directory of "
            f"your own)")
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): rtop "
            f"will not use it (someone may be squatting it; remove it, or set "
            f"XDG_RUNTIME_DIR to a directory of your own)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def _own_base(base: str) -> bool:
    """Whether ``$XDG_RUNTIME_DIR`` is a directory of ours that only we can write to."""
    try:
        st = os.stat(base)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and os.access(base, os.W_OK))


def runtime_dir() -> Path:
    """The user's private directory for hub files and spools: ``$XDG_RUNTIME_DIR/rtop``
    (when that base is the user's own), else ``/tmp/rtop-<uid>``; see
    :func:`private_dir`. When ``/tmp/rtop-<uid>`` is squatted (someone else's, a
    symbolic link, not a directory), one warning names it and its owner, and the
    user's fallback directory is used instead (:func:`fallback_runtime_dir`). Raises
    :class:`OSError` only when no private directory can be made at all."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and _own_base(base):
        return private_dir(Path(base) / "rtop")
    path = FALLBACK_BASE / f"rtop-{os.getuid()}"
    try:
        return private_dir(path)
    except PermissionError as exc:
        if not os.path.lexists(path):  # /tmp itself refused us: nothing to fall back to
            raise
        why = str(exc)
    return fallback_runtime_dir(path, why)


#: Fallback runtime directories already found by this process, by squatted path.
_fallbacks: dict[Path, Path] = {}


def pointer_path() -> Path | None:
    """Where the path of this user's fallback runtime directory on this node is kept:
    ``$XDG_CACHE_HOME/rtop/runtime-<host>`` (``~/.cache`` by default); None when the
    user has no home to keep it in."""
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache and os.path.isabs(cache):
        base = Path(cache)
    else:
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = Path(home) / ".cache"
    return base / "rtop" / f"runtime-{safe_name(socket.gethostname(), 'host')}"


def _is_fallback(path: Path) -> bool:
    """Whether ``path`` is a fallback runtime directory of ours: a real directory (not a
    link) in :data:`FALLBACK_BASE`, named ``rtop-<uid>-...``, this user's, 0700."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (path.parent == FALLBACK_BASE and path.name.startswith(f"rtop-{os.getuid()}-")
            and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and stat.S_IMODE(st.st_mode) == 0o700)


def fallback_runtime_dir(squatted: Path, why: str) -> Path:
    """The runtime directory to use when ``squatted`` (``/tmp/rtop-<uid>``) cannot be:
    an unpredictable directory of ours (``mkdtemp``), the same for every process of the
    user on this node: its path is kept in the private file :func:`pointer_path`, read
    and written under an exclusive lock, and a pointer that names anything but a
    private directory of ours is replaced. Without a home to keep the pointer in, a
    directory for this process only, with a warning that ranks, hubs and viewers will
    not find each other. Warns once per process, saying why (``why``) and where rtop
    goes instead."""
    known = _fallbacks.get(squatted)
    if known is not None and _is_fallback(known):
        return known
    pointer = pointer_path()
    found: Path | None = None
    shared = ""
    if pointer is not None:
        try:
            found = _shared_fallback(pointer)
            shared = (f"; its path is kept in {pointer} for your other processes on "
                      f"this node")
        except OSError as exc:
            shared = (f"; it could not be shared through {pointer} ({exc}), so ranks, hubs "
                      f"and viewers will not find each other: set XDG_RUNTIME_DIR to a "
                      f"private directory of yours")
    else:
        shared = ("; with no home directory to share it through, ranks, hubs and viewers "
                  "will not find each other: set XDG_RUNTIME_DIR to a private directory "
                  "of yours")
    if found is None:
        found = Path(tempfile.mkdtemp(prefix=f"rtop-{os.getuid()}-", dir=FALLBACK_BASE))
    _fallbacks[squatted] = found
    _warn_once(f"squat:{squatted}", "rtop: %s; rtop uses %s instead%s", why, found, shared)
    return found


def _shared_fallback(pointer: Path) -> Path:
    """The fallback directory named in ``pointer``, or a new one written there, under an
    exclusive lock on the pointer file (so concurrent processes agree on one)."""
    import fcntl

    cache = pointer.parent.parent  # ~/.cache: made (0700) only in a home that exists
    if not cache.exists() and cache.parent.is_dir():
        with contextlib.suppress(FileExistsError):
            cache.mkdir(mode=0o700)
    if not _own_base(str(cache)):
        raise PermissionError(f"{cache} is not a directory of yours that only you can "
                              f"write to")
    fd = open_private(private_dir(pointer.parent) / pointer.name, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = os.read(fd, 4096).decode("utf-8", "replace").strip()
        if data and _is_fallback(Path(data)):
            return Path(data)
        made = Path(tempfile.mkdtemp(prefix=f"rtop-{os.getuid()}-", dir=FALLBACK_BASE))
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, str(made).encode() + b"\n")
        return made
    finally:
        os.close(fd)  # and with it the lock


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """Open ``path`` as a private file of this user's, and return the descriptor.

    Created 0600 if ``flags`` has ``O_CREAT``; never through a symbolic link
    (``O_NOFOLLOW``), nor a FIFO or device; an existing file must belong to this user,
    and is made 0600 if it was open to others. Raises :class:`PermissionError`, saying
    why, otherwise.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(f"{os.fspath(path)} is a symbolic link: rtop will not "
                                  f"follow it (someone may have planted it)") from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader, a socket
            raise PermissionError(f"{os.fspath(path)} is not a regular file: rtop will "
                                  f"not use it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{os.fspath(path)} is not a regular file: rtop will not "
                                  f"use it")
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{os.fspath(path)} belongs to uid {st.st_uid}, not to "
                                  f"you: rtop will not use it (someone may have planted it)")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private_file(path: Path, max_bytes: int = HUB_FILE_MAX_BYTES) -> bytes | None:
    """What ``path`` holds, if it is a regular file of this user's that nobody else may
    read (0600 or stricter); ``None`` if it is missing, and ``None`` with one warning
    per path if it is a symbolic link, another user's, or open to others. Never raises.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        _warn_once(f"file:{path}", "rtop: ignoring %s: %s", str(path), why)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_uid != os.geteuid():
            why = f"it belongs to uid {st.st_uid}, not to you (planted by someone?)"
        elif stat.S_IMODE(st.st_mode) & 0o077:
            why = f"others may read or write it (mode {stat.S_IMODE(st.st_mode):04o})"
        else:
            chunks: list[bytes] = []
            size = 0
            while size <= max_bytes:
                chunk = os.read(fd, max_bytes + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > max_bytes:
                why = f"larger than {max_bytes} bytes"
            else:
                return b"".join(chunks)
    except OSError as exc:
        why = exc.strerror or str(exc)
    finally:
        os.close(fd)
    _warn_once(f"file:{path}", "rtop: ignoring %s: %s", str(path), why)
    return None


def job_key(identity: Identity) -> str:
    """A file-name-safe key naming this job on this node."""
    key = identity.job or (f"pid{identity.pid}" if identity.world_size == 1 else "default")
    return safe_name(key)


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (and may be someone else's). A zombie is
    not alive: a relay or hub a rank started and that was killed stays one until that
    rank reaps it, which it never does, and its discovery file would keep the node's
    ranks from starting another."""
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(512)
    except OSError:
        return True  # no /proc here: as far as we can tell
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


def _read_private_map(path: Path) -> dict[str, Any] | None:
    """A private file's JSON map (see :func:`read_private_file`), else None. Never
    raises."""
    data = read_private_file(path)
    if data is None:
        return None
    try:
        info = json.loads(data)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def read_hub_file(path: Path) -> dict[str, Any] | None:
    """A hub file's contents if it is this user's private file (see
    :func:`read_private_file`) and names a live hub process, else None. Never raises."""
    info = _read_private_map(path)
    if info is None:
        return None
    pid, address, token = info.get("pid"), info.get("address"), info.get("token")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 \
            or not isinstance(address, str) or not (token is None or isinstance(token, str)):
        return None
    try:
        parse_address(address)
    except ValueError:
        return None
    if not pid_alive(pid):
        return None
    return info


def hub_key_path(hub_file: Path) -> Path:
    """The private file beside a hub's discovery file that holds its master token:
    ``hub-<job>.key`` for ``hub-<job>.json`` (not a ``hub-*.json`` name, so nothing that
    lists hubs takes it for one). Written and removed with the hub file."""
    return hub_file.with_name(f"{hub_file.stem}.key")


def read_hub_key(hub_file: Path, pid: int) -> str | None:
    """The master token a hub (process ``pid``) left beside its discovery file, for
    viewers and actions; None if there is none (an older hub kept it in the hub file
    itself), if it is not this user's private file, or if it is another hub's. Never
    raises."""
    info = _read_private_map(hub_key_path(hub_file))
    if info is None or info.get("pid") != pid:
        return None
    token = info.get("token")
    return token if isinstance(token, str) and token else None


def rank_token(token: str | None) -> str | None:
    """The token a rank uses from a hub file: the ingest token. A hub file of an older
    hub holds the master token: the rank derives the ingest token from it and keeps
    nothing more (a role token is used as it is)."""
    if not token or auth.token_role(token) is not None:
        return token
    return auth.role_token(token, "ingest")


# ---- the seam ---------------------------------------------------------------------
# The only code in collectors that names the application (rtop). A rank never runs a
# hub in its own process: it starts one beside it, this node's through the
# application's command line, or a Ray actor whose code is the application's.


def hub_command(key: str, path: Path) -> list[str]:
    """The command that starts this node's hub for job ``key`` (``rtop serve --auto``),
    which writes its address to the discovery file ``path``."""
    return [sys.executable, "-m", "rtop", "serve", "--auto", "--job", key,
            "--discovery-file", str(path)]


def relay_command(path: Path, hub: str, node: str, job: str) -> list[str]:
    """The command that starts this node's relay (``rtop relay``) for the hub at
    ``hub``, which writes its address to the discovery file ``path``. The token goes
    in its environment (``RTOP_TOKEN``), never here."""
    return [sys.executable, "-m", "rtop", "relay", "--hub", hub, "--node", node, "--job",
            job, "--discovery-file", str(path)]


def ray_hub_actor_class() -> type:
    """The class of the Ray actor that runs a job's hub (``rtop.hub.ray_actor``).

    Imported only here, and only when a Ray Train rank has to create the actor; the
    class's code runs in the actor's process, where the application belongs.
    """
    from rtop.hub.ray_actor import RayHubActor  # the seam: collectors' one import of rtop

    return RayHubActor


# ---- the node-local hub -------------------------------------------------------------


def local_hub(identity: Identity, spawn: bool = True) -> HubAddress | None:
    """The node-local hub of this job, started by the first rank to ask if need be.

    Never raises: a runtime directory or hub file that is not the user's own (a
    symbolic link, another user's, open to others) means "no hub found", with one
    warning.
    """
    try:
        return _local_hub(identity, spawn)
    except Exception as exc:
        _warn_once(f"local-hub:{exc}", "rtop: no node-local hub: %s", exc)
        return None


def _local_hub(identity: Identity, spawn: bool) -> HubAddress | None:
    rdir = runtime_dir()
    key = job_key(identity)
    path = rdir / f"hub-{key}.json"
    info = read_hub_file(path)
    if info is None and spawn:
        import fcntl

        lock = open_private(rdir / f"hub-{key}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks of the node wait here
            info = read_hub_file(path)
            if info is None:
                info = _spawn_local_hub(key, path, rdir)
        finally:
            os.close(lock)
    if info is None:
        return None
    host, port = parse_address(info["address"])
    return host, port, rank_token(info.get("token"))


def _spawn_local_hub(key: str, path: Path, rdir: Path) -> dict[str, Any] | None:
    cmd = hub_command(key, path)
    log.info("rtop: starting this node's hub for job %s", key)
    # the hub's log: 0600, never through a link; the hub writes no token into it
    out = open_private(rdir / f"hub-{key}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                         start_new_session=True, close_fds=True)
    except OSError as exc:
        log.warning("rtop: could not start a hub (%s); set RTOP_HUB to use one", exc)
        return None
    finally:
        os.close(out)
    deadline = time.monotonic() + SPAWN_WAIT_S
    while time.monotonic() < deadline:
        info = read_hub_file(path)
        if info is not None:
            return info
        time.sleep(0.1)
    log.warning("rtop: the hub did not start within %.0f s (see %s)", SPAWN_WAIT_S,
                rdir / f"hub-{key}.log")
    return None


# ---- the node's relay -----------------------------------------------------------------


def relay_wanted(identity: Identity) -> bool:
    """Whether this rank's job is large enough to send through a relay per node."""
    if os.environ.get("RTOP_RELAY", "1").lower() in ("0", "false", "no"):
        return False
    raw = os.environ.get("RTOP_RELAY_MIN_WORLD", "")
    try:
        least = int(raw) if raw.strip() else RELAY_MIN_WORLD
    except ValueError:
        _warn_once("relay-min", "rtop: RTOP_RELAY_MIN_WORLD=%r is not a number; using %d",
                   raw, RELAY_MIN_WORLD)
        least = RELAY_MIN_WORLD
    return identity.world_size >= max(least, 1)


def relay_file_path(rdir: Path, identity: Identity, hub: str) -> Path:
    """Where the relay of this rank's job and node for the hub at ``hub`` leaves its
    discovery file: ``relay-<job>-<node>-<hub>.json``, every part made safe."""
    host, port = parse_address(hub)
    key = safe_name(f"{job_key(identity)}-{identity.hostname}-{host}-{port}", max_len=160)
    return rdir / f"relay-{key}.json"


def relay_off_path(path: Path) -> Path:
    """The marker a relay leaves beside its discovery file (``path``) when the hub
    refused it: the node's ranks go to the hub directly for :data:`RELAY_OFF_S`."""
    return path.with_suffix(".off")


def node_relay(identity: Identity, hub: str, token: str | None, spawn: bool = True
               ) -> HubAddress | None:
    """This node's relay to the hub at ``hub`` (``host:port``), started by the first
    rank to ask if need be; None when there is none to use (then the rank connects to
    the hub itself). Never raises."""
    if not token:
        return None  # a relay, like a rank, needs the token
    try:
        return _node_relay(identity, hub, token, spawn)
    except Exception as exc:
        _warn_once(f"relay:{exc}", "rtop: no relay on this node (%s); connecting to the "
                   "hub directly", exc)
        return None


def _node_relay(identity: Identity, hub: str, token: str, spawn: bool
                ) -> HubAddress | None:
    rdir = runtime_dir()
    path = relay_file_path(rdir, identity, hub)
    off = _read_private_map(relay_off_path(path))
    t_off = off.get("t") if off is not None else None
    if isinstance(t_off, (int, float)) and 0 <= time.time() - t_off < RELAY_OFF_S:
        _warn_once(f"relay-off:{path}", "rtop: this node's relay was refused by the hub "
                   "(%s); connecting to the hub directly", str(off.get("why"))[:200]
                   if off is not None else "")
        return None
    info = _relay_info(path, hub)
    if info is None and spawn:
        import fcntl

        lock = open_private(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks of the node wait here
            info = _relay_info(path, hub)
            if info is None:
                info = _spawn_relay(identity, path, hub, token)
        finally:
            os.close(lock)
    if info is None:
        return None
    host, port = parse_address(info["address"])
    return host, port, token


def _relay_info(path: Path, hub: str) -> dict[str, Any] | None:
    """The relay's file, if it names a live relay for ``hub``."""
    info = read_hub_file(path)
    return info if info is not None and info.get("hub") == hub else None


def _spawn_relay(identity: Identity, path: Path, hub: str, token: str
                 ) -> dict[str, Any] | None:
    cmd = relay_command(path, hub, identity.hostname, job_key(identity))
    log.info("rtop: starting this node's relay to the hub at %s", hub)
    env = {k: v for k, v in os.environ.items() if k != "RTOP_TOKEN_FILE"}
    env["RTOP_TOKEN"] = token
    out = open_private(path.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                         start_new_session=True, close_fds=True)
    except OSError as exc:
        log.warning("rtop: could not start this node's relay (%s); connecting to the hub "
                    "directly", exc)
        return None
    finally:
        os.close(out)
    deadline = time.monotonic() + RELAY_SPAWN_WAIT_S
    while time.monotonic() < deadline:
        info = _relay_info(path, hub)
        if info is not None:
            return info
        time.sleep(0.05)
    log.warning("rtop: this node's relay did not start within %.0f s (see %s); "
                "connecting to the hub directly", RELAY_SPAWN_WAIT_S,
                path.with_suffix(".log"))
    return None


def ray_actor_name(identity: Identity) -> str:
    """The hub actor's name for this Ray Train run."""
    return f"rtop-hub-{job_key(identity)}"


def ray_hub(identity: Identity, create: bool = True, token: str | None = None,
            relay: bool = True) -> HubAddress | None:
    """Ask (or make) this Ray Train run's hub actor for the hub's address (and token).

    With a token of its own (``RTOP_TOKEN``, ``collectors.start(token=...)``), the rank
    creates the actor with it and the actor never hands it out; without one, the
    actor makes a token and gives it to whoever asks inside the Ray cluster (see
    ``rtop.hub.ray_actor`` for what that does and does not protect).
    """
    if "ray" not in sys.modules:
        return None
    import ray

    name = ray_actor_name(identity)
    actor: Any
    try:
        actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        if not create:
            return None
        remote_cls: Any = ray.remote(ray_hub_actor_class())
        actor = remote_cls.options(
            name=name, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_restarts=0,
        ).remote(job_key(identity), token=token)
    host, port, given = ray.get(actor.address.remote(), timeout=60)
    use = given if isinstance(given, str) and given else token
    if relay and use and relay_wanted(identity):
        found = ray_relay(actor, identity)
        if found is not None:
            return found[0], found[1], use
    return str(host), int(port), use


def ray_relay(hub_actor: Any, identity: Identity) -> tuple[str, int] | None:
    """The relay of this rank's Ray node, made by the job's hub actor if need be (a
    ``RayRelayActor`` on this node, zero CPUs): ``(host, port)`` on loopback, or None
    when there is none to use (an older hub actor, a relay that died): then the rank
    connects to the hub itself. Never raises."""
    try:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        handle = ray.get(hub_actor.relay.remote(node_id, identity.hostname), timeout=60)
        host, port = ray.get(handle.address.remote(), timeout=60)
        return str(host), int(port)
    except Exception as exc:
        _warn_once("ray-relay", "rtop: no relay for this Ray node (%s); connecting to the "
                   "hub directly", exc)
        return None


def resolve(identity: Identity, hub: str | None, token: str | None,
            allow_spawn: bool = True, relay: bool = True) -> HubAddress | None:
    """Where this rank's hub is: explicit address, Ray actor, or the node-local hub;
    through the node's relay in a large job (unless ``relay`` is False)."""
    if hub:
        host, port = parse_address(hub)
        if relay and relay_wanted(identity):
            found = node_relay(identity, f"{host}:{port}" if ":" not in host
                               else f"[{host}]:{port}", token, spawn=allow_spawn)
            if found is not None:
                return found
        return host, port, token
    if os.environ.get("RTOP_AUTOHUB", "1").lower() in ("0", "false", "no"):
        return None
    if identity.source == "ray":
        try:
            found = ray_hub(identity, create=allow_spawn, token=token, relay=relay)
        except Exception as exc:
            if "ray" not in _warned:
                _warned.add("ray")
                log.warning("rtop: could not reach this Ray job's hub actor (%s); trying "
                            "a node-local hub", exc)
            found = None
        if found is not None:
            return found
    return local_hub(identity, spawn=allow_spawn)
