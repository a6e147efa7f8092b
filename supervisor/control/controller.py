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
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from phalanx.jobspec import JobSpec
from phalanx.tasks import Tasks
from supervisor.actuator import Actuator
from supervisor.checkpoints.publisher import CatalogPublisher
from supervisor.config import SupervisorSettings
from supervisor.control.cluster import cluster_state
from supervisor.control.orders import GangOrders
from supervisor.control.prewarm import SparePrewarm
from supervisor.control.reconcile import Reconciler
from supervisor.errors import Refused, UnknownJob
from supervisor.fleet.burnin import BurnIns, Screening
from supervisor.fleet.commands import CommandSender
from supervisor.fleet.registry import NodeState, Registry
from supervisor.jobs import Job, JobState, RankPlace, Waiting
from supervisor.recovery import intake, rollbacks
from supervisor.recovery.executor import BURN_IN_TIMEOUT_S, HANG_COLLECT_FLIGHT_S, Recoveries
from supervisor.recovery.incidents import Incidents
from supervisor.recovery.intake import Report
from supervisor.recovery.planner import Failure, FailureKind
from supervisor.recovery.sdc_watch import SdcWatch
from supervisor.scheduler import Decisions, schedule
from supervisor.store import Store

log = logging.getLogger(__name__)

# The least time between two scheduling passes: a pass looks at every node and job
# (O(nodes)), and the fleet can wake the loop thousands of times a second.
MIN_PASS_GAP_S = 0.5
# With nothing pending and nothing changed, a pass is skipped; one runs at least this
# often anyway (a change that reached no version the skip looks at is seen then).
FULL_PASS_S = 30.0


class JobController:
    """The jobs of ``store``, run on the nodes of ``registry``: ``send`` sends a command
    and waits for its ack, ``publisher`` sends the checkpoint catalogs,
    ``offline_confirmed(since)`` says whether a node offline since then is offline for sure
    (not a broker restart). It acts on the jobs through an
    :class:`~supervisor.actuator.Actuator` it shares with the recoveries, and routes
    every failure the intake (:mod:`supervisor.recovery.intake`) reports to them
    (:meth:`route`)."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        settings: SupervisorSettings,
        *,
        send: CommandSender,
        publisher: CatalogPublisher,
        offline_confirmed: Callable[[float], bool],
        agent_keys: AgentKeys | None = None,
        write_now: Callable[[], None] = lambda: None,
        written: Callable[[float], Awaitable[bool]] | None = None,
    ) -> None:
        """``write_now``: hands what was published to the broker's socket at once
        (``phalanx.link.MqttLinks.write_now``; the actuator's, after a launch's starts);
        ``written``: waits until all of it was (``MqttLinks.written``), before the
        launch's catalogs."""
        self.store = store
        self.agent_keys = agent_keys if agent_keys is not None else AgentKeys("")
        self.registry = registry
        self.settings = settings
        self._publisher = publisher
        self.catalog = publisher.catalog  # the recovery planner's view of the checkpoints
        self.jobs: dict[str, Job] = {
            job_id: Job.from_record(job_id, rec) for job_id, rec in store.load_jobs().items()
        }
        self.act = Actuator(
            self.jobs,
            store,
            registry,
            settings,
            send=send,
            publisher=publisher,
            agent_keys=self.agent_keys,
            start_orders=lambda job, nodes: self.orders.start_orders(job, nodes),
            write_now=write_now,
            written=written,
        )
        self.orders = GangOrders(self.act)
        self._hangs = intake.HangReports()
        self._wake = asyncio.Event()
        self.tasks = Tasks("job controller")
        self._busy: set[str] = set()  # jobs with a launch or stop in flight
        # Shrunk elastic jobs that could grow: the newest step committed when they could
        # (they grow at the next commit).
        self._grow_from: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self.last_pass_s = 0.0
        # What the last scheduling pass saw, and when (monotonic): see _unchanged.
        self._passed_on: tuple[object, ...] | None = None
        self._passed_at = -math.inf
        self._started = time.monotonic()
        self.burnins = BurnIns(
            registry,
            self.act.command,
            timeout_s=BURN_IN_TIMEOUT_S,
            screening=Screening(
                settings.screen_max_slowdown,
                settings.screen_min_link,
                settings.screen_min_peers,
                settings.screen_probe_bytes,
                settings.screen_min_p2p,
            ),
            agent_keys=self.agent_keys,
            busy=self._busy_nodes,
        )
        self.incidents = Incidents(self.act, self._newest_committed)
        self.recoveries = Recoveries(self.act, self.incidents, self.burnins)
        self.prewarm = SparePrewarm(send, self.tasks, self.orders.prewarm_args)
        self.sdc = SdcWatch(self.act)
        self.reconciler = Reconciler(
            self.jobs,
            registry,
            send,
            self.tasks,
            busy=self._busy,
            settling=self._settling,
            offline_confirmed=offline_confirmed,
            on_failure=self.route,
            lost=self._ranks_lost,
        )

    @property
    def spares(self) -> tuple[str, ...]:
        """The spare pool of the last scheduling pass."""
        return self.act.spares

    @spares.setter
    def spares(self, pool: tuple[str, ...]) -> None:
        self.act.spares = pool

    # --- lifecycle -------------------------------------------------------------

    def resume(self) -> None:
        """After a restart: finish what a previous supervisor left half done."""
        for job in self.jobs.values():
            if job.state is JobState.STARTING and job.recovery is not None:
                # A recovery's launch, its outcome unknown: the recovery runs again (its
                # stop first), once the nodes had a chance to re-announce themselves.
                # The generation it launched is the one to stop now.
                job.recovery.phase = "plan"
                job.recovery.generation = job.generation
                self.move(job, JobState.RECOVERING, "supervisor restarted during recovery")
                self.spawn(job, self._recover(job, settle=True))
            elif job.state is JobState.RECOVERING:
                self.spawn(job, self._recover(job, settle=True))
            elif job.state is JobState.STARTING:
                # The launch's outcome is unknown: stop what may have started, then requeue.
                job.stop_target = JobState.PENDING
                job.reason = "supervisor restarted during launch"
                self.move(job, JobState.STOPPING, job.reason)
                self.spawn(job, self._stop_after_settling(job))
            elif job.state is JobState.STOPPING:
                self.spawn(job, self._stop_after_settling(job))
        self.wake()

    async def loop(self) -> None:
        interval = self.settings.schedule_interval_s
        gap = min(MIN_PASS_GAP_S, interval)
        last = -math.inf
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            # A burst of wakes (a fleet's births, a broker restart's rebirths, a gang's
            # nodes changing state) is one pass, not one per wake.
            if (wait := last + gap - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            last = time.monotonic()
            self._wake.clear()
            self.tick()

    def tick(self) -> None:
        """One turn of :meth:`loop`: runtimes, growth, the nodes' ranks, burn-ins, then a
        scheduling pass unless nothing it decides from changed."""
        self.check_runtimes()
        self.check_growth()
        self.reconciler.check_nodes()
        for node in self.burnins.observe():
            self.burnins.start(node)  # undrained: burned in before it takes work
        self.burnins.survey()  # the fleet's link figures, for the replacements to come
        if self._unchanged():
            for spare in self.spares:
                self.burnins.start(spare)  # one that could not run is tried again
        else:
            self.schedule_pass()
            self._passed_on, self._passed_at = self._pass_key(), time.monotonic()
        if self.spares:
            try:  # an optional speed-up: never what stops the loop
                self.prewarm.tick(self.spares, self.jobs, self._spare_gpus(self.spares))
            except Exception:
                log.exception("could not send the spares' prewarm orders")

    def _spare_gpus(self, nodes: Iterable[str]) -> dict[str, tuple[int, str | None]]:
        """Each node's GPU count and model (0 and None: not known)."""
        out: dict[str, tuple[int, str | None]] = {}
        for node in nodes:
            known = self.registry.nodes.get(node)
            gpus = known.birth.gpus if known is not None and known.birth else []
            out[node] = (len(gpus), gpus[0].model if gpus else None)
        return out

    async def command(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        return await self.act.command(node, args, timeout=timeout)

    # --- failures ------------------------------------------------------------------

    def route(self, job: Job, report: Report) -> None:
        """Every failure of a job comes here, from the intake: its events recorded, then
        its recovery begun and run as the job's task (one recovery at a time)."""
        for noted in report.noted:
            self.event(noted.kind, job, node=noted.node, **noted.detail)
        if self.recoveries.begin(job, report):
            self.spawn(job, self._recover(job))

    def on_failure(self, job: Job, failure: Failure, *, fault_at: float | None = None) -> None:
        """A failure of ``job``'s current generation, named by hand (an operator's tool, a
        test): routed as any other."""
        self.route(job, Report(failure, fault_at=fault_at))

    async def _recover(self, job: Job, *, settle: bool = False) -> None:
        """The job's recovery, as its task, and what its relaunch came to: running, or a
        failed launch that begins a new recovery (charged to the budget) in this task.
        ``settle``: a recovery a previous supervisor left, run once the nodes had one
        offline timeout to announce themselves."""
        wait = self._started + self.settings.offline_after_s - time.monotonic()
        if settle and wait > 0:
            await asyncio.sleep(wait)
        while True:
            launched = await self.recoveries.run(job)
            if launched is None or launched.superseded:
                break
            if launched.ok:
                self._running(job)
                break
            assert launched.node is not None
            if not self.recoveries.relaunch_failed(job, launched.node, launched.why):
                break
            if self.tasks.closed:
                break  # shutting down: begun and persisted, the next supervisor runs it
        self.wake()

    def _settling(self) -> bool:
        """A restarted supervisor has heard from no node yet: for one offline timeout."""
        return time.monotonic() - self._started < self.settings.offline_after_s

    def _busy_nodes(self) -> set[str]:
        """The nodes of every job that holds nodes (its ranks may be training there)."""
        return {n for job in self.jobs.values() if job.state.holds_nodes for n in job.nodes}

    def wake(self) -> None:
        self._wake.set()
        self.recoveries.wake()

    def close(self) -> None:
        """Stop accepting: no job task, orphan stop or burn-in starts from now on (a job
        keeps its persisted state, which the next supervisor takes up: :meth:`resume`)."""
        self.tasks.close()
        self.burnins.close()
        self.recoveries.close()

    async def shutdown(self, timeout: float) -> None:
        """Start nothing new; wait up to ``timeout`` s for the job tasks, orphan stops and
        burn-ins running, then cancel the rest. A job's state is persisted on every
        change: what was cut short is taken up by the next supervisor (:meth:`resume`)."""
        await asyncio.gather(self.tasks.shutdown(timeout), self.burnins.shutdown(timeout))

    # --- operators -----------------------------------------------------------

    def submit(self, spec: JobSpec) -> Job:
        job = Job(Job.new_id(spec.name), spec)
        self.jobs[job.id] = job
        self.save(job)
        self.event("job_submitted", job, team=spec.team, world_size=spec.world_size)
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
            self.move(job, JobState.CANCELLED, job.reason)
            return job
        self.incidents.abandon(job, "cancelled")  # its task steps aside (checks the state)
        job.stop_target = JobState.CANCELLED
        job.reason = "cancelled by operator"
        if job.state is not JobState.STOPPING:
            self.move(job, JobState.STOPPING, job.reason)
            self.spawn(job, self.stop(job), exclusive=False)
        else:
            self.save(job)
        return job

    # --- inbound -----------------------------------------------------------------

    def on_rank_event(self, ev: wire.RankEvent) -> None:
        job = self.jobs.get(ev.job)
        if job is None or ev.generation > job.generation:
            return
        if ev.step is not None and ev.event in ("exited", "hung", "stepped", "guard"):
            # (a hung rank took its last step idle_s before the report)
            job.note_step(ev.generation, ev.step, ev.at - (ev.idle_s or 0.0))
        if ev.generation != job.generation:
            return
        if ev.event in ("restored", "stepped"):
            self.incidents.on_progress(job, ev)
            return
        if ev.event == "guard":
            if (report := rollbacks.on_guard(self.act, job, ev)) is not None:
                self.route(job, report)
            return
        if ev.event == "digest":
            if (report := self.sdc.on_digest(job, ev)) is not None:
                self.route(job, report)
            return
        if ev.event == "hung":
            if job.state is JobState.RUNNING:
                self.event(
                    "ranks_hung",
                    job,
                    node=ev.node,
                    rank=ev.rank,
                    step=ev.step,
                    stopped=ev.stopped,
                    idle_s=ev.idle_s,
                    detail=ev.detail,
                )
                self._on_hang(job, ev)
            return
        if ev.event != "exited":
            return
        place = job.place(ev.rank)
        if place is None or place.node != ev.node or place.exited:
            return
        job.rank_exited(place, ev.code, ev.signal)
        # A gang's stop brings one per rank (16,384 at once): written soon, together.
        self.store.add_event_soon(
            "rank_exited",
            ev.node,
            {
                "job": job.id,
                "rank": ev.rank,
                "code": ev.code,
                "signal": ev.signal,
                "generation": ev.generation,
                "step": ev.step,
            },
        )
        self._after_exit(job, place, step=ev.step, at=ev.at)

    def on_heartbeat(self, beat: wire.Heartbeat) -> None:
        self.reconciler.on_heartbeat(beat)

    def _on_hang(self, job: Job, ev: wire.RankEvent) -> None:
        """A node reports its ranks of the job hung: the other nodes' reports are waited
        for (as long as their agents wait for their ranks' flight recorders), then the
        intake names the culprit from all of them."""
        first, everyone = self._hangs.add(job, ev)
        key = (job.id, ev.generation)
        if everyone:
            self._hang_decided(key)  # every node of the gang reported: no need to wait
        elif first:
            asyncio.get_running_loop().call_later(HANG_COLLECT_FLIGHT_S, self._hang_decided, key)

    def _hang_decided(self, key: tuple[str, int]) -> None:
        reports = self._hangs.take(key)
        job = self.jobs.get(key[0])
        if job is None:
            return
        report = intake.hang(job, key[1], reports, now=time.time())
        if report is not None:
            self.route(job, report)

    def _ranks_lost(self, job: Job, node: str, ranks: list[RankPlace]) -> None:
        job.ranks_lost(ranks)
        self.event("ranks_lost", job, node=node, ranks=[r.rank for r in ranks])
        self._after_exit(job, ranks[0])

    def _after_exit(
        self, job: Job, place: RankPlace, *, step: int | None = None, at: float | None = None
    ) -> None:
        if (report := intake.rank_exit(job, place, step=step, at=at)) is not None:
            self.route(job, report)
            return
        if job.state is JobState.RUNNING and job.all_exited_clean():
            job.reason = "every rank exited 0"
            self.move(job, JobState.SUCCEEDED, job.reason)
            self.event("job_succeeded", job, generation=job.generation)
            self.wake()
            return
        self.save_soon(job)  # one exit of thousands: the record is built once for them

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

    def check_growth(self) -> None:
        """Grow a shrunk elastic job back (planner rule 7) once it ran ``grow_after`` at
        its size, nodes are free for a larger allowed size, and it committed a step
        since they were: the restart then loses only the steps after that commit."""
        now = time.time()
        free: int | None = None  # nodes up and held by no job nor the spare pool
        for job in self.jobs.values():
            e = job.spec.elastic
            if (
                e is None
                or job.state is not JobState.RUNNING
                or job.recovery is not None
                or job.id in self._busy
                or len(job.nodes) >= job.spec.nodes
                or job.started_at is None
                or now - job.started_at < e.grow_after
            ):
                self._grow_from.pop(job.id, None)
                continue
            if free is None:  # cheap, before the plan reads the job's checkpoint catalog
                held = {n for j in self.jobs.values() if j.state.holds_nodes for n in j.nodes}
                free = sum(
                    1
                    for n in self.registry.nodes.values()
                    if n.state is NodeState.UP and n.id not in held and n.id not in self.spares
                )
            plan = self.recoveries.grow_plan(job) if free else None
            if plan is None:
                self._grow_from.pop(job.id, None)
                continue
            # At its next commit the larger gang can read: the restart then loses only
            # the steps since (the new nodes read the peer or object copy, not RAM).
            newest = plan.restore_step if plan.restore_step is not None else -1
            since = self._grow_from.setdefault(job.id, newest)
            if newest <= since:
                continue
            del self._grow_from[job.id]
            added = [n for n in plan.nodes if n not in job.nodes]
            self.on_failure(
                job,
                Failure(
                    FailureKind.GROW,
                    added[0],
                    step=newest,
                    detail=f"{', '.join(added)} free since step {since}; {plan.reason}",
                    generation=job.generation,
                    quarantine=False,
                ),
            )

    def fail(self, job: Job, why: str) -> None:
        if job.state not in (JobState.RUNNING, JobState.RECOVERING):
            return
        job.stop_target = JobState.FAILED
        job.reason = why
        self.move(job, JobState.STOPPING, why)
        self.spawn(job, self.stop(job))

    # --- scheduling ------------------------------------------------------------

    def _pass_key(self) -> tuple[object, ...]:
        return (self.registry.version, self.act.saves, len(self.jobs), self.burnins.key())

    def _unchanged(self) -> bool:
        """Whether a scheduling pass now would decide what the last one did: no job is
        pending (a pending job's reservations and fair shares move with the clock), and
        no node, job or burn-in changed since. At 2,048 nodes a pass costs ~30 ms, every
        ``schedule_interval_s`` for the spare pool alone: 8 % of the supervisor in
        steady state (issue 22). A full pass still runs every ``FULL_PASS_S``."""
        if self._passed_on is None or time.monotonic() - self._passed_at >= FULL_PASS_S:
            return False
        if any(j.state is JobState.PENDING for j in self.jobs.values()):
            return False
        return self._pass_key() == self._passed_on

    def schedule_pass(self) -> Decisions | None:
        # With a spare pool, every pass tops it up (a recovery just took a spare).
        if not self.settings.spares and not any(
            j.state is JobState.PENDING for j in self.jobs.values()
        ):
            return None
        t0 = time.perf_counter()
        decisions = schedule(
            cluster_state(
                self.registry.nodes.values(),
                list(self.jobs.values()),
                self.settings,
                needs_burn_in=self.burnins.needs,
                previous_spares=self.spares,
                now=time.time(),
            )
        )
        self.last_pass_s = time.perf_counter() - t0
        if decisions.spares != self.spares:
            self.recoveries.wake()
        self.spares = decisions.spares
        for spare in self.spares:
            self.burnins.start(spare)  # a spare is burned in as it enters the pool
        for wait in decisions.waits:
            job = self.jobs[wait.job_id]
            waiting = Waiting(wait.reason.value, wait.detail)
            if job.waiting != waiting:
                job.waiting = waiting
                self.save(job)
        for pre in decisions.preemptions:
            victim = self.jobs[pre.victim_id]
            if victim.state is JobState.RUNNING and victim.id not in self._busy:
                victim.stop_target = JobState.PENDING
                victim.reason = f"preempted for {pre.for_job_id}"
                victim.preemptions += 1
                self.event(
                    "job_preempted",
                    victim,
                    by=pre.for_job_id,
                    lost_gpu_seconds=round(pre.lost_work, 1),
                )
                self.move(victim, JobState.STOPPING, victim.reason)
                self.spawn(victim, self.preempt(victim))
        for start in decisions.starts:
            job = self.jobs[start.job_id]
            if start.preempts:
                # Its nodes free up once the victims stop; a later pass places it.
                job.waiting = Waiting(
                    "preemption", f"waiting for {', '.join(start.preempts)} to stop"
                )
                self.save(job)
                continue
            if job.state is JobState.PENDING and job.id not in self._busy:
                job.waiting = None
                self.spawn(job, self.launch(job, list(start.nodes)))
        return decisions

    # --- launch and stop -----------------------------------------------------------

    async def launch(self, job: Job, nodes: list[str]) -> None:
        """Launch a pending job on the nodes a scheduling pass placed it on; a launch that
        fails stops what started and fails the job."""
        launched = await self.act.launch(job, nodes)
        if launched.ok:
            self._running(job)
        elif not launched.superseded and job.recovery is not None and launched.node:
            # A recovery began while this launch was under way (a guard's trip): it
            # takes the failed launch up, charged to the budget, as its own would.
            if self.recoveries.relaunch_failed(job, launched.node, launched.why):
                self.spawn(job, self._recover(job))
        elif not launched.superseded:
            job.stop_target = JobState.FAILED
            job.reason = f"launch failed: {launched.why}"
            self.move(job, JobState.STOPPING, job.reason)
            await self.stop(job, grace_s=5.0)

    def _running(self, job: Job) -> None:
        """A launch's every start was acknowledged: a recovery's incident is recorded, and
        what raced the acks is acted on (a rank's exit, a loss guard's trip)."""
        self.incidents.on_started(job)
        for place in job.ranks:  # exits that raced the start acks
            if place.exited:
                self._after_exit(job, place)
                break
        if (tripped := job.guard_pending) is not None:  # a trip that raced them too
            job.guard_pending = None
            report = None
            if tripped.generation == job.generation:
                report = rollbacks.on_guard(self.act, job, tripped)
            if report is not None:
                self.route(job, report)

    async def preempt(self, job: Job) -> None:
        """A preempted job: checkpointed first (``GangOrders.save_first``), then stopped."""
        await self.orders.save_first(job)
        await self.stop(job)

    async def _stop_after_settling(self, job: Job) -> None:
        """A restarted supervisor knows no node yet: give the job's nodes one offline timeout
        to re-announce themselves before sending the stops (an offline node gets none)."""
        settle = self._started + self.settings.offline_after_s - time.monotonic()
        if settle > 0:
            await asyncio.sleep(settle)
        await self.stop(job)

    async def stop(self, job: Job, grace_s: float | None = None) -> None:
        grace = grace_s if grace_s is not None else job.spec.grace_period
        args = wire.StopRanksArgs(
            job=job.id, generation=max(job.generation, 1), grace_s=grace, reason=job.reason
        )
        timeout = grace + self.settings.command_timeout_s
        results = await self.act.command_gang(self.act.reachable(job.nodes), args, timeout)
        for result in results:
            if isinstance(result, BaseException):
                log.warning("job %s: a stop was not acknowledged: %s", job.id, result)
        target = job.stop_target or JobState.FAILED
        if target is JobState.PENDING:
            job.started_at = None
            job.ran_before_s = 0.0
            job.nodes, job.ranks = [], []
        self.move(job, target, job.reason)
        self.event(f"job_{target.value}", job, reason=job.reason, generation=job.generation)
        self.wake()

    # --- plumbing ------------------------------------------------------------------

    def spawn(self, job: Job, work: Coroutine[Any, Any, None], *, exclusive: bool = True) -> None:
        """Run a launch or stop of ``job``; ``exclusive=False`` for a cancel that may overlap
        a launch still in flight (the launch notices the state change and steps aside).
        Once shutdown has begun nothing starts: the job's state, persisted, says what the
        next supervisor takes up."""

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

        if self.tasks.spawn(run(), name=f"job-{job.id}") is None:
            work.close()
            return
        self._busy.add(job.id)
        self._inflight[job.id] = self._inflight.get(job.id, 0) + 1

    def move(self, job: Job, to: JobState, why: str) -> None:
        """Move ``job`` to state ``to``; one that ends with a recovery under way ends its
        incident so."""
        if to.final:
            self.incidents.abandon(job, to.value)
        self.act.move(job, to, why)

    def _newest_committed(self, job: str, upto: int) -> int | None:
        return max(
            (step for step, _, _ in self.catalog.rows.commits(job) if step <= upto), default=None
        )

    def save(self, job: Job) -> None:
        self.act.save(job)

    def save_soon(self, job: Job) -> None:
        self.act.save_soon(job)

    def event(self, kind: str, job: Job, node: str | None = None, **detail: Any) -> None:
        self.act.event(kind, job, node, **detail)
