"""The NVML backend: real GPUs, read through pynvml (the nvidia-ml-py package).

Rules every reading follows:

* NVML answering NOT_SUPPORTED (or FUNCTION_NOT_FOUND: a driver older than the
  call) means "unknown": the field stays ``None``, never 0.
* Any other NVML error goes into that GPU's ``errors`` as ``"call: message"``.
  A GPU that reports GPU_IS_LOST is not read further in that sample.
* Failures not tied to one GPU (device count, handles, the XID event set) go
  into ``NodeSample.errors``.

GPU handles, the NVLink baseline and the XID event set are taken once, in
`NvmlBackend.open`; NVML keeps handles valid until ``nvmlShutdown``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from agentd.gpu.base import (
    GpuBackendError,
    GpuInfo,
    GpuSample,
    NodeSample,
    RecoveryAction,
    Throttle,
)

log = logging.getLogger(__name__)

# A storm of events is drained over several samples rather than in one endless loop.
_MAX_EVENTS_PER_SAMPLE = 4096

# Suffixes of NVML's nvmlClocksEventReason* (older bindings: nvmlClocksThrottleReason*).
_THROTTLE_REASONS = {
    "HwSlowdown": Throttle.HW_SLOWDOWN,
    "HwThermalSlowdown": Throttle.HW_THERMAL,
    "HwPowerBrakeSlowdown": Throttle.HW_POWER_BRAKE,
    "SwThermalSlowdown": Throttle.SW_THERMAL,
    "SwPowerCap": Throttle.SW_POWER_CAP,
}

_RECOVERY_PREFIX = "NVML_GPU_RECOVERY_ACTION_"

# Preferred call first; the next ones serve older drivers (FUNCTION_NOT_FOUND) or bindings.
_CLOCK_REASON_CALLS = (
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
)
_TEMPERATURE_CALLS = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")

# nvmlInit error code -> what to tell the operator.
_INIT_HINTS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "libnvidia-ml.so.1 not found (is the NVIDIA driver installed?)",
    "NVML_ERROR_DRIVER_NOT_LOADED": "the NVIDIA kernel driver is not loaded",
    "NVML_ERROR_NO_PERMISSION": "no permission to open the GPU devices (/dev/nvidia*)",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "libnvidia-ml and the kernel driver differ in version",
}


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise GpuBackendError(
            f"the NVML binding is not installed (pip install nvidia-ml-py): {exc}"
        ) from exc
    return pynvml


def _init_failure(nvml: Any, exc: Exception) -> str:
    """An operator-facing sentence for an nvmlInit failure."""
    code = getattr(exc, "value", None)
    why = next(
        (hint for name, hint in _INIT_HINTS.items() if code == getattr(nvml, name, None)),
        "the NVIDIA driver did not answer",
    )
    return f"NVML could not initialise: {why} [nvmlInit: {exc}]"


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any, scale: float = 1.0) -> float | None:
    return None if value is None else float(value) / scale


@dataclass(frozen=True)
class _Gpu:
    index: int
    uuid: str
    handle: Any
    links_up: tuple[int, ...]


class _Reader:
    """Calls NVML for one GPU: NOT_SUPPORTED becomes None, other errors become strings."""

    def __init__(self, nvml: Any, handle: Any, unsupported: frozenset[int]) -> None:
        self._nvml = nvml
        self._handle = handle
        self._unsupported = unsupported
        self.errors: list[str] = []
        self.lost = False

    def read(self, names: str | tuple[str, ...], *args: Any) -> Any:
        """The first of `names` that the binding and driver support, called on the GPU.

        Returns None when none is supported, when the call failed (recorded in
        `errors`), or when the GPU was lost earlier in this sample.
        """
        for name in (names,) if isinstance(names, str) else names:
            fn = getattr(self._nvml, name, None)
            if fn is None or self.lost:
                continue
            try:
                return fn(self._handle, *args)
            except self._nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code in self._unsupported:
                    continue
                self.errors.append(f"{name}: {exc}")
                self.lost = code == self._nvml.NVML_ERROR_GPU_IS_LOST
                return None
        return None


class NvmlBackend:
    """GPU samples from NVML. Build with `NvmlBackend.open()`; release with `close()`."""

    name = "nvml"

    @classmethod
    def open(cls, nvml_module: Any = None) -> NvmlBackend:
        """Initialise NVML and take the GPUs it sees now.

        `nvml_module` replaces ``pynvml`` (tests pass a fake). Raises
        `GpuBackendError` when NVML cannot start or cannot count the GPUs.
        """
        nvml = _import_pynvml() if nvml_module is None else nvml_module
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise GpuBackendError(_init_failure(nvml, exc)) from exc
        try:
            return cls(nvml)
        except BaseException:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                log.warning("nvmlShutdown after a failed open: %s", exc)
            raise

    def __init__(self, nvml: Any) -> None:
        """Enumerate GPUs on an already initialised NVML; use `open` instead."""
        self._nvml = nvml
        self._lock = threading.Lock()
        self._closed = False
        self._unsupported = frozenset(
            code
            for code in (
                getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", None),
                getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", None),
            )
            if code is not None
        )
        # Errors found at open that hold for the backend's life (a GPU without a handle, ...).
        self._open_errors: list[str] = []
        try:
            self._count_at_open = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise GpuBackendError(
                f"NVML started but cannot count GPUs [nvmlDeviceGetCount: {exc}]"
            ) from exc
        self._throttle_bits = self._resolve_throttle_bits()
        self._recovery_field: int | None = getattr(
            nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None
        )
        self._recovery_names = {
            int(getattr(nvml, attr)): attr.removeprefix(_RECOVERY_PREFIX)
            for attr in dir(nvml)
            if attr.startswith(_RECOVERY_PREFIX)
        }
        self._gpus = self._enumerate()
        self._event_set: Any = None
        self._xid_mask = int(getattr(nvml, "nvmlEventTypeXidCriticalError", 0))
        self._open_xid_events()
        for message in self._open_errors:
            log.warning("NVML at open: %s", message)

    # -- open-time helpers -------------------------------------------------

    def _resolve_throttle_bits(self) -> tuple[tuple[int, Throttle], ...]:
        bits = []
        for suffix, throttle in _THROTTLE_REASONS.items():
            bit = getattr(self._nvml, "nvmlClocksEventReason" + suffix, None)
            if bit is None:
                bit = getattr(self._nvml, "nvmlClocksThrottleReason" + suffix, None)
            if bit is not None:
                bits.append((int(bit), throttle))
        return tuple(bits)

    def _enumerate(self) -> tuple[_Gpu, ...]:
        nvml = self._nvml
        gpus = []
        for index in range(self._count_at_open):
            call = "nvmlDeviceGetHandleByIndex"
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                call = "nvmlDeviceGetUUID"
                uuid = str(nvml.nvmlDeviceGetUUID(handle))
            except nvml.NVMLError as exc:
                self._open_errors.append(f"{call}({index}): {exc}; GPU {index} is not watched")
                continue
            gpus.append(_Gpu(index, uuid, handle, self._links_up(index, handle)))
        return tuple(gpus)

    def _links_up(self, index: int, handle: Any) -> tuple[int, ...]:
        nvml = self._nvml
        up = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0))):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except nvml.NVMLError:
                continue  # no such link on this GPU (NOT_SUPPORTED / INVALID_ARGUMENT)
            if int(state) == nvml.NVML_FEATURE_ENABLED:
                up.append(link)
        log.debug("GPU %d: NVLink links up at open: %s", index, up)
        return tuple(up)

    def _open_xid_events(self) -> None:
        nvml = self._nvml
        if not self._xid_mask or not self._gpus:
            return
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) in self._unsupported:
                log.info("NVML events not supported: XIDs will not be reported (%s)", exc)
            else:
                self._open_errors.append(f"nvmlEventSetCreate: {exc}; XIDs are not watched")
            return
        unsupported = []
        for gpu in self._gpus:
            try:
                nvml.nvmlDeviceRegisterEvents(gpu.handle, self._xid_mask, self._event_set)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) in self._unsupported:
                    unsupported.append(gpu.index)
                else:
                    self._open_errors.append(
                        f"nvmlDeviceRegisterEvents(GPU {gpu.index}): {exc}; XIDs not watched"
                    )
        if unsupported:
            log.info(
                "XID events not supported on GPU(s) %s: no XIDs reported for them", unsupported
            )

    # -- GpuBackend --------------------------------------------------------

    def inventory(self) -> list[GpuInfo]:
        """The GPUs taken at open, with model and memory read now.

        Raises `GpuBackendError` naming the GPU and call when NVML fails.
        """
        nvml = self._nvml
        with self._lock:
            self._check_open()
            infos = []
            for gpu in self._gpus:
                call = "nvmlDeviceGetName"
                try:
                    model = str(nvml.nvmlDeviceGetName(gpu.handle))
                    call = "nvmlDeviceGetMemoryInfo"
                    memory = int(nvml.nvmlDeviceGetMemoryInfo(gpu.handle).total)
                except nvml.NVMLError as exc:
                    raise GpuBackendError(f"GPU {gpu.index} ({gpu.uuid}): {call}: {exc}") from exc
                infos.append(GpuInfo(gpu.index, gpu.uuid, model, memory))
            return infos

    def sample(self) -> NodeSample:
        """Read every GPU once and drain pending XID events (never blocks on events)."""
        with self._lock:
            self._check_open()
            errors = list(self._open_errors)
            try:
                count = int(self._nvml.nvmlDeviceGetCount())
            except self._nvml.NVMLError as exc:
                errors.append(f"nvmlDeviceGetCount: {exc}")
            else:
                if count != self._count_at_open:
                    errors.append(
                        f"nvmlDeviceGetCount: {count} GPUs visible, {self._count_at_open} at start"
                    )
            gpus = tuple(self._sample_gpu(gpu) for gpu in self._gpus)
            xids = self._drain_xids(errors)
            return NodeSample(gpus=gpus, xids=tuple(xids), errors=tuple(errors))

    def close(self) -> None:
        """Free the event set and shut NVML down; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            nvml = self._nvml
            if self._event_set is not None:
                try:
                    nvml.nvmlEventSetFree(self._event_set)
                except nvml.NVMLError as exc:
                    log.warning("nvmlEventSetFree: %s", exc)
                self._event_set = None
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                log.warning("nvmlShutdown: %s", exc)

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- sampling ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise GpuBackendError("the NVML backend is closed")

    def _sample_gpu(self, gpu: _Gpu) -> GpuSample:
        n = self._nvml
        r = _Reader(n, gpu.handle, self._unsupported)
        ecc = "nvmlDeviceGetTotalEccErrors"
        sbe, dbe = n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        causes = (
            n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        pages = [r.read("nvmlDeviceGetRetiredPages", cause) for cause in causes]
        pending = r.read("nvmlDeviceGetRetiredPagesPendingStatus")
        remap = r.read("nvmlDeviceGetRemappedRows")  # (correctable, uncorrectable, pending, failed)
        threshold = "nvmlDeviceGetTemperatureThreshold"
        reasons = _opt_int(r.read(_CLOCK_REASON_CALLS))
        util = r.read("nvmlDeviceGetUtilizationRates")
        memory = r.read("nvmlDeviceGetMemoryInfo")
        sample = GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            ecc_sbe_volatile=_opt_int(r.read(ecc, sbe, n.NVML_VOLATILE_ECC)),
            ecc_dbe_volatile=_opt_int(r.read(ecc, dbe, n.NVML_VOLATILE_ECC)),
            ecc_sbe_aggregate=_opt_int(r.read(ecc, sbe, n.NVML_AGGREGATE_ECC)),
            ecc_dbe_aggregate=_opt_int(r.read(ecc, dbe, n.NVML_AGGREGATE_ECC)),
            retired_pages=None if None in pages else sum(len(p) for p in pages),
            retired_pending=None if pending is None else pending == n.NVML_FEATURE_ENABLED,
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failed=None if remap is None else bool(remap[3]),
            temperature_c=_opt_float(r.read(_TEMPERATURE_CALLS, n.NVML_TEMPERATURE_GPU)),
            temp_slowdown_c=_opt_float(r.read(threshold, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
            temp_shutdown_c=_opt_float(r.read(threshold, n.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)),
            throttle=frozenset(t for bit, t in self._throttle_bits if (reasons or 0) & bit),
            power_w=_opt_float(r.read("nvmlDeviceGetPowerUsage"), 1000.0),
            power_limit_w=_opt_float(r.read("nvmlDeviceGetEnforcedPowerLimit"), 1000.0),
            util_pct=None if util is None else float(util.gpu),
            mem_used_bytes=None if memory is None else int(memory.used),
            mem_total_bytes=None if memory is None else int(memory.total),
            recovery_action=self._recovery_action(r),
            nvlink_down=tuple(
                link
                for link in gpu.links_up
                if r.read("nvmlDeviceGetNvLinkState", link) == n.NVML_FEATURE_DISABLED
            ),
        )
        return replace(sample, errors=tuple(r.errors))

    def _recovery_action(self, r: _Reader) -> RecoveryAction | None:
        nvml = self._nvml
        if self._recovery_field is None:
            return None  # the binding predates the field
        values = r.read("nvmlDeviceGetFieldValues", [self._recovery_field])
        if values is None:
            return None
        value = values[0]
        code = int(value.nvmlReturn)
        call = "nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)"
        if code != nvml.NVML_SUCCESS:
            if code not in self._unsupported:
                r.errors.append(f"{call}: {nvml.NVMLError(code)}")
            return None
        raw = int(value.value.uiVal)  # NVML reports this field as NVML_VALUE_TYPE_UNSIGNED_INT
        name = self._recovery_names.get(raw)
        try:
            return RecoveryAction((name or "").lower())
        except ValueError:
            r.errors.append(
                f"{call}: action {raw} ({name or 'unknown'}) has no RecoveryAction member"
            )
            return None

    def _drain_xids(self, errors: list[str]) -> list[tuple[int, int]]:
        nvml = self._nvml
        xids: list[tuple[int, int]] = []
        if self._event_set is None:
            return xids
        for _ in range(_MAX_EVENTS_PER_SAMPLE):
            try:
                event = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                    errors.append(f"nvmlEventSetWait_v2: {exc}")
                break
            if not int(event.eventType) & self._xid_mask:
                continue
            xid = int(event.eventData)
            try:
                index = int(nvml.nvmlDeviceGetIndex(event.device))
            except nvml.NVMLError as exc:
                errors.append(f"XID {xid} on an unidentified GPU [nvmlDeviceGetIndex: {exc}]")
                continue
            xids.append((index, xid))
        return xids
