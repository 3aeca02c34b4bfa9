"""The Ray actor that runs a Ray Train job's hub.

A rank of the job creates it through ``collectors.discovery`` (the one place where the
in-rank package names this one), as a detached, zero-CPU named actor; its code runs in
the actor's own process, where importing the application is fine. This module imports
nothing of the hub until the actor starts, so a rank that merely names the class
stays light.

**The Ray trust boundary.** A named actor answers every client of the Ray cluster, and
Ray itself authenticates nobody: whoever can reach the cluster (submit a job, run
``ray.init(address=...)``) can run any code on any of its nodes as the user the job
runs as, and so can read the job's memory, environment and files, or ``ray.kill`` the
actor. rtop cannot protect a job from the members of its own Ray cluster, and does not
try. What it does:

* the hub's port is open to the network (ranks come from other nodes) and needs a
  token: a host that can reach the port but is not in the cluster can neither feed,
  read, nor act on the job;
* a token the job gave (``RTOP_TOKEN`` in its runtime environment, or
  ``collectors.start(token=...)``) is passed to the actor by the rank that creates it
  and is never handed out: ranks and viewers use the one they were given;
* without one (zero configuration), the actor makes a master token and hands out only
  what each caller needs: :meth:`RayHubActor.address` the *ingest* token (to send
  records, as ranks must) and :meth:`RayHubActor.view_token` the *view* token (to
  watch); anyone in the cluster can have those, which grants nothing they could not
  do already. The master and control tokens never leave the actor;
* :meth:`RayHubActor.info`, what ``rtop list`` asks, never returns a token;
* :meth:`RayHubActor.relay` makes (or finds) the relay of a node for a large job's ranks:
  a :class:`RayRelayActor` on that node (node affinity, zero CPUs), owned by the hub
  actor (and living as long as it), given the ingest token (what the node's ranks have
  anyway); it listens on the node's loopback only;
* :meth:`RayHubActor.shutdown` stops the hub only for a caller that presents its
  master or control token (compared in constant time): neither listing hubs, a rank,
  a viewer nor a stray script can end a job's hub. Without a token of the job's own,
  the hub ends by itself, ten minutes after the job and its viewers left.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from typing import Any

from collectors import auth
from collectors.wire import parse_address


class RayHubActor:
    """Runs a job's hub on a thread of the actor's process, niced (on a node it shares
    with training workers, the workers come first); the actor exits with the hub, ten
    minutes after the last rank and viewer left.

    ``token``: the job's own (master) token, if it has one (never handed out); without
    one the hub makes one, and :meth:`address` and :meth:`view_token` give out the
    ingest and view tokens derived from it.
    """

    def __init__(self, job: str, record: str | None = None, token: str | None = None,
                 host: str = "0.0.0.0") -> None:
        from rtop.hub.service import ThreadedHub

        def start(master: str | None) -> ThreadedHub:
            return ThreadedHub(job=job, record=record, host=host, token=master,
                               linger_s=600.0, on_exit=self._exit, nice=10).start()

        self._given = bool(token)
        #: the relay actors made for the job's nodes (:meth:`relay`), by (node id, name)
        self._relays: dict[tuple[str, str], Any] = {}
        try:
            self._hub = start(token or None)
        except RuntimeError as exc:
            if not self._given or not isinstance(exc.__cause__, ValueError):
                raise
            # a token no hub may use here (a role token, or too short for a port open
            # to the network): the job's ranks get the ingest token of one made here
            logging.getLogger("rtop.hub").warning(
                "rtop hub actor: the job's token cannot be a hub's (%s); using a fresh "
                "one, which ranks get from this actor", exc.__cause__)
            self._given = False
            self._hub = start(None)

    def _exit(self) -> None:
        with contextlib.suppress(Exception):  # not in an actor (a test), or Ray going down
            import ray

            ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    def address(self) -> tuple[str, int, str | None]:
        """``(host, port, ingest token)`` of the hub, for the job's ranks. The token is
        None when the job gave its own (the ranks have it already); see the module's
        docstring for whom a token made here is handed to."""
        host, port = parse_address(self._hub.address)
        return host, port, self._role_token("ingest")

    def view_token(self) -> str | None:
        """The hub's view token, for viewers in the cluster (None when the job gave its
        own token: a viewer then uses that one)."""
        return self._role_token("view")

    def _role_token(self, role: str) -> str | None:
        return None if self._given else auth.role_token(self._hub.token, role)

    def relay(self, node_id: str, node: str) -> Any:
        """The relay actor of Ray node ``node_id`` (whose ranks' hostname is ``node``),
        made now if it has none: a :class:`RayRelayActor` placed on that node (node
        affinity, not soft), with zero CPUs, named after the job and node (one per node:
        ``get_if_exists``), owned by this actor, so it ends with it. The caller asks it
        for its address."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from collectors.discovery import RAY_NAMESPACE, safe_name

        key = (node_id, node)
        held = self._relays.get(key)
        if held is not None:
            try:  # alive (a relay actor is killed only from outside): the same one
                ray.get(held.address.remote(), timeout=10)
                return held
            except Exception:
                self._relays.pop(key, None)
        name = safe_name(f"rtop-relay-{self._hub.job}-{node_id[:16]}-{node}", max_len=200)
        remote_cls: Any = ray.remote(RayRelayActor)
        # held here: an actor that no handle names any more is ended by Ray
        handle = self._relays[key] = remote_cls.options(
            name=name, namespace=RAY_NAMESPACE, get_if_exists=True, num_cpus=0,
            max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id, soft=False),
        ).remote(self._hub.address, auth.role_token(self._hub.token, "ingest"), node,
                 self._hub.job)
        return handle

    def info(self) -> dict[str, Any]:
        """What ``rtop list`` shows: address, job, recording, and whether the job gave
        its own token (``token_given``). Never the token."""
        return {"address": self._hub.address, "job": self._hub.job,
                "record": self._hub.record_path, "token_given": self._given}

    def shutdown(self, token: str | None = None) -> str | None:
        """Stop the hub (the recording is flushed and closed) and return the
        recording's path, for a caller that presents the hub's master or control
        token; anyone else gets :class:`PermissionError` and the hub goes on."""
        master = self._hub.token
        allowed = (master, auth.role_token(master, "control"))
        presented = token.encode() if isinstance(token, str) else b""
        # every comparison is made, in constant time, whatever matched
        ok = [hmac.compare_digest(presented, t.encode()) for t in allowed]
        if not isinstance(token, str) or not any(ok):
            raise PermissionError("rtop hub actor: shutdown needs the hub's master or "
                                  "control token")
        path = self._hub.record_path
        self._hub.stop()
        return path


class RayRelayActor:
    """One node's relay for a Ray job (:mod:`rtop.hub.relay`) on a thread of the actor's
    process, made by the job's hub actor (:meth:`RayHubActor.relay`) on that node. It
    listens on the node's loopback for the node's ranks and carries them to the hub
    over one connection; it lives as long as the hub actor, which owns it and holds its
    handle."""

    def __init__(self, hub: str, token: str, node: str, job: str) -> None:
        from rtop.hub.relay import RelayConfig, ThreadedRelay

        self._relay = ThreadedRelay(RelayConfig(hub=hub, token=token, node=node, job=job,
                                                linger_s=None),
                                    on_exit=self._exit).start()

    def _exit(self) -> None:
        with contextlib.suppress(Exception):  # not in an actor (a test), or Ray going down
            import ray

            ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    def address(self) -> tuple[str, int]:
        """``(host, port)`` the node's ranks connect to (loopback)."""
        return parse_address(self._relay.address)
