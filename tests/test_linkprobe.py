"""The link probe: its plan, real gloo jobs probing their links at a common step (one
with a rank SIGKILLed in the middle, one cancelled in the middle), the verdict on
matrices of real measurements, the run state, the snapshot, the slow_link detector and
the CLI's text."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from collectors import wire
from collectors.linkprobe import _ABANDONED, LinkProbe, circle, plan, schedule
from rtop.actions.probe import format_text
from rtop.analysis import AnalysisConfig, Monitor
from rtop.analysis import detectors as d
from rtop.analysis.links import (
    assemble,
    judge,
    merge_answers,
    others_median,
    slow_links,
    verdict,
)
from rtop.analysis.window import take
from rtop.run import snapshot as shape
from rtop.run.recording import read
from rtop.run.state import KIND_LINKS, ProtocolError
from tests.test_snapshot_shape import FIXTURES, check_snapshot, keys

# ---- the plan --------------------------------------------------------------------------


def check_rounds(rounds: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Every round's pairs are disjoint, ordered (low, high) and of distinct ranks;
    returns every pair in order."""
    out = []
    for rnd in rounds:
        seen = [x for pair in rnd for x in pair]
        assert len(seen) == len(set(seen)), f"a rank twice in one round: {rnd}"
        assert all(a < b for a, b in rnd)
        out += rnd
    return out


@pytest.mark.parametrize("n", [*range(0, 20), 63, 64])
def test_a_flat_plan_measures_every_pair_once(n):
    rounds = plan([f"node-{i % 3}" for i in range(n)])
    pairs = check_rounds(rounds)
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    assert len(rounds) == (0 if n < 2 else n - 1 if n % 2 == 0 else n)
    # a round of an even count keeps every rank busy
    if n % 2 == 0:
        assert all(len(r) == n // 2 for r in rounds)


def test_a_schedule_of_given_pairs_puts_each_rank_in_one_transfer_a_round():
    """The re-measurement's rounds: every pair once (a repeat and a self-pair dropped),
    each rank at most once a round, as few rounds as the busiest rank needs here."""
    pairs = [(2, 0), (1, 2), (2, 3), (0, 1), (0, 2), (4, 4), (5, 6)]
    rounds = schedule(pairs)
    flat = [p for rnd in rounds for p in rnd]
    assert sorted(flat) == [(0, 1), (0, 2), (1, 2), (2, 3), (5, 6)]
    for rnd in rounds:
        ranks = [r for p in rnd for r in p]
        assert len(ranks) == len(set(ranks)), rnd
    assert len(rounds) == 3  # rank 2 is in three pairs
    assert rounds[0] == [(0, 2), (5, 6)]  # first come, first placed
    assert schedule([]) == []


def test_merged_answers_keep_the_faster_figure_of_each_direction():
    first = {0: {"rank": 0, "links": [[1, 2e8], [2, 5e8]], "seconds": 1.0, "nbytes": 64},
             1: {"rank": 1, "links": [[0, 4e8]], "seconds": 1.5, "nbytes": 64},
             2: {"rank": 2, "error": "a transfer failed"}}
    again = {0: {"rank": 0, "links": [[1, 4.5e8]], "seconds": 0.5, "nbytes": 64},
             1: {"rank": 1, "error": "timed out"},
             2: {"rank": 2, "links": [[0, 9e8]], "seconds": 0.5}}
    got = merge_answers(first, again)
    assert sorted(got[0]["links"]) == [[1, 4.5e8], [2, 5e8]] and got[0]["seconds"] == 1.5
    assert got[1] == first[1]  # an error the second time leaves the first answer
    assert got[2] == first[2]  # an error the first time stays one
    result = assemble([0, 1, 2], ["a", "b", "c"], got)
    assert result["matrix_Bps"][0][1] == 4e8  # then the slower direction, as always


def test_1024_ranks_on_128_nodes_take_134_rounds_one_representative_a_node():
    nodes = [f"gpu-{k:03d}" for k in range(128) for _ in range(8)]
    rounds = plan(nodes)
    pairs = check_rounds(rounds)
    assert len(rounds) == 127 + 7
    representatives = set(range(0, 1024, 8))  # each node's lowest rank
    inter, intra = rounds[:127], rounds[127:]
    across = [p for r in inter for p in r]
    assert all(a in representatives and b in representatives for a, b in across)
    assert all(nodes[a] != nodes[b] for a, b in across)
    assert sorted(across) == list(itertools.combinations(sorted(representatives), 2))
    within = [p for r in intra for p in r]
    assert all(nodes[a] == nodes[b] for a, b in within)
    assert sorted(within) == sorted(p for k in range(128)
                                    for p in itertools.combinations(range(8 * k, 8 * k + 8), 2))
    assert len(pairs) == len(set(pairs)) == 128 * 127 // 2 + 128 * 28


def test_a_hierarchical_plan_with_odd_counts_and_interleaved_nodes():
    # 65 ranks dealt round-robin over 5 nodes (13 each): 5 rounds across (odd), 13 within
    nodes = [f"n{i % 5}" for i in range(65)]
    rounds = plan(nodes)
    check_rounds(rounds)
    assert len(rounds) == 5 + 13
    assert sorted(p for r in rounds[:5] for p in r) == list(itertools.combinations(range(5), 2))
    assert plan(nodes, flat_limit=65) == circle(65)


# ---- real jobs -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DiesInRound(LinkProbe):
    """A rank that SIGKILLs itself as it starts its pair of round ``die_round``: a rank
    killed in the middle of the probe."""

    die_round = 1

    def _pair(self, dist: Any, peer: int, k: int, *args: Any) -> float:
        if k == self.die_round:
            os.kill(os.getpid(), signal.SIGKILL)
        return super()._pair(dist, peer, k, *args)


def job(rank: int, world: int, port: int, spec: dict[str, Any], q: Any) -> None:
    """A rank of a small DDP job on gloo that runs the link probe at the boundary
    before step ``probe_at`` (the same on every rank), then trains on. ``cancel``:
    ``{"rank", "after_s"}``, that rank's probe is aborted (as the hub's cancel does, from
    another thread) that long after it started."""
    import threading

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.get("pg_timeout_s", 60)))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    answers: list[dict[str, Any]] = []
    cls = DiesInRound if rank in spec.get("die", ()) else LinkProbe
    action = cls(rank, plan(spec["nodes"]), spec["nbytes"], answers.append,
                 reps=spec.get("reps", 3), timeout_s=spec["timeout_s"])
    out: dict[str, Any] = {"rank": rank, "job_error": None, "probe_s": None}
    done = rank in spec.get("skip", ())  # a rank that never joins the probe
    try:
        for step in range(spec["steps"]):
            if step >= spec["probe_at"] and not done:  # the boundary before this step
                cancel = spec.get("cancel")
                if cancel and cancel["rank"] == rank:
                    threading.Timer(cancel["after_s"], action.abort,
                                    args=("cancelled by the hub",)).start()
                t0 = time.monotonic()
                done = action.at_boundary(step)
                out["probe_s"] = time.monotonic() - t0
                out["probed_at"] = step
                # transfers it left unfinished (kept referenced, never waited for)
                out["abandoned"] = len(_ABANDONED)
                q.put({**out, "answers": answers})
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # the job's own error, after a peer died
        out["job_error"] = f"{type(exc).__name__}: {exc}"[:200]
    q.put({**out, "answers": answers, "finished": True})
    if out["job_error"] is None:
        # as a job should end: without it gloo's worker threads may still hold work as
        # the interpreter is torn down, and the process aborts ("terminate called
        # without an active exception", pytorch/pytorch#190489; CI, 1 run in ~6 here)
        dist.destroy_process_group()


def run_job(world: int, spec: dict[str, Any], timeout: float = 120.0
            ) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]], list[Any]]:
    """Start ``world`` ranks of :func:`job`; returns each rank's report at the probe,
    at its end, and the processes (joined)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=job, args=(r, world, port, spec, q)) for r in range(world)]
    for p in procs:
        p.start()
    at_probe: dict[int, dict[str, Any]] = {}
    at_end: dict[int, dict[str, Any]] = {}
    expected = world - len(spec.get("die", ()))
    deadline = time.monotonic() + timeout
    try:
        while len(at_end) < expected and time.monotonic() < deadline:
            try:
                msg = q.get(timeout=1.0)
            except Exception:
                continue
            (at_end if msg.get("finished") else at_probe)[msg["rank"]] = msg
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return at_probe, at_end, procs


@pytest.fixture(scope="module")
def loopback_probe() -> dict[str, Any]:
    """A real 4-rank gloo job on loopback probing its links at step 3."""
    spec = {"nodes": ["host"] * 4, "nbytes": 4 << 20, "reps": 5, "timeout_s": 20.0,
            "steps": 6, "probe_at": 3}
    _at_probe, at_end, procs = run_job(4, spec)
    assert sorted(at_end) == [0, 1, 2, 3], f"ranks that finished: {sorted(at_end)}"
    assert all(p.exitcode == 0 for p in procs)
    answers = {r: at_end[r]["answers"] for r in at_end}
    return {"answers": answers, "at_end": at_end}


def test_a_real_gloo_job_measures_every_link_at_the_same_step(loopback_probe):
    answers = loopback_probe["answers"]
    for rank, got in answers.items():
        assert len(got) == 1, f"rank {rank} answered {len(got)} times"
        a = got[0]
        assert set(a) == {"rank", "links", "seconds", "nbytes"}, a
        assert a["rank"] == rank and a["nbytes"] == 4 << 20 and a["seconds"] > 0
        assert sorted(p for p, _ in a["links"]) == [r for r in range(4) if r != rank]
        assert all(bps > 0 for _, bps in a["links"])
    for r, end in loopback_probe["at_end"].items():
        assert end["probed_at"] == 3 and end["job_error"] is None, (r, end)
    result = assemble([0, 1, 2, 3], ["host"] * 4, {r: a[0] for r, a in answers.items()})
    m = result["matrix_Bps"]
    assert result["ranks"] == [0, 1, 2, 3] and result["errors"] == []
    for i in range(4):
        assert m[i][i] is None
        for j in range(4):
            if i != j:
                assert m[i][j] == m[j][i] and m[i][j] > 0
                # the slower of the two directions the two ranks measured
                got = {p: b for p, b in answers[i][0]["links"]}[j]
                back = {p: b for p, b in answers[j][0]["links"]}[i]
                assert m[i][j] == pytest.approx(min(got, back), rel=1e-3)


def test_a_rank_killed_during_the_probe_ends_it_for_everyone(tmp_path):
    """Rank 3 SIGKILLs itself as it starts round 1: every survivor answers an error
    naming a peer and a round within the probe's timeout, and exits (its job's next
    collective meets the dead rank on its own terms: an error, not a hang)."""
    timeout_s = 5.0
    spec = {"nodes": ["host"] * 4, "nbytes": 4 << 20, "reps": 3, "timeout_s": timeout_s,
            "steps": 6, "probe_at": 3, "die": [3], "pg_timeout_s": 15}
    t0 = time.monotonic()
    at_probe, _at_end, procs = run_job(4, spec, timeout=90.0)
    assert procs[3].exitcode == -signal.SIGKILL
    assert sorted(at_probe) == [0, 1, 2], sorted(at_probe)
    for r in (0, 1, 2):
        report = at_probe[r]
        assert len(report["answers"]) == 1
        a = report["answers"][0]
        assert a["rank"] == r and "error" in a and "links" not in a, a
        assert "peer" in a, a
        assert f"with rank {a['peer']}" in a["error"] and f"round {a['round']}" in a["error"]
        assert a["round"] >= 1, a  # round 0 was done before rank 3 died
        # a survivor waits at most one timeout: its peer is dead (at once) or stopped
        assert report["probe_s"] < timeout_s + 3.0, report
    # the pair that met the dead rank learnt it from the closed connection, not a timeout
    assert any(at_probe[r]["answers"][0]["peer"] == 3 for r in (0, 1, 2))
    for r in (0, 1, 2):
        assert procs[r].exitcode is not None, f"rank {r} still runs"
    assert time.monotonic() - t0 < 80


def test_a_rank_that_never_joins_costs_its_peers_one_timeout_and_the_job_goes_on():
    """Rank 3 never runs the probe (it goes on to the job's allreduce): each peer that
    meets it gives up after the timeout, and then the job trains on to its end."""
    timeout_s = 2.0
    spec = {"nodes": ["host"] * 4, "nbytes": 1 << 20, "reps": 3, "timeout_s": timeout_s,
            "steps": 6, "probe_at": 3, "skip": [3], "pg_timeout_s": 60}
    at_probe, at_end, procs = run_job(4, spec, timeout=90.0)
    assert sorted(at_end) == [0, 1, 2, 3] and all(p.exitcode == 0 for p in procs)
    assert all(at_end[r]["job_error"] is None for r in range(4)), at_end
    for r in (0, 1, 2):
        a = at_probe[r]["answers"][0]
        assert "error" in a and a["peer"] in (3, 0, 1, 2) and a["peer"] != r, a
        # one timeout (its pair with rank 3, or with a peer that gave up on rank 3)
        assert at_probe[r]["probe_s"] < 2 * timeout_s + 3.0, at_probe[r]
    assert {at_probe[r]["answers"][0]["peer"] for r in (0, 1, 2)} & {3}


def test_a_cancel_mid_probe_leaves_nothing_posted_and_the_peer_learns_at_once():
    """The hub cancels rank 0 in the middle of a real 2-rank gloo probe: rank 0 answers
    the cancel at once, carries the transfer under way to its end and stops at the next
    agreement, where rank 1 learns it (long before its 20 s timeout); neither rank leaves
    a transfer unfinished, and the job trains on. Before: rank 0 stopped polling with its
    receive posted (left unfinished), and rank 1 waited out its whole timeout for a
    message that never came."""
    timeout_s = 20.0
    spec = {"nodes": ["host"] * 2, "nbytes": 32 << 20, "reps": 20, "timeout_s": timeout_s,
            "steps": 5, "probe_at": 2, "cancel": {"rank": 0, "after_s": 0.2}}
    at_probe, at_end, procs = run_job(2, spec, timeout=90.0)
    assert sorted(at_end) == [0, 1], at_end
    assert at_probe[0]["abandoned"] == 0 and at_probe[1]["abandoned"] == 0, at_probe
    assert all(p.exitcode == 0 for p in procs), ([p.exitcode for p in procs], at_probe)
    assert all(at_end[r]["job_error"] is None for r in (0, 1)), at_end
    assert at_probe[0]["answers"] == [{"rank": 0, "error": "cancelled by the hub"}], \
        at_probe[0]  # (a probe that ended before the cancel would have answered links)
    (a1,) = at_probe[1]["answers"]
    assert a1["peer"] == 0 and "rank 0 is not coming" in a1["error"], a1
    assert at_probe[1]["probe_s"] < timeout_s / 4, at_probe[1]
    assert at_probe[0]["abandoned"] == 0 and at_probe[1]["abandoned"] == 0, at_probe


def test_an_aborted_probe_answers_once_and_runs_nothing():
    got: list[dict[str, Any]] = []
    probe = LinkProbe(0, [[(0, 1)]], 1024, got.append)
    probe.abort("cancelled by the hub")
    probe.abort("twice")
    assert probe.at_boundary(5) is True
    assert got == [{"rank": 0, "error": "cancelled by the hub"}]


def test_a_probe_outside_a_distributed_job_answers_an_error():
    got: list[dict[str, Any]] = []

    def boom(answer: dict[str, Any]) -> None:
        got.append(answer)
        raise RuntimeError("the channel is gone")  # the callback's own failure stays here

    assert LinkProbe(0, [[(0, 1)]], 1024, boom).at_boundary(0) is True
    assert len(got) == 1 and "not initialised" in got[0]["error"]


def test_importing_the_probe_loads_no_torch():
    code = ("import sys, collectors.linkprobe as lp; lp.plan(['a'] * 80); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.strip() == "False"


# ---- the verdict on real measurements --------------------------------------------------


def real_matrix(loopback_probe: dict[str, Any]) -> tuple[list[list[Any]], float]:
    """The 4-rank loopback job's matrix and its spread (slowest link / fastest)."""
    answers = {r: a[0] for r, a in loopback_probe["answers"].items()}
    m = assemble([0, 1, 2, 3], ["host"] * 4, answers)["matrix_Bps"]
    values = [v for row in m for v in row if v is not None]
    return m, max(values) / min(values)


def scaled(m: list[list[Any]], factor: float, touching: set[int] | None = None,
           links: set[tuple[int, int]] | None = None) -> list[list[Any]]:
    out = [list(row) for row in m]
    for i, j in itertools.permutations(range(len(m)), 2):
        if (touching and (i in touching or j in touching)) or (links and (min(i, j),
                                                                          max(i, j)) in links):
            out[i][j] = m[i][j] * factor
    return out


def by_definition(result: dict[str, Any], fraction: float) -> set[tuple[int, int]]:
    """The slow links, straight from the definition (each against the median of the
    other links of its kind), written independently of rtop.analysis.links."""
    nodes, m = result["nodes"], result["matrix_Bps"]
    links = [(i, j, m[i][j]) for i, j in itertools.combinations(range(len(m)), 2)
             if m[i][j] is not None]
    out = set()
    for i, j, v in links:
        kind = nodes[i] != nodes[j]
        others = [w for a, b, w in links if (a, b) != (i, j) and (nodes[a] != nodes[b]) == kind]
        if others and v < fraction * statistics.median(others):
            out.add((i, j))
    return out


def test_a_throttled_node_is_named_exactly(loopback_probe):
    """Four "nodes" (the real matrix's four ranks), node-c's links cut to a quarter of
    the healthy spread below the slowest healthy link: every scaled link is under a
    quarter of any healthy one, and every healthy one over four times any scaled one,
    whatever the noise of the real measurement."""
    m, spread = real_matrix(loopback_probe)
    nodes = ["node-a", "node-b", "node-c", "node-d"]
    result = {"ranks": [0, 1, 2, 3], "nodes": nodes,
              "matrix_Bps": scaled(m, 1 / (4 * spread), touching={2})}
    found = slow_links(result, AnalysisConfig())
    assert len(found) == 1, found
    f = found[0]
    assert f["kind"] == "slow_link" and f["ranks"] == [2]
    assert f["evidence"]["nodes"] == ["node-c"]
    assert sorted(tuple(x[:2]) for x in f["evidence"]["links"]) == [(0, 2), (1, 2), (2, 3)]
    assert "node node-c slow" in f["summary"] and "rank 2 on it" in f["summary"]


def test_the_verdict_is_the_definition_on_real_links(loopback_probe):
    """Healthy links as measured: whatever the noise, the verdict is the definition's;
    within 2x of each other (loopback links are one path), nothing is slow."""
    m, spread = real_matrix(loopback_probe)
    for nodes in (["h"] * 4, ["a", "b", "c", "d"], ["a", "a", "b", "b"]):
        result = {"ranks": [0, 1, 2, 3], "nodes": nodes, "matrix_Bps": m}
        jd = judge(result, AnalysisConfig())
        got = {(int(jd.i[k]), int(jd.j[k])) for k in range(len(jd.bps)) if jd.slow[k]}
        assert got == by_definition(result, 0.5), nodes
        if spread < 2:
            assert slow_links(result, AnalysisConfig()) == [], (spread, m)


def test_links_between_nodes_are_judged_against_links_between_nodes(loopback_probe):
    """Two nodes of two ranks whose network is 20x slower than within the node (NVLink
    against Ethernet): scaling every link of a kind by one factor changes no verdict."""
    m, _spread = real_matrix(loopback_probe)
    nodes = ["a", "a", "b", "b"]
    between = {(0, 2), (0, 3), (1, 2), (1, 3)}
    fast = {"ranks": [0, 1, 2, 3], "nodes": nodes, "matrix_Bps": m}
    slow_net = {**fast, "matrix_Bps": scaled(m, 1 / 20, links=between)}
    assert by_definition(slow_net, 0.5) == by_definition(fast, 0.5)

    def verdicts(result: dict[str, Any]) -> list[tuple[Any, ...]]:
        # what is named (its figures scale with the links: a noisy link of the real
        # matrix is named in both, at 1/20 of the speed in one)
        return [(f["kind"], f["ranks"], f["evidence"]["nodes"], f["evidence"]["link_kind"],
                 [link[:2] for link in f["evidence"]["links"]])
                for f in slow_links(result, AnalysisConfig())]

    assert verdicts(slow_net) == verdicts(fast)


def test_one_slow_link_is_named_as_a_link(loopback_probe):
    """One link between two of four nodes slow: both its nodes touch every slow link, so
    no node is named, the link is."""
    m, spread = real_matrix(loopback_probe)
    result = {"ranks": [0, 1, 2, 3], "nodes": ["a", "b", "c", "d"],
              "matrix_Bps": scaled(m, 1 / (4 * spread), links={(0, 2)})}
    slow = by_definition(result, 0.5)
    assert (0, 2) in slow
    found = slow_links(result, AnalysisConfig())
    assert len(found) == 1 and found[0]["evidence"]["nodes"] == []
    assert found[0]["evidence"]["links"][0][:2] == [0, 2]
    if slow == {(0, 2)}:  # noise aside (a healthy spread under 2x)
        assert found[0]["ranks"] == [0, 2]
        assert "not all through one node" in found[0]["summary"]


def test_others_median_leaves_each_value_out():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0]
    import numpy as np

    got = others_median(np.array(values))
    for k, v in enumerate(got):
        assert v == statistics.median(values[:k] + values[k + 1:])
    assert np.isnan(others_median(np.array([3.0]))).all()


def test_assemble_groups_by_node_and_keeps_what_ranks_could_not_do():
    answers = {
        0: {"rank": 0, "links": [[1, 4e8], [2, 5e8], [9, 1e9], [0, 1e9]], "seconds": 0.5,
            "nbytes": 1024},
        1: {"rank": 1, "links": [[0, 3e8], [2, "fast"], [2, float("nan")]], "seconds": 0.7,
            "nbytes": 1024},
        2: {"rank": 2, "error": "round 1, with rank 3: timed out"},
    }
    result = assemble([0, 1, 2, 3], ["b", "a", "b", "a"], answers)
    assert result["ranks"] == [0, 2, 1, 3]  # node of rank 0 first, then by rank
    assert result["nodes"] == ["b", "b", "a", "a"]
    m = result["matrix_Bps"]
    assert m[0][2] == m[2][0] == 3e8  # 0-1: the slower direction
    assert m[0][1] == m[1][0] == 5e8  # 0-2: only rank 0 measured it
    assert m[2][1] is None and m[3][3] is None
    assert result["seconds"] == 0.7 and result["nbytes"] == 1024
    assert result["errors"] == [{"rank": 2, "error": "round 1, with rank 3: timed out"},
                                {"rank": 3, "error": "no answer"}]


# ---- the run state, the snapshot, the detector --------------------------------------


def probe_result(ranks: list[int], nodes: list[str], bps: float,
                 slow: dict[int, float] | None = None) -> dict[str, Any]:
    """A result where every link runs at ``bps`` except those of ``slow`` ranks."""
    n = len(ranks)
    slow = slow or {}
    m = [[None if i == j else bps * min(slow.get(ranks[i], 1.0), slow.get(ranks[j], 1.0))
          for j in range(n)] for i in range(n)]
    return {"ranks": ranks, "nodes": nodes, "matrix_Bps": m, "seconds": 0.2,
            "nbytes": 8 << 20, "errors": []}


def replayed(name: str, until: float | None = None, cfg: AnalysisConfig | None = None
             ) -> tuple[Monitor, float]:
    monitor = Monitor(config=cfg or AnalysisConfig())
    t = 0.0
    first = None
    for t, frame in read(FIXTURES / f"{name}.rtop"):
        first = t if first is None else first
        if until is not None and t - first > until:
            break
        monitor.apply(frame, t)
    return monitor, t


def test_the_run_state_keeps_the_latest_probe_and_refuses_bad_ones():
    st, t = replayed("healthy", until=10.0)
    assert st.state.links is None
    st.state.apply(wire.Frame(KIND_LINKS, probe_result([0, 1, 2], ["vm"] * 3, 2e9, {2: 0.01})),
                   t)
    kept = st.state.links
    assert kept is not None and kept["t"] == t and kept["nodes"] == ["vm"] * 3
    assert kept["links"] == [[0, 1, 2e9], [0, 2, 2e7], [1, 2, 2e7]]
    assert kept["busbw_Bps"] is not None and kept["busbw_Bps"] > 0
    bad = [
        {"ranks": [0, 0], "nodes": ["a", "b"], "matrix_Bps": [[None, 1], [1, None]]},
        {"ranks": [0, 1], "nodes": ["a"], "matrix_Bps": [[None, 1], [1, None]]},
        {"ranks": [0, 1], "nodes": ["a", "b"], "matrix_Bps": [[None, "1"], [1, None]]},
        {"ranks": [0, 1], "nodes": ["a", "b"], "matrix_Bps": [[None, 1]]},
        {"ranks": [0, 1], "nodes": ["a", {"x": 1}], "matrix_Bps": [[None, 1], [1, None]]},
        {"ranks": [-1, 1], "nodes": ["a", "b"], "matrix_Bps": [[None, 1], [1, None]]},
    ]
    for result in bad:
        with pytest.raises(ProtocolError):
            st.state.set_links(result, t)
    assert st.state.links is kept
    # a rank cannot send one: only the hub (and its recording) can
    rank = st.state.active_ranks()[0]
    with pytest.raises(ProtocolError, match="rank may not"):
        st.state.apply(wire.Frame(KIND_LINKS, probe_result([0, 1], ["a", "b"], 1e9)), t,
                       peer=rank)
    # negative and non-finite figures are not measured; a node name is made safe
    st.state.set_links({"ranks": [0, 1, 2], "nodes": ["a\x1b[31m", "b", "c"],
                        "matrix_Bps": [[None, -5, float("inf")], [-5, None, 1e9],
                                       [float("nan"), 1e9, None]]}, t)
    assert st.state.links["links"] == [[1, 2, 1e9]]
    assert "\x1b" not in st.state.links["nodes"][0]


def test_the_snapshot_carries_the_probe_with_its_verdict():
    monitor, t = replayed("healthy", until=12.0)
    monitor.advance(t, force=True)
    snap = monitor.snapshot()
    check_snapshot(dict(snap))
    assert snap["links"] is None
    monitor.state.set_links(probe_result([0, 1, 2], ["vm", "vm", "vm"], 2e9, {1: 0.01}), t)
    snap = monitor.snapshot()
    check_snapshot(dict(snap))
    links = snap["links"]
    assert links is not None
    assert set(links) == keys(shape.LinksView)
    assert links["slow"] == [[0, 1], [1, 2]]
    assert links["medians_Bps"] == {"inter_node": None, "intra_node": 2e7}


def test_once_probed_a_healthy_slow_fabric_is_no_slow_link():
    """The issue's false alarm: a healthy fabric slower than its class's nominal figure
    (here loopback said to give 10 GB/s) is a slow_link until a probe has measured it;
    after a healthy probe the allreduce is judged against what it reached then."""
    cfg = AnalysisConfig(fabric_busbw={"loopback": 10e9})
    monitor, t = replayed("healthy", until=15.0, cfg=cfg)
    ctx = d.Context(take(monitor.state, cfg, t), cfg)
    nominal = d.slow_link(ctx)
    assert nominal is not None and nominal.evidence["expected_busbw_Bps"] == 10e9
    monitor.state.set_links(probe_result([0, 1, 2], ["vm"] * 3, 2e9), t)
    probe = monitor.state.links
    assert probe is not None and probe["busbw_Bps"] is not None
    assert d.slow_link(d.Context(take(monitor.state, cfg, t), cfg, links=probe)) is None
    # a link that slows after the probe still shows: the allreduce falls below half of
    # what it reached then
    later = {**probe, "busbw_Bps": probe["busbw_Bps"] * 4}
    f = d.slow_link(d.Context(take(monitor.state, cfg, t), cfg, links=later))
    assert f is not None and f.evidence["expected_from"] == "probe"
    assert f.evidence["expected_busbw_Bps"] == pytest.approx(later["busbw_Bps"], rel=1e-3)
    assert "when the link probe found every link healthy" in f.summary


def test_a_probe_with_a_slow_node_is_the_slow_link_finding():
    cfg = AnalysisConfig()
    monitor, t = replayed("healthy", until=15.0, cfg=cfg)
    monitor.state.set_links(probe_result([0, 1, 2, 3], ["a", "b", "c", "d"], 1e9,
                                         {2: 0.02}), t)
    f = d.slow_link(d.Context(take(monitor.state, cfg, t), cfg, links=monitor.state.links))
    assert f is not None and f.ranks == [2] and f.evidence["nodes"] == ["c"]
    assert verdict(monitor.state.links, cfg) is not None


def test_a_replayed_probe_reaches_the_diagnosis():
    """Through the Monitor, as the hub and ``rtop report`` run it (the engine hands the
    detectors the run state's probe: ``Context(..., links=state.links)``)."""
    monitor, t = replayed("healthy", until=15.0)
    monitor.apply(wire.Frame(KIND_LINKS, probe_result([0, 1, 2, 3], ["a", "b", "c", "d"],
                                                      1e9, {2: 0.02})), t)
    for k in range(4):
        monitor.advance(t + 0.5 * k, force=True)
    kinds = {f["kind"]: f for f in monitor.findings}
    assert "slow_link" in kinds, monitor.findings
    assert kinds["slow_link"]["evidence"]["nodes"] == ["c"]


# ---- the CLI's text -----------------------------------------------------------------


def test_format_text_draws_the_matrix_by_node_and_marks_slow_links():
    result = assemble([0, 1, 2, 3], ["node-b", "node-b", "node-[a]", "node-[a]"], {
        r: {"links": [[p, 1e9 if 3 not in (r, p) else 2e7] for p in range(4) if p != r],
            "seconds": 0.25, "nbytes": 8 << 20} for r in range(3)})
    result["findings"] = slow_links(result, AnalysisConfig())
    text = format_text(result)
    lines = text.splitlines()
    assert lines[0].startswith("Link probe: 4 ranks on 2 nodes, 6 of 6 links measured")
    rows = {line.split()[-5]: line.split()[-4:] for line in lines[3:9] if line.strip()}
    assert rows["3"] == ["0.02!", "0.02!", "0.02!", "·"], rows
    assert rows["0"] == ["·", "1", "1", "0.02!"], rows
    assert "node-[a]" in text and "n/a" not in "\n".join(lines[1:])
    assert "slow_link" in text and "rank 3: no answer" in text
