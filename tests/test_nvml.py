"""Tests of collectors.nvml against a fake NVML that behaves like pynvml on an 8x H200 node.

The fake is a module-like namespace holding the *real* pynvml constants, exception
classes and ctypes result structs (so the sampler's except-clauses and attribute reads
are the ones that run against the real library); only the C library behind the
functions is replaced. One test runs the real pynvml on this machine.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from collectors.nvml import (
    CLOCK_EVENT_REASONS,
    THROTTLE_REASONS,
    NvmlSampler,
    decode_reasons,
)
from collectors.schema import GPU_FIELDS

ROOT = Path(__file__).resolve().parent.parent

# An HGX H200 board: eight GPUs, in NVML (PCI bus) order.
UUIDS = [
    "GPU-8f1c2f6e-3b7a-4d51-9a0e-5c2d7b1e9f40",
    "GPU-1d0e5a7b-9c42-4f3e-8b6d-2a7c9e0f1b53",
    "GPU-c3a9e1f0-7d25-4b86-a1e4-6f8b2d0c9a17",
    "GPU-5e7b0c2d-1a93-4e6f-b8d0-3c9a7f2e4b61",
    "GPU-9a2f4d6c-8e1b-4c70-9f3a-1b5d7e9c0a28",
    "GPU-2b8d6f0a-4c1e-4a97-8e5b-7d3f1a9c6e05",
    "GPU-7c4e2a9f-6b3d-4e18-a0c7-9e1b5d3f8a72",
    "GPU-e0b3c5a7-2f9d-4b6e-9c1a-8f4d6b2e0c39",
]
BUS_IDS = [
    "00000000:19:00.0",
    "00000000:3B:00.0",
    "00000000:4C:00.0",
    "00000000:5D:00.0",
    "00000000:9B:00.0",
    "00000000:BB:00.0",
    "00000000:CB:00.0",
    "00000000:DB:00.0",
]
MEM_TOTAL = 150754820096  # 143771 MiB
MEM_USED = 98_765_432_832
POWER_MW = 452_310
POWER_LIMIT_MW = 700_000
TEMP_C = 62
SM_MHZ = 1755
SM_MAX_MHZ = 1980
MEM_CLOCK_MHZ = 3201  # returned for NVML_CLOCK_MEM: catches a wrong clock type
UTIL_GPU, UTIL_MEM = 97, 45
PCIE_TX_KBPS, PCIE_RX_KBPS = 1_843_200, 3_276_800
NVLINK_LINKS = 18
NVLINK_TX_STEP_KIB = 341_796_875  # ~350 GB sent between two reads
NVLINK_RX_STEP_KIB = 292_968_750  # ~300 GB received
# The running boost clock is held back by the power cap.
REASONS = pynvml.nvmlClocksEventReasonSwPowerCap
DRIVER = "570.124.06"
CUDA_DRIVER = 12080
ALL_LINKS = 0xFFFFFFFF
# Cumulative PCIe byte counters (NVML_FI_DEV_PCIE_COUNT_*_BYTES), and what one read adds.
PCIE_TX_BYTES0, PCIE_RX_BYTES0 = 7_312_345_678_901, 9_876_123_456_789
PCIE_TX_STEP_BYTES = 3_221_225_472  # 3 GiB between two reads
PCIE_RX_STEP_BYTES = 6_442_450_944  # 6 GiB
NVLINK_FIDS = {
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
}
PCIE_FIDS = {pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES}

# Board MIG_BOARD of a FakeNvml(mig_board=MIG_BOARD) is in MIG mode, cut in two 3g.71gb
# instances (torch reports their UUIDs without the "MIG-" prefix).
MIG_BOARD = 3
MIG_UUIDS = [
    "MIG-4f5a8c2e-1b3d-5e7f-9a0c-2d4e6f8a0b1c",
    "MIG-b7e1d3c5-9f2a-5b4d-8c6e-0a1f3d5b7e92",
]
MIG_NAME = "NVIDIA H200 MIG 3g.71gb"
MIG_MEM_TOTAL = 74_625_056_768  # 71168 MiB
MIG_MEM_USED = [41_943_040_000, 12_582_912_000]
# Compute processes NVML lists on the sampler's GPU: (pid, usedGpuMemory or None).
MY_PID = os.getpid()
OTHER_PID = 4_190_001
PROCESSES = [(OTHER_PID, 1_610_612_736), (MY_PID, 21_474_836_480)]


def _parse_bus_id(text: str) -> tuple[int, int, int, int]:
    """NVML accepts ``[domain:]bus:device[.function]``, hex, with any width."""
    parts = text.strip().split(":")
    domain = int(parts[0], 16) if len(parts) == 3 else 0
    bus = int(parts[-2], 16)
    dev, _, fn = parts[-1].partition(".")
    return domain, bus, int(dev, 16), int(fn or "0", 16)


class FakeHandle:
    """Stands for ``c_nvmlDevice_t`` of a whole GPU."""

    def __init__(self, index: int) -> None:
        self.index = index


class FakeMigHandle:
    """Stands for ``c_nvmlDevice_t`` of MIG instance ``instance`` of GPU ``parent``."""

    def __init__(self, parent: int, instance: int) -> None:
        self.parent = parent
        self.instance = instance


class FakeNvml:
    """What pynvml does on an 8x H200 machine, with knobs for failures.

    ``module`` is the fake ``pynvml``: the real constants and exception classes plus one
    function per NVML call used, each counted in ``calls``. ``fail[name] = code`` makes
    ``name`` raise the real ``pynvml.NVMLError(code)``.

    ``mig_board``: that GPU is in MIG mode with the instances of ``MIG_UUIDS``; as in
    NVML, a MIG handle answers only what NVML measures per instance (name, UUID, PCI
    info, memory, processes) and NOT_SUPPORTED to the rest. ``mig_capable=False``: a
    GPU without MIG (``nvmlDeviceGetMigMode`` is NOT_SUPPORTED). ``pcie_counter_code``:
    the per-entry answer for the PCIe byte counter fields (``NVML_SUCCESS``, or e.g.
    NOT_SUPPORTED). ``processes``: what ``nvmlDeviceGetComputeRunningProcesses`` lists.
    """

    def __init__(
        self,
        *,
        nvlink_links: int = NVLINK_LINKS,
        mig_board: int | None = None,
        mig_capable: bool = True,
    ) -> None:
        self.calls: Counter[str] = Counter()
        self.fail: dict[str, int] = {}
        self.init_count = 0
        self.nvlink_links = nvlink_links
        self.nvlink_tx_kib = 9_876_543_210
        self.nvlink_rx_kib = 8_765_432_109
        self.nvlink_auto_step = True
        self.pcie_counter_code = pynvml.NVML_SUCCESS
        self.pcie_tx_bytes = PCIE_TX_BYTES0
        self.pcie_rx_bytes = PCIE_RX_BYTES0
        self.pcie_auto_step = True
        self.mig_board = mig_board
        self.mig_capable = mig_capable
        self.processes: list[tuple[int, int | None]] = list(PROCESSES)
        self.field_requests: list[list[tuple[int, int]]] = []
        attrs: dict[str, Any] = {
            name: getattr(pynvml, name)
            for name in dir(pynvml)
            if name.startswith(("NVML_", "NVMLError", "NVMLLibraryMismatchError", "nvmlClocks"))
        }
        for name in dir(self):
            if name.startswith("nvml"):
                attrs[name] = self._counted(name, getattr(self, name))
        self.module = types.SimpleNamespace(**attrs)

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls[name] += 1
            if name in self.fail:
                raise pynvml.NVMLError(self.fail[name])
            if name != "nvmlInit" and self.init_count <= 0:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
            return fn(*args)

        return call

    @staticmethod
    def _dev(handle: Any) -> int:
        """A whole GPU's index; NOT_SUPPORTED for a MIG instance's handle."""
        if isinstance(handle, FakeMigHandle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not isinstance(handle, FakeHandle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.index

    # -- library and lookups -----------------------------------------------------------

    def nvmlInit(self) -> None:
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self.init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return DRIVER

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return CUDA_DRIVER

    def nvmlDeviceGetCount(self) -> int:
        return len(UUIDS)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        if not 0 <= index < len(UUIDS):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle | FakeMigHandle:
        if not uuid.startswith(("GPU-", "MIG-")):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if uuid in MIG_UUIDS and self.mig_board is not None:
            return FakeMigHandle(self.mig_board, MIG_UUIDS.index(uuid))
        if uuid not in UUIDS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeHandle(UUIDS.index(uuid))

    # -- MIG -----------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        index = self._dev(handle)
        if not self.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if index == self.mig_board:
            return [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
        return [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE]

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> Any:
        # As pynvml: the ctypes c_uint itself, not its value.
        if isinstance(handle, FakeMigHandle):
            return ctypes.c_uint(1)
        self._dev(handle)
        return ctypes.c_uint(0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> FakeHandle:
        if not isinstance(handle, FakeMigHandle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(handle.parent)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> FakeHandle:
        try:
            wanted = _parse_bus_id(bus_id)
        except ValueError:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        for index, known in enumerate(BUS_IDS):
            if _parse_bus_id(known) == wanted:
                return FakeHandle(index)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    # -- static facts --------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: Any) -> str:
        if isinstance(handle, FakeMigHandle):
            return MIG_NAME
        self._dev(handle)
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, FakeMigHandle):
            return MIG_UUIDS[handle.instance]
        return UUIDS[self._dev(handle)]

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._dev(handle)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        info = pynvml.nvmlPciInfo_t()
        if isinstance(handle, FakeMigHandle):  # the board's
            handle = FakeHandle(handle.parent)
        info.busId = BUS_IDS[self._dev(handle)]
        info.pciDeviceId = 0x233510DE
        return info

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        self._dev(handle)
        if self.nvlink_links == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < self.nvlink_links:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock_type: int) -> int:
        self._dev(handle)
        return SM_MAX_MHZ if clock_type == pynvml.NVML_CLOCK_SM else 3201

    # -- counters ------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        self._dev(handle)
        return pynvml.c_nvmlUtilization_t(gpu=UTIL_GPU, memory=UTIL_MEM)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        if isinstance(handle, FakeMigHandle):  # the instance's own memory
            used = MIG_MEM_USED[handle.instance]
            return pynvml.c_nvmlMemory_t(total=MIG_MEM_TOTAL, free=MIG_MEM_TOTAL - used, used=used)
        self._dev(handle)
        return pynvml.c_nvmlMemory_t(total=MEM_TOTAL, free=MEM_TOTAL - MEM_USED, used=MEM_USED)

    def _processes(self, handle: Any) -> list[Any]:
        """As pynvml builds the list: friendly objects, ``usedGpuMemory`` None if N/A."""
        if not isinstance(handle, FakeMigHandle):
            self._dev(handle)
        procs = []
        for pid, used in self.processes:
            raw = pynvml.c_nvmlProcessInfo_t(
                pid=pid,
                usedGpuMemory=pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                if used is None
                else used,
            )
            obj = pynvml.nvmlStructToFriendlyObject(raw)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            procs.append(obj)
        return procs

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._processes(handle)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        self._dev(handle)
        return POWER_MW

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        self._dev(handle)
        return POWER_LIMIT_MW

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        self._dev(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return TEMP_C

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        self._dev(handle)
        return SM_MHZ if clock_type == pynvml.NVML_CLOCK_SM else MEM_CLOCK_MHZ

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        self._dev(handle)
        return REASONS

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        self._dev(handle)
        return REASONS

    def nvmlDeviceGetPcieThroughput(self, handle: Any, counter: int) -> int:
        self._dev(handle)
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return PCIE_TX_KBPS
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return PCIE_RX_KBPS
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[Any]) -> Any:
        """As pynvml builds the request: an array of ``c_nvmlFieldValue_t``, filled in."""
        self._dev(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, field_id in enumerate(field_ids):
            try:
                (values[i].fieldId, values[i].scopeId) = field_id
            except TypeError:
                values[i].fieldId = field_id
        self.field_requests.append([(v.fieldId, v.scopeId) for v in values])
        requested = {v.fieldId for v in values}
        if self.nvlink_auto_step and requested & NVLINK_FIDS:
            self.nvlink_tx_kib += NVLINK_TX_STEP_KIB
            self.nvlink_rx_kib += NVLINK_RX_STEP_KIB
        if self.pcie_auto_step and requested & PCIE_FIDS:
            self.pcie_tx_bytes += PCIE_TX_STEP_BYTES
            self.pcie_rx_bytes += PCIE_RX_STEP_BYTES
        counters = {
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: self.nvlink_tx_kib,
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: self.nvlink_rx_kib,
        }
        pcie = {
            pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: self.pcie_tx_bytes,
            pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: self.pcie_rx_bytes,
        }
        for v in values:
            v.timestamp = 1_754_000_000_000_000
            if v.fieldId in pcie:  # device-wide: the scope id is ignored
                v.nvmlReturn = self.pcie_counter_code
                if self.pcie_counter_code == pynvml.NVML_SUCCESS:
                    v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                    v.value.ullVal = pcie[v.fieldId]
            elif v.fieldId not in counters:
                v.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
            elif self.nvlink_links == 0:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif v.scopeId != ALL_LINKS and v.scopeId >= self.nvlink_links:
                v.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
            else:
                v.nvmlReturn = pynvml.NVML_SUCCESS
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = counters[v.fieldId]
        return values


def field(row: list[Any], name: str) -> Any:
    return row[GPU_FIELDS.index(name)]


@pytest.fixture(autouse=True)
def _no_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


def selected_index(sampler: NvmlSampler) -> int | None:
    info = sampler.info()
    return None if info is None else info["index"]


def requests_for(fake: FakeNvml, fids: set[int]) -> list[list[tuple[int, int]]]:
    """The ``nvmlDeviceGetFieldValues`` requests that asked for any of ``fids``."""
    return [req for req in fake.field_requests if any(fid in fids for fid, _ in req)]


# -- values and units ------------------------------------------------------------------


def test_sample_values_and_units(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    assert sampler.available and sampler.reason == ""
    row = sampler.sample(1_754_000_000.25)
    assert row is not None and len(row) == len(GPU_FIELDS)
    assert field(row, "t_wall") == 1_754_000_000.25
    assert field(row, "util_pct") == 97
    assert field(row, "mem_util_pct") == 45
    assert field(row, "mem_used_bytes") == MEM_USED
    assert field(row, "mem_total_bytes") == 150754820096 == 143771 * 1024 * 1024
    assert field(row, "power_w") == pytest.approx(452.31)
    assert field(row, "power_limit_w") == pytest.approx(700.0)
    assert field(row, "temp_c") == 62
    assert field(row, "sm_clock_mhz") == 1755
    assert field(row, "sm_clock_max_mhz") == 1980
    assert field(row, "clock_event_reasons") == 0x4
    assert decode_reasons(field(row, "clock_event_reasons")) == ["sw_power_cap"]
    # PCIe and NVLink counters are cumulative: the first sample has no rate yet.
    assert field(row, "pcie_tx_Bps") is None
    assert field(row, "pcie_rx_Bps") is None
    assert field(row, "nvlink_tx_Bps") is None
    assert field(row, "nvlink_rx_Bps") is None
    # The NVLink counters were asked for summed over all links.
    assert requests_for(fake, NVLINK_FIDS) == [
        [
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
        ]
    ]
    # The PCIe byte counters, device-wide (scope 0); no 20 ms snapshot taken.
    assert requests_for(fake, PCIE_FIDS) == [
        [
            (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0),
            (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0),
        ]
    ]
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    sampler.close()


def test_nvlink_rate_from_two_samples(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    first = sampler.sample(1000.0)
    second = sampler.sample(1002.0)
    assert first is not None and second is not None
    assert field(first, "nvlink_tx_Bps") is None
    assert field(second, "nvlink_tx_Bps") == pytest.approx(NVLINK_TX_STEP_KIB * 1024 / 2.0)
    assert field(second, "nvlink_rx_Bps") == pytest.approx(NVLINK_RX_STEP_KIB * 1024 / 2.0)
    # ~175 GB/s out and ~150 GB/s in: within an H200's 450 GB/s per direction.
    assert 1e11 < field(second, "nvlink_tx_Bps") < 4.5e11

    # Idle links: a measured zero, not a missing value.
    fake.nvlink_auto_step = False
    third = sampler.sample(1003.0)
    assert third is not None and field(third, "nvlink_tx_Bps") == 0.0

    # Counters reset (driver reloaded): no negative rate, then rates again.
    fake.nvlink_tx_kib = fake.nvlink_rx_kib = 1000
    reset = sampler.sample(1004.0)
    assert reset is not None and field(reset, "nvlink_tx_Bps") is None
    fake.nvlink_tx_kib += 4096
    after = sampler.sample(1004.5)
    assert after is not None and field(after, "nvlink_tx_Bps") == pytest.approx(4096 * 1024 / 0.5)

    # The same t_wall twice: no division by zero.
    same = sampler.sample(1004.5)
    assert same is not None and field(same, "nvlink_tx_Bps") is None


def test_nvlink_absent_is_missing_and_not_asked_for() -> None:
    fake = FakeNvml(nvlink_links=0)  # e.g. a PCIe card
    sampler = NvmlSampler(nvml=fake.module)
    rows = [sampler.sample(1.0)]
    link_queries = fake.calls["nvmlDeviceGetNvLinkState"]
    rows += [sampler.sample(t) for t in (2.0, 3.0)]
    for row in rows:
        assert row is not None
        assert field(row, "nvlink_tx_Bps") is None
        assert field(row, "nvlink_rx_Bps") is None
        assert field(row, "util_pct") == 97
    assert requests_for(fake, NVLINK_FIDS) == []
    assert fake.calls["nvmlDeviceGetNvLinkState"] == link_queries  # links counted once
    info = sampler.info()
    assert info is not None and info["nvlink_links"] == 0


def test_nvlink_field_not_supported_per_entry() -> None:
    """A driver that knows NVLink but not the throughput fields answers per entry."""
    fake = FakeNvml(nvlink_links=0)
    fake.fail["nvmlDeviceGetNvLinkState"] = pynvml.NVML_ERROR_UNKNOWN  # link count unknown
    sampler = NvmlSampler(nvml=fake.module)
    for t in (1.0, 2.0, 3.0):
        row = sampler.sample(t)
        assert row is not None and field(row, "nvlink_tx_Bps") is None
    assert len(requests_for(fake, NVLINK_FIDS)) == 1


def test_info(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    info = sampler.info()
    assert info == {
        "name": "NVIDIA H200",
        "uuid": UUIDS[0],
        "pci_bus_id": "00000000:19:00.0",
        "index": 0,
        "mem_total_bytes": 150754820096,
        "power_limit_w": 700.0,
        "sm_clock_max_mhz": 1980,
        "nvlink_links": 18,
        "driver_version": DRIVER,
        "cuda_driver_version": "12.8",
        "mig": False,
        "parent_uuid": None,
        "pcie_window": "interval",
    }
    # Static: read once.
    calls = sum(fake.calls.values())
    assert sampler.info() == info
    assert sum(fake.calls.values()) == calls


def test_info_missing_facts_are_none(fake: FakeNvml) -> None:
    fake.fail["nvmlDeviceGetName"] = pynvml.NVML_ERROR_UNKNOWN
    fake.fail["nvmlSystemGetCudaDriverVersion_v2"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    del fake.module.nvmlDeviceGetEnforcedPowerLimit  # an old binding
    sampler = NvmlSampler(nvml=fake.module)
    info = sampler.info()
    assert info is not None
    assert info["name"] is None
    assert info["cuda_driver_version"] is None
    assert info["power_limit_w"] is None
    assert info["uuid"] == UUIDS[0]


# -- which GPU ---------------------------------------------------------------------------


def test_default_is_local_rank_or_cuda_index(fake: FakeNvml) -> None:
    assert selected_index(NvmlSampler(nvml=fake.module)) == 0
    assert selected_index(NvmlSampler(nvml=fake.module, local_rank=3)) == 3
    assert selected_index(NvmlSampler(nvml=fake.module, local_rank=3, cuda_index=6)) == 6
    assert selected_index(NvmlSampler(nvml=fake.module, local_rank=2, cuda_index=0)) == 0


@pytest.mark.parametrize(
    "uuid",
    [UUIDS[4], UUIDS[4].removeprefix("GPU-"), "  " + UUIDS[4].upper().replace("GPU-", "gpu-")],
)
def test_by_uuid(fake: FakeNvml, uuid: str) -> None:
    sampler = NvmlSampler(nvml=fake.module, uuid=uuid, local_rank=1, visible_devices="0,1")
    assert sampler.available
    assert selected_index(sampler) == 4


def test_by_pci_bus_id(fake: FakeNvml) -> None:
    for bus_id in ("00000000:9B:00.0", "0000:9b:00.0", "9b:00.0"):
        sampler = NvmlSampler(nvml=fake.module, pci_bus_id=bus_id, local_rank=0)
        assert selected_index(sampler) == 4, bus_id
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 0


def test_uuid_wins_over_pci_and_pci_is_a_fallback(fake: FakeNvml) -> None:
    both = NvmlSampler(nvml=fake.module, uuid=UUIDS[2], pci_bus_id=BUS_IDS[5])
    assert selected_index(both) == 2
    unknown_uuid = "GPU-00000000-0000-0000-0000-000000000000"
    fallback = NvmlSampler(nvml=fake.module, uuid=unknown_uuid, pci_bus_id=BUS_IDS[5])
    assert selected_index(fallback) == 5


def test_unknown_uuid_is_unavailable_not_a_guess(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module, uuid="GPU-00000000-0000-0000-0000-000000000000")
    assert not sampler.available
    assert "GPU-00000000" in sampler.reason
    assert sampler.sample(1.0) is None
    assert fake.init_count == 0  # NVML released again


def test_cuda_visible_devices_integer_list(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module, local_rank=1, visible_devices="3,5")
    assert selected_index(sampler) == 5
    sampler = NvmlSampler(nvml=fake.module, local_rank=1, cuda_index=0, visible_devices="3,5")
    assert selected_index(sampler) == 3


def test_cuda_visible_devices_from_environment(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert selected_index(NvmlSampler(nvml=fake.module, local_rank=1)) == 5


def test_cuda_visible_devices_uuid_list(fake: FakeNvml) -> None:
    visible = f"{UUIDS[6]},{UUIDS[2]}"
    assert selected_index(NvmlSampler(nvml=fake.module, visible_devices=visible)) == 6
    assert selected_index(NvmlSampler(nvml=fake.module, local_rank=1, visible_devices=visible)) == 2
    # CUDA also takes a unique prefix of a UUID.
    prefix = NvmlSampler(nvml=fake.module, visible_devices="GPU-7c4e2a9f, GPU-e0b3c5a7")
    assert selected_index(prefix) == 6


def test_cuda_visible_devices_stops_at_invalid_entry(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module, local_rank=2, visible_devices="0,1,-1,2")
    assert not sampler.available
    assert "not visible" in sampler.reason


def test_cuda_visible_devices_empty_means_no_gpu(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module, visible_devices="")
    assert not sampler.available
    assert "no GPU visible" in sampler.reason
    assert sampler.sample(1.0) is None and sampler.info() is None
    assert fake.calls["nvmlInit"] == 0


def test_cuda_visible_devices_out_of_range(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module, local_rank=2, visible_devices="3,5")
    assert not sampler.available
    assert sampler.sample(1.0) is None


@pytest.mark.parametrize("bare", [True, False])
def test_mig_uuid_samples_the_instance_not_the_board(bare: bool) -> None:
    fake = FakeNvml(mig_board=MIG_BOARD)
    uuid = MIG_UUIDS[1].removeprefix("MIG-") if bare else MIG_UUIDS[1]  # torch: bare
    # torch also gives the bus id, which the board and both instances share.
    sampler = NvmlSampler(nvml=fake.module, uuid=uuid, pci_bus_id=BUS_IDS[MIG_BOARD])
    assert sampler.available, sampler.reason
    assert fake.calls["nvmlDeviceGetHandleByPciBusId"] == 0
    rows = [sampler.sample(1.0), sampler.sample(2.0)]
    for row in rows:
        assert row is not None
        assert field(row, "mem_used_bytes") == MIG_MEM_USED[1]  # the instance's
        assert field(row, "mem_total_bytes") == MIG_MEM_TOTAL
        for board_only in ("power_w", "temp_c", "util_pct", "sm_clock_mhz", "pcie_tx_Bps"):
            assert field(row, board_only) is None, board_only
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1  # NOT_SUPPORTED: not asked again
    info = sampler.info()
    assert info is not None
    assert info["mig"] is True
    assert info["uuid"] == MIG_UUIDS[1]
    assert info["parent_uuid"] == UUIDS[MIG_BOARD]
    assert info["name"] == MIG_NAME
    assert info["mem_total_bytes"] == MIG_MEM_TOTAL
    assert info["power_limit_w"] is None
    assert info["pcie_window"] is None


def test_mig_instance_known_without_is_mig_function() -> None:
    """An old binding without nvmlDeviceIsMigDeviceHandle: a MIG- lookup is an instance."""
    fake = FakeNvml(mig_board=MIG_BOARD)
    del fake.module.nvmlDeviceIsMigDeviceHandle
    sampler = NvmlSampler(nvml=fake.module, uuid=MIG_UUIDS[0].removeprefix("MIG-"))
    info = sampler.info()
    assert info is not None and info["mig"] is True and info["parent_uuid"] == UUIDS[MIG_BOARD]


def test_cuda_visible_devices_mig_entry_is_the_instance() -> None:
    fake = FakeNvml(mig_board=MIG_BOARD)
    visible = ",".join(MIG_UUIDS)
    sampler = NvmlSampler(nvml=fake.module, local_rank=1, visible_devices=visible)
    assert sampler.available, sampler.reason
    row = sampler.sample(1.0)
    assert row is not None and field(row, "mem_used_bytes") == MIG_MEM_USED[1]
    info = sampler.info()
    assert info is not None and info["uuid"] == MIG_UUIDS[1] and info["mig"] is True
    first = NvmlSampler(nvml=fake.module, local_rank=0, visible_devices=visible)
    row = first.sample(1.0)
    assert row is not None and field(row, "mem_used_bytes") == MIG_MEM_USED[0]


@pytest.mark.parametrize(
    "uuid",
    [
        "00000000-0000-0000-0000-000000000000",  # bare: neither GPU- nor MIG- is known
        "GPU-00000000-0000-0000-0000-000000000000",
        None,  # the bus id alone
    ],
)
def test_bus_id_of_a_mig_board_is_never_sampled(uuid: str | None) -> None:
    fake = FakeNvml(mig_board=MIG_BOARD)
    sampler = NvmlSampler(nvml=fake.module, uuid=uuid, pci_bus_id=BUS_IDS[MIG_BOARD])
    assert not sampler.available
    assert "MIG mode" in sampler.reason
    assert "span every MIG instance" in sampler.reason
    assert BUS_IDS[MIG_BOARD] in sampler.reason
    if uuid is not None:
        assert "00000000-0000" in sampler.reason  # why the UUID did not do
    assert sampler.sample(1.0) is None and sampler.info() is None
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 0  # the board was never read
    assert fake.init_count == 0


def test_bus_id_of_a_board_without_mig_mode_is_still_a_fallback() -> None:
    fake = FakeNvml(mig_board=MIG_BOARD)  # another board is in MIG mode, not this one
    unknown = "00000000-0000-0000-0000-000000000000"
    sampler = NvmlSampler(nvml=fake.module, uuid=unknown, pci_bus_id=BUS_IDS[5])
    assert selected_index(sampler) == 5


def test_uuid_of_a_mig_board_is_not_sampled() -> None:
    """CUDA cannot run on a board in MIG mode: its UUID cannot be the CUDA device's."""
    fake = FakeNvml(mig_board=MIG_BOARD)
    sampler = NvmlSampler(nvml=fake.module, uuid=UUIDS[MIG_BOARD].removeprefix("GPU-"))
    assert not sampler.available and "MIG mode" in sampler.reason


@pytest.mark.parametrize(
    "kwargs",
    [
        {"local_rank": MIG_BOARD},
        {"local_rank": 0, "cuda_index": MIG_BOARD},
        {"local_rank": 0, "visible_devices": str(MIG_BOARD)},
        {"local_rank": 1, "visible_devices": f"0,{MIG_BOARD}"},
    ],
)
def test_mig_board_by_index_is_unavailable_and_logged_once(
    kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="collectors.nvml")
    fake = FakeNvml(mig_board=MIG_BOARD)
    sampler = NvmlSampler(nvml=fake.module, **kwargs)
    assert not sampler.available
    assert "MIG mode" in sampler.reason
    assert "instance could not be identified" in sampler.reason
    assert sampler.sample(1.0) is None and sampler.sample(2.0) is None
    assert sampler.info() is None
    assert len([r for r in caplog.records if r.name == "collectors.nvml"]) == 1
    assert fake.init_count == 0


@pytest.mark.parametrize("how", ["not_capable", "no_function", "not_in_driver"])
def test_gpu_without_mig_is_sampled_by_index(how: str) -> None:
    fake = FakeNvml(mig_capable=how != "not_capable")
    if how == "no_function":
        del fake.module.nvmlDeviceGetMigMode  # an old pynvml
    if how == "not_in_driver":
        fake.fail["nvmlDeviceGetMigMode"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    sampler = NvmlSampler(nvml=fake.module, local_rank=2)
    assert selected_index(sampler) == 2
    info = sampler.info()
    assert info is not None and info["mig"] is False and info["parent_uuid"] is None


def test_mig_mode_unknown_is_unavailable_not_a_guess() -> None:
    fake = FakeNvml()
    fake.fail["nvmlDeviceGetMigMode"] = pynvml.NVML_ERROR_UNKNOWN
    by_index = NvmlSampler(nvml=fake.module, local_rank=2)
    assert not by_index.available
    assert "MIG mode" in by_index.reason and "Unknown Error" in by_index.reason
    by_bus_id = NvmlSampler(nvml=fake.module, pci_bus_id=BUS_IDS[2])
    assert not by_bus_id.available and "MIG mode" in by_bus_id.reason
    # The GPU's own UUID is exact: a board in MIG mode is refused only when NVML says so.
    by_uuid = NvmlSampler(nvml=fake.module, uuid=UUIDS[2].removeprefix("GPU-"))
    assert selected_index(by_uuid) == 2


def test_nvml_index_out_of_range(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module, local_rank=9)
    assert not sampler.available
    assert "index" in sampler.reason
    assert fake.init_count == 0


# -- per-process GPU memory -------------------------------------------------------------


def test_process_memory_of_this_and_another_process(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    assert sampler.process_memory() == 21_474_836_480  # this process by default
    assert sampler.process_memory(MY_PID) == 21_474_836_480
    assert sampler.process_memory(OTHER_PID) == 1_610_612_736
    # A process listed more than once (e.g. per MIG compute instance): summed.
    fake.processes = [(MY_PID, 1_000), (OTHER_PID, 5), (MY_PID, 2_000)]
    assert sampler.process_memory() == 3_000


def test_process_memory_pid_not_listed(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="collectors.nvml")
    fake.processes = [(OTHER_PID, 1_610_612_736)]  # e.g. host PIDs seen from a container
    sampler = NvmlSampler(nvml=fake.module)
    assert [sampler.process_memory() for _ in range(3)] == [None, None, None]
    said = [r for r in caplog.records if "PID namespace" in r.getMessage()]
    assert len(said) == 1  # said once
    # Still asked: a CUDA context made later shows up.
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 3
    fake.processes.append((MY_PID, 4_096))
    assert sampler.process_memory() == 4_096


def test_process_memory_not_available_is_none(fake: FakeNvml) -> None:
    fake.processes = [(MY_PID, None), (OTHER_PID, 1_610_612_736)]  # WDDM, some vGPUs
    sampler = NvmlSampler(nvml=fake.module)
    assert sampler.process_memory() is None
    assert sampler.process_memory(OTHER_PID) == 1_610_612_736
    fake.processes = [(MY_PID, 1_000), (MY_PID, None)]  # part unknown: the sum is too
    assert sampler.process_memory() is None


def test_process_memory_not_supported_is_none_and_not_asked_again(fake: FakeNvml) -> None:
    fake.fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.fail["nvmlDeviceGetComputeRunningProcesses_v2"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    sampler = NvmlSampler(nvml=fake.module)
    assert [sampler.process_memory() for _ in range(3)] == [None, None, None]
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 1
    row = sampler.sample(1.0)
    assert row is not None and field(row, "util_pct") == 97


def test_process_memory_transient_error_is_none_then_read_again(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    fake.fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_TIMEOUT
    assert sampler.process_memory() is None
    del fake.fail["nvmlDeviceGetComputeRunningProcesses"]
    assert sampler.process_memory() == 21_474_836_480


def test_process_memory_driver_without_v3_uses_v2(fake: FakeNvml) -> None:
    """pynvml 13's unversioned call needs _v3 and raises a plain Exception without it."""

    def mismatch(handle: Any) -> Any:
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called ...")

    fake.module.nvmlDeviceGetComputeRunningProcesses = mismatch
    sampler = NvmlSampler(nvml=fake.module)
    assert sampler.process_memory() == 21_474_836_480
    assert sampler.process_memory() == 21_474_836_480
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2


def test_process_memory_of_a_mig_instance() -> None:
    fake = FakeNvml(mig_board=MIG_BOARD)
    sampler = NvmlSampler(nvml=fake.module, uuid=MIG_UUIDS[0])
    assert sampler.process_memory() == 21_474_836_480


def test_process_memory_unavailable_sampler_is_none(fake: FakeNvml) -> None:
    assert NvmlSampler(nvml=fake.module, visible_devices="").process_memory() is None
    sampler = NvmlSampler(nvml=fake.module)
    sampler.close()
    assert sampler.process_memory() is None
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 0


# -- PCIe throughput ---------------------------------------------------------------------


def test_pcie_rate_from_byte_counters(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    first = sampler.sample(1000.0)
    second = sampler.sample(1002.0)
    assert first is not None and second is not None
    assert field(first, "pcie_tx_Bps") is None and field(first, "pcie_rx_Bps") is None
    # Bytes (not KiB) averaged over the 2 s between the samples.
    assert field(second, "pcie_tx_Bps") == PCIE_TX_STEP_BYTES / 2.0
    assert field(second, "pcie_rx_Bps") == PCIE_RX_STEP_BYTES / 2.0
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0  # no 20 ms snapshot

    # Idle: a measured zero.
    fake.pcie_auto_step = False
    idle = sampler.sample(1003.0)
    assert idle is not None and field(idle, "pcie_tx_Bps") == 0.0

    # Counter went back (wrapped, or reset): no rate, then rates again from there.
    fake.pcie_tx_bytes = fake.pcie_rx_bytes = 1_000
    back = sampler.sample(1004.0)
    assert back is not None and field(back, "pcie_tx_Bps") is None
    fake.pcie_tx_bytes += 1_000_000
    after = sampler.sample(1004.5)
    assert after is not None and field(after, "pcie_tx_Bps") == 2_000_000.0
    info = sampler.info()
    assert info is not None and info["pcie_window"] == "interval"


def test_pcie_counter_transient_error_keeps_the_counters(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    assert sampler.sample(1000.0) is not None
    fake.fail["nvmlDeviceGetFieldValues"] = pynvml.NVML_ERROR_TIMEOUT
    gap = sampler.sample(1001.0)
    assert gap is not None and field(gap, "pcie_tx_Bps") is None
    del fake.fail["nvmlDeviceGetFieldValues"]
    row = sampler.sample(1004.0)  # spans the gap: one step over 4 s
    assert row is not None and field(row, "pcie_tx_Bps") == PCIE_TX_STEP_BYTES / 4.0
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    info = sampler.info()
    assert info is not None and info["pcie_window"] == "interval"


@pytest.mark.parametrize(
    "how", ["entry_not_supported", "entry_unknown_field", "no_constants", "info_first"]
)
def test_pcie_without_counters_falls_back_to_20ms_snapshots(fake: FakeNvml, how: str) -> None:
    if how == "entry_unknown_field":  # a driver older than the field ids
        fake.pcie_counter_code = pynvml.NVML_ERROR_INVALID_ARGUMENT
    elif how == "no_constants":  # a pynvml older than the field ids
        del fake.module.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    else:
        fake.pcie_counter_code = pynvml.NVML_ERROR_NOT_SUPPORTED
    sampler = NvmlSampler(nvml=fake.module)
    if how == "info_first":  # the hello frame, before any sample
        info = sampler.info()
        assert info is not None and info["pcie_window"] == "20ms"
    rows = [sampler.sample(t) for t in (1.0, 2.0, 3.0)]
    for row in rows:
        assert row is not None
        # A snapshot from the first sample on, in bytes/s.
        assert field(row, "pcie_tx_Bps") == PCIE_TX_KBPS * 1024
        assert field(row, "pcie_rx_Bps") == PCIE_RX_KBPS * 1024
    info = sampler.info()
    assert info is not None and info["pcie_window"] == "20ms"
    assert len(requests_for(fake, PCIE_FIDS)) <= 1  # counters not asked for again
    # NVLink's counters (same call, other fields) unaffected.
    assert rows[-1] is not None
    assert field(rows[-1], "nvlink_tx_Bps") == pytest.approx(NVLINK_TX_STEP_KIB * 1024)


# -- failures ----------------------------------------------------------------------------


def test_not_supported_field_is_none_and_not_called_again(fake: FakeNvml) -> None:
    fake.fail["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.pcie_counter_code = pynvml.NVML_ERROR_NOT_SUPPORTED  # neither PCIe source
    fake.fail["nvmlDeviceGetPcieThroughput"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    sampler = NvmlSampler(nvml=fake.module)
    for t in (1.0, 2.0, 3.0):
        row = sampler.sample(t)
        assert row is not None
        assert field(row, "power_w") is None  # missing, never 0
        assert field(row, "pcie_tx_Bps") is None
        assert field(row, "pcie_rx_Bps") is None
        assert field(row, "power_limit_w") == 700.0
        assert field(row, "util_pct") == 97
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1
    assert len(requests_for(fake, PCIE_FIDS)) == 1
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2  # TX and RX once each
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] == 3
    info = sampler.info()
    assert info is not None and info["pcie_window"] is None  # no PCIe figure at all


def test_transient_error_is_none_then_read_again(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    fake.fail["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_TIMEOUT
    row = sampler.sample(1.0)
    assert row is not None and field(row, "temp_c") is None
    del fake.fail["nvmlDeviceGetTemperature"]
    row = sampler.sample(2.0)
    assert row is not None and field(row, "temp_c") == 62


def test_lost_gpu_is_logged_once(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    sampler = NvmlSampler(nvml=fake.module)
    assert sampler.info() is not None
    for name in list(fake.calls) + [n for n in vars(fake.module) if n.startswith("nvmlDevice")]:
        if name not in ("nvmlInit", "nvmlShutdown"):
            fake.fail[name] = pynvml.NVML_ERROR_GPU_IS_LOST
    caplog.set_level(logging.DEBUG, logger="collectors.nvml")
    for t in range(1, 21):
        row = sampler.sample(float(t))
        assert row is not None
        assert row[0] == float(t)
        cached = ("t_wall", "sm_clock_max_mhz")  # the max clock is a constant, read before
        assert all(v is None for k, v in zip(GPU_FIELDS, row, strict=True) if k not in cached)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "GPU is lost" in warnings[0].getMessage()
    # Not NOT_SUPPORTED: still asked for, in case the GPU comes back.
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 20


def test_unexpected_exception_from_binding_is_contained(fake: FakeNvml) -> None:
    def broken(handle: Any) -> Any:
        raise RuntimeError("ctypes went wrong")

    fake.module.nvmlDeviceGetUtilizationRates = broken
    sampler = NvmlSampler(nvml=fake.module)
    row = sampler.sample(1.0)
    assert row is not None
    assert field(row, "util_pct") is None and field(row, "mem_util_pct") is None
    assert field(row, "temp_c") == 62


def test_clock_event_reasons_fall_back_to_throttle_reasons(fake: FakeNvml) -> None:
    # pynvml older than the R535 rename has no ...EventReasons function.
    del fake.module.nvmlDeviceGetCurrentClocksEventReasons
    sampler = NvmlSampler(nvml=fake.module)
    for t in (1.0, 2.0):
        row = sampler.sample(t)
        assert row is not None and field(row, "clock_event_reasons") == REASONS
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


def test_clock_event_reasons_missing_in_driver(fake: FakeNvml) -> None:
    # New pynvml, old driver: the symbol is missing from libnvidia-ml.
    fake.fail["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    sampler = NvmlSampler(nvml=fake.module)
    for t in (1.0, 2.0):
        row = sampler.sample(t)
        assert row is not None and field(row, "clock_event_reasons") == REASONS
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_init_fails_like_a_machine_without_driver(
    fake: FakeNvml, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="collectors.nvml")
    fake.fail["nvmlInit"] = code
    sampler = NvmlSampler(nvml=fake.module)
    assert not sampler.available
    assert str(pynvml.NVMLError(code)) in sampler.reason
    assert sampler.sample(1.0) is None
    assert sampler.info() is None
    sampler.close()
    assert fake.calls["nvmlShutdown"] == 0  # init never succeeded
    assert len([r for r in caplog.records if r.name == "collectors.nvml"]) == 1


def test_pynvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    sampler = NvmlSampler()
    assert not sampler.available
    assert "pynvml" in sampler.reason
    assert sampler.sample(1.0) is None and sampler.info() is None
    sampler.close()


def _real_driver_error() -> pynvml.NVMLError | None:
    """Why the real NVML library does not load here (no driver), or None if it does."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return exc
    pynvml.nvmlShutdown()
    return None


def test_real_pynvml_without_a_driver_is_unavailable() -> None:
    """The real library, not a fake: no driver means unavailable, never an exception."""
    driver_error = _real_driver_error()
    if driver_error is None:
        pytest.skip("the NVIDIA driver loads here: see the test with a driver")
    sampler = NvmlSampler()
    try:
        assert not sampler.available
        assert str(driver_error) in sampler.reason
        assert sampler.sample(1.0) is None
        assert sampler.info() is None
    finally:
        sampler.close()
        sampler.close()


def test_real_pynvml_with_a_driver_samples_the_gpu() -> None:
    """Where the driver loads (a GPU machine), the sampler must find a GPU and read it;
    if it cannot, this fails with the sampler's own reason."""
    if _real_driver_error() is not None:
        pytest.skip("no NVIDIA driver on this machine")
    sampler = NvmlSampler()
    try:
        assert sampler.available, f"NVML loads but the sampler is unavailable: {sampler.reason}"
        row = sampler.sample(1.0)
        assert row is not None and len(row) == len(GPU_FIELDS)
        info = sampler.info()
        assert info is not None and info["name"]
    finally:
        sampler.close()
        sampler.close()


def test_close_shuts_down_once(fake: FakeNvml) -> None:
    with NvmlSampler(nvml=fake.module) as sampler:
        assert fake.init_count == 1
        assert sampler.sample(1.0) is not None
    assert fake.calls["nvmlShutdown"] == 1 and fake.init_count == 0
    sampler.close()
    assert fake.calls["nvmlShutdown"] == 1
    assert not sampler.available
    assert sampler.sample(2.0) is None and sampler.info() is None


def test_import_does_not_load_pynvml() -> None:
    code = (
        "import sys, collectors, collectors.nvml\n"
        "assert 'pynvml' not in sys.modules, 'pynvml imported'\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


# -- clock event reasons -----------------------------------------------------------------


def test_decode_reasons() -> None:
    assert decode_reasons(None) == []
    assert decode_reasons(0) == []
    assert decode_reasons(pynvml.nvmlClocksEventReasonGpuIdle) == ["gpu_idle"]
    mask = (
        pynvml.nvmlClocksEventReasonSwPowerCap
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        | pynvml.nvmlClocksEventReasonApplicationsClocksSetting
    )
    assert decode_reasons(mask) == [
        "applications_clocks_setting",
        "sw_power_cap",
        "hw_thermal_slowdown",
    ]
    assert decode_reasons(pynvml.nvmlClocksEventReasonAll) == [
        "gpu_idle",
        "applications_clocks_setting",
        "sw_power_cap",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "display_clock_setting",
    ]
    assert decode_reasons(1 << 40) == ["unknown_0x10000000000"]


def test_reason_bits_match_pynvml() -> None:
    for bit, name in CLOCK_EVENT_REASONS.items():
        camel = "".join(part.capitalize() for part in name.split("_"))
        candidates = {
            f"nvmlClocksEventReason{camel}",
            f"nvmlClocksThrottleReason{camel}",
        }
        found = [getattr(pynvml, c) for c in candidates if hasattr(pynvml, c)]
        assert found and all(v == bit for v in found), name


def test_throttle_reasons() -> None:
    assert set(THROTTLE_REASONS) <= set(CLOCK_EVENT_REASONS.values())
    assert "sw_power_cap" in THROTTLE_REASONS
    assert "hw_thermal_slowdown" in THROTTLE_REASONS
    assert "hw_power_brake_slowdown" in THROTTLE_REASONS
    for benign in ("gpu_idle", "applications_clocks_setting", "display_clock_setting"):
        assert benign not in THROTTLE_REASONS
    throttled = [r for r in decode_reasons(0x4 | 0x1) if r in THROTTLE_REASONS]
    assert throttled == ["sw_power_cap"]
