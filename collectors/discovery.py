"""Finding the hub without configuration, from inside a rank.

In order:

1. ``RTOP_HUB`` / ``RTOP_TOKEN`` (or ``collectors.start(hub=..., token=...)``).
2. Inside a Ray Train worker: a detached named actor, ``rtop-hub-<run id>`` in the
   ``rtop`` namespace with zero CPUs, runs the hub; whichever rank comes first creates
   it (``get_if_exists`` makes that race-free) and every rank asks it for its address
   and token.
3. Otherwise (torchrun, a single process): the hub of this job on this node is found
   through a file in the user's runtime directory; the first rank to take the lock
   beside it starts one (``python -m rtop serve --auto``, its own process, so it can
   never slow a rank down) and the others wait for the file.

This runs on the collector's sender thread, never on the training thread. It imports
Ray only when the process already has it. The hub always runs in another process (the
Ray actor's, or its own), and the application (``rtop``) is named in one place only,
"the seam" below: the command that starts a node's hub, and the Ray actor's class,
imported there lazily when a rank has to create the actor
(``tests/test_import_seam.py`` keeps it that way).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from collectors.identity import Identity
from collectors.wire import parse_address

log = logging.getLogger("collectors")

HubAddress = tuple[str, int, "str | None"]
RAY_NAMESPACE = "rtop"
_warned: set[str] = set()
SPAWN_WAIT_S = 15.0


def runtime_dir() -> Path:
    """The user's private directory for hub files: ``$XDG_RUNTIME_DIR/rtop``, else
    ``/tmp/rtop-<uid>``; created 0700 and refused if anyone else could write to it."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "rtop" if base and os.access(base, os.W_OK) else \
        Path(f"/tmp/rtop-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is not private to this user; not using it")
    return path


def job_key(identity: Identity) -> str:
    """A file-name-safe key naming this job on this node."""
    key = identity.job or (f"pid{identity.pid}" if identity.world_size == 1 else "default")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (and may be someone else's)."""
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def read_hub_file(path: Path) -> dict[str, Any] | None:
    """A hub file's contents if it names a live hub process, else None."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        return None
    if not pid_alive(info["pid"]) or not isinstance(info.get("address"), str):
        return None
    return info


# ---- the seam ---------------------------------------------------------------------
# The only code in collectors that names the application (rtop). A rank never runs a
# hub in its own process: it starts one beside it, this node's through the
# application's command line, or a Ray actor whose code is the application's.


def hub_command(key: str, path: Path) -> list[str]:
    """The command that starts this node's hub for job ``key`` (``rtop serve --auto``),
    which writes its address to the discovery file ``path``."""
    return [sys.executable, "-m", "rtop", "serve", "--auto", "--job", key,
            "--discovery-file", str(path)]


def ray_hub_actor_class() -> type:
    """The class of the Ray actor that runs a job's hub (``rtop.hub.ray_actor``).

    Imported only here, and only when a Ray Train rank has to create the actor; the
    class's code runs in the actor's process, where the application belongs.
    """
    from rtop.hub.ray_actor import RayHubActor  # the seam: collectors' one import of rtop

    return RayHubActor


# ---- the node-local hub -------------------------------------------------------------


def local_hub(identity: Identity, spawn: bool = True) -> HubAddress | None:
    """The node-local hub of this job, started by the first rank to ask if need be."""
    rdir = runtime_dir()
    key = job_key(identity)
    path = rdir / f"hub-{key}.json"
    info = read_hub_file(path)
    if info is None and spawn:
        import fcntl

        with open(rdir / f"hub-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks of the node wait here
            info = read_hub_file(path)
            if info is None:
                info = _spawn_local_hub(key, path, rdir)
    if info is None:
        return None
    host, port = parse_address(info["address"])
    return host, port, info.get("token")


def _spawn_local_hub(key: str, path: Path, rdir: Path) -> dict[str, Any] | None:
    cmd = hub_command(key, path)
    log.info("rtop: starting this node's hub for job %s", key)
    with open(rdir / f"hub-{key}.log", "ab") as out:
        try:
            subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             start_new_session=True, close_fds=True)
        except OSError as exc:
            log.warning("rtop: could not start a hub (%s); set RTOP_HUB to use one", exc)
            return None
    deadline = time.monotonic() + SPAWN_WAIT_S
    while time.monotonic() < deadline:
        info = read_hub_file(path)
        if info is not None:
            return info
        time.sleep(0.1)
    log.warning("rtop: the hub did not start within %.0f s (see %s)", SPAWN_WAIT_S,
                rdir / f"hub-{key}.log")
    return None


def ray_actor_name(identity: Identity) -> str:
    """The hub actor's name for this Ray Train run."""
    return f"rtop-hub-{job_key(identity)}"


def ray_hub(identity: Identity, create: bool = True) -> HubAddress | None:
    """Ask (or make) this Ray Train run's hub actor for the hub's address and token."""
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
        ).remote(job_key(identity))
    host, port, token = ray.get(actor.address.remote(), timeout=60)
    return str(host), int(port), str(token)


def resolve(identity: Identity, hub: str | None, token: str | None,
            allow_spawn: bool = True) -> HubAddress | None:
    """Where this rank's hub is: explicit address, Ray actor, or the node-local hub."""
    if hub:
        host, port = parse_address(hub)
        return host, port, token
    if os.environ.get("RTOP_AUTOHUB", "1").lower() in ("0", "false", "no"):
        return None
    if identity.source == "ray":
        try:
            found = ray_hub(identity, create=allow_spawn)
        except Exception as exc:
            if "ray" not in _warned:
                _warned.add("ray")
                log.warning("rtop: could not reach this Ray job's hub actor (%s); trying "
                            "a node-local hub", exc)
            found = None
        if found is not None:
            return found
    return local_hub(identity, spawn=allow_spawn)
