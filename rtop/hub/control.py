"""The hub's side of the control channel: actions a control peer asks of the ranks.

A peer authenticated with the control role (or the master token) sends ``control``
``{"id", "action", "ranks", "args", "timeout_s"}``; the hub checks it, sends each target
rank its part over the rank's own connection, gathers the ranks' ``result`` frames, and
answers the peer with one ``result`` when every rank has answered or the deadline has
passed: ``{"id", "action", "state": "done", "answers": [...], "errors": [...],
"missing": [ranks], ...}``. Nobody waits forever: every action has a deadline, a rank
that does not answer is named in ``missing``, and a rank that dies mid-action is an
error for that rank only.

* ``stacks`` goes to every target at once; each rank answers from its sender thread.
* ``profile`` is armed on the targets at a common step ``at_step`` a little ahead of the
  furthest rank (:func:`common_step`); each rank's training thread runs it from there.
* ``probe`` is armed the same way on every rank of the job, and synchronised: each rank
  says ``ready`` at ``at_step`` and waits; the hub says ``go`` once all are ready (within
  :data:`GO_WINDOW_S` of the first), else ``cancel`` (a rank ``late``, lost or silent),
  so a probe runs on every rank or on none (see :mod:`collectors.control`). The links it
  finds slow are then measured again, by their ranks only, the same way (up to
  :data:`RECHECK_PASSES` short probes; the peer gets another ``started`` with
  ``"recheck": true``), and each keeps the faster of its figures. The answers make the
  link matrix and its findings (:mod:`rtop.analysis.links`), which the hub keeps in the
  run's state and records.

At most one training-thread action (profile or probe) runs at a time.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from collectors import wire
from collectors.control import MAX_PROFILE_STEPS
from rtop.fmt import fmt_ranks, safe_text
from rtop.hub.answers import MAX_RESULT_BYTES, BadAnswer, clean_result

if TYPE_CHECKING:
    from rtop.hub.server import Hub

log = logging.getLogger("rtop.hub")

#: Actions a control peer may ask for.
ACTIONS = ("profile", "probe", "stacks")
#: How far ahead (seconds of steps) the common start step is put: the hub knows each
#: rank's step from its last batch (sent every 0.5 s), and the frame must arrive first.
LEAD_S = 1.5
#: ... and at least this many steps ahead.
LEAD_STEPS = 2
#: A synchronised action starts only if every rank is ready within this of the first.
GO_WINDOW_S = 4.0
#: What a rank waits at its step for the hub's go (must exceed GO_WINDOW_S).
WAIT_FOR_GO_S = 10.0
#: Default deadlines (seconds) when the peer gives none.
STACKS_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 3600.0
#: Limits on what may be asked.
MIN_PROBE_BYTES, MAX_PROBE_BYTES = 1024, 1 << 30
DEFAULT_PROBE_BYTES = 16 << 20
#: Timed transfers each way per link in a probe, and in its re-measurement of the links
#: it found slow (few links: more transfers cost little and narrow the figure).
PROBE_REPS, RECHECK_REPS = 3, 10
#: Passes of re-measurement at most (see :meth:`Actions._recheck`).
RECHECK_PASSES = 3
DEFAULT_PROFILE_STEPS = 5


class _Peer(Protocol):
    """A connection the hub can send frames to (its ``_Conn``)."""

    closing: bool

    def send(self, kind: str, payload: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class ActionError(ValueError):
    """A control request that cannot be carried out; the message says why."""


@dataclass
class Action:
    """One action in flight."""

    id: str
    client_id: Any
    action: str
    requester: _Peer
    targets: Mapping[int, _Peer]
    deadline: float
    args: dict[str, Any]
    at_step: int | None = None
    sync: bool = False
    started: float = field(default_factory=time.monotonic)
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    ready: set[int] = field(default_factory=set)
    first_ready: float | None = None
    go_sent: bool = False
    cancelled: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: a probe's re-measurement of its slow links: the probe it re-measures
    first: Action | None = None
    #: the deadline is the requester's (else one the hub picked)
    timeout_given: bool = False
    #: a probe's answers merged with its re-measurements so far
    measured: dict[int, dict[str, Any]] | None = None
    #: a probe's re-measurement: ``{"links", "passes", "seconds", "error"}``
    recheck: dict[str, Any] | None = None

    def pending(self) -> list[int]:
        """Targets that have neither answered nor failed."""
        return sorted(r for r in self.targets if r not in self.answers and r not in self.errors)


class Actions:
    """The actions a hub runs (see the module doc). Called on the hub's event loop."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.running: dict[str, Action] = {}
        self.counters = {"actions": 0, "action_errors": 0, "bad_answers": 0,
                         "stray_answers": 0}

    @staticmethod
    def _new_id() -> str:
        """An action's id: unguessable, so no connection can answer for an action it
        was not sent (its rank's answers are matched by connection too)."""
        return "a" + secrets.token_urlsafe(12)

    def _tell(self, peer: _Peer, kind: str, payload: dict[str, Any]) -> bool:
        """Send one frame to one peer; a failure (a frame too big, a broken transport)
        costs that peer alone: it is logged and that connection closed. True if sent."""
        if peer.closing:
            return False
        try:
            peer.send(kind, payload)
            return True
        except Exception as exc:
            log.warning("rtop hub: could not send a %s frame to a peer (%s); closing that "
                        "connection", kind, safe_text(repr(exc), 200))
            try:
                peer.close()
            except Exception:
                log.exception("rtop hub: closing a peer failed")
            return False

    # ---- requests from a control peer ----------------------------------------------

    def request(self, peer: _Peer, payload: dict[str, Any]) -> None:
        """A control peer's ``control`` frame."""
        client_id = payload.get("id")
        if not isinstance(client_id, (str, int)) or isinstance(client_id, bool) \
                or (isinstance(client_id, str) and len(client_id) > 64):
            client_id = None
        try:
            action = self._start(peer, client_id, payload)
        except ActionError as exc:
            self.counters["action_errors"] += 1
            self._tell(peer, wire.KIND_RESULT, {"id": client_id, "state": "refused",
                                         "error": str(exc)})
            return
        self.counters["actions"] += 1
        self._tell(peer, wire.KIND_RESULT, {"id": client_id, "state": "started",
                                     "action": action.action, "ranks": sorted(action.targets),
                                     "at_step": action.at_step, "timeout_s":
                                     round(action.deadline - time.monotonic(), 1),
                                     **action.info})
        log.info("rtop hub: %s on ranks %s%s", action.action, fmt_ranks(sorted(action.targets)),
                 f" from step {action.at_step}" if action.at_step is not None else "")

    def _start(self, peer: _Peer, client_id: Any, p: dict[str, Any]) -> Action:
        name = p.get("action")
        if name not in ACTIONS:
            raise ActionError(f"unknown action {safe_text(str(name))[:40]!r} "
                              f"(one of {', '.join(ACTIONS)})")
        args = p.get("args") or {}
        if not isinstance(args, dict):
            raise ActionError("args must be a map")
        conns = self.hub.rank_connections()
        if not conns:
            raise ActionError("no rank is connected to this hub")
        wanted = p.get("ranks")
        if name == "probe":
            if wanted is not None:
                raise ActionError("a probe runs on every rank of the job (no ranks)")
            targets = conns
        elif wanted is None:
            targets = conns
        else:
            if not isinstance(wanted, list) or not wanted or len(wanted) > 1 << 20 or \
                    not all(isinstance(r, int) and not isinstance(r, bool) for r in wanted):
                raise ActionError("ranks must be a non-empty list of rank numbers")
            absent = sorted(set(wanted) - set(conns))
            if absent:
                raise ActionError(f"rank{'s' if len(absent) > 1 else ''} "
                                  f"{fmt_ranks(absent)} not connected to this hub")
            targets = {r: conns[r] for r in sorted(set(wanted))}
        if name != "stacks" and any(a.action != "stacks" for a in self.running.values()):
            raise ActionError("another profile or probe is running; try again when it ends")
        timeout = p.get("timeout_s")
        if timeout is not None and (not isinstance(timeout, (int, float))
                                    or isinstance(timeout, bool)
                                    or not 0 < timeout <= MAX_TIMEOUT_S):
            raise ActionError(f"timeout_s must be a number of seconds up to {MAX_TIMEOUT_S:.0f}")
        aid = self._new_id()
        now = time.monotonic()
        if name == "stacks":
            act = Action(aid, client_id, name, peer, targets,
                         now + float(timeout or STACKS_TIMEOUT_S), {})
            self.running[aid] = act
            for conn in targets.values():
                self._tell(conn, wire.KIND_CONTROL, {"id": aid, "action": "stacks"})
            return act
        step_s = self.hub.step_seconds(targets)
        at_step = common_step([self.hub.last_step(r) for r in targets], step_s)
        lead_s = (at_step - max(self.hub.last_step(r) for r in targets)) * (step_s or 0.0)
        if name == "profile":
            steps = args.get("steps", DEFAULT_PROFILE_STEPS)
            if not isinstance(steps, int) or isinstance(steps, bool) \
                    or not 1 <= steps <= MAX_PROFILE_STEPS:
                raise ActionError(f"steps must be 1 to {MAX_PROFILE_STEPS}")
            out = args.get("dir")
            if out is not None and (not isinstance(out, str) or not out or len(out) > 4096
                                    or "\x00" in out):
                raise ActionError("dir must be a path")
            out_dir = out or self.hub.profile_dir()
            auto = 60.0 + lead_s + 3 * steps * (step_s or 1.0)
            act = Action(aid, client_id, name, peer, targets,
                         now + float(timeout or auto), {"dir": out_dir, "steps": steps},
                         at_step=at_step, info={"dir": out_dir, "steps": steps})
            self.running[aid] = act
            for conn in targets.values():
                self._tell(conn, wire.KIND_CONTROL, {"id": aid, "action": "profile",
                                              "at_step": at_step, "args": act.args})
            return act
        # probe: every rank of the job, synchronised
        from collectors.linkprobe import plan

        nbytes = args.get("bytes", DEFAULT_PROBE_BYTES)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) \
                or not MIN_PROBE_BYTES <= nbytes <= MAX_PROBE_BYTES:
            raise ActionError(f"bytes must be {MIN_PROBE_BYTES} to {MAX_PROBE_BYTES}")
        world = self.hub.world_size()
        ranks = sorted(targets)
        too_much = self.hub.probe_refusal(nbytes, ranks)
        if too_much is not None:
            raise ActionError(too_much)
        if world is not None and ranks != list(range(world)):
            missing = sorted(set(range(world)) - set(ranks))
            raise ActionError(f"a probe needs every rank of the job connected; "
                              f"rank{'s' if len(missing) > 1 else ''} {fmt_ranks(missing)} "
                              f"{'are' if len(missing) > 1 else 'is'} not")
        nodes = [self.hub.node_of(r) for r in ranks]
        rounds = [[(ranks[a], ranks[b]) for a, b in rnd] for rnd in plan(nodes)]
        return self._probe(aid, client_id, peer, targets, rounds, nbytes, PROBE_REPS,
                           at_step, lead_s, float(timeout) if timeout else None,
                           {"bytes": nbytes, "rounds": len(rounds), "nodes": nodes})

    def _probe(self, aid: str, client_id: Any, peer: _Peer, targets: Mapping[int, _Peer],
               rounds: list[list[tuple[int, int]]], nbytes: int, reps: int, at_step: int,
               lead_s: float, timeout: float | None, info: dict[str, Any],
               first: Action | None = None) -> Action:
        """Arm a probe of ``rounds`` (pairs of ranks) on ``targets`` at ``at_step``: each
        rank gets its own pairs, numbered by round."""
        per_rank: dict[int, list[list[int]]] = {r: [] for r in targets}
        for i, pairs in enumerate(rounds):
            for ra, rb in pairs:
                per_rank[ra].append([i, ra, rb])
                per_rank[rb].append([i, ra, rb])
        per_transfer = 0.05 + nbytes / 50e6  # even at 50 MB/s
        transfer_timeout = max(10.0, 4 * per_transfer * reps)
        auto = 30.0 + lead_s + WAIT_FOR_GO_S + len(rounds) * reps * 2 * per_transfer * 4
        act = Action(aid, client_id, "probe", peer, targets,
                     time.monotonic() + (timeout or auto),
                     {"bytes": nbytes, "rounds": len(rounds), "reps": reps,
                      "timeout_s": transfer_timeout},
                     at_step=at_step, sync=True, info=info, first=first,
                     timeout_given=timeout is not None)
        self.running[aid] = act
        for r, conn in targets.items():
            self._tell(conn, wire.KIND_CONTROL, {"id": aid, "action": "probe", "at_step": at_step,
                                          "wait_s": WAIT_FOR_GO_S,
                                          "args": {**act.args, "pairs": per_rank[r]}})
        return act

    def _recheck(self, act: Action) -> bool:
        """After a probe that ran everywhere and found slow links, or after a pass of
        their re-measurement, re-measure the slow links not measured twice yet (a short
        probe of their ranks only, a few steps on; see "Measured twice" in
        :mod:`rtop.analysis.links`). A link re-measured faster raises the reference of
        the others, so another may turn slow: up to :data:`RECHECK_PASSES` passes, a
        further one only if the last found a link healthy the second time (a slow node's
        links beyond :data:`~rtop.analysis.links.MAX_RECHECK_LINKS`, all slow again,
        are not worth another pass). True
        if a pass started: the requester hears when the last one ends. Within a
        deadline the requester gave, only with time left for it."""
        from collectors.linkprobe import schedule
        from rtop.analysis.links import assemble, merge_answers, recheck_pairs

        first = act.first or act
        if act.first is None:
            if act.cancelled or act.errors or act.pending():
                return False
            first.measured = dict(act.answers)
            first.recheck = {"links": [], "unmeasured": [], "passes": 0, "seconds": 0.0,
                             "error": None}
        rc = first.recheck
        assert rc is not None and first.measured is not None
        if act.first is not None:  # a pass ended
            rc["passes"] += 1
            rc["seconds"] = round(rc["seconds"] + time.monotonic() - act.started, 3)
            rc["error"] = _failure(act)
            if rc["error"] is not None:  # its links keep their first figures
                rc["unmeasured"] += act.info["links"]
                return False
            first.measured = merge_answers(first.measured, act.answers)
        if first.requester.closing:
            return False
        result = assemble(sorted(first.targets), first.info["nodes"], first.measured)
        cfg = self.hub.analysis_config()
        if act.first is not None:
            still = set(recheck_pairs(result, cfg, limit=len(first.targets) ** 2))
            if all(tuple(p) in still for p in act.info["links"]):
                return False  # every link re-measured is slow again: nothing moved
        done = {tuple(x) for x in rc["links"]}
        pairs = [p for p in recheck_pairs(result, cfg) if p not in done]
        if not pairs or rc["passes"] >= RECHECK_PASSES:
            return False
        involved = sorted({r for pair in pairs for r in pair})
        conns = self.hub.rank_connections()
        lost = [r for r in involved if r not in conns]
        if lost:
            rc["error"] = f"rank{'s' if len(lost) > 1 else ''} {fmt_ranks(lost)} left"
            rc["links"] += [list(p) for p in pairs]
            rc["unmeasured"] += [list(p) for p in pairs]
            return False
        targets = {r: conns[r] for r in involved}
        step_s = self.hub.step_seconds(targets)
        at_step = common_step([self.hub.last_step(r) for r in targets], step_s)
        lead_s = (at_step - max(self.hub.last_step(r) for r in targets)) * (step_s or 0.0)
        timeout = None
        if first.timeout_given:
            timeout = first.deadline - time.monotonic()
            if timeout < lead_s + WAIT_FOR_GO_S:
                rc["error"] = "no time was left within the deadline to re-measure"
                rc["links"] += [list(p) for p in pairs]
                rc["unmeasured"] += [list(p) for p in pairs]
                return False
        rc["links"] += [list(p) for p in pairs]
        aid = self._new_id()
        again = self._probe(aid, first.client_id, first.requester, targets, schedule(pairs),
                            int(first.args["bytes"]), RECHECK_REPS, at_step, lead_s,
                            timeout, {"links": [list(p) for p in pairs]}, first=first)
        self._tell(first.requester, wire.KIND_RESULT, {
            "id": first.client_id, "state": "started", "action": "probe", "recheck": True,
            "ranks": involved, "at_step": at_step, "links": len(pairs),
            "timeout_s": round(again.deadline - time.monotonic(), 1)})
        log.info("rtop hub: probe: re-measuring %d slow link%s on ranks %s from step %d",
                 len(pairs), "s" if len(pairs) > 1 else "", fmt_ranks(involved), at_step)
        return True

    # ---- answers from ranks --------------------------------------------------------

    def result(self, conn: _Peer, rank: int, payload: dict[str, Any], size: int = 0) -> None:
        """A ``result`` frame (``size`` bytes) that came on ``conn``, the connection of
        ``rank``.

        It counts only for an action the hub sent on that very connection (an answer
        for another rank's action, or on another connection claiming the rank, is
        counted in ``stray_answers`` and dropped); its fields are checked and bounded
        (:func:`rtop.hub.answers.clean_result`; over
        :data:`~rtop.hub.answers.MAX_RESULT_BYTES` it is not read): a malformed answer
        is an error for that rank alone, and its connection stays up."""
        aid = payload.get("id")
        act = self.running.get(aid) if isinstance(aid, str) else None
        if act is None or act.targets.get(rank) is not conn:
            self.counters["stray_answers"] += 1
            return
        try:
            if size > MAX_RESULT_BYTES:
                raise BadAnswer(f"{size} bytes, at most {MAX_RESULT_BYTES}")
            state, body = clean_result(act.action, payload)
        except BadAnswer as exc:
            self.counters["bad_answers"] += 1
            state, body = "error", {"error": f"its answer was malformed ({exc})"}
        if rank in act.answers or rank in act.errors:
            return  # answered already: a second answer changes nothing
        if state == "ready" and act.sync:
            act.ready.add(rank)
            if act.first_ready is None:
                act.first_ready = time.monotonic()
            if act.ready >= set(act.targets) and not act.go_sent and act.cancelled is None:
                act.go_sent = True
                for target in act.targets.values():
                    self._tell(target, wire.KIND_CONTROL, {"id": act.id, "action": "go"})
        elif state == "late":
            step = body["step"]
            self._cancel(act, f"rank {rank} was past step {act.at_step} when the probe "
                              f"reached it (at step {'?' if step is None else step}); "
                              f"nothing ran")
        elif state == "error":
            act.errors[rank] = body["error"]
            if act.sync and not act.go_sent:
                self._cancel(act, f"rank {rank} could not take part: {act.errors[rank]}")
        elif state == "done":
            body["rank"] = rank
            act.answers[rank] = body
        if not act.pending():
            self._finish(act)

    def rank_lost(self, conn: _Peer, rank: int) -> None:
        """A rank's connection closed: it will not answer the actions sent on it."""
        for act in list(self.running.values()):
            if act.targets.get(rank) is conn and rank not in act.answers \
                    and rank not in act.errors:
                act.errors[rank] = "the rank's connection closed during the action"
                if act.sync and not act.go_sent:
                    self._cancel(act, f"rank {rank} left before the probe started")
                if not act.pending():
                    self._finish(act)

    def peer_lost(self, peer: _Peer) -> None:
        """The control peer left: its actions are cancelled (a running capture still
        ends at its own step and writes its traces)."""
        for act in list(self.running.values()):
            if act.requester is peer:
                self._cancel(act, "the control peer that asked left")
                self.running.pop(act.id, None)

    def tick(self, now: float) -> None:
        """Deadlines and the go window (called by the hub's housekeeping)."""
        for act in list(self.running.values()):
            if act.sync and not act.go_sent and act.cancelled is None \
                    and act.first_ready is not None and now - act.first_ready > GO_WINDOW_S:
                waiting = sorted(set(act.targets) - act.ready)
                self._cancel(act, f"rank{'s' if len(waiting) > 1 else ''} "
                                  f"{fmt_ranks(waiting)} did not reach step {act.at_step} "
                                  f"within {GO_WINDOW_S:.0f} s of the others")
            if now >= act.deadline:
                if act.sync and not act.go_sent and act.cancelled is None:
                    self._cancel(act, "the deadline passed before every rank was ready")
                self._finish(act, timed_out=True)

    def close(self) -> None:
        """The hub is closing: cancel everything."""
        for act in list(self.running.values()):
            self._cancel(act, "the hub is closing")
            self._finish(act)

    # ---- internals -----------------------------------------------------------------

    def _cancel(self, act: Action, why: str) -> None:
        if act.cancelled is not None:
            return
        act.cancelled = why
        if act.action != "stacks":
            for conn in act.targets.values():
                self._tell(conn, wire.KIND_CONTROL, {"id": act.id, "action": "cancel", "why": why})
        if act.sync and not act.go_sent:
            for r in act.pending():
                act.errors.setdefault(r, "cancelled: " + why)
            self._finish(act)

    def _finish(self, act: Action, timed_out: bool = False) -> None:
        if self.running.pop(act.id, None) is None:
            return
        if act.action == "probe" and (act.go_sent or act.first is not None) \
                and self._recheck(act):
            return  # the requester hears when the re-measurement ends
        first = act.first or act  # what the requester asked for
        missing = first.pending()
        answers = [first.answers[r] for r in sorted(first.answers)]
        out: dict[str, Any] = {
            "id": first.client_id, "action": first.action, "state": "done",
            "ranks": sorted(first.targets), "at_step": first.at_step,
            "answers": answers,
            "errors": [{"rank": r, "error": e} for r, e in sorted(first.errors.items())],
            "missing": missing, "cancelled": first.cancelled,
            "seconds": round(time.monotonic() - first.started, 3), **first.info,
        }
        if first.action == "probe" and first.go_sent:
            out["links"] = self.probe_done(
                sorted(first.targets), first.info["nodes"],
                first.measured if first.measured is not None else first.answers,
                first.recheck if first.recheck and first.recheck["links"] else None)
        if missing:
            log.warning("rtop hub: %s: rank%s %s did not answer within the deadline",
                        act.action, "s" if len(missing) > 1 else "", fmt_ranks(missing))
        self._answer(act.requester, out)

    def probe_done(self, ranks: list[int], nodes: list[str],
                   answers: Mapping[int, Mapping[str, Any]],
                   recheck: dict[str, Any] | None = None) -> dict[str, Any]:
        """A finished probe's answers: the link matrix and its findings, which the hub
        keeps in the run's state (the fabric view, the slow_link detector) and records
        (:meth:`rtop.hub.server.Hub.keep_links`). With ``recheck`` (the probe's
        re-measurement of the links it first found slow: ``{"links": [[rank, rank],
        ...], "unmeasured": [...], "error", ...}``), the answers are already merged with
        it, and the result says how many of the links measured twice are still slow
        (``recheck["confirmed"]``)."""
        from rtop.analysis.links import assemble, recheck_pairs, slow_links

        result = assemble(ranks, nodes, answers)
        cfg = self.hub.analysis_config()
        result["findings"] = slow_links(result, cfg)
        if recheck is not None:
            still = set(recheck_pairs(result, cfg, limit=len(ranks) ** 2))
            once = {(min(a, b), max(a, b)) for a, b in recheck.get("unmeasured") or ()}
            recheck["confirmed"] = sum(1 for a, b in recheck.get("links") or ()
                                       if (min(a, b), max(a, b)) not in once
                                       and ((a, b) in still or (b, a) in still))
            result["recheck"] = recheck
        self.hub.keep_links(result)
        return result

    def _answer(self, requester: _Peer, out: dict[str, Any]) -> None:
        """Send the requester its answer. One too big for a frame keeps the answers of
        the ranks that fit (in rank order) and says which were left out, as errors."""
        try:
            wire.encode(wire.KIND_RESULT, out)
        except wire.FrameTooLarge:
            answers, kept, room = out["answers"], [], wire.MAX_FRAME_BYTES // 2
            for a in answers:
                size = len(wire.encode(wire.KIND_RESULT, a))
                if size > room:
                    break
                kept.append(a)
                room -= size
            left = [a["rank"] for a in answers[len(kept):]]
            out = {**out, "answers": kept, "errors": [*out["errors"], *(
                {"rank": r, "error": "its answer was left out: all the answers together "
                                     "would not fit one frame (ask fewer ranks)"}
                for r in left)]}
            log.warning("rtop hub: %s: the answers of %d rank(s) were left out to fit one "
                        "frame", out.get("action"), len(left))
        self._tell(requester, wire.KIND_RESULT, out)


def _failure(act: Action) -> str | None:
    """Why an action did not run everywhere (None: every target answered)."""
    if act.cancelled:
        return safe_text(act.cancelled)[:300]
    if act.errors:
        return "; ".join(f"rank {r}: {e}" for r, e in sorted(act.errors.items()))[:300]
    if act.pending():
        pending = act.pending()
        return (f"rank{'s' if len(pending) > 1 else ''} {fmt_ranks(pending)} did not answer "
                "within the deadline")
    return None


def common_step(last_steps: list[int], step_s: float | None) -> int:
    """The step every rank starts an action at: :data:`LEAD_S` of steps (at least
    :data:`LEAD_STEPS`) after the furthest rank's last reported step."""
    furthest = max(last_steps) if last_steps else -1
    lead = LEAD_STEPS
    if step_s is not None and step_s > 0 and math.isfinite(step_s):
        lead = max(lead, math.ceil(LEAD_S / step_s))
    return max(0, furthest + 1) + lead


def default_profile_dir(record: Path | None, job: str) -> str:
    """Where traces go by default: a folder beside the run's recording (``RUN.rtop`` →
    ``RUN.profiles/<time>``), else under the runs directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if record is not None:
        return str(record.with_suffix(".profiles") / stamp)
    from rtop.hub.recorder import default_record_path

    return str(default_record_path(job or "job").with_suffix(".profiles") / stamp)
