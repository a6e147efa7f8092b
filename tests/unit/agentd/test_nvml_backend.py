"""The NVML backend maps each NVML answer onto the sample fields, against a fake pynvml."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pynvml
import pytest

from agentd.gpu.base import GpuBackendError, RecoveryAction, Throttle
from agentd.gpu.nvml import NvmlBackend
from tests.unit.agentd.fake_pynvml import (
    AGGREGATE,
    CORRECTED,
    DBE_CAUSE,
    SBE_CAUSE,
    UNCORRECTED,
    VOLATILE,
    FakeDevice,
    FakeNvml,
    nvml_error,
)


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml([FakeDevice("GPU-aaaa"), FakeDevice("GPU-bbbb")])


@pytest.fixture
def backend(fake: FakeNvml) -> Iterator[NvmlBackend]:
    backend = NvmlBackend.open(nvml_module=fake)
    yield backend
    backend.close()


def test_backend_is_named_nvml(backend: NvmlBackend) -> None:
    assert backend.name == "nvml"


def test_inventory_reports_index_uuid_model_and_memory(backend: NvmlBackend) -> None:
    first, second = backend.inventory()

    assert (first.index, first.uuid, first.model) == (0, "GPU-aaaa", "NVIDIA H100 80GB HBM3")
    assert first.memory_bytes == 80 * 2**30
    assert (second.index, second.uuid) == (1, "GPU-bbbb")


def test_inventory_failure_raises_gpu_backend_error_naming_gpu_and_call(
    fake: FakeNvml, backend: NvmlBackend
) -> None:
    fake.devices[1].raises["nvmlDeviceGetName"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    with pytest.raises(GpuBackendError, match=r"GPU 1 \(GPU-bbbb\): nvmlDeviceGetName"):
        backend.inventory()


def test_double_bit_ecc_counts_are_reported_volatile_and_aggregate(fake: FakeNvml) -> None:
    fake.devices[1].ecc = {(UNCORRECTED, VOLATILE): 1, (UNCORRECTED, AGGREGATE): 3}

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[1]

    assert (gpu.ecc_dbe_volatile, gpu.ecc_dbe_aggregate) == (1, 3)
    assert (gpu.ecc_sbe_volatile, gpu.ecc_sbe_aggregate) == (0, 0)


def test_single_bit_ecc_counts_are_reported_as_corrected(fake: FakeNvml) -> None:
    fake.devices[0].ecc = {(CORRECTED, VOLATILE): 5, (CORRECTED, AGGREGATE): 40}

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert (gpu.ecc_sbe_volatile, gpu.ecc_sbe_aggregate) == (5, 40)
    assert gpu.ecc_dbe_volatile == 0


def test_unsupported_ecc_is_none_not_zero(fake: FakeNvml) -> None:
    fake.devices[0].ecc = None

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.ecc_sbe_volatile is None
    assert gpu.ecc_dbe_volatile is None
    assert gpu.ecc_sbe_aggregate is None
    assert gpu.ecc_dbe_aggregate is None
    assert gpu.errors == ()


def test_xid_79_is_reported_once_then_drained(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.queue_xid(1, 79)

    assert backend.sample().xids == ((1, 79),)
    assert backend.sample().xids == ()


def test_all_pending_xids_are_drained_in_one_sample(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.queue_xid(0, 48)
    fake.queue_xid(1, 79)
    fake.queue_xid(1, 94)

    assert backend.sample().xids == ((0, 48), (1, 79), (1, 94))
    assert fake.events == []


def test_xids_unsupported_means_no_xids_and_one_log_line(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    for device in fake.devices:
        device.xid_events_supported = False
    caplog.set_level(logging.INFO, logger="agentd.gpu.nvml")

    with NvmlBackend.open(nvml_module=fake) as backend:
        fake.queue_xid(0, 79)
        first, second = backend.sample(), backend.sample()

    assert (first.xids, first.errors, second.xids, second.errors) == ((), (), (), ())
    assert len([r for r in caplog.records if "XID events not supported" in r.message]) == 1


def test_event_wait_failure_is_a_node_error(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.raises["nvmlEventSetWait_v2"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    sample = backend.sample()

    assert sample.errors == ("nvmlEventSetWait_v2: Unknown Error",)


def test_event_registration_failure_is_a_node_error(fake: FakeNvml) -> None:
    fake.devices[0].raises["nvmlDeviceRegisterEvents"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    with NvmlBackend.open(nvml_module=fake) as backend:
        errors = backend.sample().errors

    assert len(errors) == 1
    assert errors[0].startswith("nvmlDeviceRegisterEvents(GPU 0): Unknown Error")


def test_unsupported_remap_is_none_not_false(fake: FakeNvml) -> None:
    fake.devices[0].remapped_rows = None

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert (gpu.remap_pending, gpu.remap_failed) == (None, None)
    assert gpu.errors == ()


def test_remap_pending_is_reported(fake: FakeNvml) -> None:
    fake.devices[1].remapped_rows = (0, 1, 1, 0)

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[1]

    assert (gpu.remap_pending, gpu.remap_failed) == (True, False)


def test_remap_failure_is_reported(fake: FakeNvml) -> None:
    fake.devices[1].remapped_rows = (0, 8, 0, 1)

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[1]

    assert (gpu.remap_pending, gpu.remap_failed) == (False, True)


def test_retired_pages_count_both_causes(fake: FakeNvml) -> None:
    fake.devices[0].retired_pages = {SBE_CAUSE: [0x1000, 0x2000], DBE_CAUSE: [0x3000]}
    fake.devices[0].retired_pending = True

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert (gpu.retired_pages, gpu.retired_pending) == (3, True)


def test_page_retirement_unsupported_on_ampere_is_none(backend: NvmlBackend) -> None:
    gpu = backend.sample().gpus[0]

    assert (gpu.retired_pages, gpu.retired_pending) == (None, None)


def test_other_nvml_error_is_recorded_as_call_and_message(fake: FakeNvml) -> None:
    fake.devices[1].raises["nvmlDeviceGetPowerUsage"] = nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[1]

    assert gpu.power_w is None
    assert gpu.errors == ("nvmlDeviceGetPowerUsage: Insufficient Permissions",)


def test_failed_call_does_not_hide_the_other_fields(fake: FakeNvml) -> None:
    fake.devices[0].raises["nvmlDeviceGetTotalEccErrors"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.ecc_dbe_volatile is None
    assert gpu.temperature_c == 40.0
    assert gpu.remap_pending is False


def test_lost_gpu_reports_one_error_and_is_not_read_further(fake: FakeNvml) -> None:
    backend = NvmlBackend.open(nvml_module=fake)
    fake.devices[1].lost = True
    calls_before = len(fake.devices[1].calls)

    sample = backend.sample()
    backend.close()

    (error,) = sample.gpus[1].errors
    assert error.endswith(": GPU is lost")
    assert len(fake.devices[1].calls) == calls_before + 1
    assert sample.gpus[0].errors == ()


def test_device_count_drop_is_a_node_error(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.devices[1].lost = True

    assert "nvmlDeviceGetCount: 1 GPUs visible, 2 at start" in backend.sample().errors


def test_device_count_failure_is_a_node_error(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.raises["nvmlDeviceGetCount"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    sample = backend.sample()

    assert sample.errors == ("nvmlDeviceGetCount: Unknown Error",)
    assert len(sample.gpus) == 2


def test_handle_failure_at_open_is_a_node_error_on_every_sample(fake: FakeNvml) -> None:
    fake.devices[1].raises["nvmlDeviceGetHandleByIndex"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)

    with NvmlBackend.open(nvml_module=fake) as backend:
        first, second = backend.sample(), backend.sample()

    assert [g.uuid for g in first.gpus] == ["GPU-aaaa"]
    assert first.errors == second.errors
    assert first.errors[0].startswith("nvmlDeviceGetHandleByIndex(1): GPU is lost")


def test_throttle_reasons_are_mapped(fake: FakeNvml) -> None:
    fake.devices[0].clock_reasons = (
        pynvml.nvmlClocksEventReasonHwSlowdown
        | pynvml.nvmlClocksEventReasonSwThermalSlowdown
        | pynvml.nvmlClocksEventReasonGpuIdle
    )

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.throttle == {Throttle.HW_SLOWDOWN, Throttle.SW_THERMAL}


def test_every_health_throttle_reason_has_its_nvml_bit(fake: FakeNvml) -> None:
    fake.devices[0].clock_reasons = pynvml.nvmlClocksEventReasonAll

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.throttle == frozenset(Throttle)


def test_throttle_reasons_fall_back_to_legacy_call_on_old_driver(fake: FakeNvml) -> None:
    fake.devices[0].has_event_reasons_call = False
    fake.devices[0].clock_reasons = pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.throttle == {Throttle.HW_POWER_BRAKE}
    assert gpu.errors == ()


def test_power_is_converted_from_milliwatts_to_watts(fake: FakeNvml) -> None:
    fake.devices[0].power_mw = 412_500
    fake.devices[0].power_limit_mw = 700_000

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert (gpu.power_w, gpu.power_limit_w) == (412.5, 700.0)


def test_temperature_and_the_gpus_own_thresholds_are_reported(fake: FakeNvml) -> None:
    device = fake.devices[0]
    device.temperature, device.temp_slowdown, device.temp_shutdown = 83, 88, 93

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert (gpu.temperature_c, gpu.temp_slowdown_c, gpu.temp_shutdown_c) == (83.0, 88.0, 93.0)


def test_utilisation_and_memory_are_reported(fake: FakeNvml) -> None:
    fake.devices[0].util_gpu = 97
    fake.devices[0].memory_used = 60 * 2**30

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.util_pct == 97.0
    assert (gpu.mem_used_bytes, gpu.mem_total_bytes) == (60 * 2**30, 80 * 2**30)


def test_recovery_action_is_read_from_field_values(fake: FakeNvml) -> None:
    fake.devices[1].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET

    with NvmlBackend.open(nvml_module=fake) as backend:
        sample = backend.sample()

    assert sample.gpus[0].recovery_action is RecoveryAction.NONE
    assert sample.gpus[1].recovery_action is RecoveryAction.DRAIN_AND_RESET


def test_recovery_action_unknown_to_driver_is_none(fake: FakeNvml) -> None:
    fake.devices[0].recovery_action = None

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.recovery_action is None
    assert gpu.errors == ()


def test_recovery_action_bus_reset_maps_to_its_enum_member(fake: FakeNvml) -> None:
    fake.devices[0].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_BUS_RESET

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.recovery_action is RecoveryAction.BUS_RESET
    assert gpu.errors == ()


def test_nvlink_up_at_open_and_down_now_is_reported(fake: FakeNvml) -> None:
    fake.devices[0].nvlink = {0: True, 1: True, 2: True}
    backend = NvmlBackend.open(nvml_module=fake)
    fake.devices[0].nvlink[2] = False

    gpu = backend.sample().gpus[0]
    backend.close()

    assert gpu.nvlink_down == (2,)


def test_nvlink_down_at_open_is_not_reported(fake: FakeNvml) -> None:
    fake.devices[0].nvlink = {0: True, 1: False}

    with NvmlBackend.open(nvml_module=fake) as backend:
        gpu = backend.sample().gpus[0]

    assert gpu.nvlink_down == ()


def test_gpu_without_nvlink_reports_no_links_down_and_no_errors(backend: NvmlBackend) -> None:
    gpu = backend.sample().gpus[0]

    assert (gpu.nvlink_down, gpu.errors) == ((), ())


def test_nvml_init_failure_raises_gpu_backend_error_for_the_operator(fake: FakeNvml) -> None:
    fake.raises["nvmlInit"] = nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    with pytest.raises(GpuBackendError, match="NVIDIA kernel driver is not loaded"):
        NvmlBackend.open(nvml_module=fake)


def test_device_count_failure_at_open_raises_and_shuts_nvml_down(fake: FakeNvml) -> None:
    fake.raises["nvmlDeviceGetCount"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    with pytest.raises(GpuBackendError, match="nvmlDeviceGetCount"):
        NvmlBackend.open(nvml_module=fake)
    assert fake.shutdown_calls == 1


def test_close_is_idempotent(fake: FakeNvml) -> None:
    backend = NvmlBackend.open(nvml_module=fake)

    backend.close()
    backend.close()

    assert (fake.event_sets_freed, fake.shutdown_calls) == (1, 1)


def test_sample_after_close_raises(fake: FakeNvml) -> None:
    backend = NvmlBackend.open(nvml_module=fake)
    backend.close()

    with pytest.raises(GpuBackendError, match="closed"):
        backend.sample()
