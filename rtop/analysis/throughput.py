"""Throughput and MFU where they can be known: samples/s, tokens/s, model TFLOPS and the
share of the GPUs' peak they reach.

Per rank, from its step figures (recent medians live, run medians in a report): samples
and tokens per second are its samples and tokens per step over its step time; its model
FLOP/s its FLOPs per step (``flops``: given by the loop or the settings, or counted once
by ``probe.count_flops``) over its step time; its MFU that over its GPU's dense peak at
the step's precision (:mod:`rtop.analysis.peaks`: the precision the rank said, else
bf16, assumed and said so).

For the job (:func:`job_throughput`): samples and tokens per second summed over one rank
per model replica (:func:`rtop.analysis.roles.counted`: a batch that crosses four
pipeline stages is one batch, not four), model FLOP/s summed over every rank (each counts
its own part of the model), MFU as their sum over the sum of the same ranks' peaks. What
cannot be known is None, with the reason for MFU in words.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, TypedDict

import numpy as np

from rtop.analysis.peaks import DEFAULT_DTYPE, gpu_model, peak_flops
from rtop.analysis.window import Window
from rtop.run.snapshot import Throughput


class RankRates(TypedDict):
    """One rank's throughput (None: not measured)."""

    samples_per_s: float | None
    tokens_per_s: float | None
    model_flops_per_s: float | None
    mfu: float | None
    mfu_dtype: str | None


def said_dtype(meta: dict[str, Any]) -> str | None:
    """The precision a rank said its FLOPs are in (``meta["flops"]["dtype"]``)."""
    flops = meta.get("flops") if isinstance(meta, dict) else None
    dtype = flops.get("dtype") if isinstance(flops, dict) else None
    return dtype if isinstance(dtype, str) else None


def _ok(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _per_s(x: Any, step_s: Any) -> float | None:
    if not (_ok(x) and _ok(step_s)) or step_s <= 0:
        return None
    return float(x) / float(step_s)


def rank_rates(step_s: Any, samples: Any, tokens: Any, flops: Any, gpu: str | None,
               meta: dict[str, Any]) -> RankRates:
    """One rank's rates from its step figures, GPU name and meta (module doc)."""
    dtype = said_dtype(meta) or DEFAULT_DTYPE
    fps = _per_s(flops, step_s)
    peak = peak_flops(gpu, dtype)
    return RankRates(samples_per_s=_per_s(samples, step_s), tokens_per_s=_per_s(tokens, step_s),
                     model_flops_per_s=fps,
                     mfu=fps / peak if fps is not None and peak else None,
                     mfu_dtype=dtype if peak else None)


def _sum(values: np.ndarray, mask: np.ndarray) -> float | None:
    picked = values[mask & ~np.isnan(values)]
    return float(picked.sum()) if len(picked) else None


def job_throughput(step_s: np.ndarray, samples: np.ndarray, tokens: np.ndarray,
                   flops: np.ndarray, gpus: Sequence[str | None],
                   metas: Sequence[dict[str, Any]], counted: np.ndarray,
                   active: np.ndarray, said: Sequence[str | None] | None = None
                   ) -> Throughput:
    """The job's throughput over its active ranks (module doc); arrays of one entry per
    rank, NaN where not measured (``said``: :func:`said_dtype` of each of ``metas``,
    when the caller has them)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        timed = active & (step_s > 0)
        samples_s = samples / step_s
        tokens_s = tokens / step_s
        flops_s = flops / step_s
    if said is None:
        said = [said_dtype(m) for m in metas]
    dtypes = [d or DEFAULT_DTYPE for d in said]
    known: dict[tuple[str | None, str], float] = {}  # each GPU and precision looked up once
    peaks = np.array([known[gd] if (gd := (g, d)) in known else known.setdefault(
        gd, peak_flops(g, d) or np.nan) for g, d in zip(gpus, dtypes, strict=True)],
        dtype=np.float64)
    with_flops = timed & ~np.isnan(flops_s)
    both = with_flops & ~np.isnan(peaks)
    model_fps = _sum(flops_s, with_flops)
    peak_sum = _sum(peaks, both)
    mfu = float(flops_s[both].sum() / peak_sum) if both.any() and peak_sum else None
    gpu_names = [g for g, t in zip(gpus, timed.tolist(), strict=True) if g and t]
    common = Counter(gpu_names).most_common(1)[0][0] if gpu_names else None
    why = None
    if mfu is None:
        if not with_flops.any():
            why = ("no FLOPs per step known: probe.count_flops(model, batch), "
                   "probe.step(flops=...) or RTOP_FLOPS_PER_STEP")
        elif common is None:
            why = "no GPU measured"
        elif gpu_model(common) is None:
            why = f"{common}: not in rtop's table of GPU peaks"
        else:
            why = f"{common} has no {dtypes[0]} peak"
    both_list = both.tolist()
    used = [d for d, b in zip(dtypes, both_list, strict=True) if b] or dtypes[:1]
    dtype = Counter(used).most_common(1)[0][0] if used else None
    return Throughput(
        samples_per_s=_sum(samples_s, timed & counted),
        tokens_per_s=_sum(tokens_s, timed & counted),
        ranks_counted=int((timed & counted).sum()),
        model_flops_per_s=model_fps, peak_flops_per_s=peak_sum if both.any() else None,
        mfu=mfu, dtype=dtype if both.any() else None,
        dtype_assumed=bool(both.any()) and not any(
            s for s, b in zip(said, both_list, strict=True) if b),
        gpu=gpu_model(common) or common, why_no_mfu=why)


def of_window(w: Window) -> Throughput:
    """The job's throughput over the window's recent steps (:func:`job_throughput`)."""
    counted = w.counted if w.counted is not None else np.ones(w.n, dtype=bool)
    return job_throughput(w.steps["step_s"], w.steps["samples"], w.steps["tokens"],
                          w.steps["flops"], w.gpu_name, [r.meta for r in w.ranks], counted,
                          w.active, w.said_dtype)
