"""The link probe: point-to-point bandwidth between ranks, over the job's backend and
fabric, so it measures the path the job's collectives take.

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

**Both post, or neither (the agreement).** A transfer posted on one rank completes only
when its peer posts the matching one: an NCCL send or receive left posted is never
cancelled and, once it outlives the process group's timeout, NCCL's watchdog tears the
training process down. So no rank posts anything until its peer has committed to the
same transfer, through the process group's store (a side channel that involves no
communicator): for the ``i``-th transfer of a pair both ranks ``add`` to one key, and
the store's atomic answer decides. The second to arrive reads 2: both post. A rank
that arrived first polls the key; when it gives up (its timeout, a cancel) it adds
:data:`_STOP`, and the answer tells it whether the peer came in between (then it posts
all the same: the peer has). A rank that leaves (an error, a cancel) also adds to the
next key it would have met, :data:`_STOP` once everything it posted has completed and
:data:`_FAIL` if not, and to the first key of each pair still ahead of it, so its peers
learn at once instead of after a timeout. A committed transfer is always carried to its
end on both ranks, whatever happens meanwhile: a cancel takes effect at the next
agreement. What a committed transfer cannot finish within ``timeout_s`` (its peer died
or hangs) is drained: on NCCL by aborting the pair's own communicator (below), which
ends every operation posted on it; gloo has no cancel, so its buffers stay referenced
(:data:`_ABANDONED`) and nothing waits on it. Each rank of a pair's key is deleted by
whichever rank reads it last; a peer that never came leaves one key behind.

**One pair.** Key 0 is the join (is the peer there?). Then each direction is timed
where the data arrives: :data:`WARMUP` untimed transfers, then ``reps`` timed ones, the
two directions taking turns, one agreement each; a last agreement says both are done.
The figure is ``nbytes`` over the fastest time: interference (other processes on the
cores, other pairs on a shared NIC) only ever slows a transfer, so the fastest is the
link's own figure, while a slow link is slow every time (on a loaded 2-core machine the
median of 3 varied 3x between healthy loopback links; more ``reps`` narrow it further).
Timing at the sender would measure how fast a buffer fills, not the link. Each rank
answers the direction it received (``[peer, Bps]`` from ``peer`` to it); the hub keeps
the slower of the two directions.

**Gloo (CPU): the job's group, timed on the host.** The receiver posts its receive,
starts its clock and sends a 1-byte "go"; the sender sends ``nbytes`` once the go has
arrived; the clock stops when they have. Gloo cannot be trusted with a timeout: a
point-to-point wait that times out closes *every* connection of the process group
("Application timeout caused pair closure"), so the job's next collective fails; and
its ``is_completed()`` says nothing until ``wait()`` was called. So the probe never
waits on gloo for what may not come: what it sends is all ones, what it receives lands
in a tensor whose last byte it zeroed first, and the receiver polls that byte (TCP
delivers in order and gloo receives straight into the tensor); once it is one, the
receive is waited for (it has completed). A send is waited for once the peer's next
word in the store (its arrival at the next key, or its leaving after a transfer it
completed) shows that it arrived.

**NCCL (CUDA): a communicator of the pair's own, timed with CUDA events.** Each pair
runs on a process group of its own, a two-rank ``ProcessGroupNCCL`` on a prefix of the
store, made after the join and shut down at the end of the pair (aborted on an error):
at most one probe communicator lives on a rank at a time, it is freed after, the job's
communicators carry none of the probe's operations, and the job's process-group registry
never sees it. Its communicator is created inside the first transfer
(``ncclCommInitRank`` is collective over the two ranks and blocks the host until both
are in): a 1-byte exchange that both ranks commit to once both have made their group
(one more agreement, so a rank that fails to make its group never leaves its peer
blocked in the creation), timed apart from the figures. Every operation is posted with a
stream of the probe's own current, on the model's device, so the job's streams never
wait on a transfer. Completion is polled (``work.is_completed()``, a query of the
transfer's CUDA event): ``work.wait(timeout)`` would block the host. A timed transfer is
a 1-byte "ready" from the sender (the receiver's start event follows it, so the sender
is at its data), then ``burst`` back-to-back transfers of ``nbytes``, then the end
event; the two events are recorded on the probe's stream after
``block_current_stream()`` on the transfers and read once complete. The host's clock
would add the launch and polling overhead (100 µs or more, while 16 MiB cross NVLink in
about 40 µs); the events leave only the first launch after the start event, which
``burst`` amortises: the receiver picks it from its last measurement so the timed span
is about :data:`TIMED_S` (at most :data:`MAX_BURST`), and tells the sender through the
store. Back-to-back transfers stay back to back on the GPU while posting one takes the
host less time than the GPU takes to carry it (~20 µs: 8 MiB over a 450 GB/s NVLink is
at that edge; ask more bytes there).

**What a rank can afford.** Those buffers (:func:`probe_footprint`) come out of the
memory the job trains in: the GPU's for a CUDA probe, the host's for a CPU one (where
every rank of the node allocates its own at once). A rank refuses a probe whose buffers
would take more than :data:`REFUSE_SHARE` of the free memory where they go (all the
node's ranks' together, for host memory), and logs one warning beyond
:data:`WARN_SHARE`; :func:`affordable` says why, from figures alone, so the hub can
apply the same rule to a rank's last reported free memory before it asks. A CUDA probe
allocates on the device the model lives on (:func:`cuda_probe_index`), never on
whatever device happens to be current: in a job that never calls
``torch.cuda.set_device`` that is GPU 0 for every rank.

On an error the rank answers ``{"rank", "error", "peer", "round"}`` and stops; the job
goes on (a peer that died then fails the job's own next collective, on the job's terms).

Everything here is imported without torch; torch is imported when a probe runs.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from itertools import count
from typing import Any, Final, NamedTuple

from collectors.control import AnswerOnce

log = logging.getLogger("collectors")

Pair = tuple[int, int]
Rounds = list[list[Pair]]

#: Ranks up to which every pair is measured (beyond: by node, see the module doc).
FLAT_LIMIT: Final = 64
#: Bytes per timed transfer unless the caller says otherwise: large enough for a link's
#: bandwidth, not its latency, to set the time (8 MiB take 0.7 ms at 100 Gb/s).
DEFAULT_BYTES: Final = 8 << 20
#: Tags of the probe's gloo messages: ``TAG_BASE + 4 * (probe id % TAG_IDS) + kind``, so
#: a message an earlier, failed probe left behind never matches a later probe's (gloo
#: matches by tag; NCCL ignores tags and matches in order).
TAG_BASE: Final = 0x7270  # "rp"
TAG_IDS: Final = 1 << 20
_GO, _DATA = 1, 2
#: Untimed transfers each way before the timed ones (a fresh TCP connection's window
#: is still growing, NCCL connects a pair's channels lazily: the first are slower).
WARMUP: Final = 2
#: GPU: the span a timed burst of back-to-back transfers aims at (see the module doc):
#: a first launch of up to 50 µs is then under 2 % of it.
TIMED_S: Final = 2.5e-3
#: GPU: the most transfers in one timed burst.
MAX_BURST: Final = 64
#: A rank refuses a probe whose buffers would take more than this share of the free
#: memory where they go (see "What a rank can afford" in the module doc): a probe
#: measures links, and must never be what pushes a job into swapping, the OOM killer or
#: a CUDA out-of-memory error. A quarter leaves the job three quarters of what it had
#: free for the few seconds the probe runs.
REFUSE_SHARE: Final = 0.25
#: ... and logs one warning beyond this share (the probe still runs).
WARN_SHARE: Final = 0.10
#: What a rank adds to an agreement key (see the module doc): it is there; it leaves
#: with everything it posted complete; it leaves after a transfer of its failed.
_ARRIVE, _STOP, _FAIL = 1, -10, -100
#: The store's prefix for the probe's keys.
STORE_PREFIX: Final = "rtop/probe/"
#: The longest pause between two polls of the store (it is polled, not waited on: a
#: store ``wait`` that times out logs a warning in the job's output each time).
_POLL_MAX_S = 5e-3
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


def cuda_probe_index(*, model: int | None, bound: int | None, devices: int,
                     thread: int | None, local_rank: str | None) -> int:
    """The CUDA device index a probe over NCCL allocates its buffers on and sends from:
    the device the model lives on (``model``: the watched model's, as its CUDA event
    pool and memory sampler know it), else the device the default process group is bound
    to (``bound``: ``init_process_group(device_id=...)``), else the only one
    (``devices``: ``torch.cuda.device_count()``). Failing those, the training thread's
    current device (``thread``) only where the job evidently chose it: a device other
    than 0 (``set_device`` was called), or 0 on local rank 0 (``local_rank``:
    ``LOCAL_RANK``). Otherwise raises :class:`ValueError`: a job that never calls
    ``torch.cuda.set_device`` is on ``cuda:0`` in every rank, and a probe there would put
    a context and two buffers of every rank on GPU 0 (NCCL then refuses: "duplicate
    GPU"). Pure: no I/O."""
    for index in (model, bound):
        if index is not None:
            return int(index)
    if devices == 1:
        return 0
    if thread is not None and (thread != 0 or (local_rank or "").strip() == "0"):
        return int(thread)
    raise ValueError(
        "the GPU this rank trains on is unknown: no model on CUDA was watched "
        "(probe.watch(model)), the process group is bound to no device, and the training "
        f"thread is on cuda:{0 if thread is None else thread}, where every rank of a job "
        "that never calls torch.cuda.set_device is; refused rather than put every rank's "
        "probe on GPU 0")


class ProbeError(Exception):
    """A transfer of the probe failed or timed out (which peer, which round)."""

    def __init__(self, peer: int, round_no: int, what: str) -> None:
        super().__init__(f"round {round_no}, with rank {peer}: {what}")
        self.peer = peer
        self.round = round_no


class _PeerLeft(ProbeError):
    """The peer left the pair (its own error, its timeout, a cancel) before this rank
    posted anything; ``completed``: the peer's side of every earlier transfer is done, so
    what this rank sent it has arrived."""

    def __init__(self, peer: int, round_no: int, what: str, completed: bool) -> None:
        super().__init__(peer, round_no, what)
        self.completed = completed


class _Stopped(Exception):
    """The probe was aborted while it ran."""


class _Runtime(NamedTuple):
    """What the probe uses of torch, in one place: ``torch`` (tensors, devices),
    ``torch.distributed`` and ``torch.cuda``. Tests hand a :class:`LinkProbe` fakes that
    behave like the runtime (``tests/fakecuda.py``)."""

    torch: Any
    dist: Any
    cuda: Any

    @classmethod
    def real(cls) -> _Runtime:
        """The real modules (imported here: never at import time)."""
        import torch
        import torch.distributed as dist

        from collectors.cuda_events import cuda_module

        return cls(torch, dist, cuda_module())


class _Ctx(NamedTuple):
    """What every pair of one probe shares: the runtime, the store under the probe's
    prefix, the device, and (CUDA) the probe's own stream."""

    rt: _Runtime
    store: Any
    device: Any
    stream: Any


class LinkProbe:
    """The link probe's part on one rank: a training-thread action (``at_boundary``,
    ``abort``) that runs every round of ``rounds`` this rank is in, synchronously, at
    its first boundary (every rank of the job is started at the same step).

    ``rank`` is this rank in ``group`` (the default group: its global rank); the rounds
    name ranks of that group (only this rank's pairs matter here). Transfers carry
    ``nbytes`` each, on ``device`` (a CUDA device: over NCCL, see the module doc; None:
    the CPU, or under NCCL the device the default group is bound to, and an error if it
    is bound to none: :func:`cuda_probe_index` says which device to give), over
    ``group`` (None: the default group) and its backend. ``on_done`` is called exactly
    once with the answer: ``{"rank", "links": [[peer, Bps], ...], "seconds", "nbytes"}``
    (``Bps`` from that peer to this rank, the fastest of ``reps`` timed transfers), or
    ``{"rank", "error", ...}``. Every wait ends after ``timeout_s``. ``probe_id`` (the
    same on every rank) keeps this probe's messages and store keys apart from another
    probe's; by default this process's count of probes. ``runtime`` is a seam for tests
    (None: torch's modules).

    :attr:`counts` says what the probe did: operations ``posted``, ``completed`` and
    ``drained`` (ended by aborting the pair's communicator), NCCL pair ``groups`` made
    and ``groups_freed``; posted = completed + drained once it has answered, unless a
    gloo transfer was abandoned (:data:`_ABANDONED`).
    """

    def __init__(self, rank: int, rounds: Sequence[Sequence[Pair]], nbytes: int,
                 on_done: Callable[[dict[str, Any]], None], *, group: Any = None,
                 reps: int = 3, timeout_s: float = 30.0, device: Any = None,
                 probe_id: int | None = None, runtime: Any = None) -> None:
        self.rank = rank
        self.rounds = [list(r) for r in rounds]
        self.nbytes = int(nbytes)
        self.reps = max(1, int(reps))
        self.timeout_s = float(timeout_s)
        self.group = group
        self.device = device
        self._answer = AnswerOnce(on_done, "the link probe's answer")
        self._id = next(_PROBES) if probe_id is None else int(probe_id)
        self._tag = TAG_BASE + 4 * (self._id % TAG_IDS)
        self._rt: _Runtime | None = runtime
        self._stop: str | None = None
        self._pending: list[Any] = []  # (work, tensors) not yet known complete
        self._ctx: _Ctx | None = None
        #: What the probe did (see the class doc).
        self.counts = {"posted": 0, "completed": 0, "drained": 0, "groups": 0,
                       "groups_freed": 0}

    # ---- the action ----------------------------------------------------------------

    def at_boundary(self, step: int) -> bool:
        """Run every round (synchronously) and answer; True: finished. Never raises."""
        if self._answer.given:
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
            self._ctx = None
        if answer is not None:
            self._answer(answer)
        return True

    def abort(self, why: str) -> None:
        """Stop (any thread): answers ``{"rank", "error": why}`` now if not done yet. A
        transfer under way is carried to its end first (its peer has posted its half):
        the probe stops at its next agreement, and its peer learns there at once."""
        self._stop = why
        self._answer({"rank": self.rank, "error": why})

    # ---- the rounds ----------------------------------------------------------------

    def _run(self) -> dict[str, Any]:
        rt = self._rt if self._rt is not None else _Runtime.real()
        dist = rt.dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        if self.nbytes < 1:
            raise ValueError(f"nbytes must be at least 1, got {self.nbytes}")
        backend = str(dist.get_backend(self.group))
        device = self._device(rt, backend)
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
            store = dist.PrefixStore(f"{STORE_PREFIX}{self._id}/",
                                     dist.distributed_c10d._get_default_store())
            at = -1  # the pair under way (it tells its own peer when it fails)
            try:
                with self._on_device(rt, device) as stream:
                    self._ctx = _Ctx(rt, store, device, stream)
                    # what is sent is all ones (never written while a send may read it);
                    # what is received lands elsewhere (pages touched now, not while timed)
                    bufs = _Buffers(*(rt.torch.full((n,), fill, dtype=rt.torch.uint8,
                                                    device=device)
                                      for n, fill in ((self.nbytes, 1), (self.nbytes, 0),
                                                      (1, 1), (1, 0))))
                    try:
                        for k, peer in mine:
                            at += 1
                            links.append([peer, self._pair(dist, peer, k, bufs)])
                    finally:
                        del bufs  # released (a transfer left unfinished keeps its own)
            except BaseException:
                self._leave_rest(store, mine[at + 1:])  # the peers ahead learn at once
                raise
        return {"rank": self.rank, "links": links, "seconds": time.perf_counter() - t0,
                "nbytes": self.nbytes}

    def _device(self, rt: _Runtime, backend: str) -> Any:
        torch = rt.torch
        nccl = "nccl" in backend.lower()
        if self.device is not None:
            dev = torch.device(self.device)
        elif nccl and rt.cuda.is_available():
            dev = getattr(rt.dist.distributed_c10d._get_default_group(), "bound_device_id",
                          None)
            if dev is None:
                raise ValueError("a link probe over NCCL needs the device the model lives "
                                 "on, and the process group is bound to none")
        else:
            dev = torch.device("cpu")
        if dev.type == "cuda" and not nccl:
            raise ValueError(f"the {backend} backend sends CPU tensors, not {dev}")
        if dev.type == "cuda" and dev.index is None:
            raise ValueError(f"a link probe needs a CUDA device with an index, not {dev}")
        return dev

    @contextmanager
    def _on_device(self, rt: _Runtime, device: Any) -> Iterator[Any]:
        """CUDA: the model's device current (then the one before again) and the probe's
        own stream; CPU: nothing (None)."""
        if device.type != "cuda":
            yield None
            return
        with rt.cuda.device(device.index):
            yield rt.cuda.Stream(device=device)

    def _leave_rest(self, store: Any, rest: Sequence[tuple[int, int]]) -> None:
        """Tell the peers of the pairs still ahead that this rank will not come."""
        for k, peer in rest:
            try:
                ag = _Agreement(self, store, peer, k)
                ag.leave(_STOP)
            except Exception as exc:  # best effort: they time out instead
                log.debug("rtop: could not tell rank %d the probe ended: %r", peer, exc)

    def _pair(self, dist: Any, peer: int, k: int, b: _Buffers) -> float:
        """One pair: the join, both directions in turn, and the last agreement; returns
        the bandwidth from ``peer`` to this rank (bytes/s)."""
        ctx = self._ctx
        assert ctx is not None
        low = self.rank < peer
        ag = _Agreement(self, ctx.store, peer, k)
        link: _GlooLink | _NcclLink
        if ctx.stream is None:
            link = _GlooLink(self, dist, peer, k, b)
        else:
            link = _NcclLink(self, ctx, ag.base, peer, k, b, low)
        best = math.inf
        burst = 1
        try:
            ag.meet("joining")
            if isinstance(link, _NcclLink):  # both have a pair group before either posts
                link.make()
                ag.meet("making the pair's process group")
            link.join()
            for rep in range(self.reps + WARMUP):  # the two directions take turns
                for low_sends in (True, False):
                    if low_sends == low:  # this rank sends, the peer times it
                        ag.meet("waiting for its go")
                        link.settle()
                        link.send(ag.burst() if link.bursts else 1)
                        continue
                    if link.bursts:
                        ag.offer_burst(burst)
                    ag.meet("sending its go")
                    link.settle()
                    t = link.receive(burst)
                    if rep >= WARMUP:
                        best = min(best, t / burst)
                    burst = link.next_burst(t / burst)
            ag.meet("finishing")  # both are done: what each sent has arrived
            link.settle()
            link.close()
        except _PeerLeft as exc:
            if exc.completed:
                with _quiet("waiting for what was sent"):
                    link.settle()
            link.fail()
            raise
        except _Stopped:
            # what it sent is waited for once the peer is past it
            if link.unsettled() and ag.peer_passed():
                with _quiet("waiting for what was sent"):
                    link.settle()
            link.fail()
            raise
        except BaseException:
            completed = not link.busy()
            link.fail()
            if ag.committed:  # in a transfer: the peer meets the next key
                with _quiet("telling the peer the pair ended"):
                    ag.leave(_STOP if completed else _FAIL)
            raise
        return self.nbytes / best if best > 0 else float("inf")


class _Buffers(NamedTuple):
    """A probe's tensors: what it sends (all ones) and where it receives."""

    data_out: Any
    data_in: Any
    token_out: Any
    token_in: Any


@contextmanager
def _quiet(what: str) -> Iterator[None]:
    """Best effort: a failure is logged (debug), never raised."""
    try:
        yield
    except Exception as exc:
        log.debug("rtop: link probe, %s: %r", what, exc)


def _pauses() -> Iterator[float]:
    """Pauses between two polls: none for a few, then growing to :data:`_POLL_MAX_S`."""
    for _ in range(20):
        yield 0.0
    pause = 1e-4
    while True:
        yield pause
        pause = min(_POLL_MAX_S, pause * 1.5)


class _Agreement:
    """The store side of one pair (see "Both post, or neither" in the module doc): key
    ``i`` of the pair decides its ``i``-th transfer."""

    def __init__(self, probe: LinkProbe, store: Any, peer: int, k: int) -> None:
        lo, hi = sorted((probe.rank, peer))
        self.p = probe
        self.store = store
        self.peer = peer
        self.k = k
        self.base = f"{lo}-{hi}/"
        self.i = 0
        #: What this rank added to the last key it met or left.
        self.mine = 0
        #: Whether the last key met committed both ranks (a transfer is under way).
        self.committed = False

    def meet(self, what: str) -> None:
        """Returns once both ranks are committed to the next transfer (then both post
        it); raises :class:`_PeerLeft`, :class:`_Stopped` or a timeout's
        :class:`ProbeError` when neither will."""
        p = self.p
        self.committed = False
        key = self._next()
        stop = p._stop
        if stop is not None:
            self._leave_key(key, _STOP, what)
            raise _Stopped(stop)
        v = self._add(key, _ARRIVE, what)
        self.mine = _ARRIVE
        if v == 2 * _ARRIVE:
            self.committed = True
            return  # the peer was waiting: it reads 2 and deletes the key
        if v != _ARRIVE:  # the peer left before: nobody comes back to this key
            self._delete(key)
            raise self._left(v - _ARRIVE, what)
        deadline = time.monotonic() + p.timeout_s
        for pause in _pauses():
            failure: ProbeError | None = None
            try:
                v = self._add(key, 0, what)
            except ProbeError as exc:  # withdrawn below, if the store lets us
                failure, v = exc, _ARRIVE
            if v != _ARRIVE:
                self._delete(key)  # the peer is done with it
                if v == 2 * _ARRIVE:
                    self.committed = True
                    return
                raise self._left(v - _ARRIVE, what)
            stop = p._stop
            if failure is not None or stop is not None or time.monotonic() > deadline:
                v = self._add(key, _STOP, what)
                self.mine = _ARRIVE + _STOP
                if v == 2 * _ARRIVE + _STOP:  # the peer came in between: it posts, so do we
                    self._delete(key)
                    self.committed = True
                    return
                if v != _ARRIVE + _STOP:  # the peer left as well
                    self._delete(key)
                if failure is not None:
                    raise failure
                if stop is not None:
                    raise _Stopped(stop)
                raise ProbeError(self.peer, self.k, f"{what}: nothing from rank "
                                 f"{self.peer} in {p.timeout_s:g} s")
            time.sleep(pause)
        raise AssertionError("unreachable")

    def leave(self, part: int) -> None:
        """This rank will not come to the next key (:data:`_STOP`: with everything it
        posted complete; :data:`_FAIL`: after a transfer of its failed)."""
        self._leave_key(self._next(), part, "leaving")

    def peer_passed(self) -> bool:
        """After leaving the last key met: wait (at most ``timeout_s``) until the peer
        has come to it or left, which it does only with its side of every earlier
        transfer done; False if it did not, or left after a failure."""
        key = f"{self.base}{self.i - 1}"
        deadline = time.monotonic() + self.p.timeout_s
        for pause in _pauses():
            try:
                if not self.store.check([key]):
                    return True  # it came and deleted the key
                v = int(self.store.add(key, 0))
            except Exception:
                return False
            if v == 0:  # deleted between the two calls (and made again by the add)
                self._delete(key)
                return True
            peer = v - self.mine
            if peer in (_ARRIVE, _STOP, _ARRIVE + _STOP):
                return True
            if peer != 0 or time.monotonic() > deadline:
                return False
            time.sleep(pause)
        return False

    def offer_burst(self, n: int) -> None:
        """The receiver's word on the next transfer's burst, before it arrives."""
        self._call(self.store.set, f"{self.base}{self.i}/n", str(int(n)),
                   what="offering the burst")

    def burst(self) -> int:
        """The burst of the transfer just agreed, as its receiver offered it."""
        key = f"{self.base}{self.i - 1}/n"
        n = int(self._call(self.store.get, key, what="reading the burst"))
        self._delete(key)
        return max(1, min(MAX_BURST, n))

    def _next(self) -> str:
        key = f"{self.base}{self.i}"
        self.i += 1
        return key

    def _leave_key(self, key: str, part: int, what: str) -> None:
        v = self._add(key, part, what)
        self.mine = part
        if v not in (part, part + _ARRIVE):  # the peer left it too: nobody reads it again
            self._delete(key)

    def _left(self, peer: int, what: str) -> _PeerLeft:
        """The error for a peer that added ``peer`` (:data:`_STOP`, :data:`_FAIL`, or
        :data:`_ARRIVE` + :data:`_STOP`: came first, then withdrew)."""
        why = {_STOP: "it left the probe (a cancel, or an error with another rank)",
               _ARRIVE + _STOP: "it stopped waiting for this rank (its timeout, or a cancel)",
               _FAIL: "a transfer of its failed"}.get(peer, f"its word was {peer}")
        return _PeerLeft(self.peer, self.k, f"{what}: rank {self.peer} is not coming: {why}",
                         completed=peer in (_STOP, _ARRIVE + _STOP))

    def _add(self, key: str, n: int, what: str) -> int:
        return int(self._call(self.store.add, key, n, what=what))

    def _call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise ProbeError(self.peer, self.k, f"{what}: the process group's store "
                             f"failed: {type(exc).__name__}: {_first_line(exc)}") from exc

    def _delete(self, key: str) -> None:
        with _quiet("deleting a store key"):
            self.store.delete_key(key)


def _first_line(exc: BaseException) -> str:
    """An exception's message for a person: its first line, without gloo's source."""
    text = _SOURCE.sub("", str(exc).strip())
    return text.splitlines()[0][:160] if text else ""


class _GlooLink:
    """The transfers of one pair over gloo, from one side (see "Gloo" in the module
    doc): the job's own group, host timing, one transfer at a time."""

    bursts = False

    def __init__(self, probe: LinkProbe, dist: Any, peer: int, k: int, b: _Buffers) -> None:
        self.p = probe
        self.dist = dist
        self.to = peer
        if probe.group is not None and probe.group is not dist.group.WORLD:
            self.to = dist.get_global_rank(probe.group, peer)
        self.peer = peer
        self.k = k
        self.b = b
        self._unsettled: list[tuple[Any, str]] = []  # our sends not yet known arrived
        self._receiving = False

    def join(self) -> None:
        """Nothing: gloo's connections exist; the warm-up transfers grow their window."""

    def send(self, n: int) -> None:
        """Send ``nbytes`` once the receiver's go has arrived."""
        b = self.b
        b.token_in[-1] = 0
        go = self._start(self.dist.irecv, b.token_in, _GO, "waiting for its go")
        self._receiving = True
        self._until(lambda: bool(b.token_in[-1] != 0), "waiting for its go")
        self._done(go, "waiting for its go")
        self._receiving = False
        self._unsettled.append((self._start(self.dist.isend, b.data_out, _DATA, "sending"),
                                "sending"))

    def receive(self, n: int) -> float:
        """Receive ``nbytes`` after sending the go; the seconds from the go to the last
        byte."""
        b = self.b
        b.data_in[-1] = 0
        data = self._start(self.dist.irecv, b.data_in, _DATA, "receiving")
        self._receiving = True
        t0 = time.perf_counter()
        go = self._start(self.dist.isend, b.token_out, _GO, "sending its go")
        self._until(lambda: bool(b.data_in[-1] != 0), "receiving")
        seconds = time.perf_counter() - t0
        self._done(data, "receiving")
        self._receiving = False
        self._done(go, "sending its go")  # the data came after it
        return seconds

    def next_burst(self, per_s: float) -> int:
        """One transfer at a time (timed on the host)."""
        return 1

    def settle(self) -> None:
        """Wait for our sends, which have arrived (the peer's word in the store says)."""
        while self._unsettled:
            work, said = self._unsettled.pop(0)
            self._done(work, said)

    def unsettled(self) -> bool:
        """Whether a send of ours is not known to have arrived yet."""
        return bool(self._unsettled)

    def busy(self) -> bool:
        """Whether a receive of ours is posted and unfinished."""
        return self._receiving

    def close(self) -> None:
        """Nothing to free: the job's group."""

    def fail(self) -> None:
        """Nothing can be cancelled on gloo: what is unfinished stays referenced."""
        self._unsettled.clear()

    def _start(self, fn: Any, tensor: Any, kind: int, what: str) -> Any:
        p = self.p
        try:
            work = fn(tensor, self.to, group=p.group, tag=p._tag + kind)
        except Exception as exc:  # a closed connection fails at once
            raise self._failed(what, exc) from exc
        p._pending.append((work, tensor))
        p.counts["posted"] += 1
        return work

    def _until(self, ready: Callable[[], bool], what: str) -> None:
        """Poll ``ready`` until it holds; past ``timeout_s`` the pair has failed (a
        committed transfer: its peer died or hangs)."""
        p = self.p
        deadline = time.monotonic() + p.timeout_s
        spin_until = time.monotonic() + 5e-4
        while not ready():
            now = time.monotonic()
            if now > deadline:
                raise ProbeError(self.peer, self.k, f"{what}: nothing from rank "
                                 f"{self.peer} in {p.timeout_s:g} s")
            time.sleep(0 if now < spin_until else 5e-5)

    def _done(self, work: Any, what: str) -> None:
        """Wait for a transfer that has completed (or is about to)."""
        try:
            work.wait(timeout=timedelta(seconds=self.p.timeout_s))
        except Exception as exc:
            raise self._failed(what, exc) from exc
        self.p._pending = [x for x in self.p._pending if x[0] is not work]
        self.p.counts["completed"] += 1

    def _failed(self, what: str, exc: Exception) -> Exception:
        return ProbeError(self.peer, self.k,
                          f"{what}: {type(exc).__name__}: {_first_line(exc)}")


def block_current_stream(work: Any) -> None:
    """Make the current CUDA stream wait for ``work`` without blocking the host
    (``Work.block_current_stream``; before it existed, ``wait()`` without a timeout,
    which for NCCL is the same unless ``TORCH_NCCL_BLOCKING_WAIT`` is set)."""
    fn = getattr(work, "block_current_stream", None)
    if fn is not None:
        fn()
    else:
        work.wait()


def nccl_pair_group(dist: Any, store: Any, rank: int, size: int = 2) -> Any:
    """A process group of the probe's own (see "NCCL" in the module doc): a
    ``ProcessGroupNCCL`` backend of ``size`` ranks on ``store`` (a prefix of the job's
    store no one else uses), never registered with ``torch.distributed``; its
    communicator is created at its first operation, freed by ``shutdown()`` or
    ``abort()``. ``dist`` is ``torch.distributed`` (or a test's fake)."""
    return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())


class _NcclLink:
    """The transfers of one pair over NCCL, from one side (see "NCCL" in the module
    doc): a two-rank process group of the pair's own, the probe's stream, CUDA events."""

    bursts = True

    def __init__(self, probe: LinkProbe, ctx: _Ctx, base: str, peer: int, k: int,
                 b: _Buffers, low: bool) -> None:
        self.p = probe
        self.ctx = ctx
        self.base = base
        self.peer = peer
        self.k = k
        self.b = b
        self.low = low
        self.pg: Any = None
        self.posted: list[Any] = []  # our operations not yet known complete

    def make(self) -> None:
        """Make the pair's process group (nothing is posted, no communicator yet)."""
        dist = self.ctx.rt.dist
        try:
            store = dist.PrefixStore(f"{self.base}nccl/", self.ctx.store)
            self.pg = nccl_pair_group(dist, store, 0 if self.low else 1)
        except Exception as exc:
            raise self._failed("making the pair's process group", exc) from exc
        self.p.counts["groups"] += 1

    def join(self) -> None:
        """Exchange a byte each way: the pair's communicator is created inside the first
        operation, on both ranks at once (both have committed, with their groups
        made)."""
        b = self.b
        with self._posting():
            if self.low:
                self._post(self.pg.send, b.token_out, "creating the pair's communicator")
                self._post(self.pg.recv, b.token_in, "creating the pair's communicator")
            else:
                self._post(self.pg.recv, b.token_in, "creating the pair's communicator")
                self._post(self.pg.send, b.token_out, "creating the pair's communicator")
        self._complete("creating the pair's communicator")

    def send(self, n: int) -> None:
        """The ready byte, then ``n`` transfers of ``nbytes``, back to back."""
        b = self.b
        with self._posting():
            self._post(self.pg.send, b.token_out, "sending its ready")
            for _ in range(n):
                self._post(self.pg.send, b.data_out, "sending")
        self._complete("sending")

    def receive(self, n: int) -> float:
        """The ready byte, then ``n`` transfers of ``nbytes``; the GPU's seconds from the
        ready's arrival to the last byte (CUDA events on the probe's stream)."""
        cuda = self.ctx.rt.cuda
        stream = self.ctx.stream
        start = cuda.Event(enable_timing=True)
        end = cuda.Event(enable_timing=True)
        b = self.b
        with self._posting():
            block_current_stream(self._post(self.pg.recv, b.token_in,
                                            "waiting for its ready"))
            start.record(stream)
            work = None
            for _ in range(n):
                work = self._post(self.pg.recv, b.data_in, "receiving")
            block_current_stream(work)
            end.record(stream)
        self._complete("receiving", also=end.query)
        try:
            return float(start.elapsed_time(end)) / 1000.0
        except Exception as exc:
            raise self._failed("timing", exc) from exc

    def next_burst(self, per_s: float) -> int:
        """Transfers in the next timed burst: about :data:`TIMED_S` of them."""
        if not per_s > 0:
            return MAX_BURST
        return max(1, min(MAX_BURST, math.ceil(TIMED_S / per_s)))

    def settle(self) -> None:
        """Nothing: every operation is complete before the next agreement."""

    def unsettled(self) -> bool:
        """Never: see :meth:`settle`."""
        return False

    def busy(self) -> bool:
        """Whether an operation of ours is posted and not known complete."""
        return bool(self.posted)

    def close(self) -> None:
        """The pair is done on both ranks: shut its process group down (its
        communicator's memory is freed)."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        try:
            pg.shutdown()
        except Exception as exc:
            log.debug("rtop: the link probe's pair group did not shut down: %r", exc)
            with _quiet("aborting the pair's process group"):
                pg.abort()
        self.p.counts["groups_freed"] += 1

    def fail(self) -> None:
        """An error: abort the pair's communicator, which ends every operation posted on
        it (none of the job's), and free it."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        if self.posted:
            self.p.counts["drained"] += len(self.posted)
            self.p._pending.extend((w, self.b) for w in self.posted)  # buffers kept
            self.posted = []
        try:
            pg.abort()
        except Exception as exc:
            log.warning("rtop: the link probe could not abort its pair's communicator: "
                        "%r", exc)
        self.p.counts["groups_freed"] += 1

    @contextmanager
    def _posting(self) -> Iterator[None]:
        """Post with the probe's stream current: NCCL's stream waits for it, never the
        job's; :func:`block_current_stream` makes it, not the job's, wait."""
        with ExitStack() as stack:
            stack.enter_context(self.ctx.rt.cuda.stream(self.ctx.stream))
            yield

    def _post(self, fn: Callable[..., Any], tensor: Any, what: str) -> Any:
        try:
            work = fn([tensor], 1 if self.low else 0, 0)
        except Exception as exc:
            raise self._failed(what, exc) from exc
        self.posted.append(work)
        self.p.counts["posted"] += 1
        return work

    def _complete(self, what: str, also: Callable[[], Any] | None = None) -> None:
        """Poll until every posted operation has completed (and ``also`` holds); past
        ``timeout_s`` the pair has failed (its communicator is then aborted)."""
        p = self.p
        deadline = time.monotonic() + p.timeout_s
        spin_until = time.monotonic() + 5e-4
        last = self.posted[-1] if self.posted else None

        def done() -> bool:
            if last is not None and not last.is_completed():
                return False  # one stream: the last done means all are
            return all(w.is_completed() for w in self.posted) and (
                also is None or bool(also()))

        try:
            while not done():
                now = time.monotonic()
                if now > deadline:
                    raise ProbeError(self.peer, self.k, f"{what}: not complete after "
                                     f"{p.timeout_s:g} s (rank {self.peer} died or hangs); "
                                     "the pair's own communicator was aborted")
                time.sleep(0 if now < spin_until else 5e-5)
        except ProbeError:
            raise
        except Exception as exc:  # an NCCL error surfaces in the query
            raise self._failed(what, exc) from exc
        p.counts["completed"] += len(self.posted)
        self.posted = []

    def _failed(self, what: str, exc: Exception) -> ProbeError:
        return ProbeError(self.peer, self.k,
                          f"{what}: {type(exc).__name__}: {_first_line(exc)}")
