"""What part of the model a rank runs, from the process groups it said it is in: who its
peers are, and whose samples count once.

A job with pipeline parallelism runs different layers on each stage: the last stage
computes the loss, the first one loads the batches, and a stage's step is made of other
work than another's. Its ranks are peers of the ranks *of the same stage* only: a
straggler is a rank slower than its own stage, not stage 3 being slower than stage 0
when every rank of stage 3 is alike. A rank's stage is its place in its pipeline group
(``collectors.groups``: the group whose description names a pipeline, as a DeviceMesh's
``mesh_pp``, Megatron's ``PIPELINE_MODEL_PARALLEL_GROUP`` or torchtitan's ``pp`` do), or
the ``pipeline_stage`` its settings give (``RTOP_PIPELINE_STAGE``), which wins.

The same groups say whose samples count once in the job's throughput: a model replica's
batch goes through every stage and every rank of a tensor-parallel group, so one rank
per replica counts it: the first stage's, and the first of its tensor-parallel group.

Everything is read from the ranks' ``meta`` (a peer's word: checked, never trusted to
be well formed).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

#: Words of a group's description that make it a pipeline group, and a tensor-parallel one
#: (a description mentioning data, expert or context parallelism too is neither: Megatron's
#: ``TENSOR_AND_DATA_PARALLEL_GROUP`` spans replicas).
PIPELINE_WORDS: Final = frozenset({"pp", "pipe", "pipeline"})
TENSOR_WORDS: Final = frozenset({"tp", "tensor"})
OTHER_WORDS: Final = frozenset({"dp", "data", "ep", "expert", "cp", "context", "and",
                                "embedding", "position"})
#: The peer class of a rank whose stage is not known (all such ranks are peers).
NO_STAGE: Final = -1


def _words(desc: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", desc.lower())) - {""}


def kind_of(desc: Any) -> str | None:
    """``"pipeline"``, ``"tensor"`` or None for a group's description."""
    if not isinstance(desc, str):
        return None
    return _kind(desc)


@functools.lru_cache(maxsize=1024)
def _kind(desc: str) -> str | None:
    words = _words(desc)
    if words & OTHER_WORDS:
        return None
    if words & PIPELINE_WORDS:
        return "pipeline"
    if words & TENSOR_WORDS:
        return "tensor"
    return None


def _place(meta: dict[str, Any], kind: str) -> int | None:
    """The rank's place in its group of ``kind`` (None: in none it said)."""
    groups = meta.get("groups")
    if not isinstance(groups, list):
        return None
    for g in groups:
        if isinstance(g, dict) and kind_of(g.get("desc")) == kind:
            rank, size = g.get("rank"), g.get("size")
            if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 and (
                    not isinstance(size, int) or size > 1):
                return rank
    return None


def stage_of(meta: dict[str, Any]) -> int | None:
    """The rank's pipeline stage: its setting's, else its place in its pipeline group;
    None when neither says."""
    given = meta.get("pipeline_stage")
    if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
        return given
    return _place(meta, "pipeline")


def tensor_rank_of(meta: dict[str, Any]) -> int | None:
    """The rank's place in its tensor-parallel group; None when it said of none."""
    return _place(meta, "tensor")


def roles_of(metas: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: its pipeline stage (:data:`NO_STAGE` when not known) and its place in
    its tensor-parallel group (-1 when in none it said), int64."""
    stage = np.full(len(metas), NO_STAGE, dtype=np.int64)
    tp = np.full(len(metas), -1, dtype=np.int64)
    for i, meta in enumerate(metas):
        if not isinstance(meta, dict) or ("groups" not in meta
                                          and "pipeline_stage" not in meta):
            continue
        s, t = stage_of(meta), tensor_rank_of(meta)
        if s is not None:
            stage[i] = s
        if t is not None:
            tp[i] = t
    return stage, tp


def peer_classes(metas: Sequence[dict[str, Any]]) -> np.ndarray:
    """Per rank, its peer class: its pipeline stage, or :data:`NO_STAGE` (int64)."""
    return roles_of(metas)[0]


def counted(metas: Sequence[dict[str, Any]], classes: np.ndarray) -> np.ndarray:
    """Per rank, whether its samples and tokens count in the job's throughput: one rank
    per model replica (the lowest stage present, the first of its tensor-parallel group;
    every rank when no stage or tensor group is known)."""
    return counted_from(classes, roles_of(metas)[1])


def counted_from(classes: np.ndarray, tensor_rank: np.ndarray) -> np.ndarray:
    """:func:`counted` from the ranks' classes and tensor-parallel places."""
    out = np.ones(len(classes), dtype=bool)
    staged = classes != NO_STAGE
    if staged.any():
        out &= ~staged | (classes == classes[staged].min())
    return out & (tensor_rank <= 0)


class RoleCache:
    """The ranks' roles (:func:`roles_of`) as of the last call, kept while ``key`` is
    the same (the run state's meta version and the ranks' slots: a rank's groups change
    only with its meta), so an evaluation of 16,384 ranks does not read every meta
    again."""

    def __init__(self) -> None:
        self._key: Any = None
        self._roles: tuple[np.ndarray, np.ndarray] | None = None

    def of(self, metas: Sequence[dict[str, Any]], key: Any) -> tuple[np.ndarray, np.ndarray]:
        """:func:`roles_of` ``metas``, or what it gave for the same ``key``."""
        if self._roles is None or key != self._key:
            self._roles, self._key = roles_of(metas), key
        return self._roles


def describe(classes: np.ndarray) -> dict[int, str]:
    """The words for each peer class present (``"pipeline stage 3"``)."""
    return {int(c): f"pipeline stage {int(c)}" for c in np.unique(classes) if c != NO_STAGE}
