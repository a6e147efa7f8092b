"""The wait before a restart: only a crash loop backs off."""

from __future__ import annotations

from supervisor.recovery.executor import BACKOFF_MAX_S, backoff_delay, loop_ran


def test_the_first_failure_restarts_at_once() -> None:
    assert backoff_delay([], 3.0, 1.0) == 0.0


def test_a_failure_after_a_long_run_restarts_at_once() -> None:
    assert backoff_delay([290.0, 295.0], 290.0, 1.0) == 0.0  # one failure every 5 minutes


def test_a_quick_failure_after_a_recovery_waits_the_base_backoff() -> None:
    assert backoff_delay([400.0], 5.0, 1.0) == 1.0


def test_each_quick_failure_in_a_row_doubles_the_wait_up_to_the_cap() -> None:
    assert backoff_delay([400.0, 5.0], 5.0, 1.0) == 2.0
    assert backoff_delay([400.0, 5.0, 5.0], 5.0, 1.0) == 4.0
    assert backoff_delay([400.0, *[5.0] * 20], 5.0, 1.0) == BACKOFF_MAX_S


def test_a_long_run_between_quick_failures_resets_the_streak() -> None:
    assert backoff_delay([400.0, 5.0, 300.0, 5.0], 5.0, 1.0) == 2.0


def test_no_backoff_when_the_spec_asks_for_none() -> None:
    assert backoff_delay([400.0, 5.0], 5.0, 0.0) == 0.0


def test_a_generation_that_trained_is_no_crash_loop_however_soon_it_failed() -> None:
    # A failure a minute: each generation trains 59 s and fails; none of them waits.
    ran = [loop_ran(59.0, 1400) for _ in range(8)]
    assert backoff_delay([400.0, *ran], loop_ran(59.0, 1400), 1.0) == 0.0
    # One that reported no step, or only the first, is: it waits, and the streak counts
    # only the generations that did not train.
    assert loop_ran(5.0, 0) == 5.0 and loop_ran(5.0, None) == 5.0
    assert backoff_delay([400.0, loop_ran(59.0, 1400)], loop_ran(5.0, 0), 1.0) == 1.0
    assert backoff_delay([400.0, loop_ran(5.0, None)], loop_ran(5.0, 0), 1.0) == 2.0
