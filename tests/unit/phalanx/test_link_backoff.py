"""Backoff: capped exponential reconnect delays with equal jitter."""

from __future__ import annotations

import random

import pytest

from phalanx.link import Backoff


def _ceilings(initial: float, cap: float, n: int) -> list[float]:
    return [min(cap, initial * 2**k) for k in range(n)]


def test_delays_stay_within_half_and_all_of_their_ceiling() -> None:
    backoff = Backoff(initial=0.5, cap=8.0)

    for ceiling in _ceilings(0.5, 8.0, 200):
        assert ceiling / 2 <= backoff.next() <= ceiling


def test_the_lowest_jitter_gives_half_the_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random, "uniform", lambda low, high: low)
    backoff = Backoff(initial=1.0, cap=8.0)

    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_the_highest_jitter_gives_the_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random, "uniform", lambda low, high: high)
    backoff = Backoff(initial=1.0, cap=8.0)

    assert [backoff.next() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_delays_grow_while_below_the_cap() -> None:
    # Ceilings 0.2, 0.4, ... 6.4: each delay is at least the previous ceiling.
    backoff = Backoff(initial=0.2, cap=10.0)

    delays = [backoff.next() for _ in range(6)]

    assert delays == sorted(delays)
    assert delays[-1] >= 3.2


def test_delays_are_capped() -> None:
    backoff = Backoff(initial=0.2, cap=10.0)

    assert max(backoff.next() for _ in range(100)) <= 10.0


def test_delays_stay_capped_after_thousands_of_attempts() -> None:
    backoff = Backoff(initial=0.2, cap=10.0)

    delays = [backoff.next() for _ in range(5000)]

    assert all(5.0 <= d <= 10.0 for d in delays[-100:])


def test_reset_starts_again_from_the_initial_delay() -> None:
    backoff = Backoff(initial=0.2, cap=10.0)
    for _ in range(20):
        backoff.next()

    backoff.reset()

    assert 0.1 <= backoff.next() <= 0.2


def test_an_initial_delay_above_the_cap_is_capped() -> None:
    backoff = Backoff(initial=30.0, cap=10.0)

    assert 5.0 <= backoff.next() <= 10.0
