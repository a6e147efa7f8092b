"""The supervisor's catalog, applied on this node: a step the catalog commits at a
tier gets its manifest written there (last: the copy then describes itself) and
counts for retention; a manifest write that fails is retried with a growing,
jittered delay. An ended job's stores stay until what they landed is committed
(``ENDED_SETTLE_S``) and its manifests are written (``ENDED_MANIFEST_RETRY_S``);
then its RAM tier goes and the supervisor is told.

``Commits`` is a part of ``agentd.ckpt.CkptService``, which holds the state it reads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agentd.ckpt_store import RankStore
from ckpt import ShardKey, TierError, TierEvent, TierManifest, namespace_for
from phalanx import wire

log = logging.getLogger(__name__)

APPLY_RETRY_MIN_S, APPLY_RETRY_MAX_S = 1.0, 60.0  # writing a failed manifest again
ENDED_SETTLE_S = 10.0  # an ended job's last landings: how long their commits are awaited
ENDED_MANIFEST_RETRY_S = 600.0  # ... and its failed manifest writes retried, at most


class Commits:
    """The catalog application of ``CkptService``, which sets what is declared here."""

    node: str
    shm_dir: Path
    catalogs: dict[str, wire.CkptCatalog]
    plans: dict[str, wire.CkptPlan]
    generations: dict[str, int]
    stores: dict[tuple[str, int], RankStore]
    changed: asyncio.Condition
    commits: concurrent.futures.ThreadPoolExecutor
    _lock: threading.Lock
    _listings: dict[tuple[str, str], tuple[float, concurrent.futures.Future[list[str]]]]
    _appliers: dict[str, asyncio.Task[None]]
    _apply_backoff: dict[str, tuple[float, asyncio.TimerHandle | None]]
    _ending: dict[str, float]
    _reapply: set[str]
    _closing: bool

    if TYPE_CHECKING:

        def publish(self, msg: wire.CkptLanding | wire.CkptReleased) -> None: ...

    async def on_catalog(self, catalog: wire.CkptCatalog) -> None:
        """Take the newest catalog of a job; one applier per job works through it.

        Catalogs can come faster than manifests are written (a slow buddy or object
        store): the applier always applies the latest one, skipping those it missed."""
        if catalog.node != self.node:
            log.warning(
                "dropped: a checkpoint catalog of job %s for node %s", catalog.job, catalog.node
            )
            return
        self.catalogs[catalog.job] = catalog
        async with self.changed:
            self.changed.notify_all()  # a restore may be waiting for this generation
        self._kick_applier(catalog.job)

    def _kick_applier(self, job: str) -> None:
        """Have the job's applier (started if need be) apply its latest catalog to every
        store of the job, new ones included. Called on the event loop."""
        self._reapply.add(job)
        running = self._appliers.get(job)
        if (running is None or running.done()) and not self._closing:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on the loop: the next catalog applies it
                return
            self._appliers[job] = loop.create_task(self._applier(job), name=f"ckpt-apply-{job}")

    async def _applier(self, job: str) -> None:
        loop = asyncio.get_running_loop()
        whole = True
        while job in self._reapply and (catalog := self.catalogs.get(job)) is not None:
            self._reapply.discard(job)
            stores = [s for (j, _), s in list(self.stores.items()) if j == job]
            whole = True
            for store in stores:
                try:
                    whole &= await loop.run_in_executor(self.commits, self._apply, store, catalog)
                except Exception:
                    whole = False
                    log.exception("applying the checkpoint catalog of %s rank %d", job, store.rank)
            if catalog.ended and await self._settled(job, catalog):
                try:
                    await loop.run_in_executor(self.commits, self._free_ram, job)
                except Exception:
                    log.exception("freeing the RAM tier of job %s", job)
                else:
                    self._let_go(job, catalog)
            async with self.changed:
                self.changed.notify_all()
        if job not in self.catalogs:  # let go of: no catalog will kick this applier again
            self._appliers.pop(job, None)
            self._apply_backoff.pop(job, None)
        elif whole:
            self._apply_backoff.pop(job, None)
        else:
            self._retry_applier(job)

    def _retry_applier(self, job: str) -> None:
        """Apply the job's catalog again after a capped, jittered, growing delay: a
        manifest write failed (a blip of the object store or the buddy), and nothing else
        would write it before the next commit of the job, if one ever comes."""
        delay, pending = self._apply_backoff.get(job, (0.0, None))
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
            self._apply_backoff[job] = (delay, None)
            if not self._closing:
                self._kick_applier(job)

        self._apply_backoff[job] = (delay, asyncio.get_running_loop().call_later(wait_s, fire))

    def _apply(self, store: RankStore, catalog: wire.CkptCatalog) -> bool:
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
                        world_size=catalog.world_size,
                    )
                    fleet = {e.step for e in catalog.steps if tier in e.committed}
                    try:
                        if not store.engine.commit(
                            tier, manifest, store.rank, fleet_committed=fleet, protect=protect
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
        if self.catalogs.get(job) is catalog:
            del self.catalogs[job]
        self.plans.pop(job, None)
        self.generations.pop(job, None)
        with self._lock:
            for listed in [k for k in self._listings if k[0] == job]:
                del self._listings[listed]
        self.publish(wire.CkptReleased(node=self.node, job=job, at=time.time()))

    async def _settled(self, job: str, catalog: wire.CkptCatalog) -> bool:
        """The job ended: finish its write-downs (the stores stay, so that the commits of
        what they land still get their manifests here), then whether its RAM tier may go:
        once every step this node landed is committed where it landed, or is older than
        what is committed there (a catalog committing the last landings may still be on
        its way: ``ENDED_SETTLE_S`` at most), and every manifest written (one that failed
        is written again: ``ENDED_MANIFEST_RETRY_S`` at most, then logged as an error)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            stores = [s for (j, _), s in self.stores.items() if j == job]
        for store in stores:
            try:
                await loop.run_in_executor(self.commits, store.engine.close, 600.0)
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
            loop.call_later(started + ENDED_SETTLE_S - now + 0.05, self._kick_applier, job)
            return False
        if failing and now < started + ENDED_MANIFEST_RETRY_S:
            # The applier writes them again meanwhile (_retry_applier); look again then.
            loop.call_later(
                min(APPLY_RETRY_MAX_S, started + ENDED_MANIFEST_RETRY_S - now),
                self._kick_applier,
                job,
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
        with self._lock:
            stores = [self.stores.pop(k) for k in list(self.stores) if k[0] == job]
        for store in stores:
            for step in store.ram.steps(job):
                store.engine.report(TierEvent("deleted", "ram", ShardKey(job, step, store.rank)))
            with contextlib.suppress(Exception):
                if "peer" in store.tiers:
                    store.tiers["peer"].close()
            store.ram.unlink()
        mine = re.compile(re.escape(namespace_for(job, 0)[:-1]) + r"\d+\.slot\d+$")
        for leftover in self.shm_dir.glob(f"phalanx-{job}-r*"):
            if mine.match(leftover.name):  # segments an agent left before its restart
                leftover.unlink(missing_ok=True)
        if stores:
            log.info("ckpt: job %s ended: freed the RAM tier of %d rank(s)", job, len(stores))
