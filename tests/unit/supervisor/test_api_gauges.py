"""A node's GPU gauges summed up for the fleet view: the hottest GPU, ECC and retired
pages over its GPUs, the GPUs throttled; nothing known is None, not 0."""

from __future__ import annotations

from phalanx import wire
from supervisor.api.node_routes import gauge_summary
from supervisor.fleet.registry import Gauges


def test_a_nodes_gauges_sum_up_to_its_hottest_gpu_and_its_ecc_counts() -> None:
    health = wire.Health(
        status=wire.HealthStatus.WARN,
        gpus=[
            wire.GpuGauges(index=0, temperature_c=41.0, ecc_sbe_volatile=2, ecc_dbe_volatile=0),
            wire.GpuGauges(
                index=1,
                temperature_c=89.0,
                ecc_sbe_volatile=3,
                ecc_dbe_volatile=1,
                retired_pages=4,
                throttle=["hw_thermal_slowdown"],
            ),
        ],
    )

    assert gauge_summary(Gauges.of(health)) == {
        "temperature_max_c": 89.0,
        "ecc_sbe_volatile": 5,
        "ecc_dbe_volatile": 1,
        "retired_pages": 4,
        "throttled_gpus": [1],
    }


def test_a_node_without_gauges_has_none_rather_than_zero() -> None:
    summary = gauge_summary(Gauges.of(wire.Health(status=wire.HealthStatus.OK)))

    assert summary["temperature_max_c"] is None
    assert summary["ecc_dbe_volatile"] is None
    assert summary["throttled_gpus"] == []
