"""The incident record of a recovery: what it cost the job."""

from __future__ import annotations

import time
from typing import Any, cast

from phalanx import wire
from supervisor.actuator import Actuator
from supervisor.jobs import Job, JobState
from supervisor.records import Awaiting, Recovery
from supervisor.recovery.incidents import Incidents
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
    job.recovery = Recovery(generation=1, failures=[], fault_at=now - 1, detected_at=now - 1)
    return job


def test_a_failed_recovery_loses_the_steps_since_the_newest_committed_checkpoint() -> None:
    job = failed_at(1969)
    log = Incidents(cast(Actuator, Control()), lambda _job, upto: min(1960, upto))

    log.finish(job, None, outcome="failed")

    (incident,) = job.incidents
    assert incident.restored_step is None
    assert incident.lost_steps == 9  # not 1969: steps 0..1960 are in a checkpoint


def test_a_failed_recovery_with_nothing_committed_loses_every_step() -> None:
    job = failed_at(40)
    log = Incidents(cast(Actuator, Control()), lambda _job, _upto: None)

    log.finish(job, None, outcome="failed")

    assert job.incidents[0].lost_steps == 40


def test_a_recovered_incident_counts_from_the_restored_step() -> None:
    job = failed_at(57)
    assert job.recovery is not None
    job.recovery.restored_step = 50
    log = Incidents(cast(Actuator, Control()), lambda _job, _upto: 55)

    log.finish(job, None, outcome="recovered", resumed_at=time.time())

    assert job.incidents[0].lost_steps == 7


def relaunched(fault_at: float) -> Job:
    """A job whose recovery launched generation 2 at ``fault_at + 1``, now acked."""
    job = make_job(JobState.RUNNING)
    job.generation = 2
    job.recovery = Recovery(
        generation=1,
        failures=[],
        fault_at=fault_at,
        detected_at=fault_at,
        phases={"detect": 0.0},
        launch_started_at=fault_at + 1.0,
        restored_step=50,
        awaiting=Awaiting(),
    )
    return job


def stepped(rank: int, at: float) -> wire.RankEvent:
    return wire.RankEvent(
        node="n01", job="tinylm-abc123", generation=2, rank=rank, event="stepped", step=50, at=at
    )


def test_a_recovery_acked_reports_when_its_ranks_started_and_no_mttr_yet() -> None:
    ctl = Control()
    job = relaunched(time.time() - 2.0)

    Incidents(cast(Actuator, ctl)).on_started(job)

    ((kind, detail),) = ctl.events
    assert kind == "job_recovered"
    assert "mttr_s" not in detail and 1.9 <= detail["acked_s"] < 10.0
    assert job.incidents[0].mttr_s is None


def test_the_mttr_is_the_fault_to_the_new_generations_first_step() -> None:
    ctl = Control()
    fault_at = time.time() - 30.0
    job = relaunched(fault_at)
    log = Incidents(cast(Actuator, ctl))
    log.on_started(job)

    for rank in range(4):
        log.on_progress(job, stepped(rank, fault_at + 7.0 + rank))

    timed = [d for k, d in ctl.events if k == "recovery_timed"]
    assert [d["mttr_s"] for d in timed] == [10.0]
    assert job.incidents[0].mttr_s == 10.0


def test_a_recovery_of_a_job_that_reports_no_steps_lost_unknown_work_not_none() -> None:
    job = make_job(JobState.RECOVERING)
    now = time.time()
    job.recovery = Recovery(
        generation=1, failures=[], fault_at=now - 1, detected_at=now - 1, restored_step=None
    )

    Incidents(cast(Actuator, Control())).finish(job, None, outcome="recovered", resumed_at=now)

    (incident,) = job.incidents
    assert (incident.lost_steps, incident.lost_work_s) == (None, None)
