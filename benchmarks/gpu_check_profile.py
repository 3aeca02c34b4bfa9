"""GPU sections of ``benchmarks/gpu_check.py``: ``rtop profile`` with CUDA activity on one
GPU (issue 25, findings 8, 9 and 10), what ``tests/test_profile_capture.py`` can only
fake.

``sections(torch, ui)`` returns ``(label, fn)`` pairs; ``gpu_check.main`` runs them after
it has initialised a one-rank NCCL process group and called ``torch.cuda.set_device(0)``.
Every check ends PASS, FAIL or SKIP (with a reason) through ``ui.check`` / ``ui.skip``;
``ui.say`` prints a detail line. Each section takes well under 20 s on an H200.

1. A capture with CUDA activity: ``ProfileCapture`` (what a hub arms on a rank) over 5
   steps of a GPU-bound model, started and stopped at the steps' boundaries with the
   model's device given, CUDA events recorded around the same boundaries. The trace must hold
   GPU kernels (and say whether kineto wrote GPU-side ``ProfilerStep`` annotations); the
   answer's timeline must be the GPU's, its window (``wall_s``) and busy time
   (``wall_s - idle_s``) within 10% of the CUDA events' span; the profiler must be off
   afterwards.
2. Bounds on the GPU: more than ``MAX_CUDA_PROFILE_STEPS`` steps is refused with a clear
   error and starts nothing; a capture of ``MAX_CUDA_PROFILE_STEPS`` steps of a model with
   many small kernels finishes at its last boundary within a few seconds, its trace size
   per step printed (the figure the bound is made of), and stops early, saying so, if
   the capture's memory bound is reached first.

Run alone (``python benchmarks/gpu_check_profile.py``) it runs the sections with a plain
printer; without CUDA each section says SKIP.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Tolerance of the summary's GPU figures against CUDA events.
REL_TOL = 0.10


def sections(torch: Any, ui: Any) -> list[tuple[str, Callable[[], None]]]:
    """The sections, as ``gpu_check.main`` runs them (see the module doc)."""
    return [
        ("P1. profile with CUDA activity", lambda: profile_check(torch, ui)),
        ("P2. profile bounds on the GPU", lambda: bounds_check(torch, ui)),
    ]


def _profiler_on() -> bool:
    import torch
    import torch.autograd.profiler as autograd_profiler

    return bool(autograd_profiler._is_profiler_enabled) or bool(
        torch._C._autograd._profiler_enabled())


def _capture(torch: Any, cap: Any, step: Callable[[], None], first: int,
             limit: int) -> tuple[list[tuple[Any, Any]], float]:
    """Run steps, calling the capture at each boundary from ``first`` on, with CUDA events
    recorded just before and just after each boundary (starting the profiler holds the
    host, and the GPU idles meanwhile); those pairs, and the last boundary's duration."""
    marks = []
    last_s = 0.0
    for i in range(limit):
        step()
        if i + 1 < first:
            continue
        before, after = (torch.cuda.Event(enable_timing=True),
                         torch.cuda.Event(enable_timing=True))
        before.record()
        t0 = time.perf_counter()
        finished = cap.at_boundary(i + 1)
        last_s = time.perf_counter() - t0
        after.record()
        marks.append((before, after))
        if finished:
            break
    return marks, last_s


def profile_check(torch: Any, ui: Any) -> None:
    """Section 1 (module doc)."""
    if not torch.cuda.is_available():
        ui.skip("profile with CUDA activity", "no CUDA device")
        return
    from collectors.profiler import ProfileCapture

    ui.say("P1. ProfileCapture over 5 GPU-bound steps; CUDA events at the same boundaries")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
    x = torch.randn(2048, 4096, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    out = tempfile.mkdtemp(prefix="rtop-gpu-profile-")
    answers: list[dict[str, Any]] = []
    try:
        cap = ProfileCapture(out, "rank0", 5, 0, answers.append, device=0)
        marks, last_s = _capture(torch, cap, step, first=2, limit=12)
        torch.cuda.synchronize()
        ans = answers[0] if answers else {"error": "no answer"}
        ui.check("P1: the capture answers", "error" not in ans,
                 ans.get("error") or f"steps {ans.get('steps')}, trace "
                 f"{(ans.get('trace_bytes') or 0) / 1e6:.1f} MB, last boundary {last_s:.2f} s")
        ui.check("P1: the profiler is off afterwards", not _profiler_on(), "")
        if "error" in ans:
            return
        kernels, gpu_steps = 0, 0
        try:
            trace = json.loads(Path(ans["trace"]).read_text())
            for ev in trace.get("traceEvents", []):
                cat = str(ev.get("cat", ""))
                kernels += cat == "kernel"
                gpu_steps += cat == "gpu_user_annotation" and str(
                    ev.get("name", "")).startswith("ProfilerStep")
        except (OSError, ValueError) as exc:
            ui.check("P1: the trace holds GPU kernels", False, f"unreadable: {exc}")
            return
        ui.check("P1: the trace holds GPU kernels", kernels > 0,
                 f"{kernels} kernels; GPU-side ProfilerStep annotations: {gpu_steps}")
        ui.check("P1: the split is the GPU's", ans.get("timeline") == "gpu",
                 f"timeline {ans.get('timeline')}")
        # from the profiler's start (after the first boundary) to its last step's end
        # (before the last boundary)
        span = marks[0][1].elapsed_time(marks[-1][0]) / 1e3
        wall, idle = ans.get("wall_s") or 0.0, ans.get("idle_s") or 0.0
        ui.say(f"summary: wall {wall * 1e3:.2f} ms, compute {ans.get('compute_s', 0) * 1e3:.2f}"
               f" ms, comm {ans.get('comm_s', 0) * 1e3:.2f} ms, idle {idle * 1e3:.2f} ms; "
               f"CUDA events across the captured steps: {span * 1e3:.2f} ms")
        ui.check("P1: the GPU window within 10% of CUDA events",
                 span > 0 and abs(wall - span) <= REL_TOL * span,
                 f"{wall * 1e3:.2f} ms vs {span * 1e3:.2f} ms")
        ui.check("P1: the GPU's busy time within 10% of CUDA events",
                 span > 0 and abs((wall - idle) - span) <= REL_TOL * span,
                 f"{(wall - idle) * 1e3:.2f} ms vs {span * 1e3:.2f} ms (GPU-bound steps)")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def bounds_check(torch: Any, ui: Any) -> None:
    """Section 2 (module doc)."""
    if not torch.cuda.is_available():
        ui.skip("profile bounds on the GPU", "no CUDA device")
        return
    from collectors.profiler import MAX_CUDA_PROFILE_STEPS, ProfileCapture

    ui.say(f"P2. bounds: {MAX_CUDA_PROFILE_STEPS + 1} steps refused; "
           f"{MAX_CUDA_PROFILE_STEPS} steps of many small kernels")
    out = tempfile.mkdtemp(prefix="rtop-gpu-bounds-")
    try:
        answers: list[dict[str, Any]] = []
        cap = ProfileCapture(os.path.join(out, "big"), "rank0", MAX_CUDA_PROFILE_STEPS + 1, 0,
                             answers.append, device=0)
        refused = cap.at_boundary(1)
        err = (answers[0] if answers else {}).get("error") or ""
        ui.check(f"P2: {MAX_CUDA_PROFILE_STEPS + 1} steps refused with a clear error",
                 refused and f"at most {MAX_CUDA_PROFILE_STEPS} steps" in err
                 and not _profiler_on(), err[:160] or "no error")

        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(48)]).cuda()
        x = torch.randn(64, 256, device="cuda")

        def step() -> None:
            model(x).square().mean().backward()

        for _ in range(3):
            step()
        answers = []
        cap = ProfileCapture(os.path.join(out, "many"), "rank0", MAX_CUDA_PROFILE_STEPS, 0,
                             answers.append, device=0)
        t0 = time.perf_counter()
        _, last_s = _capture(torch, cap, step, first=1, limit=MAX_CUDA_PROFILE_STEPS + 5)
        total_s = time.perf_counter() - t0
        ans = answers[0] if answers else {"error": "no answer"}
        if "error" in ans:
            ui.check("P2: a bounded GPU capture answers", False, ans["error"])
            return
        first, last = ans["steps"]
        steps = last - first + 1
        per_step = (ans.get("trace_bytes") or 0) / max(1, steps)
        ui.say(f"{steps} steps captured of {MAX_CUDA_PROFILE_STEPS} asked in {total_s:.1f} s; "
               f"trace {(ans.get('trace_bytes') or 0) / 1e6:.1f} MB ({per_step / 1e3:.0f} KB a "
               f"step); the last boundary (stop, write, summarise) took {last_s:.2f} s; "
               f"note: {ans.get('note')}")
        ui.check("P2: a bounded GPU capture answers",
                 steps == MAX_CUDA_PROFILE_STEPS or bool(ans.get("note")),
                 f"{steps} steps" + (f" (stopped early: {ans['note'][:100]})"
                                     if steps < MAX_CUDA_PROFILE_STEPS else ""))
        ui.check("P2: the last boundary holds the training thread a few seconds at most",
                 last_s < 15.0, f"{last_s:.2f} s")
        ui.check("P2: the profiler is off afterwards", not _profiler_on(), "")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    """Run the sections alone, with gpu_check's printer's format."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check_collectives import PlainUI

    ui = PlainUI()
    for label, fn in sections(torch, ui):
        print(label, flush=True)
        try:
            fn()
        except Exception as exc:
            ui.check(f"{label}: ran to the end", False, f"{type(exc).__name__}: {exc}")
    return 1 if ui.failed else 0


if __name__ == "__main__":
    os.environ.setdefault("RTOP_AUTOHUB", "0")
    sys.exit(main())
