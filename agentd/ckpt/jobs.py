"""What this node knows of each job's checkpoints: its plan and newest generation (from
the start of its ranks here) and the supervisor's latest catalog of it. The service,
its commits and its restores share one ``JobBook``."""

from __future__ import annotations

import asyncio

from agentd.ckpt.errors import CkptRequestError
from agentd.ckpt.rank_stores import TIER_ORDER
from phalanx import wire

__all__ = ["DEFAULT_PLAN", "JobBook"]

DEFAULT_PLAN = wire.CkptPlan(tiers=["ram", "nvme", "object"])


class JobBook:
    """Each job's plan, generation and catalog; ``changed`` is notified when a catalog
    comes or is applied (a rank's ``wait`` and a restore wait on it). Used on the event
    loop."""

    def __init__(self) -> None:
        self.plans: dict[str, wire.CkptPlan] = {}
        self.generations: dict[str, int] = {}
        self.catalogs: dict[str, wire.CkptCatalog] = {}
        self.changed = asyncio.Condition()

    def plan(self, job: str) -> wire.CkptPlan:
        return self.plans.get(job, DEFAULT_PLAN)

    def tiers_of(self, job: str) -> list[str]:
        """The tiers the job's checkpoints go to here, nearest first (RAM always; the peer
        tier once the plan names a buddy)."""
        plan = self.plan(job)
        tiers = [t for t in TIER_ORDER if t in plan.tiers or t == "ram"]
        return [t for t in tiers if t != "peer" or plan.buddy is not None]

    def keep(self, job: str) -> dict[str, int]:
        """How many committed steps each tier keeps of the job."""
        plan = self.plan(job)
        return {t: plan.keep.get(t, 2) for t in TIER_ORDER}

    def fence(self, job: str, generation: int) -> None:
        """Refuse (409) a request of a generation older than the newest started here."""
        current = self.generations.get(job, 0)
        if generation < current:
            raise CkptRequestError(
                f"job {job}: generation {generation} is older than "
                f"generation {current} started here",
                status=409,
            )

    def forget(self, job: str, catalog: wire.CkptCatalog) -> None:
        """The job ended here (``catalog`` said so, and its RAM tier is free)."""
        if self.catalogs.get(job) is catalog:
            del self.catalogs[job]
        self.plans.pop(job, None)
        self.generations.pop(job, None)

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()
