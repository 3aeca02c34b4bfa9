"""Every threshold the diagnosis uses, with its default and what it means.

A rank is judged against its peers (the median of the other ranks, and their spread as
1.4826 x the median absolute deviation, so a noisy fleet gets a wider band than a quiet
one) and over time: a rank fault needs its condition in at least ``persist_min_steps``
of its recent steps and ``*_min_fraction`` of them, the newest included (a GPU's clocks:
its last ``throttle_samples`` samples), so one hiccup is never a fault. A finding starts
when its condition holds at ``onset_evals`` evaluations in a row and ends when it has
not held for ``clear_s`` seconds; while it is active its ranks are judged against
thresholds eased by the kind's ``*_clear`` factor (under 1 where a high figure flags,
over 1 where a low one does), so a figure hovering at the limit does not make a finding
flap. A condition most ranks share is one finding about the job, not hundreds of rank
faults. Every number that decides a finding is a field here. Override any
field with ``AnalysisConfig(**changes)``, from a JSON file (``rtop serve --thresholds
FILE``, ``rtop report --thresholds FILE``) or ``RTOP_THRESHOLDS='{"straggler_ratio": 1.5}'``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

#: Expected allreduce bus bandwidth per fabric class, bytes/s. ``None``: not judged.
DEFAULT_FABRIC_BUSBW: dict[str, float | None] = {
    "nvlink": 300e9,  # NVLink 4 (H100/H200 SXM); NCCL reaches 350+ GB/s at 8 GPUs
    "pcie": 20e9,  # PCIe Gen4/5 peer-to-peer without NVLink
    "infiniband": 40e9,  # 400 Gb/s NDR per GPU, ~45 GB/s busbw in nccl-tests
    "ethernet": 10e9,  # 100 GbE
    "loopback": None,  # several CPU ranks on one host (gloo): nothing to compare with
}


@dataclass(frozen=True)
class AnalysisConfig:
    """Thresholds of the diagnosis (see the module doc for how they are applied)."""

    # windows
    recent_s: float = 2.0  # step figures are medians over the steps of the last recent_s
    recent_min_steps: int = 3  # ... but over at least this many steps
    recent_max_steps: int = 20  # ... and at most this many
    onset_evals: int = 2  # consecutive evaluations (0.5 s apart live) before a finding starts
    clear_s: float = 5.0  # a finding ends after its condition has not held this long
    # persistence: a rank fault holds in at least this many of its recent steps ...
    persist_min_steps: int = 2
    # lost_rank
    # ranks lost this soon after the first are named with it when they went silent (their
    # order is not known finer than their batches), or when their connections closed and
    # they were every rank of the first one's node (the node went away); otherwise the
    # first connection to close without a goodbye is the culprit and the rest followers
    lost_together_s: float = 0.3
    # ranks that said goodbye (terminated by a signal, failed, exited) within this long
    # after the first rank was lost are listed as its followers
    lost_follow_s: float = 60.0
    # starved_rank / input_bound
    starved_ratio: float = 3.0  # data wait at least this many times the others' median
    starved_min_wait_s: float = 0.005  # ... and at least this long
    starved_min_share: float = 0.15  # ... and at least this share of the rank's step
    starved_z: float = 6.0  # ... and this many robust spreads (MAD) above its peers
    starved_min_fraction: float = 0.5  # ... in at least this share of its recent steps
    # ... and, held in just persist_min_steps, not shrinking below this share of its
    # excess from one step to the next (a loader catching up after one stall)
    starved_steady: float = 0.8
    starved_clear: float = 0.7  # active findings use thresholds times this
    input_bound_share: float = 0.15  # every rank's data wait above this share of its step
    input_bound_fraction: float = 0.75  # ... for at least this fraction of the ranks
    # straggler
    straggler_ratio: float = 1.3  # compute at least this many times the others' median
    straggler_min_excess_s: float = 0.005  # ... and at least this much longer
    straggler_min_share: float = 0.10  # ... and the excess at least this share of its step
    straggler_z: float = 6.0  # ... and this many robust spreads (MAD) above its peers
    straggler_min_fraction: float = 0.6  # ... in at least this share of its recent steps
    # ... and those slow steps together last at least this long: on fast steps, a second
    # of CPU contention (a checkpoint's write beside the job) slows ten-odd steps alike
    straggler_min_s: float = 1.5
    # ... counted over the rank's last straggler_lookback_steps steps (of the last
    # straggler_lookback_s seconds), back from its newest to where straggler_break_steps
    # steps in a row were not slow: 20 steps of 65 ms cannot hold 1.5 s
    straggler_lookback_steps: int = 64
    straggler_lookback_s: float = 10.0
    straggler_break_steps: int = 3
    straggler_max_share: float = 0.5  # more than this share of the ranks slow: no straggler
    straggler_clear: float = 0.8  # active findings use thresholds times this
    # straggler: its cause, read from the slow rank's own counters
    cause_power_share: float = 0.95  # power at least this share of its limit: at the power cap
    cause_temp_c: float = 85.0  # GPU at least this hot (degrees C): heat
    cause_host_cpu_pct: float = 90.0  # its host's CPUs at least this busy: saturated
    # ... said plainly when this many points busier than its peers' hosts (or theirs is
    # unknown), else with the load average: "the processes there compete for cores"
    cause_host_cpu_over_peers_pct: float = 20.0
    # slow_link
    fabric_busbw: dict[str, float | None] = field(
        default_factory=lambda: dict(DEFAULT_FABRIC_BUSBW))
    inter_node_fabric: str = "ethernet"  # the class assumed between nodes
    slow_link_ratio: float = 0.5  # measured busbw below this share of the expected
    slow_link_min_bytes: float = 1e6  # only judge steps that all-reduce at least this
    slow_link_clear: float = 1.2  # active: slow_link_ratio times this
    # slow_link, from a link probe: a link under this share of the median of the other
    # links of its kind (between nodes, within a node) is slow
    link_slow_fraction: float = 0.5
    # low_scaling_efficiency
    efficiency_min: float = 0.6  # compute / (compute + exposed comm) below this
    efficiency_clear: float = 1.1  # active: efficiency_min times this
    # memory_wall
    headroom_min: float = 0.10  # free memory below this share of capacity
    oom_horizon_steps: float = 20000.0  # memory growth that fills the device within this
    oom_horizon_s: float = 3600.0  # ... or, with no step rate known, within this many seconds
    mem_trend_samples: int = 20  # samples (about 1 s apart) the growth is fitted on ...
    # ... and, where those show no trend (a slow leak), this many
    mem_trend_long_samples: int = 120
    mem_trend_long_every_s: float = 5.0  # ... refitted this often (it changes slowly)
    mem_trend_min_samples: int = 10  # ... of which at least this many (after warm-up)
    mem_trend_min_growth: float = 0.02  # growth over the fit at least this share of capacity
    mem_trend_min_r2: float = 0.8  # ... and this straight
    # ... and the newer half of the fit growing at least this share as fast as the whole
    # (memory that grew during a warm-up and then stopped is no trend)
    mem_trend_newer_ratio: float = 0.5
    # active: headroom_min and oom_horizon_steps times this, mem_trend_min_growth and
    # mem_trend_min_r2 divided by it
    memory_wall_clear: float = 1.3
    oom_critical_steps: float = 500.0  # critical (not warning) when it fills within this ...
    headroom_critical: float = 0.03  # ... or less than this share of capacity is free
    # gpu_throttled
    throttle_clock_ratio: float = 0.9  # SM clock below this share of its max, with a reason
    # ... and this far (share of max) below its peers' median clock (a fleet that runs
    # power-capped, every GPU at ~92 %, is no fleet of throttled GPUs) ...
    throttle_peer_drop: float = 0.08
    throttle_samples: int = 2  # ... in each of its last this many GPU samples (~1 s apart)
    throttle_clear: float = 1.05  # active: throttle_clock_ratio times this
    # this share of the GPUs or more under their max clock with a throttle reason (the
    # power cap, heat): one fact about the job, not a fault of each rank
    throttle_fleet_fraction: float = 0.75
    throttle_fleet_ratio: float = 0.98  # ... "under" meaning below this share of the max
    # hung_rank
    hung_min_s: float = 30.0  # a phase longer than the larger of this ...
    hung_step_multiple: float = 10.0  # ... and this many median steps
    # checkpoint_interval (Young/Daly)
    gpu_mtbf_h: float = 50000.0  # mean time between failures of one GPU (and its share of node)
    checkpoint_tolerance: float = 2.0  # interval off the optimum by more than this factor
    checkpoint_clear: float = 1.2  # active: checkpoint_tolerance times this
    # warning (not info) when the share of the run lost to checkpoints and to redoing work
    # after failures is over this many times what the optimum loses ...
    checkpoint_warning_ratio: float = 2.0
    checkpoint_warning_overhead: float = 0.05  # ... and over this share of the run

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> AnalysisConfig:
        """Defaults, then ``RTOP_THRESHOLDS`` (JSON), then a JSON file, then overrides."""
        changes: dict[str, Any] = {}
        if os.environ.get("RTOP_THRESHOLDS"):
            changes.update(json.loads(os.environ["RTOP_THRESHOLDS"]))
        if path:
            changes.update(json.loads(Path(path).read_text()))
        changes.update(overrides)
        return cls().with_changes(**changes)

    def with_changes(self, **changes: Any) -> AnalysisConfig:
        """A copy with some thresholds changed; unknown names are an error."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown threshold(s): {', '.join(sorted(unknown))}")
        if "fabric_busbw" in changes:
            merged = dict(self.fabric_busbw)
            merged.update(changes["fabric_busbw"])
            changes["fabric_busbw"] = merged
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """All thresholds, for the report's record of how it judged."""
        return asdict(self)
