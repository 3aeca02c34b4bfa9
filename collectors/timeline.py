"""Pure functions that turn a step's raw timestamps into a step record.

They run on the sender thread, never on the training thread. Times are seconds on one
clock (``time.perf_counter`` on CPU, CUDA-event offsets from the step's start on GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total time covered by at least one interval (overlaps counted once)."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if cur_end is None or cur_start is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def intersection(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]
                 ) -> list[tuple[float, float]]:
    """The time covered by both ``a`` and ``b`` (each a set of intervals)."""
    ma, mb = merged(a), merged(b)
    out: list[tuple[float, float]] = []
    i = j = 0
    while i < len(ma) and j < len(mb):
        s, e = max(ma[i][0], mb[j][0]), min(ma[i][1], mb[j][1])
        if e > s:
            out.append((s, e))
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return out


def clipped_union(intervals: Iterable[tuple[float, float]], lo: float) -> float:
    """Union length of the intervals' parts that lie at or after ``lo``."""
    return union_length((max(s, lo), e) for s, e in intervals if e > lo)


def bus_bandwidth(algbw_bps: float, world_size: int) -> float | None:
    """Allreduce bus bandwidth (nccl-tests): ``algbw * 2(n-1)/n``; None for one rank."""
    if world_size < 2:
        return None
    return algbw_bps * 2.0 * (world_size - 1) / world_size


def comm_figures(
    buckets: Sequence[tuple[float, float, int]], world_size: int
) -> tuple[float, float, int, int, float | None, float | None]:
    """Collective figures of one step from its buckets ``(launch, done, bytes)``.

    Returns ``(comm_s, comm_exposed_s, comm_bytes, comm_calls, algbw_Bps, busbw_Bps)``.
    ``comm_s`` is the union of the buckets' in-flight intervals. The exposed part is
    what remains of that union after the last bucket was launched: DDP launches the
    last bucket when backward has produced the last gradient, so from then on the
    training thread has nothing to do but wait for the collectives.
    """
    if not buckets:
        return 0.0, 0.0, 0, 0, None, None
    intervals = [(launch, done) for launch, done, _ in buckets]
    comm_s = union_length(intervals)
    last_launch = max(launch for launch, _ in intervals)
    exposed = clipped_union(intervals, last_launch)
    nbytes = sum(b for _, _, b in buckets)
    algbw = nbytes / comm_s if comm_s > 0 else None
    busbw = bus_bandwidth(algbw, world_size) if algbw is not None else None
    return comm_s, exposed, nbytes, len(buckets), algbw, busbw


def span_comm_figures(
    start: float, last_launch: float, end: float, nbytes: int, calls: int, world_size: int
) -> tuple[float, float, int, int, float | None, float | None]:
    """Collective figures of one step from DDP's own stamps (see ``collectors.ddptimer``).

    ``start`` is the first bucket's launch, ``last_launch`` the time backward produced
    the last gradient, ``end`` the last bucket's completion. Same return as
    :func:`comm_figures`; ``comm_s`` is the whole span.
    """
    comm_s = max(0.0, end - start)
    exposed = min(comm_s, max(0.0, end - max(last_launch, start)))
    algbw = nbytes / comm_s if comm_s > 0 and nbytes > 0 else None
    busbw = bus_bandwidth(algbw, world_size) if algbw is not None else None
    return comm_s, exposed, nbytes, calls, algbw, busbw
