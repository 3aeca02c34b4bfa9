"""Settings of a probe, with defaults and the environment variables that set them.

| variable | meaning | default |
|---|---|---|
| ``RTOP_HUB`` | ``host:port`` of the hub | discovered |
| ``RTOP_TOKEN`` | the hub's token | discovered |
| ``RTOP_DISABLE`` | ``1``: ``collectors.start()`` returns a probe that does nothing | off |
| ``RTOP_FLUSH_S`` | how often records are sent | 0.5 |
| ``RTOP_SAMPLE_S`` | GPU / host / memory / heartbeat sampling period | 1.0 |
| ``RTOP_STACK_AFTER_S`` | a phase longer than this sends the training thread's stack | 10 |
| ``RTOP_MEM_CAPACITY_BYTES`` | the memory capacity headroom is measured against | device's |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any


def _float(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


def _int_or_none(name: str) -> int | None:
    try:
        return int(float(os.environ[name]))
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class ProbeConfig:
    """Everything a probe can be told. Build with :meth:`from_env` and override fields."""

    hub: str | None = None
    token: str | None = None
    enabled: bool = True
    flush_interval_s: float = 0.5
    sample_interval_s: float = 1.0
    stack_after_s: float = 10.0
    memory_capacity_bytes: int | None = None
    #: Step records the training thread may queue before the sender takes them.
    buffer_records: int = 8192
    #: Encoded frames kept while the hub is unreachable (oldest dropped first).
    backlog_frames: int = 240
    #: Bytes of encoded frames not yet sent (queued, or being written to the socket)
    #: beyond which the oldest queued frames are dropped, their records counted as
    #: ``dropped_unsent`` (like ``backlog_frames``, which counts frames instead).
    max_unsent_bytes: int = 8 * 1024 * 1024
    connect_timeout_s: float = 1.0
    welcome_timeout_s: float = 5.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    close_timeout_s: float = 2.0
    #: How a DDP model's allreduce is timed: "ddp" (on CPU, DDP's own C++ timer and no
    #: hook: no extra pass over the gradients; see ``collectors.ddptimer``; models it
    #: cannot time, CUDA ones first, get the hook; "auto", its earlier name, means the
    #: same) or "hook" (always a comm hook timing each bucket, with CUDA events on GPU).
    comm_timing: str = "ddp"
    #: Give up on a GPU step time whose CUDA events have not completed after this long.
    cuda_resolve_timeout_s: float = 30.0

    @classmethod
    def from_env(cls, **overrides: Any) -> ProbeConfig:
        """Defaults, then ``RTOP_*`` environment variables, then explicit overrides."""
        cfg = cls(
            hub=os.environ.get("RTOP_HUB") or None,
            token=os.environ.get("RTOP_TOKEN") or None,
            enabled=os.environ.get("RTOP_DISABLE", "").lower() not in ("1", "true", "yes"),
            flush_interval_s=_float("RTOP_FLUSH_S", cls.flush_interval_s),
            sample_interval_s=_float("RTOP_SAMPLE_S", cls.sample_interval_s),
            stack_after_s=_float("RTOP_STACK_AFTER_S", cls.stack_after_s),
            memory_capacity_bytes=_int_or_none("RTOP_MEM_CAPACITY_BYTES"),
            comm_timing=os.environ.get("RTOP_COMM_TIMING", cls.comm_timing).lower(),
        )
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown probe setting(s): {', '.join(sorted(unknown))}")
        return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
