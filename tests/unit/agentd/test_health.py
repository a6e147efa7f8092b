"""HealthClassifier: every rule turns a sample into the reason and status the fleet acts on."""

from __future__ import annotations

import math
from typing import Any

import pytest

from agentd.config import Thresholds
from agentd.gpu.base import GpuSample, NodeSample, RecoveryAction, Throttle
from agentd.health import HealthClassifier
from phalanx.wire import Health, HealthStatus, HostGauges, Reason

GIB = 1024**3


def _gpu(index: int = 0, **fields: Any) -> GpuSample:
    healthy: dict[str, Any] = {
        "ecc_sbe_volatile": 0,
        "ecc_dbe_volatile": 0,
        "retired_pages": 0,
        "retired_pending": False,
        "remap_pending": False,
        "remap_failed": False,
        "temperature_c": 45.0,
        "temp_slowdown_c": 87.0,
        "temp_shutdown_c": 92.0,
        "recovery_action": RecoveryAction.NONE,
    }
    return GpuSample(index=index, uuid=f"GPU-{index}", **{**healthy, **fields})


def _node(
    *gpus: GpuSample, xids: tuple[tuple[int, int], ...] = (), errors: tuple[str, ...] = ()
) -> NodeSample:
    return NodeSample(gpus=gpus or (_gpu(0), _gpu(1)), xids=xids, errors=errors)


def _host(**fields: Any) -> HostGauges:
    healthy: dict[str, Any] = {
        "disk_free_bytes": 500 * GIB,
        "disk_total_bytes": 1000 * GIB,
        "mem_available_bytes": 100 * GIB,
        "mem_total_bytes": 128 * GIB,
        "load1": 1.0,
        "cpu_count": 16,
    }
    return HostGauges(**{**healthy, **fields})


def _classifier(gpus_at_birth: int = 2, **thresholds: Any) -> HealthClassifier:
    return HealthClassifier(Thresholds(**thresholds), gpus_at_birth=gpus_at_birth)


def _only(health: Health) -> Reason:
    assert len(health.reasons) == 1, health.reasons
    return health.reasons[0]


def _codes(health: Health) -> set[str]:
    return {r.code for r in health.reasons}


def test_a_healthy_node_is_ok_with_no_reasons() -> None:
    health = _classifier().classify(_node(), _host(), now=100.0)

    assert health.status is HealthStatus.OK
    assert health.reasons == []


def test_health_carries_gauges_of_every_gpu_and_the_host() -> None:
    host = _host()

    health = _classifier().classify(_node(), host, now=100.0)

    assert [g.index for g in health.gpus] == [0, 1]
    assert health.host == host
    assert health.sampled_at == 100.0


def test_a_double_bit_ecc_error_drains_with_the_gpu_index() -> None:
    health = _classifier().classify(_node(_gpu(0), _gpu(1, ecc_dbe_volatile=2)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.severity, reason.gpu) == ("ecc_dbe", "drain", 1)


@pytest.mark.parametrize("xid", [46, 48, 64, 74, 79, 95])
def test_a_drain_xid_drains(xid: int) -> None:
    health = _classifier().classify(_node(xids=((1, xid),)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.severity, reason.gpu) == (f"xid_{xid}", "drain", 1)


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 63, 68, 92, 94, 109])
def test_a_warn_xid_warns(xid: int) -> None:
    health = _classifier().classify(_node(xids=((0, xid),)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.WARN
    assert (reason.code, reason.severity, reason.gpu) == (f"xid_{xid}", "warn", 0)


def test_an_unknown_xid_is_ignored() -> None:
    health = _classifier().classify(_node(xids=((0, 999),)), None, now=0.0)

    assert health.status is HealthStatus.OK
    assert health.reasons == []


def test_an_xid_reason_is_held_for_xid_hold_s_after_the_event() -> None:
    classifier = _classifier(xid_hold_s=100.0)
    classifier.classify(_node(xids=((0, 79),)), None, now=1000.0)

    health = classifier.classify(_node(), None, now=1100.0)

    assert _codes(health) == {"xid_79"}
    assert health.status is HealthStatus.DRAIN


def test_an_xid_reason_is_dropped_after_xid_hold_s() -> None:
    classifier = _classifier(xid_hold_s=100.0)
    classifier.classify(_node(xids=((0, 79),)), None, now=1000.0)

    health = classifier.classify(_node(), None, now=1100.5)

    assert health.status is HealthStatus.OK
    assert health.reasons == []


def test_a_repeated_xid_restarts_its_hold() -> None:
    classifier = _classifier(xid_hold_s=100.0)
    classifier.classify(_node(xids=((0, 79),)), None, now=1000.0)
    classifier.classify(_node(xids=((0, 79),)), None, now=1080.0)

    health = classifier.classify(_node(), None, now=1150.0)

    assert _codes(health) == {"xid_79"}


def test_a_pending_row_remap_warns() -> None:
    health = _classifier().classify(_node(_gpu(0, remap_pending=True), _gpu(1)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.WARN
    assert (reason.code, reason.gpu) == ("row_remap_pending", 0)


def test_a_failed_row_remap_drains() -> None:
    sample = _node(_gpu(0, remap_failed=True, remap_pending=True), _gpu(1))

    health = _classifier().classify(sample, None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("row_remap_failed", 0)


def test_retired_pages_above_the_threshold_drain() -> None:
    health = _classifier().classify(_node(_gpu(0, retired_pages=11), _gpu(1)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("retired_pages", 0)


def test_retired_pages_at_the_threshold_do_not_drain() -> None:
    health = _classifier().classify(_node(_gpu(0, retired_pages=10), _gpu(1)), None, now=0.0)

    assert health.status is HealthStatus.OK


def test_a_pending_page_retirement_drains() -> None:
    health = _classifier().classify(_node(_gpu(0, retired_pending=True), _gpu(1)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert reason.code == "retirement_pending"


@pytest.mark.parametrize("action", [a for a in RecoveryAction if a is not RecoveryAction.NONE])
def test_a_recovery_action_other_than_none_drains(action: RecoveryAction) -> None:
    health = _classifier().classify(_node(_gpu(0), _gpu(1, recovery_action=action)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("recovery_action", 1)
    assert action.value in reason.detail


def test_an_unknown_recovery_action_is_not_a_reason() -> None:
    health = _classifier().classify(_node(_gpu(0, recovery_action=None), _gpu(1)), None, now=0.0)

    assert health.status is HealthStatus.OK


def test_fewer_gpus_than_at_birth_drains_as_gpu_missing() -> None:
    health = _classifier(gpus_at_birth=2).classify(_node(_gpu(0)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("gpu_missing", None)
    assert "1 GPUs visible, 2 at birth" in reason.detail


def test_a_down_nvlink_drains() -> None:
    health = _classifier().classify(_node(_gpu(0, nvlink_down=(3, 5)), _gpu(1)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("nvlink_down", 0)
    assert "[3, 5]" in reason.detail


def test_a_failing_nvml_call_on_a_gpu_drains_as_nvml_error() -> None:
    sample = _node(_gpu(0), _gpu(1, errors=("nvmlDeviceGetTemperature: Unknown Error",)))

    health = _classifier().classify(sample, None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("nvml_error", 1)
    assert "nvmlDeviceGetTemperature" in reason.detail


def test_a_node_wide_nvml_error_drains_as_nvml_error_without_a_gpu_missing_reason() -> None:
    sample = NodeSample(gpus=(), errors=("nvmlDeviceGetCount: Driver Not Loaded",))

    health = _classifier(gpus_at_birth=2).classify(sample, None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("nvml_error", None)


def test_a_backend_error_that_timed_out_drains_as_nvml_hang() -> None:
    health = _classifier().classify(
        None, None, now=0.0, backend_error="GPU sample timed out after 10.0s"
    )

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert reason.code == "nvml_hang"
    assert health.gpus == []


def test_any_other_backend_error_drains_as_nvml_error() -> None:
    health = _classifier().classify(None, None, now=0.0, backend_error="NVML went away")

    assert _only(health).code == "nvml_error"
    assert health.status is HealthStatus.DRAIN


def test_a_temperature_at_the_slowdown_threshold_warns() -> None:
    health = _classifier().classify(_node(_gpu(0, temperature_c=87.0), _gpu(1)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.WARN
    assert (reason.code, reason.gpu) == ("temp_slowdown", 0)


def test_a_temperature_at_the_shutdown_threshold_drains() -> None:
    health = _classifier().classify(_node(_gpu(0, temperature_c=92.0), _gpu(1)), None, now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("temp_shutdown", 0)


def test_a_temperature_below_slowdown_is_fine() -> None:
    health = _classifier().classify(_node(_gpu(0, temperature_c=86.9), _gpu(1)), None, now=0.0)

    assert health.status is HealthStatus.OK


def _sbe_series(classifier: HealthClassifier, points: list[tuple[float, int]]) -> Health:
    health = None
    for now, count in points:
        health = classifier.classify(_node(_gpu(0, ecc_sbe_volatile=count), _gpu(1)), None, now=now)
    assert health is not None
    return health


def test_a_rising_corrected_ecc_rate_warns() -> None:
    # 50 errors in 60 s is 3000/hour, over the default 100/hour.
    health = _sbe_series(_classifier(), [(0.0, 0), (60.0, 50)])

    reason = _only(health)
    assert health.status is HealthStatus.WARN
    assert (reason.code, reason.gpu) == ("ecc_sbe_rate", 0)


def test_a_flat_corrected_ecc_count_does_not_warn_however_high() -> None:
    health = _sbe_series(_classifier(), [(0.0, 5000), (60.0, 5000), (120.0, 5000)])

    assert health.status is HealthStatus.OK


def test_a_slow_corrected_ecc_rate_does_not_warn() -> None:
    # 1 error in 60 s is 60/hour, under 100/hour.
    health = _sbe_series(_classifier(), [(0.0, 0), (60.0, 1)])

    assert health.status is HealthStatus.OK


def test_a_single_corrected_ecc_reading_gives_no_rate() -> None:
    health = _sbe_series(_classifier(), [(0.0, 5000)])

    assert health.status is HealthStatus.OK


def test_a_corrected_ecc_counter_reset_does_not_produce_a_rate() -> None:
    health = _sbe_series(_classifier(), [(0.0, 0), (60.0, 500), (120.0, 0)])

    assert "ecc_sbe_rate" not in _codes(health)


def test_after_a_counter_reset_the_rate_is_measured_from_the_reset() -> None:
    # 50 errors in the 60 s since the reset is 3000/hour; the 10000 before it no longer count.
    health = _sbe_series(_classifier(), [(0.0, 10000), (60.0, 10000), (120.0, 0), (180.0, 50)])

    assert _codes(health) == {"ecc_sbe_rate"}


def test_corrected_errors_older_than_the_window_stop_counting() -> None:
    # A burst of 500 early on, then flat for longer than the 600 s window.
    points = [(0.0, 0), (60.0, 500)] + [(60.0 + 60 * k, 500) for k in range(1, 13)]

    health = _sbe_series(_classifier(sbe_window_s=600.0), points)

    assert health.status is HealthStatus.OK


def _throttled(
    classifier: HealthClassifier,
    now: float,
    throttle: frozenset[Throttle] = frozenset({Throttle.HW_SLOWDOWN}),
) -> Health:
    return classifier.classify(_node(_gpu(0, throttle=throttle), _gpu(1)), None, now=now)


def test_a_slowdown_shorter_than_slowdown_sustain_s_does_not_warn() -> None:
    classifier = _classifier(slowdown_sustain_s=60.0)
    _throttled(classifier, now=0.0)

    assert _throttled(classifier, now=59.0).status is HealthStatus.OK


def test_a_slowdown_sustained_for_slowdown_sustain_s_warns() -> None:
    classifier = _classifier(slowdown_sustain_s=60.0)
    _throttled(classifier, now=0.0)
    _throttled(classifier, now=30.0)

    health = _throttled(classifier, now=60.0)

    reason = _only(health)
    assert health.status is HealthStatus.WARN
    assert (reason.code, reason.gpu) == ("slowdown", 0)
    assert "hw_slowdown" in reason.detail


def test_a_slowdown_that_stops_starts_its_clock_over() -> None:
    classifier = _classifier(slowdown_sustain_s=60.0)
    _throttled(classifier, now=0.0)
    _throttled(classifier, now=30.0, throttle=frozenset())

    assert _throttled(classifier, now=70.0).status is HealthStatus.OK


@pytest.mark.parametrize(
    "reason",
    [Throttle.HW_THERMAL, Throttle.SW_THERMAL, Throttle.HW_POWER_BRAKE, Throttle.HW_SLOWDOWN],
)
def test_every_hardware_or_thermal_slowdown_counts(reason: Throttle) -> None:
    classifier = _classifier(slowdown_sustain_s=0.0)

    assert _codes(_throttled(classifier, 0.0, frozenset({reason}))) == {"slowdown"}


def test_a_software_power_cap_is_not_a_slowdown() -> None:
    classifier = _classifier(slowdown_sustain_s=0.0)

    health = _throttled(classifier, 0.0, frozenset({Throttle.SW_POWER_CAP}))

    assert health.status is HealthStatus.OK


def test_a_nearly_full_data_disk_drains_as_disk_full() -> None:
    health = _classifier().classify(_node(), _host(disk_free_bytes=GIB), now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.DRAIN
    assert (reason.code, reason.gpu) == ("disk_full", None)


def test_a_low_data_disk_warns_as_disk_low() -> None:
    health = _classifier().classify(_node(), _host(disk_free_bytes=50 * GIB), now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.WARN
    assert reason.code == "disk_low"


def test_low_available_memory_warns_as_mem_low() -> None:
    health = _classifier().classify(_node(), _host(mem_available_bytes=GIB), now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.WARN
    assert reason.code == "mem_low"


def test_a_high_load_per_cpu_warns_as_load_high() -> None:
    health = _classifier().classify(_node(), _host(load1=65.0, cpu_count=16), now=0.0)

    reason = _only(health)
    assert health.status is HealthStatus.WARN
    assert reason.code == "load_high"


def test_the_status_is_the_worst_reason() -> None:
    sample = _node(_gpu(0, remap_pending=True), _gpu(1, ecc_dbe_volatile=1))

    health = _classifier().classify(sample, _host(load1=100.0), now=0.0)

    assert _codes(health) == {"row_remap_pending", "ecc_dbe", "load_high"}
    assert health.status is HealthStatus.DRAIN


def test_warn_reasons_alone_give_warn() -> None:
    sample = _node(_gpu(0, remap_pending=True), _gpu(1))

    health = _classifier().classify(sample, _host(load1=100.0), now=0.0)

    assert health.status is HealthStatus.WARN


def test_unknown_counters_are_not_read_as_faults() -> None:
    unknown = GpuSample(index=0, uuid="GPU-0")

    health = _classifier(gpus_at_birth=1).classify(NodeSample(gpus=(unknown,)), None, now=0.0)

    assert health.status is HealthStatus.OK


@pytest.mark.parametrize("reading", [math.nan, math.inf, -math.inf])
def test_a_gpu_reading_that_is_not_finite_is_sent_as_unknown(reading: float) -> None:
    gpu = _gpu(0, temperature_c=reading, power_w=reading, util_pct=reading)

    health = _classifier(gpus_at_birth=1).classify(_node(gpu), _host(), now=100.0)

    [gauges] = health.gpus
    assert (gauges.temperature_c, gauges.power_w, gauges.util_pct) == (None, None, None)
