"""The agent's checkpoint tiers: RAM slots its ranks copy into, and the write-down.

For every (job, rank) on this node the agent keeps a ``RankStore``: a
``ckpt.RamTier`` whose segments in ``ckpt.shm_dir`` are named
``ckpt.namespace_for(job, rank)`` and owned by the agent (they outlive the
rank, ``kill -9`` included, and the job's generations), and a ``ckpt.Engine``
that seals each saved shard and writes it down: ``nvme`` (a ``DiskTier`` under
``DATA_DIR/ckpt``) → ``peer`` (the buddy the supervisor named, over HTTP) →
``object`` (``ckpt.object_store``), as the job spec's ``checkpoint.tiers`` say.

Commit is the supervisor's: every landing is published (``CkptLanding``), the
supervisor's catalog commits a step at a tier once every rank's shard is there
and publishes the job's ``CkptCatalog`` (retained). On a new commit the agent
writes the step's manifest at that tier and applies retention
(``checkpoint.keep``): the previous committed step is never deleted before a
newer one is committed at that tier. Restores answer from the catalog
(``agentd.ckpt_restore``): the step the gang restores from, with where this node
can read a copy, nearest first. What the service keeps per rank is
``agentd.ckpt_store.RankStore``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentd.ckpt_restore import Restores
from agentd.ckpt_store import TIER_ORDER, CkptRequestError, RankStore, Reporter
from ckpt import (
    DiskTier,
    Engine,
    LocalFolderStore,
    ObjectStore,
    ObjectTier,
    Pacing,
    RamTier,
    ShardKey,
    Tier,
    TierError,
    TierEvent,
    TierManifest,
    namespace_for,
    open_store,
)
from ckpt.peer import HttpPeerStore
from ckpt.tiers import place_writer_thread
from phalanx import wire

__all__ = ["CkptRequestError", "CkptService", "RankStore"]

log = logging.getLogger(__name__)

DEFAULT_PLAN = wire.CkptPlan(tiers=["ram", "nvme", "object"])
APPLY_RETRY_MIN_S, APPLY_RETRY_MAX_S = 1.0, 60.0  # writing a failed manifest again
ENDED_SETTLE_S = 10.0  # an ended job's last landings: how long their commits are awaited
ENDED_MANIFEST_RETRY_S = 600.0  # ... and its failed manifest writes retried, at most
GENERATIONS_KEPT = 64  # saves whose generation a landing names: far more than are in flight
LISTING_TTL_S = 60.0  # a remote tier's listing of a job serves this node's ranks this long
_Listing = concurrent.futures.Future[list[str]]


class CkptService(Restores):
    def __init__(self, node: str, data_dir: Path, shm_dir: Path, object_store: str,
                 token: str, publish: Callable[[wire.CkptLanding | wire.CkptReleased], None], *,
                 pacing: Pacing | None = None) -> None:  # fmt: skip
        self.node = node
        self.publish_threadsafe = publish
        self.shm_dir = shm_dir
        self.token = token
        self.disk_root = data_dir / "ckpt"
        self.peer_root = data_dir / "ckpt-peer"
        self.object_url = object_store or (data_dir / "ckpt-objects").as_uri()
        self._objects: ObjectStore | None = None
        # One disk tier for every rank: it removes unfinished writes once, at start (a
        # second instance's rescan would delete another rank's write in flight).
        self.pacing = pacing if pacing is not None else Pacing()  # ckpt.write_nice etc.
        self.disk = DiskTier(self.disk_root, name="nvme", pacing=self.pacing)
        self.peer_store = LocalFolderStore(self.peer_root)  # what buddies push to us
        self.plans: dict[str, wire.CkptPlan] = {}
        self.generations: dict[str, int] = {}
        self.stores: dict[tuple[str, int], RankStore] = {}
        self.catalogs: dict[str, wire.CkptCatalog] = {}
        self.changed = asyncio.Condition()
        self._lock = threading.Lock()
        # (job, tier url) -> (when, the keys under JOB/): one listing for the node's ranks
        self._listings: dict[tuple[str, str], tuple[float, _Listing]] = {}
        # Own thread pools, never the loop's default one: a rank waiting for a slot, or a
        # commit pushing a manifest to a buddy, can block for long, and a buddy's pushes to
        # us must never queue behind them (two agents would wait on each other).
        self.slow = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="ckpt-req")
        # Both take CPU from the node (a buddy's pushes checked and staged, manifests written):
        # on the write-down's CPUs, as the engines' writers are; not niced, so that a buddy
        # pushing to this node never waits on a starved reader (its socket times out).
        on_write_cpus = replace(self.pacing, nice=0, idle=False)
        self.peer_io = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix="ckpt-peer", initializer=place_writer_thread,
            initargs=(on_write_cpus,))  # fmt: skip
        # Catalog application writes manifests at every tier (a buddy, the object store):
        # its own threads, so that a slow or black-holed tier never holds up a rank's save.
        self.commits = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix="ckpt-commit", initializer=place_writer_thread,
            initargs=(on_write_cpus,))  # fmt: skip
        self._appliers: dict[str, asyncio.Task[None]] = {}
        # job -> (the last retry delay, the retry scheduled) after a manifest write failed
        self._apply_backoff: dict[str, tuple[float, asyncio.TimerHandle | None]] = {}
        self._ending: dict[str, float] = {}  # ended job -> when its RAM tier goes regardless
        self._reapply: set[str] = set()  # jobs whose latest catalog some store has not seen
        self._closing = False

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.slow, fn, *args)

    # --- plumbing ---------------------------------------------------------------

    def publish(self, msg: wire.CkptLanding | wire.CkptReleased) -> None:
        self.publish_threadsafe(msg)

    def objects(self) -> ObjectStore:
        if self._objects is None:
            self._objects = open_store(self.object_url, pacing=self.pacing)
        return self._objects

    def configure(self, job: str, generation: int, plan: wire.CkptPlan | None) -> None:
        """A start of ``job``'s ranks: remember its plan and generation (fences stale ranks).

        A new plan (another buddy after a move, say) applies to the ranks' stores at
        once; their RAM slots stay."""
        self.generations[job] = max(self.generations.get(job, 0), generation)
        new = plan or DEFAULT_PLAN
        if self.plans.get(job) == new:
            return
        self.plans[job] = new
        with self._lock:
            stores = [s for (j, _), s in self.stores.items() if j == job]
        for store in stores:
            tiers, holder = self._tiers(job)
            store.tiers = tiers
            store.reporter.holder = holder
            store.engine.keep = self._keep(job)
            store.engine.tiers = list(tiers.values())  # the writer reads it per shard

    def _keep(self, job: str) -> dict[str, int]:
        plan = self.plans.get(job, DEFAULT_PLAN)
        return {t: plan.keep.get(t, 2) for t in TIER_ORDER}  # type: ignore[call-overload]

    def _tiers(self, job: str) -> tuple[dict[str, Tier], dict[str, str | None]]:
        plan = self.plans.get(job, DEFAULT_PLAN)
        tiers: dict[str, Tier] = {}
        holder: dict[str, str | None] = {"ram": self.node, "nvme": self.node, "object": None}
        for name in self.tiers_of(job):
            if name == "nvme":
                tiers[name] = self.disk
            elif name == "peer" and plan.buddy is not None:
                b = plan.buddy
                tiers[name] = ObjectTier(HttpPeerStore(b.node, b.address, b.http_port,
                                                       self.token), name="peer",
                                         level=self.pacing.compress_level, pacing=self.pacing)
                holder["peer"] = b.node
            elif name == "object":
                tiers[name] = ObjectTier(self.objects(), name="object",
                                         level=self.pacing.compress_level, pacing=self.pacing)
        return tiers, holder

    def _listing(self, job: str, tier: ObjectTier) -> list[str]:
        """The keys under ``JOB/`` at a remote tier, listed once for every rank of this
        node whose store starts within ``LISTING_TTL_S`` (each listing names every rank's
        shard of every step; a buddy that does not answer is waited for once, not once
        per rank). A failed listing fails the ranks waiting on it, and is not kept."""
        cache_key = (job, tier.store.url)
        now = time.monotonic()
        with self._lock:
            for stale in [k for k, (at, _) in self._listings.items() if now - at > LISTING_TTL_S]:
                del self._listings[stale]
            entry = self._listings.get(cache_key)
            owner = entry is None
            if entry is None:
                entry = (now, concurrent.futures.Future())
                self._listings[cache_key] = entry
        listing = entry[1]
        if owner:
            try:
                listing.set_result(tier.store.keys(f"{job}/"))
            except BaseException as exc:  # the ranks waiting on it get it; the next one lists
                listing.set_exception(exc)
                with self._lock:
                    if self._listings.get(cache_key) is entry:
                        del self._listings[cache_key]
                if not isinstance(exc, Exception):
                    raise
        return listing.result()

    def tiers_of(self, job: str) -> list[str]:
        plan = self.plans.get(job, DEFAULT_PLAN)
        tiers = [t for t in TIER_ORDER if t in plan.tiers or t == "ram"]
        return [t for t in tiers if t != "peer" or plan.buddy is not None]

    def store(self, job: str, rank: int) -> RankStore:
        """Rank ``rank``'s tiers for ``job``, made on first use.

        A new store starts out knowing what this node's tiers already hold of the rank
        (the agent restarted since the rank saved), so that a step the catalog commits
        later still gets its manifest here and counts for retention, and retention never
        takes a committed step for an unknown one: the RAM tier's sealed slots and the
        disk's shards at once; the peer and object tiers (network calls, never on the
        event loop) from one listing each, in a thread that holds ``store.lock`` until
        it is done, so that no catalog is applied to the store before then."""

        def seed_remote(store: RankStore, remote: list[ObjectTier]) -> None:
            try:
                for tier in remote:
                    suffix = ".zst" if tier.compression else ""
                    try:
                        keys = self._listing(job, tier)
                    except Exception as exc:
                        log.warning("ckpt: job %s rank %d: cannot list the %s tier, so steps "
                                    "landed there before a restart are unknown here: %s", job,
                                    rank, tier.name, exc)  # fmt: skip
                        continue
                    for key in keys:
                        step = key.split("/")[1] if key.count("/") == 2 else ""
                        if step.isdigit() and ShardKey(job, int(step), rank).relpath(suffix) == key:
                            store.landed.setdefault((tier.name, int(step)), None)
            finally:
                store.lock.release()

        with self._lock:
            found = self.stores.get((job, rank))
            if found is not None:
                return found
            keep = self._keep(job)
            ram = RamTier(namespace_for(job, rank), job=job, directory=self.shm_dir,
                          slots=keep["ram"] + 1, keep=keep["ram"], pin=False)  # fmt: skip
            tiers, holder = self._tiers(job)
            reporter = Reporter(self, holder)
            engine = Engine(ram, list(tiers.values()), keep=keep, catalog=reporter,
                            pacing=self.pacing, on_event=self._on_event)  # fmt: skip
            store = RankStore(job, rank, ram, engine, tiers, reporter)
            store.landed.update((("ram", step), None) for step in ram.steps(job))
            if "nvme" in tiers:
                try:
                    store.landed.update((("nvme", step), None)
                                        for step in self.disk.landed_steps(job)
                                        if self.disk.path(ShardKey(job, step, rank)).is_file())
                except TierError as exc:
                    log.warning("ckpt: job %s rank %d: %s", job, rank, exc)
            remote = [t for t in tiers.values() if isinstance(t, ObjectTier)]
            if remote:
                store.lock.acquire()  # released by seed_remote's thread
                try:
                    threading.Thread(target=seed_remote, args=(store, remote), daemon=True,
                                     name=f"ckpt-seed-{job}-r{rank}").start()
                except BaseException:
                    store.lock.release()
                    raise
            reporter.store = store
            self.stores[(job, rank)] = store
            log.info("ckpt: job %s rank %d: tiers %s", job, rank,
                     ", ".join(["ram", *tiers]))  # fmt: skip
        if job in self.catalogs:
            # A store made after the job's latest catalog (a rank moved here, an agent
            # restart): what it already holds gets its manifests now, not at the next commit.
            self._kick_applier(job)
        return store

    def _on_event(self, event: TierEvent) -> None:
        if event.kind not in ("failed", "deleted") or event.tier not in TIER_ORDER:
            return
        self.publish(wire.CkptLanding(
            node=self.node, job=event.key.job, step=event.key.step, rank=event.key.rank,
            tier=event.tier, event=event.kind,
            error=event.error or "", at=event.at))

    def _fence(self, job: str, generation: int) -> None:
        current = self.generations.get(job, 0)
        if generation < current:
            raise CkptRequestError(f"job {job}: generation {generation} is older than "
                                   f"generation {current} started here", status=409)

    # --- saving ---------------------------------------------------------------------

    async def acquire(self, job: str, generation: int, rank: int, step: int, nbytes: int,
                      when_busy: str, timeout: float) -> dict[str, Any]:  # fmt: skip
        self._fence(job, generation)
        store = self.store(job, rank)
        key = ShardKey(job, step, rank)
        before = set(store.ram.steps(job))
        slot = await self._run(functools.partial(
            store.ram.acquire, key, nbytes, when_busy="skip" if when_busy == "skip" else "wait",
            timeout=timeout))
        if slot is None:
            store.engine.report(TierEvent("skipped", "ram", key, None, nbytes, 0.0,
                                          "every RAM slot is still being written down"))
            return {"skipped": True, "why": "every RAM slot is still being written down"}
        store.outstanding[slot.index] = slot
        store.report_reused(before)
        return {"slot": slot.index, "path": str(slot.path), "capacity": slot.capacity}

    def submit(self, job: str, generation: int, rank: int, step: int, index: int, nbytes: int,
               abort: bool) -> dict[str, Any]:  # fmt: skip
        store = self.stores.get((job, rank))
        slot = store.outstanding.pop(index, None) if store else None
        if store is None or slot is None or slot.step != step or slot.nbytes != nbytes:
            raise CkptRequestError(f"job {job} rank {rank}: slot {index} was not acquired for "
                                   f"step {step} of {nbytes} bytes", status=409)
        if abort:
            store.ram.release(slot, keep_content=False)
            return {"aborted": True}
        try:
            before = store.generation_of.pop(step, None)
            store.generation_of[step] = generation  # the newest save last
            while len(store.generation_of) > GENERATIONS_KEPT:  # the oldest saves go first,
                del store.generation_of[next(iter(store.generation_of))]  # not the lowest steps
            # A newer generation saves here (after an agent restart too: what it found on its
            # tiers was an older one's), or saves a step an older one saved here.
            if generation > store.generation or (before is not None and before < generation):
                self._renew(store, step)
                store.generation = max(store.generation, generation)
            store.engine.submit(slot, ShardKey(job, step, rank))
        except BaseException:
            store.ram.release(slot, keep_content=False)  # never left busy
            raise
        return {"submitted": step}

    @staticmethod
    def _renew(store: RankStore, step: int) -> None:
        """A newer generation saves ``step`` here: from it on, what an older one landed and
        committed is being saved anew (it restored an older step), so that ``wait`` waits
        for the new commits and the applier writes their manifests, not the old ones. Runs
        on the event loop, lock-free: an ``_apply`` under way sees ``renews`` change and
        records none of what it commits from ``step`` on."""
        store.renewed_from, store.renews = step, store.renews + 1
        for key in [k for k in list(store.landed) if k[1] >= step]:  # list(): one GIL hold
            store.landed.pop(key, None)
        store.applied = {mark for mark in list(store.applied) if mark[1] < step}
        for tier, (failed, _why) in list(store.commit_errors.items()):
            if failed >= step:
                store.commit_errors.pop(tier, None)
        for tier, upto in list(store.committed_upto.items()):
            store.committed_upto[tier] = min(upto, step - 1)
        # Retention, too, stops counting them: else the RAM tier would keep the older
        # save of a newer step and delete the newer generation's saves in its favour.
        seen = store.engine.committed
        for tier in list(seen):
            seen[tier] = {s for s in list(seen[tier]) if s < step}
        in_ram = set(store.ram.steps(store.job)) & seen.get(store.ram.name, set())
        store.ram.newest_committed = max(in_ram, default=None)

    async def reserve(self, job: str, generation: int, rank: int, nbytes: int) -> list[str]:
        self._fence(job, generation)
        store = self.store(job, rank)
        await self._run(store.ram.reserve, nbytes)
        return [str(s.path) for s in store.ram.slots if s is not None and s.path.exists()]

    def rank_exited(self, job: str, rank: int) -> None:
        """A rank died between acquire and submit: its slot holds nothing; free it."""
        store = self.stores.get((job, rank))
        if store is None:
            return
        for slot in list(store.outstanding.values()):
            store.ram.release(slot, keep_content=False)
        store.outstanding.clear()

    async def wait(self, job: str, rank: int, step: int, timeout: float) -> dict[str, Any]:
        store = self.stores.get((job, rank))
        if store is None:
            return {"committed": {}}
        deadline = time.monotonic() + timeout
        try:
            await self._run(store.engine.wait, timeout)
        except TierError as exc:
            raise CkptRequestError(str(exc), status=409, tier=exc.tier, step=step) from exc
        except TimeoutError as exc:
            raise CkptRequestError(str(exc), status=504, step=step) from exc
        wanted = self.tiers_of(job)

        def missing() -> list[str]:
            # Committed by the catalog and applied at this node's tiers (manifest written).
            return [t for t in wanted if store.committed_upto.get(t, -1) < step]

        async with self.changed:
            while left := missing():
                failed = next((t for t in left if store.commit_errors.get(t, (-1, ""))[0]
                               >= step), None)  # fmt: skip
                if failed is not None:  # written again in the background until it takes
                    raise CkptRequestError(store.commit_errors[failed][1], status=409,
                                           tier=failed, step=step)  # fmt: skip
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CkptRequestError(
                        f"step {step} of job {job} not committed on tier(s) {', '.join(left)} "
                        f"within {timeout:g} s (every rank's shard must land there)",
                        status=504, step=step)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), remaining)
        return {"committed": {t: step for t in wanted}}

    # --- the catalog ------------------------------------------------------------------

    async def on_catalog(self, catalog: wire.CkptCatalog) -> None:
        """Take the newest catalog of a job; one applier per job works through it.

        Catalogs can come faster than manifests are written (a slow buddy or object
        store): the applier always applies the latest one, skipping those it missed."""
        if catalog.node != self.node:
            log.warning("dropped: a checkpoint catalog of job %s for node %s", catalog.job,
                        catalog.node)
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
                    whole &= await loop.run_in_executor(self.commits, self._apply, store,
                                                        catalog)  # fmt: skip
                except Exception:
                    whole = False
                    log.exception("applying the checkpoint catalog of %s rank %d", job,
                                  store.rank)
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
        log.warning("job %s: a checkpoint manifest could not be written: trying again in "
                    "%.1f s", job, wait_s, extra={"job": job})  # fmt: skip

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
                    manifest = TierManifest(catalog.job, entry.step, shards,
                                            committed_at=entry.committed[tier],
                                            world_size=catalog.world_size)  # fmt: skip
                    fleet = {e.step for e in catalog.steps if tier in e.committed}
                    try:
                        if not store.engine.commit(tier, manifest, store.rank,
                                                   fleet_committed=fleet, protect=protect):
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
                    store.committed_upto[tier] = max(entry.step,
                                                     store.committed_upto.get(tier, -1))
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
        open_ = [(s.rank, tier, step) for s in stores for tier, step in list(s.landed)
                 if (tier, step) not in committed and step > newest.get(tier, -1)]  # fmt: skip
        failing = [(s.rank, tier, step) for s in stores
                   for tier, (step, _why) in list(s.commit_errors.items())]  # fmt: skip
        now = time.monotonic()
        started = self._ending.setdefault(job, now)
        if open_ and now < started + ENDED_SETTLE_S:
            log.info("job %s ended: freeing its RAM tier once the commits of %d landing(s) "
                     "come (at most %.0f s)", job, len(open_), started + ENDED_SETTLE_S - now,
                     extra={"job": job})  # fmt: skip
            loop.call_later(started + ENDED_SETTLE_S - now + 0.05, self._kick_applier, job)
            return False
        if failing and now < started + ENDED_MANIFEST_RETRY_S:
            # The applier writes them again meanwhile (_retry_applier); look again then.
            loop.call_later(min(APPLY_RETRY_MAX_S, started + ENDED_MANIFEST_RETRY_S - now),
                            self._kick_applier, job)  # fmt: skip
            return False
        if failing:
            log.error("job %s ended: its RAM tier goes, and these manifests could not be "
                      "written in %.0f s (rank, tier, step): %s", job, ENDED_MANIFEST_RETRY_S,
                      failing, extra={"job": job})  # fmt: skip
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

    # --- lifetime -----------------------------------------------------------------

    async def close(self, timeout: float = 30.0) -> None:
        self._closing = True
        for _delay, pending in self._apply_backoff.values():
            if pending is not None:
                pending.cancel()
        for task in self._appliers.values():
            task.cancel()
        for store in list(self.stores.values()):
            try:
                await self._run(store.engine.close, timeout)
            except Exception:
                log.exception("closing the checkpoint engine of %s rank %d", store.job,
                              store.rank)
            with contextlib.suppress(Exception):
                if "peer" in store.tiers:  # the disk tier and object store are shared
                    store.tiers["peer"].close()
            store.ram.close()  # the segments stay: a restarted agent maps them back
        if self._objects is not None:
            with contextlib.suppress(Exception):
                self._objects.close()
        self.slow.shutdown(wait=False, cancel_futures=True)
        self.peer_io.shutdown(wait=False, cancel_futures=True)
        self.commits.shutdown(wait=False, cancel_futures=True)
