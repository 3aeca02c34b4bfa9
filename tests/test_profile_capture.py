"""On-demand profiler capture (``collectors.profiler``) in a real 2-rank DDP job over gloo.

One job per test session (``job`` fixture): each rank runs a small MLP under the real
probe and, at its step boundaries from step 10 on, the capture a hub would arm
(``ProfileCapture(DIR, "rank{r}", steps=5)``), as the control channel's dispatcher
calls it. Then, in the same job, the ways a capture is refused or aborted. The traces
are read back with torch-tb-profiler's own loader and HTA's ``TraceAnalysis``.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from rtop.workload import free_port

WORLD = 2
STEPS = 40  # the job's main loop
START = 10  # the first profiled step
K = 5  # profiled steps
LAYERS = 3  # Linear layers in the model (each: one aten::addmm per forward)


# ---- the job (spawned ranks) ------------------------------------------------------------


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10))


def _enabled() -> bool:
    """Whether any torch profiler runs in this process."""
    import torch.autograd.profiler as ap

    return bool(ap._is_profiler_enabled)


def _job(rank: int, world: int, port: int, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import collectors
    from collectors.identity import detect
    from collectors.profiler import ProfileCapture

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
    model = probe.watch(torch.nn.parallel.DistributedDataParallel(_model()))
    held = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01)}
    del model
    gen = torch.Generator().manual_seed(rank)
    done = {"steps": 0}

    def step() -> None:
        with probe.step():
            x = torch.randn(64, 64, generator=gen)
            loss = held["model"](x).pow(2).mean()
            held["opt"].zero_grad()
            loss.backward()
            held["opt"].step()
        done["steps"] += 1

    mine = os.path.join(out, f"own{rank}")  # this rank's folders (A shares one)
    os.makedirs(mine)

    def capture(name: str, steps: int = K, **kw: Any) -> tuple[Any, list[dict[str, Any]]]:
        answers: list[dict[str, Any]] = []
        where = os.path.join(out, name) if name == "traces" else os.path.join(mine, name)
        return ProfileCapture(where, f"rank{rank}", steps, rank, answers.append, **kw), answers

    res: dict[str, Any] = {}

    # A: the capture a hub arms, from step START, K steps; every iteration timed
    cap, answers = capture("traces")
    finished_at = None
    times = []
    for i in range(STEPS):
        t0 = time.perf_counter()
        step()
        if i + 1 >= START and finished_at is None and cap.at_boundary(i + 1):
            finished_at = i + 1
        times.append(time.perf_counter() - t0)
    res["A"] = {"answers": answers, "finished_at": finished_at, "times": times,
                "enabled_after": _enabled()}

    # B: the user's own profiler runs on the training thread: refused, theirs unharmed
    from torch.profiler import ProfilerActivity, profile

    user = profile(activities=[ProfilerActivity.CPU])
    user.start()
    step()
    cap, answers = capture("user")
    returned = cap.at_boundary(done["steps"])
    step()
    still_on = _enabled()
    user.stop()
    addmm = sum(1 for e in user.events() if e.name == "aten::addmm")
    res["B"] = {"answers": answers, "returned": returned, "user_on": still_on,
                "user_addmm": addmm, "files": _files(mine, "user")}

    # B2: the user's profiler runs on another thread: refused too (torch keeps one
    # profiler per process; a second start would take the user's session away)
    started, release = threading.Event(), threading.Event()
    other: dict[str, Any] = {}

    def users_thread() -> None:
        p = profile(activities=[ProfilerActivity.CPU])
        p.start()
        started.set()
        release.wait(60)
        torch.mm(torch.randn(8, 8), torch.randn(8, 8))
        p.stop()
        other["mm"] = sum(1 for e in p.events() if e.name == "aten::mm")

    t = threading.Thread(target=users_thread)
    t.start()
    started.wait(60)
    cap, answers = capture("user-thread")
    returned = cap.at_boundary(done["steps"])
    release.set()
    t.join(60)
    step()
    res["B2"] = {"answers": answers, "returned": returned, "user_mm": other.get("mm"),
                 "files": _files(mine, "user-thread")}

    # C: aborted before it started (the hub cancelled while it waited for its step)
    cap, answers = capture("abort-before")
    cap.abort("cancelled by the hub")
    cap.abort("again")
    step()
    returned = cap.at_boundary(done["steps"])
    res["C"] = {"answers": answers, "returned": returned, "enabled": _enabled(),
                "files": _files(mine, "abort-before")}

    # D: aborted mid-capture from another thread: answered at once, stopped at the next
    # boundary (torch.profiler is stopped on the thread that started it)
    cap, answers = capture("abort-thread")
    first = cap.at_boundary(done["steps"])
    step()
    t = threading.Thread(target=cap.abort, args=("cancelled by the hub",))
    t.start()
    t.join(60)
    n_at_abort, on_at_abort = len(answers), _enabled()
    step()
    returned = cap.at_boundary(done["steps"])
    res["D"] = {"answers": answers, "first": first, "n_at_abort": n_at_abort,
                "on_at_abort": on_at_abort, "returned": returned, "enabled": _enabled(),
                "files": _files(mine, "abort-thread")}

    # E: aborted mid-capture on the training thread (probe.close()): stops at once
    cap, answers = capture("abort-here")
    cap.at_boundary(done["steps"])
    step()
    cap.abort("the rank is closing")
    res["E"] = {"answers": answers, "enabled": _enabled(),
                "returned": cap.at_boundary(done["steps"]), "files": _files(mine, "abort-here")}

    # F: the directory cannot be made (a file is in the way)
    Path(mine, "blocker").write_text("")
    answers = []
    cap = ProfileCapture(os.path.join(mine, "blocker", "traces"), f"rank{rank}", K, rank,
                         answers.append)
    res["F"] = {"returned": cap.at_boundary(done["steps"]), "answers": answers,
                "enabled": _enabled()}

    # G: the directory goes away mid-capture and a file takes its place: the trace
    # cannot be written; the profiler is stopped all the same
    cap, answers = capture("vanishing", steps=2)
    cap.at_boundary(done["steps"])
    step()
    gone = Path(mine, "vanishing")
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    gone.write_text("")
    cap.at_boundary(done["steps"])
    step()
    res["G"] = {"returned": cap.at_boundary(done["steps"]), "answers": answers,
                "enabled": _enabled()}

    step()  # the job goes on
    res["steps_done"] = done["steps"]
    probe.close(0.1)
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    import gc

    held.clear()  # the DDP model goes before its process group
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _files(out: str, name: str) -> list[str]:
    d = Path(out, name)
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# ---- the tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, dict[int, dict[str, Any]]]:
    out = tmp_path_factory.mktemp("profile")
    # join=True: raises if a rank exits with an error or a non-zero code
    mp.start_processes(_job, args=(WORLD, free_port(), str(out)), nprocs=WORLD,
                       start_method="spawn", join=True)
    return out, {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)}


def test_the_job_finishes_and_each_rank_answers_once(job):
    _, res = job
    for r in range(WORLD):
        assert res[r]["steps_done"] > STEPS, "the job did not run all its steps"
        a = res[r]["A"]
        assert a["finished_at"] == START + K, "the capture did not finish after K steps"
        assert not a["enabled_after"], "the profiler still runs after the capture"
        assert len(a["answers"]) == 1
        ans = a["answers"][0]
        assert "error" not in ans, ans
        assert ans["rank"] == r and ans["steps"] == [START, START + K - 1]


def test_the_summary_names_real_operators_and_splits_the_time(job):
    _, res = job
    for r in range(WORLD):
        ans = res[r]["A"]["answers"][0]
        assert ans["timeline"] == "cpu"
        ops = {o["name"]: o for o in ans["top_ops"]}
        assert {"aten::addmm", "aten::mm"} & set(ops), ops
        assert ops["aten::addmm"]["calls"] == LAYERS * K  # one per Linear per forward
        assert all(o["self_s"] > 0 for o in ans["top_ops"])
        selfs = [o["self_s"] for o in ans["top_ops"]]
        assert selfs == sorted(selfs, reverse=True)
        assert ans["compute_s"] > 0, "no operator time"
        assert ans["comm_s"] > 0, "DDP's allreduce over gloo was not seen"
        assert 0 <= ans["overlap_s"] <= min(ans["compute_s"], ans["comm_s"])
        parts = ans["compute_s"] + ans["comm_s"] - ans["overlap_s"] + ans["idle_s"]
        assert parts == pytest.approx(ans["wall_s"], rel=1e-6)
        assert ans["idle_s"] >= 0 and ans["wall_s"] > 0


def test_traces_are_where_the_answers_say(job):
    out, res = job
    traces = sorted((out / "traces").iterdir())
    assert [p.name.split(".")[0] for p in traces] == [f"rank{r}" for r in range(WORLD)]
    for r in range(WORLD):
        path = Path(res[r]["A"]["answers"][0]["trace"])
        assert path.is_absolute() and path.parent == out / "traces" and path.is_file()
        info = json.loads(path.read_text())
        assert info["distributedInfo"]["rank"] == r
        assert info["distributedInfo"]["backend"] == "gloo"


def test_torch_tb_profiler_loads_the_traces(job):
    import tempfile

    from torch_tb_profiler import io
    from torch_tb_profiler.profiler.loader import RunLoader
    from torch_tb_profiler.run import DistributedRunProfile, RunProfile

    out, _ = job
    with tempfile.TemporaryDirectory() as cache_dir:
        cache = io.Cache(cache_dir)
        try:
            run = RunLoader("profile", str(out / "traces"), cache).load()
        finally:
            cache._manager.shutdown()  # its multiprocessing manager
    assert {f"rank{r}" for r in range(WORLD)} <= set(run.workers)
    for r in range(WORLD):
        (prof,) = run.get_profiles(worker=f"rank{r}")
        assert isinstance(prof, RunProfile)
        rows = prof.operation_table_by_name["data"]
        assert any(row["name"] == "aten::addmm" for row in rows)
        steps = [row[0] for row in prof.overview["steps"]["rows"]]
        assert steps == [str(s) for s in range(START, START + K)]  # the job's step indices
        assert prof.has_communication, "tb-profiler saw no communication on this rank"
    dist = [p for p in run.get_profiles() if isinstance(p, DistributedRunProfile)]
    assert dist, "tb-profiler did not see the ranks' communication (no Distributed view)"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def test_hta_loads_the_traces_and_agrees_on_the_collectives(job):
    from hta.trace_analysis import TraceAnalysis

    from collectors.profiler import is_comm

    out, res = job
    # the capture's last step is complete (HTA drops it by default, assuming it is not)
    ta = TraceAnalysis(trace_dir=str(out / "traces"), include_last_profiler_step=True)
    assert sorted(ta.t.traces) == list(range(WORLD))
    sym = ta.t.symbol_table.sym_table
    for r in range(WORLD):
        df = ta.t.get_trace(r)
        names = df["name"].map(lambda i: sym[i])
        assert sorted(set(df["iteration"]) - {-1}) == list(range(START, START + K))
        steps = df[names.str.startswith("ProfilerStep#")]
        lo, hi = steps["ts"].min(), (steps["ts"] + steps["dur"]).max()
        gloo = df[names.str.startswith("gloo:")]
        assert len(gloo) > 0 and (gloo["dur"] > 0).all(), "no gloo collective in the trace"
        # the same rule over what HTA read from the file as rtop applied to the events
        comm = df[names.map(is_comm)]
        hta_comm_s = _union([(max(a, lo), min(a + d, hi)) for a, d in
                             zip(comm["ts"], comm["dur"], strict=True)]) / 1e6
        ans = res[r]["A"]["answers"][0]
        # HTA reads the written trace (microseconds, rounded); rtop the profiler's events
        assert ans["comm_s"] == pytest.approx(hta_comm_s, rel=0.02, abs=50e-6)
        assert ans["wall_s"] == pytest.approx((hi - lo) / 1e6, rel=0.02, abs=50e-6)


def test_step_time_costs_only_while_capturing(job):
    """Printed, not asserted: on a shared 2-core machine timings are too noisy."""
    _, res = job
    for r in range(WORLD):
        t = res[r]["A"]["times"]
        before, during, after = t[1:START - 1], t[START - 1:START + K], t[START + K + 1:]
        print(f"rank {r}: median step {statistics.median(before) * 1e3:.2f} ms before, "
              f"{statistics.median(during) * 1e3:.2f} ms while capturing "
              f"(start {t[START - 1] * 1e3:.1f} ms, stop {t[START + K - 1] * 1e3:.1f} ms), "
              f"{statistics.median(after) * 1e3:.2f} ms after")


def test_a_running_user_profiler_is_refused_and_left_alone(job):
    _, res = job
    for r in range(WORLD):
        b = res[r]["B"]
        assert b["returned"] is True and len(b["answers"]) == 1
        assert "already" in b["answers"][0]["error"] and b["answers"][0]["rank"] == r
        assert b["user_on"], "rtop stopped the user's profiler"
        assert b["user_addmm"] == LAYERS * 2, "the user's profiler lost operators"
        assert b["files"] == []
        b2 = res[r]["B2"]
        assert b2["returned"] is True and "already" in b2["answers"][0]["error"]
        assert b2["user_mm"] == 1 and b2["files"] == []


def test_abort_before_the_start(job):
    _, res = job
    for r in range(WORLD):
        c = res[r]["C"]
        assert c["answers"] == [{"rank": r, "error": "cancelled by the hub"}]
        assert c["returned"] is True and not c["enabled"] and c["files"] == []


def test_abort_from_another_thread_answers_at_once_and_stops_at_the_next_boundary(job):
    _, res = job
    for r in range(WORLD):
        d = res[r]["D"]
        assert d["first"] is False
        assert d["n_at_abort"] == 1, "the abort did not answer at once"
        assert d["on_at_abort"], "stopped off the thread that started it"
        assert d["returned"] is True and not d["enabled"]
        assert d["answers"] == [{"rank": r, "error": "cancelled by the hub"}]
        assert d["files"] == []


def test_abort_on_the_training_thread_stops_at_once(job):
    _, res = job
    for r in range(WORLD):
        e = res[r]["E"]
        assert e["answers"] == [{"rank": r, "error": "the rank is closing"}]
        assert not e["enabled"] and e["returned"] is True and e["files"] == []


def test_an_unwritable_directory_is_an_answer_not_an_exception(job):
    _, res = job
    for r in range(WORLD):
        f = res[r]["F"]
        assert f["returned"] is True and not f["enabled"]
        assert "cannot write traces" in f["answers"][0]["error"]
        g = res[r]["G"]
        assert g["returned"] is True and not g["enabled"] and len(g["answers"]) == 1
        assert "directory" in g["answers"][0]["error"], g["answers"]


# ---- what the CLI and the UI make of the answers ----------------------------------------


def test_assemble_and_format_real_answers(job):
    from rtop.actions.profile import assemble, format_text

    out, res = job
    answers = {r: res[r]["A"]["answers"][0] for r in range(WORLD)}
    answers[5] = {"rank": 5, "error": "a torch profiler is already running\x1b[31m"}
    result = assemble(answers, str(out / "traces"), missing=[3])
    assert result["dir"] == str(out / "traces")
    assert [t["rank"] for t in result["traces"]] == list(range(WORLD))
    assert all(Path(t["path"]).is_file() for t in result["traces"])
    ranks = result["summary"]["ranks"]
    assert [x["rank"] for x in ranks] == list(range(WORLD))
    for x in ranks:
        assert {"aten::addmm", "aten::mm"} & {o["name"] for o in x["top_ops"]}
        assert x["comm_s"] > 0 and x["compute_s"] > 0 and x["idle_s"] >= 0
    assert result["missing"] == [3]
    assert set(result["errors"]) == {"5"} and "\x1b" not in result["errors"]["5"]
    json.dumps(result)  # what --json prints

    text = format_text(result)
    assert f"tensorboard --logdir {out / 'traces'}" in text
    assert "aten::addmm" in text and "rank 3" in text and "rank 5" in text
    for t in result["traces"]:
        assert t["path"] in text
    assert "\x1b" not in text
    print(text)


def test_assemble_bounds_and_cleans_untrusted_answers():
    from rtop.actions.profile import MAX_OPS, assemble, format_text

    evil = "[bold red]x[/]\x1b]0;owned\x07"
    answers: dict[int, Any] = {
        0: {"rank": 0, "trace": evil, "top_ops": [{"name": evil, "self_s": 1.0}] * 500,
            "compute_s": "lots", "comm_s": float("nan"), "idle_s": -1, "steps": [1, 2]},
        1: "not a mapping",
    }
    result = assemble(answers, "/tmp/x", missing=[])
    (r0,) = result["summary"]["ranks"]
    assert len(r0["top_ops"]) == MAX_OPS
    assert "\x1b" not in r0["top_ops"][0]["name"] and "\x07" not in result["traces"][0]["path"]
    assert r0["compute_s"] is None and r0["comm_s"] is None
    assert "1" in result["errors"]
    text = format_text(result)
    assert "\x1b" not in text and "n/a" in text


async def test_profile_screen_shows_names_as_text_and_closes():
    import io

    from rich.console import Console
    from textual.app import App
    from textual.widgets import Static

    from rtop.actions.profile import assemble
    from rtop.tui.profile_view import ProfileScreen

    name = "[bold]aten::[/bold]addmm[@click=app.quit]"
    answers = {0: {"rank": 0, "steps": [4, 8], "trace": "/d/rank0.1.pt.trace.json",
                   "top_ops": [{"name": name, "self_s": 0.002, "calls": 3}],
                   "compute_s": 0.004, "comm_s": 0.003, "overlap_s": 0.001, "idle_s": 0.002,
                   "wall_s": 0.008, "timeline": "cpu"}}
    result = assemble(answers, "/d", missing=[1])

    class Host(App[None]):
        def on_mount(self) -> None:
            self.push_screen(ProfileScreen(result))

    app = Host()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, ProfileScreen)
        console = Console(width=200, record=True, file=io.StringIO())
        for s in screen.query(Static):
            console.print(s.content)
        shown = console.export_text()
        assert name in shown  # literally, not as markup
        assert "/d/rank0.1.pt.trace.json" in shown and "rank 1" in shown
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, ProfileScreen)


# ---- the split itself, on events this machine cannot produce (a GPU's) -------------------


def test_split_time_partitions_the_window():
    from collectors.profiler import split_time

    # compute 0-4 and 6-8 (one interval nested, one past the window); comm 3-7
    s = split_time([(0, 4), (1, 2), (6, 8), (9, 12)], [(3, 7)], (0, 10))
    assert s["wall_s"] == 10
    assert s["compute_s"] == 4 + 2 + 1  # 9-12 clipped to 9-10
    assert s["comm_s"] == 4 and s["overlap_s"] == 1 + 1
    assert s["idle_s"] == 10 - (7 + 4 - 2)
    assert split_time([], [], (5, 5)) == {"wall_s": 0, "compute_s": 0, "comm_s": 0,
                                          "overlap_s": 0, "idle_s": 0}


def test_comm_names():
    from collectors.profiler import is_comm

    for name in ("gloo:all_reduce", "nccl:all_reduce", "c10d::allreduce_",
                 "record_param_comms", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                 "c10d_functional::wait_tensor", "gloo:all_gather"):
        assert is_comm(name), name
    for name in ("aten::broadcast_to", "aten::addmm", "ampere_sgemm_128x64_tn",
                 "Memcpy HtoD (Pageable -> Device)", "ProfilerStep#3"):
        assert not is_comm(name), name


def test_summary_uses_the_gpu_timeline_where_there_is_one():
    """GPU events as ``prof.events()`` holds them (device CUDA, kineto activity types):
    NCCL kernels are comm, other kernels and copies compute, GPU annotations neither;
    operators rank by self CUDA time."""
    from types import SimpleNamespace as NS

    from collectors.profiler import summarise

    def ev(name, a, b, device="CPU", activity="cpu_op", cpu_self=0.0, dev_self=0.0):
        return NS(name=name, trace_name=name, device_type=f"DeviceType.{device}",
                  activity_type=activity, time_range=NS(start=a, end=b),
                  self_cpu_time_total=cpu_self, self_device_time_total=dev_self,
                  is_user_annotation=activity.endswith("annotation"))

    events = [
        ev("ProfilerStep#7", 0, 1000, activity="user_annotation"),
        ev("aten::mm", 10, 20, cpu_self=10, dev_self=300),
        ev("aten::add_", 20, 25, cpu_self=5, dev_self=50),
        ev("c10d::allreduce_", 30, 40, cpu_self=10),
        ev("ampere_sgemm", 100, 400, device="CUDA", activity="kernel"),
        ev("Memcpy DtoD", 400, 450, device="CUDA", activity="gpu_memcpy"),
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 350, 700, device="CUDA",
           activity="kernel"),
        ev("DistributedDataParallel.forward", 0, 900, device="CUDA",
           activity="gpu_user_annotation"),
    ]
    gpu = summarise(events, gpu=True)
    assert gpu["timeline"] == "gpu"
    # the GPU's own window: no GPU-side ProfilerStep here, so its kernels' (100-700), not
    # the CPU's ProfilerStep (0-1000, which read 400 us of idle: issue 25, finding 8)
    assert gpu["wall_s"] == pytest.approx(600e-6)
    assert gpu["compute_s"] == pytest.approx(350e-6)  # 100-450
    assert gpu["comm_s"] == pytest.approx(350e-6)  # 350-700
    assert gpu["overlap_s"] == pytest.approx(100e-6)
    assert gpu["idle_s"] == pytest.approx(0.0)
    assert [o["name"] for o in gpu["top_ops"]] == ["aten::mm", "aten::add_"]
    cpu = summarise(events, gpu=False)
    assert cpu["timeline"] == "cpu"
    assert cpu["compute_s"] == pytest.approx(15e-6) and cpu["comm_s"] == pytest.approx(10e-6)
    assert [o["name"] for o in cpu["top_ops"]] == ["aten::mm", "c10d::allreduce_",
                                                   "aten::add_"]


def test_a_collective_inside_an_operator_is_not_compute():
    """DDP launches its allreduce from inside autograd's AccumulateGrad: the launch is
    comm, the rest of the operator compute; gloo's own thread overlaps the backward."""
    from types import SimpleNamespace as NS

    from collectors.profiler import subtract, summarise

    assert subtract([(0, 10), (20, 30)], [(2, 4), (8, 22), (25, 26)]) == [
        (0, 2), (4, 8), (22, 25), (26, 30)]
    assert subtract([(0, 10)], []) == [(0, 10)] and subtract([], [(0, 1)]) == []

    def ev(name, a, b, thread, activity="cpu_op"):
        return NS(name=name, trace_name=name, device_type="DeviceType.CPU", thread=thread,
                  activity_type=activity, time_range=NS(start=a, end=b),
                  self_cpu_time_total=b - a, self_device_time_total=0.0)

    s = summarise([ev("ProfilerStep#1", 0, 200, 1, "user_annotation"),
                   ev("autograd::engine::evaluate_function: AccumulateGrad", 0, 100, 1),
                   ev("c10d::allreduce_", 40, 60, 1),
                   ev("gloo:all_reduce", 50, 150, 2, "user_annotation")], gpu=False)
    assert s["compute_s"] == pytest.approx(80e-6)  # 0-40 and 60-100
    assert s["comm_s"] == pytest.approx(110e-6)  # 40-150
    assert s["overlap_s"] == pytest.approx(40e-6)  # 60-100: backward while gloo reduces
    assert s["idle_s"] == pytest.approx(50e-6)


# ---- on a GPU (findings 8, 9, 10 of issue 25): the GPU's timeline, its device, bounds ------


def _gpu_ev(name, a, b, device="CPU", activity="cpu_op", cpu_self=0.0, dev_self=0.0):
    from types import SimpleNamespace as NS

    return NS(name=name, trace_name=name, device_type=f"DeviceType.{device}",
              activity_type=activity, time_range=NS(start=a, end=b), thread=1,
              self_cpu_time_total=cpu_self, self_device_time_total=dev_self,
              is_user_annotation=activity.endswith("annotation"))


def test_the_gpu_split_uses_the_gpus_own_steps_not_the_cpus():
    """Finding 8: the GPU runs behind the host. Clipped to the CPU's ProfilerStep window
    (0-1000 us), the kernels that lag past it were dropped and the 300 us before the
    first step's kernels read as idle; kineto's GPU-side ProfilerStep spans the kernels
    the steps launched (300-1600 us)."""
    from collectors.profiler import summarise

    events = [
        _gpu_ev("ProfilerStep#4", 0, 500, activity="user_annotation"),
        _gpu_ev("ProfilerStep#5", 500, 1000, activity="user_annotation"),
        _gpu_ev("aten::mm", 10, 20, cpu_self=10, dev_self=700),
        _gpu_ev("ProfilerStep#4", 300, 900, device="CUDA", activity="gpu_user_annotation"),
        _gpu_ev("ProfilerStep#5", 900, 1600, device="CUDA", activity="gpu_user_annotation"),
        _gpu_ev("sm90_gemm", 300, 700, device="CUDA", activity="kernel"),
        _gpu_ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 700, 900, device="CUDA",
                activity="kernel"),
        _gpu_ev("sm90_gemm", 900, 1200, device="CUDA", activity="kernel"),
        _gpu_ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1300, 1600, device="CUDA",
                activity="kernel"),
    ]
    s = summarise(events, gpu=True)
    assert s["timeline"] == "gpu"
    assert s["wall_s"] == pytest.approx(1300e-6)  # was 1000e-6 (the CPU's window)
    assert s["compute_s"] == pytest.approx(700e-6)  # was 600e-6: 1000-1200 was dropped
    assert s["comm_s"] == pytest.approx(500e-6)  # was 200e-6: 1300-1600 was dropped
    assert s["idle_s"] == pytest.approx(100e-6)  # was 200e-6 (0-300 counted as idle)
    # without GPU-side steps in the trace: the kernels' own window
    bare = summarise([e for e in events if e.activity_type != "gpu_user_annotation"],
                     gpu=True)
    assert bare["wall_s"] == pytest.approx(1300e-6) and bare["idle_s"] == pytest.approx(
        100e-6)


class _FakeCudaProfiler:
    """``torch.profiler.profile`` with CUDA activity, as far as a capture uses it. Its
    rule: stopping synchronises the *current* device (torch/autograd/profiler.py,
    ``profile.__exit__``: ``device_module.synchronize()``), and a synchronise on a
    device opens a CUDA context there (tests/fakecuda.py)."""

    cuda = None  # the FakeCuda, set by the test

    def __init__(self, activities=None, schedule=None, on_trace_ready=None, **kw) -> None:
        self.on_trace_ready = on_trace_ready
        self.step_num = 0
        self.started = False

    def start(self) -> None:
        self.started = True

    def step(self) -> None:
        self.step_num += 1

    def stop(self) -> None:
        type(self).cuda.synchronize()
        self.started = False
        if self.on_trace_ready is not None:
            self.on_trace_ready(self)

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text("{}")

    def events(self) -> list:
        return []


@pytest.fixture
def cuda_profiler(monkeypatch):
    """The fake CUDA runtime as ``torch.cuda`` for rtop, and the fake profiler above as
    ``torch.profiler.profile``."""
    import torch.profiler

    from collectors import cuda_events
    from tests.fakecuda import FakeCuda

    fake = FakeCuda(devices=2)
    monkeypatch.setattr(cuda_events, "cuda_module", lambda: fake)
    monkeypatch.setattr(_FakeCudaProfiler, "cuda", fake)
    monkeypatch.setattr(torch.profiler, "profile", _FakeCudaProfiler)
    return fake


def test_the_profiler_stops_on_the_models_gpu(cuda_profiler, tmp_path):
    """Finding 9: a job that never calls set_device stays on GPU 0 while its model lives
    on GPU 1; torch's profiler synchronises the current device when it stops, so every
    rank opened a CUDA context on GPU 0. The profiler now stops with the model's device
    current (and the training thread's current device is left as it was)."""
    from collectors.profiler import ProfileCapture

    fake = cuda_profiler
    fake.run(1, 1.0)  # the model's GPU is in use; the training thread is on device 0
    answers: list = []
    cap = ProfileCapture(str(tmp_path / "t"), "rank0", 2, 0, answers.append, cuda=True,
                         device=1)
    assert [cap.at_boundary(s) for s in (7, 8, 9)] == [False, False, True]
    assert "error" not in answers[0], answers
    assert answers[0]["steps"] == [7, 8]
    assert fake.context_devices() == {1}, fake.contexts  # nothing on GPU 0
    assert fake.current_device() == 0


def test_a_gpu_profile_is_bounded(cuda_profiler, tmp_path, monkeypatch):
    """Finding 10: with CUDA activity every kernel adds to the trace, outside the memory
    the capture's bound watches: more than MAX_CUDA_PROFILE_STEPS steps is refused with a
    clear error (nothing started), and the capture stops at a lower growth."""
    from collectors import profiler
    from collectors.profiler import (
        MAX_CAPTURE_GROWTH_BYTES,
        MAX_CAPTURE_GROWTH_BYTES_CUDA,
        MAX_CUDA_PROFILE_STEPS,
        ProfileCapture,
    )

    answers: list = []
    cap = ProfileCapture(str(tmp_path / "big"), "rank0", MAX_CUDA_PROFILE_STEPS + 1, 0,
                         answers.append, cuda=True, device=1)
    assert cap.at_boundary(3) is True
    assert f"at most {MAX_CUDA_PROFILE_STEPS} steps" in answers[0]["error"]
    assert not (tmp_path / "big").exists()  # nothing made, nothing started
    # memory: the CPU capture goes on at a growth the GPU one stops at
    assert MAX_CAPTURE_GROWTH_BYTES_CUDA < MAX_CAPTURE_GROWTH_BYTES
    rss = {"now": 1 << 30}
    monkeypatch.setattr(profiler, "_rss", lambda: rss["now"])
    for cuda, steps_done in ((True, 2), (False, 5)):
        answers = []
        cap = ProfileCapture(str(tmp_path / f"grow-{cuda}"), "rank0", 5, 0, answers.append,
                             cuda=cuda, device=1 if cuda else None)
        rss["now"] = 1 << 30
        cap.at_boundary(0)
        cap.at_boundary(1)
        rss["now"] += MAX_CAPTURE_GROWTH_BYTES_CUDA + (1 << 20)
        while not cap.at_boundary(2):
            pass
        assert answers[0]["steps"][1] - answers[0]["steps"][0] + 1 == steps_done, cuda
        assert ("memory" in (answers[0]["note"] or "")) is cuda


def test_the_summary_reads_a_bounded_number_of_events():
    """Finding 10: the summary is made on the training thread while the other ranks
    wait in NCCL; it reads at most ``max_events`` events (and for at most its time), and
    says it made do with part of them."""
    from collectors.profiler import summarise

    events = [_gpu_ev("aten::mm", i, i + 1, cpu_self=1) for i in range(5000)]
    whole = summarise(events, gpu=False)
    assert whole["events_read"] == 5000 and whole["partial"] is False
    part = summarise(events, gpu=False, max_events=1000)
    assert part["events_read"] == 1000 and part["partial"] is True
    assert part["top_ops"][0]["calls"] == 1000
