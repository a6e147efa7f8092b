"""The incident record of a recovery: what it cost the job."""

from __future__ import annotations

import time
from typing import Any, cast

from supervisor.control import JobControl
from supervisor.incidents import Incidents
from supervisor.jobs import Job, JobState
from tests.unit.supervisor.test_jobs_state import make_job


class Control:
    """The job controller's side the incident log uses: events and saves, recorded."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def save(self, job: Job) -> None:
        return None

    def event(self, kind: str, job: Job, node: str | None = None, **detail: Any) -> None:
        self.events.append((kind, detail))


def failed_at(step: int) -> Job:
    job = make_job(JobState.RECOVERING)
    now = time.time()
    job.progress["1"] = [0, now - 60, step, now - 1]
    job.recovery = {
        "generation": 1,
        "failures": [],
        "fault_at": now - 1,
        "detected_at": now - 1,
        "phases": {},
    }
    return job


def test_a_failed_recovery_loses_the_steps_since_the_newest_committed_checkpoint() -> None:
    job = failed_at(1969)
    log = Incidents(cast(JobControl, Control()), lambda _job, upto: min(1960, upto))

    log.finish(job, None, outcome="failed")

    (incident,) = job.incidents
    assert incident["restored_step"] is None
    assert incident["lost_steps"] == 9  # not 1969: steps 0..1960 are in a checkpoint


def test_a_failed_recovery_with_nothing_committed_loses_every_step() -> None:
    job = failed_at(40)
    log = Incidents(cast(JobControl, Control()), lambda _job, _upto: None)

    log.finish(job, None, outcome="failed")

    assert job.incidents[0]["lost_steps"] == 40


def test_a_recovered_incident_counts_from_the_restored_step() -> None:
    job = failed_at(57)
    assert job.recovery is not None
    job.recovery["restored_step"] = 50
    log = Incidents(cast(JobControl, Control()), lambda _job, _upto: 55)

    log.finish(job, None, outcome="recovered", resumed_at=time.time())

    assert job.incidents[0]["lost_steps"] == 7
