"""The agent's training metrics: step reports folded into one bounded batch per job and window."""

from __future__ import annotations

import math

from agentd.metrics import MetricsWindow
from phalanx import wire
from phalanx.progress import StepReport

JOB = "tinylm-abc"


def report(
    step: int, at: float, rank: int = 0, generation: int = 1, **scalars: float
) -> StepReport:
    return StepReport(JOB, generation, rank, 100 + rank, step, at, scalars)


def test_a_window_of_steps_becomes_one_batch_with_step_range_mean_time_and_last_values() -> None:
    window = MetricsWindow("n1")
    for step in range(10):
        window.add(report(step, 100.0 + 0.5 * step, loss=5.0 - step, tokens=1000, lr=1e-3))
    [batch] = window.flush(105.0)
    [r] = batch.ranks
    assert (batch.node, batch.job, batch.generation) == ("n1", JOB, 1)
    assert (r.rank, r.step_first, r.step_last, r.reports) == (0, 0, 9, 10)
    assert r.at == 104.5
    assert r.step_time_s == 0.5
    assert r.tokens_per_s == 2000.0  # 9 timed steps of 1000 tokens over 4.5 s
    assert r.scalars["loss"] == (-4.0, -4.0, 5.0, 0.5)
    assert set(r.scalars) == {"loss", "lr"}


def test_the_next_window_times_its_first_step_from_the_previous_windows_last() -> None:
    window = MetricsWindow("n1")
    window.add(report(0, 100.0))
    window.add(report(1, 101.0))
    window.flush(102.0)
    window.add(report(3, 105.0))
    [batch] = window.flush(106.0)
    [r] = batch.ranks
    assert (r.step_first, r.step_last, r.step_time_s) == (3, 3, 2.0)


def test_a_window_without_reports_sends_nothing() -> None:
    window = MetricsWindow("n1")
    window.add(report(0, 100.0))
    window.flush(101.0)
    assert window.flush(106.0) == []


def test_a_nan_loss_stays_the_windows_min_and_max() -> None:
    window = MetricsWindow("n1")
    for step, loss in enumerate([2.0, math.nan, 1.0]):
        window.add(report(step, 100.0 + step, loss=loss))
    [batch] = window.flush(103.0)
    last, low, high, mean = batch.ranks[0].scalars["loss"]
    assert last == 1.0 and math.isnan(low) and math.isnan(high) and math.isnan(mean)


def test_scalar_names_past_the_cap_are_dropped_and_counted() -> None:
    window = MetricsWindow("n1", max_names=2)
    window.add(report(0, 100.0, a=1.0, b=2.0, c=3.0, d=4.0))
    [batch] = window.flush(101.0)
    assert set(batch.ranks[0].scalars) == {"a", "b"}
    assert batch.dropped_names == 2 and window.dropped_names == 2


def test_a_node_with_more_ranks_than_a_batch_holds_sends_several_batches() -> None:
    window = MetricsWindow("n1")
    ranks = wire.MAX_METRIC_RANKS + 3
    for rank in range(ranks):
        window.add(report(0, 100.0, rank=rank, loss=1.0))
    batches = window.flush(101.0)
    assert [len(b.ranks) for b in batches] == [wire.MAX_METRIC_RANKS, 3]
    assert sorted(r.rank for b in batches for r in b.ranks) == list(range(ranks))


def test_every_batch_fits_in_one_payload_and_parses_back() -> None:
    window = MetricsWindow("n1")
    names = {f"scalar_{i:02d}_{'x' * 50}": float(i) for i in range(wire.MAX_METRIC_NAMES)}
    for rank in range(wire.MAX_METRIC_RANKS):
        window.add(report(10**11, 1e9, rank=rank, **names))
    [batch] = window.flush(1e9 + 5)
    payload = wire.encode(batch)
    assert len(payload) < wire.MAX_PAYLOAD_BYTES
    assert wire.parse(wire.metrics_topic("n1"), payload).message == batch


def test_an_older_generation_is_flushed_once_then_forgotten() -> None:
    window = MetricsWindow("n1")
    window.add(report(5, 100.0, generation=1, loss=3.0))
    window.add(report(2, 101.0, generation=2, loss=4.0))
    assert sorted(b.generation for b in window.flush(102.0)) == [1, 2]
    window.add(report(3, 103.0, generation=2, loss=4.0))
    assert [b.generation for b in window.flush(104.0)] == [2]


def test_data_wait_is_averaged_and_tokens_are_not_kept_as_named_scalars() -> None:
    window = MetricsWindow("n1")
    window.add(report(0, 100.0, data_wait_s=0.1, tokens=10))
    window.add(report(1, 101.0, data_wait_s=0.3, tokens=10))
    [batch] = window.flush(102.0)
    r = batch.ranks[0]
    assert r.data_wait_s is not None and abs(r.data_wait_s - 0.2) < 1e-12
    assert r.tokens_per_s == 10.0
    assert r.scalars == {}
