"""Rollbacks: a rank's loss guard tripped; the gang goes back to a checkpoint before the
spike and skips the data that led there.

A rank's ``phalanx.rank.step`` judges every loss (:mod:`phalanx.guard`); a trip reaches
the supervisor as the agent's ``guard`` rank event. :func:`on_guard` turns it into a
failure of kind ``loss_spike`` or ``nan`` that :class:`~supervisor.recovery.Recoveries`
recovers like any other, with :func:`plan` (the pure
:func:`~supervisor.recovery.rollback.plan_rollback`) as its planner: stop the gang, restart it in
place from the newest committed step before the onset, the skipped steps handed to the
ranks. When the plan is carried out (:func:`apply`), the steps the rolled-back run
committed after the restored one are forgotten (they hold the spike's weights) and
their late landings ignored (:func:`void_landing`), and the rollback is recorded on the
job: the ranks of every later generation get its skipped steps (``PHALANX_SKIP``), the
mean loss before the spike as their guard's starting point and, if the spec asks, an
LR scale (:func:`start_env`). Rollbacks spend ``guard.max_rollbacks``, not
``restart.max_restarts``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from phalanx import guard, wire
from phalanx.jobspec import GuardSpec
from supervisor.actuator import Actuator
from supervisor.fleet.registry import NodeState
from supervisor.jobs import Job, JobState, hold_steps, void_landing
from supervisor.records import GuardTrip
from supervisor.recovery.intake import Report
from supervisor.recovery.planner import CatalogView, Failure, FailureKind, Plan
from supervisor.recovery.rollback import RollbackView, plan_rollback, skip_ranges, void

log = logging.getLogger(__name__)


def failure_of(ev: wire.RankEvent) -> Failure:
    """The failure a ``guard`` rank event stands for."""
    kind = FailureKind.NAN if ev.guard == "nan" else FailureKind.LOSS_SPIKE
    onset = ev.onset if ev.onset is not None else ev.step
    if ev.guard == "nan":
        detail = "a NaN or infinite loss"
    else:
        detail = f"loss {ev.value:.4g}" if ev.value is not None else "a loss spike"
        if ev.baseline is not None:
            detail += f" against a mean of {ev.baseline:.4g} before it"
    return Failure(
        kind,
        ev.node,
        rank=ev.rank,
        step=ev.step,
        detail=detail,
        generation=ev.generation,
        quarantine=False,  # the data's fault, not the node's
        onset=onset,
    )


def on_guard(ctl: Actuator, job: Job, ev: wire.RankEvent) -> Report | None:
    """A rank of ``job``'s current generation reports its loss guard tripped: recorded,
    and the failure it stands for (None: the job has no guard, is not running, or
    recovers already; a trip during a recovery's launch waits in ``job.guard_pending``)."""
    ctl.event(
        "loss_guard",
        job,
        node=ev.node,
        rank=ev.rank,
        generation=ev.generation,
        guard=ev.guard,
        step=ev.step,
        onset=ev.onset,
        value=ev.value,
        baseline=ev.baseline,
    )
    if job.spec.guard is None or job.state not in (JobState.RUNNING, JobState.STARTING):
        return None
    if job.recovery is not None:
        if job.state is JobState.STARTING and job.recovery.launch_started_at:
            # The new generation's ranks stepped (and tripped) before every start was
            # acknowledged: the rollback waits for the launch to end (the ranks hold).
            job.guard_pending = ev
        return None  # else already recovering: another failure came first
    trip = GuardTrip(ev.baseline, ev.value, ev.guard)
    return Report(failure_of(ev), fault_at=ev.at, guard=trip)


def plan(ctl: Actuator, job: Job, failure: Failure) -> Plan:
    """The rollback plan of ``job`` now (:func:`supervisor.recovery.rollback.plan_rollback`)."""
    spec = job.spec.guard or GuardSpec(max_rollbacks=0)  # turned off: no budget
    committed, where = ctl.catalog.committed_view(job.id)
    alive = {n for n, v in ctl.registry.nodes.items() if v.state is not NodeState.OFFLINE}
    view = RollbackView(
        id=job.id,
        nodes=tuple(job.nodes),
        ranks_per_node=job.spec.ranks_per_node,
        margin=spec.margin,
        max_rollbacks=spec.max_rollbacks,
        rollback_window_s=spec.rollback_window,
        past=tuple(float(r["at"]) for r in guard_rollbacks(job)),
        replicated=job.spec.reshapes,
        reshards=job.spec.reshards,
    )
    return plan_rollback(view, failure, CatalogView(committed, where), now=time.time(), alive=alive)


def apply(ctl: Actuator, job: Job, plan: Plan) -> None:
    """Carry out a rollback plan before its launch (the old generation is stopped):
    record it on the job and forget the steps it voids."""
    rec = job.recovery
    if rec is not None and rec.rollback_applied:
        return  # a relaunch run again after a restart
    failure = rec.failures[0] if rec is not None and rec.failures else None
    trip = rec.guard if rec is not None else None
    entry = {
        "at": time.time(),
        "generation": job.generation,
        "after": plan.restore_step if plan.restore_step is not None else -1,
        "skip": list(plan.skip) if plan.skip is not None else None,
        "kind": failure.kind.value if failure is not None else None,
        "onset": failure.onset if failure is not None else None,
        "step": failure.step if failure is not None else None,
        "baseline": trip.baseline if trip is not None else None,
    }
    job.rollbacks.append(entry)
    dropped = void(((s, t) for s, t, _ in ctl.catalog.rows.commits(job.id)), job.rollbacks)
    with ctl.store.batch():
        for step, tier in dropped:
            ctl.catalog.rows.drop_step(job.id, step, tier)
    if rec is not None:
        rec.rollback_applied = True
    ctl.save(job)
    ctl.event(
        "job_rolled_back",
        job,
        generation=job.generation,
        restore_step=plan.restore_step,
        skip=entry["skip"],
        voided=[[s, t] for s, t in dropped],
    )
    log.warning(
        "job %s: rolled back to step %s, skipping steps %s; forgot %d later checkpoint(s)",
        job.id,
        plan.restore_step,
        entry["skip"],
        len(dropped),
        extra={"job": job.id, "event": "job_rolled_back"},
    )


def start_env(job: Job) -> dict[str, str]:
    """What the ranks of the job's next generation get of the guard: its rule (with the
    mean before the last spike, after a rollback), the steps to skip, an LR scale."""
    spec = job.spec.guard
    if spec is None:
        return {}
    rolled = guard_rollbacks(job)
    last = rolled[-1] if rolled else None
    baseline = last.get("baseline") if last is not None else None
    rule = guard.Rule(
        ratio=spec.ratio,
        window=spec.window,
        patience=spec.patience,
        baseline=float(baseline) if isinstance(baseline, int | float) and baseline > 0 else None,
    )
    env = {guard.ENV_GUARD: rule.encode()}
    ranges = skip_ranges(rolled)
    if ranges:
        env[guard.ENV_SKIP] = "[" + ",".join(f"[{a},{b}]" for a, b in ranges) + "]"
    if spec.lr_scale is not None and last is not None and last.get("skip"):
        start = int(last["skip"][1])
        scale = guard.LrScale(spec.lr_scale.factor, start, start + spec.lr_scale.steps)
        env[guard.ENV_LR_SCALE] = scale.encode()
    return env


def guard_rollbacks(job: Job) -> list[dict[str, Any]]:
    """The job's rollbacks of the loss guard (``job.rollbacks`` also holds the steps an
    SDC recovery voided, :mod:`supervisor.recovery.sdc`)."""
    return [r for r in job.rollbacks if r.get("kind") != "sdc"]


__all__ = ["hold_steps", "void_landing"]  # kept here too: the guard's whole surface
