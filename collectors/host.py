"""Host sampler (psutil): the rank's process, its DataLoader workers, the machine."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger("collectors")

_CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def cgroup_memory_limit() -> int | None:
    """The memory limit of this process's cgroup in bytes, or None if there is none."""
    for path in _CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit():
            return None
        value = int(text)
        # cgroup v1 reports "no limit" as a huge page-aligned number.
        if value >= 1 << 60 or value >= psutil.virtual_memory().total * 16:
            return None
        return value
    return None


class HostSampler:
    """Samples CPU and memory of this process, its child processes and the machine.

    Child processes are the DataLoader's workers (``num_workers > 0``); their CPU is
    reported together as ``loader_cpu_pct``, 100 meaning one core busy.
    """

    def __init__(self, pid: int | None = None) -> None:
        self._proc = psutil.Process(pid or os.getpid())
        self._children: dict[int, psutil.Process] = {}
        self._cgroup_limit = cgroup_memory_limit()
        self._proc.cpu_percent(None)  # first call primes the counters
        psutil.cpu_percent(None)

    @property
    def cgroup_limit(self) -> int | None:
        """The cgroup memory limit found at start, if any."""
        return self._cgroup_limit

    def _child_pids(self) -> list[int] | None:
        """Direct children from /proc/<pid>/task/*/children (cheap); None if unavailable."""
        pids: list[int] = []
        try:
            tasks = os.listdir(f"/proc/{self._proc.pid}/task")
            for tid in tasks:
                with open(f"/proc/{self._proc.pid}/task/{tid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            return None
        return pids

    def _loader_cpu(self) -> tuple[float | None, int]:
        # psutil's children() scans every process on the machine (~1 ms); Linux lists a
        # process's children directly, which costs a few microseconds.
        pids = self._child_pids()
        try:
            if pids is None:
                kids = self._proc.children(recursive=True)
            else:
                kids = [self._children.get(pid) or psutil.Process(pid) for pid in pids]
        except psutil.Error:
            return None, 0
        seen: dict[int, psutil.Process] = {}
        total = 0.0
        for kid in kids:
            proc = self._children.get(kid.pid, kid)
            try:
                if kid.pid in self._children:
                    total += proc.cpu_percent(None)
                else:
                    proc.cpu_percent(None)  # primed now, counted from the next sample
            except psutil.Error:
                continue
            seen[kid.pid] = proc
        self._children = seen
        return total, len(seen)

    def sample(self, t_wall: float) -> list[Any]:
        """One row in the order of ``collectors.schema.HOST_FIELDS``."""
        try:
            proc_cpu: float | None = self._proc.cpu_percent(None)
            rss: int | None = int(self._proc.memory_info().rss)
        except psutil.Error:
            proc_cpu, rss = None, None
        loader_cpu, loader_procs = self._loader_cpu()
        vm = psutil.virtual_memory()
        try:
            load1: float | None = os.getloadavg()[0]
        except OSError:
            load1 = None
        return [
            t_wall,
            proc_cpu,
            loader_cpu,
            loader_procs,
            rss,
            int(vm.available),
            int(vm.total),
            self._cgroup_limit,
            psutil.cpu_percent(None),
            load1,
        ]
