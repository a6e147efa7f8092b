"""A hand-written fake of the parts of pynvml that `agentd.gpu.nvml` calls.

`FakeNvml` stands in for the module: same function names, the real constants
and the real ``NVMLError`` classes (so ``str(error)`` reads as on a GPU node).
Handles are the `FakeDevice` objects themselves. A device field set to ``None``
is one the device cannot report: its call raises NOT_SUPPORTED.

    fake = FakeNvml([FakeDevice("GPU-0"), FakeDevice("GPU-1")])
    fake.devices[1].ecc[UNCORRECTED, AGGREGATE] = 2
    fake.devices[0].raises["nvmlDeviceGetPowerUsage"] = nvml_error(NVML_ERROR_UNKNOWN)
    fake.queue_xid(1, 79)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pynvml

NVMLError = pynvml.NVMLError

CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOLATILE = pynvml.NVML_VOLATILE_ECC
AGGREGATE = pynvml.NVML_AGGREGATE_ECC
SBE_CAUSE = pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
DBE_CAUSE = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR


def nvml_error(code: int) -> pynvml.NVMLError:
    """The exception pynvml raises for `code` (an ``NVMLError_*`` subclass)."""
    return pynvml.NVMLError(code)


@dataclass
class FakeDevice:
    """One GPU. ``None`` in a field means the device does not support it."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 80 * 2**30
    memory_used: int = 0
    # (error type, counter type) -> count; a missing key reads as 0.
    ecc: dict[tuple[int, int], int] | None = field(default_factory=dict)
    # retirement cause -> page addresses.
    retired_pages: dict[int, list[int]] | None = None
    retired_pending: bool | None = None
    # nvmlDeviceGetRemappedRows: (correctable, uncorrectable, pending, failure).
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    temperature: int | None = 40
    temp_slowdown: int | None = 87
    temp_shutdown: int | None = 92
    clock_reasons: int | None = 0
    # False: a driver older than nvmlDeviceGetCurrentClocksEventReasons (FUNCTION_NOT_FOUND).
    has_event_reasons_call: bool = True
    power_mw: int | None = 300_000
    power_limit_mw: int | None = 700_000
    util_gpu: int | None = 0
    # NVML_GPU_RECOVERY_ACTION_* value; None: the driver does not know the field.
    recovery_action: int | None = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    # Link id -> active; link ids not listed are NOT_SUPPORTED.
    nvlink: dict[int, bool] = field(default_factory=dict)
    xid_events_supported: bool = True
    # Fallen off the bus: every call raises GPU_IS_LOST and the device count drops.
    lost: bool = False
    # NVML call name -> the error that call raises on this device.
    raises: dict[str, pynvml.NVMLError] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)


@dataclass
class FakeEventData:
    """What nvmlEventSetWait_v2 returns (c_nvmlEventData_t's fields the backend reads)."""

    device: FakeDevice
    eventType: int
    eventData: int


@dataclass
class FakeFieldValue:
    """One c_nvmlFieldValue_t: the per-field return code and the value union."""

    fieldId: int
    nvmlReturn: int
    valueType: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    value: Any = None


@dataclass
class _Union:
    uiVal: int


@dataclass
class _Memory:
    total: int
    free: int
    used: int


@dataclass
class _Utilization:
    gpu: int
    memory: int


class FakeNvml:
    """The fake pynvml module: pass an instance as ``NvmlBackend.open(nvml_module=...)``."""

    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[FakeDevice]) -> None:
        self.devices = devices
        # Call name -> error, for calls not tied to a device (nvmlInit, nvmlDeviceGetCount, ...).
        self.raises: dict[str, pynvml.NVMLError] = {}
        self.events: list[FakeEventData] = []
        self.init_calls = 0
        self.shutdown_calls = 0
        self.event_sets_freed = 0
        self._registered: set[int] = set()  # id() of devices registered for XID events

    def __getattr__(self, name: str) -> Any:
        # Constants (NVML_*, nvmlClocksEventReason*, ...) come from the real binding;
        # functions this fake does not define stay missing, as in an older binding.
        value = getattr(pynvml, name)
        if callable(value):
            raise AttributeError(f"FakeNvml does not implement {name}")
        return value

    def __dir__(self) -> list[str]:
        constants = [n for n in dir(pynvml) if not callable(getattr(pynvml, n))]
        return sorted({*super().__dir__(), *constants})

    def queue_xid(self, index: int, xid: int) -> None:
        """Queue an XID event on device `index`; delivered only if it registered for them."""
        device = self.devices[index]
        if id(device) in self._registered:
            self.events.append(FakeEventData(device, pynvml.nvmlEventTypeXidCriticalError, xid))

    # -- helpers -----------------------------------------------------------

    def _check(self, call: str) -> None:
        if call in self.raises:
            raise self.raises[call]

    def _dev(self, device: FakeDevice, call: str) -> FakeDevice:
        device.calls.append(call)
        if device.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if call in device.raises:
            raise device.raises[call]
        return device

    @staticmethod
    def _supported(value: Any) -> Any:
        if value is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    # -- library -----------------------------------------------------------

    def nvmlInit(self) -> None:
        self._check("nvmlInit")
        self.init_calls += 1

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return sum(1 for d in self.devices if not d.lost)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        self._check("nvmlDeviceGetHandleByIndex")
        visible = [d for d in self.devices if not d.lost]
        if index >= len(visible):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._dev(visible[index], "nvmlDeviceGetHandleByIndex")

    def nvmlDeviceGetIndex(self, handle: FakeDevice) -> int:
        self._dev(handle, "nvmlDeviceGetIndex")
        return self.devices.index(handle)

    # -- identity ----------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        return self._dev(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:
        return self._dev(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> _Memory:
        d = self._dev(handle, "nvmlDeviceGetMemoryInfo")
        return _Memory(d.memory_total, d.memory_total - d.memory_used, d.memory_used)

    # -- memory errors -----------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(
        self, handle: FakeDevice, error_type: int, counter_type: int
    ) -> int:
        ecc = self._supported(self._dev(handle, "nvmlDeviceGetTotalEccErrors").ecc)
        return int(ecc.get((error_type, counter_type), 0))

    def nvmlDeviceGetRetiredPages(self, handle: FakeDevice, cause: int) -> list[int]:
        pages = self._supported(self._dev(handle, "nvmlDeviceGetRetiredPages").retired_pages)
        return list(pages.get(cause, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeDevice) -> int:
        d = self._dev(handle, "nvmlDeviceGetRetiredPagesPendingStatus")
        return int(self._supported(d.retired_pending))

    def nvmlDeviceGetRemappedRows(self, handle: FakeDevice) -> tuple[int, int, int, int]:
        d = self._dev(handle, "nvmlDeviceGetRemappedRows")
        rows: tuple[int, int, int, int] = self._supported(d.remapped_rows)
        return rows

    # -- thermal, clocks, power --------------------------------------------

    def nvmlDeviceGetTemperatureV(self, handle: FakeDevice, sensor: int) -> int:
        d = self._dev(handle, "nvmlDeviceGetTemperatureV")
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self._supported(d.temperature))

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeDevice, threshold: int) -> int:
        d = self._dev(handle, "nvmlDeviceGetTemperatureThreshold")
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return int(self._supported(d.temp_slowdown))
        assert threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
        return int(self._supported(d.temp_shutdown))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeDevice) -> int:
        d = self._dev(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        if not d.has_event_reasons_call:
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return int(self._supported(d.clock_reasons))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeDevice) -> int:
        d = self._dev(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return int(self._supported(d.clock_reasons))

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        return int(self._supported(self._dev(handle, "nvmlDeviceGetPowerUsage").power_mw))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeDevice) -> int:
        d = self._dev(handle, "nvmlDeviceGetEnforcedPowerLimit")
        return int(self._supported(d.power_limit_mw))

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> _Utilization:
        d = self._dev(handle, "nvmlDeviceGetUtilizationRates")
        return _Utilization(gpu=int(self._supported(d.util_gpu)), memory=0)

    # -- field values, NVLink ----------------------------------------------

    def nvmlDeviceGetFieldValues(
        self, handle: FakeDevice, field_ids: list[int]
    ) -> list[FakeFieldValue]:
        d = self._dev(handle, "nvmlDeviceGetFieldValues")
        values = []
        for field_id in field_ids:
            if field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and (
                d.recovery_action is not None
            ):
                values.append(
                    FakeFieldValue(field_id, pynvml.NVML_SUCCESS, value=_Union(d.recovery_action))
                )
            else:
                values.append(FakeFieldValue(field_id, pynvml.NVML_ERROR_NOT_SUPPORTED))
        return values

    def nvmlDeviceGetNvLinkState(self, handle: FakeDevice, link: int) -> int:
        d = self._dev(handle, "nvmlDeviceGetNvLinkState")
        if link not in d.nvlink:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(pynvml.NVML_FEATURE_ENABLED if d.nvlink[link] else pynvml.NVML_FEATURE_DISABLED)

    # -- events ------------------------------------------------------------

    def nvmlEventSetCreate(self) -> str:
        self._check("nvmlEventSetCreate")
        return "event-set"

    def nvmlDeviceRegisterEvents(
        self, handle: FakeDevice, event_types: int, event_set: str
    ) -> None:
        d = self._dev(handle, "nvmlDeviceRegisterEvents")
        assert event_set == "event-set"
        if not d.xid_events_supported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if event_types & pynvml.nvmlEventTypeXidCriticalError:
            self._registered.add(id(d))

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> FakeEventData:
        assert timeout_ms == 0, "the backend must never block on events"
        self._check("nvmlEventSetWait_v2")
        if not self.events:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self._check("nvmlEventSetFree")
        self.event_sets_freed += 1
