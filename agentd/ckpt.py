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
newer one is committed at that tier. ``restore`` answers from the catalog:
committed steps, newest first, each with where this node can read a copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt import (
    DiskTier,
    Engine,
    LocalFolderStore,
    ObjectStore,
    ObjectTier,
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
from ckpt.ram import Slot
from phalanx import wire

log = logging.getLogger(__name__)

DEFAULT_PLAN = wire.CkptPlan(tiers=["ram", "nvme", "object"])
TIER_ORDER = ("ram", "nvme", "peer", "object")


class CkptRequestError(Exception):
    """A rank's request the agent refuses; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


@dataclass
class RankStore:
    job: str
    rank: int
    ram: RamTier
    engine: Engine
    tiers: dict[str, Tier]
    reporter: _Reporter
    outstanding: dict[int, Slot] = field(default_factory=dict)  # acquired, not submitted
    landed: set[tuple[str, int]] = field(default_factory=set)
    applied: set[tuple[str, int]] = field(default_factory=set)
    committed_upto: dict[str, int] = field(default_factory=dict)  # tier -> newest applied
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Reporter:
    """The engine's catalog under an agent: report each landing, never commit locally."""

    def __init__(self, service: CkptService, holder: dict[str, str | None]) -> None:
        self.service = service
        self.holder = holder
        self.store: RankStore | None = None

    def landed(self, tier: str, key: ShardKey, checksum: str, nbytes: int) -> TierManifest | None:
        if self.store is not None:
            self.store.landed.add((tier, key.step))
        self.service.publish(wire.CkptLanding(
            node=self.service.node, job=key.job, step=key.step, rank=key.rank,
            tier=tier,
            nbytes=nbytes, checksum=checksum, holder=self.holder.get(tier), at=time.time()))
        return None


class CkptService:
    def __init__(self, node: str, data_dir: Path, shm_dir: Path, object_store: str,
                 token: str, publish: Callable[[wire.CkptLanding], None]) -> None:  # fmt: skip
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
        self.disk = DiskTier(self.disk_root, name="nvme")
        self.peer_store = LocalFolderStore(self.peer_root)  # what buddies push to us
        self.plans: dict[str, wire.CkptPlan] = {}
        self.generations: dict[str, int] = {}
        self.stores: dict[tuple[str, int], RankStore] = {}
        self.catalogs: dict[str, wire.CkptCatalog] = {}
        self.changed = asyncio.Condition()
        self._lock = threading.Lock()
        # Own thread pools, never the loop's default one: a rank waiting for a slot, or a
        # commit pushing a manifest to a buddy, can block for long, and a buddy's pushes to
        # us must never queue behind them (two agents would wait on each other).
        self.slow = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="ckpt-req")
        self.peer_io = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="ckpt-peer")

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.slow, fn, *args)

    # --- plumbing ---------------------------------------------------------------

    def publish(self, msg: wire.CkptLanding) -> None:
        self.publish_threadsafe(msg)

    def objects(self) -> ObjectStore:
        if self._objects is None:
            self._objects = open_store(self.object_url)
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
                                                       self.token), name="peer")
                holder["peer"] = b.node
            elif name == "object":
                tiers[name] = ObjectTier(self.objects(), name="object")
        return tiers, holder

    def tiers_of(self, job: str) -> list[str]:
        plan = self.plans.get(job, DEFAULT_PLAN)
        tiers = [t for t in TIER_ORDER if t in plan.tiers or t == "ram"]
        return [t for t in tiers if t != "peer" or plan.buddy is not None]

    def store(self, job: str, rank: int) -> RankStore:
        with self._lock:
            found = self.stores.get((job, rank))
            if found is not None:
                return found
            keep = self._keep(job)
            ram = RamTier(namespace_for(job, rank), job=job, directory=self.shm_dir,
                          slots=keep["ram"] + 1, keep=keep["ram"], pin=False)  # fmt: skip
            tiers, holder = self._tiers(job)
            reporter = _Reporter(self, holder)
            engine = Engine(ram, list(tiers.values()), keep=keep, catalog=reporter,
                            on_event=self._on_event)  # fmt: skip
            store = RankStore(job, rank, ram, engine, tiers, reporter)
            reporter.store = store
            self.stores[(job, rank)] = store
            log.info("ckpt: job %s rank %d: tiers %s", job, rank,
                     ", ".join(["ram", *tiers]))  # fmt: skip
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
        for gone in sorted(before - set(store.ram.steps(job))):  # a sealed slot was reused
            store.engine.report(TierEvent("deleted", "ram", ShardKey(job, gone, rank)))
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
        store.engine.submit(slot, ShardKey(job, step, rank))
        return {"submitted": step}

    async def reserve(self, job: str, generation: int, rank: int, nbytes: int) -> list[str]:
        self._fence(job, generation)
        store = self.store(job, rank)
        await self._run(store.ram.reserve, nbytes)
        return [str(s.path) for s in store.ram.slots if s is not None]

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
        self.catalogs[catalog.job] = catalog
        stores = [s for (job, _), s in list(self.stores.items()) if job == catalog.job]
        for store in stores:
            await self._run(self._apply, store, catalog)
        if catalog.ended:
            await self._run(self._free_ram, catalog.job)
        async with self.changed:
            self.changed.notify_all()

    def _apply(self, store: RankStore, catalog: wire.CkptCatalog) -> None:
        """Commit, at this node's tiers, the steps the supervisor found complete."""
        with store.lock:
            for entry in sorted(catalog.steps, key=lambda e: e.step):
                shards = {s.rank: (s.checksum, s.nbytes) for s in entry.shards}
                for tier in entry.committed:
                    mark = (tier, entry.step)
                    if mark in store.applied or mark not in store.landed:
                        continue
                    store.applied.add(mark)
                    manifest = TierManifest(catalog.job, entry.step, shards,
                                            committed_at=entry.committed[tier])  # fmt: skip
                    if not store.engine.commit(tier, manifest, store.rank):
                        continue  # a failed manifest write: wait() raises it
                    # Only now, with the manifest written here, is the step readable here.
                    store.committed_upto[tier] = max(entry.step,
                                                     store.committed_upto.get(tier, -1))

    def _free_ram(self, job: str) -> None:
        """The job ended: finish its write-downs, then remove its RAM segments."""
        with self._lock:
            stores = [self.stores.pop(k) for k in list(self.stores) if k[0] == job]
        for store in stores:
            try:
                store.engine.close(600.0)
            except Exception:
                log.exception("closing the checkpoint engine of %s rank %d", job, store.rank)
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

    # --- restoring --------------------------------------------------------------------

    def restore_plan(self, job: str, rank: int, step: int | None) -> list[dict[str, Any]]:
        """Committed steps, newest first (or just ``step``), each with the places this
        node can read rank ``rank``'s copy from, nearest first."""
        catalog = self.catalogs.get(job)
        if catalog is None:
            return []
        entries = sorted(catalog.steps, key=lambda e: -e.step)
        if step is not None:
            entries = [e for e in entries if e.step == step]
        store = self.store(job, rank)
        out = []
        for entry in entries:
            shard = next((s for s in entry.shards if s.rank == rank), None)
            if shard is None:
                continue
            base = {"checksum": shard.checksum, "nbytes": shard.nbytes}
            candidates = []
            for tier in TIER_ORDER:
                if tier not in entry.committed:
                    continue
                if tier == "ram":
                    slot = store.ram.find(entry.step)
                    if slot is not None and slot.path.exists():
                        candidates.append({"tier": tier, "path": str(slot.path), **base})
                elif tier == "nvme":
                    shard_path = self.disk_root / ShardKey(job, entry.step, rank).relpath()
                    if shard_path.exists():
                        candidates.append({"tier": tier, "path": str(shard_path), **base})
                elif tier in store.tiers:
                    candidates.append({"tier": tier, **base})
            out.append({"step": entry.step, "candidates": candidates})
        return out

    async def fetch(self, job: str, rank: int, step: int, tier: str) -> bytes:
        store = self.store(job, rank)
        found = store.tiers.get(tier)
        if found is None or tier in ("ram", "nvme"):
            raise CkptRequestError(f"tier {tier!r} is not fetched through the agent for job "
                                   f"{job}", status=404, tier=tier)

        def read() -> bytes:
            stored = found.open(ShardKey(job, step, rank))
            if stored is None:
                return b""
            try:
                return bytes(stored.buffer)
            finally:
                stored.close()

        try:
            data: bytes = await self._run(read)
            return data
        except TierError as exc:
            raise CkptRequestError(str(exc), status=502, tier=tier, step=step) from exc

    # --- lifetime -----------------------------------------------------------------

    async def close(self, timeout: float = 30.0) -> None:
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
