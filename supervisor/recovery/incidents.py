"""The incident record: what each recovery of a job cost.

A recovery's incident is recorded when it ends (recovered, failed, abandoned),
with its phases (detect, plan, stop, launch, restore, first step), the work it
lost (steps since the restored one, and their time) and its downtime; the last
phases and the MTTR (fault to the new generation's first step, the one figure
a user reads) are timed once every rank of the new generation has reported its
first step. ``acked_s`` (fault to every start acked) is known at once. A job
knows its own goodput from them; quarantine reads them across jobs
(:func:`node_incidents`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from phalanx import wire
from supervisor.actuator import Actuator, cold_ranks, rank_ranges
from supervisor.jobs import Job, JobState
from supervisor.records import Awaiting, Incident, PlanRecord, Recovery, known
from supervisor.recovery.planner import NodeIncident, Plan


class Incidents:
    def __init__(
        self, ctl: Actuator, newest_committed: Callable[[str, int], int | None] | None = None
    ) -> None:
        """``newest_committed(job, step)``: the newest step of ``job`` committed at or
        before ``step`` (None: none), what a failed recovery's lost work counts from."""
        self.ctl = ctl
        self.newest_committed = newest_committed

    def abandon(self, job: Job, outcome: str) -> None:
        """The job ended (cancelled, or its relaunch failed) with a recovery under way."""
        if job.recovery is not None:
            self.finish(job, None, outcome=outcome)
            job.recovery = None

    def on_started(self, job: Job) -> None:
        """The relaunched generation runs (every start acked): the incident is recorded
        now, as recovered, with ``acked_s`` (fault to every start acked: its rank
        processes spawned, not yet training); the ranks' ``restored`` and ``stepped``
        events (some may have come already) then time its launch, restore and first-step
        phases and its MTTR, fault to the first step (ranks that report no steps leave
        them unknown)."""
        rec = job.recovery
        if rec is None or rec.launch_started_at is None:
            return
        now = time.time()
        rec.generation_new = job.generation
        awaiting, rec.awaiting = rec.awaiting or Awaiting(), None
        self.finish(job, None, outcome="recovered", resumed_at=now)
        incident = job.incidents[-1]
        incident.awaiting = awaiting
        job.recovery = None
        self._maybe_timed(job, incident)
        self.ctl.save(job)

    def on_progress(self, job: Job, ev: wire.RankEvent) -> None:
        """A ``restored`` or ``stepped`` event of a relaunched generation (it may come
        before the launch is acknowledged everywhere)."""
        rec = job.recovery
        if rec is not None and rec.awaiting is not None and job.state is JobState.STARTING:
            awaiting = rec.awaiting
            incident = None
        else:
            incident = job.incidents[-1] if job.incidents else None
            if (
                incident is None
                or incident.next_generation != ev.generation
                or incident.awaiting is None
            ):
                return
            awaiting = incident.awaiting
        if ev.event == "restored":
            awaiting.restored[str(ev.rank)] = (ev.at, ev.took_s or 0.0)
        elif ev.event == "stepped":
            awaiting.stepped[str(ev.rank)] = ev.at
        if incident is not None:
            self._maybe_timed(job, incident)

    def _maybe_timed(self, job: Job, incident: Incident) -> None:
        """Once every rank of the new generation stepped: the incident's last phases."""
        awaiting = incident.awaiting
        if awaiting is None or len(awaiting.stepped) < job.world_size:
            return
        incident.awaiting = None
        phases = incident.phases
        first_step_at = max(awaiting.stepped.values())
        launch_at = incident.launch_started_at
        assert launch_at is not None  # awaited: its relaunch began
        restored = list(awaiting.restored.values())
        if restored:
            began = max(at - took for at, took in restored)
            done = max(at for at, _ in restored)
            phases["launch"] = round(max(0.0, began - launch_at), 3)
            phases["restore"] = round(max(took for _, took in restored), 3)
            phases["first_step"] = round(max(0.0, first_step_at - done), 3)
        else:
            phases["launch"] = round(max(0.0, first_step_at - launch_at), 3)
        incident.resumed_at = first_step_at
        incident.downtime_s = round(max(0.0, first_step_at - incident.fault_at), 3)
        incident.mttr_s = incident.downtime_s
        self.ctl.save(job)
        self.ctl.event(
            "recovery_timed",
            job,
            generation=incident.next_generation,
            phases=phases,
            mttr_s=incident.mttr_s,
        )

    def finish(
        self, job: Job, plan: Plan | None, *, outcome: str, resumed_at: float | None = None
    ) -> None:
        rec = job.recovery
        assert rec is not None
        old = rec.generation
        failed_step = None
        entry = job.progress.get(str(old))
        if entry is not None:
            failed_step = int(entry[2])
        restored = known(rec.restored_step)
        lost_steps = None
        lost_work: float | None = None  # unknown: the job reports no steps
        if failed_step is not None:
            # No restore (the recovery failed): what is lost is what no checkpoint holds,
            # the steps since the newest committed one (a resubmission resumes there).
            since = restored
            if since is None and self.newest_committed is not None:
                since = self.newest_committed(job.id, failed_step)
            lost_steps = max(0, failed_step - (since or 0))
            step_time = job.step_time(old)
            if step_time is not None:
                lost_work = lost_steps * step_time
            elif lost_steps == 0:
                lost_work = 0.0
        end = resumed_at if resumed_at is not None else time.time()
        ran = time_ran(job, rec.fault_at)
        incident = Incident(
            generation=old,
            next_generation=rec.generation_new,
            failures=rec.failures,
            size=rec.size,  # of the generation it ended
            fault_at=rec.fault_at,
            detected_at=rec.detected_at,
            plan=plan_record(plan) if plan is not None else rec.plan,
            phases=rec.phases,
            # ranks the relaunch started cold (no warm interpreter became them), by reason
            cold_ranks=known(rec.cold_ranks),
            launch_started_at=rec.launch_started_at,
            outcome=outcome,
            failed_step=failed_step,
            restored_step=restored,
            lost_steps=lost_steps,
            lost_work_s=None if lost_work is None else round(lost_work, 3),
            downtime_s=round(max(0.0, end - rec.fault_at), 3),
            resumed_at=resumed_at,
            ran_s=ran,
            # steps the failed generation trained past its first (None: it reported none)
            trained_steps=trained_steps(entry),
            # fault to every start of the new generation acked; the MTTR (fault to its
            # first step) comes once every rank stepped (_maybe_timed)
            acked_s=round(end - rec.fault_at, 3) if resumed_at else None,
            mttr_s=None,
        )
        job.incidents.append(incident)
        extra: dict[str, Any] = {"acked_s": incident.acked_s} if outcome == "recovered" else {}
        self.ctl.event(
            "job_recovered" if outcome == "recovered" else "recovery_failed",
            job,
            generation=job.generation,
            phases=incident.phases,
            lost_steps=lost_steps,
            restored_step=restored,
            **extra,
        )


def node_incidents(jobs: Iterable[Job]) -> list[NodeIncident]:
    """Every failure any job recorded, by the node it struck (quarantine follows the
    hardware across jobs)."""
    out = []
    for job in jobs:
        records: list[Incident | Recovery] = [*job.incidents]
        if job.recovery is not None:
            records.append(job.recovery)
        for rec in records:
            for f in rec.failures:
                if f.quarantine:  # not a node stopped on purpose
                    out.append(NodeIncident(job.id, f.node, rec.fault_at, f.kind.value))
    return out


def trained_steps(entry: list[float] | None) -> int | None:
    """Steps a generation trained past the first it reported (its ``Job.progress``
    entry; None: it reported none)."""
    return None if entry is None else int(entry[2] - entry[0])


def time_ran(job: Job, fault_at: float) -> float | None:
    """How long the failed generation ran: since the last recovery resumed the job, or
    since its first start (None: not known)."""
    previous = job.incidents[-1] if job.incidents else None
    since = previous.resumed_at if previous is not None else job.first_started_at
    return None if since is None else max(0.0, fault_at - since)


def plan_record(plan: Plan) -> PlanRecord:
    return PlanRecord(
        action=plan.action.value,
        cause=plan.cause.value,
        reason=plan.reason,
        nodes=tuple(plan.nodes),
        quarantine=tuple(plan.quarantine),
        swaps=tuple(plan.swaps),
        restore_step=plan.restore_step,
        restore_note=plan.restore_note,
        restore_from={str(r): t for r, t in sorted(plan.restore_from.items())},
        burn_in=tuple(plan.burn_in),
        reinstate=tuple(plan.reinstate),
        skip=plan.skip,
        sources={str(r): v for r, v in sorted(plan.sources.items())},
    )


__all__ = [
    "Incidents",
    "cold_ranks",  # the launch's (supervisor.actuator), read with the incident
    "node_incidents",
    "plan_record",
    "rank_ranges",
    "time_ran",
    "trained_steps",
]
