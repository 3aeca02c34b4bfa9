"""Who this rank is: world rank, local rank, world size, node, pid, attempt.

Resolved, in order, from Ray Train's context (inside a Ray Train worker), from an
initialised ``torch.distributed`` process group plus torchrun's environment variables,
and otherwise as a single process. Ray and torch are consulted only if the training
process has already imported them; this module imports neither.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Identity:
    """The identity of one rank, as sent to the hub in the hello frame.

    ``source`` says where it came from: ``"ray"``, ``"torch"``, ``"env"`` or
    ``"single"``. ``job`` names the training run (Ray Train run id, torchrun run id, or
    the rendezvous address) and ``group`` the worker group inside it: a Ray Train
    worker-group restart or a torchrun restart gives a new ``group`` and ``attempt``.
    """

    rank: int
    local_rank: int
    world_size: int
    hostname: str
    ip: str
    pid: int
    attempt: int = 0
    job: str = ""
    group: str = ""
    node_id: str = ""
    source: str = "single"

    @property
    def node(self) -> str:
        """The node name used to group ranks: the hostname."""
        return self.hostname

    def to_wire(self) -> dict[str, Any]:
        """The identity as a msgpack-able map."""
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Identity:
        """Rebuild an identity from its wire map, ignoring unknown keys."""
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def _host_ip() -> str:
    """This host's outward-facing IP address (no packet is sent), or loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip: str = s.getsockname()[0]
            return ip
    except OSError:
        return "127.0.0.1"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        return None
    return int(value)


def _from_ray() -> dict[str, Any] | None:
    """Fields from Ray Train's context, if this is a Ray Train worker."""
    if "ray" not in sys.modules:
        return None
    try:
        import ray
        import ray.train

        ctx = ray.train.get_context()
        fields: dict[str, Any] = {
            "rank": int(ctx.get_world_rank()),
            "local_rank": int(ctx.get_local_rank()),
            "world_size": int(ctx.get_world_size()),
            "source": "ray",
        }
    except Exception:
        return None
    try:  # not in Ray Train's local mode: get_runtime_context() would start a Ray instance
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised")
        runtime = ray.get_runtime_context()
        fields["node_id"] = str(runtime.get_node_id())
        fields["ip"] = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:
        pass
    try:  # Ray Train v2 internals: run id and the worker group's shared actor
        from ray.train.v2._internal.execution.context import get_train_context

        internal = get_train_context()
        fields["job"] = str(internal.train_run_context.run_id)
        sync_actor: Any = internal.execution_context.synchronization_actor
        fields["group"] = str(sync_actor._actor_id.hex())
    except Exception:
        pass
    return fields


def _from_torch() -> dict[str, Any] | None:
    """Fields from an initialised torch.distributed process group and torchrun's env."""
    fields: dict[str, Any] = {}
    torch_dist = None
    if "torch" in sys.modules:
        try:
            import torch.distributed as torch_dist_module

            if torch_dist_module.is_available() and torch_dist_module.is_initialized():
                torch_dist = torch_dist_module
        except Exception:
            torch_dist = None
    env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if torch_dist is not None:
        fields["rank"] = int(torch_dist.get_rank())
        fields["world_size"] = int(torch_dist.get_world_size())
        fields["source"] = "torch"
    elif env_rank is not None and env_world is not None:
        fields["rank"], fields["world_size"], fields["source"] = env_rank, env_world, "env"
    else:
        return None
    local = _env_int("LOCAL_RANK")
    fields["local_rank"] = local if local is not None else fields["rank"]
    fields["attempt"] = _env_int("TORCHELASTIC_RESTART_COUNT") or 0
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    master = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if run_id:
        fields["job"] = run_id
    elif master and port:
        fields["job"] = f"{master}:{port}"
    fields["group"] = f"{fields.get('job', '')}#{fields['attempt']}"
    return fields


def detect(**overrides: Any) -> Identity:
    """Work out this rank's identity; keyword arguments override what is detected."""
    fields: dict[str, Any] = {
        "rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "hostname": socket.gethostname(),
        "ip": "",
        "pid": os.getpid(),
        "source": "single",
    }
    found = _from_ray() or _from_torch()
    if found:
        fields.update(found)
    attempt = _env_int("RTOP_ATTEMPT")
    if attempt is not None:
        fields["attempt"] = attempt
    if os.environ.get("RTOP_JOB"):
        fields["job"] = os.environ["RTOP_JOB"]
    if os.environ.get("RTOP_NODE"):  # containers with random hostnames, test "nodes"
        fields["hostname"] = os.environ["RTOP_NODE"]
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if not fields["ip"]:
        fields["ip"] = _host_ip()
    return Identity(**fields)
