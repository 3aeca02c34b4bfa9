"""Every kind of finding, declared once: its badge, whether it blames ranks, its usual
severity and its usual fix.

The detectors decide *whether* a finding holds (``rtop.analysis.detectors``), the
wording says it (``rtop.analysis.wording``), and this table is what both, the report
and the UI (badges, worst-first order) read about a kind. A fix may name the finding's
figures in ``{braces}``; the wording fills them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from rtop.run.snapshot import Severity


@dataclass(frozen=True)
class Kind:
    """One kind of finding."""

    name: str
    #: the word its ranks wear in the UI's table ("" when the kind blames no rank there)
    badge: str
    #: blames particular ranks (as opposed to the job as a whole)
    rank_fault: bool
    #: severity unless the detector finds it worse (or milder)
    severity: Severity
    #: the usual fix, a template filled from the finding's figures
    fix: str
    #: how serious its badge is against the others' (higher first); 0 without a badge
    badge_weight: int = 0
    #: its condition is settled when it first holds: its detector requires it over
    #: several of each rank's steps (or samples) itself, or it is a state that does not
    #: flap (a rank lost: its connection closed without a goodbye, or silent past the
    #: hub's timeout). The finding starts at the first evaluation that holds, rather
    #: than after ``onset_evals`` of them (which would count the persistence twice, and
    #: would miss a job whose ranks all died within the last evaluation's half second:
    #: the report's last evaluation is the only one that sees them lost)
    persists: bool = False


KINDS: Final[dict[str, Kind]] = {k.name: k for k in (
    Kind("starved_rank", "STARVED", True, "warning",
         "Give {ranks}'s input more throughput: raise DataLoader num_workers and "
         "prefetch_factor (Ray Data: prefetch_batches), cache or move its shard to faster "
         "local storage, and check node {node}'s CPU and disk: its loader competes there.",
         badge_weight=3, persists=True),
    Kind("input_bound", "", False, "warning",
         "Feed faster: more DataLoader workers (num_workers) and prefetch_factor, or Ray "
         "Data prefetch_batches; cheaper decoding and augmentation (or move it to the "
         "GPU); faster or local storage. More GPUs will not help until the pipeline keeps "
         "up.", persists=True),
    Kind("straggler", "STRAGGLER", True, "warning",
         "If clocks or power are the cause: check cooling, the power cap and nvidia-smi -q "
         "-d PERFORMANCE on that node. A different GPU model: keep the job on identical "
         "GPUs. Host CPU: stop or pin what competes. Otherwise look for uneven batch "
         "shapes, or drain the node and compare.",
         badge_weight=2, persists=True),
    Kind("slow_link", "", False, "warning",
         "Check the links and NICs between the nodes (ethtool, ibstat), that NCCL uses the "
         "fast interface (NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME, NCCL_IB_HCA), and keep the "
         "job's workers on well-connected nodes (a STRICT_PACK placement group, fewer "
         "nodes)."),
    Kind("low_scaling_efficiency", "", False, "info",
         "More compute per byte: a larger per-rank batch (or gradient accumulation with "
         "no_sync); a faster fabric; better overlap (bucket_cap_mb, static_graph, "
         "FSDP/ZeRO prefetch); fewer bytes (bf16 gradients: bf16_compress_hook)."),
    Kind("memory_wall", "MEMWALL", True, "warning",
         "Data parallelism adds throughput, never capacity: every rank holds the whole "
         "model. Use activation checkpointing, a smaller per-rank batch (with gradient "
         "accumulation), mixed precision, or shard the model (FSDP/ZeRO; tensor or "
         "pipeline parallelism). If memory grows every step, look for tensors kept across "
         "steps (losses summed without .item(), growing caches, lists of outputs).",
         badge_weight=4),
    Kind("gpu_throttled", "THROTTLED", True, "warning",
         "Power cap: check the board's limit (nvidia-smi -q -d POWER) and the node's power "
         "budget. Thermal: check fans, inlet temperature and airflow. A throttled GPU makes "
         "its rank a straggler for the whole job.",
         badge_weight=1, persists=True),
    Kind("hung_rank", "HUNG", True, "critical",
         "Read the stack in the evidence: it shows where the rank waits. Usual causes: a "
         "data-loader worker deadlocked or a hung filesystem read, a collective that only "
         "some ranks call, an exception swallowed on one rank. py-spy dump --pid gives the "
         "native frames too.",
         badge_weight=6),
    Kind("lost_rank", "LOST", True, "critical",
         "Check the rank's log and the node's kernel log (OOM killer, Xid errors, "
         "segfaults). With Ray Train, FailureConfig(max_failures=...) restarts the worker "
         "group from the last checkpoint.",
         badge_weight=5, persists=True),
    Kind("checkpoint_interval", "", False, "info",
         "Checkpoint about every {optimum} (Young/Daly: sqrt(2 x checkpoint cost x job "
         "MTBF)); cheaper checkpoints (asynchronous, sharded) make frequent ones "
         "affordable. MTBF falls as GPUs are added."),
)}

#: Every kind, in the order the design lists them.
ALL_KINDS: Final = tuple(KINDS)
#: Kinds that blame particular ranks (as opposed to the job as a whole).
RANK_FAULTS: Final = tuple(k.name for k in KINDS.values() if k.rank_fault)
#: Badge -> how serious it is (higher first).
BADGE_WEIGHT: Final = {k.badge: k.badge_weight for k in KINDS.values() if k.badge}
#: Severity -> order, worst highest.
SEVERITY_ORDER: Final[dict[str, int]] = {"critical": 3, "warning": 2, "info": 1}
