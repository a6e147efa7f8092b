"""The supervisor's side of silent data corruption: digests in, a quarantine out.

The agents forward every rank's ``digest`` event; :class:`SdcWatch` keeps a
:class:`~supervisor.recovery.sdc.DigestBoard` per running job (in memory: a restarted
supervisor starts comparing afresh). When the replicas' digests of a step differ and a
strict majority names the odd one out, its node is the suspect: the checkpoints
committed after the newest clean step (the state of the last step whose digests all
agreed) are voided like a rollback's (forgotten, their late landings ignored), and the
job recovers from a failure of kind ``sdc`` on that node, which the planner treats as
hardware: the node is quarantined (drained, the reason starting ``sdc_suspect``) and
its ranks move to a spare, which restores the newest clean step with the others.

Without a majority (two replicas, or a split) the group's nodes are rechecked: each runs
its burn-in again, whose deterministic recompute check says whether its GPUs compute
right. The nodes that fail it are the suspects, quarantined as above; when none fails
(a transient fault) the gang restarts in place from the newest clean step, nothing
quarantined. Either way the checkpoints after that step are voided first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from phalanx import wire
from supervisor.actuator import Actuator
from supervisor.fleet.burnin import BurnIns
from supervisor.jobs import Job, JobState
from supervisor.records import Recheck
from supervisor.recovery.intake import Report
from supervisor.recovery.planner import Failure, FailureKind
from supervisor.recovery.rollback import void
from supervisor.recovery.sdc import DigestBoard, Verdict

log = logging.getLogger(__name__)


class SdcWatch:
    def __init__(self, ctl: Actuator) -> None:
        self.ctl = ctl
        self._boards: dict[str, DigestBoard] = {}

    def on_digest(self, job: Job, ev: wire.RankEvent) -> Report | None:
        """A ``digest`` event of the job's current generation: the failure it shows, if
        the replicas diverged (None: they agree, or do not know yet)."""
        if job.spec.sdc is None or ev.digest is None or ev.step is None:
            return None
        board = self._boards.get(job.id)
        if board is None or board.generation != job.generation:
            groups = job.spec.sdc.replica_groups(job.world_size)
            board = DigestBoard(groups, job.generation, floor=agreed_floor(job))
            self._boards[job.id] = board
        verdict = board.see(ev.rank, ev.step, ev.digest)
        agreed = board.agreed
        if agreed is not None and (job.sdc_agreed is None or agreed > job.sdc_agreed):
            job.sdc_agreed = agreed  # kept with the job: a later board starts from it
            self.ctl.save(job)
        if verdict is None:
            return None
        nodes = {p.rank: p.node for p in job.ranks}
        self.ctl.event(
            "sdc_diverged",
            job,
            generation=job.generation,
            step=verdict.step,
            group=list(verdict.group),
            digests={str(r): f"{d:016x}" for r, d in sorted(verdict.digests.items())},
            odd=list(verdict.odd),
            suspects=sorted({nodes[r] for r in verdict.odd if r in nodes}),
            agreed=verdict.agreed,
        )
        if job.state is not JobState.RUNNING or job.recovery is not None:
            return None
        if not verdict.odd:
            log.error(
                "job %s: the replicas' parameter digests of step %d differ with no majority: "
                "its recovery rechecks their nodes",
                job.id,
                verdict.step,
            )
            self._void_after(job, verdict.clean_upto)
            group_nodes: dict[str, int] = {}  # node -> its first rank of the group
            for r in verdict.group:
                if r in nodes:
                    group_nodes.setdefault(nodes[r], r)
            if not group_nodes:
                return None
            first = min(group_nodes)
            # Until the recheck says which node failed, the failure names none: as it
            # stands it restarts the gang in place (Recoveries.run rechecks first).
            failure = no_majority(job, verdict, first, group_nodes[first])
            plan = Recheck(
                nodes={n: group_nodes[n] for n in sorted(group_nodes)},
                replicas=len(verdict.group),
                clean=verdict.clean_upto,
            )
            return Report(failure, fault_at=ev.at, recheck=plan)
        rank = verdict.odd[0]
        node = nodes.get(rank)
        if node is None:
            return None
        self._void_after(job, verdict.clean_upto)
        failure = Failure(
            FailureKind.SDC,
            node,
            rank=rank,
            step=verdict.step,
            detail=(
                f"its parameter digest after step {verdict.step} differs from "
                f"{sum(1 for r in verdict.digests if r not in verdict.odd)} other replicas'; "
                f"the newest clean checkpoint is step {verdict.clean_upto}"
            ),
            generation=job.generation,
            onset=verdict.agreed,
        )
        return Report(failure, fault_at=ev.at)

    def _void_after(self, job: Job, clean_upto: int) -> None:
        """Forget the checkpoints after the newest clean step, and ignore their late
        landings (the rolled-back run's, as a rollback does)."""
        job.rollbacks.append(
            {
                "at": time.time(),
                "generation": job.generation,
                "after": clean_upto,
                "skip": None,
                "kind": "sdc",
            }
        )
        dropped = void(((s, t) for s, t, _ in self.ctl.catalog.rows.commits(job.id)), job.rollbacks)
        with self.ctl.store.batch():
            for step, tier in dropped:
                self.ctl.catalog.rows.drop_step(job.id, step, tier)
        self.ctl.save(job)
        self.ctl.event(
            "ckpt_voided",
            job,
            generation=job.generation,
            after=clean_upto,
            voided=[[s, t] for s, t in dropped],
        )

    def forget(self, job_id: str) -> None:
        self._boards.pop(job_id, None)


def agreed_floor(job: Job) -> int | None:
    """The newest step known to have agreed that the job's current generation may start
    its board from: the job's record (``Job.sdc_agreed``), no newer than the step the
    generation restored less one (its ranks replay the steps after it); None for a
    generation a recovery started from nothing."""
    floor = job.sdc_agreed
    for incident in reversed(job.incidents):
        if incident.next_generation == job.generation:
            restored = incident.restored_step
            if floor is None or restored is None:
                return None
            return min(floor, int(restored) - 1)
    return floor


def no_majority(job: Job, verdict: Verdict, node: str, rank: int) -> Failure:
    """The failure of a group whose digests differ with no majority, named on ``node``
    for the record only (no quarantine) until its recheck says which node failed."""
    return Failure(
        FailureKind.SDC,
        node,
        rank=rank,
        step=verdict.step,
        detail=_detail(
            len(verdict.group), verdict.step, verdict.clean_upto, "its nodes are rechecked"
        ),
        generation=job.generation,
        quarantine=False,
        onset=verdict.agreed,
    )


def _detail(replicas: int, step: int | None, clean: int, why: str) -> str:
    return (
        f"the {replicas} replicas' parameter digests after step {step} differ with no "
        f"majority; {why}; the newest clean checkpoint is step {clean}"
    )


async def recheck(
    ctl: Actuator, burnins: BurnIns, job: Job, failure: Failure, plan: Recheck
) -> list[Failure]:
    """Recheck the nodes of ``plan`` (``nodes``, node -> its rank in the diverged
    group; ``replicas``; ``clean``, the newest clean step), the gang stopped:
    each runs its burn-in again. The failures the recovery then plans from: one of kind
    ``sdc`` on each node that failed it (quarantined), or, none failing, ``failure``
    (no node to blame: a restart in place), its detail saying why."""
    nodes = plan.nodes
    names = sorted(nodes)
    results = await asyncio.gather(*(burnins.recheck(n) for n in names))
    checked = dict(zip(names, results, strict=True))
    ctl.event(
        "sdc_rechecked",
        job,
        generation=failure.generation,
        step=failure.step,
        nodes={n: {"passed": ok, "reason": why} for n, (ok, why) in checked.items()},
    )

    def detail(why: str) -> str:
        return _detail(plan.replicas, failure.step, plan.clean, why)

    failed = [
        replace(failure, node=n, rank=nodes[n], quarantine=True, detail=detail(f"it {why}"))
        for n, (ok, why) in checked.items()
        if ok is False
    ]
    if failed:
        return failed
    passed = "no node failed its recheck (a transient fault)"
    unknown = [f"{n}: {why}" for n, (ok, why) in checked.items() if ok is None]
    return [replace(failure, detail=detail("; ".join([passed, *unknown])))]
