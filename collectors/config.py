"""Settings of a probe, with defaults and the environment variables that set them.

| variable | meaning | default |
|---|---|---|
| ``RTOP_HUB`` | ``host:port`` of the hub | discovered |
| ``RTOP_TOKEN`` | the hub's token | discovered |
| ``RTOP_TOKEN_FILE`` | a file holding the token (0600, yours); ``RTOP_TOKEN`` wins | — |
| ``RTOP_DISABLE`` | ``1``: ``collectors.start()`` returns a probe that does nothing | off |
| ``RTOP_FLUSH_S`` | how often records are sent | 0.5 s; 1 s in a world of 1,024 ranks or more |
| ``RTOP_SAMPLE_S`` | GPU / host / memory / heartbeat sampling period | 1.0 |
| ``RTOP_STACK_AFTER_S`` | a phase longer than this sends the training thread's stack | 10 |
| ``RTOP_MEM_CAPACITY_BYTES`` | the memory capacity headroom is measured against | device's |
| ``RTOP_SPOOL`` | ``0``: records still unsent at exit are dropped, not spooled | on |
| ``RTOP_SPOOL_MAX_BYTES`` | the most a rank's spool file may hold (oldest left out) | 64 MiB |
| ``RTOP_PROBE_MEMORY_SHARE`` | the most of its free memory a link probe may take on a rank | 0.25 |
| ``RTOP_FLOPS_PER_STEP`` | the model FLOPs of one step of this rank (TFLOPS, MFU) | — |
| ``RTOP_FLOPS_DTYPE`` | the precision of MFU's peak: bf16, fp16, tf32, fp32, fp8 | bf16 |
| ``RTOP_PIPELINE_STAGE`` | this rank's pipeline stage (its peers: its stage's) | groups' |
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, fields, replace
from typing import Any

from collectors.linkprobe import REFUSE_SHARE

log = logging.getLogger("collectors")

#: The most a token file may hold: a token is a line, not a document.
TOKEN_FILE_MAX_BYTES = 4096
#: How a DDP model's allreduce may be timed (``ProbeConfig.comm_timing``).
COMM_TIMINGS = ("ddp", "hook")
#: The precisions MFU may be measured against (``ProbeConfig.flops_dtype``).
DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")
#: How often a rank sends its records unless told (``RTOP_FLUSH_S``) ...
FLUSH_S = 0.5
#: ... and in a world of ``LARGE_WORLD`` ranks or more: a big job's ranks send half as
#: many frames, each twice as full (half the frames to decode, acknowledgements to send
#: and relay frames to carry; the records are the same; the diagnosis, which judges
#: several steps, learns of a fault half a second later).
LARGE_WORLD = 1024
LARGE_WORLD_FLUSH_S = 1.0


class TokenFileError(ValueError):
    """A token file that must not be used; the message says why and what to do."""


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (its first line, stripped).

    A token is a secret: the file must be a regular file owned by this user (or root)
    that nobody else can read (``chmod 600``); anything else raises
    :class:`TokenFileError` with a message that says what is wrong. Symbolic links are
    followed (mounted secrets are links) and the file they reach is checked.
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TokenFileError(f"cannot read the token file {name}: "
                             f"{exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"the token file {name} is not a regular file")
        if st.st_uid not in (os.getuid(), 0):
            raise TokenFileError(f"the token file {name} belongs to uid {st.st_uid}, not "
                                 f"to you: anyone who planted it knows the token")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise TokenFileError(
                f"the token file {name} is readable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {name}`")
        data = os.read(fd, TOKEN_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > TOKEN_FILE_MAX_BYTES:
        raise TokenFileError(f"the token file {name} is larger than "
                             f"{TOKEN_FILE_MAX_BYTES} bytes: not a token")
    lines = data.decode("utf-8", "replace").strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise TokenFileError(f"the token file {name} is empty")
    return token


def _env_token() -> str | None:
    """``RTOP_TOKEN``, else the token in ``RTOP_TOKEN_FILE``; never raises: a token file
    that cannot be used is logged and ignored (the job goes on; the hub will refuse)."""
    token = os.environ.get("RTOP_TOKEN")
    if token:
        return token
    path = os.environ.get("RTOP_TOKEN_FILE")
    if not path:
        return None
    try:
        return read_token_file(path)
    except Exception as exc:  # a TokenFileError, or anything else: never into the job
        log.warning("rtop: RTOP_TOKEN_FILE ignored: %s", exc)
    return None


def _float(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of ``choices`` from the environment (any case); anything else is logged and
    ignored."""
    value = os.environ.get(name)
    if value is None or value.lower() in choices:
        return default if value is None else value.lower()
    log.warning("rtop: %s=%s ignored: it is one of %s (the default, %s, is used)", name,
                value, ", ".join(choices), default)
    return default


def _share(name: str, default: float) -> float:
    """A share in (0, 1] from the environment; anything else is logged and ignored."""
    value = _float(name, default)
    if 0 < value <= 1:
        return value
    log.warning("rtop: %s=%s ignored: a share is above 0 and at most 1", name,
                os.environ.get(name))
    return default


def _dtype(value: str) -> str | None:
    return None if value == "auto" else value


def _positive(name: str) -> float | None:
    """A positive number from the environment (None when absent); anything else is
    logged and ignored."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if number > 0 and number != float("inf"):
        return number
    log.warning("rtop: %s=%s ignored: it is a positive number", name, value)
    return None


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
    #: How often records are sent; None: :data:`FLUSH_S`, or :data:`LARGE_WORLD_FLUSH_S`
    #: in a world of :data:`LARGE_WORLD` ranks or more (:meth:`flush_every`).
    flush_interval_s: float | None = None
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
    #: The socket's send buffer (``SO_SNDBUF``; 0: the system's, which grows to
    #: megabytes). Kept small: what the kernel holds is out of sight of the bounds
    #: above, and the frames written are kept until the hub acknowledges them anyway.
    send_buffer_bytes: int = 256 * 1024
    connect_timeout_s: float = 1.0
    welcome_timeout_s: float = 5.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    close_timeout_s: float = 2.0
    #: How a DDP model's allreduce is timed: "ddp" (on CPU, DDP's own C++ timer and no
    #: hook: no extra pass over the gradients; see ``collectors.ddptimer``; models it
    #: cannot time, CUDA ones first, get the hook) or "hook" (always a comm hook timing
    #: each bucket, with CUDA events on GPU).
    comm_timing: str = "ddp"
    #: Give up on a GPU step time whose CUDA events have not completed after this long.
    cuda_resolve_timeout_s: float = 30.0
    #: At exit with no hub to take them, write the unsent records to a spool file in
    #: the runtime directory (:mod:`collectors.spool`) for a later hub or ``rtop
    #: report``; off: they are dropped and counted.
    spool: bool = True
    #: The most bytes a spool file may hold; the oldest batches are left out beyond it
    #: (their records counted as dropped).
    spool_max_bytes: int = 64 * 1024 * 1024
    #: The most seconds writing the spool may take (after ``close_timeout_s``); batches
    #: not written by then are counted as dropped.
    spool_timeout_s: float = 1.0
    #: Where spools go: None for the runtime directory (the hubs of this node look
    #: there); another directory must be the user's own (made 0700).
    spool_dir: str | None = None
    #: The share of the free memory where a link probe allocates (the GPU's, or the
    #: host's for all the node's ranks) beyond which this rank refuses the probe
    #: (``collectors.linkprobe.affordable``); between 0 (exclusive) and 1.
    probe_memory_share: float = REFUSE_SHARE
    #: The model FLOPs of one step of this rank, when known beforehand (else
    #: ``probe.count_flops`` or ``probe.step(flops=...)``); None: not known.
    flops_per_step: float | None = None
    #: The precision the GPU's peak is read for, for MFU (one of :data:`DTYPES`); None:
    #: as ``count_flops`` finds it, else bf16 (the hub says it assumed it).
    flops_dtype: str | None = None
    #: This rank's pipeline stage, when the job's groups do not say (the hub reads it
    #: from a pipeline group's description: ``mesh_pp``, ``PIPELINE_MODEL_PARALLEL``).
    pipeline_stage: int | None = None

    def flush_every(self, world_size: int) -> float:
        """Seconds between a rank's sends in a world of ``world_size`` ranks: as set, else
        :data:`FLUSH_S` (:data:`LARGE_WORLD_FLUSH_S` from :data:`LARGE_WORLD` ranks on)."""
        if self.flush_interval_s is not None:
            return self.flush_interval_s
        return LARGE_WORLD_FLUSH_S if world_size >= LARGE_WORLD else FLUSH_S

    @classmethod
    def from_env(cls, **overrides: Any) -> ProbeConfig:
        """Defaults, then ``RTOP_*`` environment variables, then explicit overrides."""
        cfg = cls(
            hub=os.environ.get("RTOP_HUB") or None,
            token=_env_token(),
            enabled=os.environ.get("RTOP_DISABLE", "").lower() not in ("1", "true", "yes"),
            flush_interval_s=_positive("RTOP_FLUSH_S"),
            sample_interval_s=_float("RTOP_SAMPLE_S", cls.sample_interval_s),
            stack_after_s=_float("RTOP_STACK_AFTER_S", cls.stack_after_s),
            memory_capacity_bytes=_int_or_none("RTOP_MEM_CAPACITY_BYTES"),
            comm_timing=_choice("RTOP_COMM_TIMING", COMM_TIMINGS, cls.comm_timing),
            spool=os.environ.get("RTOP_SPOOL", "1").lower() not in ("0", "false", "no"),
            spool_max_bytes=_int_or_none("RTOP_SPOOL_MAX_BYTES") or cls.spool_max_bytes,
            probe_memory_share=_share("RTOP_PROBE_MEMORY_SHARE", cls.probe_memory_share),
            flops_per_step=_positive("RTOP_FLOPS_PER_STEP"),
            flops_dtype=_dtype(_choice("RTOP_FLOPS_DTYPE", DTYPES, "auto")),
            pipeline_stage=_int_or_none("RTOP_PIPELINE_STAGE"),
        )
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown probe setting(s): {', '.join(sorted(unknown))}")
        return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
