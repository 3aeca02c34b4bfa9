"""Tests of collectors.nvml against a fake NVML that behaves like pynvml on an 8x H200 node.

The fake is a module-like namespace holding the *real* pynvml constants, exception
classes and ctypes result structs (so the sampler's except-clauses and attribute reads
are the ones that run against the real library); only the C library behind the
functions is replaced. One test runs the real pynvml on this machine.
"""

from __future__ import annotations

import logging
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


def _parse_bus_id(text: str) -> tuple[int, int, int, int]:
    """NVML accepts ``[domain:]bus:device[.function]``, hex, with any width."""
    parts = text.strip().split(":")
    domain = int(parts[0], 16) if len(parts) == 3 else 0
    bus = int(parts[-2], 16)
    dev, _, fn = parts[-1].partition(".")
    return domain, bus, int(dev, 16), int(fn or "0", 16)


class FakeHandle:
    """Stands for ``c_nvmlDevice_t``."""

    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml:
    """What pynvml does on an 8x H200 machine, with knobs for failures.

    ``module`` is the fake ``pynvml``: the real constants and exception classes plus one
    function per NVML call used, each counted in ``calls``. ``fail[name] = code`` makes
    ``name`` raise the real ``pynvml.NVMLError(code)``.
    """

    def __init__(self, *, nvlink_links: int = NVLINK_LINKS) -> None:
        self.calls: Counter[str] = Counter()
        self.fail: dict[str, int] = {}
        self.init_count = 0
        self.nvlink_links = nvlink_links
        self.nvlink_tx_kib = 9_876_543_210
        self.nvlink_rx_kib = 8_765_432_109
        self.nvlink_auto_step = True
        self.field_requests: list[list[tuple[int, int]]] = []
        attrs: dict[str, Any] = {
            name: getattr(pynvml, name)
            for name in dir(pynvml)
            if name.startswith(("NVML_", "NVMLError", "nvmlClocks"))
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

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        if not uuid.startswith(("GPU-", "MIG-")):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if uuid not in UUIDS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeHandle(UUIDS.index(uuid))

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
        self._dev(handle)
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return UUIDS[self._dev(handle)]

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._dev(handle)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        info = pynvml.nvmlPciInfo_t()
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
        self._dev(handle)
        return pynvml.c_nvmlMemory_t(total=MEM_TOTAL, free=MEM_TOTAL - MEM_USED, used=MEM_USED)

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
        if self.nvlink_auto_step:
            self.nvlink_tx_kib += NVLINK_TX_STEP_KIB
            self.nvlink_rx_kib += NVLINK_RX_STEP_KIB
        counters = {
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: self.nvlink_tx_kib,
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: self.nvlink_rx_kib,
        }
        for v in values:
            v.timestamp = 1_754_000_000_000_000
            if v.fieldId not in counters:
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
    assert field(row, "pcie_tx_Bps") == PCIE_TX_KBPS * 1024
    assert field(row, "pcie_rx_Bps") == PCIE_RX_KBPS * 1024
    # NVLink counters are cumulative: the first sample has no rate yet.
    assert field(row, "nvlink_tx_Bps") is None
    assert field(row, "nvlink_rx_Bps") is None
    # The NVLink counters were asked for summed over all links.
    assert fake.field_requests[-1] == [
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
    ]
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
    assert fake.calls["nvmlDeviceGetFieldValues"] == 0
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
    assert fake.calls["nvmlDeviceGetFieldValues"] == 1


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


def test_mig_is_unsupported_and_logged_once(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="collectors.nvml")
    mig = "MIG-4f5a8c2e-1b3d-5e7f-9a0c-2d4e6f8a0b1c"
    sampler = NvmlSampler(nvml=fake.module, visible_devices=mig)
    assert not sampler.available
    assert "MIG" in sampler.reason
    assert sampler.sample(1.0) is None and sampler.sample(2.0) is None
    assert len([r for r in caplog.records if r.name == "collectors.nvml"]) == 1


def test_nvml_index_out_of_range(fake: FakeNvml) -> None:
    sampler = NvmlSampler(nvml=fake.module, local_rank=9)
    assert not sampler.available
    assert "index" in sampler.reason
    assert fake.init_count == 0


# -- failures ----------------------------------------------------------------------------


def test_not_supported_field_is_none_and_not_called_again(fake: FakeNvml) -> None:
    fake.fail["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_NOT_SUPPORTED
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
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2  # TX and RX once each
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] == 3


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
