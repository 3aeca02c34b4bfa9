"""Who may connect to the hub, and what a connection may hold before it has proved
itself (:class:`Admission`).

Before a peer has authenticated its connection counts against caps, overall and per
address group (:func:`addr_group`: a /24, a /64, or loopback), as do its pending bytes
(half frames); HTTP connections have caps of their own. At a cap the newcomer gets in
and the oldest unfinished connection of the fullest group is closed
(:meth:`Admission.make_room`), so stalled connections from a few addresses can neither
fill the table nor keep a scraper or a rank out. Off loopback, an address that fails to
authenticate ``throttle_failures`` times within ``throttle_window_s`` is refused for
``throttle_block_s`` (:class:`Throttle`). Refusals are logged at most once per address
every ``log_every_s``, with a count of the rest (:class:`PeerLog`); a connection that
sends faster than its :class:`Bucket` allows is a flood.

The hub (:mod:`rtop.hub.server`) owns one :class:`Admission` and calls it as
connections open, speak, authenticate and close; the connection's own fields
(``unauth``, ``pending``, ``http_counted``) say what it is counted as.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rtop.hub.server import HubConfig

log = logging.getLogger("rtop.hub")


class Admitted(Protocol):
    """What admission reads and writes of a connection (the hub's ``_Conn``)."""

    addr: str  # the peer's address
    who: str  # its address and port, for the log
    group: str  # its address group (addr_group)
    closing: bool
    unauth: bool  # counted among the connections not yet authenticated
    pending: int  # bytes of half frames counted while not authenticated
    http_counted: bool  # counted among the open HTTP connections

    def close(self) -> None: ...


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def addr_group(addr: str) -> str:
    """The group a peer's address is counted in against the connection limits: its /24
    (IPv4, and IPv4 mapped into IPv6) or its /64 (IPv6); every loopback address is one
    group. So a few addresses of one host or one subnet share one quota."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return addr
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    prefix = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


class Quota:
    """Connections of one kind (not yet authenticated, or HTTP) held open, oldest
    first, counted overall and per address group (:func:`addr_group`)."""

    def __init__(self, total: int, per_group: int) -> None:
        self.total, self.per_group = total, per_group
        self.conns: dict[Admitted, None] = {}  # insertion order: the oldest first
        self.by_group: dict[str, int] = {}

    def full_for(self, group: str) -> bool:
        """Whether a newcomer of ``group`` finds a cap reached (overall or its group's)."""
        return len(self.conns) >= self.total or self.by_group.get(group, 0) >= self.per_group

    def victim(self, group: str) -> Admitted | None:
        """Whom to close to make room for a newcomer of ``group``: the oldest of that
        group if the group is at its cap, else the oldest of the group that holds the
        most (a few addresses cannot hold every place, nor keep a newcomer out)."""
        if self.by_group.get(group, 0) >= self.per_group:
            pick = group
        elif len(self.conns) >= self.total and self.by_group:
            pick = max(self.by_group, key=self.by_group.__getitem__)
        else:
            return None
        return next((c for c in self.conns if c.group == pick), None)

    def add(self, conn: Admitted) -> None:
        """Count ``conn`` (the newest)."""
        self.conns[conn] = None
        self.by_group[conn.group] = self.by_group.get(conn.group, 0) + 1

    def remove(self, conn: Admitted) -> None:
        """Stop counting ``conn`` (nothing if it was not counted)."""
        if self.conns.pop(conn, False) is None:
            left = self.by_group.get(conn.group, 1) - 1
            if left > 0:
                self.by_group[conn.group] = left
            else:
                self.by_group.pop(conn.group, None)

    def __len__(self) -> int:
        return len(self.conns)

    def of(self, group: str) -> int:
        """How many of ``group`` are counted."""
        return self.by_group.get(group, 0)


class Bucket:
    """A token bucket: ``rate`` per second, ``burst`` seconds of it in reserve."""

    __slots__ = ("cap", "level", "rate", "t")

    def __init__(self, rate: float, burst_s: float) -> None:
        self.rate, self.cap = rate, rate * burst_s
        self.level = self.cap
        self.t = time.monotonic()

    def take(self, n: float, now: float) -> bool:
        """Take ``n`` at monotonic time ``now``; False once the bucket is overdrawn."""
        self.level = min(self.cap, self.level + (now - self.t) * self.rate)
        self.t = now
        self.level -= n
        return self.level >= 0


class PeerLog:
    """Warnings about peers, at most one per address every ``every_s`` seconds; the
    ones held back are counted and summed up every ``summary_s`` seconds."""

    def __init__(self, every_s: float, summary_s: float) -> None:
        self.every_s, self.summary_s = every_s, summary_s
        self._last: dict[str, float] = {}
        self._held = 0
        self._held_from: set[str] = set()
        self._next_summary = time.monotonic() + summary_s

    def __call__(self, addr: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(addr)
        if last is not None and now - last < self.every_s:
            self._held += 1
            if len(self._held_from) < 100_000:
                self._held_from.add(addr)
            return
        if len(self._last) > 10_000:
            self._last = {a: t for a, t in self._last.items() if now - t < self.every_s}
        self._last[addr] = now
        log.warning(msg, *args)

    def tick(self, now: float) -> None:
        """Log the count of the warnings held back, every ``summary_s``."""
        if now < self._next_summary:
            return
        self._next_summary = now + self.summary_s
        if self._held:
            log.warning("rtop hub: %d more refusals from %d address%s in the last %.0f s "
                        "were not logged one by one", self._held, len(self._held_from),
                        "" if len(self._held_from) == 1 else "es", self.summary_s)
        self._held = 0
        self._held_from.clear()


class Throttle:
    """Failed authentications per address; too many within a window block it a while."""

    def __init__(self, failures: int, window_s: float, block_s: float) -> None:
        self.failures, self.window_s, self.block_s = failures, window_s, block_s
        self._fails: dict[str, deque[float]] = {}
        self._blocked: dict[str, float] = {}

    def blocked(self, addr: str, now: float) -> bool:
        """Whether ``addr`` is refused at ``now``."""
        until = self._blocked.get(addr)
        if until is None:
            return False
        if now >= until:
            del self._blocked[addr]
            return False
        return True

    def fail(self, addr: str, now: float) -> bool:
        """Note a failure; True when it gets the address blocked."""
        times = self._fails.setdefault(addr, deque())
        times.append(now)
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) >= self.failures:
            self._blocked[addr] = now + self.block_s
            del self._fails[addr]
            return True
        return False

    def prune(self, now: float) -> None:
        """Forget failures and blocks that are over."""
        for addr in [a for a, t in self._fails.items() if not t or now - t[-1] > self.window_s]:
            del self._fails[addr]
        for addr in [a for a, until in self._blocked.items() if now >= until]:
            del self._blocked[addr]


class Admission:
    """The hub's connection limits (see the module doc): ``counters`` are the hub's,
    counted into (``throttled``, ``evicted``, ``busy``, ``refused``); ``peer_log`` is
    where refusals are logged."""

    def __init__(self, cfg: HubConfig, counters: dict[str, int], peer_log: PeerLog) -> None:
        self.cfg = cfg
        self.counters = counters
        self.peer_log = peer_log
        #: connections not yet authenticated, and the bytes of half frames they hold
        self.unauth = Quota(cfg.max_unauth, cfg.max_unauth_per_addr)
        self.unauth_pending = 0
        #: connections that speak HTTP
        self.https = Quota(cfg.max_http, cfg.max_http_per_addr)
        self.throttle = Throttle(cfg.throttle_failures, cfg.throttle_window_s,
                                 cfg.throttle_block_s)

    def throttles(self, addr: str) -> bool:
        """Whether failures from ``addr`` count towards blocking it (not loopback,
        unless the config says so)."""
        return self.cfg.throttle_loopback or not is_loopback(addr)

    def admit(self, conn: Admitted) -> None:
        """A new connection: refused at once if its address is throttled; else counted
        as unauthenticated, making room if the limits are reached by closing the oldest
        connection not yet authenticated (:meth:`make_room`)."""
        addr, now = conn.addr, time.monotonic()
        if self.throttles(addr) and self.throttle.blocked(addr, now):
            self.counters["throttled"] += 1
            conn.close()
            return
        self.make_room(self.unauth, conn, "not yet authenticated")
        conn.unauth = True
        self.unauth.add(conn)

    def admit_http(self, conn: Admitted) -> None:
        """The connection speaks HTTP: it is one of those now, within the HTTP limits
        (full: the oldest unfinished request goes, :meth:`make_room`)."""
        self.release(conn)
        self.make_room(self.https, conn, "speaking HTTP")
        conn.http_counted = True
        self.https.add(conn)

    def make_room(self, quota: Quota, conn: Admitted, what: str) -> None:
        """Close the oldest connection ``quota`` holds that keeps ``conn`` out (see
        :meth:`Quota.victim`): when full, the newcomer gets in and the oldest unfinished
        one goes, so stalled connections from a few addresses cannot lock others out."""
        while quota.full_for(conn.group):
            victim = quota.victim(conn.group)
            if victim is None:
                break
            self.counters["evicted"] += 1
            self.peer_log(victim.addr, "rtop hub: too many connections %s (%d, %d from "
                          "%s); closed the oldest, %r, to let %r in", what, len(quota),
                          quota.of(victim.group), victim.group, victim.who, conn.who)
            victim.close()
            self.release(victim)

    def release(self, conn: Admitted) -> None:
        """The connection authenticated, turned out to be HTTP, or closed."""
        if conn.unauth:
            conn.unauth = False
            self.unauth.remove(conn)
            self.unauth_pending -= conn.pending
            conn.pending = 0
        if conn.http_counted and conn.closing:
            conn.http_counted = False
            self.https.remove(conn)

    def hold(self, conn: Admitted, n: int) -> bool:
        """May an unauthenticated connection buffer ``n`` more bytes? If not, it is
        closed."""
        if self.unauth_pending + n <= self.cfg.max_unauth_pending_bytes:
            return True
        self.counters["busy"] += 1
        self.peer_log(conn.addr, "rtop hub: unauthenticated connections hold over %d "
                      "bytes; closed %r", self.cfg.max_unauth_pending_bytes, conn.who)
        conn.close()
        return False

    def held(self, conn: Admitted, pending: int) -> None:
        """An unauthenticated connection now holds ``pending`` bytes of a half frame."""
        self.unauth_pending += pending - conn.pending
        conn.pending = pending

    def failed(self, conn: Admitted) -> None:
        """A failed authentication (wrong proof, wrong HTTP token) from this address."""
        self.counters["refused"] += 1
        if self.throttles(conn.addr) and self.throttle.fail(conn.addr, time.monotonic()):
            log.warning("rtop hub: %r failed to authenticate %d times within %.0f s; "
                        "refusing it for %.0f s", conn.addr, self.cfg.throttle_failures,
                        self.cfg.throttle_window_s, self.cfg.throttle_block_s)

    def tick(self, now: float) -> None:
        """Housekeeping (monotonic ``now``): the peer log's summary, expired blocks."""
        self.peer_log.tick(now)
        self.throttle.prune(now)
