"""MFU: the FLOPs the ranks report per step, per second, over their GPUs' peak."""

from __future__ import annotations

import pytest

from supervisor.store import Store
from supervisor.telemetry.mfu import mfu, peak_flops
from supervisor.telemetry.training import TrainingMetrics
from tests.unit.supervisor.test_metrics import JOB, Clock, batch, make_job, store, window

__all__ = ["store"]  # the fixture


@pytest.mark.parametrize(
    ("model", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA B200", 2.25e15),
        ("Tesla T4", None),
        (None, None),
    ],
)
def test_the_peak_of_a_gpu_comes_from_its_model_name(model: str | None, peak: float | None) -> None:
    assert peak_flops(model) == peak


def test_a_configured_peak_wins_over_the_table() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", {"NVIDIA H100 80GB HBM3": 1e15}) == 1e15


def test_mfu_is_the_gangs_flops_per_second_over_its_peak() -> None:
    # two ranks: 4e14 FLOPs in 1 s, 3e14 in 0.5 s, on 1e15 peak GPUs: 1e15 / 2e15
    assert mfu([(4e14, 1.0, 1e15), (3e14, 0.5, 1e15)]) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "ranks",
    [[], [(4e14, 1.0, 1e15), (None, 1.0, 1e15)], [(4e14, None, 1e15)], [(4e14, 1.0, None)]],
)
def test_mfu_is_unknown_unless_every_rank_has_its_flops_step_time_and_peak(
    ranks: list[tuple[float | None, float | None, float | None]],
) -> None:
    assert mfu(ranks) is None


def test_the_job_summary_has_the_mfu_of_its_ranks_on_their_nodes_gpus(store: Store) -> None:
    job, clock = make_job(), Clock()
    models = {"n1": "NVIDIA H100 80GB HBM3", "n2": "NVIDIA H100 80GB HBM3"}
    m = TrainingMetrics(
        store,
        {job.id: job}.get,
        interval_s=5.0,
        clock=clock,
        gpu_model=models.get,
        gpu_peaks={"NVIDIA H100 80GB HBM3": 1e15},
    )
    # each rank: 1e14 FLOPs a step at 0.1 s a step = 1e15 FLOP/s; the peak 4 x 1e15
    m.on_batch(batch("n1", window(0, 19, flops=1e14), window(1, 19, flops=1e14)))
    m.on_batch(batch("n2", window(2, 19, flops=1e14), window(3, 19, flops=1e14)))
    m.flush()

    assert m.summary(JOB)["mfu"] == pytest.approx(1.0)
