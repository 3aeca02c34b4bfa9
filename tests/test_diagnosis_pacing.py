"""The live hub's diagnosis at thousands of ranks: a window read in parts is the window
read at once, the diagnosis keeps to its share of a core, and at small sizes it runs
every half second as before (rtop.analysis.monitor: ``advance(share=...)``)."""

from __future__ import annotations

import itertools

import numpy as np

from collectors import wire
from collectors.schema import MEM_FIELDS
from rtop.analysis import AnalysisConfig
from rtop.analysis.monitor import EVAL_EVERY_S, EVAL_MOST_EVERY_S, Monitor
from rtop.analysis.window import Taking, TrendCache, _mem_trend, take
from rtop.run.state import RunState
from tests.rankclient import identity
from tests.test_analysis import NOW, state_with, steps

RANKS = 48
SLOW, STARVED = 7, 30


def fleet() -> RunState:
    """48 ranks on 6 nodes, rank 7 computes slower, rank 30 waits on its loader."""
    figures = {r: {} for r in range(RANKS)}
    figures[SLOW] = {"compute_s": 0.12, "step_s": 0.15}
    figures[STARVED] = {"data_wait_s": 0.05, "step_s": 0.15}
    return state_with(steps(figures), nodes={r: f"node-{r // 8}" for r in range(RANKS)})


def test_a_window_read_in_parts_is_the_window_read_at_once():
    st, cfg = fleet(), AnalysisConfig()
    whole = take(st, cfg, st.now, TrendCache())
    taking = Taking(st, cfg, st.now, TrendCache())
    for _ in range(5):
        taking.step(11)  # 11, 22, 33, 44, 48
    assert taking.done == RANKS
    parts = taking.window()
    for name in ("rank", "node_of", "n_recent", "step_rate", "mem_slope", "mem_r2",
                 "clock_history", "recent_t", "phase_age_s", "active"):
        assert np.array_equal(getattr(whole, name), getattr(parts, name), equal_nan=True), name
    for figure in whole.steps:
        assert np.array_equal(whole.steps[figure], parts.steps[figure], equal_nan=True)
        assert np.array_equal(whole.recent[figure], parts.recent[figure], equal_nan=True)
    assert whole.node == parts.node and whole.status == parts.status
    assert whole.phase == parts.phase and whole.said_dtype == parts.said_dtype


def diagnoses(mon: Monitor, until: float, share: float | None, every: float = 0.25,
              lost: list[float] | None = None) -> list[tuple[float, list[str]]]:
    """Call ``advance`` every ``every`` s as the hub's timer does; the times of the
    evaluations that ran the diagnosis and the kinds each started (``lost``: filled with
    the times of those that marked ranks lost)."""
    assert mon.analyzer is not None
    out = []
    t = NOW + 2.0
    while t < until:
        t += every
        mon.state.now = t
        before = mon.analyzer.overview  # each diagnosis makes a new one
        ev = mon.advance(t, share=share)
        if ev is not None and mon.analyzer.overview is not before:
            out.append((ev.t, sorted(f["kind"] for f in ev.started)))
        if ev is not None and ev.lost and lost is not None:
            lost.append(ev.t)
    return out


def test_small_jobs_keep_the_half_second_cadence():
    """Cheap evaluations (48 ranks: ~ms) run every 0.5 s with or without a share: the
    latency the accuracy figures were measured with does not change."""
    plain = Monitor(fleet(), AnalysisConfig())
    shared = Monitor(fleet(), AnalysisConfig())
    a = diagnoses(plain, NOW + 6.0, None)
    b = diagnoses(shared, NOW + 6.0, 0.10)
    assert shared.eval_every_s == EVAL_EVERY_S
    assert len(a) == len(b) >= 7
    assert [k for _, k in a] == [k for _, k in b]
    assert {"straggler", "starved_rank"} <= {k for _, ks in b for k in ks}


def test_a_dear_diagnosis_runs_less_often_but_losses_are_not_late():
    """Evaluations dearer than their share (here any: a share of a millionth) come
    their cost over the share apart, at most EVAL_MOST_EVERY_S, while silent ranks are
    still marked lost every half second."""
    mon = Monitor(fleet(), AnalysisConfig())
    mon.state.lost_after_s = 3.0
    lost: list[float] = []
    ran = diagnoses(mon, NOW + 14.0, 1e-6, lost=lost)
    assert mon.eval_every_s == EVAL_MOST_EVERY_S
    times = [t for t, _ in ran]
    # the first two half a second apart (one evaluation alone never slows the next),
    # then as far apart as the share allows
    assert len(times) == 4 and times[1] - times[0] == EVAL_EVERY_S
    assert all(b - a >= EVAL_MOST_EVERY_S for a, b in itertools.pairwise(times[1:]))
    # the ranks sent last at NOW + 2: lost 3 s later, at the next half-second tick,
    # whatever the diagnosis' pace
    assert lost and NOW + 5.0 < lost[0] <= NOW + 5.5


def test_a_large_window_is_read_over_several_calls():
    """More ranks than part_ranks (48 > 16): the due call reads the first 16, the next
    two the others, the next the long memory fit, the one after runs the detectors and
    says what started, as of when the evaluation began; the findings are those of an
    evaluation at once."""
    whole = Monitor(fleet(), AnalysisConfig())
    ev0 = whole.advance(NOW + 2.5)
    assert ev0 is not None
    mon = Monitor(fleet(), AnalysisConfig())
    mon.part_ranks = 16
    t0 = NOW + 2.5
    first = mon.advance(t0, share=0.10)
    assert first is not None and first.started == [] and mon.findings == []
    assert mon.advance(t0 + 0.25, share=0.10) is None  # ranks 16-31
    assert mon.advance(t0 + 0.5, share=0.10) is not None  # 32-47 and the half-second tick
    assert mon.advance(t0 + 0.75, share=0.10) is None  # the long memory fit
    assert mon.findings == []
    done = mon.advance(t0 + 1.0, share=0.10)  # the detectors
    assert done is not None and done.t == t0
    assert sorted(f["kind"] for f in done.started) == \
        sorted(f["kind"] for f in ev0.started)
    assert [f["ranks"] for f in mon.findings] == [f["ranks"] for f in whole.findings]


def test_forcing_an_evaluation_drops_the_one_under_way():
    """A forced evaluation (the job exited) runs whole, at once, in place of one being
    read in parts."""
    mon = Monitor(fleet(), AnalysisConfig())
    mon.part_ranks = 16
    mon.advance(NOW + 2.5, share=0.10)
    ev = mon.advance(NOW + 2.6, force=True, share=0.10)
    assert ev is not None and {"straggler", "starved_rank"} <= {f["kind"] for f in ev.started}
    # and nothing of the dropped one comes after
    assert mon.advance(NOW + 2.7, share=0.10) is None


def test_frames_between_parts_are_fine():
    """Ranks that send (or a new one that says hello) while a window is read in parts:
    the evaluation ends with the ranks it began with, the next one takes the new one."""
    mon = Monitor(fleet(), AnalysisConfig())
    mon.part_ranks = 16
    t0 = NOW + 2.5
    mon.advance(t0, share=0.10)
    mon.apply(wire.Frame("hello", {"identity": identity(RANKS, world=RANKS + 1,
                                                           host="node-6")}), t0 + 0.1)
    assert mon.advance(t0 + 0.25, share=0.10) is None
    mon.advance(t0 + 0.5, share=0.10)
    mon.advance(t0 + 0.75, share=0.10)
    done = mon.advance(t0 + 1.0, share=0.10)
    assert done is not None and done.t == t0
    assert mon.analyzer is not None and mon.analyzer.cache.members is not None
    assert len(mon.analyzer.cache.members.ranks) == RANKS


def test_ranks_new_to_the_long_fit_are_fitted_a_share_at_a_time():
    """The long memory fit of ranks it has not seen: at most new_most at a call, NaN
    until their turn, then what a fit of all of them at once gives."""
    st = state_with(steps({r: {} for r in range(40)}, n=40))
    for r in range(40):  # 40 samples a second apart, each rank's memory growing its way
        rows = []
        for k in range(40):
            mem = dict.fromkeys(MEM_FIELDS)
            mem.update(t_wall=NOW + k * 0.1, device="cuda:0",
                       used_bytes=40e9 + (r + 1) * 1e7 * k, capacity_bytes=80e9)
            rows.append([mem[f] for f in MEM_FIELDS])
        st.apply(wire.Frame("batch", {"rank": r, "group": "g0", "mem": rows}), NOW + 4.0)
    cfg = AnalysisConfig()
    taking = Taking(st, cfg, NOW + 4.0)
    ranks, slots = taking.ranks, taking.slots
    at_once = _mem_trend(st, ranks, slots, cfg, cfg.mem_trend_long_samples)
    assert not np.isnan(at_once[0]).any()
    cache = TrendCache(new_most=16)
    # three calls within half a second: the first also fits its turn of the ranks (every
    # 10th: mem_trend_long_every_s over half a second), the others only new ones
    for fitted in (16, 32, 40):
        slope, growth, r2 = cache.long_fit(st, ranks, slots, cfg, NOW + 4.0)
        assert not np.isnan(slope[:fitted]).any()
        assert np.isnan(slope[fitted:]).sum() >= 40 - fitted - 4
    for got, want in zip((slope, growth, r2), at_once, strict=True):
        assert np.array_equal(got, want, equal_nan=True)
