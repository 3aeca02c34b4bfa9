"""The process groups a rank's collectives run on: named for its step records, described
for the hub.

A job with tensor, pipeline and data parallelism runs its collectives on several
``ProcessGroup``\\ s: a data-parallel group's gradient allreduce, a tensor-parallel
group's activations, a pipeline group's broadcasts. ``collectors.collectives`` keeps the
group each collective ran on (the ``ProcessGroup`` object, on the training thread: no
lookup there); on the sender thread :class:`ProcessGroups` names it by the name torch gives
it (``group.group_name``: the same on every rank of the group, and unique in the job:
``"0"`` for the default group, then a counter or a hash of the ranks) and describes it
once, for the rank's ``meta`` (:meth:`ProcessGroups.described`): its name, its
description (``group_desc``: ``"default_pg"``, a DeviceMesh's ``"mesh_pp"``, Megatron's
``"PIPELINE_MODEL_PARALLEL_GROUP"``, whatever the job passed to ``new_group``), its size,
this rank's place in it and its ranks (:func:`ranks_text`). The hub learns from these
which ranks are peers (ranks of different pipeline stages are not: the stage is a rank's
place in its pipeline group, ``rtop.analysis.peers``).

Everything here runs on the sender thread and never raises: a group torch cannot
describe is named by its id and described with what could be read.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Sequence
from typing import Any, Final

#: The most groups a rank describes and splits its steps by (the rest are one: "other").
MAX_GROUPS: Final = 16
#: The name of the collectives on groups past :data:`MAX_GROUPS`.
OTHER: Final = "other"
#: The most characters of a group's ranks as text.
MAX_RANKS_TEXT: Final = 200


def ranks_text(ranks: Sequence[int]) -> str:
    """A group's ranks, short: ``"0-7"``, ``"1,3"``, ``"0-1023:8"`` (from 0 to 1023 in
    steps of 8), or a list cut with ``…`` past :data:`MAX_RANKS_TEXT` characters."""
    rs = [int(r) for r in ranks]
    if not rs:
        return ""
    if len(rs) >= 3:
        step = rs[1] - rs[0]
        if step > 0 and all(b - a == step for a, b in itertools.pairwise(rs)):
            return f"{rs[0]}-{rs[-1]}" + ("" if step == 1 else f":{step}")
    text = ",".join(str(r) for r in rs)
    return text if len(text) <= MAX_RANKS_TEXT else text[:MAX_RANKS_TEXT - 1] + "…"


def describe(group: Any) -> dict[str, Any]:
    """What torch says of ``group``: ``{"name", "desc", "size", "rank", "ranks"}`` (each
    left out when it cannot be read)."""
    out: dict[str, Any] = {}
    try:
        out["name"] = str(group.group_name)
    except Exception:
        out["name"] = f"pg{id(group):x}"
    with contextlib.suppress(Exception):
        out["desc"] = str(group.group_desc)
    with contextlib.suppress(Exception):
        out["size"] = int(group.size())
        out["rank"] = int(group.rank())
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        with contextlib.suppress(Exception):
            out["ranks"] = ranks_text(dist.get_process_group_ranks(group))
    return out


class ProcessGroups:
    """Names the groups a rank's collectives ran on, and keeps their descriptions
    (sender thread only). ``generation`` grows with each group first seen, so the sender
    knows when to send its meta again."""

    def __init__(self) -> None:
        self._names: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, name)
        self._described: list[dict[str, Any]] = []
        self.generation = 0
        #: the default group's name, once seen (its collectives need no split of their own)
        self.world: str | None = None

    def name(self, group: Any) -> str | None:
        """The name of ``group`` (:data:`OTHER` past :data:`MAX_GROUPS`); None for no
        group (a collective whose group is not known)."""
        if group is None:
            return None
        known = self._names.get(id(group))
        if known is not None and known[0] is group:
            return known[1]
        if len(self._described) >= MAX_GROUPS:
            return OTHER
        info = describe(group)
        name = str(info["name"])
        if self._is_world(group):
            self.world = name
            info["world"] = True
        self._names[id(group)] = (group, name)  # the group lives as long as the job
        if all(d.get("name") != name for d in self._described):
            self._described.append(info)
            self.generation += 1
        return name

    def scan(self) -> None:
        """Name every group this rank belongs to, whether or not a timed collective ran
        on it yet: a pipeline group that only carries point-to-point sends (not timed)
        still says which stage the rank is. Read from torch's own registry of groups
        (``distributed_c10d._world.pg_names``: not a public API, so anything amiss there
        only leaves the scan out)."""
        dist = sys.modules.get("torch.distributed")
        if dist is None:
            return
        try:
            if not dist.is_initialized():
                return
            groups = list(dist.distributed_c10d._world.pg_names)
        except Exception:
            return
        for group in groups:
            self.name(group)

    def described(self) -> list[dict[str, Any]]:
        """Every group seen, as :func:`describe` says (a copy)."""
        return [dict(d) for d in self._described]

    @staticmethod
    def _is_world(group: Any) -> bool:
        dist = sys.modules.get("torch.distributed")
        if dist is None:
            return False
        try:
            return group is dist.group.WORLD
        except Exception:
            return False
