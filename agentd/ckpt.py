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
newer one is committed at that tier (``agentd.ckpt_commit``). Restores answer from the catalog
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
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentd.ckpt_commit import Commits
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
    namespace_for,
    open_store,
)
from ckpt.pacing import place_writer_thread
from ckpt.peer import HttpPeerStore
from phalanx import wire

__all__ = ["CkptRequestError", "CkptService", "RankStore"]

log = logging.getLogger(__name__)

DEFAULT_PLAN = wire.CkptPlan(tiers=["ram", "nvme", "object"])
GENERATIONS_KEPT = 64  # saves whose generation a landing names: far more than are in flight
LISTING_TTL_S = 60.0  # a remote tier's listing of a job serves this node's ranks this long
_Listing = concurrent.futures.Future[list[str]]


class CkptService(Restores, Commits):
    def __init__(
        self,
        node: str,
        data_dir: Path,
        shm_dir: Path,
        object_store: str,
        token: str,
        publish: Callable[[wire.CkptLanding | wire.CkptReleased], None],
        *,
        pacing: Pacing | None = None,
    ) -> None:
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
            4,
            thread_name_prefix="ckpt-peer",
            initializer=place_writer_thread,
            initargs=(on_write_cpus,),
        )
        # Catalog application writes manifests at every tier (a buddy, the object store):
        # its own threads, so that a slow or black-holed tier never holds up a rank's save.
        self.commits = concurrent.futures.ThreadPoolExecutor(
            4,
            thread_name_prefix="ckpt-commit",
            initializer=place_writer_thread,
            initargs=(on_write_cpus,),
        )
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
        if generation > self.generations.get(job, 0):
            # What an older generation's write-downs failed at is not the new one's: its
            # ranks' final wait() must not raise it (a buddy that died with its node).
            with self._lock:
                stores = [s for (j, _), s in self.stores.items() if j == job]
            for store in stores:
                if dropped := store.engine.forget_failures():
                    log.info(
                        "job %s generation %d starts: %d failure(s) of an older "
                        "generation's write-down dropped (%s)",
                        job,
                        generation,
                        len(dropped),
                        dropped[0],
                    )
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
                tiers[name] = ObjectTier(
                    HttpPeerStore(b.node, b.address, b.http_port, self.token),
                    name="peer",
                    level=self.pacing.compress_level,
                    pacing=self.pacing,
                )
                holder["peer"] = b.node
            elif name == "object":
                tiers[name] = ObjectTier(
                    self.objects(),
                    name="object",
                    level=self.pacing.compress_level,
                    pacing=self.pacing,
                )
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
                        log.warning(
                            "ckpt: job %s rank %d: cannot list the %s tier, so steps "
                            "landed there before a restart are unknown here: %s",
                            job,
                            rank,
                            tier.name,
                            exc,
                        )
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
            ram = RamTier(
                namespace_for(job, rank),
                job=job,
                directory=self.shm_dir,
                slots=keep["ram"] + 1,
                keep=keep["ram"],
                pin=False,
            )
            tiers, holder = self._tiers(job)
            reporter = Reporter(self, holder)
            engine = Engine(
                ram,
                list(tiers.values()),
                keep=keep,
                catalog=reporter,
                pacing=self.pacing,
                on_event=self._on_event,
            )
            store = RankStore(job, rank, ram, engine, tiers, reporter)
            store.landed.update((("ram", step), None) for step in ram.steps(job))
            if "nvme" in tiers:
                try:
                    store.landed.update(
                        (("nvme", step), None)
                        for step in self.disk.landed_steps(job)
                        if self.disk.path(ShardKey(job, step, rank)).is_file()
                    )
                except TierError as exc:
                    log.warning("ckpt: job %s rank %d: %s", job, rank, exc)
            remote = [t for t in tiers.values() if isinstance(t, ObjectTier)]
            if remote:
                store.lock.acquire()  # released by seed_remote's thread
                try:
                    threading.Thread(
                        target=seed_remote,
                        args=(store, remote),
                        daemon=True,
                        name=f"ckpt-seed-{job}-r{rank}",
                    ).start()
                except BaseException:
                    store.lock.release()
                    raise
            reporter.store = store
            self.stores[(job, rank)] = store
            log.info("ckpt: job %s rank %d: tiers %s", job, rank, ", ".join(["ram", *tiers]))
        if job in self.catalogs:
            # A store made after the job's latest catalog (a rank moved here, an agent
            # restart): what it already holds gets its manifests now, not at the next commit.
            self._kick_applier(job)
        return store

    def _on_event(self, event: TierEvent) -> None:
        if event.kind not in ("failed", "deleted") or event.tier not in TIER_ORDER:
            return
        self.publish(
            wire.CkptLanding(
                node=self.node,
                job=event.key.job,
                step=event.key.step,
                rank=event.key.rank,
                tier=event.tier,
                event=event.kind,
                error=event.error or "",
                at=event.at,
            )
        )

    def _fence(self, job: str, generation: int) -> None:
        current = self.generations.get(job, 0)
        if generation < current:
            raise CkptRequestError(
                f"job {job}: generation {generation} is older than "
                f"generation {current} started here",
                status=409,
            )

    # --- saving ---------------------------------------------------------------------

    async def acquire(
        self,
        job: str,
        generation: int,
        rank: int,
        step: int,
        nbytes: int,
        when_busy: str,
        timeout: float,
    ) -> dict[str, Any]:
        self._fence(job, generation)
        store = self.store(job, rank)
        key = ShardKey(job, step, rank)
        before = set(store.ram.steps(job))
        slot = await self._run(
            functools.partial(
                store.ram.acquire,
                key,
                nbytes,
                when_busy="skip" if when_busy == "skip" else "wait",
                timeout=timeout,
            )
        )
        if slot is None:
            store.engine.report(
                TierEvent(
                    "skipped",
                    "ram",
                    key,
                    None,
                    nbytes,
                    0.0,
                    "every RAM slot is still being written down",
                )
            )
            return {"skipped": True, "why": "every RAM slot is still being written down"}
        store.outstanding[slot.index] = slot
        store.report_reused(before)
        return {"slot": slot.index, "path": str(slot.path), "capacity": slot.capacity}

    def submit(
        self, job: str, generation: int, rank: int, step: int, index: int, nbytes: int, abort: bool
    ) -> dict[str, Any]:
        store = self.stores.get((job, rank))
        slot = store.outstanding.pop(index, None) if store else None
        if store is None or slot is None or slot.step != step or slot.nbytes != nbytes:
            raise CkptRequestError(
                f"job {job} rank {rank}: slot {index} was not acquired for "
                f"step {step} of {nbytes} bytes",
                status=409,
            )
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
                failed = next(
                    (t for t in left if store.commit_errors.get(t, (-1, ""))[0] >= step), None
                )
                if failed is not None:  # written again in the background until it takes
                    raise CkptRequestError(
                        store.commit_errors[failed][1], status=409, tier=failed, step=step
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CkptRequestError(
                        f"step {step} of job {job} not committed on tier(s) {', '.join(left)} "
                        f"within {timeout:g} s (every rank's shard must land there)",
                        status=504,
                        step=step,
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), remaining)
        return {"committed": {t: step for t in wanted}}

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
                log.exception("closing the checkpoint engine of %s rank %d", store.job, store.rank)
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
