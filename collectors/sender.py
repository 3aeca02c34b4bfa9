"""The sender thread: the only place a probe samples, resolves, encodes and sends.

One daemon thread per process. About twice a second (and whenever the hub sends a
frame) it takes the training thread's finished steps from the probe's hand-over
buffers and turns them into step records (:mod:`collectors.steps`, CUDA-timed steps
once their events have completed), runs its samplers (:mod:`collectors.samplers`:
heartbeat, memory, host, GPU) on their own period, packs everything into a batch
frame every ``flush_interval_s`` and hands frames to its :class:`HubConnection`
(:mod:`collectors.connection`), which writes them to the hub over a non-blocking
socket. A frame is either sent whole or dropped whole and counted; the hub never sees
half a frame from a healthy connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from collectors import wire
from collectors.connection import HubConnection
from collectors.control import Control
from collectors.groups import ProcessGroups
from collectors.logonce import LogOnce
from collectors.samplers import (
    GpuSampler,
    HeartbeatSampler,
    LazyHostSampler,
    Sampler,
    TableSampler,
)
from collectors.schema import TABLES
from collectors.steps import CollectiveWatch, StepContext, StepRecords

if TYPE_CHECKING:
    from collectors.probe import Probe

log = logging.getLogger("collectors")

#: A batch is flushed early once it holds this many records.
FLUSH_RECORDS = 2048
#: How often the perf_counter -> wall clock mapping is re-anchored.
CLOCK_REFRESH_S = 10.0
#: How often torch's process groups are looked over (``ProcessGroups.scan``).
GROUPS_SCAN_S = 5.0


class Sender(threading.Thread):
    """Samples, resolves, batches and sends one probe's records (see module doc).

    It reads the probe's hand-over buffers (``probe.records``, ``probe.events``) and
    the objects the probe owns (``probe.activity``, ``probe.comm``, ``probe.cuda``,
    ``probe.memory``, ``probe.notes``); it writes nothing on the probe. ``samplers``
    are run in order on every sample.
    """

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
        self._sample_last = True  # sample once more in the last round (not on a last word)
        self._once = LogOnce()
        # records waiting to be batched
        self._rows: dict[str, list[list[Any]]] = {key: [] for key in TABLES}
        self._n_rows = 0
        self._steps = StepRecords(self._cfg.cuda_resolve_timeout_s,
                                  on_error=self._step_error)
        self._bound_pool: Any = None  # the event pool whose device this thread is on
        #: the process groups the steps' collectives ran on (named, described in meta)
        self._groups = ProcessGroups()
        self._groups_sent = 0  # the generation of groups the last meta described
        self._groups_scan = 0.0  # when torch's groups are looked over next (monotonic)
        self._collective = CollectiveWatch()
        self._seq = 0
        self._meta_dirty = True
        self._notes_sent: list[str] | None = None
        self._figures_sent: dict[str, Any] = {}
        self._unencoded = 0  # records lost because their batch could not be encoded
        # samplers, run on this thread
        self._gpu = GpuSampler(probe.identity.local_rank, nvml, training_device=self._device)
        self._gpu_generation = 0
        probe.memory.process_bytes = self._gpu.process_memory
        self.samplers: list[Sampler] = [
            HeartbeatSampler(probe.activity, lambda: probe.step_count,
                             self._cfg.stack_after_s, gpu_collective=self._gpu_collective),
            TableSampler("mem", probe.memory.sample),
            LazyHostSampler(),
            self._gpu,
        ]
        #: The rank's side of the control channel (the hub's actions)
        self.control = Control(probe, self._wake)
        self.connection = HubConnection(
            self._cfg, probe.identity, collector_info=self._collector_info,
            on_connect=self._on_connect, on_control=self.control.on_control,
        )

    # ---- called from other threads ----------------------------------------------

    @property
    def dropped_unsent(self) -> int:
        """Records made into batches that never reached the hub."""
        return self.connection.dropped_unsent + self._unencoded

    def stats(self) -> dict[str, int]:
        """Counters of this sender (read without locking; monotonic)."""
        return {**self.connection.stats(), "dropped_unsent": self.dropped_unsent}

    def dropped_total(self) -> int:
        """Records lost so far: buffer full on the training side, or never sent."""
        return self._p.dropped_buffer + self.dropped_unsent

    def use_cuda_device(self, index: int) -> None:
        """The training device is ``cuda:index``: sample that GPU with NVML."""
        self._gpu.use_cuda_device(index)

    def _wake(self) -> None:
        """Wake the thread now (an action's answer is waiting to go out)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def stop(self, timeout: float, wait_s: float | None = None, *,
             sample: bool = True) -> None:
        """Flush within ``timeout`` seconds, then end the thread, waiting for it at most
        ``wait_s`` seconds (default ``timeout`` and half a second, and the spool's time
        when no hub takes the last records: ``spool_timeout_s``). ``sample=False``
        skips the last round's samples (a last word, in a hurry). Never hangs."""
        self._sample_last = sample
        self._deadline = time.monotonic() + max(0.0, timeout)
        self._stop_evt.set()
        self._wake()
        if self.is_alive() and threading.current_thread() is not self:
            spool_s = max(0.0, self._cfg.spool_timeout_s) if self._cfg.spool else 0.0
            self.join(timeout + 0.5 + spool_s if wait_s is None else max(0.0, wait_s))

    # ---- the thread --------------------------------------------------------------

    def run(self) -> None:
        """Loop until stopped; a bug here ends rtop's thread, never the training job."""
        next_sample = 0.0
        flush_s = self._cfg.flush_every(self._p.identity.world_size)
        next_flush = time.monotonic() + flush_s
        next_clock = time.monotonic() + CLOCK_REFRESH_S
        tick = max(0.05, min(flush_s, self._cfg.sample_interval_s))
        try:
            while True:
                stopping = self._stop_evt.is_set()
                now = time.monotonic()
                if stopping:
                    # the last round: each part guarded on its own, so that the goodbye
                    # (carrying the job's exit error) goes out whatever fails before it
                    parts = [self._final_drain, self._sample, self._flush, self._answers]
                    if not self._sample_last:
                        parts.remove(self._sample)  # a last word, in a hurry
                    for part in parts:
                        try:
                            part()
                        except Exception as exc:
                            self._once(f"final-{part.__name__}", logging.WARNING,
                                       "rtop: the collector's last %s failed: %r",
                                       part.__name__.strip("_"), exc)
                    self._finish()
                    return
                self._guarded("drain", self._drain_steps)
                if now >= next_sample:
                    self._sample()
                    next_sample = now + self._cfg.sample_interval_s
                if now >= next_flush or self._n_rows >= FLUSH_RECORDS:
                    self._guarded("flush", self._flush)
                    next_flush = now + flush_s
                if now >= next_clock:
                    self._steps.clock.refresh()
                    next_clock = now + CLOCK_REFRESH_S
                self._guarded("answers", self._answers)
                self.connection.pump(now)
                self._sleep(min(tick, max(0.0, min(next_flush, next_sample) - now) + 0.001))
        except Exception:
            log.exception("rtop: the collector's sender thread stopped on an error")
        finally:
            self.connection.close()
            for sampler in self.samplers:
                try:
                    sampler.close()
                except Exception as exc:
                    log.debug("rtop: closing the %s sampler failed: %r", sampler.name, exc)
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _answers(self) -> None:
        """Hand the control channel's queued answers to the connection."""
        self.control.flush(self.connection.queue_frame)

    def _guarded(self, what: str, part: Any) -> None:
        """Run one part of a round; an error is logged once and the thread goes on."""
        try:
            part()
        except Exception as exc:
            self._once(f"part-{what}", logging.WARNING,
                       "rtop: the collector's %s failed (it goes on): %r", what, exc)

    def _sleep(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the hub to send something, or for stop()."""
        readers: list[Any] = [self._wake_r]
        writers: list[Any] = []
        sock = self.connection.socket
        if sock is not None:
            readers.append(sock)
            if self.connection.wants_write:
                writers.append(sock)  # a stalled write resumes as soon as it can
        try:
            ready, _, _ = select.select(readers, writers, [], timeout)
        except (OSError, ValueError):
            time.sleep(timeout)
            return
        if self._wake_r in ready:
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 64)

    # ---- steps -------------------------------------------------------------------

    def _final_drain(self) -> None:
        self._drain_steps(final=True)

    def _bind_cuda(self) -> None:
        """Before this thread's first CUDA call: make the watched device current here
        (a new thread starts on device 0, where a query would open a CUDA context)."""
        pool = self._p.cuda
        if pool is None or pool is self._bound_pool:
            return
        self._bound_pool = pool
        try:
            pool.bind_thread()
        except Exception as exc:
            pool.fail(f"the collector's thread could not use cuda:{pool.device}: "
                      f"{type(exc).__name__}: {exc}")

    def _step_error(self, exc: BaseException) -> None:
        """A step's events could not be read (a CUDA error): those steps are sent with
        GPU figures not measured, and CUDA timing is turned off."""
        self._once("step-error", logging.WARNING,
                   "rtop: reading a step's CUDA events failed; the step is sent without "
                   "GPU figures and CUDA timing is off from now on: %r", exc)
        pool = self._p.cuda
        if pool is not None and isinstance(exc, RuntimeError):
            pool.fail(f"reading CUDA events failed: {type(exc).__name__}: {exc}")

    def _gpu_collective(self) -> float | None:
        """``perf_counter`` time since which the GPU has sat in one collective, if the
        comm hook's CUDA events say it does (the heartbeat then reports "comm")."""
        p = self._p
        if p.cuda is None and self._steps.pending.oldest() is None:
            return None
        lists: list[list[Any]] = []
        oldest = self._steps.pending.oldest()
        if oldest is not None:
            lists.append(oldest.buckets())
        live = p.comm.buckets
        if live:
            lists.append(live)
        return self._collective.check(lists, time.perf_counter()) if lists else None

    def _device(self) -> int | None:
        """The training thread's current CUDA device (asked for at its next step)."""
        p = self._p
        if p.cuda_device is None:
            p.device_wanted = True
        return p.cuda_device

    def _drain_steps(self, final: bool = False) -> None:
        self._bind_cuda()
        p = self._p
        comm = p.comm
        now = time.monotonic()
        if now >= self._groups_scan:  # a group a step's collectives did not run on yet
            self._groups_scan = now + GROUPS_SCAN_S
            self._groups.scan()
        ref = comm.ddp_ref
        model = ref() if ref is not None else None
        context = StepContext(p.flops_per_step, self._groups,
                              getattr(model, "process_group", None))
        rows = self._steps.drain(p.records, p.cuda, world=comm.world, nbytes=comm.nbytes,
                                 now=now, final=final, context=context)
        self._rows["steps"] += rows
        self._n_rows += len(rows)
        events = p.events
        wall = self._steps.clock.wall
        while events:
            t0, kind, duration, step = events.popleft()
            self._add("events", [wall(t0), kind, duration, step])

    def _add(self, table: str, row: list[Any]) -> None:
        self._rows[table].append(row)
        self._n_rows += 1

    # ---- sampling ----------------------------------------------------------------

    def _sample(self) -> None:
        now_wall = time.time()
        for sampler in self.samplers:
            try:
                records = sampler.sample(now_wall)
            except Exception as exc:
                self._once(f"sample-{sampler.name}", logging.WARNING,
                           "rtop: %s sampling failed: %r", sampler.name, exc)
                continue
            for table, row in records:
                self._add(table, row)

    # ---- batching ----------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        p = self._p
        meta = {
            **p.figures,  # an integration's figures (collectors.raytrain: "ray_data")
            "notes": list(p.notes),
            "device": self._gpu.info(),
            "device_reason": self._gpu.reason(),
            "mem_device": p.memory.device,
            "comm_measured": p.comm.measured,
            "cuda_timing": p.cuda is not None,
        }
        groups = self._groups.described()
        if groups:  # the process groups its collectives ran on (collectors.groups)
            meta["groups"] = groups
        self._groups_sent = self._groups.generation
        return meta

    def _flush(self) -> None:
        notes, figures = self._p.notes, self._p.figures
        if self._meta_dirty or self._gpu.generation != self._gpu_generation \
                or notes != self._notes_sent or figures != self._figures_sent \
                or self._groups.generation != self._groups_sent:
            self._meta_dirty = False
            self._gpu_generation = self._gpu.generation
            self._notes_sent = list(notes)
            self._figures_sent = dict(figures)
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
            self._unencoded += n
            return
        self.connection.send(frame, n, self._seq)

    # ---- the connection's callbacks ----------------------------------------------

    def _on_connect(self) -> None:
        self._meta_dirty = True  # a new connection (perhaps a new hub) gets the meta again

    def _collector_info(self) -> dict[str, Any]:
        from collectors import __version__

        torch = sys.modules.get("torch")
        return {
            "version": __version__,
            "python": sys.version.split()[0],
            "torch": getattr(torch, "__version__", None),
            "dropped": self.dropped_total(),
        }

    def _bye(self) -> dict[str, Any]:
        p = self._p
        return {"rank": p.identity.rank, "group": p.identity.group,
                "dropped": self.dropped_total(), "reason": p.exit_reason,
                "error": p.exit_error}

    def _finish(self) -> None:
        """Last flush on close: send what can be sent before the deadline, then bye."""
        deadline = self._deadline if self._deadline is not None else time.monotonic() + 1.0
        self.connection.finish(deadline, self._bye)
