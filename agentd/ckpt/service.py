"""The agent's checkpoint service: RAM slots its ranks copy into, and the write-down.

For every (job, rank) on this node the agent keeps a ``RankStore``
(``agentd.ckpt.rank_stores``): a ``ckpt.RamTier`` whose segments in ``ckpt.shm_dir``
are named ``ckpt.namespace_for(job, rank)`` and owned by the agent (they outlive
the rank, ``kill -9`` included, and the job's generations), and a ``ckpt.Engine``
that seals each saved shard and writes it down the node's tiers
(``agentd.ckpt.node_tiers``) as the job spec's ``checkpoint.tiers`` say.

``CkptService`` answers a saving rank itself (acquire, submit, reserve, wait) and
holds the parts it is composed of: what it knows of each job (``JobBook``), the
rank stores, the catalog application (``Commits``: the supervisor commits, the
agent writes manifests and applies retention) and the restores (``Restores``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from agentd.ckpt.commits import Commits
from agentd.ckpt.errors import CkptRequestError
from agentd.ckpt.jobs import DEFAULT_PLAN, JobBook
from agentd.ckpt.node_tiers import NodeTiers
from agentd.ckpt.rank_stores import TIER_ORDER, Publish, RankStore, RankStores, Reporter
from agentd.ckpt.restores import CATALOG_WAIT_S, Restores
from ckpt import (
    Engine,
    ObjectTier,
    Pacing,
    RamTier,
    ShardKey,
    TierError,
    TierEvent,
    namespace_for,
    place_writer_thread,
    protocol,
)
from phalanx import wire
from phalanx.tasks import Deadline

__all__ = ["CkptService"]

log = logging.getLogger(__name__)

GENERATIONS_KEPT = 64  # saves whose generation a landing names: far more than are in flight
APPLIERS_CLOSE_S = 5.0  # at close, the catalog appliers finish their pass this long at most
T = TypeVar("T")


class CkptService:
    """The node's checkpoint service: every rank's store, and the parts that serve them
    (``jobs``, ``stores``, ``tiers``, ``commits``, ``restores``). ``publish`` takes the
    landings and releases for the supervisor, from any thread."""

    def __init__(
        self,
        node: str,
        data_dir: Path,
        shm_dir: Path,
        object_store: str,
        publish: Publish,
        *,
        pacing: Pacing | None = None,
        peer_ssl: ssl.SSLContext | None = None,
        catalog_wait_s: float = CATALOG_WAIT_S,
    ) -> None:
        self.node = node
        self.publish_threadsafe = publish
        self.shm_dir = shm_dir
        self.pacing = pacing if pacing is not None else Pacing()  # ckpt.write_nice etc.
        self.tiers = NodeTiers(node, data_dir, object_store, self.pacing, peer_ssl=peer_ssl)
        self.peer_root = self.tiers.peer_root  # what the peer routes keep for buddies
        self.peer_store = self.tiers.peer_store
        self.jobs = JobBook()
        self.stores = RankStores()
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
        self.commit_io = concurrent.futures.ThreadPoolExecutor(
            4,
            thread_name_prefix="ckpt-commit",
            initializer=place_writer_thread,
            initargs=(on_write_cpus,),
        )
        self.commits = Commits(
            node, shm_dir, self.jobs, self.stores, self.tiers, self.commit_io, self.publish
        )
        self.restores = Restores(
            node, self.jobs, self.tiers, self.store, self.slow, self.publish, catalog_wait_s
        )
        self._closed = False

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.slow, fn, *args)

    # --- plumbing ---------------------------------------------------------------

    @property
    def generations(self) -> dict[str, int]:
        """Each job's newest generation started here."""
        return self.jobs.generations

    def publish(self, msg: wire.CkptLanding | wire.CkptReleased) -> None:
        self.publish_threadsafe(msg)

    async def on_catalog(self, catalog: wire.CkptCatalog) -> None:
        """The supervisor's newest catalog of a job for this node (``Commits.on_catalog``)."""
        await self.commits.on_catalog(catalog)

    def configure(self, job: str, generation: int, plan: wire.CkptPlan | None) -> None:
        """A start of ``job``'s ranks: remember its plan and generation (fences stale ranks).

        A new plan (another buddy after a move, say) applies to the ranks' stores at
        once; their RAM slots stay."""
        if generation > self.jobs.generations.get(job, 0):
            # What an older generation's write-downs failed at is not the new one's: its
            # ranks' final wait() must not raise it (a buddy that died with its node).
            for store in self.stores.of_job(job):
                if dropped := store.engine.forget_failures():
                    log.info(
                        "job %s generation %d starts: %d failure(s) of an older "
                        "generation's write-down dropped (%s)",
                        job,
                        generation,
                        len(dropped),
                        dropped[0],
                    )
        self.jobs.generations[job] = max(self.jobs.generations.get(job, 0), generation)
        new = plan or DEFAULT_PLAN
        if self.jobs.plans.get(job) == new:
            return
        self.jobs.plans[job] = new
        for store in self.stores.of_job(job):
            tiers, holder = self.tiers.for_plan(new, self.jobs.tiers_of(job))
            store.tiers = tiers
            store.reporter.holder = holder
            store.engine.keep = self.jobs.keep(job)
            store.engine.tiers = list(tiers.values())  # the writer reads it per shard

    def store(self, job: str, rank: int) -> RankStore:
        """Rank ``rank``'s tiers for ``job``, made on first use.

        A new store starts out knowing what this node's tiers already hold of the rank
        (the agent restarted since the rank saved), so that a step the catalog commits
        later still gets its manifest here and counts for retention, and retention never
        takes a committed step for an unknown one: the RAM tier's sealed slots and the
        disk's shards at once; the peer and object tiers (network calls, never on the
        event loop) from one listing each, in a thread that holds ``store.lock`` until
        it is done, so that no catalog is applied to the store before then."""
        store, made = self.stores.get_or_make(job, rank, functools.partial(self._make, job, rank))
        if made and job in self.jobs.catalogs:
            # A store made after the job's latest catalog (a rank moved here, an agent
            # restart): what it already holds gets its manifests now, not at the next commit.
            self.commits.kick(job)
        return store

    def _make(self, job: str, rank: int) -> RankStore:
        keep = self.jobs.keep(job)
        ram = RamTier(
            namespace_for(job, rank),
            job=job,
            directory=self.shm_dir,
            slots=keep["ram"] + 1,
            keep=keep["ram"],
            pin=False,
        )
        tiers, holder = self.tiers.for_plan(self.jobs.plan(job), self.jobs.tiers_of(job))
        reporter = Reporter(self.node, self.publish, holder)
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
            disk = self.tiers.disk
            try:
                store.landed.update(
                    (("nvme", step), None)
                    for step in disk.landed_steps(job)
                    if disk.path(ShardKey(job, step, rank)).is_file()
                )
            except TierError as exc:
                log.warning("ckpt: job %s rank %d: %s", job, rank, exc)
        remote = [t for t in tiers.values() if isinstance(t, ObjectTier)]
        if remote:
            store.lock.acquire()  # released by _seed_remote's thread
            try:
                threading.Thread(
                    target=self._seed_remote,
                    args=(store, remote),
                    daemon=True,
                    name=f"ckpt-seed-{job}-r{rank}",
                ).start()
            except BaseException:
                store.lock.release()
                raise
        reporter.store = store
        log.info("ckpt: job %s rank %d: tiers %s", job, rank, ", ".join(["ram", *tiers]))
        return store

    def _seed_remote(self, store: RankStore, remote: list[ObjectTier]) -> None:
        """What the peer and object tiers hold of a new store's rank (see ``store``); then
        ``store.lock``, held since the store was made, is released."""
        job, rank = store.job, store.rank
        try:
            for tier in remote:
                suffix = ".zst" if tier.compression else ""
                try:
                    keys = self.tiers.listing(job, tier)
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

    # --- saving ---------------------------------------------------------------------

    async def acquire(self, req: protocol.AcquireRequest) -> protocol.AcquireReply:
        self.jobs.fence(req.job, req.generation)
        store = self.store(req.job, req.rank)
        key = ShardKey(req.job, req.step, req.rank)
        before = set(store.ram.steps(req.job))
        slot = await self._run(
            functools.partial(
                store.ram.acquire, key, req.nbytes, when_busy=req.when_busy, timeout=req.timeout
            )
        )
        if slot is None:
            why = "every RAM slot is still being written down"
            store.engine.report(TierEvent("skipped", "ram", key, None, req.nbytes, 0.0, why))
            return protocol.AcquireReply(skipped=True, why=why)
        store.outstanding[slot.index] = slot
        store.report_reused(before)
        return protocol.AcquireReply(slot=slot.index, path=str(slot.path), capacity=slot.capacity)

    def submit(self, req: protocol.SubmitRequest) -> protocol.SubmitReply:
        job, generation, rank, step = req.job, req.generation, req.rank, req.step
        store = self.stores.get(job, rank)
        slot = store.outstanding.pop(req.slot, None) if store else None
        if store is None or slot is None or slot.step != step or slot.nbytes != req.nbytes:
            raise CkptRequestError(
                f"job {job} rank {rank}: slot {req.slot} was not acquired for "
                f"step {step} of {req.nbytes} bytes",
                status=409,
            )
        if req.abort:
            store.ram.release(slot, keep_content=False)
            return protocol.SubmitReply(aborted=True)
        try:
            before = store.generation_of.pop(step, None)
            store.generation_of[step] = generation  # the newest save last
            while len(store.generation_of) > GENERATIONS_KEPT:  # the oldest saves go first,
                del store.generation_of[next(iter(store.generation_of))]  # not the lowest steps
            # A newer generation saves here (after an agent restart too: what it found on its
            # tiers was an older one's), or saves a step an older one saved here.
            if generation > store.generation or (before is not None and before < generation):
                store.renew(step)
                store.generation = max(store.generation, generation)
            store.engine.submit(slot, ShardKey(job, step, rank))
        except BaseException:
            store.ram.release(slot, keep_content=False)  # never left busy
            raise
        return protocol.SubmitReply(submitted=step)

    async def reserve(self, req: protocol.ReserveRequest) -> protocol.ReserveReply:
        self.jobs.fence(req.job, req.generation)
        store = self.store(req.job, req.rank)
        await self._run(store.ram.reserve, req.nbytes)
        paths = [str(s.path) for s in store.ram.slots if s is not None and s.path.exists()]
        return protocol.ReserveReply(paths=paths)

    def rank_exited(self, job: str, rank: int) -> None:
        """A rank died between acquire and submit: its slot holds nothing; free it."""
        store = self.stores.get(job, rank)
        if store is None:
            return
        for slot in list(store.outstanding.values()):
            store.ram.release(slot, keep_content=False)
        store.outstanding.clear()

    async def wait(self, req: protocol.WaitRequest) -> protocol.WaitReply:
        job, step, timeout = req.job, req.step, req.timeout
        store = self.stores.get(job, req.rank)
        if store is None:
            return protocol.WaitReply()
        deadline = time.monotonic() + timeout
        try:
            await self._run(store.engine.wait, timeout)
        except TierError as exc:  # a write-down failed there: not a copy read
            raise CkptRequestError(str(exc), status=409, tier=exc.tier, step=step) from exc
        except TimeoutError as exc:
            raise CkptRequestError(str(exc), status=504, step=step) from exc
        wanted = self.jobs.tiers_of(job)

        def missing() -> list[str]:
            # Committed by the catalog and applied at this node's tiers (manifest written).
            return [t for t in wanted if store.committed_upto.get(t, -1) < step]

        changed = self.jobs.changed
        async with changed:
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
                    await asyncio.wait_for(changed.wait(), remaining)
        return protocol.WaitReply(committed={t: step for t in wanted})

    # --- lifetime -----------------------------------------------------------------

    async def close(self, timeout: float = 30.0) -> None:
        """Shut down within ``timeout``: start no catalog applier again and give those
        running a few seconds to finish their pass (then cancel them), finish every rank's
        write-down with what is left, and let go of the tiers and threads. The RAM
        segments stay: a restarted agent maps them back. Once is enough."""
        if self._closed:
            return
        self._closed = True
        deadline = Deadline(timeout)
        await self.commits.close(min(APPLIERS_CLOSE_S, deadline.left()))
        loop = asyncio.get_running_loop()
        stores = self.stores.all()
        left = deadline.left()
        closed = await asyncio.gather(
            *(loop.run_in_executor(self.slow, store.close, left) for store in stores),
            return_exceptions=True,
        )
        for store, outcome in zip(stores, closed, strict=True):
            if isinstance(outcome, Exception):
                log.error(
                    "closing the checkpoint store of %s rank %d: %r", store.job, store.rank, outcome
                )
        self.tiers.close()
        self.slow.shutdown(wait=False, cancel_futures=True)
        self.peer_io.shutdown(wait=False, cancel_futures=True)
        self.commit_io.shutdown(wait=False, cancel_futures=True)
