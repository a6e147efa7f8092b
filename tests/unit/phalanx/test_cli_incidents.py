"""How ``phalanx status`` words goodput and recoveries it cannot measure."""

from __future__ import annotations

from phalanx.cli.incidents import ettr_text, incident_lines

UNKNOWN = {
    "generation": 1,
    "outcome": "recovered",
    "failures": [{"kind": "rank_exit", "node": "n01", "rank": 1}],
    "plan": {"action": "restart_in_place", "reason": "rank 1 was killed"},
    "phases": {"detect": 0.01},
    "restored_step": None,
    "lost_steps": None,
    "lost_work_s": None,
    "acked_s": 0.3,
    "mttr_s": None,
}


def test_status_says_the_lost_work_of_a_job_without_steps_is_unknown_not_zero() -> None:
    text = "\n".join(incident_lines(UNKNOWN))
    assert "lost work unknown" in text
    assert "0.00s of work" not in text


def test_status_says_the_mttr_is_unknown_before_the_first_step() -> None:
    text = "\n".join(incident_lines(UNKNOWN))
    assert "MTTR unknown" in text and "ranks started 0.30s after the fault" in text


def test_status_shows_the_ettr_of_a_job_without_steps_as_an_upper_bound() -> None:
    goodput = {
        "ettr": 0.994,
        "ettr_upper_bound": True,
        "lost_s": 2.0,
        "wall_s": 400.0,
        "lost_work_unknown": 1,
    }
    text = ettr_text(goodput)
    assert text is not None and "at most 99.4%" in text and "reports no steps" in text


def test_status_shows_an_exact_ettr_plainly() -> None:
    goodput = {"ettr": 0.9, "ettr_upper_bound": False, "lost_s": 10.0, "wall_s": 100.0}
    assert ettr_text(goodput) == "ETTR: 90.0% (lost 10.0s of 100.0s)"


def test_status_names_the_ranks_a_recovery_launched_cold_by_reason() -> None:
    importing = "its warm interpreter was still importing"
    incident = {**UNKNOWN, "cold_ranks": {importing: "0-1", "restart.warm is off": "3"}}
    lines = incident_lines(incident)
    assert f"    cold launch of ranks 0-1: {importing}" in lines
    assert "    cold launch of ranks 3: restart.warm is off" in lines
    assert not any("cold launch" in line for line in incident_lines(UNKNOWN))


def test_status_shows_the_phases_in_their_order_with_the_prepare_phase() -> None:
    phases = {"launch": 0.2, "prepare": 1.5, "stop": 1.0, "detect": 0.01, "port": 0.0}
    lines = incident_lines({**UNKNOWN, "phases": phases})
    assert "    phases: detect 0.01s  stop 1.00s  prepare 1.50s  launch 0.20s" in lines
