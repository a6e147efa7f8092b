"""What the rig reports, without building a fleet: the verdict on a scenario's outcome and
the p50/p95 over trials."""

from __future__ import annotations

from typing import Any

from tests.rig.driver import judge, summary


def outcome(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "fault": "kill-rank",
        "state": "succeeded",
        "reason": "every rank exited 0",
        "generations": 2,
        "nodes": {"before": ["h1", "h2"], "after": ["h1", "h2"]},
        "committed_lost": 0,
        "final_digest_equal": True,
        "as_expected": True,
        "detected_s": 0.1,
        "mttr_s": 5.0,
        "phases": [{"detect": 0.01, "launch": 4.0}],
    }
    return {**base, **over}


def test_a_restart_in_place_with_the_same_digest_is_as_expected() -> None:
    assert judge("succeeded", "in-place", outcome()) == (True, "")


def test_a_restart_in_place_that_moved_the_ranks_is_not() -> None:
    ok, why = judge("succeeded", "in-place", outcome(nodes={"before": ["h1"], "after": ["h3"]}))
    assert not ok and "expected a restart in place" in why


def test_a_fault_expected_to_need_no_recovery_that_restarted_is_not_as_expected() -> None:
    ok, why = judge("succeeded", "none", outcome(generations=2))
    assert not ok and why == "2 generations, expected no recovery"


def test_a_lost_committed_step_or_another_digest_fails_any_scenario() -> None:
    ok, why = judge("succeeded", "any", outcome(committed_lost=1, final_digest_equal=False))
    assert not ok
    assert "1 committed step(s) lost" in why and "final digest differs" in why


def test_a_code_error_that_used_a_spare_is_not_as_expected() -> None:
    failed = outcome(state="failed", nodes={"before": ["h1", "h2"], "after": ["h3", "h2"]})
    ok, why = judge("failed", "no-spare", failed)
    assert not ok and "a spare was used" in why


def test_the_summary_gives_p50_and_p95_of_detection_mttr_and_each_phase() -> None:
    trials = [
        outcome(detected_s=0.1, mttr_s=5.0, phases=[{"detect": 0.01, "launch": 4.0}]),
        outcome(detected_s=0.2, mttr_s=6.0, phases=[{"detect": 0.02, "launch": 5.0}]),
    ]
    got = summary(trials)
    assert got["trials"] == 2 and got["as_expected"] == 2
    assert got["detected_s"] == {"p50": 0.15, "p95": 0.2}
    assert got["mttr_s"] == {"p50": 5.5, "p95": 5.95}
    assert got["phases_s"]["launch"] == {"p50": 4.5, "p95": 4.95}
