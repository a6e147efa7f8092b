"""The supervisor's catalog, applied on this node: a step the catalog commits at a
tier gets its manifest written there (last: the copy then describes itself) and
counts for retention; a manifest write that fails is retried with a growing,
jittered delay. An ended job's stores stay until what they landed is committed
(``ENDED_SETTLE_S``) and its manifests are written (``ENDED_MANIFEST_RETRY_S``);
then its RAM tier goes and the supervisor is told.

One applier task per job works through its catalogs (``Commits``); the tasks are owned
by a ``phalanx.tasks.Tasks``, which ``close`` shuts down within its limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import re
import time
from pathlib import Path

from agentd.ckpt.jobs import JobBook
from agentd.ckpt.node_tiers import NodeTiers
from agentd.ckpt.rank_stores import Publish, RankStore, RankStores
from ckpt import TierError, TierManifest, namespace_for
from phalanx import wire
from phalanx.tasks import Tasks

log = logging.getLogger(__name__)

APPLY_RETRY_MIN_S, APPLY_RETRY_MAX_S = 1.0, 60.0  # writing a failed manifest again
ENDED_SETTLE_S = 10.0  # an ended job's last landings: how long their commits are awaited
ENDED_MANIFEST_RETRY_S = 600.0  # ... and its failed manifest writes retried, at most
ENGINE_CLOSED_S = 1.0  # an ended job's engines, closed already (``_settled``): no wait


class Commits:
    """The supervisor's catalogs, applied to this node's rank stores.

    ``pool`` runs the manifest writes (at every tier: a buddy, the object store), so
    that a slow or black-holed tier never holds up a rank's save."""

    def __init__(
        self,
        node: str,
        shm_dir: Path,
        jobs: JobBook,
        stores: RankStores,
        tiers: NodeTiers,
        pool: concurrent.futures.Executor,
        publish: Publish,
    ) -> None:
        self.node = node
        self.shm_dir = shm_dir
        self.jobs = jobs
        self.stores = stores
        self.tiers = tiers
        self.pool = pool
        self.publish = publish
        self.tasks = Tasks(f"checkpoint commits of node {node}")
        self._appliers: dict[str, asyncio.Task[None]] = {}
        # job -> (the last retry delay, the retry scheduled) after a manifest write failed
        self._backoff: dict[str, tuple[float, asyncio.TimerHandle | None]] = {}
        self._ending: dict[str, float] = {}  # ended job -> when its RAM tier goes regardless
        self._reapply: set[str] = set()  # jobs whose latest catalog some store has not seen

    async def on_catalog(self, catalog: wire.CkptCatalog) -> None:
        """Take the newest catalog of a job; one applier per job works through it.

        Catalogs can come faster than manifests are written (a slow buddy or object
        store): the applier always applies the latest one, skipping those it missed."""
        if catalog.node != self.node:
            log.warning(
                "dropped: a checkpoint catalog of job %s for node %s", catalog.job, catalog.node
            )
            return
        self.jobs.catalogs[catalog.job] = catalog
        await self.jobs.notify()  # a restore may be waiting for this generation
        self.kick(catalog.job)

    def kick(self, job: str) -> None:
        """Have the job's applier (started if need be) apply its latest catalog to every
        store of the job, new ones included. Called on the event loop."""
        self._reapply.add(job)
        running = self._appliers.get(job)
        if (running is None or running.done()) and not self.tasks.closed:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # not on the loop: the next catalog applies it
                return
            task = self.tasks.spawn(self._applier(job), name=f"ckpt-apply-{job}")
            if task is not None:
                self._appliers[job] = task

    async def close(self, timeout: float) -> None:
        """Start no applier again, and give those running ``timeout`` to finish their
        pass (a manifest write under way ends in its thread regardless); cancel the rest."""
        for _delay, pending in self._backoff.values():
            if pending is not None:
                pending.cancel()
        await self.tasks.shutdown(timeout)

    async def _applier(self, job: str) -> None:
        loop = asyncio.get_running_loop()
        whole = True
        while job in self._reapply and (catalog := self.jobs.catalogs.get(job)) is not None:
            self._reapply.discard(job)
            whole = True
            for store in self.stores.of_job(job):
                try:
                    whole &= await loop.run_in_executor(self.pool, self.apply, store, catalog)
                except Exception:
                    whole = False
                    log.exception("applying the checkpoint catalog of %s rank %d", job, store.rank)
            if catalog.ended and await self._settled(job, catalog):
                try:
                    await loop.run_in_executor(self.pool, self._free_ram, job)
                except Exception:
                    log.exception("freeing the RAM tier of job %s", job)
                else:
                    self._let_go(job, catalog)
            await self.jobs.notify()
        if job not in self.jobs.catalogs:  # let go of: no catalog will kick this applier again
            self._appliers.pop(job, None)
            self._backoff.pop(job, None)
        elif whole:
            self._backoff.pop(job, None)
        else:
            self._retry(job)

    def _retry(self, job: str) -> None:
        """Apply the job's catalog again after a capped, jittered, growing delay: a
        manifest write failed (a blip of the object store or the buddy), and nothing else
        would write it before the next commit of the job, if one ever comes."""
        delay, pending = self._backoff.get(job, (0.0, None))
        if pending is not None and not pending.cancelled():
            return
        delay = min(APPLY_RETRY_MAX_S, max(APPLY_RETRY_MIN_S, delay * 2))
        wait_s = delay * random.uniform(0.5, 1.0)
        log.warning(
            "job %s: a checkpoint manifest could not be written: trying again in %.1f s",
            job,
            wait_s,
            extra={"job": job},
        )

        def fire() -> None:
            self._backoff[job] = (delay, None)
            self.kick(job)

        self._backoff[job] = (delay, asyncio.get_running_loop().call_later(wait_s, fire))

    def apply(self, store: RankStore, catalog: wire.CkptCatalog) -> bool:
        """Commit, at this node's tiers, the steps the supervisor found complete. False
        when a manifest could not be written: that step stays unapplied at that tier, so
        that the next pass writes it again (``_applier`` retries with a backoff), and
        ``wait`` names the tier meanwhile."""
        protect = {catalog.restore_step} if catalog.restore_step is not None else set()
        whole = True
        renews = store.renews  # a newer generation's save renews the store meanwhile: see there
        with store.lock:
            for entry in sorted(catalog.steps, key=lambda e: e.step):
                shards = {s.rank: (s.checksum, s.nbytes) for s in entry.shards}
                theirs = shards[store.rank][0] if store.rank in shards else None
                for tier in entry.committed:
                    if (tier, entry.step) not in store.landed:
                        continue
                    ours = store.landed.get((tier, entry.step))
                    if ours is not None and theirs is not None and ours != theirs:
                        continue  # it commits another save of the step (an older generation's)
                    mark = (tier, entry.step, theirs)
                    if mark in store.applied:
                        continue
                    manifest = TierManifest(
                        catalog.job,
                        entry.step,
                        shards,
                        committed_at=entry.committed[tier],
                        world_size=entry.world_size or catalog.world_size,
                    )
                    fleet = {e.step for e in catalog.steps if tier in e.committed}
                    try:
                        if not store.engine.commit(
                            tier,
                            manifest,
                            store.rank,
                            fleet_committed=fleet,
                            # the loss guard's steps, below RAM (a RAM slot is reused anyway)
                            protect=protect if tier == "ram" else protect | set(catalog.hold),
                        ):
                            continue  # not a tier of this store
                    except TierError as exc:
                        store.commit_errors[tier] = (entry.step, str(exc))
                        whole = False
                        continue
                    if store.renews != renews and entry.step >= store.renewed_from:
                        continue  # an older save of the step: the newer one's commit counts
                    store.applied.add(mark)
                    store.commit_errors.pop(tier, None)
                    # Only now, with the manifest written here, is the step readable here.
                    store.committed_upto[tier] = max(entry.step, store.committed_upto.get(tier, -1))
            listed = {(name, e.step) for e in catalog.steps for name in e.committed}
            for name, (step, _why) in list(store.commit_errors.items()):
                if (name, step) not in listed:  # no longer committed there: nothing to write
                    store.commit_errors.pop(name, None)
        return whole

    def _let_go(self, job: str, catalog: wire.CkptCatalog) -> None:
        """The job ended and its RAM tier is free: forget it, and tell the supervisor, which
        then clears the catalog the broker keeps for this node."""
        self.jobs.forget(job, catalog)
        self.tiers.forget(job)
        self.publish(wire.CkptReleased(node=self.node, job=job, at=time.time()))

    async def _settled(self, job: str, catalog: wire.CkptCatalog) -> bool:
        """The job ended: finish its write-downs (the stores stay, so that the commits of
        what they land still get their manifests here), then whether its RAM tier may go:
        once every step this node landed is committed where it landed, or is older than
        what is committed there (a catalog committing the last landings may still be on
        its way: ``ENDED_SETTLE_S`` at most), and every manifest written (one that failed
        is written again: ``ENDED_MANIFEST_RETRY_S`` at most, then logged as an error)."""
        loop = asyncio.get_running_loop()
        stores = self.stores.of_job(job)
        for store in stores:
            try:
                await loop.run_in_executor(self.pool, store.engine.close, 600.0)
            except Exception:
                log.exception("closing the checkpoint engine of %s rank %d", job, store.rank)
        committed = {(tier, e.step) for e in catalog.steps for tier in e.committed}
        newest: dict[str, int] = {}
        for tier, step in committed:
            newest[tier] = max(step, newest.get(tier, -1))
        open_ = [
            (s.rank, tier, step)
            for s in stores
            for tier, step in list(s.landed)
            if (tier, step) not in committed and step > newest.get(tier, -1)
        ]
        failing = [
            (s.rank, tier, step)
            for s in stores
            for tier, (step, _why) in list(s.commit_errors.items())
        ]
        now = time.monotonic()
        started = self._ending.setdefault(job, now)
        if open_ and now < started + ENDED_SETTLE_S:
            log.info(
                "job %s ended: freeing its RAM tier once the commits of %d landing(s) "
                "come (at most %.0f s)",
                job,
                len(open_),
                started + ENDED_SETTLE_S - now,
                extra={"job": job},
            )
            loop.call_later(started + ENDED_SETTLE_S - now + 0.05, self.kick, job)
            return False
        if failing and now < started + ENDED_MANIFEST_RETRY_S:
            # The applier writes them again meanwhile (_retry); look again then.
            loop.call_later(
                min(APPLY_RETRY_MAX_S, started + ENDED_MANIFEST_RETRY_S - now), self.kick, job
            )
            return False
        if failing:
            log.error(
                "job %s ended: its RAM tier goes, and these manifests could not be "
                "written in %.0f s (rank, tier, step): %s",
                job,
                ENDED_MANIFEST_RETRY_S,
                failing,
                extra={"job": job},
            )
        self._ending.pop(job, None)
        return True

    def _free_ram(self, job: str) -> None:
        """The job ended and its write-downs are done (``_settled``): remove its RAM
        segments."""
        stores = self.stores.take_job(job)
        for store in stores:
            store.close(ENGINE_CLOSED_S, free=True)
        mine = re.compile(re.escape(namespace_for(job, 0)[:-1]) + r"\d+\.slot\d+$")
        for leftover in self.shm_dir.glob(f"phalanx-{job}-r*"):
            if mine.match(leftover.name):  # segments an agent left before its restart
                leftover.unlink(missing_ok=True)
        if stores:
            log.info("ckpt: job %s ended: freed the RAM tier of %d rank(s)", job, len(stores))
