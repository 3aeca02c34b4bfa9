"""A rank's side of the control channel: the actions a hub asks of it.

Control frames come only from a hub that has proved it holds the token
(:mod:`collectors.auth`) and welcomed this rank; :class:`HubConnection` hands them to
:meth:`Control.on_control` on the sender thread. Each names an ``action`` and an ``id``:

* ``stacks``: every thread's Python stack, taken at once on the sender thread (so a rank
  whose training thread hangs still answers);
* ``profile``: ``torch.profiler`` over ``steps`` steps (:mod:`collectors.profiler`);
* ``probe``: point-to-point transfers with the rank's peers (:mod:`collectors.linkprobe`);
* ``go`` / ``cancel``: the hub's word on an action already armed.

Profile and probe need the training thread: they are **armed** (:class:`Armed`) and the
training thread runs them at its step boundaries from step ``at_step`` on (the hub picks
a step in the near future, the same for every rank). A probe must start at the same
boundary on every rank, or its transfers would wait for peers that are busy in the
job's own collectives; so it is **synchronised**: at boundary ``at_step`` each rank says
``ready`` and waits (at most ``wait_s``) for the hub's ``go``, which the hub sends only
once every rank is ready. A rank that is already past ``at_step`` says ``late``, and the
hub cancels the probe everywhere: nobody runs it, nobody waits for long. A rank refuses
(``error``, when it is armed) a probe whose buffers it cannot afford
(:func:`collectors.linkprobe.affordable`), and the hub cancels that one everywhere too.

Answers go back as ``result`` frames (``state``: ready, late, done, error), queued from
any thread and written by the sender thread. Nothing here raises into the job: a
failing action answers with its error and the job goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from collectors import wire

if TYPE_CHECKING:
    from collectors.probe import Probe

log = logging.getLogger("collectors")

#: Actions a rank knows.
ACTIONS = ("stacks", "profile", "probe", "go", "cancel")
#: The most a synchronised action waits at its step for the hub's go (seconds).
WAIT_FOR_GO_S = 10.0
#: Bounds on what a hub may ask (a hub that proved itself is trusted, not unbounded).
#: Steps of a profile: a trace of a few steps is what is read (torch-tb-profiler and HTA
#: look at 3 to 10), and every step's events cost the rank memory and the training
#: thread time at the end (``collectors.profiler``, "Bounded"), which a capture also
#: bounds by what it grows; 100 steps leave room for a slow or irregular step to be
#: caught among many.
MAX_PROFILE_STEPS = 100
#: Bytes per transfer of a link probe: 1 GiB takes about 2 ms on a 450 GB/s NVLink, so
#: no link needs more to show its bandwidth rather than its latency; what a rank can
#: afford of it is checked against its free memory (``collectors.linkprobe.affordable``).
MAX_PROBE_BYTES = 1 << 30
MAX_ARMED = 4
#: Characters of an error message sent back.
ERROR_CHARS = 300


class TrainingAction(Protocol):
    """An action run by the training thread at step boundaries (profile, probe)."""

    def at_boundary(self, step: int) -> bool:
        """Called at each boundary from the start step on; True once finished."""

    def abort(self, why: str) -> None:
        """Stop (the rank closes or the hub cancelled); answer with ``why`` if not done."""


class AnswerOnce:
    """How a training action (a profile, a link probe) hands its answer over: once, the
    first of its result and an abort's error, from whichever thread comes first; a
    failure to hand it over is logged, never raised."""

    def __init__(self, on_done: Callable[[dict[str, Any]], None], what: str) -> None:
        self._on_done = on_done
        self._what = what
        self._lock = threading.Lock()
        self._given = False

    @property
    def given(self) -> bool:
        """Whether the answer was handed over (or is being)."""
        return self._given

    def __call__(self, answer: dict[str, Any]) -> None:
        """Hand ``answer`` over, unless an answer was already."""
        with self._lock:
            if self._given:
                return
            self._given = True
        try:
            self._on_done(answer)
        except Exception:
            log.warning("rtop: %s could not be handed over", self._what, exc_info=True)


class Armed:
    """A training-thread action waiting for (or running from) step ``at_step``."""

    def __init__(self, control: Control, action_id: str, name: str,
                 action: TrainingAction, at_step: int, sync: bool, wait_s: float) -> None:
        self.control = control
        self.id = action_id
        self.name = name
        self.action = action
        self.at_step = at_step
        self.sync = sync
        self.wait_s = wait_s
        self.go = threading.Event()
        self.cancelled: str | None = None
        self.started = False
        self.finished = False

    def at_boundary(self, step: int) -> bool:
        """The training thread's call at a step boundary; True when this is done."""
        if self.cancelled is not None:
            self._abort(self.cancelled)
            return True
        if step < self.at_step:
            return False
        if not self.started:
            if self.sync:
                if step != self.at_step:
                    self.control.answer(self.id, "late", {"step": step})
                    self.finished = True
                    return True
                self.control.answer(self.id, "ready", {"step": step})
                got = self.go.wait(self.wait_s)
                if self.cancelled is not None or not got:
                    why = self.cancelled or (f"no go from the hub within {self.wait_s:.0f} "
                                             f"s at step {step}")
                    self._abort(why)
                    return True
            self.started = True
        try:
            done = self.action.at_boundary(step)
        except Exception as exc:  # an action's bug costs the action, not the job
            self._abort(f"{type(exc).__name__}: {exc}")
            return True
        if done:
            self.finished = True
        return done

    def cancel(self, why: str) -> None:
        """The hub's cancel (any thread): a waiting rank goes on at once."""
        self.cancelled = why
        self.go.set()

    def _abort(self, why: str) -> None:
        self.finished = True
        try:
            self.action.abort(why)
        except Exception as exc:
            self.control.answer(self.id, "error", {"error": f"{why}; and aborting "
                                                            f"failed: {exc!r}"})


class Control:
    """Dispatches a hub's control frames for one probe (see the module doc).

    ``on_control`` runs on the sender thread; :meth:`answer` may be called from any
    thread; :meth:`flush` (sender thread) hands queued answers to the connection.
    """

    def __init__(self, probe: Probe, wake: Callable[[], None]) -> None:
        self._p = probe
        self._wake = wake
        self._out: deque[dict[str, Any]] = deque(maxlen=256)
        self._armed: dict[str, Armed] = {}

    # ---- sender thread -------------------------------------------------------------

    def on_control(self, frame: wire.Frame) -> None:
        """A control frame from the hub (sender thread). Never raises."""
        p = frame.payload
        action_id, action = p.get("id"), p.get("action")
        if not isinstance(action_id, str) or len(action_id) > 64:
            log.debug("rtop: a control frame without a usable id was ignored")
            return
        try:
            if action == "stacks":
                self._stacks(action_id)
            elif action in ("profile", "probe"):
                self._arm(action_id, str(action), p)
            elif action == "go":
                armed = self._armed.get(action_id)
                if armed is not None:
                    armed.go.set()
            elif action == "cancel":
                armed = self._armed.pop(action_id, None)
                if armed is not None:
                    why = p.get("why")
                    armed.cancel(str(why)[:ERROR_CHARS] if why else "cancelled by the hub")
            else:
                self.answer(action_id, "error",
                            {"error": f"this rank knows no action {str(action)[:40]!r}"})
        except Exception as exc:
            self.answer(action_id, "error", {"error": f"{type(exc).__name__}: {exc}"})

    def flush(self, send: Callable[[str, dict[str, Any]], None]) -> None:
        """Queue every pending answer on the connection (sender thread)."""
        while self._out:
            send(wire.KIND_RESULT, self._out.popleft())
        for key in [k for k, a in self._armed.items() if a.finished]:
            del self._armed[key]

    def close(self, why: str = "the rank is closing") -> None:
        """Abort every armed action (the probe is closing)."""
        for armed in list(self._armed.values()):
            if armed.finished:
                continue
            armed.cancel(why)
            if armed.started:
                armed._abort(why)  # the action answers with the reason
            else:
                armed.finished = True
                self.answer(armed.id, "error", {"error": why})

    # ---- any thread ----------------------------------------------------------------

    def answer(self, action_id: str, state: str, payload: dict[str, Any] | None = None
               ) -> None:
        """Queue a ``result`` frame for the hub and wake the sender."""
        body: dict[str, Any] = dict(payload or {})
        error = body.get("error")
        if isinstance(error, str) and len(error) > ERROR_CHARS:
            body["error"] = error[:ERROR_CHARS] + "..."
        if state == "done" and body.get("error"):
            state = "error"
        body.update(id=action_id, state=state, rank=self._p.identity.rank,
                    t_wall=time.time())
        self._out.append(body)
        with contextlib.suppress(Exception):
            self._wake()

    # ---- actions -------------------------------------------------------------------

    def _stacks(self, action_id: str) -> None:
        from collectors.stacks import stacks_answer

        answer = stacks_answer(self._p.identity.rank,
                               training_ident=self._p.activity.thread_id)
        self.answer(action_id, "done", answer)

    def _arm(self, action_id: str, name: str, p: dict[str, Any]) -> None:
        if action_id in self._armed:
            return  # the same frame twice
        if len(self._armed) >= MAX_ARMED:
            raise RuntimeError("too many actions armed on this rank")
        at_step = p.get("at_step")
        args = p.get("args")
        if not isinstance(at_step, int) or isinstance(at_step, bool) \
                or not isinstance(args, dict):
            raise ValueError("a profile or probe needs an integer at_step and args")
        on_done = self._done(action_id)
        if name == "profile":
            action = self._profile(args, on_done)
            sync = False
        else:
            action = self._probe(action_id, args, on_done)
            sync = True
        wait_s = p.get("wait_s", WAIT_FOR_GO_S)
        if not isinstance(wait_s, (int, float)) or not 0 < wait_s <= 60:
            wait_s = WAIT_FOR_GO_S
        armed = Armed(self, action_id, name, action, at_step, sync, float(wait_s))
        self._armed[action_id] = armed
        self._p.arm(armed)
        self.answer(action_id, "armed", {"step": self._p.step_count})

    def _done(self, action_id: str) -> Callable[[dict[str, Any]], None]:
        def on_done(answer: dict[str, Any]) -> None:
            self.answer(action_id, "error" if answer.get("error") else "done", answer)
        return on_done

    def _profile(self, args: dict[str, Any], on_done: Callable[[dict[str, Any]], None]
                 ) -> TrainingAction:
        from collectors.profiler import ProfileCapture

        out_dir, steps = args.get("dir"), args.get("steps")
        if not isinstance(out_dir, str) or not out_dir or len(out_dir) > 4096:
            raise ValueError("a profile needs a directory")
        if not isinstance(steps, int) or isinstance(steps, bool) \
                or not 1 <= steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"a profile needs 1 to {MAX_PROFILE_STEPS} steps")
        rank = self._p.identity.rank
        # started and stopped with the model's GPU current (not GPU 0 of a job that never
        # calls set_device: collectors.profiler, "The model's GPU")
        return ProfileCapture(out_dir, f"rank{rank}", steps, rank, on_done,
                              device=self._p.model_device())

    def _probe(self, action_id: str, args: dict[str, Any],
               on_done: Callable[[dict[str, Any]], None]) -> TrainingAction:
        from collectors.linkprobe import LinkProbe, check_affordable

        nbytes, pairs = args.get("bytes"), args.get("pairs")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) \
                or not 1 <= nbytes <= MAX_PROBE_BYTES:
            raise ValueError(f"a probe needs 1 to {MAX_PROBE_BYTES} bytes")
        if not isinstance(pairs, list):
            raise ValueError("a probe needs this rank's pairs")
        rank = self._p.identity.rank
        n_rounds = args.get("rounds")
        if not isinstance(n_rounds, int) or not 0 <= n_rounds <= 100_000:
            raise ValueError("a probe needs its number of rounds")
        rounds: list[list[tuple[int, int]]] = [[] for _ in range(n_rounds)]
        for item in pairs:
            if not (isinstance(item, list) and len(item) == 3
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
                raise ValueError("a probe pair is [round, rank, rank]")
            r, a, b = item
            if not 0 <= r < n_rounds or rank not in (a, b):
                raise ValueError("a probe pair must be this rank's, in a known round")
            rounds[r].append((a, b))
        reps = args.get("reps", 3)
        timeout_s = args.get("timeout_s", 30.0)
        if not isinstance(reps, int) or not 1 <= reps <= 20:
            reps = 3
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            timeout_s = 30.0
        device = None
        if any(rounds):  # this rank allocates buffers: refused here if it cannot afford them
            device, sharing = self._probe_device()
            check_affordable(nbytes, device, sharing=sharing,
                             share=self._p.config.probe_memory_share)
        # the same message tags and store keys on every rank (from the hub's action id),
        # so nothing a failed probe left behind can be taken for this one's
        return LinkProbe(rank, rounds, nbytes, on_done, reps=reps, device=device,
                         timeout_s=float(timeout_s), probe_id=zlib.crc32(action_id.encode()))

    def _probe_device(self) -> tuple[Any, int]:
        """The device a probe allocates its buffers on and sends from, handed to the
        :class:`~collectors.linkprobe.LinkProbe`: under NCCL, the GPU the model lives on
        (:func:`collectors.linkprobe.cuda_probe_index`: never ``cuda:0`` merely because
        that is current in a job that never calls ``set_device``; refused when it
        cannot be told), else the CPU; and how many ranks allocate from that same memory
        at once (this node's ranks, ``LOCAL_WORLD_SIZE``, for host memory; 1 for a
        GPU)."""
        import torch
        import torch.distributed as dist

        from collectors.cuda_events import cuda_module
        from collectors.linkprobe import cuda_probe_index

        backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() \
            else ""
        cuda = cuda_module()
        if "nccl" in backend.lower() and cuda.is_available():
            p = self._p
            model = p.cuda.device if p.cuda is not None else None
            if model is None and p.memory.device.startswith("cuda:"):
                model = int(p.memory.device.split(":")[1])
            bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id",
                            None)
            index = cuda_probe_index(
                model=model, bound=None if bound is None else bound.index,
                devices=int(cuda.device_count()), thread=p.cuda_device,
                local_rank=os.environ.get("LOCAL_RANK"))
            return torch.device("cuda", index), 1
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        return torch.device("cpu"), int(local) if local.isdigit() and int(local) > 0 else 1
