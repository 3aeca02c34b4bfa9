"""A link probe names a link only if it is slow twice: the hub re-measures the links a
probe first found slow, with their ranks only, and judges the faster of the two figures.

A real hub over real sockets, four hand-driven ranks on four "nodes" (``RankClient``,
so each rank answers exactly the figures a case needs: a healthy link measured slow once,
a link slow twice, a rank that fails in the re-measurement), and ``HubClient.act`` as
``rtop probe`` calls it. The real ranks' side of the same path runs in
``tests/test_linkprobe_netns.py`` (a throttled node on a real network) and
``tests/test_control.py``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from collectors import auth, wire
from rtop.client import HubClient
from rtop.hub.service import ThreadedHub
from tests.rankclient import RankClient, step_row

MASTER = "recheck-test-master-token-0123456789"
NODES = ("node-a", "node-b", "node-c", "node-d")
HEALTHY, SLOW = 4.5e8, 2.0e8  # bytes/s: 2.0e8 is under half of 4.5e8


class Ranks:
    """A hub and four hand-driven ranks, one per node, at step 10."""

    def __init__(self) -> None:
        self.hub = ThreadedHub(record="", token=MASTER).start()
        ingest = auth.role_token(MASTER, "ingest")
        self.ranks = [RankClient(self.hub.address, ingest, r, world=4, host=NODES[r])
                      for r in range(4)]
        for c in self.ranks:
            assert c.recv().kind == wire.KIND_WELCOME
            c.batch(steps=[step_row(s) for s in range(11)])

    def probe(self, figures: dict[tuple[int, int], float]) -> tuple[int, list[list[int]]]:
        """Serve one probe the hub asks of its ranks (whichever it sends it to): each
        answers, for each of its pairs, the peer's figure from ``figures`` (``HEALTHY``
        when absent), or an error where ``figures`` holds one for the rank (``(r, r)``).
        Returns the at_step and the pairs ``[round, a, b]`` asked."""
        asked: dict[int, dict[str, Any]] = {}
        for c in self.ranks:
            frame = self._control(c, timeout=1.0)
            if frame is not None:
                assert frame.payload["action"] == "probe", frame.payload
                asked[c.rank] = frame.payload
        assert asked, "the hub asked no rank for a probe"
        for r, p in asked.items():
            self.ranks[r].send(wire.KIND_RESULT, {"id": p["id"], "state": "ready",
                                                  "step": p["at_step"]})
        for r, p in asked.items():
            go = self._control(self.ranks[r], timeout=10.0)
            assert go is not None and go.payload == {"id": p["id"], "action": "go"}, go
        pairs: list[list[int]] = []
        for r, p in asked.items():
            mine = p["args"]["pairs"]
            pairs += [x for x in mine if x not in pairs]
            if (r, r) in figures:
                answer: dict[str, Any] = {"state": "error", "error": "a transfer failed"}
            else:
                links = []
                for _round, a, b in mine:
                    peer = b if a == r else a
                    links.append([peer, figures.get((min(a, b), max(a, b)), HEALTHY)])
                answer = {"state": "done", "links": links, "seconds": 0.5,
                          "nbytes": p["args"]["bytes"]}
            self.ranks[r].send(wire.KIND_RESULT, {"id": p["id"], **answer})
        return next(iter(asked.values()))["at_step"], sorted(pairs)

    @staticmethod
    def _control(c: RankClient, timeout: float) -> wire.Frame | None:
        """The next control frame to ``c``, or None if none comes within ``timeout``."""
        try:
            while True:
                frame = c.recv(timeout=timeout)
                if frame is None:
                    raise AssertionError(f"the hub closed rank {c.rank}'s connection")
                if frame.kind == wire.KIND_CONTROL:
                    return frame
        except TimeoutError:
            return None

    def ask(self) -> tuple[threading.Thread, dict[str, Any]]:
        """``rtop probe`` in a thread: its result and every ``started`` answer."""
        out: dict[str, Any] = {"started": []}

        def run() -> None:
            with HubClient(self.hub.address, auth.role_token(MASTER, "control"),
                           role="control") as c:
                out["result"] = c.act("probe", args={"bytes": 1 << 16},
                                      on_started=out["started"].append)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, out

    def close(self) -> None:
        for c in self.ranks:
            c.close()
        self.hub.stop()


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    r = Ranks()
    try:
        yield r
    finally:
        r.close()


def finish(t: threading.Thread, out: dict[str, Any]) -> dict[str, Any]:
    t.join(30)
    assert not t.is_alive(), "the probe's answer never came"
    result: dict[str, Any] = out["result"]
    return result


def test_a_link_slow_once_is_measured_again_and_not_named(ranks: Ranks) -> None:
    t, out = ranks.ask()
    first_step, first_pairs = ranks.probe({(1, 2): SLOW})
    assert len(first_pairs) == 6  # every link of 4 ranks, in 3 rounds
    # the re-measurement: link 1-2 alone, by ranks 1 and 2 alone, a few steps later
    again_step, again_pairs = ranks.probe({(1, 2): 4.4e8})
    assert again_pairs == [[0, 1, 2]]
    assert again_step >= first_step
    result = finish(t, out)
    assert [s.get("recheck", False) for s in out["started"]] == [False, True]
    assert out["started"][1]["ranks"] == [1, 2] and out["started"][1]["links"] == 1
    links = result["links"]
    assert links["findings"] == [], links["findings"]
    assert links["recheck"]["links"] == [[1, 2]] and links["recheck"]["confirmed"] == 0
    assert links["recheck"]["error"] is None and links["recheck"]["passes"] == 1
    m = links["matrix_Bps"]
    assert m[1][2] == m[2][1] == 4.4e8  # the faster of the two measurements
    assert m[0][1] == HEALTHY
    assert result["errors"] == [] and result["missing"] == []
    from rtop.actions.probe import format_text

    text = format_text(links)
    assert "No slow link" in text
    assert "1 link first measured slow, re-measured (" in text
    assert "0 still slow, 1 healthy the second time" in text
    # what the hub keeps is the merged matrix: the fabric view shows no slow link
    with HubClient(ranks.hub.address, MASTER) as c:
        assert c.snapshot()["links"]["slow"] == []


def test_a_link_that_turns_slow_against_a_re_measured_one_is_measured_again(
        ranks: Ranks) -> None:
    """Link 2-3 is slow at first and healthy re-measured; that raises the median the
    others are judged against, so link 1-2, which was not slow at first, is now: it is
    measured again too (a second pass) before anything is named."""
    t, out = ranks.ask()
    first = {(0, 1): 5.5e8, (0, 2): 5.2e8, (0, 3): 5.6e8, (1, 2): 2.7e8, (1, 3): 3.65e8,
             (2, 3): 2.0e8}
    ranks.probe(first)
    _, again = ranks.probe({(2, 3): 5.9e8})
    assert again == [[0, 2, 3]]
    _, third = ranks.probe({(1, 2): 4.0e8})
    assert third == [[0, 1, 2]]
    links = finish(t, out)["links"]
    assert links["findings"] == []
    assert links["recheck"]["links"] == [[2, 3], [1, 2]]
    assert links["recheck"]["passes"] == 2 and links["recheck"]["confirmed"] == 0
    assert [s.get("recheck", False) for s in out["started"]] == [False, True, True]


def test_a_later_pass_that_fails_keeps_what_the_earlier_one_measured(ranks: Ranks
                                                                      ) -> None:
    """As above, but rank 1 fails in the second pass: link 2-3 was measured twice
    (healthy), link 1-2 only once: the text says which is which, not "not re-measured"
    for both."""
    t, out = ranks.ask()
    first = {(0, 1): 5.5e8, (0, 2): 5.2e8, (0, 3): 5.6e8, (1, 2): 2.7e8, (1, 3): 3.65e8,
             (2, 3): 2.0e8}
    ranks.probe(first)
    ranks.probe({(2, 3): 5.9e8})
    _, third = ranks.probe({(1, 1): 0.0})  # rank 1 fails; rank 2 answers
    assert third == [[0, 1, 2]]
    links = finish(t, out)["links"]
    rc = links["recheck"]
    assert rc["links"] == [[2, 3], [1, 2]] and rc["unmeasured"] == [[1, 2]]
    assert rc["passes"] == 2 and rc["confirmed"] == 0
    assert "rank 1: a transfer failed" in rc["error"]
    m = links["matrix_Bps"]
    assert m[2][3] == 5.9e8 and m[1][2] == 2.7e8  # the second pass's figure, the first's
    from rtop.actions.probe import format_text

    text = format_text(links)
    assert "2 links first measured slow, 1 re-measured (" in text, text
    assert "0 still slow, 1 healthy the second time" in text, text
    assert "; 1 not re-measured (its first figures stand): rank 1: a transfer failed" \
        in text, text


def test_a_link_slow_twice_is_named(ranks: Ranks) -> None:
    t, out = ranks.ask()
    ranks.probe({(1, 2): SLOW})
    _, again = ranks.probe({(1, 2): 1.9e8})
    assert again == [[0, 1, 2]]
    links = finish(t, out)["links"]
    assert links["recheck"]["confirmed"] == 1 and links["recheck"]["error"] is None
    (f,) = links["findings"]
    assert f["kind"] == "slow_link" and f["ranks"] == [1, 2]
    assert f["evidence"]["links"] == [[1, 2, SLOW]]  # the faster of 2.0e8 and 1.9e8


def test_a_slow_node_is_measured_again_in_rounds(ranks: Ranks) -> None:
    """Node-c's three links slow: re-measured in three rounds (rank 2 is in each), and
    still slow: the node is named."""
    t, out = ranks.ask()
    slow_c = {(0, 2): SLOW, (1, 2): SLOW, (2, 3): SLOW}
    ranks.probe(slow_c)
    _, again = ranks.probe(slow_c)
    assert sorted(tuple(x[1:]) for x in again) == [(0, 2), (1, 2), (2, 3)]
    assert sorted(x[0] for x in again) == [0, 1, 2]  # one transfer a round for rank 2
    links = finish(t, out)["links"]
    # all slow again: nothing moved, so no further pass
    assert links["recheck"]["confirmed"] == 3 and links["recheck"]["passes"] == 1
    (f,) = links["findings"]
    assert f["ranks"] == [2] and f["evidence"]["nodes"] == ["node-c"]


def test_a_failed_re_measurement_keeps_the_first_verdict_and_says_why(ranks: Ranks
                                                                       ) -> None:
    t, out = ranks.ask()
    ranks.probe({(1, 2): SLOW})
    ranks.probe({(2, 2): 0.0})  # rank 2 fails; rank 1 answers
    result = finish(t, out)
    links = result["links"]
    assert "rank 2: a transfer failed" in links["recheck"]["error"]
    (f,) = links["findings"]  # the first measurement's verdict, said to be unconfirmed
    assert f["ranks"] == [1, 2]
    assert result["errors"] == [] and result["cancelled"] is None  # the probe itself ran
    from rtop.actions.probe import format_text

    assert "1 link first measured slow, not re-measured: rank 2: a transfer failed" in \
        format_text(links)


def test_healthy_links_are_not_measured_again(ranks: Ranks) -> None:
    t, out = ranks.ask()
    ranks.probe({})
    result = finish(t, out)
    assert "recheck" not in result["links"] and result["links"]["findings"] == []
    assert len(out["started"]) == 1
    for c in ranks.ranks:  # and no rank was asked for anything more
        assert ranks._control(c, timeout=0.3) is None


async def test_the_ui_says_it_re_measures_before_it_names(ranks: Ranks) -> None:
    """``b`` in the live UI: while the hub re-measures, the UI says so; the answer (a
    healthy link measured slow once) is that every link is healthy, in the fabric view."""
    import asyncio
    import time

    from rtop.tui.app import make_app
    from rtop.tui.source import LiveSource
    from rtop.tui.views import FabricScreen

    app = make_app(LiveSource(ranks.hub.address, MASTER, rate_hz=10))
    said: list[str] = []
    async with app.run_test(size=(140, 40)) as pilot:
        real = app.notify

        def notify(message: str, **kw: Any) -> None:
            said.append(str(message))
            real(message, **kw)

        app.notify = notify  # type: ignore[method-assign]
        await pilot.press("b")
        await asyncio.to_thread(ranks.probe, {(1, 2): SLOW})
        await asyncio.to_thread(ranks.probe, {(1, 2): 4.4e8})
        deadline = time.monotonic() + 10
        while not any("every link is healthy" in m for m in said):
            assert time.monotonic() < deadline, said
            await pilot.pause(0.05)
        assert any(m.startswith("measuring every link") for m in said), said
        assert "probe: re-measuring the 1 slow link before naming it ..." in said, said
        await pilot.pause(0.2)
        assert isinstance(app.screen, FabricScreen)
