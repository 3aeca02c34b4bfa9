"""The sender thread: the only place a probe samples, resolves, encodes and sends.

One daemon thread per process. About twice a second (and whenever the hub sends a
frame) it takes the training thread's finished steps, turns them into step records
(resolving CUDA events that have completed), samples GPU / host / memory / heartbeat
on their own period, packs everything into a batch frame every ``flush_interval_s``
and writes frames to the hub over a non-blocking socket. A frame is either sent whole
or dropped whole and counted; the hub never sees half a frame from a healthy
connection.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import select
import socket
import sys
import threading
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any

from collectors import wire
from collectors.cuda_events import seconds_between
from collectors.schema import TABLES
from collectors.timeline import comm_figures, span_comm_figures

if TYPE_CHECKING:
    from collectors.probe import Probe, RawStep

log = logging.getLogger("collectors")

MAX_STACK_CHARS = 16_000
STACK_REPEAT_S = 5.0
RECV_BYTES = 65536


def parse_hub(address: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) to a tuple; raises ValueError when malformed."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"hub address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class _Once:
    """Logs a message the first time a key is seen, then stays quiet."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, key: str, level: int, msg: str, *args: Any) -> None:
        if key not in self._seen:
            self._seen.add(key)
            log.log(level, msg, *args)


class Sender(threading.Thread):
    """Samples, resolves, batches and sends one probe's records (see module doc)."""

    def __init__(self, probe: Probe, nvml: Any = None) -> None:
        super().__init__(name="rtop-sender", daemon=True)
        self._p = probe
        self._cfg = probe.config
        self._stop_evt = threading.Event()
        # The thread sleeps in select() on the hub socket and this pipe: it wakes for a
        # frame from the hub (a ping is answered at once) or for stop(), else once a
        # flush interval: a couple of wake-ups a second in all.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._deadline: float | None = None
        self._once = _Once()
        self._finishing = False
        # records waiting to be batched
        self._rows: dict[str, list[list[Any]]] = {key: [] for key in TABLES}
        self._n_rows = 0
        self._cuda_pending: deque[tuple[RawStep, float]] = deque()
        self._meta_dirty = True
        # samplers, made on the sender thread
        self._nvml_module = nvml
        self._nvml: Any = None
        self._nvml_args: dict[str, Any] | None = None
        self._host: Any = None
        self._last_stack_t = -1e9
        # clock map perf_counter -> wall
        self._wall0 = time.time()
        self._pc0 = time.perf_counter()
        # connection
        self._sock: socket.socket | None = None
        self._state = "down"  # down | hello | up
        self._hello_deadline = 0.0
        self._decoder = wire.FrameDecoder()
        self._outbox: deque[tuple[bytes, int]] = deque()  # encoded frames not yet started
        self._writing: deque[list[Any]] = deque()  # [memoryview, records] being written
        self._next_connect = 0.0
        self._backoff = self._cfg.backoff_initial_s
        self._seq = 0
        self._hub_info: dict[str, Any] = {}
        # counters
        self.sent_records = 0
        self.sent_frames = 0
        self.dropped_unsent = 0
        self.connects = 0
        self.connect_failures = 0
        self.refusals = 0

    # ---- called from other threads ----------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters of this sender (read without locking; monotonic)."""
        return {
            "sent_records": self.sent_records,
            "sent_frames": self.sent_frames,
            "dropped_unsent": self.dropped_unsent,
            "connects": self.connects,
            "connect_failures": self.connect_failures,
            "refusals": self.refusals,
            "connected": int(self._state == "up"),
        }

    def use_cuda_device(self, index: int) -> None:
        """The training device is ``cuda:index``: sample that GPU with NVML."""
        args: dict[str, Any] = {"cuda_index": index, "local_rank": self._p.identity.local_rank}
        try:
            import torch

            props = torch.cuda.get_device_properties(index)
            uuid = getattr(props, "uuid", None)
            if uuid is not None:
                args["uuid"] = str(uuid)
            bus = getattr(props, "pci_bus_id", None)
            if bus is not None:
                domain = getattr(props, "pci_domain_id", 0)
                device = getattr(props, "pci_device_id", 0)
                args["pci_bus_id"] = f"{domain:08x}:{bus:02x}:{device:02x}.0"
        except Exception:
            pass
        self._nvml_args = args

    def stop(self, timeout: float) -> None:
        """Flush within ``timeout`` seconds, then end the thread. Never hangs."""
        self._deadline = time.monotonic() + max(0.0, timeout)
        self._stop_evt.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout + 0.5)

    # ---- the thread --------------------------------------------------------------

    def run(self) -> None:
        """Loop until stopped; a bug here ends rtop's thread, never the training job."""
        next_sample = 0.0
        next_flush = time.monotonic() + self._cfg.flush_interval_s
        next_clock = time.monotonic() + 10.0
        tick = max(0.05, min(self._cfg.flush_interval_s, self._cfg.sample_interval_s))
        try:
            while True:
                stopping = self._stop_evt.is_set()
                now = time.monotonic()
                self._drain_steps(final=stopping)
                if now >= next_sample or stopping:
                    self._sample()
                    next_sample = now + self._cfg.sample_interval_s
                if now >= next_flush or stopping or self._n_rows >= 2048:
                    self._flush()
                    next_flush = now + self._cfg.flush_interval_s
                if now >= next_clock:
                    self._wall0, self._pc0 = time.time(), time.perf_counter()
                    next_clock = now + 10.0
                if stopping:
                    self._finish()
                    return
                self._pump(now)
                self._sleep(min(tick, max(0.0, min(next_flush, next_sample) - now) + 0.001))
        except Exception:
            log.exception("rtop: the collector's sender thread stopped on an error")
        finally:
            self._close_socket()
            if self._nvml is not None:
                self._nvml.close()
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _sleep(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the hub to send something, or for stop()."""
        readers: list[Any] = [self._wake_r]
        writers: list[Any] = []
        if self._sock is not None:
            readers.append(self._sock)
            if self._writing and self._state == "up":
                writers.append(self._sock)  # a stalled write resumes as soon as it can
        try:
            ready, _, _ = select.select(readers, writers, [], timeout)
        except (OSError, ValueError):
            time.sleep(timeout)
            return
        if self._wake_r in ready:
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 64)

    # ---- steps -------------------------------------------------------------------

    def _wall(self, pc: float) -> float:
        return self._wall0 + (pc - self._pc0)

    def _drain_steps(self, final: bool = False) -> None:
        records = self._p._records
        while records:
            raw = records.popleft()
            if raw[8] is not None:
                self._cuda_pending.append((raw, time.monotonic()))
            else:
                self._add("steps", self._step_row(raw, None))
        events = self._p._events
        while events:
            t0, kind, duration, step = events.popleft()
            self._add("events", [self._wall(t0), kind, duration, step])
        while self._cuda_pending:
            raw, queued = self._cuda_pending[0]
            resolved = self._resolve_cuda(raw)
            if resolved is None:
                waited = time.monotonic() - queued
                if not final and waited < self._cfg.cuda_resolve_timeout_s:
                    break
                resolved = (None, None)
            self._cuda_pending.popleft()
            self._add("steps", self._step_row(raw, resolved))

    def _resolve_cuda(self, raw: RawStep) -> tuple[float | None, list[Any] | None] | None:
        """GPU seconds of the step and its buckets on the GPU timeline, once complete."""
        pair = raw[8]
        assert pair is not None
        start, end = pair
        buckets = raw[6] if isinstance(raw[6], list) else []  # CUDA: the comm hook's
        events = [start, end] + [e for b in buckets for e in (b[0], b[1])]
        if any(e is not None and not e.query() for e in events):
            return None
        pool = self._p._cuda
        try:
            gpu_s = seconds_between(start, end)
            gpu_buckets = [
                [
                    seconds_between(start, b[0]),
                    seconds_between(start, b[1]) if b[1] is not None else gpu_s,
                    b[2],
                ]
                for b in buckets
            ]
        finally:
            if pool is not None:
                pool.release(*events)
        return gpu_s, gpu_buckets

    def _step_row(
        self, raw: RawStep, gpu: tuple[float | None, list[Any] | None] | None
    ) -> list[Any]:
        step, t_start, wait, t_enter, t_exit, samples, buckets, gap, _ = raw
        body = t_exit - t_enter
        gpu_s = gpu[0] if gpu is not None else None
        comm: tuple[Any, ...] = (None,) * 6
        if gpu is not None:
            if gpu[1] is not None and buckets is not None:
                comm = comm_figures([tuple(b) for b in gpu[1]], self._p._comm_world)
        elif isinstance(buckets, tuple):
            comm = self._ddp_comm(buckets, t_enter, t_exit)
        elif buckets is not None:
            comm = comm_figures(
                [(b[0], b[1] if b[1] is not None else t_exit, b[2]) for b in buckets],
                self._p._comm_world,
            )
        exposed = comm[1]
        if gpu_s is not None:
            compute = max(0.0, gpu_s - (exposed or 0.0))
        else:
            compute = max(0.0, body - min(exposed or 0.0, body))
        step_s = (t_exit - t_start) + (gap or 0.0)
        return [
            step, self._wall(t_start), step_s, wait, compute, gpu_s, *comm, samples, gap,
        ]

    def _ddp_comm(
        self, stamps: tuple[int, ...], t_enter: float, t_exit: float
    ) -> tuple[Any, ...]:
        """A step's collective figures from DDP's own stamps (``collectors.ddptimer``)."""
        if not stamps:
            return 0.0, 0.0, 0, 0, None, None  # no synchronized backward in this step
        start_ns, compute_end_ns, end_ns, calls, exit_ns = stamps
        if start_ns <= 0 or end_ns < start_ns:
            return (None,) * 6

        def perf(ns: int) -> float:  # time.time_ns's clock to time.perf_counter's
            return t_exit - (exit_ns - ns) / 1e9

        if perf(end_ns) < t_enter - 0.001:  # an earlier step's stamps: no allreduce here
            return 0.0, 0.0, 0, 0, None, None

        return span_comm_figures(
            perf(start_ns), perf(compute_end_ns) if compute_end_ns > 0 else perf(start_ns),
            perf(end_ns), self._p._comm_bytes, calls, self._p._comm_world,
        )

    def _add(self, table: str, row: list[Any]) -> None:
        self._rows[table].append(row)
        self._n_rows += 1

    # ---- sampling ----------------------------------------------------------------

    def _sample(self) -> None:
        now_wall = time.time()
        self._sample_one("hb", self._heartbeat, now_wall)
        self._sample_one("mem", self._p.memory.sample, now_wall)
        if self._host is None:
            try:
                from collectors.host import HostSampler

                self._host = HostSampler()
            except Exception as exc:
                self._once("host-init", logging.WARNING, "rtop: no host sampling: %r", exc)
        if self._host is not None:
            self._sample_one("host", self._host.sample, now_wall)
        nvml = self._nvml_sampler()
        if nvml is not None:
            self._sample_one("gpu", nvml.sample, now_wall)

    def _sample_one(self, table: str, fn: Any, now_wall: float) -> None:
        try:
            row = fn(now_wall)
        except Exception as exc:
            self._once(f"sample-{table}", logging.WARNING, "rtop: %s sampling failed: %r",
                       table, exc)
            return
        if row is not None:
            self._add(table, row)

    def _nvml_sampler(self) -> Any:
        """The NVML sampler for the rank's GPU; made once the rank is known to use one."""
        args = self._nvml_args
        if args is None and "torch" in sys.modules:
            torch = sys.modules["torch"]
            try:
                if torch.cuda.is_initialized():
                    args = {"local_rank": self._p.identity.local_rank}
                    self._nvml_args = args
            except Exception:
                args = None
        if args is None:
            return None
        if self._nvml is None or getattr(self._nvml, "_rtop_args", None) is not args:
            from collectors.nvml import NvmlSampler

            if self._nvml is not None:
                self._nvml.close()
            self._nvml = NvmlSampler(nvml=self._nvml_module, **args)
            self._nvml._rtop_args = args
            self._meta_dirty = True
        return self._nvml if self._nvml.available else None

    def _heartbeat(self, now_wall: float) -> list[Any]:
        p = self._p
        phase, since = p._phase, p._phase_t
        phase_s = max(0.0, time.perf_counter() - since)
        stack = None
        now = time.monotonic()
        if (
            phase_s >= self._cfg.stack_after_s
            and p._train_tid is not None
            and now - self._last_stack_t >= STACK_REPEAT_S
        ):
            frame = sys._current_frames().get(p._train_tid)
            if frame is not None:
                stack = "".join(traceback.format_stack(frame, limit=60))[-MAX_STACK_CHARS:]
                self._last_stack_t = now
        return [now_wall, phase, phase_s, p._step - 1, stack]

    # ---- batching ----------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        nvml = self._nvml
        return {
            "notes": list(self._p.notes),
            "device": nvml.info() if nvml is not None and nvml.available else None,
            "mem_device": self._p.memory.device,
            "comm_measured": self._p._comm is not None or self._p._ddp_logger is not None,
            "cuda_timing": self._p._cuda is not None,
        }

    def _flush(self) -> None:
        if self._meta_dirty or self._p.notes != self._hub_info.get("notes_sent"):
            self._meta_dirty = False
            self._hub_info["notes_sent"] = list(self._p.notes)
            include_meta = True
        else:
            include_meta = False
        if not self._n_rows and not include_meta:
            return
        self._seq += 1
        payload: dict[str, Any] = {
            "rank": self._p.identity.rank,
            "group": self._p.identity.group,
            "seq": self._seq,
            "t_wall": time.time(),
            "dropped": self.dropped_total(),
            # this thread's own CPU time: the hub shows rtop's cost to the job
            "cpu_s": time.thread_time(),
        }
        if include_meta:
            payload["meta"] = self._meta()
        for key, rows in self._rows.items():
            if rows:
                payload[key] = rows
        n = self._n_rows
        self._rows = {key: [] for key in TABLES}
        self._n_rows = 0
        try:
            frame = wire.encode(wire.KIND_BATCH, payload)
        except Exception as exc:
            self._once("encode", logging.WARNING, "rtop: could not encode a batch: %r", exc)
            self.dropped_unsent += n
            return
        self._outbox.append((frame, n))
        while len(self._outbox) > self._cfg.backlog_frames:
            _, lost = self._outbox.popleft()
            self.dropped_unsent += lost

    def dropped_total(self) -> int:
        """Records lost so far: buffer full on the training side, or never sent."""
        return self._p.dropped_buffer + self.dropped_unsent

    # ---- connection --------------------------------------------------------------

    def resolve_hub(self) -> tuple[str, int, str | None] | None:
        """The hub to connect to: configured, or discovered (see collectors.discovery).

        While closing, only an existing hub is looked up; none is started.
        """
        from collectors.discovery import resolve

        return resolve(self._p.identity, self._cfg.hub, self._cfg.token,
                       allow_spawn=not self._finishing)

    def _connect(self, now: float, timeout: float) -> None:
        try:
            target = self.resolve_hub()
        except Exception as exc:
            self._once("hub-addr", logging.WARNING, "rtop: no usable hub address: %s", exc)
            target = None
        if target is None:
            self._next_connect = now + self._cfg.backoff_max_s
            return
        host, port, token = target
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            self.connect_failures += 1
            self._once(
                f"connect-{host}:{port}", logging.INFO,
                "rtop: hub %s:%s not reachable (%s); training continues, retrying", host, port,
                exc.strerror or exc,
            )
            self._schedule_retry(now)
            return
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._decoder = wire.FrameDecoder()
        self._state = "hello"
        self._hello_deadline = now + self._cfg.welcome_timeout_s
        self._meta_dirty = True
        ident = self._p.identity
        hello = {
            "role": "rank",
            "token": token or "",
            "identity": ident.to_wire(),
            "clock": {"t_wall": time.time(), "t_mono": time.monotonic()},
            "collector": self._collector_info(),
        }
        self._writing.appendleft([memoryview(wire.encode(wire.KIND_HELLO, hello)), 0])

    def _collector_info(self) -> dict[str, Any]:
        from collectors import __version__

        torch = sys.modules.get("torch")
        return {
            "version": __version__,
            "python": sys.version.split()[0],
            "torch": getattr(torch, "__version__", None),
            "dropped": self.dropped_total(),
        }

    def _schedule_retry(self, now: float) -> None:
        jitter = 0.8 + 0.4 * random.random()
        self._next_connect = now + self._backoff * jitter
        self._backoff = min(self._backoff * 2.0, self._cfg.backoff_max_s)

    def _close_socket(self, requeue: bool = True) -> None:
        sock, self._sock = self._sock, None
        self._state = "down"
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        # A frame cut mid-write is lost; frames not started go back to the outbox.
        if self._writing:
            head = self._writing.popleft()
            total = len(head[0].obj)
            if len(head[0]) < total or not requeue:
                self.dropped_unsent += head[1]
            else:
                self._writing.appendleft(head)
        while self._writing:
            view, n = self._writing.pop()
            if n and requeue:
                self._outbox.appendleft((bytes(view), n))
            elif n:
                self.dropped_unsent += n

    def _pump(self, now: float) -> None:
        """Connect when due, read what the hub sent, write what is waiting."""
        if self._sock is None:
            if now < self._next_connect:
                return
            self._connect(now, self._cfg.connect_timeout_s)
        self._service(now)

    def _service(self, now: float) -> None:
        if self._sock is None:
            return
        if self._state == "hello" and now > self._hello_deadline:
            self._once("welcome", logging.WARNING, "rtop: hub did not answer the hello; retrying")
            self._close_socket()
            self._schedule_retry(now)
            return
        if not self._read(now):
            return
        if self._state == "up":
            while self._outbox and len(self._writing) < 8:
                frame, n = self._outbox.popleft()
                self._writing.append([memoryview(frame), n])
        self._write(now)

    def _read(self, now: float) -> bool:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                data = sock.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:
                self._lost(now, f"connection error: {exc}")
                return False
            if not data:
                self._lost(now, "hub closed the connection")
                return False
            try:
                frames = self._decoder.feed(data)
            except wire.WireError as exc:
                self._lost(now, f"bad frame from hub: {exc}")
                return False
            for frame in frames:
                self._on_frame(now, frame)
                if self._sock is None:
                    return False

    def _on_frame(self, now: float, frame: wire.Frame) -> None:
        if frame.kind == wire.KIND_WELCOME:
            self._state = "up"
            self.connects += 1
            self._backoff = self._cfg.backoff_initial_s
            self._hub_info.update(frame.payload)
            log.debug("rtop: connected to hub")
        elif frame.kind == wire.KIND_PING:
            pong = {
                "t_hub": frame.payload.get("t_hub"),
                "t_rank": time.time(),
                "seq": frame.payload.get("seq"),
            }
            self._writing.append([memoryview(wire.encode(wire.KIND_PONG, pong)), 0])
        elif frame.kind == wire.KIND_ERROR:
            self.refusals += 1
            self._once(
                f"refused-{frame.payload.get('code')}", logging.WARNING,
                "rtop: hub refused this rank: %s", frame.payload.get("message", "no reason"),
            )
            self._close_socket()
            self._backoff = self._cfg.backoff_max_s
            self._schedule_retry(now)
        # other kinds (control frames of later versions) are ignored by this collector

    def _lost(self, now: float, why: str) -> None:
        self._once(f"lost-{why}", logging.INFO, "rtop: %s; training continues, retrying", why)
        self._close_socket()
        self._schedule_retry(now)

    def _write(self, now: float) -> None:
        sock = self._sock
        while sock is not None and self._writing:
            head = self._writing[0]
            try:
                sent = sock.send(head[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return
                self._lost(now, f"send failed: {exc.strerror or exc}")
                return
            head[0] = head[0][sent:]
            if len(head[0]) == 0:
                self._writing.popleft()
                if head[1]:
                    self.sent_frames += 1
                    self.sent_records += head[1]

    def _finish(self) -> None:
        """Last flush on close: send what can be sent before the deadline, then bye."""
        deadline = self._deadline if self._deadline is not None else time.monotonic() + 1.0
        self._finishing = True
        bye_queued = False
        if self._sock is None and deadline > time.monotonic():
            # one last attempt, bounded by the deadline
            self._connect(time.monotonic(), min(self._cfg.connect_timeout_s,
                                                deadline - time.monotonic()))
        while self._sock is not None:
            now = time.monotonic()
            if now >= deadline:
                break
            if self._state == "up" and not self._outbox and not self._writing:
                if bye_queued:
                    break
                bye = {"rank": self._p.identity.rank, "group": self._p.identity.group,
                       "dropped": self.dropped_total(), "reason": self._p.exit_reason,
                       "error": self._p.exit_error}
                self._writing.append([memoryview(wire.encode(wire.KIND_BYE, bye)), 0])
                bye_queued = True
            self._service(now)
            if self._sock is None or (bye_queued and not self._writing):
                break
            select.select([self._sock], [self._sock] if self._writing else [], [],
                          min(0.05, max(0.0, deadline - now)))
        unsent = sum(n for _, n in self._outbox) + sum(w[1] for w in self._writing)
        self.dropped_unsent += unsent
        self._outbox.clear()
        self._writing.clear()
