"""The jobs against what the fleet says of them, both ways.

* A node's heartbeat lists the job generations it runs: ranks that no live job
  here owns are stopped (orphans: a supervisor that lost its state, a generation
  that outlived its stop), and a running job whose ranks a node no longer runs,
  unreported, lost them.
* The registry's node states: a running job's node that went offline (for sure:
  not a broker restart) or was drained for its health is a failure of the job.

The controller acts on what is found (:class:`Reconciler` calls it back); the
orphans' stops are sent as tasks of the controller's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Mapping

from phalanx import wire
from phalanx.tasks import Tasks
from supervisor.errors import RegistryError
from supervisor.fleet.commands import CommandSender
from supervisor.fleet.registry import Registry
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.recovery import intake
from supervisor.recovery.intake import Report

log = logging.getLogger(__name__)

ORPHAN_STOP_EVERY_S = 30.0  # one job generation's orphans on one node: one stop this often
ORPHAN_GRACE_S = 10.0
MISSED_BEATS = 2  # heartbeats in a row without a running job's ranks: they are lost
START_SLACK_S = 2.0  # heartbeats sent this soon after a start may predate the ranks
# An older generation still listed this long after its job's relaunch is being stopped by
# it: the recovery's stop (its grace, executor.STOP_GRACE_S, 5 s) and each node's start.
OLDER_STOPPING_S = 5.0 + START_SLACK_S


OnFailure = Callable[[Job, Report], None]  # the controller's route


class Reconciler:
    """``jobs`` and ``busy`` (the ids of jobs with a launch or stop in flight) are the
    controller's; ``settling()`` is true while a restarted supervisor gives the nodes time
    to announce themselves; ``offline_confirmed(since)`` as in the controller;
    ``on_failure`` routes a job's failure to its recovery; ``lost(job, node, ranks)`` is
    told of ranks a node lost unreported."""

    def __init__(
        self,
        jobs: Mapping[str, Job],
        registry: Registry,
        send: CommandSender,
        tasks: Tasks,
        *,
        busy: Container[str],
        settling: Callable[[], bool],
        offline_confirmed: Callable[[float], bool],
        on_failure: OnFailure,
        lost: Callable[[Job, str, list[RankPlace]], None],
    ) -> None:
        self._jobs = jobs
        self._registry = registry
        self._send = send
        self._tasks = tasks
        self._busy = busy
        self._settling = settling
        self._offline_confirmed = offline_confirmed
        self._on_failure = on_failure
        self._lost = lost
        self._orphan_stops: dict[tuple[str, str, int], float] = {}
        self._missing: dict[tuple[str, str], int] = {}  # (job, node) -> heartbeats without it

    def on_heartbeat(self, beat: wire.Heartbeat) -> None:
        listed = {(j.job, j.generation) for j in beat.jobs}
        self._stop_orphans(beat.node, listed, beat.sent_at)
        for job in self._jobs.values():
            if job.state is not JobState.RUNNING or not job.holds(beat.node):
                continue
            if job.started_at is None or beat.sent_at < job.started_at + START_SLACK_S:
                continue
            key = (job.id, beat.node)
            if (job.id, job.generation) in listed:
                self._missing.pop(key, None)
                continue
            open_ranks = [r for r in job.places_on(beat.node) if not r.exited]
            if not open_ranks:
                continue
            self._missing[key] = self._missing.get(key, 0) + 1
            if self._missing[key] >= MISSED_BEATS:
                del self._missing[key]
                self._lost(job, beat.node, open_ranks)

    def _stop_orphans(self, node: str, listed: set[tuple[str, int]], sent_at: float) -> None:
        now = time.monotonic()
        for job_id, generation in listed:
            job = self._jobs.get(job_id)
            if job is not None and _being_stopped(job, node, generation, sent_at):
                continue
            owned = (
                job is not None
                and job.generation == generation
                and job.holds(node)
                # (a recovering job's gang is being stopped by its recovery already)
                and job.state
                in (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING, JobState.STOPPING)
            )
            key = (job_id, node, generation)
            if owned or now - self._orphan_stops.get(key, -1e9) < ORPHAN_STOP_EVERY_S:
                continue
            self._orphan_stops[key] = now
            log.warning(
                "node %s runs job %s generation %d, which no live job here owns; "
                "stopping those ranks",
                node,
                job_id,
                generation,
                extra={"node": node, "job": job_id, "event": "orphan_ranks"},
            )
            args = wire.StopRanksArgs(
                job=job_id,
                generation=generation,
                grace_s=ORPHAN_GRACE_S,
                reason="orphaned: not owned by any live job",
                # An older generation of a job that goes on here (a recovery under way):
                # its warm interpreters are for the next generation's ranks.
                keep_warm=job is not None
                and job.holds(node)
                and job.state in (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING),
            )
            self._tasks.spawn(self._send_quietly(node, args), name=f"orphan-stop-{job_id}-{node}")

    async def _send_quietly(self, node: str, args: wire.StopRanksArgs) -> None:
        try:
            await self._send(node, args, timeout=args.grace_s + 10.0)
        except (TimeoutError, ConnectionError, RegistryError) as exc:
            log.warning("orphan stop of %s on %s not acknowledged: %s", args.job, node, exc)

    def check_nodes(self) -> None:
        """A running job's node offline or drained for its health: the job failed
        (:func:`supervisor.recovery.intake.node_failure`)."""
        # A restarted supervisor has not heard from anyone yet: give the nodes one offline
        # timeout to re-announce themselves before judging the jobs on them.
        settling = self._settling()
        for job in self._jobs.values():
            if job.state is not JobState.RUNNING or job.id in self._busy:
                continue
            report = intake.node_failure(
                job,
                self._registry.nodes,
                settling=settling,
                offline_confirmed=self._offline_confirmed,
            )
            if report is not None:
                self._on_failure(job, report)


def _being_stopped(job: Job, node: str, generation: int, sent_at: float) -> bool:
    """Whether ``generation`` of ``job`` on ``node``, listed in a heartbeat sent at
    ``sent_at``, is an older one its node's agent takes care of: a relaunch that went
    ahead before every stop was acknowledged (``recovery_stop_wait_s``; the agent stops
    the older ranks before it starts the new; at 2,048 nodes ~190 orphan stops went out
    beside a launch's starts, issue 22), or an in-process restart's survivors, parked
    until their agent hands them the new generation (it stops those that do not park in
    time)."""
    if generation >= job.generation or not job.holds(node):
        return False
    if job.state is JobState.STARTING:
        return True
    if job.state is JobState.RECOVERING:
        return job.spec.restart.in_process and generation == job.generation - 1
    return (
        job.state is JobState.RUNNING
        and job.started_at is not None
        and sent_at < job.started_at + OLDER_STOPPING_S
    )
