"""The link probe: point-to-point bandwidth between ranks, over the job's own process
group, so it measures the path the job's collectives take.

:func:`plan` schedules the pairs in rounds; :class:`LinkProbe` is the training-thread
action that runs them on one rank. The hub collects every rank's answer and puts the
matrix together (``rtop.analysis.links.assemble``).

**Rounds.** Pairs are scheduled round-robin (the circle method), so each rank is in one
transfer at a time:

* up to ``flat_limit`` ranks (64), every pair: ``n - 1`` rounds for an even ``n``, ``n``
  for an odd one;
* beyond that, one representative rank per node (its lowest) is measured against every
  other node's, and every pair within each node is measured, all nodes at once:
  ``(nodes - 1) + (ranks per node - 1)`` rounds (one more for each count that is odd).
  1,024 ranks on 128 nodes of 8 take 127 + 7 = 134 rounds instead of 1,023, and
  12,000 transfers instead of 524,000.

Pairs of a round run at the same time; a node with several ranks may then carry several
inter-node transfers at once in a flat plan (one per GPU: fine where each GPU has its
own NIC, shared where the node has one). A rank goes through its own pairs in round
order without waiting for the round to end elsewhere: every pair of round ``k`` is
reached by both its ranks once their earlier pairs are done, so nothing deadlocks.

**One pair.** Both ranks first exchange a 1-byte token (is the peer there? it also
sets up the backend's connection, outside the timed part). Then each direction is
timed where the data arrives: the receiver posts a small "go" to the sender, starts its
clock, and stops it when ``nbytes`` have arrived; :data:`WARMUP` untimed rounds, then
``reps`` timed ones, the two directions taking turns. The figure is ``nbytes`` over the
fastest time: interference (other processes on the cores, other pairs on a shared NIC)
only ever slows a transfer, so the fastest is the link's own figure, while a slow link
is slow every time (on a loaded 2-core machine the median of 3 varied 3x between
healthy loopback links; more ``reps`` narrow it further). Timing at the sender would
measure how fast a socket buffer fills, not the link. The time includes one small
message's latency, negligible for ``nbytes`` of megabytes. Each rank answers the
direction it received (``[peer, Bps]`` from ``peer`` to it); the hub keeps the slower
of the two directions.

**Waits that end, and a job that goes on.** No wait lasts more than ``timeout_s``, and
none breaks the job's process group. Gloo cannot be trusted with a timeout: a
point-to-point wait that times out closes *every* connection of the process group
("Application timeout caused pair closure"), so the job's next collective fails; and
its ``is_completed()`` says nothing until ``wait()`` was called. So on CPU the probe
never waits on gloo for what may not come: what it sends is all ones, what it receives
lands in a tensor whose last byte it zeroed first, and the receiver polls that byte (TCP
delivers in order and gloo receives straight into the tensor); once it is one, the
receive is waited for (it has completed). A send is waited for only once the peer's
next message shows that it arrived: every message of a pair answers the ones before it,
and the pair ends with the last receiver's acknowledgement. A peer that died fails the
next transfer started to it at once (its connection is closed) or the one in flight at
the timeout; a peer that stopped (an error of its own) fails it at the timeout. NCCL's
``work.wait(timeout)`` first makes the *current CUDA stream* wait for the transfer's
stream and only then times out on the host: a transfer whose peer died would leave the
job's own stream blocked behind it. So on CUDA the probe polls ``work.is_completed()`` (a
query of the transfer's CUDA event) until it is done or the timeout passes, and calls
``wait()`` only on completed work. A transfer abandoned on an error is never waited for
and keeps its tensor referenced (a few, bounded), so a late arrival never lands in
memory the job reuses. On an error the rank answers ``{"rank", "error", "peer",
"round"}`` and stops; the job goes on (a peer that died then fails the job's own next
collective, on the job's terms). The probe holds two buffers of ``nbytes`` (one sent,
one received) while it runs.

**What a rank can afford.** Those buffers (:func:`probe_footprint`) come out of the
memory the job trains in: the GPU's for a CUDA probe, the host's for a CPU one (where
every rank of the node allocates its own at once). A rank refuses a probe whose buffers
would take more than :data:`REFUSE_SHARE` of the free memory where they go (all the
node's ranks' together, for host memory), and logs one warning beyond
:data:`WARN_SHARE`; :func:`affordable` says why, from figures alone, so the hub can
apply the same rule to a rank's last reported free memory before it asks.

On NCCL, the first transfer between two ranks may create a communicator for the pair
(a few hundred ms and some GPU memory) unless the job's process group was initialised
with a ``device_id``; the token exchange takes that cost, outside the timed transfers.

Everything here is imported without torch; torch is imported when a probe runs.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from itertools import count
from typing import Any, Final, NamedTuple

log = logging.getLogger("collectors")

Pair = tuple[int, int]
Rounds = list[list[Pair]]

#: Ranks up to which every pair is measured (beyond: by node, see the module doc).
FLAT_LIMIT: Final = 64
#: Bytes per timed transfer unless the caller says otherwise: large enough for a link's
#: bandwidth, not its latency, to set the time (8 MiB take 0.7 ms at 100 Gb/s).
DEFAULT_BYTES: Final = 8 << 20
#: Tags of the probe's messages: ``TAG_BASE + 4 * (probe id % TAG_IDS) + kind``, so a
#: message an earlier, failed probe left behind never matches a later probe's (gloo
#: matches by tag; NCCL ignores tags and matches in order).
TAG_BASE: Final = 0x7270  # "rp"
TAG_IDS: Final = 1 << 20
_SYNC, _GO, _DATA = 0, 1, 2
#: Untimed transfers each way before the timed ones (a fresh TCP connection's window
#: is still growing: the first megabytes are slower).
WARMUP: Final = 2
#: A rank refuses a probe whose buffers would take more than this share of the free
#: memory where they go (see "What a rank can afford" in the module doc): a probe
#: measures links, and must never be what pushes a job into swapping, the OOM killer or
#: a CUDA out-of-memory error. A quarter leaves the job three quarters of what it had
#: free for the few seconds the probe runs.
REFUSE_SHARE: Final = 0.25
#: ... and logs one warning beyond this share (the probe still runs).
WARN_SHARE: Final = 0.10
#: Transfers abandoned on an error, kept referenced with their buffers (see the doc).
_ABANDONED: deque[Any] = deque(maxlen=64)
_PROBES = count()  # this process's probes, in order: the default probe id
_SOURCE = re.compile(r"^\[[^\]]*\]\s*")  # gloo's "[.../pair.cc:553] " before its message


def circle(n: int) -> Rounds:
    """Round-robin pairs of ``0 .. n-1`` by the circle method: every pair exactly once,
    each index at most once per round; ``n - 1`` rounds for an even ``n``, ``n`` for an
    odd one (each index sits one round out), none below 2. Pairs are ``(low, high)``."""
    if n < 2:
        return []
    m = n + (n % 2)  # a dummy index (n) for odd n: whoever meets it sits out
    fixed = m - 1
    out: Rounds = []
    for r in range(m - 1):
        pairs = [(r, fixed)]
        for k in range(1, m // 2):
            pairs.append(((r + k) % (m - 1), (r - k) % (m - 1)))
        out.append(sorted((min(a, b), max(a, b)) for a, b in pairs if n not in (a, b)))
    return out


def plan(nodes: Sequence[str], flat_limit: int = FLAT_LIMIT) -> Rounds:
    """Rounds of disjoint pairs of ranks (indices into ``nodes``, which names each
    rank's node). Up to ``flat_limit`` ranks, every pair (:func:`circle`): ``n - 1``
    rounds. Beyond, one representative per node (its lowest rank) against every other
    node's, then every pair within each node, the nodes side by side:
    ``(nodes - 1) + (ranks per node - 1)`` rounds (for even counts; one more for each
    odd one)."""
    n = len(nodes)
    if n <= flat_limit:
        return circle(n)
    members: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        members.setdefault(node, []).append(i)
    groups = list(members.values())
    reps = [g[0] for g in groups]
    inter = [[_pair(reps[a], reps[b]) for a, b in rnd] for rnd in circle(len(reps))]
    within = [[[_pair(g[a], g[b]) for a, b in rnd] for rnd in circle(len(g))] for g in groups]
    depth = max((len(w) for w in within), default=0)
    intra = [sorted(p for w in within if r < len(w) for p in w[r]) for r in range(depth)]
    return inter + intra


def schedule(pairs: Sequence[Pair]) -> Rounds:
    """Rounds for a given list of pairs (the links a probe re-measures): each pair in
    the first round where neither of its ranks is busy yet, so each rank is in one
    transfer a round and, as in :func:`plan`, nothing deadlocks. Pairs are kept in the
    order given within the ranks' turns; duplicates and self-pairs are dropped."""
    out: Rounds = []
    busy: list[set[int]] = []
    seen: set[Pair] = set()
    for a, b in pairs:
        pair = _pair(a, b)
        if a == b or pair in seen:
            continue
        seen.add(pair)
        k = next((k for k, used in enumerate(busy) if a not in used and b not in used),
                 len(busy))
        if k == len(busy):
            out.append([])
            busy.append(set())
        out[k].append(pair)
        busy[k].update(pair)
    return [sorted(rnd) for rnd in out]


def _pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


def probe_footprint(nbytes: int) -> int:
    """Bytes a probe of ``nbytes`` per transfer allocates on one rank while it runs:
    the buffer it sends and the one it receives into, ``nbytes`` each, and two 1-byte
    tokens (see :meth:`LinkProbe._run`), on the probe's device."""
    return 2 * max(0, int(nbytes)) + 2


def _size(n: float) -> str:
    """Bytes for a person: ``1.0 GiB``, ``512.0 MiB``, ``800 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def affordable(nbytes: int, free_bytes: int | None, *, sharing: int = 1,
               share: float = REFUSE_SHARE, where: str = "memory") -> str | None:
    """Why a probe of ``nbytes`` per transfer must be refused on a rank whose memory
    where the probe allocates (``where``: "host memory", "cuda:0") has ``free_bytes``
    free, or None when it fits.

    It fits when :func:`probe_footprint` times ``sharing`` (the ranks that allocate it
    from that same memory at once: the node's ranks for host memory, 1 for a GPU of its
    own) is at most ``share`` of ``free_bytes``. An unknown ``free_bytes`` (None)
    fits: nothing was measured to refuse on. The reason names the bytes asked, what the
    probe would allocate, what is free, and the most that would fit. Pure: no I/O.
    """
    if free_bytes is None:
        return None
    sharing = max(1, int(sharing))
    total = probe_footprint(nbytes) * sharing
    if total <= share * max(0, free_bytes):
        return None
    most = max(0, int((share * max(0, free_bytes) / sharing - 2) // 2))
    ranks = "" if sharing == 1 else f" ({_size(total)} with the {sharing} ranks sharing it)"
    return (f"a link probe of {nbytes} bytes per transfer would allocate "
            f"{_size(probe_footprint(nbytes))} on this rank{ranks}, more than "
            f"{share:.0%} of the {_size(free_bytes)} free in {where}: refused so that "
            f"the job keeps its memory; ask for at most {most} bytes (--bytes)")


def probe_memory(device: Any) -> tuple[str, int | None]:
    """Where a probe on ``device`` (a ``torch.device``) allocates and how many bytes are
    free there for it: for CUDA, the device's free memory (``torch.cuda.mem_get_info``)
    plus what torch's caching allocator holds reserved but unused on it (the probe's
    buffers are allocated from that first); for the CPU, the host's available memory
    (``psutil``). ``(where, None)`` when it cannot be read. Never raises."""
    try:
        if getattr(device, "type", "cpu") == "cuda":
            from collectors.cuda_events import cuda_module

            cuda = cuda_module()
            index = device.index if device.index is not None else cuda.current_device()
            free, _total = cuda.mem_get_info(index)
            cached = cuda.memory_reserved(index) - cuda.memory_allocated(index)
            return f"cuda:{index}", int(free) + max(0, int(cached))
        import psutil

        return "host memory", int(psutil.virtual_memory().available)
    except Exception as exc:
        log.debug("rtop: the free memory for a link probe could not be read: %r", exc)
        return ("cuda" if getattr(device, "type", "") == "cuda" else "host memory"), None


_warned_share = False


def check_affordable(nbytes: int, device: Any, *, sharing: int = 1,
                     share: float = REFUSE_SHARE) -> None:
    """Refuse a probe this rank cannot afford: raises :class:`ValueError` with
    :func:`affordable`'s reason; logs one warning per process when it takes more than
    :data:`WARN_SHARE` (but no more than ``share``) of what is free."""
    global _warned_share
    where, free = probe_memory(device)
    why = affordable(nbytes, free, sharing=sharing, share=share, where=where)
    if why is not None:
        raise ValueError(why)
    if free is not None and not _warned_share \
            and probe_footprint(nbytes) * max(1, sharing) > WARN_SHARE * free:
        _warned_share = True
        log.warning("rtop: a link probe of %d bytes per transfer allocates %s on this "
                    "rank (%d sharing %s), over %.0f%% of the %s free there; it runs, but "
                    "a smaller --bytes measures the link as well", nbytes,
                    _size(probe_footprint(nbytes)), max(1, sharing), where,
                    WARN_SHARE * 100, _size(free))


class ProbeError(Exception):
    """A transfer of the probe failed or timed out (which peer, which round)."""

    def __init__(self, peer: int, round_no: int, what: str) -> None:
        super().__init__(f"round {round_no}, with rank {peer}: {what}")
        self.peer = peer
        self.round = round_no


class _Stopped(Exception):
    """The probe was aborted while it ran."""


class LinkProbe:
    """The link probe's part on one rank: a training-thread action (``at_boundary``,
    ``abort``) that runs every round of ``rounds`` this rank is in, synchronously, at
    its first boundary (every rank of the job is started at the same step).

    ``rank`` is this rank in ``group`` (the default group: its global rank); the rounds
    name ranks of that group (only this rank's pairs matter here). Transfers carry
    ``nbytes`` each, on ``device`` (None: CPU, or the current CUDA device when the
    group's backend is NCCL), over ``group`` (None: the default group) and its backend.
    ``on_done`` is called exactly once with the answer:
    ``{"rank", "links": [[peer, Bps], ...], "seconds", "nbytes"}`` (``Bps`` from that
    peer to this rank, the fastest of ``reps`` timed transfers), or
    ``{"rank", "error", ...}``. Every wait ends after ``timeout_s``. ``probe_id`` (the
    same on every rank) keeps this probe's messages apart from an earlier one's;
    by default this process's count of probes.
    """

    def __init__(self, rank: int, rounds: Sequence[Sequence[Pair]], nbytes: int,
                 on_done: Callable[[dict[str, Any]], None], *, group: Any = None,
                 reps: int = 3, timeout_s: float = 30.0, device: Any = None,
                 probe_id: int | None = None) -> None:
        self.rank = rank
        self.rounds = [list(r) for r in rounds]
        self.nbytes = int(nbytes)
        self.reps = max(1, int(reps))
        self.timeout_s = float(timeout_s)
        self.group = group
        self.device = device
        self._on_done = on_done
        pid = next(_PROBES) if probe_id is None else probe_id
        self._tag = TAG_BASE + 4 * (pid % TAG_IDS)
        self._lock = threading.Lock()
        self._answered = False
        self._stop: str | None = None
        self._pending: list[Any] = []  # (work, tensors) not yet known complete
        self._poll = False

    # ---- the action ----------------------------------------------------------------

    def at_boundary(self, step: int) -> bool:
        """Run every round (synchronously) and answer; True: finished. Never raises."""
        if self._answered:
            return True
        answer: dict[str, Any] | None = None
        try:
            answer = self._run()
        except _Stopped:
            pass  # abort() has answered
        except ProbeError as exc:
            answer = {"rank": self.rank, "error": str(exc), "peer": exc.peer,
                      "round": exc.round}
        except Exception as exc:
            answer = {"rank": self.rank, "error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            _ABANDONED.extend(self._pending)  # empty unless a transfer was left unfinished
            self._pending.clear()
        if answer is not None:
            self._answer(answer)
        return True

    def abort(self, why: str) -> None:
        """Stop (any thread): answers ``{"rank", "error": why}`` now if not done yet; a
        transfer under way ends within ``timeout_s`` (gloo) or at once (CUDA)."""
        self._stop = why
        self._answer({"rank": self.rank, "error": why})

    def _answer(self, answer: dict[str, Any]) -> None:
        with self._lock:
            if self._answered:
                return
            self._answered = True
        try:
            self._on_done(answer)
        except Exception:
            log.warning("rtop: the link probe's answer could not be handed over",
                        exc_info=True)

    # ---- the rounds ----------------------------------------------------------------

    def _run(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        if self.nbytes < 1:
            raise ValueError(f"nbytes must be at least 1, got {self.nbytes}")
        backend = str(dist.get_backend(self.group))
        device = self._device(torch, backend)
        self._poll = device.type != "cpu"
        mine: list[tuple[int, int]] = []  # (round, peer)
        for k, rnd in enumerate(self.rounds):
            peers = [b if a == self.rank else a for a, b in rnd if self.rank in (a, b)]
            if len(peers) > 1:
                raise ValueError(f"round {k} puts rank {self.rank} in {len(peers)} pairs")
            if peers and peers[0] == self.rank:
                raise ValueError(f"round {k} pairs rank {self.rank} with itself")
            mine += [(k, p) for p in peers]
        t0 = time.perf_counter()
        links: list[list[Any]] = []
        if mine:
            # what is sent is all ones (never written while a send may read it); what is
            # received lands elsewhere (pages touched now, not while timed)
            bufs = _Buffers(torch.ones(self.nbytes, dtype=torch.uint8, device=device),
                            torch.zeros(self.nbytes, dtype=torch.uint8, device=device),
                            torch.ones(1, dtype=torch.uint8, device=device),
                            torch.zeros(1, dtype=torch.uint8, device=device))
            try:
                for k, peer in mine:
                    bps = self._pair(dist, peer, k, bufs)
                    links.append([peer, bps])
            finally:
                del bufs  # released (a transfer left unfinished keeps its own, see above)
        return {"rank": self.rank, "links": links, "seconds": time.perf_counter() - t0,
                "nbytes": self.nbytes}

    def _device(self, torch: Any, backend: str) -> Any:
        if self.device is not None:
            dev = torch.device(self.device)
        elif "nccl" in backend.lower() and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
        if dev.type == "cuda" and "nccl" not in backend.lower():
            raise ValueError(f"the {backend} backend sends CPU tensors, not {dev}")
        return dev

    def _pair(self, dist: Any, peer: int, k: int, b: _Buffers) -> float:
        """One pair: the token exchange, both directions in turn, and the last
        receiver's acknowledgement; returns the bandwidth from ``peer`` to this rank
        (bytes/s)."""
        to = peer
        if self.group is not None and self.group is not dist.group.WORLD:
            to = dist.get_global_rank(self.group, peer)
        ch = _Channel(self, dist, to, peer, k)
        low = self.rank < peer
        if low:
            ch.send(b.token_out, _SYNC, "the token exchange")
            ch.recv(b.token_in, _SYNC, "the token exchange")
        else:
            ch.recv(b.token_in, _SYNC, "the token exchange")
            ch.send(b.token_out, _SYNC, "the token exchange")
        times: list[float] = []
        for rep in range(self.reps + WARMUP):  # the two directions take turns
            for low_sends in (True, False):
                if low_sends == low:  # this rank sends, the peer times it
                    ch.recv(b.token_in, _GO, "waiting for its go")
                    ch.send(b.data_out, _DATA, "sending")
                    continue
                t0 = time.perf_counter()
                ch.send(b.token_out, _GO, "sending its go")
                ch.recv(b.data_in, _DATA, "receiving")
                if rep >= WARMUP:
                    times.append(time.perf_counter() - t0)
        # the last data went from high to low: low says it arrived, so that high's
        # send is known complete before its buffer is used again
        if low:
            ch.send(b.token_out, _SYNC, "acknowledging")
            ch.settle("acknowledging")
        else:
            ch.recv(b.token_in, _SYNC, "waiting for the acknowledgement")
        t = min(times)
        return self.nbytes / t if t > 0 else float("inf")


class _Buffers(NamedTuple):
    """A probe's tensors: what it sends (all ones) and where it receives."""

    data_out: Any
    data_in: Any
    token_out: Any
    token_in: Any


class _Channel:
    """The messages of one pair, from one side (see the module doc, "Waits that end").

    CPU: a received message is seen arriving by its last byte, zeroed before the
    receive is posted and one in every message sent (TCP delivers in order, and gloo
    receives straight into the tensor); only then is the receive
    waited for (it has completed). A send is waited for once the peer's answer shows
    it arrived (every message of the pair answers the ones before it), so no wait can
    time out in gloo, which closes every connection of the process group when one
    does. CUDA (NCCL): ``is_completed()`` polled, then ``wait()``.
    """

    def __init__(self, probe: LinkProbe, dist: Any, to: int, peer: int, k: int) -> None:
        self.p = probe
        self.dist = dist
        self.to = to
        self.peer = peer
        self.k = k
        self.unsettled: list[tuple[Any, str]] = []  # our sends not yet known arrived

    def send(self, tensor: Any, kind: int, what: str) -> None:
        """Send ``tensor`` (all ones: its last byte marks its arrival)."""
        work = self._start(self.dist.isend, tensor, kind, what)
        if self.p._poll:
            self._await(work, what)
        else:
            self.unsettled.append((work, what))

    def recv(self, tensor: Any, kind: int, what: str) -> None:
        """Receive into ``tensor``, within the timeout; the peer's earlier sends have
        then arrived, and ours before it too."""
        if self.p._poll:
            self._await(self._start(self.dist.irecv, tensor, kind, what), what)
            return
        tensor[-1] = 0
        work = self._start(self.dist.irecv, tensor, kind, what)
        self._until(lambda: bool(tensor[-1] != 0), what)
        self._done(work, what)
        self.settle(what)

    def settle(self, what: str) -> None:
        """Wait for our sends, which have arrived (see the class doc)."""
        while self.unsettled:
            work, said = self.unsettled.pop(0)
            self._done(work, said)

    def _start(self, fn: Any, tensor: Any, kind: int, what: str) -> Any:
        p = self.p
        if p._stop is not None:
            raise _Stopped(p._stop)
        try:
            work = fn(tensor, self.to, group=p.group, tag=p._tag + kind)
        except Exception as exc:  # a closed connection fails at once
            raise self._failed(what, exc) from exc
        p._pending.append((work, tensor))
        return work

    def _until(self, ready: Callable[[], bool], what: str) -> None:
        """Poll ``ready`` until it holds; past ``timeout_s`` the pair has failed."""
        p = self.p
        deadline = time.monotonic() + p.timeout_s
        spin_until = time.monotonic() + 5e-4
        while not ready():
            if p._stop is not None:
                raise _Stopped(p._stop)
            now = time.monotonic()
            if now > deadline:
                raise ProbeError(self.peer, self.k, f"{what}: nothing from rank "
                                 f"{self.peer} in {p.timeout_s:g} s")
            time.sleep(0 if now < spin_until else 5e-5)

    def _await(self, work: Any, what: str) -> None:
        try:
            self._until(work.is_completed, what)
        except (ProbeError, _Stopped):
            raise
        except Exception as exc:
            raise self._failed(what, exc) from exc
        self._done(work, what)

    def _done(self, work: Any, what: str) -> None:
        """Wait for a transfer that has completed (or is about to)."""
        try:
            work.wait(timeout=timedelta(seconds=self.p.timeout_s))
        except Exception as exc:
            raise self._failed(what, exc) from exc
        self.p._pending = [x for x in self.p._pending if x[0] is not work]

    def _failed(self, what: str, exc: Exception) -> Exception:
        """The error to raise for a transfer that failed: the abort's, or which peer
        and round (gloo's message is long: its first line, cut)."""
        if self.p._stop is not None:
            return _Stopped(self.p._stop)
        text = _SOURCE.sub("", str(exc).strip())
        msg = text.splitlines()[0][:160] if text else ""
        return ProbeError(self.peer, self.k, f"{what}: {type(exc).__name__}: {msg}")
