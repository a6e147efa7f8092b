"""The agent's answers to a restoring rank (``ckpt.remote`` lists the routes): which
step the gang restores from and where this rank's copies lie, nearest first; a copy
from the peer or the object store streamed, or staged in a free RAM slot of the
rank's; and the copies a rank found bad, reported to the supervisor. The answers are
``ckpt.protocol``'s models.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from agentd.ckpt.errors import CkptRequestError, copy_failed
from agentd.ckpt.jobs import JobBook
from agentd.ckpt.node_tiers import NodeTiers
from agentd.ckpt.rank_stores import TIER_ORDER, Publish, RankStore
from ckpt import (
    FormatError,
    ObjectTier,
    ShardCorrupt,
    ShardKey,
    ShardReader,
    Tier,
    TierError,
    protocol,
)
from phalanx import wire

log = logging.getLogger(__name__)

# How long a restoring rank's node waits for the catalog of the generation it started
# (``ckpt.catalog_wait_s``). The supervisor sends a generation's catalogs and its start
# orders together, and at 2,048 nodes publishing the catalogs takes seconds: a rank of a
# warm node asks at once. (A rank's request waits longer:
# ckpt.remote.AgentClient.restore_plan; the setting is at most 60 s.)
CATALOG_WAIT_S = 20.0

T = TypeVar("T")


class Restores:
    """A restoring rank's requests. ``store`` is the service's (it makes a rank's store on
    first use); ``pool`` runs what blocks (a remote tier's reads)."""

    def __init__(
        self,
        node: str,
        jobs: JobBook,
        tiers: NodeTiers,
        store: Callable[[str, int], RankStore],
        pool: concurrent.futures.Executor,
        publish: Publish,
        catalog_wait_s: float = CATALOG_WAIT_S,
    ) -> None:
        self.node = node
        self.catalog_wait_s = catalog_wait_s
        self.jobs = jobs
        self.tiers = tiers
        self.store = store
        self.pool = pool
        self.publish = publish

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _catalog_for(self, job: str) -> wire.CkptCatalog | None:
        """The job's catalog, once it is of the generation started here (the supervisor
        sends it beside the ranks' start; give a late one ``catalog_wait_s``)."""
        wanted = self.jobs.generations.get(job, 0)
        deadline = time.monotonic() + self.catalog_wait_s
        changed = self.jobs.changed
        async with changed:
            while (catalog := self.jobs.catalogs.get(job)) is None or catalog.generation < wanted:
                if catalog is None and wanted == 0:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if catalog is None:
                        raise CkptRequestError(
                            f"job {job}: no checkpoint catalog came for generation {wanted} "
                            f"within {self.catalog_wait_s:g} s: cannot tell which step the gang "
                            "restores from",
                            status=503,
                        )
                    log.warning(
                        "job %s: restoring from the catalog of generation %d: none "
                        "of generation %d came",
                        job,
                        catalog.generation,
                        wanted,
                    )
                    return catalog
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        return catalog

    async def plan(self, job: str, rank: int, step: int | None) -> protocol.RestorePlan:
        """Where rank ``rank`` can read its copy of ``step``, nearest first.

        Without a step, the step is the catalog's ``restore_step``: the one the whole gang
        restores from. A rank never picks an older one on its own; when no step is readable
        by every rank, ``unavailable`` says why."""
        try:
            catalog = await self._catalog_for(job)
        except CkptRequestError as exc:
            return protocol.RestorePlan(unavailable=str(exc))
        if catalog is None:
            return protocol.RestorePlan()
        if not catalog.steps:  # nothing committed yet, or (with a note) nothing left
            return protocol.RestorePlan(
                unavailable=f"job {job}: {catalog.restore_note}" if catalog.restore_note else None
            )
        wanted = step if step is not None else catalog.restore_step
        entries = [e for e in catalog.steps if e.step == wanted]
        if not entries:
            why = (
                f"step {step} is not committed"
                if step is not None
                else catalog.restore_note or "no committed step is readable by every rank"
            )
            return protocol.RestorePlan(unavailable=f"job {job}: {why}")
        entry = entries[0]
        asking, rank = rank, rank
        if entry.step == catalog.restore_step:  # an elastic gang of another size's
            rank = catalog.sources.get(asking, asking)
        shard = next((s for s in entry.shards if s.rank == rank), None)
        saved = entry.world_size or catalog.world_size
        if shard is None and saved != catalog.world_size and rank >= saved:
            # A gang that grew, its ranks resharding (elastic.reshard): this rank saved
            # nothing of that step; it reads the saved ranks' shards (each as that rank).
            return protocol.RestorePlan(
                steps=[protocol.RestoreStep(step=entry.step, world_size=saved)]
            )
        if shard is None:
            return protocol.RestorePlan(
                unavailable=f"job {job}: the catalog lists no shard of rank "
                f"{rank} for step {entry.step}"
            )
        store = self.store(job, rank)
        candidates = []
        for tier in TIER_ORDER:
            if tier not in entry.committed:
                continue
            path: str | None = None
            if tier == "ram":
                slot = store.ram.find(entry.step)
                if slot is None or not slot.path.exists():
                    continue
                path = str(slot.path)
            elif tier == "nvme":
                shard_path = self.tiers.disk_root / ShardKey(job, entry.step, rank).relpath()
                if not shard_path.exists():
                    continue
                path = str(shard_path)
            elif self.read_tier(job, rank, entry.step, tier) is None:
                continue
            candidates.append(
                protocol.Candidate(
                    tier=tier, path=path, checksum=shard.checksum, nbytes=shard.nbytes
                )
            )
        return protocol.RestorePlan(
            steps=[
                protocol.RestoreStep(
                    step=entry.step,
                    rank=rank if rank != asking else None,
                    candidates=candidates,
                    world_size=saved,
                )
            ]
        )

    def read_tier(self, job: str, rank: int, step: int, tier: str) -> Tier | None:
        """The tier to read rank ``rank``'s copy of ``step`` from, for ``peer`` and
        ``object``: the peer copy is read from the buddy the catalog says holds it (the
        rank may have moved since, or its node's buddy changed)."""
        store = self.store(job, rank)
        if tier == "object":
            return store.tiers.get("object") or ObjectTier(self.tiers.objects(), name="object")
        if tier != "peer":
            return None
        shard = self._catalog_shard(job, rank, step)
        if shard is None or shard.peer is None:
            return store.tiers.get("peer")
        if shard.peer.node == self.node:  # this node holds the copy a buddy pushed here
            return ObjectTier(self.tiers.peer_store, name="peer")
        return ObjectTier(self.tiers.buddy_store(shard.peer), name="peer")

    def report(self, job: str, rank: int, step: int, tier: str, error: str) -> None:
        """A rank found its copy unusable (corrupt, or gone): tell the supervisor, whose
        catalog stops offering it (the step is no longer whole at that tier)."""
        if tier not in TIER_ORDER:
            raise CkptRequestError(f"unknown tier {tier!r}")
        log.warning(
            "job %s rank %d: the copy of step %d at tier %s is unusable: %s",
            job,
            rank,
            step,
            tier,
            error,
            extra={"job": job, "event": "ckpt_corrupt"},
        )
        self.publish(
            wire.CkptLanding(
                node=self.node,
                job=job,
                step=step,
                rank=rank,
                tier=tier,
                event="corrupt",
                error=error[:2000],
                at=time.time(),
            )
        )

    def _catalog_shard(self, job: str, rank: int, step: int) -> wire.CkptShard | None:
        """What the job's catalog lists of rank ``rank``'s shard of ``step``, if anything."""
        catalog = self.jobs.catalogs.get(job)
        entry = next((e for e in catalog.steps if e.step == step), None) if catalog else None
        return next((s for s in entry.shards if s.rank == rank), None) if entry else None

    def _remote_copy(
        self, job: str, rank: int, step: int, tier: str
    ) -> tuple[ObjectTier, wire.CkptShard]:
        """The peer or object tier to read rank ``rank``'s copy of ``step`` from, and the
        catalog's entry for that shard (its size and checksum)."""
        found = self.read_tier(job, rank, step, tier) if tier in ("peer", "object") else None
        if not isinstance(found, ObjectTier):
            raise CkptRequestError(
                f"tier {tier!r} is not fetched through the agent for job {job}",
                status=404,
                tier=tier,
            )
        shard = self._catalog_shard(job, rank, step)
        if shard is None:
            raise CkptRequestError(
                f"job {job}: the catalog lists no shard of rank {rank} for step {step}",
                status=404,
                tier=tier,
                step=step,
            )
        return found, shard

    async def fetch(self, job: str, rank: int, step: int, tier: str) -> ShardReader | None:
        """Rank ``rank``'s shard of ``step`` at the peer or object tier, to stream to the
        rank in bounded pieces (never whole in memory); ``None`` when that tier has no
        copy. The size is the catalog's for that rank and step: a copy whose manifest
        says otherwise is refused here, one that runs past it while read is cut off."""
        found, shard = self._remote_copy(job, rank, step, tier)
        try:
            reader: ShardReader | None = await self._run(
                found.reader, ShardKey(job, step, rank), shard.nbytes, shard.checksum
            )
        except TierError as exc:
            raise copy_failed(exc, tier=tier, step=step) from exc
        return reader

    async def stage(
        self, job: str, generation: int, rank: int, step: int, tier: str
    ) -> protocol.StageReply:
        """Rank ``rank``'s copy of ``step`` at the peer or object tier, read into a free
        RAM slot of its own (``RamTier.stage``: verified against the catalog's checksum
        before it is sealed), for the rank to restore as a RAM copy: one copy out of
        memory already touched instead of a stream into fresh memory, and the slot's
        pages serve its next saves. ``{"path": ...}``; ``{"gone": true}`` when the tier
        has no copy; ``{"staged": false}`` when no slot is free (the rank streams the
        copy from ``/v1/ckpt/shard`` then). A copy that does not verify, or runs short or
        long, is a 502 with ``corrupt`` (the rank reports it).

        The staged copy is reported to the supervisor (``staged`` at RAM on this node, the
        catalog's checksum), so that a restart before the rank's next save reads it here
        too: the catalog counts a copy with the shards of the generation that saved it."""
        self.jobs.fence(job, generation)
        found, shard = self._remote_copy(job, rank, step, tier)
        store = self.store(job, rank)
        key = ShardKey(job, step, rank)

        class Gone(Exception):
            pass

        def fill(view: memoryview) -> None:
            reader = found.reader(key, shard.nbytes, shard.checksum)
            if reader is None:
                raise Gone
            reader.fill(view)

        before = set(store.ram.steps(job))
        try:
            slot = await self._run(store.ram.stage, key, shard.nbytes, fill, shard.checksum)
        except Gone:
            return protocol.StageReply(gone=True)
        except (ShardCorrupt, FormatError) as exc:  # UnsupportedVersion: a newer writer's
            raise copy_failed(exc, tier=tier, step=step) from exc
        except TierError as exc:
            if exc.tier == store.ram.name:  # no room for a slot (a full /dev/shm), say: the
                log.warning(
                    "job %s rank %d: cannot stage step %d in RAM, streaming it: %s",
                    job,
                    rank,
                    step,
                    exc,
                    extra={"job": job},
                )
                return protocol.StageReply(staged=False)  # copy itself is not in question
            raise copy_failed(exc, tier=tier, step=step) from exc
        finally:
            store.report_reused(before)
        if slot is None:
            return protocol.StageReply(staged=False)
        store.reporter.landed(
            store.ram.name, key, shard.checksum, shard.nbytes, staged_by=generation
        )
        log.info(
            "job %s rank %d: staged step %d from tier %s in RAM for its restore",
            job,
            rank,
            step,
            tier,
            extra={"job": job},
        )
        return protocol.StageReply(path=str(slot.path), slot=slot.index)
