"""Recovery: a failed rank, GPU or node costs seconds, not the run.

The controller hands every failure signal of a running job here
(:meth:`Recoveries.on_failure`): a rank that exited badly or was lost, a
node of the gang that turned ``drain`` or went offline, a gang whose steps
stopped. The job turns ``recovering`` and one task per job then:

1. **plans** with the pure planner (:func:`supervisor.planner.plan_recovery`)
   from the fleet, the spare pool, the checkpoint catalog and the job's history;
2. **stops** the gang's ranks everywhere (each node keeps the job's RAM tier);
3. **quarantines** a failed node: drained, with the failure as the reason;
4. **waits** for a spare or a healthy node when there is none (bounded by
   ``restart.spare_wait``), and backs off before a repeated restart;
5. **burns in** each replacement node (a failed burn-in drains it; the next is tried);
6. **launches** generation g+1 on the planned nodes with a fresh rendezvous
   (its port on the new rank-0 node, alive by construction), which restores the
   newest step the whole gang can read.

The incident is recorded (:mod:`supervisor.incidents`) with its phases (detect, plan, stop, launch,
restore, first step) and the work it lost once every rank of the new
generation has reported its first step. The recovery in progress is persisted
with the job: a restarted supervisor runs it again from the start (every step
above is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict
from typing import Any

from phalanx import wire
from supervisor.control import JobControl
from supervisor.errors import RegistryError
from supervisor.incidents import Incidents, node_incidents, plan_record, time_ran
from supervisor.jobs import Job, JobState
from supervisor.planner import (
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
)
from supervisor.registry import NodeState

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # the most a recovery waits for a rank to take SIGTERM before SIGKILL
BACKOFF_MAX_S = 60.0
QUICK_FAILURE_S = 60.0  # a generation a recovery started that fails sooner is a crash loop
BURN_IN_TIMEOUT_S = 150.0  # the agent's GPU matmul check may take 120 s (agentd.burnin)
HANG_COLLECT_S = 1.5  # after a node reports a hang, how long the others get to report theirs
WAIT_POLL_S = 1.0


class Recoveries:
    """One recovery task per failed job, run through ``ctl``; ``incidents`` records each."""

    def __init__(self, ctl: JobControl, incidents: Incidents) -> None:
        self.ctl = ctl
        self.incidents = incidents
        self._wake = asyncio.Event()
        self._hangs: dict[tuple[str, int], list[wire.RankEvent]] = {}

    def wake(self) -> None:
        """Something changed in the fleet: recoveries waiting for a node look again."""
        self._wake.set()

    # --- signals ----------------------------------------------------------------

    def on_failure(self, job: Job, failure: Failure, *, fault_at: float | None = None) -> None:
        """A failure of ``job``'s current generation: start its recovery (once)."""
        if job.state not in (JobState.RUNNING, JobState.STARTING) or job.recovery is not None:
            return
        now = time.time()
        if job.state is JobState.RUNNING and job.started_at is not None:
            # max_runtime counts every generation's run (a failed launch ran none)
            job.ran_before_s += max(0.0, (fault_at or now) - job.started_at)
        job.recovery = {
            "generation": job.generation,
            "failures": [_failure_record(failure)],
            "fault_at": fault_at if fault_at is not None else now,
            "detected_at": now,
            "phase": "plan",
            "phases": {"detect": round(max(0.0, now - (fault_at or now)), 3)},
        }
        job.reason = failure.describe()
        self.ctl.move(job, JobState.RECOVERING, job.reason)
        self.ctl.event(
            "job_failure",
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
        self.ctl.spawn(job, self.run(job))

    def on_hang(self, job: Job, ev: wire.RankEvent) -> None:
        """A node reports its ranks of the job hung: wait a moment for the other nodes'
        reports, then name the culprit from all of them."""
        key = (job.id, ev.generation)
        first = key not in self._hangs
        self._hangs.setdefault(key, []).append(ev)
        if first:
            asyncio.get_running_loop().call_later(HANG_COLLECT_S, self._hang_decided, key)

    def _hang_decided(self, key: tuple[str, int]) -> None:
        reports = self._hangs.pop(key, [])
        job = self.ctl.jobs.get(key[0])
        if not reports or job is None or job.generation != key[1]:
            return
        if any(r.clean for r in job.ranks):
            return  # a rank finished: the others wait for it at the end, they are not hung
        # A stopped process first, then the rank furthest behind, then the longest silent.
        culprit = min(
            reports,
            key=lambda e: (not e.stopped, e.step if e.step is not None else -1, -(e.idle_s or 0.0)),
        )
        idle = max(e.idle_s or 0.0 for e in reports)
        failure = Failure(
            FailureKind.HANG,
            culprit.node,
            rank=culprit.rank,
            step=culprit.step,
            detail=f"no step for {idle:.1f}s; {culprit.detail}".strip("; "),
            generation=key[1],
        )
        if culprit.dumps:
            self.ctl.event("hang_dumps", job, node=culprit.node, dumps=culprit.dumps)
        self.on_failure(job, failure, fault_at=time.time() - idle)

    # --- the recovery -----------------------------------------------------------

    async def run(self, job: Job) -> None:
        rec = job.recovery
        if rec is None or not _recovering(job):
            return  # cancelled before it began
        failures = [_failure(f) for f in rec["failures"]]
        phases: dict[str, float] = rec.setdefault("phases", {})
        old_generation = int(rec["generation"])
        stopped = rec.get("phase") not in (None, "plan")
        while True:
            if not _recovering(job) or job.recovery is not rec:
                return  # cancelled meanwhile: that stop owns the job
            if (
                time.time() - rec["detected_at"]
                > job.spec.restart.spare_wait + BACKOFF_MAX_S + BURN_IN_TIMEOUT_S
            ):
                self._fail(
                    job,
                    Plan(
                        Action.FAIL,
                        "no recovery within restart.spare_wait "
                        f"({job.spec.restart.spare_wait:.0f}s): "
                        f"{rec.get('plan', {}).get('reason', '')}",
                        Cause.SOFTWARE,
                    ),
                )
                return
            t0 = time.perf_counter()
            plan = self.plan(job, failures)
            phases["plan"] = round(time.perf_counter() - t0, 4)
            record = plan_record(plan)
            if record != rec.get("plan"):  # a waiting recovery plans again and again
                rec["plan"] = record
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
                )
            self._quarantine(job, plan, failures)
            if not stopped:
                t0 = time.perf_counter()
                await self._stop_gang(job, old_generation)
                phases["stop"] = round(time.perf_counter() - t0, 3)
                rec["phase"] = "stopped"
                stopped = True
                self.ctl.save(job)
            if not _recovering(job):
                return
            if plan.action is Action.FAIL:
                self._fail(job, plan)
                return
            if plan.action is Action.WAIT:
                if not await self._wait_for_nodes(job, plan):
                    return
                continue
            job.waiting = None
            if not await self._backoff(job):
                return
            if not await self._burn_in_swaps(job, plan):
                continue  # a replacement failed its burn-in: plan again without it
            if not _recovering(job) or job.recovery is not rec:
                return
            plan = self.plan(job, failures)  # the fleet may have moved while we waited
            if plan.action in (Action.RESTART_IN_PLACE, Action.REPLACE) and all(
                self.ctl.burnins.passed(b) for _, b in plan.swaps
            ):
                break
        rec["plan"] = plan_record(plan)
        await self._relaunch(job, plan)

    def _fail(self, job: Job, plan: Plan) -> None:
        self.incidents.finish(job, plan, outcome="failed")
        job.recovery = None
        job.reason = plan.reason
        job.waiting = None
        self.ctl.move(job, JobState.FAILED, plan.reason)
        self.ctl.event("job_failed", job, reason=plan.reason, generation=job.generation)
        self.ctl.wake()

    def relaunch_failed(self, job: Job, node: str, why: str) -> None:
        """The recovery's launch failed (a start not acknowledged, a port not found): the
        incident ends so, and a new recovery starts from it, charged to the budget."""
        self.incidents.abandon(job, "launch_failed")
        self.on_failure(
            job,
            Failure(
                FailureKind.RANK_EXIT,
                node,
                detail=f"launch failed: {why}"[:900],
                generation=job.generation,
            ),
        )

    def plan(self, job: Job, failures: list[Failure]) -> Plan:
        ctl = self.ctl
        busy: set[str] = set()
        for other in ctl.jobs.values():
            if other.id != job.id and other.state.holds_nodes:
                busy.update(other.nodes)
                if other.recovery is not None:  # held for its relaunch
                    busy.update((other.recovery.get("plan") or {}).get("nodes", []))
        rejected = set((job.recovery or {}).get("rejected", []))
        spares = set(ctl.spares)
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
                burned_in=not ctl.burnins.needs(node.id) and node.id not in rejected,
            )
        committed: dict[int, dict[str, float]] = {}
        for step, tier, at in ctl.store.commits(job.id):
            committed.setdefault(step, {})[tier] = at
        where: dict[tuple[int, int, str], tuple[str, str | None]] = {}
        for step, tier, rank, node_id, holder, _n, _c in ctl.store.committed_shards(job.id):
            where[(step, rank, tier)] = (node_id, holder)
        history = tuple(
            PastFailure(
                kind=FailureKind(f["kind"]),
                node=f["node"],
                rank=f.get("rank"),
                code=f.get("code"),
                signal=f.get("signal"),
                step=f.get("step"),
                restored_step=i.get("restored_step"),
            )
            for i in job.incidents
            for f in i["failures"][:1]
        )
        detected = job.recovery["detected_at"] if job.recovery else time.time()
        for f in failures:  # back after a clean shutdown (an upgrade): burn it in to reuse it
            known = ctl.registry.nodes.get(f.node)
            if not f.quarantine and known is not None and known.state is NodeState.UP:
                ctl.burnins.start(f.node)
        cleared = frozenset(n for n in job.nodes if ctl.burnins.passed_since(n, detected))
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
        )
        return plan_recovery(
            view,
            failures,
            nodes,
            CatalogView(committed, where),
            now=time.time(),
            node_incidents=node_incidents(ctl.jobs.values()),
        )

    async def _stop_gang(self, job: Job, generation: int) -> None:
        """Stop the generation's ranks on every node still reachable; RAM tiers stay."""
        grace = min(job.spec.grace_period, STOP_GRACE_S)
        args = wire.StopRanksArgs(
            job=job.id,
            generation=max(generation, 1),
            grace_s=grace,
            reason=f"recovering: {job.reason}",
        )
        targets = [
            n
            for n in job.nodes
            if (known := self.ctl.registry.nodes.get(n)) is not None
            and known.state is not NodeState.OFFLINE
        ]
        timeout = grace + self.ctl.settings.command_timeout_s
        results = await asyncio.gather(
            *(self.ctl.command(n, args, timeout=timeout) for n in targets), return_exceptions=True
        )
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
        done = job.recovery.setdefault("quarantined", [])
        for node_id in plan.quarantine:
            node = self.ctl.registry.nodes.get(node_id)
            if node is None or node_id in done:
                continue
            done.append(node_id)
            try:
                self.ctl.registry.drain(
                    node_id, f"quarantined by job {job.id}: {why}", by="supervisor"
                )
            except RegistryError as exc:
                log.warning("job %s: could not quarantine node %s: %s", job.id, node_id, exc)
                continue
            self.ctl.event("node_quarantined", job, node=node_id, reason=why)

    async def _wait_for_nodes(self, job: Job, plan: Plan) -> bool:
        """Wait until the fleet changes; False when ``spare_wait`` ran out (job failed)."""
        rec = job.recovery
        assert rec is not None
        since = rec.setdefault("wait_since", time.time())
        waiting = {"reason": "no_spare", "detail": plan.reason}
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

    async def _backoff(self, job: Job) -> bool:
        """Wait before restarting a generation that a recovery started and that failed
        again within ``QUICK_FAILURE_S``: ``restart.backoff``, doubling with each such
        failure in a row (a crash loop), at most ``BACKOFF_MAX_S``."""
        assert job.recovery is not None
        ran = time_ran(job, job.recovery["fault_at"])
        delay = backoff_delay(
            [i.get("ran_s") for i in job.incidents], ran, job.spec.restart.backoff
        )
        if delay <= 0:
            return True
        job.recovery["backoff_s"] = delay
        self.ctl.save(job)
        await asyncio.sleep(delay)
        return job.state is JobState.RECOVERING

    async def _burn_in_swaps(self, job: Job, plan: Plan) -> bool:
        for failed, spare in plan.swaps:
            if self.ctl.burnins.passed(spare):
                continue
            passed, why = await self.ctl.burnins.run(spare)
            if not passed:
                self.ctl.event("spare_rejected", job, node=spare, replacing=failed, reason=why)
                if job.recovery is not None:  # not again in this recovery (drained, or mute)
                    job.recovery.setdefault("rejected", []).append(spare)
                return False
        return True

    async def _relaunch(self, job: Job, plan: Plan) -> None:
        rec = job.recovery
        if rec is None or not _recovering(job):
            return
        if not rec.get("restart_counted"):  # a relaunch run again after a restart: once
            job.restarts += 1
            rec["restart_counted"] = True
        rec["awaiting"] = {"restored": {}, "stepped": {}}
        rec["phase"] = "launch"
        rec["launch_started_at"] = time.time()
        rec["restored_step"] = plan.restore_step
        self.ctl.save(job)
        self.ctl.event(
            "job_recovering",
            job,
            action=plan.action.value,
            reason=plan.reason,
            restart=job.restarts,
            restore_step=plan.restore_step,
            swaps=[list(s) for s in plan.swaps],
        )
        await self.ctl.launch(job, list(plan.nodes))


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


def _recovering(job: Job) -> bool:
    return job.state is JobState.RECOVERING


def _failure_record(f: Failure) -> dict[str, Any]:
    rec = asdict(f)
    rec["kind"] = f.kind.value
    return rec


def _failure(rec: dict[str, Any]) -> Failure:
    return Failure(**{**rec, "kind": FailureKind(rec["kind"])})


__all__ = ["HANG_COLLECT_S", "Recoveries", "backoff_delay"]
