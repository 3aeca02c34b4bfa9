"""Finding running hubs from a viewer's side: the environment, this user's hub files,
and the hub actors of a Ray cluster this machine belongs to; and writing a hub's file.

Hub files (written by ``rtop.hub.service.write_hub_file``) live in the user's private
runtime directory (``collectors.discovery.
runtime_dir``: 0700, the user's own, not a link) and are read only when they are
0600 and the user's own, so another local user can neither read a token nor plant a
file that points rtop at their hub. A hub file holds the ranks' ingest token; a viewer
takes the master token from the private key file beside it
(``collectors.discovery.hub_key_path``), or, from an older hub, the hub file's own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors.discovery import (
    RAY_NAMESPACE,
    read_hub_file,
    read_hub_key,
    runtime_dir,
    safe_name,
)

log = logging.getLogger("rtop")


@dataclass(frozen=True)
class FoundHub:
    """A hub a viewer can attach to."""

    address: str
    token: str | None
    job: str
    source: str  # env | file | ray
    record: str | None = None

    def label(self) -> str:
        """One line for a list of hubs."""
        rec = f"  recording {self.record}" if self.record else ""
        return f"{self.job or '(unnamed job)'}  {self.address}  [{self.source}]{rec}"


def from_env() -> FoundHub | None:
    """``RTOP_HUB`` / ``RTOP_TOKEN``."""
    if not os.environ.get("RTOP_HUB"):
        return None
    return FoundHub(os.environ["RTOP_HUB"], os.environ.get("RTOP_TOKEN"), "", "env")


def from_files(directory: Path | None = None) -> list[FoundHub]:
    """Live hubs that left a file in this user's runtime directory."""
    found = []
    try:
        rdir = directory or runtime_dir()
    except OSError:
        return []
    for path in sorted(rdir.glob("hub-*.json")):
        info = read_hub_file(path)
        if info is not None:
            # the master token, from the private key file beside it (a hub file holds
            # the ranks' ingest token; an older hub's held the master itself)
            token = read_hub_key(path, info["pid"]) or info.get("token")
            found.append(FoundHub(info["address"], token, str(info.get("job", "")),
                                  "file", info.get("record")))
    return found


def hub_file_path(job: str, directory: Path | None = None) -> Path:
    """Where a hub for ``job`` leaves its file: ``hub-<job>.json`` in the runtime
    directory, the job's name made safe (:func:`collectors.discovery.safe_name`), so
    that no name can lead the file elsewhere."""
    rdir = directory or runtime_dir()
    path = rdir / f"hub-{safe_name(job)}.json"
    if path.parent != rdir:  # cannot happen with a safe name; never write elsewhere
        raise ValueError(f"job name {job!r} does not make a file name")
    return path


def _ray_cluster_running() -> bool:
    """Whether this machine is part of a Ray cluster, without importing Ray (slow)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return True
    if os.environ.get("RAY_ADDRESS"):
        return True
    import psutil

    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in ("gcs_server", "raylet"):
            return True
    return False


def from_ray() -> list[FoundHub]:
    """Hub actors of the Ray cluster this machine is part of (if Ray is installed and a
    cluster is running; never starts one)."""
    if not _ray_cluster_running():
        return []
    try:
        import ray
    except ImportError:
        return []
    found: list[FoundHub] = []
    try:
        if not ray.is_initialized():
            ray.init(address="auto", namespace=RAY_NAMESPACE, logging_level=logging.ERROR,
                     log_to_driver=False)
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name, ns = entry.get("name", ""), entry.get("namespace", "")
            if ns != RAY_NAMESPACE or not name.startswith("rtop-hub-"):
                continue
            with contextlib.suppress(Exception):
                actor = ray.get_actor(name, namespace=ns)
                info: dict[str, Any] = dict(ray.get(actor.info.remote(), timeout=10))
                token = None
                if not info.get("token_given"):
                    # the view token of a token the actor made is handed to whoever asks
                    # in the cluster (rtop.hub.ray_actor); a token the job gave is not,
                    # and the viewer uses its own (RTOP_TOKEN, --token-file)
                    token = ray.get(actor.view_token.remote(), timeout=10)
                found.append(FoundHub(info["address"], token,
                                      str(info.get("job", "")), "ray", info.get("record")))
    except Exception as exc:
        log.warning("rtop: could not list the Ray cluster's hubs: %s", exc)
    return found


def find_hubs(ray: bool = True) -> list[FoundHub]:
    """Every hub this user can attach to, the environment's first."""
    hubs: list[FoundHub] = []
    env = from_env()
    if env is not None:
        hubs.append(env)
    hubs += [h for h in from_files() if all(h.address != x.address for x in hubs)]
    if ray:
        hubs += [h for h in from_ray() if all(h.address != x.address for x in hubs)]
    return hubs
