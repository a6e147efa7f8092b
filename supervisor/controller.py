"""The job controller: queue, scheduling passes, gang launch, rank exits, stops.

It owns the jobs' records (persisted on every change) and drives them
through :mod:`supervisor.jobs`' state machine. Placement decisions come from
the pure scheduler (:func:`supervisor.scheduler.schedule`); the controller
turns them into commands to agents and waits for their acks. Every command
names the job's generation, so a late ack or rank event of an older launch
changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from phalanx import wire
from phalanx.jobspec import JobSpec
from supervisor.burnin import BurnIns
from supervisor.errors import LaunchError, Refused, RegistryError, UnknownJob
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.orders import GangOrders
from supervisor.planner import Failure, FailureKind, NodeIncident
from supervisor.recovery import BURN_IN_TIMEOUT_S, Recoveries
from supervisor.registry import NodeState
from supervisor.scheduler import (
    ClusterNode,
    ClusterState,
    Decisions,
    PendingJob,
    Placement,
    RunningJob,
    TeamShare,
    schedule,
)

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor

log = logging.getLogger(__name__)


class JobController:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.store = sup.store
        self.jobs: dict[str, Job] = {
            job_id: Job.from_record(job_id, rec) for job_id, rec in self.store.load_jobs().items()
        }
        self.spares: tuple[str, ...] = ()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy: set[str] = set()  # jobs with a launch or stop in flight
        self._inflight: dict[str, int] = {}
        self._orphan_stops: dict[tuple[str, str, int], float] = {}
        self._missing: dict[tuple[str, str], int] = {}  # (job, node) -> heartbeats without it
        self.last_pass_s = 0.0
        self._started = time.monotonic()
        self.registry = sup.registry
        self.settings = sup.settings
        self.burnins = BurnIns(sup.registry, self.command, timeout_s=BURN_IN_TIMEOUT_S)
        self.recoveries = Recoveries(self)
        self.orders = GangOrders(self)

    # --- lifecycle -------------------------------------------------------------

    def resume(self) -> None:
        """After a restart: finish what a previous supervisor left half done."""
        for job in self.jobs.values():
            if job.state is JobState.STARTING and job.recovery is not None:
                # A recovery's launch, its outcome unknown: the recovery runs again (its
                # stop first), once the nodes had a chance to re-announce themselves.
                # The generation it launched is the one to stop now.
                job.recovery["phase"] = "plan"
                job.recovery["generation"] = job.generation
                self._move(job, JobState.RECOVERING, "supervisor restarted during recovery")
                self._spawn(job, self._after_settling(job))
            elif job.state is JobState.RECOVERING:
                self._spawn(job, self._after_settling(job))
            elif job.state is JobState.STARTING:
                # The launch's outcome is unknown: stop what may have started, then requeue.
                job.stop_target = JobState.PENDING
                job.reason = "supervisor restarted during launch"
                self._move(job, JobState.STOPPING, job.reason)
                self._spawn(job, self._stop_after_settling(job))
            elif job.state is JobState.STOPPING:
                self._spawn(job, self._stop_after_settling(job))
        self.wake()

    async def loop(self) -> None:
        interval = self.sup.settings.schedule_interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            self._wake.clear()
            self.check_runtimes()
            self.check_nodes()
            for node in self.burnins.observe():
                self.burnins.start(node)  # undrained: burned in before it takes work
            self.schedule_pass()

    # --- what the recoveries use -------------------------------------------------

    async def command(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        return await self.sup.command(node, args, timeout=timeout)

    def node_incidents(self) -> list[NodeIncident]:
        """Every failure any job recorded, by the node it struck (quarantine follows the
        hardware across jobs)."""
        out = []
        for job in self.jobs.values():
            records = [*job.incidents, *([job.recovery] if job.recovery else [])]
            for rec in records:
                for f in rec.get("failures", []):
                    if f.get("quarantine", True):  # not a node stopped on purpose
                        out.append(NodeIncident(job.id, f["node"], rec.get("fault_at", 0.0)))
        return out

    def move(self, job: Job, to: JobState, why: str) -> None:
        self._move(job, to, why)

    def save(self, job: Job) -> None:
        self._save(job)

    async def stop(self, job: Job) -> None:
        await self._stop(job)

    def event(self, kind: str, job: Job, node: str | None = None, **detail: Any) -> None:
        self._event(kind, job, node, **detail)

    def spawn(self, job: Job, work: Awaitable[None]) -> None:
        self._spawn(job, work)

    async def launch(self, job: Job, nodes: list[str]) -> None:
        await self._launch(job, nodes)

    async def _after_settling(self, job: Job) -> None:
        """Run a recovery a previous supervisor left, once the nodes had one offline
        timeout to announce themselves."""
        settle = self._started + self.sup.settings.offline_after_s - time.monotonic()
        if settle > 0:
            await asyncio.sleep(settle)
        await self.recoveries.run(job)

    def wake(self) -> None:
        self._wake.set()
        self.recoveries.wake()

    async def close(self) -> None:
        await self.burnins.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- operators -----------------------------------------------------------

    def submit(self, spec: JobSpec) -> Job:
        job = Job(Job.new_id(spec.name), spec)
        self.jobs[job.id] = job
        self._save(job)
        self._event("job_submitted", job, team=spec.team, world_size=spec.world_size)
        self.wake()
        return job

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(job_id)
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state.final:
            raise Refused(f"job {job_id} already ended ({job.state.value})")
        if job.state is JobState.PENDING:
            job.reason = "cancelled by operator"
            self._move(job, JobState.CANCELLED, job.reason)
            return job
        self.recoveries.abandon(job, "cancelled")  # its task steps aside (checks the state)
        job.stop_target = JobState.CANCELLED
        job.reason = "cancelled by operator"
        if job.state is not JobState.STOPPING:
            self._move(job, JobState.STOPPING, job.reason)
            self._spawn(job, self._stop(job), exclusive=False)
        else:
            self._save(job)
        return job

    # --- inbound -----------------------------------------------------------------

    def on_rank_event(self, ev: wire.RankEvent) -> None:
        job = self.jobs.get(ev.job)
        if job is None or ev.generation > job.generation:
            return
        if ev.step is not None and ev.event in ("exited", "hung", "stepped"):
            # (a hung rank took its last step idle_s before the report)
            job.note_step(ev.generation, ev.step, ev.at - (ev.idle_s or 0.0))
        if ev.generation != job.generation:
            return
        if ev.event in ("restored", "stepped"):
            self.recoveries.on_progress(job, ev)
            return
        if ev.event == "hung":
            if job.state is JobState.RUNNING:
                self._event(
                    "ranks_hung",
                    job,
                    node=ev.node,
                    rank=ev.rank,
                    step=ev.step,
                    stopped=ev.stopped,
                    idle_s=ev.idle_s,
                    detail=ev.detail,
                )
                self.recoveries.on_hang(job, ev)
            return
        if ev.event != "exited":
            return
        place = next((r for r in job.ranks if r.rank == ev.rank), None)
        if place is None or place.node != ev.node or place.exited:
            return
        place.code, place.signal = ev.code, ev.signal
        self._event(
            "rank_exited",
            job,
            node=ev.node,
            rank=ev.rank,
            code=ev.code,
            signal=ev.signal,
            generation=ev.generation,
            step=ev.step,
        )
        self._after_exit(job, place, step=ev.step, at=ev.at)

    def on_heartbeat(self, beat: wire.Heartbeat) -> None:
        """Reconcile both ways: ranks a node runs that no live job here owns are stopped, and
        a running job whose ranks a node no longer runs, unreported, lost them."""
        listed = {(j.job, j.generation) for j in beat.jobs}
        self._stop_orphans(beat.node, listed)
        for job in self.jobs.values():
            if job.state is not JobState.RUNNING or beat.node not in job.nodes:
                continue
            if job.started_at is None or beat.sent_at < job.started_at + 2.0:
                continue
            key = (job.id, beat.node)
            if (job.id, job.generation) in listed:
                self._missing.pop(key, None)
                continue
            open_ranks = [r for r in job.ranks if r.node == beat.node and not r.exited]
            if not open_ranks:
                continue
            self._missing[key] = self._missing.get(key, 0) + 1
            if self._missing[key] >= 2:
                del self._missing[key]
                for r in open_ranks:
                    r.lost = True
                self._event("ranks_lost", job, node=beat.node, ranks=[r.rank for r in open_ranks])
                self._after_exit(job, open_ranks[0])

    def _stop_orphans(self, node: str, listed: set[tuple[str, int]]) -> None:
        now = time.monotonic()
        for job_id, generation in listed:
            job = self.jobs.get(job_id)
            owned = (
                job is not None
                and job.generation == generation
                and node in job.nodes
                and job.state in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING)
            )
            key = (job_id, node, generation)
            if owned or now - self._orphan_stops.get(key, -1e9) < 30.0:
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
                grace_s=10.0,
                reason="orphaned: not owned by any live job",
            )
            task = asyncio.create_task(self._send_quietly(node, args), name="orphan-stop")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_quietly(self, node: str, args: wire.StopRanksArgs) -> None:
        try:
            await self.sup.command(node, args, timeout=args.grace_s + 10.0)
        except (TimeoutError, ConnectionError, RegistryError) as exc:
            log.warning("orphan stop of %s on %s not acknowledged: %s", args.job, node, exc)

    def _after_exit(
        self, job: Job, place: RankPlace, *, step: int | None = None, at: float | None = None
    ) -> None:
        if job.state is JobState.RUNNING:
            if not place.clean:
                self.recoveries.on_failure(
                    job,
                    Failure(
                        FailureKind.RANK_EXIT,
                        place.node,
                        rank=place.rank,
                        code=place.code,
                        signal=place.signal,
                        step=step,
                        generation=job.generation,
                        detail="lost: its node no longer runs it" if place.lost else "",
                    ),
                    fault_at=at,
                )
                return
            if all(r.exited and r.clean for r in job.ranks):
                job.reason = "every rank exited 0"
                self._move(job, JobState.SUCCEEDED, job.reason)
                self._event("job_succeeded", job, generation=job.generation)
                self.wake()
                return
        self._save(job)

    # --- periodic checks -------------------------------------------------------

    def check_runtimes(self) -> None:
        now = time.time()
        for job in self.jobs.values():
            if (
                job.state is JobState.RUNNING
                and job.started_at is not None
                and now - job.started_at + job.ran_before_s > job.spec.max_runtime
            ):
                self.fail(job, f"max_runtime of {job.spec.max_runtime:.0f}s exceeded")

    def check_nodes(self) -> None:
        # A restarted supervisor has not heard from anyone yet: give the nodes one offline
        # timeout to re-announce themselves before judging the jobs on them.
        settling = time.monotonic() - self._started < self.sup.settings.offline_after_s
        for job in self.jobs.values():
            if job.state is not JobState.RUNNING or job.id in self._busy:
                continue
            for node_id in job.nodes:
                node = self.sup.registry.nodes.get(node_id)
                if node is not None and settling and node.last_seen == 0.0:
                    continue
                if (
                    node is not None
                    and node.state is NodeState.OFFLINE
                    and not self.sup.offline_confirmed(node.offline_at)
                ):
                    continue  # perhaps the broker restarting: confirmed in a moment
                if node is None or node.state is NodeState.OFFLINE:
                    cause = node.offline_cause if node else "unknown"
                    self.recoveries.on_failure(
                        job,
                        Failure(
                            FailureKind.NODE_OFFLINE,
                            node_id,
                            detail=cause,
                            generation=job.generation,
                            quarantine=cause != "clean shutdown",
                        ),
                    )
                    break
                # A drain for the node's health is a hardware failure under the job; an
                # operator's drain lets the job finish (a rolling upgrade waits for it).
                if (
                    node.state is NodeState.DRAIN
                    and node.drain is not None
                    and node.drain.by == "auto"
                ):
                    self.recoveries.on_failure(
                        job,
                        Failure(
                            FailureKind.NODE_DRAIN,
                            node_id,
                            detail=node.drain.reason,
                            generation=job.generation,
                        ),
                        fault_at=node.drain.since,
                    )
                    break

    def fail(self, job: Job, why: str) -> None:
        if job.state not in (JobState.RUNNING, JobState.RECOVERING):
            return
        job.stop_target = JobState.FAILED
        job.reason = why
        self._move(job, JobState.STOPPING, why)
        self._spawn(job, self._stop(job))

    # --- scheduling ------------------------------------------------------------

    def cluster_state(self) -> ClusterState:
        now = time.time()
        nodes = []
        for node in self.sup.registry.nodes.values():
            if node.birth is None or not node.birth.gpus:
                continue
            nodes.append(
                ClusterNode(
                    id=node.id,
                    rack=node.birth.topology.rack,
                    gpus=len(node.birth.gpus),
                    gpu_type=node.birth.gpus[0].model,
                    nvlink_domain=node.birth.topology.nvlink_domain,
                    # Back from a drain, a node takes work once its burn-in passed.
                    schedulable=node.state is NodeState.UP and not self.burnins.needs(node.id),
                )
            )
        known = {n.id for n in nodes}
        running, pending = [], []
        for job in self.jobs.values():
            spec = job.spec
            held = list(job.nodes)
            if job.recovery is not None:  # the nodes its relaunch will use are held too
                held += [
                    n for n in (job.recovery.get("plan") or {}).get("nodes", []) if n not in held
                ]
            if job.state.holds_nodes and all(n in known for n in held):
                running.append(
                    RunningJob(
                        id=job.id,
                        team=spec.team,
                        priority=spec.priority,
                        nodes=tuple(held),
                        gpus_per_node=spec.ranks_per_node,
                        preemptible=spec.preemptible,
                        start_time=job.started_at or now,
                        max_runtime=spec.max_runtime,
                    )
                )
            elif job.state is JobState.PENDING:
                pending.append(
                    PendingJob(
                        id=job.id,
                        team=spec.team,
                        priority=spec.priority,
                        nodes=spec.nodes,
                        gpus_per_node=spec.ranks_per_node,
                        max_runtime=spec.max_runtime,
                        submit_time=job.submitted_at,
                        gpu_type=spec.gpu_type,
                        placement=Placement(spec.placement.policy),
                        placement_required=spec.placement.required,
                        preemptible=spec.preemptible,
                    )
                )
        settings = self.sup.settings
        teams = tuple(
            TeamShare(
                team=name, gpu_quota=t.gpu_quota, weight=t.weight, usage=self._usage(name, now)
            )
            for name, t in sorted(settings.teams.items())
        )
        return ClusterState(
            now=now,
            nodes=tuple(sorted(nodes, key=lambda n: n.id)),
            running=tuple(running),
            pending=tuple(pending),
            teams=teams,
            spare_pool=settings.spares,
            previous_spares=frozenset(self.spares),
        )

    def _usage(self, team: str, now: float) -> float:
        """GPU-seconds of the team's jobs over the last day (a plain window, no decay)."""
        total = 0.0
        for job in self.jobs.values():
            if job.spec.team != team or job.started_at is None:
                continue
            end = job.ended_at or now
            start = max(job.started_at, now - 86400)
            if end > start:
                total += (end - start) * job.spec.world_size
        return total

    def schedule_pass(self) -> Decisions | None:
        # With a spare pool, every pass tops it up (a recovery just took a spare).
        if not self.sup.settings.spares and not any(
            j.state is JobState.PENDING for j in self.jobs.values()
        ):
            return None
        t0 = time.perf_counter()
        decisions = schedule(self.cluster_state())
        self.last_pass_s = time.perf_counter() - t0
        if decisions.spares != self.spares:
            self.recoveries.wake()
        self.spares = decisions.spares
        for spare in self.spares:
            self.burnins.start(spare)  # a spare is burned in as it enters the pool
        for wait in decisions.waits:
            job = self.jobs[wait.job_id]
            waiting = {"reason": wait.reason.value, "detail": wait.detail}
            if job.waiting != waiting:
                job.waiting = waiting
                self._save(job)
        for pre in decisions.preemptions:
            victim = self.jobs[pre.victim_id]
            if victim.state is JobState.RUNNING and victim.id not in self._busy:
                victim.stop_target = JobState.PENDING
                victim.reason = f"preempted for {pre.for_job_id}"
                victim.preemptions += 1
                self._event(
                    "job_preempted",
                    victim,
                    by=pre.for_job_id,
                    lost_gpu_seconds=round(pre.lost_work, 1),
                )
                self._move(victim, JobState.STOPPING, victim.reason)
                self._spawn(victim, self.orders.preempt(victim))
        for start in decisions.starts:
            job = self.jobs[start.job_id]
            if start.preempts:
                # Its nodes free up once the victims stop; a later pass places it.
                job.waiting = {
                    "reason": "preemption",
                    "detail": f"waiting for {', '.join(start.preempts)} to stop",
                }
                self._save(job)
                continue
            if job.state is JobState.PENDING and job.id not in self._busy:
                job.waiting = None
                self._spawn(job, self._launch(job, list(start.nodes)))
        return decisions

    # --- launch and stop -----------------------------------------------------------

    async def _launch(self, job: Job, nodes: list[str]) -> None:
        spec = job.spec
        job.generation += 1
        job.nodes = nodes
        job.ranks = [
            RankPlace(rank=i * spec.ranks_per_node + lr, node=n, local_rank=lr)
            for i, n in enumerate(nodes)
            for lr in range(spec.ranks_per_node)
        ]
        job.stop_target = None
        job.reason = ""
        self._move(job, JobState.STARTING, f"placed on {', '.join(nodes)}")
        self._event("job_starting", job, nodes=nodes, generation=job.generation)
        timeout = self.sup.settings.command_timeout_s
        try:
            rank0 = self.sup.registry.get(nodes[0])
            assert rank0.birth is not None
            job.master_addr = rank0.birth.address
            ack = await self.sup.command(nodes[0], wire.AllocPortArgs(), timeout=timeout)
            if ack.status != wire.AckStatus.DONE:
                raise LaunchError(
                    f"node {nodes[0]} could not allocate a port: {ack.detail}", nodes[0]
                )
            job.master_port = int(ack.result["port"])
            # The ranks restore first thing: their nodes must know this generation's
            # restore step (or that there is none) before; their agents wait for it.
            await self.sup.publisher.publish(job.id)
            acks = await asyncio.gather(
                *(
                    self.sup.command(node, self.orders.start_args(job, i, node), timeout=timeout)
                    for i, node in enumerate(nodes)
                ),
                return_exceptions=True,
            )
            problems, failed = [], []
            for node, result in zip(nodes, acks, strict=True):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                if isinstance(result, BaseException):
                    problems.append(f"{node}: {result}")
                    failed.append(node)
                elif result.status != wire.AckStatus.DONE:
                    problems.append(f"{node}: {result.detail}")
                    failed.append(node)
            if problems:
                raise LaunchError("; ".join(problems), failed[0])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # LinkDown, a timeout, a bad ack: never stay in starting
            if job.state is not JobState.STARTING:
                return  # cancelled meanwhile: that stop owns the job now
            if job.recovery is not None:
                # A recovery's launch: recovered again (its stop covers this generation),
                # charged to the budget, rather than the job failed with restarts left.
                node = getattr(exc, "node", None) or job.nodes[0]
                self.recoveries.relaunch_failed(job, node, str(exc))
                return
            job.stop_target = JobState.FAILED
            job.reason = f"launch failed: {exc}"
            self._move(job, JobState.STOPPING, job.reason)
            await self._stop(job, grace_s=5.0)
            return
        if job.state is not JobState.STARTING:
            return  # cancelled while the ranks were starting: the cancel's stop ends it
        job.started_at = time.time()
        if job.first_started_at is None:
            job.first_started_at = job.started_at
        self._move(job, JobState.RUNNING, f"world size {spec.world_size}")
        self._event(
            "job_running",
            job,
            generation=job.generation,
            master=f"{job.master_addr}:{job.master_port}",
        )
        self.recoveries.on_started(job)
        for place in job.ranks:  # exits that raced the start acks
            if place.exited:
                self._after_exit(job, place)
                break

    async def _stop_after_settling(self, job: Job) -> None:
        """A restarted supervisor knows no node yet: give the job's nodes one offline timeout
        to re-announce themselves before sending the stops (an offline node gets none)."""
        settle = self._started + self.sup.settings.offline_after_s - time.monotonic()
        if settle > 0:
            await asyncio.sleep(settle)
        await self._stop(job)

    async def _stop(self, job: Job, grace_s: float | None = None) -> None:
        grace = grace_s if grace_s is not None else job.spec.grace_period
        args = wire.StopRanksArgs(
            job=job.id, generation=max(job.generation, 1), grace_s=grace, reason=job.reason
        )
        timeout = grace + self.sup.settings.command_timeout_s
        results = await asyncio.gather(
            *(
                self.sup.command(node, args, timeout=timeout)
                for node in job.nodes
                if self.sup.registry.nodes.get(node) is not None
                and self.sup.registry.nodes[node].state is not NodeState.OFFLINE
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                log.warning("job %s: a stop was not acknowledged: %s", job.id, result)
        target = job.stop_target or JobState.FAILED
        if target is JobState.PENDING:
            job.started_at = None
            job.ran_before_s = 0.0
            job.nodes, job.ranks = [], []
        self._move(job, target, job.reason)
        self._event(f"job_{target.value}", job, reason=job.reason, generation=job.generation)
        self.wake()

    # --- plumbing ------------------------------------------------------------------

    def _spawn(self, job: Job, work: Awaitable[None], *, exclusive: bool = True) -> None:
        """Run a launch or stop of ``job``; ``exclusive=False`` for a cancel that may overlap
        a launch still in flight (the launch notices the state change and steps aside)."""
        self._busy.add(job.id)
        self._inflight[job.id] = self._inflight.get(job.id, 0) + 1

        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("job %s: controller task failed", job.id)
                if job.state in (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING):
                    self.fail(job, f"controller error: {exc}")
            finally:
                self._inflight[job.id] -= 1
                if not self._inflight[job.id]:
                    del self._inflight[job.id]
                    self._busy.discard(job.id)

        task = asyncio.create_task(run(), name=f"job-{job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _move(self, job: Job, to: JobState, why: str) -> None:
        before = job.state
        if to.final:
            self.recoveries.abandon(job, to.value)
        job.move(to, why)
        self._save(job)
        log.info(
            "job %s: %s -> %s (%s)",
            job.id,
            before.value,
            to.value,
            why,
            extra={"job": job.id, "event": "job_state", "state": to.value},
        )
        if to.final:
            # Its agents free the RAM tier once the catalog says the job ended (a failed
            # job's, after ckpt_failed_ram_linger_s).
            self.sup.publisher.publish_soon(job.id)

    def _save(self, job: Job) -> None:
        self.store.save_job(job.id, job.state.value, job.record())

    def _event(self, kind: str, job: Job, node: str | None = None, **detail: Any) -> None:
        self.store.add_event(kind, node, {"job": job.id, **detail})
