"""Stacks on demand, on real processes: a child process whose main thread is stuck (in
``time.sleep``, a lock, a C call, a 500-deep recursion, a gloo collective) takes every
thread's stack from another thread (:func:`collectors.stacks.stacks_answer`, as rtop's
sender thread does), and the test checks the file, function and line where the main
thread is stuck, the size bounds, the grouping across ranks, the text and the screen.

The child processes run functions of this module (``python -c "from tests.test_stacks
import ..."``), so the stuck function's file and line are known here: they are read
from its source with :mod:`inspect`.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import msgpack
import pytest

from collectors.stacks import MAX_PATH_CHARS, all_stacks, stacks_answer
from rtop.actions.stacks import (
    MAIN,
    RTOP,
    assemble,
    format_text,
    group,
    short_path,
)
from rtop.fmt import fmt_ranks

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = "evil\x1b[2J\x1b]0;pwned\x07\u202e\r\nname"


# ---- what the child processes run ----------------------------------------------------

def stuck_in_known_place(how: str, gate: Any) -> None:
    """Block the calling thread until ``gate`` opens (a held lock, a pipe's read end)."""
    if how == "sleep":
        time.sleep(60)  # stuck: sleep
    elif how == "lock":
        gate.acquire()  # stuck: lock
    else:
        os.read(gate, 1)  # stuck: c_call


def expected_line(how: str) -> int:
    """The line of ``stuck_in_known_place`` where a thread blocked in ``how`` sits."""
    lines, start = inspect.getsourcelines(stuck_in_known_place)
    marker = f"# stuck: {'c_call' if how in ('c_call', 'hostile', 'gloo') else how}"
    return start + next(i for i, s in enumerate(lines) if marker in s)


def _innermost(answer: dict[str, Any]) -> dict[str, Any] | None:
    training = [t for t in answer["threads"] if t["training"]]
    return training[0]["frames"][-1] if training and training[0]["frames"] else None


def _wait_until(ident: int, function: str, timeout: float = 30.0) -> None:
    """Until thread ``ident``'s innermost frame is ``function`` at one line twice in a
    row (it has reached its blocking call and stays there)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        f = _innermost(stacks_answer(0, training_ident=ident))
        now = (f["function"], f["line"]) if f else None
        if now is not None and now[0] == function and now == last:
            return
        last = now
        time.sleep(0.1)
    raise TimeoutError(f"thread never reached {function!r}")


def child(how: str) -> None:
    """A process whose main thread is stuck in ``how``; another thread (named like
    rtop's) prints every stack as JSON and ends the process."""
    lock = threading.Lock()
    lock.acquire()
    r, _w = os.pipe()
    target = stuck_in_known_place
    if how == "hostile":
        code = stuck_in_known_place.__code__.replace(co_name=HOSTILE, co_qualname=HOSTILE)
        target = types.FunctionType(code, globals(), HOSTILE)
        threading.current_thread().name = HOSTILE
    main = threading.get_ident()
    park = threading.Event()
    threading.Thread(target=park.wait, name="worker-1", daemon=True).start()

    def sample() -> None:
        try:
            _wait_until(main, target.__code__.co_qualname)
            t0 = time.perf_counter()
            answer = stacks_answer(0, training_ident=main)
            answer["elapsed_s"] = time.perf_counter() - t0
            answer["sampler"] = threading.get_ident()
            print(json.dumps(answer), flush=True)
        finally:
            os._exit(0)

    threading.Thread(target=sample, name="rtop-test-sampler", daemon=True).start()
    target("c_call" if how == "hostile" else how, lock if how == "lock" else r)


def child_budget(max_bytes: int) -> None:
    """200 parked threads and a 500-deep recursion, in a file with a very long path."""
    src = ("import os\n"
           "def deep(n, ready, fd):\n"
           "    if n > 0:\n"
           "        return deep(n - 1, ready, fd)\n"
           "    ready.set()\n"
           "    os.read(fd, 1)  # the bottom\n")
    long_path = "/" + "/".join(["a-very-long-directory-name"] * 150) + "/deep.py"
    ns: dict[str, Any] = {}
    exec(compile(src, long_path, "exec"), ns)
    park = threading.Event()
    for i in range(200):
        threading.Thread(target=park.wait, name=f"parked-{i}", daemon=True).start()
    ready = threading.Event()
    r, _w = os.pipe()
    main = threading.get_ident()

    def sample() -> None:
        try:
            ready.wait(60)
            time.sleep(0.2)
            total = len(sys._current_frames())
            t0 = time.perf_counter()
            answer = stacks_answer(0, training_ident=main, max_bytes=max_bytes)
            elapsed = time.perf_counter() - t0
            size = len(msgpack.packb(answer, use_bin_type=True))
            plain = all_stacks(max_bytes=max_bytes, training_ident=main)
            print(json.dumps({"answer": answer, "size": size, "total": total,
                              "elapsed_s": elapsed, "path_len": len(long_path),
                              "all_stacks": len(plain)}), flush=True)
        finally:
            os._exit(0)

    threading.Thread(target=sample, name="rtop-test-sampler", daemon=True).start()
    ns["deep"](500, ready, r)


def gloo_rank(rank: int, world: int, port: int, out: str) -> None:
    """A rank of a gloo job: the last rank is stuck in ``stuck_in_known_place`` while
    the others wait for it in an allreduce. Each rank writes its stacks answer, taken
    by a thread named like rtop's, once its main thread has settled; the stuck rank is
    released once every rank has written."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=90))
    main = threading.get_ident()
    r, w = os.pipe()
    stuck = rank == world - 1
    done = Path(out)

    def sample() -> None:
        _wait_until(main, "stuck_in_known_place" if stuck else "all_reduce", 60)
        answer = stacks_answer(rank, training_ident=main)
        (done / f"{rank}.tmp").write_bytes(msgpack.packb(answer, use_bin_type=True))
        (done / f"{rank}.tmp").rename(done / f"{rank}.msgpack")
        if stuck:
            deadline = time.monotonic() + 60
            while len(list(done.glob("*.msgpack"))) < world and time.monotonic() < deadline:
                time.sleep(0.05)
            os.write(w, b"x")

    threading.Thread(target=sample, name="rtop-test-sampler", daemon=True).start()
    if stuck:
        stuck_in_known_place("c_call", r)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == world
    dist.destroy_process_group()


# ---- helpers -------------------------------------------------------------------------

def run_child(call: str, timeout: float = 90) -> dict[str, Any]:
    """Run ``call`` (Python, in this module) in a fresh interpreter; its JSON line."""
    proc = subprocess.run([sys.executable, "-c", f"from tests.test_stacks import *; {call}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def thread_named(answer: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in answer["threads"] if t["name"] == name)


def functions(thread: dict[str, Any]) -> list[str]:
    return [f["function"] for f in thread["frames"]]


def unsafe_chars(text: str) -> set[str]:
    """Characters a terminal could act on (control, format, line separators), newlines
    of the text's own layout aside."""
    import unicodedata

    return {c for c in text if c != "\n" and (not c.isprintable() and
                                              unicodedata.category(c) != "Zs")}


# ---- the collector, in a real process ------------------------------------------------

@pytest.mark.parametrize("how", ["sleep", "lock", "c_call"])
def test_a_stuck_main_thread_shows_its_file_function_and_line(how):
    answer = run_child(f"child({how!r})")
    main = thread_named(answer, "MainThread")
    assert main["training"] and answer["threads"][0] == main  # the training thread leads
    inner = main["frames"][-1]
    assert inner == {"file": __file__, "line": expected_line(how),
                     "function": "stuck_in_known_place"}
    # outermost first: the interpreter's "-c" module, then child(), then the stuck one
    fns = functions(main)
    assert fns[0] == "<module>" and main["frames"][0]["file"] == "<string>"
    assert fns.index("child") == len(fns) - 2
    assert main["truncated"] == 0 and answer["threads_omitted"] == 0
    # every thread, rtop's marked, the calling thread included
    sampler = thread_named(answer, "rtop-test-sampler")
    assert sampler["rtop"] and not sampler["training"] and sampler["daemon"]
    assert sampler["ident"] == answer["sampler"]
    worker = thread_named(answer, "worker-1")
    assert not worker["rtop"] and "wait" in functions(worker)[-1]
    assert answer["pid"] > 0 and abs(answer["time"] - time.time()) < 120


def test_control_characters_in_names_come_out_clean():
    answer = run_child("child('hostile')")
    raw = next(t for t in answer["threads"] if t["training"])
    # the collector sends names as they are (only cut) ...
    assert raw["name"] == HOSTILE and raw["frames"][-1]["function"] == HOSTILE
    assert raw["frames"][-1]["line"] == expected_line("hostile")
    # ... and the viewer's side cleans them, in the JSON and the text
    result = assemble({0: answer}, [], {1: "boom\x1b[31m\x07"})
    shown = result["ranks"][0]["threads"][0]
    assert unsafe_chars(shown["name"]) == set()
    assert unsafe_chars(shown["frames"][-1]["function"]) == set()
    assert shown["frames"][-1]["function"].startswith("evil")
    assert unsafe_chars(result["errors"]["1"]) == set()
    text = format_text(result, all_threads=True)
    assert unsafe_chars(text) == set() and "evil" in text and "\x1b" not in text
    assert json.loads(json.dumps(result)) == result


def test_budget_holds_for_a_deep_recursion_and_200_threads():
    for max_bytes in (48_000, 8_000):
        got = run_child(f"child_budget({max_bytes})")
        answer = got["answer"]
        assert got["size"] <= max_bytes, (got["size"], max_bytes)
        threads = answer["threads"]
        assert len(threads) <= 64
        assert len(threads) + answer["threads_omitted"] == got["total"] >= 202
        assert abs(got["all_stacks"] - len(threads)) <= 1  # the same, bar the caller's own
        main = threads[0]
        assert main["training"] and main["name"] == "MainThread"
        # innermost frames kept (where it is stuck), the outermost few too, the cut marked
        fns = functions(main)
        assert fns[0] == "<module>" and fns[-1] == "deep" and fns[-2] == "deep"
        marker = [f for f in main["frames"] if "frames not sent" in f["function"]]
        assert len(marker) == 1 and f"... {main['truncated']} frames" in marker[0]["function"]
        depth = len(main["frames"]) - 1 + main["truncated"]
        assert depth >= 501 + 2  # deep() 501 times, child_budget, <module>
        # a long path keeps its end, cut to a sane length
        deep_file = main["frames"][-1]["file"]
        assert got["path_len"] > MAX_PATH_CHARS >= len(deep_file)
        assert deep_file.endswith("/deep.py") and deep_file.startswith("…")
        assert got["elapsed_s"] < 2.0, got["elapsed_s"]  # a walk of frames, not a parse
    # the smaller budget leaves more out, and cuts the deep stack harder
    assert answer["threads_omitted"] > 0 and len(main["frames"]) <= 128


def test_never_raises_and_honours_its_bounds_in_process():
    assert all_stacks(max_threads=0) == []
    me = threading.get_ident()
    assert all(t["ident"] != me for t in all_stacks(skip_ident=me))
    tiny = stacks_answer(3, max_bytes=10)
    assert tiny["threads"] == [] and tiny["threads_omitted"] >= 1 and tiny["rank"] == 3
    park = threading.Event()
    parked = threading.Thread(target=park.wait, name="parked", daemon=True)
    parked.start()
    try:
        one = all_stacks(max_frames=1, training_ident=parked.ident)
    finally:
        park.set()
    # the training thread first; its one frame the innermost, the others cut and marked
    assert one[0]["ident"] == parked.ident and one[0]["training"]
    marker, inner = one[0]["frames"]
    assert inner["function"] == "Condition.wait" and inner["file"] == threading.__file__
    assert marker["function"] == f"... {one[0]['truncated']} frames not sent ..."


# ---- a real gloo job: one rank stuck, the others waiting for it ----------------------

WORLD = 3


@pytest.fixture(scope="module")
def gloo_result(tmp_path_factory) -> dict[str, Any]:
    from rtop.workload import free_port

    out = tmp_path_factory.mktemp("stacks")
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", f"from tests.test_stacks import gloo_rank; "
                               f"gloo_rank({r}, {WORLD}, {port}, {str(out)!r})"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    answers = {r: msgpack.unpackb((out / f"{r}.msgpack").read_bytes(), raw=False)
               for r in range(WORLD)}
    return assemble(answers, [WORLD + 1], {WORLD: "no answer: the rank closed"})


def test_gloo_job_groups_the_odd_rank_out_first(gloo_result):
    result = gloo_result
    assert [e["rank"] for e in result["ranks"]] == list(range(WORLD))
    assert result["missing"] == [WORLD + 1] and list(result["errors"]) == [str(WORLD)]
    groups = group(result)
    assert [g.ranks for g in groups] == [[WORLD - 1], list(range(WORLD - 1))]
    stuck, waiting = groups
    assert stuck.frames[-1] == {"file": __file__, "line": expected_line("gloo"),
                                "function": "stuck_in_known_place"}
    assert waiting.frames[-1]["function"] == "all_reduce"
    assert waiting.frames[-1]["file"].endswith("distributed_c10d.py")
    for g in groups:  # outermost first: the "-c" module, then gloo_rank
        assert [f["function"] for f in g.frames[:2]] == ["<module>", "gloo_rank"]
        assert g.kind == MAIN
    text = format_text(result)
    head_stuck = f"rank {WORLD - 1} (pid {result['ranks'][-1]['pid']})"
    head_wait = f"ranks {fmt_ranks(range(WORLD - 1))} ({WORLD - 1} ranks)"
    assert head_stuck in text and head_wait in text
    assert text.index(head_stuck) < text.index(head_wait)
    # py-spy's layout: innermost first, "function (file:line)"
    block = text[text.index(head_stuck):].splitlines()
    assert block[1] == (f"    stuck_in_known_place ({short_path(__file__)}:"
                        f"{expected_line('gloo')})")
    assert block[2].startswith("    gloo_rank (")
    assert "no answer in time from rank 4" in text and "rank 3: no answer" in text
    # rtop's own threads are folded unless asked for
    assert "rtop-test-sampler" not in text and "rtop's own threads folded" in text
    everything = format_text(result, all_threads=True)
    assert '"rtop-test-sampler" (rtop)' in everything
    assert {g.kind for g in group(result, which="all")} >= {MAIN, RTOP}
    assert all(g.kind != RTOP for g in group(result, which="user"))


def test_grouping_puts_the_smallest_group_first():
    frames = [{"file": "/x/train.py", "line": 10, "function": "main"}]
    def answer(r: int, line: int) -> dict[str, Any]:
        return {"rank": r, "pid": 100 + r, "threads": [{
            "name": "MainThread", "ident": 1, "training": True,
            "frames": [*frames, {"file": "/x/train.py", "line": line, "function": "step"}]}]}
    lines = {0: 20, 1: 20, 2: 20, 3: 20, 4: 30, 5: 20, 6: 20, 7: 20}
    result = assemble({r: answer(r, ln) for r, ln in lines.items()}, [], {})
    groups = group(result)
    assert [(g.ranges, len(g.ranks)) for g in groups] == [("4", 1), ("0-3,5-7", 7)]
    text = format_text(result)
    assert text.index("rank 4 (pid 104)") < text.index("ranks 0-3,5-7 (7 ranks)")
    assert "    step (/x/train.py:30)\n    main (/x/train.py:10)" in text
    assert fmt_ranks([5, 0, 1, 2, 3, 9, 10]) == "0-3,5,9-10" and fmt_ranks([]) == ""


def test_assemble_survives_malformed_answers():
    bad: dict[int, Any] = {
        0: {"threads": "nope", "pid": "x"},
        1: {"threads": [None, {"frames": [None, {"line": True, "function": 5}]}]},
        2: "not a mapping",
        3: {"threads": [], "error": "RuntimeError: \x1b[31mred"},
    }
    result = assemble(bad, [3, 5], {})
    assert [e["rank"] for e in result["ranks"]] == [0, 1, 3]
    assert result["ranks"][0]["threads"] == [] and result["ranks"][0]["pid"] is None
    f = result["ranks"][1]["threads"][0]["frames"]
    assert f == [{"file": "", "line": None, "function": "5"}]
    assert result["missing"] == [5] and set(result["errors"]) == {"2", "3"}
    assert "\x1b" not in result["errors"]["3"]
    text = format_text(result)
    assert "no Python thread from rank(s) 0,3" in text


# ---- the screen ----------------------------------------------------------------------

def _screen_text(screen: Any) -> tuple[list[str], str]:
    from textual.widgets import OptionList, Static

    ol = screen.query_one("#groups", OptionList)
    labels = [str(ol.get_option_at_index(i).prompt) for i in range(ol.option_count)]
    return labels, str(screen.query_one("#stack", Static).render())


@pytest.mark.parametrize("size", [(80, 24), (200, 50)])
async def test_stacks_screen_shows_groups_and_closes(gloo_result, size):
    from textual.app import App

    from rtop.tui.stacks_view import StacksScreen

    class Host(App[None]):
        def on_mount(self) -> None:
            self.push_screen(StacksScreen(gloo_result))

    app = Host()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, StacksScreen)
        labels, stack = _screen_text(screen)
        assert labels[0].startswith(f"rank {WORLD - 1}\n")
        assert "stuck_in_known_place" in labels[0]
        assert labels[1].startswith(f"ranks {fmt_ranks(range(WORLD - 1))} ({WORLD - 1})")
        assert not any("rtop-test-sampler" in label for label in labels)
        assert stack.index("stuck_in_known_place") < stack.index("gloo_rank")
        assert f":{expected_line('gloo')}" in stack
        one_line = size[0] >= 200
        assert (f"stuck_in_known_place ({short_path(__file__)}:" in stack) == one_line
        await pilot.press("down")
        _, stack = _screen_text(screen)
        assert "all_reduce" in stack and "stuck_in_known_place" not in stack
        n = len(labels)
        await pilot.press("a")
        labels, _ = _screen_text(screen)
        assert len(labels) > n and any("rtop-test-sampler" in label for label in labels)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, StacksScreen)


async def test_stacks_screen_draws_hostile_names_as_text():
    from textual.app import App

    from rtop.tui.stacks_view import StacksScreen

    evil = {"rank": 0, "pid": 1, "threads": [{
        "name": "[bold]x[/]" + HOSTILE, "ident": 7, "training": True,
        "frames": [{"file": "/x/[@click=app.quit]y.py", "line": 3, "function": HOSTILE}]}]}
    result = assemble({0: evil}, [], {})

    class Host(App[None]):
        def on_mount(self) -> None:
            self.push_screen(StacksScreen(result))

    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        labels, stack = _screen_text(app.screen)
        assert "[@click=app.quit]y.py" in stack and "[bold]x[/]" in stack
        assert unsafe_chars(stack) == set() and unsafe_chars("".join(labels)) == set()
        await pilot.press("q")
        await pilot.pause()
        assert not isinstance(app.screen, StacksScreen)
