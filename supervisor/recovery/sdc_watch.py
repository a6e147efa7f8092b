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
from supervisor.actuator import JobControl
from supervisor.jobs import Job, JobState
from supervisor.recovery.planner import Failure, FailureKind
from supervisor.recovery.rollback import void
from supervisor.recovery.rollbacks import OnFailure
from supervisor.recovery.sdc import DigestBoard, Verdict

log = logging.getLogger(__name__)


class SdcWatch:
    def __init__(self, ctl: JobControl, on_failure: OnFailure) -> None:
        self.ctl = ctl
        self._on_failure = on_failure
        self._boards: dict[str, DigestBoard] = {}

    def on_digest(self, job: Job, ev: wire.RankEvent) -> None:
        """A ``digest`` event of the job's current generation."""
        if job.spec.sdc is None or ev.digest is None or ev.step is None:
            return
        board = self._boards.get(job.id)
        if board is None or board.generation != job.generation:
            groups = job.spec.sdc.replica_groups(job.world_size)
            board = self._boards[job.id] = DigestBoard(groups, job.generation)
        verdict = board.see(ev.rank, ev.step, ev.digest)
        if verdict is None:
            return
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
            return
        if not verdict.odd:
            log.error(
                "job %s: the replicas' parameter digests of step %d differ with no majority: "
                "rechecking their nodes",
                job.id,
                verdict.step,
            )
            self._void_after(job, verdict.clean_upto)
            self.ctl.spawn(job, self._recheck(job, verdict, nodes, fault_at=ev.at))
            return
        rank = verdict.odd[0]
        node = nodes.get(rank)
        if node is None:
            return
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
        self._on_failure(job, failure, fault_at=ev.at)

    async def _recheck(
        self, job: Job, verdict: Verdict, nodes: dict[int, str], *, fault_at: float
    ) -> None:
        """Recheck the diverged group's nodes; recover the job without those that fail
        (or, none failing, in place from the newest clean step)."""
        generation = job.generation
        suspects = sorted({nodes[r] for r in verdict.group if r in nodes})
        results = await asyncio.gather(*(self.ctl.burnins.recheck(n) for n in suspects))
        checked = dict(zip(suspects, results, strict=True))
        self.ctl.event(
            "sdc_rechecked",
            job,
            generation=generation,
            step=verdict.step,
            nodes={n: {"passed": ok, "reason": why} for n, (ok, why) in checked.items()},
        )
        if job.generation != generation or job.state is not JobState.RUNNING:
            return  # recovered or ended meanwhile: that recovery restores a clean step too
        if job.recovery is not None:
            return
        rank_on = {n: min(r for r in verdict.group if nodes.get(r) == n) for n in suspects}
        failed = [
            self._failure(job, verdict, node, rank_on[node], why)
            for node, (ok, why) in checked.items()
            if ok is False
        ]
        if failed:
            self._on_failure(job, failed[0], fault_at=fault_at, also=failed[1:])
            return
        unknown = [f"{n}: {why}" for n, (ok, why) in checked.items() if ok is None]
        node = suspects[0]
        transient = replace(
            self._failure(job, verdict, node, rank_on[node], "; ".join(unknown)),
            quarantine=False,
        )
        self._on_failure(job, transient, fault_at=fault_at)

    @staticmethod
    def _failure(job: Job, verdict: Verdict, node: str, rank: int, why: str) -> Failure:
        return Failure(
            FailureKind.SDC,
            node,
            rank=rank,
            step=verdict.step,
            detail=(
                f"the {len(verdict.group)} replicas' parameter digests after step "
                f"{verdict.step} differ with no majority"
                + (f"; {why}" if why else "")
                + f"; the newest clean checkpoint is step {verdict.clean_upto}"
            ),
            generation=job.generation,
            onset=verdict.agreed,
        )

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
        dropped = void(((s, t) for s, t, _ in self.ctl.store.commits(job.id)), job.rollbacks)
        with self.ctl.store.batch():
            for step, tier in dropped:
                self.ctl.store.drop_step(job.id, step, tier)
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
