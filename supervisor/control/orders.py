"""What the controller tells a gang's nodes: each node's start order (its ranks, the
rendezvous, its checkpoint tiers and buddy), and the save asked of a job before it
is preempted."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping, Sequence

from pydantic import SecretStr

from phalanx import wire
from phalanx.elastic import ENV_RESHARD, Elastic
from phalanx.jobspec import FromFile
from supervisor.actuator import Actuator
from supervisor.checkpoints.catalog import pick_buddies
from supervisor.fleet.mtbf import NodeMtbf, node_mtbf
from supervisor.jobs import Job
from supervisor.recovery import rollbacks

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=65536)
def _slot(rank: int, local_rank: int) -> wire.RankSlot:
    """A rank's slot in a start order, made once (a frozen message, shared by every order
    that names it): a 2,048-node launch made 16,384 of them again at every relaunch, 45 %
    of its orders' build (issue 22)."""
    return wire.RankSlot(rank=rank, local_rank=local_rank)


class GangOrders:
    def __init__(self, ctl: Actuator) -> None:
        self.ctl = ctl
        self._mtbf: tuple[float, NodeMtbf] | None = None  # (monotonic time, the fleet's)

    def start_orders(
        self, job: Job, nodes: Sequence[str], *, ckpt: bool = True
    ) -> list[wire.StartRanksArgs]:
        """Each node's start order (``nodes`` in group-rank order). What all of them share
        (the environment, the racks and buddies, the fleet's MTBF) is worked out once: per
        node it made a 2,048-node launch quadratic in the gang's size (issue 22).
        ``ckpt=False``: no checkpoint plan (no buddy, no credential), for an order that
        starts no rank (a spare's prewarm)."""
        spec = job.spec
        env: dict[str, str | wire.EnvFromFile] = {
            k: wire.EnvFromFile(from_file=str(v.from_file)) if isinstance(v, FromFile) else v
            for k, v in spec.env.items()
        }
        env.update(rollbacks.start_env(job))  # the loss guard's rule, the steps to skip
        if spec.restart.in_process:
            env["PHALANX_IN_PROCESS"] = "1"  # phalanx.rank.run parks on a peer's failure
        if spec.sdc is not None:
            env["PHALANX_DIGEST_EVERY"] = str(spec.sdc.every)
        if spec.elastic is not None:  # this generation's size: the global batch stays
            layout = Elastic.for_size(
                spec.elastic.global_batch,
                spec.elastic.micro_batch,
                job.world_size,
                spec.elastic.global_batch * (job.published_restore or 0),
            )
            env.update(layout.env())
            if spec.elastic.reshard:  # restore() refuses a step saved at another size
                env[ENV_RESHARD] = "1"
        buddies = self._buddies(job) if ckpt else {}
        warm = wire.WarmPlan(imports=list(spec.restart.warm_imports)) if spec.restart.warm else None
        # A recovery that left the survivors alive (parked by phalanx.rank.run) on some
        # of the gang's nodes: their agents resume them.
        in_process = bool(
            spec.restart.in_process and job.recovery is not None and job.recovery.kept
        )
        return [
            wire.StartRanksArgs(
                job=job.id,
                generation=job.generation,
                command=spec.command,
                workdir=spec.workdir,
                env=env,
                world_size=job.world_size,
                group_rank=group_rank,
                master_addr=job.master_addr or "",
                master_port=job.master_port or 1,
                ranks=[_slot(r.rank, r.local_rank) for r in job.places_on(node)],
                grace_s=spec.grace_period,
                ckpt=self._ckpt_plan(job, node, buddies) if ckpt else None,
                hang_timeout_s=spec.restart.hang_timeout,
                warm=warm,
                in_process=in_process,
            )
            for group_rank, node in enumerate(nodes)
        ]

    def start_args(self, job: Job, group_rank: int, node: str) -> wire.StartRanksArgs:
        """One node's start order (see :meth:`start_orders`)."""
        order = self.start_orders(job, [node])[0]
        return order.model_copy(update={"group_rank": group_rank})

    def prewarm_args(self, job: Job, node: str) -> wire.StartRanksArgs:
        """The start order of the job's ``node``, without its checkpoint plan: what a spare
        keeps warm interpreters to (it never starts a rank, and must not get ``node``'s
        credential at its buddy)."""
        return self.start_orders(job, [node], ckpt=False)[0]

    def ckpt_plan(self, job: Job, node: str) -> wire.CkptPlan:
        """The job's checkpoint tiers for one node, with the buddy its peer copies go to
        and that node's credential there (this plan goes to ``node`` alone)."""
        return self._ckpt_plan(job, node, self._buddies(job))

    def _buddies(self, job: Job) -> dict[str, str]:
        if "peer" not in job.spec.checkpoint.tiers:
            return {}
        racks = {}
        for n in job.nodes:
            known = self.ctl.registry.nodes.get(n)
            racks[n] = known.birth.topology.rack if known and known.birth else ""
        return pick_buddies(job.nodes, racks)

    def _ckpt_plan(self, job: Job, node: str, buddies: Mapping[str, str]) -> wire.CkptPlan:
        spec = job.spec.checkpoint
        buddy = None
        name = buddies.get(node)
        found = self.ctl.registry.nodes.get(name) if name else None
        if found is not None and found.birth is not None and found.birth.http_port:
            credential = self.ctl.agent_keys.peer_credential(found.id, node)
            buddy = wire.PeerAddr(
                node=found.id,
                address=found.birth.address,
                http_port=found.birth.http_port,
                token=None if credential is None else SecretStr(credential),
            )
        interval: str | float | int = "auto"
        if isinstance(spec.interval, dict):
            kind, value = next(iter(spec.interval.items()))
            interval = int(value) if kind == "steps" else float(value)
        now = time.monotonic()
        if self._mtbf is None or now - self._mtbf[0] > 60.0:  # one event-log scan a minute
            settings = self.ctl.settings
            self._mtbf = (
                now,
                node_mtbf(
                    self.ctl.store,
                    configured_s=settings.ckpt_node_mtbf_h * 3600.0,
                    min_failures=settings.ckpt_mtbf_min_failures,
                ),
            )
        mtbf = self._mtbf[1]
        return wire.CkptPlan(
            tiers=list(spec.tiers),
            keep=dict(spec.keep),
            interval=interval,
            buddy=buddy,
            mtbf_s=mtbf.for_job(len(job.nodes)),
        )

    async def save_first(self, job: Job) -> None:
        """Checkpoint a preempted job before its stop: its ranks are asked to save at their
        next step (``save_now``), also before its first checkpoint (up to a whole
        ``interval`` of work is at stake), and this waits, within the grace period, for
        that save to be committed at the nearest tier any node can restore from. Each
        node's ack lists the ranks that listen (report steps); a job none of whose ranks
        listen is stopped at once."""
        tiers = job.spec.checkpoint.tiers
        tier = next((t for t in ("peer", "object", "nvme", "ram") if t in tiers), None)
        commits = self.ctl.catalog.rows.commits(job.id)
        before = max((s for s, t, _ in commits if t == tier), default=-1)
        args = wire.SaveNowArgs(job=job.id, generation=max(job.generation, 1))
        timeout = self.ctl.settings.command_timeout_s
        acks = await self.ctl.command_gang(job.nodes, args, timeout)
        done = [
            a
            for a in acks
            if not isinstance(a, BaseException)
            and a.status == wire.AckStatus.DONE
            and a.result.get("ranks")
        ]
        asked = bool(done)
        # A rank asked after it reported step s saves after its next report: at s + 2 or
        # later (``ckpt.save(step + 1)``, docs/jobspec.md). A checkpoint already in flight
        # (s + 1 or older) commits meanwhile and is not the save asked for.
        reported = reported_steps(done)
        if reported:
            before = max(before, min(reported) + 1)
        saved = None
        deadline = time.monotonic() + job.spec.grace_period
        while asked and time.monotonic() < deadline:
            newest = max(
                (s for s, t, _ in self.ctl.catalog.rows.commits(job.id) if t == tier), default=-1
            )
            if newest > before:
                saved = newest
                break
            await asyncio.sleep(0.2)
        if not asked:
            log.info("job %s: no rank listens for a save request; stopping it at once", job.id)
        if asked:
            self.ctl.event(
                "job_preempt_checkpoint", job, step=saved, tier=tier, committed=saved is not None
            )
            if saved is None:
                log.warning(
                    "job %s: no checkpoint committed at %s within the grace period "
                    "of %.0fs before its preemption",
                    job.id,
                    tier,
                    job.spec.grace_period,
                )


def reported_steps(acks: list[wire.CommandAck]) -> list[int]:
    """The steps the asked ranks had reported when their nodes took a ``save_now`` (an
    agent's ack lists them under ``steps``; an older agent's, or garbage, lists none)."""
    found: list[int] = []
    for ack in acks:
        steps = ack.result.get("steps")
        if isinstance(steps, dict):
            found += [s for s in steps.values() if isinstance(s, int) and not isinstance(s, bool)]
    return found
