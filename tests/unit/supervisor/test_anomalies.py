"""NaN and spiking losses, and stragglers, as the pure watches judge them."""

from __future__ import annotations

import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.telemetry.anomalies import SpikeWatch, Straggler, StragglerWatch


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


def _reference_see(
    watch: StragglerWatch, step_times: dict[int, float]
) -> tuple[list[tuple[int, float]], list[int]]:
    """The straggler rule as first written: every rank visited at every look."""
    times = {r: t for r, t in step_times.items() if math.isfinite(t) and t >= 0}
    if len(times) < watch.min_ranks:
        return [], []
    median = statistics.median(times.values())
    new: list[tuple[int, float]] = []
    cleared: list[int] = []
    for rank, t in sorted(times.items()):
        if t > median * (1 + watch.margin):
            watch.slow_for[rank] = watch.slow_for.get(rank, 0) + 1
            if watch.slow_for[rank] >= watch.windows:
                if rank not in watch.flagged:
                    new.append((rank, t))
                watch.flagged[rank] = Straggler(rank, t, median)
        else:
            watch.slow_for.pop(rank, None)
            if watch.flagged.pop(rank, None) is not None:
                cleared.append(rank)
    return new, cleared


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(
        st.dictionaries(
            st.integers(0, 11),
            st.sampled_from([0.9, 1.0, 1.0, 1.1, 1.2, 1.3, 2.0, math.inf, math.nan, -1.0]),
        ),
        max_size=12,
    ),
)
def test_the_straggler_watch_visiting_only_slow_ranks_judges_as_the_rule_does(
    windows: int, looks: list[dict[int, float]]
) -> None:
    fast, reference = StragglerWatch(windows=windows), StragglerWatch(windows=windows)
    for times in looks:
        new, cleared = fast.see(times)
        assert ([(s.rank, s.step_time_s) for s in new], cleared) == _reference_see(reference, times)
        assert fast.slow_for == reference.slow_for
        assert fast.flagged == reference.flagged
