"""The loss guard (phalanx.guard): losses in, a trip out; and what the ranks read of a
rollback (the steps to skip, the LR scale)."""

from __future__ import annotations

import math

import pytest

from phalanx.guard import (
    GuardError,
    LossGuard,
    LrScale,
    Rule,
    next_step,
    parse_lr_scale,
    parse_rule,
    parse_skip,
)


def fed(guard: LossGuard, losses: list[float], first: int = 0) -> list[int]:
    """The steps at which the guard tripped while fed ``losses`` from step ``first``."""
    return [s for s, loss in enumerate(losses, first) if guard.see(s, loss) is not None]


def test_a_nan_loss_trips_at_once_with_its_step_as_the_onset() -> None:
    guard = LossGuard(Rule(window=10))

    trip = guard.see(3, math.nan)

    assert trip is not None
    assert (trip.kind, trip.step, trip.onset, trip.baseline) == ("nan", 3, 3, None)


def test_an_infinite_loss_is_a_nan_trip() -> None:
    trip = LossGuard(Rule(window=10)).see(0, math.inf)
    assert trip is not None and trip.kind == "nan"


def test_a_spike_trips_after_patience_steps_in_a_row_with_the_first_as_the_onset() -> None:
    guard = LossGuard(Rule(ratio=2.0, window=4, patience=3))
    fed(guard, [1.0, 1.0, 1.0, 1.0])

    assert fed(guard, [5.0, 6.0, 7.0], first=4) == [6]
    assert guard.tripped is not None
    assert (guard.tripped.kind, guard.tripped.onset, guard.tripped.value) == ("loss_spike", 4, 5.0)
    assert guard.tripped.baseline == 1.0


def test_a_spike_shorter_than_the_patience_does_not_trip() -> None:
    guard = LossGuard(Rule(ratio=2.0, window=4, patience=3))

    assert fed(guard, [1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 1.0, 5.0, 5.0, 1.0]) == []


def test_spikes_are_not_judged_before_the_window_is_full() -> None:
    guard = LossGuard(Rule(ratio=2.0, window=5, patience=1))

    assert fed(guard, [1.0, 9.0, 9.0, 9.0]) == []


def test_spiking_losses_stay_out_of_the_moving_average() -> None:
    guard = LossGuard(Rule(ratio=2.0, window=3, patience=3))
    fed(guard, [1.0, 1.0, 1.0, 5.0, 5.0, 1.0])

    assert guard.mean == 1.0


def test_a_baseline_lets_the_guard_judge_from_the_first_step() -> None:
    guard = LossGuard(Rule(ratio=2.0, window=100, patience=2, baseline=1.0))

    assert fed(guard, [1.1, 3.0, 3.0]) == [2]


def test_the_guard_trips_once() -> None:
    guard = LossGuard(Rule(window=2, patience=1))
    fed(guard, [1.0, 1.0, math.nan])

    assert fed(guard, [math.nan, 100.0], first=3) == []


def test_a_falling_noisy_loss_never_trips() -> None:
    guard = LossGuard(Rule(ratio=1.5, window=20, patience=2))
    losses = [4.8 * math.exp(-s / 50) + 1.2 + 0.2 * math.sin(s * 1.7) for s in range(2000)]

    assert fed(guard, losses) == []


def test_a_mean_at_or_below_zero_judges_no_spike() -> None:
    guard = LossGuard(Rule(ratio=2.0, window=2, patience=1))

    assert fed(guard, [-1.0, -1.0, 5.0, 0.0, 0.0, 5.0]) == []


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('{"ratio": 1}', "ratio"),
        ('{"window": 0}', "window"),
        ('{"window": 5, "patience": 6}', "patience"),
        ('{"ratio": "x"}', "ratio"),
        ('{"pace": 3}', "pace"),
        ("[1]", "object"),
        ("{", "JSON"),
    ],
)
def test_a_bad_rule_is_refused_naming_the_variable_and_the_field(text: str, names: str) -> None:
    with pytest.raises(GuardError, match="PHALANX_GUARD") as caught:
        parse_rule(text)
    assert names in str(caught.value)


def test_a_rule_round_trips_through_its_encoding() -> None:
    rule = Rule(ratio=2.5, window=50, patience=4, baseline=1.25)
    assert parse_rule(rule.encode()) == rule


def test_skip_ranges_are_sorted_and_merged() -> None:
    assert parse_skip("[[40, 50], [10, 20], [15, 30], [60, 60]]") == ((10, 30), (40, 50))


def test_next_step_jumps_past_the_skipped_ranges_only() -> None:
    ranges = ((10, 30), (40, 50))
    assert [next_step(s, ranges) for s in (9, 10, 29, 30, 45, 50)] == [9, 30, 30, 30, 50, 50]


@pytest.mark.parametrize("text", ["{}", "[[1]]", "[[5, 2]]", '[["a", 2]]', "[[-1, 2]]", "x"])
def test_a_bad_skip_list_is_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(GuardError, match="PHALANX_SKIP"):
        parse_skip(text)


def test_the_lr_scale_applies_within_its_steps_only() -> None:
    scale = parse_lr_scale(LrScale(0.5, 10, 20).encode())
    assert [scale.at(s) for s in (9, 10, 19, 20)] == [1.0, 0.5, 0.5, 1.0]


@pytest.mark.parametrize(
    "text", ['{"factor": 0, "from": 1, "until": 2}', '{"factor": 0.5, "from": 1}', "[]"]
)
def test_a_bad_lr_scale_is_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(GuardError, match="PHALANX_LR_SCALE"):
        parse_lr_scale(text)
