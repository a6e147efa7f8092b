"""Recovery: a failed rank, GPU or node costs seconds, not the run.

The controller routes every failure of a running job here, as the intake
(:mod:`supervisor.recovery.intake`) reported it (:meth:`Recoveries.begin`): a rank
that exited badly or was lost, a node of the gang that turned ``drain`` or went
offline, a gang whose steps stopped. The job turns ``recovering`` and its task then
(:meth:`Recoveries.run`, which the controller runs):

1. **plans** with the pure planner (:func:`supervisor.recovery.planner.plan_recovery`)
   from the fleet, the spare pool, the checkpoint catalog and the job's history;
2. **stops** the failed generation's ranks (each node keeps the job's RAM tier). A
   relaunch that follows at once stops only the nodes that leave the gang, and waits
   for no ack: each node that stays gets its start order, and its agent stops the old
   ranks before it starts the new (at 2,048 nodes, a stop and an ack less per node:
   seconds, issue 22).
   Anything else (a wait, a burn-in, a backoff, a rollback, an elastic resize, the end)
   stops the whole gang first and waits for every ack (a relaunch after it, for at most
   ``recovery_stop_wait_s``);
3. **quarantines** a failed node: drained, with the failure as the reason;
4. **waits** for a spare or a healthy node when there is none (bounded by
   ``restart.spare_wait``), and backs off before a repeated restart;
5. **burns in** each replacement node (a failed burn-in drains it; the next is tried);
6. **launches** generation g+1 on the planned nodes with a fresh rendezvous
   (its port on the new rank-0 node, alive by construction), which restores the
   newest step the whole gang can read, and returns what that launch came to: the
   controller acts on it (running; or failed, and :meth:`Recoveries.relaunch_failed`
   begins the next recovery). Nothing here calls the controller.

The incident is recorded (:mod:`supervisor.recovery.incidents`) with its phases
(detect, plan, stop, launch, restore, first step) and the work it lost once every rank of the new
generation has reported its first step. The recovery in progress is persisted
with the job: a restarted supervisor runs it again from the start (every step
above is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence, Set
from dataclasses import replace
from typing import Any

from phalanx import wire
from supervisor import gcdefer
from supervisor.actuator import Actuator, Launched
from supervisor.errors import RegistryError
from supervisor.fleet.burnin import JOIN_PROBES_S, ROUND_PROBES_S, BurnIns
from supervisor.fleet.registry import NodeState
from supervisor.jobs import Job, JobState, Waiting
from supervisor.records import Awaiting, Recovery
from supervisor.recovery import rollbacks
from supervisor.recovery.incidents import (
    Incidents,
    node_incidents,
    plan_record,
    time_ran,
    trained_steps,
)
from supervisor.recovery.intake import Report
from supervisor.recovery.planner import (
    GUARD_KINDS,
    HEALTHY,
    Action,
    CatalogView,
    Cause,
    Failure,
    FailureKind,
    JobView,
    NodeView,
    PastFailure,
    Plan,
    plan_recovery,
    plan_regrow,
)
from supervisor.recovery.sdc_watch import recheck

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # the most a recovery waits for a rank to take SIGTERM before SIGKILL
BACKOFF_MAX_S = 60.0
QUICK_FAILURE_S = 60.0  # a generation a recovery started that fails sooner is a crash loop
BURN_IN_TIMEOUT_S = 150.0  # the agent's GPU matmul check may take 120 s (agentd.burnin)
HANG_COLLECT_S = 1.5  # after a node reports a hang, how long the others get to report theirs
# ... and when it brings flight-recorder dumps: each agent waits up to 3 s for its ranks'
# (agentd.progress.FLIGHT_WAIT_S), so the others' reports may come that much later.
HANG_COLLECT_FLIGHT_S = HANG_COLLECT_S + 3.0
WAIT_POLL_S = 1.0
QUARANTINE_BY = "quarantined by job"  # a quarantine's drain reason: "... JOB: why"


class Recoveries:
    """The recoveries of failed jobs: :meth:`begin` takes a failure in, :meth:`run` (the
    job's task, which the controller runs) carries it out through ``ctl``, the actuator,
    up to the relaunch, whose :class:`~supervisor.actuator.Launched` it returns;
    ``incidents`` records each, ``burnins`` vets the nodes it restarts on."""

    def __init__(self, ctl: Actuator, incidents: Incidents, burnins: BurnIns) -> None:
        self.ctl = ctl
        self.incidents = incidents
        self.burnins = burnins
        self._wake = asyncio.Event()
        self._stopping: dict[str, asyncio.Future[Any]] = {}  # job -> its recovery's stop
        self._late_stops: set[asyncio.Future[Any]] = set()  # of jobs relaunched since
        self._stop_ended: dict[str, float] = {}  # job -> when its stop phase ended (perf)
        self._parted: dict[str, set[str]] = {}  # job -> the nodes stopped before its relaunch
        self._held: dict[str, gcdefer.Hold] = {}  # job -> its hold of the garbage collector

    def wake(self) -> None:
        """Something changed in the fleet: recoveries waiting for a node look again."""
        self._wake.set()

    # --- signals ----------------------------------------------------------------

    def begin(self, job: Job, report: Report) -> bool:
        """A failure of ``job``'s current generation (the intake's report): the job turns
        ``recovering`` and True, its recovery to run (:meth:`run`); False when the job is
        not running or starting, or recovers already (one recovery at a time)."""
        if job.state not in (JobState.RUNNING, JobState.STARTING) or job.recovery is not None:
            return False
        failure, fault_at, also = report.failure, report.fault_at, report.also
        failure = _at_restore(job, failure)
        now = time.time()
        if job.state is JobState.RUNNING and job.started_at is not None:
            # max_runtime counts every generation's run (a failed launch ran none)
            job.ran_before_s += max(0.0, (fault_at or now) - job.started_at)
        job.recovery = Recovery(
            generation=job.generation,
            failures=[failure, *also],
            fault_at=fault_at if fault_at is not None else now,
            detected_at=now,
            phase="plan",
            phases={"detect": round(max(0.0, now - (fault_at or now)), 3)},
            size=job.size(),  # of the generation it ends (an elastic job's changes)
            recheck=report.recheck,
            guard=report.guard,
        )
        job.reason = failure.describe()
        self.ctl.move(job, JobState.RECOVERING, job.reason)
        self.ctl.event(
            "job_growing" if failure.kind is FailureKind.GROW else "job_failure",
            job,
            node=failure.node,
            failure=failure.kind.value,
            rank=failure.rank,
            code=failure.code,
            signal=failure.signal,
            step=failure.step,
            detail=failure.detail,
            generation=job.generation,
        )
        return True

    # --- the recovery -----------------------------------------------------------

    async def run(self, job: Job) -> Launched | None:
        """The job's recovery, up to its relaunch (whose outcome it returns: the controller
        acts on it) or its end without one (None: failed, or cancelled meanwhile)."""
        rec = job.recovery
        if rec is None or not _recovering(job):
            return None  # cancelled before it began
        launched: Launched | None = None
        # No collection of the cyclic garbage collector until the start orders are out (at
        # 2,048 nodes one took up to 0.3 s of the second a recovery has: issue 22).
        self._held[job.id] = gcdefer.hold()
        try:
            launched = await self._run(job, rec)
            return launched
        finally:
            self._held.pop(job.id).release()
            self._stop_ended.pop(job.id, None)
            self._parted.pop(job.id, None)
            stopping = self._stopping.pop(job.id, None)
            if stopping is not None and not stopping.done():
                if launched is None:
                    stopping.cancel()  # the recovery ended early: a cancel's stop owns it
                else:
                    # Relaunched with acks of the stop still to come (each node acknowledged
                    # its start only once it had stopped the old ranks): they are logged.
                    self._late_stops.add(stopping)
                    stopping.add_done_callback(self._late_stop_done)

    def _late_stop_done(self, stopping: asyncio.Future[Any]) -> None:
        self._late_stops.discard(stopping)
        if not stopping.cancelled() and (exc := stopping.exception()) is not None:
            log.error("a relaunched job's stop failed: %r", exc)

    def close(self) -> None:
        """At shutdown: stop waiting for the late acks of relaunched jobs' stops."""
        for stopping in list(self._late_stops):
            stopping.cancel()

    async def _run(self, job: Job, rec: Recovery) -> Launched | None:
        failures = list(rec.failures)
        phases = rec.phases
        old_generation = rec.generation
        # "parted": a relaunch that follows at once stopped the nodes leaving the gang; the
        # others stop theirs at their start order.
        stopped = rec.phase not in ("plan", "parted")
        if rec.recheck is not None:  # replicas diverged with no majority: which node is at fault?
            if not stopped:
                await self._stop(job, old_generation)  # the GPUs free for the recheck
                stopped = True
            if not _recovering(job) or job.recovery is not rec:
                return None
            failures = await recheck(self.ctl, self.burnins, job, failures[0], rec.recheck)
            if not _recovering(job) or job.recovery is not rec:
                self._quarantine_rechecked(job, failures)  # cancelled meanwhile
                return None
            rec.failures = list(failures)
            rec.recheck = None
            self.ctl.save(job)
        while True:
            if not _recovering(job) or job.recovery is not rec:
                return None  # cancelled meanwhile: that stop owns the job
            if (
                time.time() - rec.detected_at
                > job.spec.restart.spare_wait
                + BACKOFF_MAX_S
                + BURN_IN_TIMEOUT_S
                + ROUND_PROBES_S
                + JOIN_PROBES_S
            ):
                self._fail(
                    job,
                    Plan(
                        Action.FAIL,
                        "no recovery within restart.spare_wait "
                        f"({job.spec.restart.spare_wait:.0f}s): "
                        f"{rec.plan.reason if rec.plan is not None else ''}",
                        Cause.SOFTWARE,
                    ),
                )
                return None
            t0 = time.perf_counter()
            plan = self.plan(job, failures)
            phases["plan"] = round(time.perf_counter() - t0, 4)
            record = plan_record(plan)
            if record != rec.plan:  # a waiting recovery plans again and again
                rec.plan = record
                self.ctl.save(job)
                self.ctl.event(
                    "recovery_planned",
                    job,
                    action=plan.action.value,
                    cause=plan.cause.value,
                    reason=plan.reason,
                    nodes=list(plan.nodes),
                    swaps=[list(s) for s in plan.swaps],
                    restore_step=plan.restore_step,
                    burn_in=list(plan.burn_in),
                    reinstate=list(plan.reinstate),
                )
            self._quarantine(job, plan, failures)
            if not stopped:
                kept = in_process_nodes(job, plan, failures)
                rec.kept = sorted(kept)  # their survivors wait, parked, for the relaunch
                if plan.action in RELAUNCHES and self._straight(job, plan):
                    await self._part(job, plan, old_generation, kept)
                else:
                    # A relaunch waits for the stop's acks only so long: at 2,048 nodes they
                    # take seconds, and each node's agent stops the old ranks before it
                    # starts the new.
                    bound = self.ctl.settings.recovery_stop_wait_s
                    await self._stop(
                        job,
                        old_generation,
                        keep=kept | self._parted.get(job.id, set()),
                        wait=bound if plan.action in RELAUNCHES else None,
                    )
                    stopped = True
            if not _recovering(job):
                return None
            if plan.action not in RELAUNCHES:
                await self._all_stopped(job)  # a burn-in, a wait or the end: the gang first
            if plan.action is Action.FAIL:
                await self._release_kept(job, plan, failures, old_generation)
                self._fail(job, plan)
                return None
            if (
                plan.action is Action.WAIT
                and plan.burn_in
                and await self._burn_in_suspects(job, plan)
            ):
                continue  # one passed: plan again, to restart on it
            if plan.action is Action.WAIT:
                if not await self._wait_for_nodes(job, plan):
                    return None
                continue
            job.waiting = None
            if plan.action not in FREE and not await self._backoff(job, plan):
                return None  # (a rollback spends its own budget, guard.max_rollbacks)
            if not await self._burn_in_swaps(job, plan):
                continue  # a replacement failed its burn-in: plan again without it
            if not self._reinstate(job, plan):
                continue  # a suspect could not be undrained: plan again without it
            if not _recovering(job) or job.recovery is not rec:
                return None
            plan = self.plan(job, failures)  # the fleet may have moved while we waited
            if plan.action in RELAUNCHES and all(
                self.burnins.passed(b) and self._joins(job, plan, b) for _, b in plan.swaps
            ):
                break
        if not stopped:  # the nodes this plan leaves out, if the one parted before kept them
            await self._part(job, plan, old_generation, frozenset(rec.kept or ()))
        rec.plan = plan_record(plan)
        await self._release_kept(job, plan, failures, old_generation)
        return await self._relaunch(job, plan)

    async def _release_kept(
        self, job: Job, plan: Plan, failures: list[Failure], old_generation: int
    ) -> None:
        """The nodes whose survivors were left parked for an in-process restart, stopped
        where the plan that goes ahead is not one (it changed while the recovery waited:
        a shrink, a failure) or leaves them out of the gang."""
        rec = job.recovery
        kept = set(rec.kept or ()) if rec is not None else set()
        if not kept or rec is None:
            return
        still = in_process_nodes(job, plan, failures) if plan.action is not Action.FAIL else set()
        if kept - still:
            await self._stop_gang(job, old_generation, skip=set(job.nodes) - (kept - still))
        rec.kept = sorted(kept & still)

    def _straight(self, job: Job, plan: Plan) -> bool:
        """Whether ``plan``, a relaunch, follows at once: each replacement
        burned in (a burn-in takes minutes), no backoff to wait out. Its link probe (two
        round trips) it may still need. A rollback stops the gang first all the same: its
        ranks trained on bad data, and must save no more of it; so does an elastic job's
        shrink or growth: every rank's share of the data changes with the size, and the
        old size's ranks must train and save no more of theirs."""
        if plan.action not in STRAIGHT_ACTIONS:
            return False
        if not all(self.burnins.passed(b) for _, b in plan.swaps):
            return False
        return self._backoff_delay(job, plan) <= 0

    async def _part(self, job: Job, plan: Plan, old_generation: int, kept: Set[str]) -> None:
        """Before a relaunch that follows at once: stop the failed generation's ranks on the
        nodes that leave the gang, without waiting for their acks. Each node that stays
        stops its old ranks at its start order (``wire.StartRanksArgs``: a start of
        generation G first stops what still runs of the generations before it). A
        replacement's link is probed meanwhile with a node that stays: the gang's
        collectives stall once a node's ranks are gone (a node lost, a leaver stopped),
        and the checkpoints' write-back goes on whatever the ranks do; waiting for that
        node's stop cost a round trip, seconds on a busy fleet (issue 22). Called again
        with a later plan, it stops only what the earlier calls did not."""
        rec = job.recovery
        assert rec is not None
        done = self._parted.setdefault(job.id, set())
        nodes = set(job.nodes) - set(plan.nodes) - set(kept) - done
        # Not saved: a supervisor restarted meanwhile runs the recovery from its plan again.
        rec.phase = "parted"
        if not nodes:  # the incident's stop phase took no time; its prepare starts here
            rec.phases.setdefault("stop", 0.0)
            self._stop_ended.setdefault(job.id, time.perf_counter())
            return
        done |= nodes
        await self._send_stops(job, old_generation, keep=set(job.nodes) - nodes, wait=0.0)

    async def _stop(
        self,
        job: Job,
        old_generation: int,
        keep: Set[str] = frozenset(),
        wait: float | None = None,
    ) -> None:
        """Stop the failed generation's gang (:meth:`_send_stops`); the recovery's phase is
        then ``stopped``, and saved."""
        await self._send_stops(job, old_generation, keep, wait)
        assert job.recovery is not None
        job.recovery.phase = "stopped"
        self.ctl.save(job)

    async def _send_stops(
        self, job: Job, old_generation: int, keep: Set[str], wait: float | None
    ) -> None:
        """Stop the failed generation's ranks on the job's nodes but ``keep`` (the
        incident's ``stop`` phase): those whose live ranks wait, parked, to be the next
        generation's (an in-process restart; their agent stops those that do not come
        back), and those stopped already (:meth:`_part`). ``wait``: go on after that many
        seconds with acks still to come (:meth:`_all_stopped` waits for them, with those
        of the recovery's earlier stops); None: wait for every ack."""
        rec = job.recovery
        assert rec is not None
        t0 = time.perf_counter()
        stopping: asyncio.Future[Any] = asyncio.ensure_future(
            self._stop_gang(job, old_generation, skip=keep)
        )
        earlier = self._stopping.get(job.id)
        if earlier is not None and not earlier.done():
            stopping = asyncio.gather(earlier, stopping)
        self._stopping[job.id] = stopping
        await asyncio.wait({stopping}, timeout=wait)
        self._stop_ended[job.id] = time.perf_counter()
        # Each stop of the recovery (a part, then the rest of the gang) adds to the phase.
        rec.phases["stop"] = round(rec.phases.get("stop", 0.0) + self._stop_ended[job.id] - t0, 3)
        if stopping.done():
            await self._all_stopped(job)
        elif wait:
            log.info(
                "job %s: generation %d's stop not acknowledged by every node within %.1f s: "
                "the relaunch goes ahead (each node stops the old ranks before it starts "
                "the new)",
                job.id,
                old_generation,
                wait,
            )

    async def _all_stopped(self, job: Job) -> None:
        """Wait for the rest of the job's recovery stop (:meth:`_stop`), if any."""
        stopping = self._stopping.pop(job.id, None)
        if stopping is not None:
            await stopping

    def _quarantine_rechecked(self, job: Job, failures: list[Failure]) -> None:
        """The recovery ended while its nodes were rechecked: those that failed are
        drained all the same (no later job lands on a GPU that computes wrong)."""
        for f in failures:
            if not f.quarantine:
                continue
            try:
                self.ctl.registry.drain(f.node, f"sdc_suspect: {f.detail}"[:900], by="supervisor")
            except RegistryError as exc:
                log.warning("job %s: node %s not drained: %s", job.id, f.node, exc)

    def _fail(self, job: Job, plan: Plan) -> None:
        self.incidents.finish(job, plan, outcome="failed")
        job.recovery = None
        job.reason = plan.reason
        job.waiting = None
        self.ctl.move(job, JobState.FAILED, plan.reason)
        self.ctl.event("job_failed", job, reason=plan.reason, generation=job.generation)

    def relaunch_failed(self, job: Job, node: str, why: str) -> bool:
        """The recovery's launch failed (a start not acknowledged, a port not found): the
        incident ends so, and a new recovery begins from it (True: :meth:`run` it),
        charged to the budget."""
        self.incidents.abandon(job, "launch_failed")
        return self.begin(
            job,
            Report(
                Failure(
                    FailureKind.RANK_EXIT,
                    node,
                    detail=f"launch failed: {why}"[:900],
                    generation=job.generation,
                )
            ),
        )

    def plan(self, job: Job, failures: list[Failure]) -> Plan:
        ctl = self.ctl
        if failures and failures[0].kind in GUARD_KINDS:
            return rollbacks.plan(ctl, job, failures[0])
        busy: set[str] = set()
        for other in ctl.jobs.values():
            if other.id != job.id and other.state.holds_nodes:
                busy.update(other.nodes)
                if other.recovery is not None and other.recovery.plan is not None:
                    busy.update(other.recovery.plan.nodes)  # held for its relaunch
        rejected = set(job.recovery.rejected or ()) if job.recovery is not None else set()
        spares = set(ctl.spares)
        if job.recovery is not None and job.recovery.plan is not None:
            # The replacements this recovery picked were spares then; the scheduling pass
            # took them out of the pool since (the job holds them) and put others in. They
            # stay this job's to take again: planning again must not move on to another
            # spare and probe it too (at 2,048 nodes, seconds: issue 22).
            spares.update(b for _, b in job.recovery.plan.swaps)
        nodes: dict[str, NodeView] = {}
        for node in ctl.registry.nodes.values():
            if node.birth is None or not node.birth.gpus:
                continue
            nodes[node.id] = NodeView(
                id=node.id,
                rack=node.birth.topology.rack,
                nvlink_domain=node.birth.topology.nvlink_domain or "",
                gpu_type=node.birth.gpus[0].model,
                gpus=len(node.birth.gpus),
                state=node.state.value,
                busy=node.id in busy,
                spare=node.id in spares,
                burned_in=not self.burnins.needs(node.id) and node.id not in rejected,
            )
        committed, where = ctl.catalog.committed_view(job.id)
        history = tuple(
            PastFailure(
                kind=f.kind,
                node=f.node,
                rank=f.rank,
                code=f.code,
                signal=f.signal,
                step=f.step,
                restored_step=i.restored_step,
                from_restore=f.from_restore,
            )
            for i in job.incidents
            for f in i.failures[:1]
            if f.kind is not FailureKind.GROW  # no failure
        )
        detected = job.recovery.detected_at if job.recovery else time.time()
        for f in failures:  # back after a clean shutdown (an upgrade): burn it in to reuse it
            known = ctl.registry.nodes.get(f.node)
            if f.kind in (FailureKind.GROW, FailureKind.SDC):
                continue  # no node failed (GROW), or the recheck burned it in (SDC)
            if not f.quarantine and known is not None and known.state is NodeState.UP:
                self.burnins.start(f.node)
        cleared = frozenset(n for n in job.nodes if self.burnins.passed_since(n, detected))
        rec = job.recovery
        quarantined = (rec.quarantined or []) if rec is not None else []
        vetted = (rec.vetted or []) if rec is not None else []
        view = JobView(
            id=job.id,
            nodes=tuple(job.nodes),
            ranks_per_node=job.spec.ranks_per_node,
            gpu_type=job.spec.gpu_type,
            max_restarts=job.spec.restart.max_restarts,
            restarts_used=job.restarts,
            use_spares=job.spec.restart.use_spares,
            history=history,
            cleared=cleared,
            quarantined=frozenset(n for n in quarantined if self._ours(job, n)),
            vetted=frozenset(vetted),
            sizes=tuple(job.spec.elastic_sizes()) if job.spec.elastic is not None else (),
            shrink_first=job.spec.elastic is not None and job.spec.elastic.prefer == "shrink",
            shrink_blocked=shrink_blocked(job),
            replicated=job.spec.reshapes,
            reshards=job.spec.reshards,
        )
        if failures and failures[0].kind is FailureKind.GROW:
            sick = [n for n in job.nodes if n not in nodes or nodes[n].state not in HEALTHY]
            if not sick:
                return plan_regrow(view, nodes, CatalogView(committed, where))
            # A node of its own failed while it was to grow (that failure, reported
            # during the grow, was not taken): recover from it instead.
            failures = [
                Failure(
                    FailureKind.NODE_OFFLINE
                    if n not in nodes or nodes[n].state == "offline"
                    else FailureKind.NODE_DRAIN,
                    n,
                    generation=job.generation,
                )
                for n in sick
            ]
        return plan_recovery(
            view,
            failures,
            nodes,
            CatalogView(committed, where),
            now=time.time(),
            node_incidents=node_incidents(ctl.jobs.values()),
        )

    def grow_plan(self, job: Job) -> Plan | None:
        """Whether the job, a shrunk elastic one, can grow back now (rule 7)."""
        if len(job.nodes) >= job.spec.nodes or not job.spec.resizes:
            return None
        plan = self.plan(job, [Failure(FailureKind.GROW, job.nodes[0], quarantine=False)])
        return plan if plan.action is Action.GROW else None

    async def _stop_gang(self, job: Job, generation: int, skip: Set[str] = frozenset()) -> None:
        """Stop the generation's ranks on every node still reachable but ``skip``; RAM
        tiers stay."""
        grace = min(job.spec.grace_period, STOP_GRACE_S)
        args = wire.StopRanksArgs(
            job=job.id,
            generation=max(generation, 1),
            grace_s=grace,
            reason=f"recovering: {job.reason}",
            keep_warm=True,  # the next generation's ranks start from them
        )
        targets = self.ctl.reachable(n for n in job.nodes if n not in skip)
        timeout = grace + self.ctl.settings.command_timeout_s
        results = await self.ctl.command_gang(targets, args, timeout)
        for node, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                # Its ranks are fenced anyway: the next generation has its own rendezvous
                # port, and the catalog takes no landing of an older generation's save.
                log.warning(
                    "job %s: node %s did not acknowledge the recovery stop: %s",
                    job.id,
                    node,
                    result,
                )

    def _quarantine(self, job: Job, plan: Plan, failures: list[Failure]) -> None:
        """Drain the plan's failed nodes, once per recovery (an operator's undrain after
        that is theirs to make)."""
        why = "; ".join(f.describe() for f in failures)
        assert job.recovery is not None
        if job.recovery.quarantined is None:
            job.recovery.quarantined = []
        done = job.recovery.quarantined
        registry = self.ctl.registry
        nodes = registry.nodes
        # Nodes gone together by their wills are a broker or network event, not that many
        # failed machines (2,048 nodes: a broker restart quarantined 1,908, issue 22):
        # the plan moves off them, but they are not drained for it. Each is judged by
        # when it went (Registry.mass_offline), so failures minutes apart are not.
        willed = [
            n
            for n in plan.quarantine
            if n not in done
            and (node := nodes.get(n)) is not None
            and node.offline_cause == "last will"
            and registry.mass_offline(node)
        ]
        if willed:
            log.warning(
                "job %s: %d of its nodes went offline by their last wills with many others "
                "(a broker or network event, not that many failed nodes): not quarantined",
                job.id,
                len(willed),
            )
            self.ctl.event("quarantine_skipped", job, nodes=len(willed), cause="last will")
            done.extend(willed)
        for node_id in plan.quarantine:
            node = nodes.get(node_id)
            if node is None or node_id in done:
                continue
            done.append(node_id)
            try:
                self.ctl.registry.drain(
                    node_id, f"{QUARANTINE_BY} {job.id}: {why}", by="supervisor"
                )
            except RegistryError as exc:
                log.warning("job %s: could not quarantine node %s: %s", job.id, node_id, exc)
                continue
            self.ctl.event("node_quarantined", job, node=node_id, reason=why)

    def _ours(self, job: Job, node_id: str) -> bool:
        """``node_id`` is drained by this job's quarantine and for nothing else."""
        node = self.ctl.registry.nodes.get(node_id)
        return (
            node is not None
            and node.drain is not None
            and node.drain.by == "supervisor"
            and node.drain.reason.startswith(f"{QUARANTINE_BY} {job.id}:")
            and node.health.status is not wire.HealthStatus.DRAIN
        )

    async def _burn_in_suspects(self, job: Job, plan: Plan) -> bool:
        """Burn in, once per recovery, each suspect node the plan names (quarantined on
        evidence that looks like software, no replacement); True when one passed."""
        rec = job.recovery
        assert rec is not None
        if rec.suspects_tried is None:
            rec.suspects_tried = []
        if rec.vetted is None:
            rec.vetted = []
        tried, vetted = rec.suspects_tried, rec.vetted
        passed_any = False
        for node in plan.burn_in:
            if node in tried:
                continue
            tried.append(node)
            passed, why = await self.burnins.run(node)
            self.ctl.event("suspect_burned_in", job, node=node, passed=passed, reason=why)
            if passed:
                vetted.append(node)
                passed_any = True
            self.ctl.save(job)
        return passed_any and _recovering(job)

    def _reinstate(self, job: Job, plan: Plan) -> bool:
        """Undrain the suspects the gang restarts on (they passed their burn-in); False
        when one cannot be (its health now says drain): it is no longer vetted."""
        rec = job.recovery
        assert rec is not None
        for node_id in plan.reinstate:
            node = self.ctl.registry.nodes.get(node_id)
            if node is None or node.drain is None:
                continue  # undrained already
            try:
                if not self._ours(job, node_id):
                    raise RegistryError(f"drained since for another reason: {node.drain.reason}")
                self.ctl.registry.undrain(node_id)
                self.burnins.reinstated(node_id)  # its pass stands: no second burn-in
            except RegistryError as exc:
                log.warning("job %s: node %s not reinstated: %s", job.id, node_id, exc)
                rec.vetted = [n for n in rec.vetted or () if n != node_id]
                self.ctl.save(job)
                return False
            self.ctl.event(
                "node_reinstated",
                job,
                node=node_id,
                reason="quarantined on evidence that looks like software, passed its "
                "burn-in, and no other node can take its ranks",
            )
        return True

    async def _wait_for_nodes(self, job: Job, plan: Plan) -> bool:
        """Wait until the fleet changes; False when ``spare_wait`` ran out (job failed)."""
        rec = job.recovery
        assert rec is not None
        if rec.wait_since is None:
            rec.wait_since = time.time()
        since = rec.wait_since
        waiting = Waiting("no_spare", plan.reason)
        if job.waiting != waiting:
            job.waiting = waiting
            self.ctl.save(job)
            self.ctl.event("recovery_waiting", job, reason=plan.reason)
        left = since + job.spec.restart.spare_wait - time.time()
        if left <= 0:
            why = (
                f"no spare or healthy node within restart.spare_wait "
                f"({job.spec.restart.spare_wait:.0f}s): {plan.reason}"
            )
            self._fail(job, Plan(Action.FAIL, why, plan.cause))
            return False
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), min(left, WAIT_POLL_S))
        return job.state is JobState.RECOVERING

    async def _backoff(self, job: Job, plan: Plan) -> bool:
        """Wait before restarting a generation that a recovery started and that failed
        again within ``QUICK_FAILURE_S`` without training a step: ``restart.backoff``,
        doubling with each such failure in a row (a crash loop), at most
        ``BACKOFF_MAX_S``. Not after a hardware failure (:meth:`_backoff_delay`)."""
        assert job.recovery is not None
        delay = self._backoff_delay(job, plan)
        if delay <= 0:
            return True
        job.recovery.backoff_s = delay
        self.ctl.save(job)
        await asyncio.sleep(delay)
        return job.state is JobState.RECOVERING

    def _backoff_delay(self, job: Job, plan: Plan) -> float:
        """The wait before the relaunch; none when the plan blames the hardware: a crash
        loop is the code's, and a failed node is quarantined and replaced at once. (Whether
        the failed generation trained a step is known from its ranks' exits: after a node
        lost or drained, none have come before a relaunch that follows at once.)"""
        assert job.recovery is not None
        if plan.cause is Cause.HARDWARE:
            return 0.0
        ran = time_ran(job, job.recovery.fault_at)
        trained = trained_steps(job.progress.get(str(job.recovery.generation)))
        return backoff_delay(
            [loop_ran(i.ran_s, i.trained_steps) for i in job.incidents],
            loop_ran(ran, trained),
            job.spec.restart.backoff,
        )

    async def _burn_in_swaps(self, job: Job, plan: Plan) -> bool:
        """Each replacement of the plan burned in and its link from a node of the job that
        stays probed (``BurnIns.screen_join``); False when one failed either (it is left
        out of this recovery: plan again)."""
        joining = {spare for _, spare in plan.swaps}
        staying = [n for n in plan.nodes if n not in joining]
        for failed, spare in plan.swaps:
            passed, why = True, ""
            if not self.burnins.passed(spare):
                passed, why = await self.burnins.run(spare)
            if passed and staying and not self._linked(job, spare):
                # Its link with one node of the job; a bad one, with a second too: the
                # first node's own link (or agent) may be the one at fault.
                for peer in staying[:2]:
                    passed, why = await self.burnins.screen_join(spare, peer)
                    if passed:
                        break
                if passed and job.recovery is not None:
                    job.recovery.linked = [*(job.recovery.linked or ()), spare]
            if not passed:
                self.ctl.event("spare_rejected", job, node=spare, replacing=failed, reason=why)
                if job.recovery is not None:  # not again in this recovery (drained, or mute)
                    job.recovery.rejected = [*(job.recovery.rejected or ()), spare]
                return False
        return True

    def _joins(self, job: Job, plan: Plan, spare: str) -> bool:
        """Whether nothing is left to probe before ``spare`` joins: its link passed, or
        there is no link to probe (probes off, or no node of the job stays)."""
        if not self.burnins.screening.probe_bytes or self._linked(job, spare):
            return True
        joining = {b for _, b in plan.swaps}
        return all(n in joining for n in plan.nodes)

    def _linked(self, job: Job, spare: str) -> bool:
        """Whether ``spare``'s link to the job was probed and passed in this recovery."""
        return job.recovery is not None and spare in (job.recovery.linked or ())

    async def _relaunch(self, job: Job, plan: Plan) -> Launched | None:
        rec = job.recovery
        if rec is None or not _recovering(job):
            return None
        parted = rec.phase == "parted"  # the nodes that stay stop the old ranks at the start
        if plan.action is Action.ROLLBACK:
            rollbacks.apply(self.ctl, job, plan)
        elif rec.failures[0].kind is FailureKind.GROW:
            pass  # growing back is no failure: it spends no restart
        elif not rec.restart_counted:  # a relaunch run again after a restart: once
            job.restarts += 1
            rec.restart_counted = True
        rec.awaiting = Awaiting()
        rec.phase = "launch"
        rec.launch_started_at = time.time()
        if (ended := self._stop_ended.pop(job.id, None)) is not None:
            # From the stop to the launch: the quarantine, a backoff, a wait for a node, the
            # replacements' burn-in and link probe (at 4,096 nodes, seconds: issue 22).
            rec.phases["prepare"] = round(time.perf_counter() - ended, 3)
        rec.restored_step = plan.restore_step
        # Saved with the launch's move to starting, before any order goes out (a 16,384-rank
        # job's record is 2 MB: one save less on the way to the starts).
        self.ctl.event(
            "job_recovering",
            job,
            action=plan.action.value,
            reason=plan.reason,
            restart=job.restarts,
            restore_step=plan.restore_step,
            swaps=[list(s) for s in plan.swaps],
            skip=list(plan.skip) if plan.skip is not None else None,
        )
        # A node still stopping the old ranks (its stop's ack to come, or none sent: the
        # start stops them) acknowledges its start once they are gone.
        late = STOP_GRACE_S if job.id in self._stopping or parted else 0.0
        held = self._held.get(job.id)
        return await self.ctl.launch(
            job,
            list(plan.nodes),
            ack_grace_s=late,
            on_issued=held.release if held is not None else None,
        )


RELAUNCHES = frozenset(
    {Action.RESTART_IN_PLACE, Action.REPLACE, Action.ROLLBACK, Action.SHRINK, Action.GROW}
)
FREE = frozenset({Action.ROLLBACK, Action.GROW})  # no backoff before them
# Relaunches that may follow at once, the nodes that stay stopping the old ranks at their
# start (Recoveries._straight).
STRAIGHT_ACTIONS = frozenset({Action.RESTART_IN_PLACE, Action.REPLACE})


IN_PROCESS_ACTIONS = frozenset({Action.RESTART_IN_PLACE, Action.REPLACE})


def in_process_nodes(job: Job, plan: Plan, failures: Sequence[Failure]) -> frozenset[str]:
    """The nodes whose live ranks a recovery leaves running for an in-process restart
    (``restart.in_process``): a rank exited, and the next generation keeps the gang's
    ranks on those nodes (in place, or with a failed node's ranks moved to a spare).
    A hang, a drain, a rollback: every rank is stopped as usual."""
    if (
        not job.spec.restart.in_process
        or plan.action not in IN_PROCESS_ACTIONS
        or any(f.kind is not FailureKind.RANK_EXIT for f in failures)
    ):
        return frozenset()
    return frozenset(plan.nodes) & frozenset(job.nodes)


def shrink_blocked(job: Job) -> str:
    """Why an elastic job may not shrink ("": it may)."""
    e = job.spec.elastic
    if e is not None and e.state == "sharded" and not e.reshard:
        return (
            "elastic.state is sharded (each rank holds its own part of the state) and "
            "the job does not reshard it (elastic.reshard): it waits for a node instead"
        )
    return ""


def loop_ran(ran: float | None, trained: int | None) -> float | None:
    """How long a failed generation ran, as the crash-loop rule counts it: one that trained
    a step (past the first it reported) made progress and is no crash loop, however soon
    it failed (None, as a time not known): with a failure a minute, each generation
    trains nearly a minute, and waiting before its restart would only lose more. A job
    that keeps failing that way is ended by its restart budget or the same-step rule."""
    return None if trained else ran


def backoff_delay(ran_before: list[float | None], ran_now: float | None, base: float) -> float:
    """Seconds to wait before a restart. ``ran_before``: how long each generation that
    failed before ran (oldest first), ``ran_now`` the one failing now. The first failure
    and any after a generation that ran ``QUICK_FAILURE_S`` or longer restart at once;
    each quick failure in a row after a recovery doubles the wait from ``base``."""
    if base <= 0 or not ran_before or ran_now is None or ran_now >= QUICK_FAILURE_S:
        return 0.0
    streak = 1
    for ran in reversed(ran_before[1:]):  # the first generation was no recovery's
        if ran is None or ran >= QUICK_FAILURE_S:
            break
        streak += 1
    return float(min(BACKOFF_MAX_S, base * 2 ** (streak - 1)))


def _at_restore(job: Job, failure: Failure) -> Failure:
    """A rank that exited before reporting any step of a generation that restored step S
    failed at S (so the same-step rule sees a crash that comes before the first step),
    when the job reports steps at all (an earlier generation did)."""
    if failure.kind is not FailureKind.RANK_EXIT or failure.step is not None:
        return failure
    if failure.from_restore is not None or str(failure.generation) in job.progress:
        return failure
    last = job.incidents[-1] if job.incidents else None
    if last is None or last.next_generation != failure.generation:
        return failure
    restored = last.restored_step
    if restored is None or not any(int(g) < failure.generation for g in job.progress):
        return failure
    return replace(failure, from_restore=int(restored))


def _recovering(job: Job) -> bool:
    return job.state is JobState.RECOVERING


__all__ = ["HANG_COLLECT_S", "Recoveries", "backoff_delay", "loop_ran"]
