"""What the controller tells a gang's nodes: each node's start order (its ranks, the
rendezvous, its checkpoint tiers and buddy), and the save asked of a job before it
is preempted."""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import SecretStr

from phalanx import wire
from phalanx.jobspec import FromFile
from supervisor.catalog import pick_buddies
from supervisor.control import JobControl
from supervisor.jobs import Job
from supervisor.mtbf import NodeMtbf, node_mtbf

log = logging.getLogger(__name__)


class GangOrders:
    def __init__(self, ctl: JobControl) -> None:
        self.ctl = ctl
        self._mtbf: tuple[float, NodeMtbf] | None = None  # (monotonic time, the fleet's)

    def start_args(self, job: Job, group_rank: int, node: str) -> wire.StartRanksArgs:
        spec = job.spec
        env: dict[str, str | wire.EnvFromFile] = {
            k: wire.EnvFromFile(from_file=str(v.from_file)) if isinstance(v, FromFile) else v
            for k, v in spec.env.items()
        }
        return wire.StartRanksArgs(
            job=job.id,
            generation=job.generation,
            command=spec.command,
            workdir=spec.workdir,
            env=env,
            world_size=spec.world_size,
            group_rank=group_rank,
            master_addr=job.master_addr or "",
            master_port=job.master_port or 1,
            ranks=[
                wire.RankSlot(rank=r.rank, local_rank=r.local_rank)
                for r in job.ranks
                if r.node == node
            ],
            grace_s=spec.grace_period,
            ckpt=self.ckpt_plan(job, node),
            hang_timeout_s=spec.restart.hang_timeout,
        )

    def ckpt_plan(self, job: Job, node: str) -> wire.CkptPlan:
        """The job's checkpoint tiers for one node, with the buddy its peer copies go to
        and that node's credential there (this plan goes to ``node`` alone)."""
        spec = job.spec.checkpoint
        racks = {}
        for n in job.nodes:
            known = self.ctl.registry.nodes.get(n)
            racks[n] = known.birth.topology.rack if known and known.birth else ""
        buddy = None
        name = pick_buddies(job.nodes, racks).get(node) if "peer" in spec.tiers else None
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

    async def preempt(self, job: Job) -> None:
        """Checkpoint a preempted job first: its ranks are asked to save at their next step
        (``save_now``), and the stop waits, within the grace period, for that save to be
        committed at the nearest tier any node can restore from; then it stops. A job
        that never committed a checkpoint is stopped at once."""
        tiers = job.spec.checkpoint.tiers
        tier = next((t for t in ("peer", "object", "nvme", "ram") if t in tiers), None)
        commits = self.ctl.store.commits(job.id)
        if not commits and not self.ctl.store.ever_committed(job.id):
            await self.ctl.stop(job)  # it never checkpointed: nothing to wait for
            return
        before = max((s for s, t, _ in commits if t == tier), default=-1)
        args = wire.SaveNowArgs(job=job.id, generation=max(job.generation, 1))
        timeout = self.ctl.settings.command_timeout_s
        acks = await asyncio.gather(
            *(self.ctl.command(n, args, timeout=timeout) for n in job.nodes), return_exceptions=True
        )
        asked = any(
            not isinstance(a, BaseException)
            and a.status == wire.AckStatus.DONE
            and a.result.get("ranks")
            for a in acks
        )
        saved = None
        deadline = time.monotonic() + job.spec.grace_period
        while asked and time.monotonic() < deadline:
            newest = max((s for s, t, _ in self.ctl.store.commits(job.id) if t == tier), default=-1)
            if newest > before:
                saved = newest
                break
            await asyncio.sleep(0.2)
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
        await self.ctl.stop(job)
