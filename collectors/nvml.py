"""NVML sampler for one rank's own GPU.

:class:`NvmlSampler` finds the GPU the rank trains on, reads its static facts once
(:meth:`NvmlSampler.info`, sent in the hello frame) and its counters about once a second
(:meth:`NvmlSampler.sample`, one row in the order of :data:`collectors.schema.GPU_FIELDS`).
It runs on the collector's background thread, never on the training thread.

It never raises and never guesses. No ``pynvml``, no driver, no visible GPU: the
sampler is simply not :attr:`~NvmlSampler.available` and says why in
:attr:`~NvmlSampler.reason`. A single NVML call that fails leaves its field ``None``
(missing, never 0); a call the GPU does not support is not made again; an error that
repeats on every call (a lost GPU) is logged once.

Rates (PCIe, NVLink) are averaged over the interval between two samples, from NVML's
cumulative byte counters. Only on a GPU or driver without PCIe byte counters are the
PCIe rates ``nvmlDeviceGetPcieThroughput``'s 20 ms snapshots, as ``info()["pcie_window"]``
says.

``pynvml`` (from the ``nvidia-ml-py`` package) is imported lazily, when a sampler is
made: this module is imported inside training processes and must stay cheap.

Which GPU
---------
In order of preference:

1. ``uuid`` -- the CUDA device's UUID as torch reports it, with or without NVML's
   ``GPU-`` or ``MIG-`` prefix. A bare UUID is looked up as ``GPU-<uuid>``, then as
   ``MIG-<uuid>`` (torch reports a MIG instance's UUID bare too). Exact whatever the
   device ordering.
2. ``pci_bus_id`` -- ``"domain:bus:device.function"`` in hex. Exact for a whole GPU,
   but every MIG instance of a board shares the board's bus id: see below.
3. ``CUDA_VISIBLE_DEVICES`` (the ``visible_devices`` argument, by default the
   environment variable): entry number ``cuda_index`` (else ``local_rank``) of the
   comma-separated list. An integer entry is taken as an NVML index, a ``GPU-...``
   entry (or a unique prefix of one, as CUDA allows) as a UUID, a ``MIG-...`` entry as
   a MIG instance's UUID. As in CUDA, the list ends at its first invalid entry, and an
   empty list means no GPU. Without the variable, the NVML index is ``cuda_index``
   (else ``local_rank``). Integer mappings assume CUDA enumerates devices in PCI bus
   order, as NVML does (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and in practice on servers
   whose GPUs are all alike); pass ``uuid`` where it is known to be exact.

MIG. A MIG instance found by its UUID is sampled as such: its own memory, and
``None`` for what NVML does not measure per instance (power, temperature, clocks,
utilisation...); :meth:`NvmlSampler.info` says ``"mig": True`` and gives the board's
``parent_uuid``. A whole GPU found any other way (UUID, bus id, index) is sampled only
if it is not in MIG mode (``nvmlDeviceGetMigMode``): in MIG mode the CUDA device is one
of its instances, which could not be identified, and the board's figures would span
every instance (other tenants' included), so the sampler is unavailable and says so in
:attr:`~NvmlSampler.reason`. Where NVML cannot tell the mode, a GPU found by its own
UUID is kept, one found by bus id or index is not. The board is never sampled in an
instance's place.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Final

from collectors.schema import GPU_FIELDS

__all__ = [
    "CLOCK_EVENT_REASONS",
    "THROTTLE_REASONS",
    "NvmlSampler",
    "decode_reasons",
]

log = logging.getLogger(__name__)

#: Bits of NVML's clock-event (formerly "clocks throttle") reason mask, by readable name.
#: The same bits as ``pynvml.nvmlClocksEventReason*`` / ``nvmlClocksThrottleReason*``.
CLOCK_EVENT_REASONS: Final[dict[int, str]] = {
    0x001: "gpu_idle",  # nothing to run: clocks drop on purpose
    0x002: "applications_clocks_setting",  # clocks pinned by `nvidia-smi -ac`
    0x004: "sw_power_cap",  # power draw at the power limit: the driver lowers clocks
    0x008: "hw_slowdown",  # hardware slowdown (thermal, power brake, ...): clocks halved
    0x010: "sync_boost",  # held down to match the slowest GPU of a sync-boost group
    0x020: "sw_thermal_slowdown",  # GPU or memory too hot: the driver lowers clocks
    0x040: "hw_thermal_slowdown",  # temperature too high: hardware slowdown
    0x080: "hw_power_brake_slowdown",  # external power brake (PSU/system): hardware slowdown
    0x100: "display_clock_setting",  # clocks set by the display driver
    0x200: "board_limit",  # a board-level limit (pynvml's nvmlClocksThrottleReasonBoardLimit)
    0x400: "reliability",  # a reliability limit (pynvml's nvmlClocksThrottleReasonReliability)
}

#: Reason names that mean the GPU is being slowed against its will, because of power,
#: heat or hardware: a training job is running slower than the GPU could go. Left out:
#: ``gpu_idle`` (no work -- low clocks are the right answer), ``applications_clocks_setting``
#: and ``display_clock_setting`` (clocks chosen by an administrator or the display driver,
#: a configuration rather than a throttle) and ``sync_boost`` (a deliberate policy that
#: keeps a group of GPUs in step; the GPU that limits the group shows its own reason).
THROTTLE_REASONS: Final[frozenset[str]] = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "board_limit",
        "reliability",
    }
)


def decode_reasons(mask: int | None) -> list[str]:
    """The readable names of the bits set in an NVML clock-event reason mask.

    Names follow :data:`CLOCK_EVENT_REASONS`, lowest bit first; a bit NVML may add later
    is named ``"unknown_0x..."``. ``None`` (not measured) and ``0`` give ``[]``.
    """
    if not mask:
        return []
    names: list[str] = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(CLOCK_EVENT_REASONS.get(bit, f"unknown_{bit:#x}"))
        bit <<= 1
    return names


# NVML's return codes, as in nvml.h (and pynvml); used only when the module in use does
# not define them (a minimal fake).
_SUCCESS: Final = 0
_ERROR_NOT_SUPPORTED: Final = 3
_ERROR_INVALID_ARGUMENT: Final = 2
_ERROR_FUNCTION_NOT_FOUND: Final = 13
_DEVICE_MIG_ENABLE: Final = 1

#: What NVML puts in a 64-bit value it cannot give (``NVML_VALUE_NOT_AVAILABLE``);
#: pynvml turns a process's ``usedGpuMemory`` of this into ``None``, a raw struct may not.
_NOT_AVAILABLE_ULL: Final = 0xFFFFFFFFFFFFFFFF

#: ``nvmlFieldValue_t.scopeId`` asking for the sum over all NVLink links.
_ALL_LINKS: Final = 0xFFFFFFFF

#: ``nvmlValue_t`` member holding a field value, by ``nvmlValueType_t``.
_VALUE_MEMBERS: Final = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}

#: ``scopeId`` of a device-wide field (the PCIe byte counters): NVML ignores it.
_DEVICE_SCOPE: Final = 0

_KIB: Final = 1024

_Key = tuple[Any, ...]

_NVLINK_KEY: Final[_Key] = ("nvmlDeviceGetFieldValues", "nvlink_throughput")
_PCIE_KEY: Final[_Key] = ("nvmlDeviceGetFieldValues", "pcie_bytes")


class _Unavailable(Exception):
    """Internal: why no GPU handle could be had."""


def _text(value: Any) -> str | None:
    """A str from what pynvml returns for a string (str, or bytes in old versions)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _int(value: Any) -> int | None:
    """``int(value)``, or ``None`` where there is no number."""
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _attr_int(obj: Any, name: str) -> int | None:
    """An integer member of an NVML struct, or ``None``."""
    if obj is None:
        return None
    return _int(getattr(obj, name, None))


def _watts(milliwatts: int | None) -> float | None:
    """Milliwatts to watts."""
    return None if milliwatts is None else milliwatts / 1000.0


def _nvml_uuid(uuid: str) -> str:
    """A UUID in NVML's form: torch gives the bare UUID, NVML wants ``GPU-<uuid>``."""
    uuid = uuid.strip()
    if uuid[:4].upper() in ("GPU-", "MIG-"):
        return uuid[:4].upper() + uuid[4:]
    return "GPU-" + uuid


def _visible_entries(visible_devices: str) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA honours.

    CUDA reads the list up to its first invalid entry (``"0,1,-1,2"`` shows devices 0
    and 1 only).
    """
    entries: list[str] = []
    for raw in visible_devices.split(","):
        entry = raw.strip()
        if entry.isdigit() or entry[:4].upper() in ("GPU-", "MIG-"):
            entries.append(entry)
        else:
            break
    return entries


class NvmlSampler:
    """Samples one GPU through NVML; never raises, ``None`` for whatever is not measured.

    Make one per rank on the collector's background thread, call :meth:`info` once for
    the hello frame, :meth:`sample` about once a second, :meth:`close` at the end. The
    methods are thread-safe. See the module docstring for how the GPU is chosen.
    """

    def __init__(
        self,
        *,
        cuda_index: int | None = None,
        local_rank: int = 0,
        pci_bus_id: str | None = None,
        uuid: str | None = None,
        nvml: Any = None,
        visible_devices: str | None = None,
    ) -> None:
        """Initialise NVML and find the rank's GPU.

        ``nvml`` is the NVML binding to use, ``pynvml`` (imported here) by default.
        ``visible_devices`` defaults to the ``CUDA_VISIBLE_DEVICES`` environment variable.
        """
        #: Why the sampler is not available; ``""`` while it is.
        self.reason: str = ""
        self._nvml: Any = None
        self._handle: Any = None
        self._initialized = False
        self._closed = False
        self._lock = threading.Lock()
        self._unsupported: set[_Key] = set()
        self._logged_codes: set[Any] = set()
        self._info: dict[str, Any] | None = None
        self._sm_clock_max_mhz: int | None = None
        # Previous reading of each cumulative counter, by name: (t_wall, value).
        self._prev: dict[str, tuple[float, int]] = {}
        self._links: int | None = None
        # The handle is a MIG instance's, found by its MIG UUID.
        self._mig_instance = False
        self._pid_missing_logged = False
        self._error_cls: type[BaseException] = Exception
        self._mismatch_cls: type[BaseException] | None = None
        self._code_not_supported: Any = _ERROR_NOT_SUPPORTED
        self._code_function_not_found: Any = _ERROR_FUNCTION_NOT_FOUND
        self._code_success: Any = _SUCCESS
        if visible_devices is None:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            self._start(cuda_index, local_rank, pci_bus_id, uuid, nvml, visible_devices)
        except Exception as exc:  # never break the job, whatever the binding does
            self._give_up(f"NVML setup failed: {type(exc).__name__}: {exc}")

    # -- setup -------------------------------------------------------------------------

    def _start(
        self,
        cuda_index: int | None,
        local_rank: int,
        pci_bus_id: str | None,
        uuid: str | None,
        nvml: Any,
        visible_devices: str | None,
    ) -> None:
        """Import the binding, initialise NVML, resolve the handle (or say why not)."""
        if nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                self._give_up(f"pynvml (nvidia-ml-py) is not installed: {exc}")
                return
            nvml = pynvml
        self._nvml = nvml
        self._error_cls = getattr(nvml, "NVMLError", Exception)
        # pynvml raises this plain Exception, not an NVMLError, when an unversioned call
        # (nvmlDeviceGetComputeRunningProcesses) is missing from an older driver.
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        if isinstance(mismatch, type) and issubclass(mismatch, BaseException):
            self._mismatch_cls = mismatch
        self._code_not_supported = getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", _ERROR_NOT_SUPPORTED)
        self._code_function_not_found = getattr(
            nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", _ERROR_FUNCTION_NOT_FOUND
        )
        self._code_success = getattr(nvml, "NVML_SUCCESS", _SUCCESS)

        ordinal = cuda_index if cuda_index is not None else local_rank
        if not uuid and not pci_bus_id and visible_devices is not None:
            # Decide "no GPU visible" before touching the driver.
            entries = _visible_entries(visible_devices)
            if not entries:
                self._give_up(f"no GPU visible (CUDA_VISIBLE_DEVICES={visible_devices!r})")
                return
            if not 0 <= ordinal < len(entries):
                self._give_up(
                    f"CUDA device {ordinal} is not visible "
                    f"(CUDA_VISIBLE_DEVICES={visible_devices!r})"
                )
                return

        try:
            nvml.nvmlInit()
        except Exception as exc:
            self._give_up(f"NVML is not available: {type(exc).__name__}: {exc}")
            return
        self._initialized = True

        try:
            self._handle = self._resolve(ordinal, pci_bus_id, uuid, visible_devices)
        except _Unavailable as exc:
            self._give_up(str(exc))

    def _give_up(self, reason: str) -> None:
        """Mark the sampler unavailable, say why once, release NVML if it was initialised."""
        self.reason = reason
        self._handle = None
        log.info("rtop: no NVML GPU metrics: %s", reason)
        self._shutdown()

    def _shutdown(self) -> None:
        """``nvmlShutdown`` once, if ``nvmlInit`` succeeded."""
        if not self._initialized:
            return
        self._initialized = False
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("rtop: nvmlShutdown failed: %s", exc)

    def _lookup(self, what: str, fn_name: str, arg: Any) -> Any:
        """A device handle from one of NVML's lookups, or :class:`_Unavailable`."""
        try:
            return getattr(self._nvml, fn_name)(arg)
        except Exception as exc:
            raise _Unavailable(f"no GPU with {what} {arg!r}: {exc}") from exc

    def _by_uuid(self, uuid: str) -> Any:
        """The handle of the GPU with this UUID, or of the only one it is a prefix of."""
        try:
            return self._lookup("UUID", "nvmlDeviceGetHandleByUUID", uuid)
        except _Unavailable:
            # CUDA_VISIBLE_DEVICES may give a unique prefix ("GPU-8f1c2f6e").
            nvml = self._nvml
            matches = []
            try:
                for index in range(int(nvml.nvmlDeviceGetCount())):
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    found = _text(nvml.nvmlDeviceGetUUID(handle)) or ""
                    if found.lower().startswith(uuid.lower()):
                        matches.append(handle)
            except Exception:
                matches = []
            if len(matches) == 1:
                return matches[0]
            raise

    def _by_mig_uuid(self, uuid: str) -> Any:
        """The handle of the MIG instance with this ``MIG-...`` UUID."""
        handle = self._lookup("UUID", "nvmlDeviceGetHandleByUUID", uuid)
        self._mig_instance = True
        return handle

    def _by_given_uuid(self, uuid: str) -> Any:
        """The handle for the ``uuid`` argument: ``GPU-``, ``MIG-`` or bare (torch's)."""
        text = uuid.strip()
        if text[:4].upper() == "MIG-":
            return self._by_mig_uuid(_nvml_uuid(text))
        gpu_uuid = _nvml_uuid(text)
        try:
            handle = self._by_uuid(gpu_uuid)
        except _Unavailable as exc:
            if text[:4].upper() == "GPU-":
                raise
            # torch gives a MIG instance's UUID bare too.
            try:
                return self._by_mig_uuid("MIG-" + text)
            except _Unavailable as mig_exc:
                raise _Unavailable(f"{exc}; {mig_exc}") from None
        return self._whole_gpu(handle, f"UUID {gpu_uuid!r}", exact=True)

    def _whole_gpu(self, handle: Any, found_by: str, *, exact: bool = False) -> Any:
        """``handle`` (a whole GPU's), unless the GPU is in MIG mode: :class:`_Unavailable`.

        In MIG mode the CUDA device is one of the board's instances, and the board's
        figures (power, temperature, memory, ...) span every instance. A GPU or driver
        without MIG (NOT_SUPPORTED, or no ``nvmlDeviceGetMigMode``) is not in MIG mode.
        Where NVML cannot tell, a GPU found by an ``exact`` identity (its own UUID) is
        kept, one found by bus id or index is not.
        """
        fn = getattr(self._nvml, "nvmlDeviceGetMigMode", None)
        if fn is None:
            return handle
        unknown = ""
        mode: Any = None
        try:
            mode = fn(handle)
        except self._error_cls as exc:
            if getattr(exc, "value", None) in (
                self._code_not_supported,
                self._code_function_not_found,
            ):
                return handle
            unknown = str(exc)
        except Exception as exc:
            unknown = f"{type(exc).__name__}: {exc}"
        current = None
        if not unknown:
            try:
                current = _int(mode[0])
            except Exception:
                current = None
            if current is None:
                unknown = f"nvmlDeviceGetMigMode gave {mode!r}"
        if unknown:
            if exact:
                log.debug("rtop: MIG mode of the GPU with %s unknown: %s", found_by, unknown)
                return handle
            raise _Unavailable(
                f"cannot tell whether the GPU with {found_by} is in MIG mode ({unknown}), "
                "so whether its figures are the CUDA device's"
            )
        if current == getattr(self._nvml, "NVML_DEVICE_MIG_ENABLE", _DEVICE_MIG_ENABLE):
            raise _Unavailable(
                f"the GPU with {found_by} is in MIG mode and the CUDA device's MIG "
                "instance could not be identified (pass its MIG UUID); the board's "
                "figures would span every MIG instance, so the GPU is not measured"
            )
        return handle

    def _resolve(
        self,
        ordinal: int,
        pci_bus_id: str | None,
        uuid: str | None,
        visible_devices: str | None,
    ) -> Any:
        """The NVML handle of the rank's GPU (see the module docstring)."""
        if uuid or pci_bus_id:
            # Exact identities: use them, and never fall back on a guess by index.
            failures: list[str] = []
            if uuid:
                try:
                    return self._by_given_uuid(uuid)
                except _Unavailable as exc:
                    failures.append(str(exc))
            if pci_bus_id:
                bus_id = pci_bus_id.strip()
                try:
                    handle = self._lookup("PCI bus id", "nvmlDeviceGetHandleByPciBusId", bus_id)
                    # Shared by all the MIG instances of a board: never one of them.
                    return self._whole_gpu(handle, f"PCI bus id {bus_id!r}")
                except _Unavailable as exc:
                    failures.append(str(exc))
            raise _Unavailable("; ".join(failures))
        if visible_devices is None:
            handle = self._lookup("NVML index", "nvmlDeviceGetHandleByIndex", ordinal)
            return self._whole_gpu(handle, f"NVML index {ordinal}")
        entry = _visible_entries(visible_devices)[ordinal]  # checked in _start
        if entry.isdigit():
            handle = self._lookup("NVML index", "nvmlDeviceGetHandleByIndex", int(entry))
            return self._whole_gpu(handle, f"NVML index {int(entry)} (CUDA_VISIBLE_DEVICES)")
        nvml_uuid = _nvml_uuid(entry)
        if nvml_uuid.startswith("MIG-"):
            return self._by_mig_uuid(nvml_uuid)
        return self._whole_gpu(self._by_uuid(nvml_uuid), f"UUID {entry!r}", exact=True)

    # -- guarded calls -----------------------------------------------------------------

    def _call(self, key: _Key, fn_name: str, *args: Any, device: bool = True) -> Any:
        """``nvml.<fn_name>(handle, *args)``, or ``None`` if it fails.

        NOT_SUPPORTED (or a function missing from the binding or the driver) marks
        ``key`` so that the call is not made again; other errors are logged once per
        error code.
        """
        if key in self._unsupported:
            return None
        fn = getattr(self._nvml, fn_name, None)
        if fn is None:
            self._unsupported.add(key)
            log.debug("rtop: this pynvml has no %s", fn_name)
            return None
        try:
            return fn(self._handle, *args) if device else fn(*args)
        except self._error_cls as exc:
            code = getattr(exc, "value", None)
            if code in (self._code_not_supported, self._code_function_not_found):
                self._unsupported.add(key)
                log.debug("rtop: %s%r not supported on this GPU: %s", fn_name, key[1:], exc)
            else:
                self._log_once(code, fn_name, exc)
            return None
        except Exception as exc:
            if self._mismatch_cls is not None and isinstance(exc, self._mismatch_cls):
                # pynvml's wrapper for a versioned function the driver lacks.
                self._unsupported.add(key)
                log.debug("rtop: %s not available with this driver: %s", fn_name, exc)
                return None
            self._log_once(type(exc).__name__, fn_name, exc)
            return None

    def _log_once(self, code: Any, fn_name: str, exc: BaseException) -> None:
        """Log a failing NVML call, once per error code for the sampler's lifetime."""
        if code in self._logged_codes:
            return
        self._logged_codes.add(code)
        log.warning(
            "rtop: NVML %s failed: %s (the field is reported missing; "
            "further failures with this error are not logged)",
            fn_name,
            exc,
        )

    def _value(self, key: _Key, fn_name: str, *args: Any, device: bool = True) -> int | None:
        """An integer NVML reading, or ``None``."""
        return _int(self._call(key, fn_name, *args, device=device))

    def _clock_event_reasons(self) -> int | None:
        """The clock-event reason mask; the pre-R535 "throttle reasons" call where needed."""
        key: _Key = ("nvmlDeviceGetCurrentClocksEventReasons",)
        if key not in self._unsupported:
            value = self._value(key, key[0])
            if key not in self._unsupported:
                return value
        return self._value(
            ("nvmlDeviceGetCurrentClocksThrottleReasons",),
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        )

    def _field_counters(
        self,
        key: _Key,
        names: tuple[str, str],
        scope: int,
        unsupported_codes: tuple[Any, ...],
        what: str,
    ) -> tuple[int | None, int | None]:
        """Two cumulative counters read with one ``nvmlDeviceGetFieldValues`` call.

        ``names`` are the ``NVML_FI_*`` constants, asked for with ``scopeId`` ``scope``.
        A constant missing from the binding, or both entries answering one of
        ``unsupported_codes``, marks ``key`` unsupported: the call is not made again.
        """
        if key in self._unsupported:
            return None, None
        fids = [getattr(self._nvml, name, None) for name in names]
        if None in fids:
            self._unsupported.add(key)
            log.debug("rtop: this pynvml has no %s", " / ".join(names))
            return None, None
        values = self._call(key, "nvmlDeviceGetFieldValues", [(fid, scope) for fid in fids])
        if values is None:
            return None, None
        out: list[int | None] = []
        unsupported = 0
        for i in range(2):
            try:
                field = values[i]
                ret = getattr(field, "nvmlReturn", self._code_success)
                if ret != self._code_success:
                    unsupported += ret in unsupported_codes
                    out.append(None)
                    continue
                value_type = _int(getattr(field, "valueType", None))
                member = _VALUE_MEMBERS.get(3 if value_type is None else value_type, "ullVal")
                out.append(_int(getattr(field.value, member)))
            except Exception:
                out.append(None)
        if unsupported == 2:
            self._unsupported.add(key)
            log.debug("rtop: %s counters not supported on this GPU", what)
        return out[0], out[1]

    def _nvlink_kib(self) -> tuple[int | None, int | None]:
        """Cumulative NVLink data KiB sent and received, over all links."""
        return self._field_counters(
            _NVLINK_KEY,
            ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"),
            _ALL_LINKS,
            (self._code_not_supported,),
            "NVLink throughput",
        )

    def _pcie_bytes(self) -> tuple[int | None, int | None]:
        """Cumulative PCIe bytes sent and received (``NVML_FI_DEV_PCIE_COUNT_*_BYTES``).

        Per entry, NOT_SUPPORTED (the GPU) or INVALID_ARGUMENT (a driver older than the
        field ids) means the counters are not there: :meth:`_pcie` falls back then.
        """
        return self._field_counters(
            _PCIE_KEY,
            ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES"),
            _DEVICE_SCOPE,
            (
                self._code_not_supported,
                getattr(self._nvml, "NVML_ERROR_INVALID_ARGUMENT", _ERROR_INVALID_ARGUMENT),
            ),
            "PCIe byte",
        )

    def _pcie_util_counters(self) -> tuple[int, int]:
        """``nvmlPcieUtilCounter_t`` values for TX and RX bytes."""
        nvml = self._nvml
        return (
            getattr(nvml, "NVML_PCIE_UTIL_TX_BYTES", 0),
            getattr(nvml, "NVML_PCIE_UTIL_RX_BYTES", 1),
        )

    def _pcie_snapshot(self, counter: int) -> float | None:
        """Bytes/s from ``nvmlDeviceGetPcieThroughput``: a 20 ms sample, blocks ~20 ms."""
        kbps = self._value(
            ("nvmlDeviceGetPcieThroughput", counter), "nvmlDeviceGetPcieThroughput", counter
        )
        return None if kbps is None else kbps * _KIB

    def _pcie(self, t_wall: float) -> tuple[float | None, float | None]:
        """PCIe bytes/s sent and received.

        Averaged over the ``t_wall`` interval since the previous sample from the
        cumulative byte counters; only where they are not supported, the 20 ms
        snapshots of ``nvmlDeviceGetPcieThroughput``.
        """
        tx, rx = self._pcie_bytes()
        if _PCIE_KEY not in self._unsupported:
            return self._rate("pcie_tx", t_wall, tx, 1), self._rate("pcie_rx", t_wall, rx, 1)
        tx_counter, rx_counter = self._pcie_util_counters()
        return self._pcie_snapshot(tx_counter), self._pcie_snapshot(rx_counter)

    def _pcie_window(self) -> str | None:
        """What a PCIe rate spans: ``"interval"``, ``"20ms"``, or ``None`` (no figure)."""
        if _PCIE_KEY not in self._unsupported:
            return "interval"
        if any(
            ("nvmlDeviceGetPcieThroughput", counter) not in self._unsupported
            for counter in self._pcie_util_counters()
        ):
            return "20ms"
        return None

    def _rate(self, name: str, t_wall: float, value: int | None, unit: int) -> float | None:
        """Bytes/s from the previous reading of cumulative counter ``name`` to this one.

        ``unit`` is the counter's unit in bytes. ``None`` on the first reading, when
        the clock did not move forward, and when the counter went back (a reset or a
        wrap: never a negative or made-up rate).
        """
        if value is None:
            return None  # keep the previous reading: the next rate spans the gap
        prev = self._prev.get(name)
        self._prev[name] = (t_wall, value)
        if prev is None:
            return None
        dt = t_wall - prev[0]
        delta = value - prev[1]
        if dt <= 0 or delta < 0:  # clock went back, or counters reset (driver reload)
            return None
        return delta * unit / dt

    def _nvlink_links(self) -> int | None:
        """Active NVLink links (0 without NVLink); ``None`` while NVML cannot tell.

        Counted once with ``nvmlDeviceGetNvLinkState`` over every possible link: links
        that do not exist or are not supported count as inactive.
        """
        if self._links is not None:
            return self._links
        nvml = self._nvml
        fn = getattr(nvml, "nvmlDeviceGetNvLinkState", None)
        no_link = (
            self._code_not_supported,
            self._code_function_not_found,
            getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", _ERROR_INVALID_ARGUMENT),
        )
        active = 0
        if fn is not None:
            for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
                try:
                    state = fn(self._handle, link)
                except self._error_cls as exc:
                    code = getattr(exc, "value", None)
                    if code == self._code_function_not_found:
                        break
                    if code in no_link:
                        continue
                    return None  # e.g. the GPU is lost: ask again next time
                except Exception:
                    return None
                if state:
                    active += 1
        self._links = active
        return active

    # -- public ------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """True while the sampler has a GPU to read (NVML initialised, handle found)."""
        return self._handle is not None and not self._closed

    def info(self) -> dict[str, Any] | None:
        """Static facts about the GPU, for the hello frame; ``None`` when unavailable.

        Keys: ``name``, ``uuid`` (``MIG-...`` for a MIG instance), ``pci_bus_id``,
        ``index`` (NVML index), ``mem_total_bytes``, ``power_limit_w``,
        ``sm_clock_max_mhz``, ``nvlink_links`` (active links, 0 without NVLink),
        ``driver_version`` (e.g. ``"560.35.03"``), ``cuda_driver_version`` (the CUDA
        version the driver supports, e.g. ``"12.6"``), ``mig`` (``True`` when the
        sampler reads a MIG instance, whose board-level figures NVML does not give),
        ``parent_uuid`` (a MIG instance's board, else ``None``) and ``pcie_window``:
        ``"interval"`` when the PCIe rates of :meth:`sample` are averaged over the
        interval between samples, ``"20ms"`` when they are 20 ms snapshots (a GPU or
        driver without PCIe byte counters), ``None`` when there is no PCIe figure.
        A fact NVML cannot give is ``None``. Read once, then cached.
        """
        with self._lock:
            if not self.available:
                return None
            if self._info is None:
                self._info = self._read_info()
            out = dict(self._info)
            out["pcie_window"] = self._pcie_window()
            return out

    def _read_info(self) -> dict[str, Any]:
        """The facts of :meth:`info` (``pcie_window`` is added there), from NVML."""
        mem = self._call(("nvmlDeviceGetMemoryInfo",), "nvmlDeviceGetMemoryInfo")
        pci = self._call(("nvmlDeviceGetPciInfo",), "nvmlDeviceGetPciInfo")
        cuda = self._value(
            ("nvmlSystemGetCudaDriverVersion_v2",),
            "nvmlSystemGetCudaDriverVersion_v2",
            device=False,
        )
        if cuda is None:
            cuda = self._value(
                ("nvmlSystemGetCudaDriverVersion",),
                "nvmlSystemGetCudaDriverVersion",
                device=False,
            )
        links = self._nvlink_links()
        sm_max = self._sm_clock_max()
        mig = self._is_mig()
        self._probe_pcie()
        return {
            "name": _text(self._call(("nvmlDeviceGetName",), "nvmlDeviceGetName")),
            "uuid": _text(self._call(("nvmlDeviceGetUUID",), "nvmlDeviceGetUUID")),
            "pci_bus_id": _text(getattr(pci, "busId", None)),
            "index": self._value(("nvmlDeviceGetIndex",), "nvmlDeviceGetIndex"),
            "mem_total_bytes": _attr_int(mem, "total"),
            "power_limit_w": _watts(
                self._value(("nvmlDeviceGetEnforcedPowerLimit",), "nvmlDeviceGetEnforcedPowerLimit")
            ),
            "sm_clock_max_mhz": sm_max,
            "nvlink_links": links,
            "driver_version": _text(
                self._call(
                    ("nvmlSystemGetDriverVersion",),
                    "nvmlSystemGetDriverVersion",
                    device=False,
                )
            ),
            "cuda_driver_version": (
                None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}"
            ),
            "mig": mig,
            "parent_uuid": self._parent_uuid() if mig else None,
        }

    def _is_mig(self) -> bool:
        """Whether the handle is a MIG instance's (``nvmlDeviceIsMigDeviceHandle``).

        Where NVML cannot tell, how the handle was found: only a ``MIG-`` UUID lookup
        gives an instance (index, bus id and ``GPU-`` lookups give whole GPUs).
        """
        raw = self._call(("nvmlDeviceIsMigDeviceHandle",), "nvmlDeviceIsMigDeviceHandle")
        # pynvml returns the ctypes c_uint itself, not its value.
        value = _int(getattr(raw, "value", raw))
        return self._mig_instance if value is None else bool(value)

    def _parent_uuid(self) -> str | None:
        """The UUID of the board a MIG instance is part of, or ``None``."""
        parent = self._call(
            ("nvmlDeviceGetDeviceHandleFromMigDeviceHandle",),
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        )
        if parent is None:
            return None
        return _text(
            self._call(("nvmlDeviceGetUUID", "parent"), "nvmlDeviceGetUUID", parent, device=False)
        )

    def _probe_pcie(self) -> None:
        """Learn which PCIe source :meth:`sample` will use, for ``pcie_window``.

        Reads the byte counters once (no rate: there is no previous reading yet); only
        where they are not supported, tries the 20 ms snapshots (blocking ~40 ms, once).
        """
        if _PCIE_KEY not in self._unsupported:
            self._pcie_bytes()
        if _PCIE_KEY in self._unsupported:
            for counter in self._pcie_util_counters():
                self._pcie_snapshot(counter)

    def _sm_clock_max(self) -> int | None:
        """The SM clock's maximum, MHz (a constant of the GPU: read until known)."""
        if self._sm_clock_max_mhz is None:
            clock_sm = getattr(self._nvml, "NVML_CLOCK_SM", 1)
            self._sm_clock_max_mhz = self._value(
                ("nvmlDeviceGetMaxClockInfo", clock_sm), "nvmlDeviceGetMaxClockInfo", clock_sm
            )
        return self._sm_clock_max_mhz

    def process_memory(self, pid: int | None = None) -> int | None:
        """Bytes of GPU memory NVML attributes to process ``pid`` on the sampler's GPU.

        ``pid`` defaults to this process. Unlike the torch allocator's figures, this
        counts the CUDA context and NCCL's buffers. The sum of the process's entries in
        ``nvmlDeviceGetComputeRunningProcesses``; ``None`` when the sampler is
        unavailable, when NVML cannot list processes, when the process is not listed
        (no CUDA context yet, or a container with its own PID namespace: NVML lists
        host PIDs), or when NVML cannot tell its memory (``usedGpuMemory`` not
        available, e.g. under Windows WDDM or some virtualisation). Never raises.
        """
        with self._lock:
            if not self.available:
                return None
            if pid is None:
                pid = os.getpid()
            procs = self._running_processes()
            if procs is None:
                return None
            total = 0
            listed = False
            try:
                for proc in procs:
                    if _attr_int(proc, "pid") != pid:
                        continue
                    listed = True
                    used = _attr_int(proc, "usedGpuMemory")
                    if used is None or used == _NOT_AVAILABLE_ULL:
                        return None
                    total += used
            except Exception as exc:  # not the list of structs pynvml gives
                self._log_once(type(exc).__name__, "nvmlDeviceGetComputeRunningProcesses", exc)
                return None
            if not listed:
                if not self._pid_missing_logged:
                    self._pid_missing_logged = True
                    log.info(
                        "rtop: pid %d is not among the %d processes NVML lists on this GPU "
                        "(no CUDA context yet, or a container with its own PID namespace: "
                        "NVML lists host PIDs); its GPU memory is reported missing",
                        pid,
                        len(procs),
                    )
                return None
            return total

    def _running_processes(self) -> Any:
        """NVML's compute processes on the GPU, or ``None``.

        ``nvmlDeviceGetComputeRunningProcesses`` (``_v3`` in pynvml 13); ``_v2`` where
        the driver predates ``_v3``.
        """
        for fn_name in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetComputeRunningProcesses_v2",
        ):
            key: _Key = (fn_name,)
            if key in self._unsupported:
                continue
            procs = self._call(key, fn_name)
            if key not in self._unsupported:
                return procs
        return None

    def sample(self, t_wall: float) -> list[Any] | None:
        """One row of :data:`collectors.schema.GPU_FIELDS`; ``None`` when unavailable.

        ``t_wall`` is the caller's ``time.time()``. NVLink rates, and PCIe rates where
        the GPU has PCIe byte counters, are averaged over the ``t_wall`` interval
        between successive samples (``None`` on the first one); otherwise the PCIe
        rates are NVML's 20 ms snapshots (see ``pcie_window`` in :meth:`info`).
        A field whose NVML call fails is ``None``.
        """
        with self._lock:
            if not self.available:
                return None
            nvml = self._nvml
            clock_sm = getattr(nvml, "NVML_CLOCK_SM", 1)
            temp_gpu = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)

            util = self._call(("nvmlDeviceGetUtilizationRates",), "nvmlDeviceGetUtilizationRates")
            mem = self._call(("nvmlDeviceGetMemoryInfo",), "nvmlDeviceGetMemoryInfo")
            pcie_tx, pcie_rx = self._pcie(t_wall)
            nvlink_tx, nvlink_rx = (None, None) if self._nvlink_links() == 0 else self._nvlink_kib()
            values: dict[str, Any] = {
                "t_wall": t_wall,
                "util_pct": _attr_int(util, "gpu"),
                "mem_util_pct": _attr_int(util, "memory"),
                "mem_used_bytes": _attr_int(mem, "used"),
                "mem_total_bytes": _attr_int(mem, "total"),
                "power_w": _watts(
                    self._value(("nvmlDeviceGetPowerUsage",), "nvmlDeviceGetPowerUsage")
                ),
                "power_limit_w": _watts(
                    self._value(
                        ("nvmlDeviceGetEnforcedPowerLimit",), "nvmlDeviceGetEnforcedPowerLimit"
                    )
                ),
                "temp_c": self._value(
                    ("nvmlDeviceGetTemperature", temp_gpu), "nvmlDeviceGetTemperature", temp_gpu
                ),
                "sm_clock_mhz": self._value(
                    ("nvmlDeviceGetClockInfo", clock_sm), "nvmlDeviceGetClockInfo", clock_sm
                ),
                "sm_clock_max_mhz": self._sm_clock_max(),
                "clock_event_reasons": self._clock_event_reasons(),
                "pcie_tx_Bps": pcie_tx,
                "pcie_rx_Bps": pcie_rx,
                "nvlink_tx_Bps": self._rate("nvlink_tx", t_wall, nvlink_tx, _KIB),
                "nvlink_rx_Bps": self._rate("nvlink_rx", t_wall, nvlink_rx, _KIB),
            }
            return [values.get(name) for name in GPU_FIELDS]

    def close(self) -> None:
        """Stop sampling and call ``nvmlShutdown`` (once, if ``nvmlInit`` succeeded)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self.reason:
                self.reason = "closed"
            self._handle = None
            self._shutdown()

    def __enter__(self) -> NvmlSampler:
        """Use as a context manager: :meth:`close` on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the sampler."""
        self.close()
