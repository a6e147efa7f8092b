"""A node's GPU gauges summed up for the fleet view: the hottest GPU, ECC and retired
pages over its GPUs, the GPUs throttled; nothing known is None, not 0."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

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


def _by_gpu(gauges: Gauges) -> dict[str, object]:
    """The summary as first written: over each GPU's own dict."""
    gpus = gauges.gpu_dicts()

    def total(field: str) -> int | None:
        values = [g[field] for g in gpus if g[field] is not None]
        return sum(values) if values else None

    temps = [g["temperature_c"] for g in gpus if g["temperature_c"] is not None]
    return {
        "temperature_max_c": max(temps) if temps else None,
        "ecc_sbe_volatile": total("ecc_sbe_volatile"),
        "ecc_dbe_volatile": total("ecc_dbe_volatile"),
        "retired_pages": total("retired_pages"),
        "throttled_gpus": [g["index"] for g in gpus if g["throttle"]],
    }


_counts = st.none() | st.integers(min_value=0, max_value=10**6)


@given(
    st.lists(
        st.builds(
            wire.GpuGauges,
            index=st.integers(min_value=0, max_value=15),
            temperature_c=st.none() | st.floats(min_value=0, max_value=120),
            ecc_sbe_volatile=_counts,
            ecc_dbe_volatile=_counts,
            retired_pages=_counts,
            throttle=st.lists(st.sampled_from(["hw_slowdown", "sw_thermal"]), max_size=2),
        ),
        max_size=8,
    )
)
def test_the_summary_read_off_the_flat_gauges_is_the_one_over_each_gpu(
    gpus: list[wire.GpuGauges],
) -> None:
    gauges = Gauges.of(wire.Health(status=wire.HealthStatus.OK, gpus=gpus))
    assert gauge_summary(gauges) == _by_gpu(gauges)
