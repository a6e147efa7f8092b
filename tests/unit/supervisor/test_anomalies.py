"""NaN and spiking losses, and stragglers, as the pure watches judge them."""

from __future__ import annotations

import math

from supervisor.telemetry.anomalies import SpikeWatch, StragglerWatch


def steady(watch: SpikeWatch, n: int = 30, value: float = 2.0) -> None:
    for step in range(n):
        assert watch.see(step, value + 0.01 * (step % 3)) is None


def test_a_nan_loss_is_an_anomaly_at_once() -> None:
    found = SpikeWatch("loss").see(0, math.nan)
    assert found is not None and found.kind == "nonfinite"


def test_an_infinite_grad_norm_is_an_anomaly() -> None:
    watch = SpikeWatch("grad_norm")
    steady(watch)
    found = watch.see(31, math.inf)
    assert found is not None and found.kind == "nonfinite" and found.step == 31


def test_a_loss_far_above_its_moving_average_is_a_spike() -> None:
    watch = SpikeWatch("loss")
    steady(watch)
    found = watch.see(30, 6.0)
    assert found is not None and found.kind == "spike" and found.value == 6.0
    assert found.baseline is not None and 2.0 <= found.baseline <= 2.02


def test_a_falling_loss_and_its_noise_are_no_spike() -> None:
    watch = SpikeWatch("loss")
    for step in range(200):
        assert watch.see(step, 5.0 * math.exp(-step / 50) + 0.05 * (step % 2)) is None


def test_no_spike_is_judged_during_warm_up() -> None:
    watch = SpikeWatch("loss", warmup=10)
    for step, value in enumerate([2.0, 2.0, 9.0]):
        assert watch.see(step, value) is None


def test_a_lasting_jump_stops_being_a_spike() -> None:
    watch = SpikeWatch("loss")
    steady(watch)
    verdicts = [watch.see(30 + i, 4.0) for i in range(40)]
    assert verdicts[0] is not None
    assert all(v is None for v in verdicts[-10:])


def test_a_rank_slower_than_the_median_for_the_window_is_a_straggler() -> None:
    watch = StragglerWatch(margin=0.2, windows=3)
    times = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}
    assert watch.see(times) == ([], [])
    assert watch.see(times) == ([], [])
    new, cleared = watch.see(times)
    assert [(s.rank, s.ratio) for s in new] == [(3, 1.5)] and cleared == []
    assert watch.see(times) == ([], [])  # flagged once
    assert set(watch.flagged) == {3}


def test_a_straggler_that_catches_up_is_cleared() -> None:
    watch = StragglerWatch(margin=0.2, windows=1)
    watch.see({0: 1.0, 1: 1.0, 2: 2.0})
    assert watch.see({0: 1.0, 1: 1.0, 2: 1.1}) == ([], [2])
    assert watch.flagged == {}


def test_a_rank_slow_once_is_no_straggler() -> None:
    watch = StragglerWatch(margin=0.2, windows=3)
    watch.see({0: 1.0, 1: 1.0, 2: 2.0})
    watch.see({0: 1.0, 1: 1.0, 2: 2.0})
    watch.see({0: 1.0, 1: 1.0, 2: 1.0})
    assert watch.see({0: 1.0, 1: 1.0, 2: 2.0}) == ([], [])


def test_one_rank_alone_is_never_a_straggler() -> None:
    watch = StragglerWatch(windows=1)
    assert watch.see({0: 5.0}) == ([], [])
