"""What the agent keeps of one rank's checkpoints on this node (``RankStore``), and every
rank's store of the node (``RankStores``).

A ``RankStore`` is the rank's RAM tier (segments the agent owns, outliving the rank),
the engine writing its shards down the job's tiers, and the bookkeeping of what landed
where and what the supervisor's catalog committed there (``agentd.ckpt.commits``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from ckpt import Engine, RamTier, ShardKey, Slot, Tier, TierEvent, TierManifest, protocol
from phalanx import wire

__all__ = ["TIER_ORDER", "Publish", "RankStore", "RankStores", "Reporter"]

log = logging.getLogger(__name__)

TIER_ORDER: Final[tuple[protocol.TierName, ...]] = ("ram", "nvme", "peer", "object")

Publish = Callable[[wire.CkptLanding | wire.CkptReleased], None]


@dataclass
class RankStore:
    job: str
    rank: int
    ram: RamTier
    engine: Engine
    tiers: dict[str, Tier]
    reporter: Reporter
    outstanding: dict[int, Slot] = field(default_factory=dict)  # acquired, not submitted
    # (tier, step) -> the checksum of the copy this node landed there last (None: landed
    # before an agent restart, its checksum unknown)
    landed: dict[tuple[str, int], str | None] = field(default_factory=dict)
    applied: set[tuple[str, int, str | None]] = field(default_factory=set)  # + the checksum
    committed_upto: dict[str, int] = field(default_factory=dict)  # tier -> newest applied
    generation: int = 0  # the newest generation that saved here
    generation_of: dict[int, int] = field(default_factory=dict)  # step -> generation saving it
    # tier -> (step, why) of the newest manifest write there that failed (until one takes)
    commit_errors: dict[str, tuple[int, str]] = field(default_factory=dict)
    renews: int = 0  # times a newer generation renewed the store (``renew``) ...
    renewed_from: int = 0  # ... and the step the last renewal took effect from
    lock: threading.Lock = field(default_factory=threading.Lock)

    def report_reused(self, before: set[int]) -> None:
        """Report as deleted at RAM the sealed steps whose slots were reused since the RAM
        tier held ``before`` (its ``steps`` then)."""
        for gone in sorted(before - set(self.ram.steps(self.job))):
            self.engine.report(TierEvent("deleted", "ram", ShardKey(self.job, gone, self.rank)))

    def renew(self, step: int) -> None:
        """A newer generation saves ``step`` here: from it on, what an older one landed and
        committed is being saved anew (it restored an older step), so that ``wait`` waits
        for the new commits and the applier writes their manifests, not the old ones. Runs
        on the event loop, lock-free: an ``apply`` under way sees ``renews`` change and
        records none of what it commits from ``step`` on."""
        self.renewed_from, self.renews = step, self.renews + 1
        for key in [k for k in list(self.landed) if k[1] >= step]:  # list(): one GIL hold
            self.landed.pop(key, None)
        self.applied = {mark for mark in list(self.applied) if mark[1] < step}
        for tier, (failed, _why) in list(self.commit_errors.items()):
            if failed >= step:
                self.commit_errors.pop(tier, None)
        for tier, upto in list(self.committed_upto.items()):
            self.committed_upto[tier] = min(upto, step - 1)
        # Retention, too, stops counting them: else the RAM tier would keep the older
        # save of a newer step and delete the newer generation's saves in its favour.
        seen = self.engine.committed
        for tier in list(seen):
            seen[tier] = {s for s in list(seen[tier]) if s < step}
        in_ram = set(self.ram.steps(self.job)) & seen.get(self.ram.name, set())
        self.ram.newest_committed = max(in_ram, default=None)

    def close(self, timeout: float, *, free: bool = False) -> None:
        """Finish the write-down (up to ``timeout``) and let go of what the store owns: the
        peer tier's connections (the disk tier and the object store are the node's, shared)
        and the RAM tier's maps. The RAM segments stay for a restarted agent to map back;
        ``free`` (the job ended): they are removed, each sealed step reported deleted.
        Blocks: call it in a thread."""
        try:
            self.engine.close(timeout)
        except Exception:
            log.exception("closing the checkpoint engine of %s rank %d", self.job, self.rank)
        if free:
            for step in self.ram.steps(self.job):
                self.engine.report(TierEvent("deleted", "ram", ShardKey(self.job, step, self.rank)))
        if "peer" in self.tiers:
            try:
                self.tiers["peer"].close()
            except Exception as exc:
                log.warning("closing the peer tier of %s rank %d: %s", self.job, self.rank, exc)
        if free:
            self.ram.unlink()
        else:
            self.ram.close()


class RankStores:
    """Every rank's store on this node, by ``(job, rank)``; safe to use from the event
    loop and from threads alike."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[tuple[str, int], RankStore] = {}

    def __getitem__(self, key: tuple[str, int]) -> RankStore:
        with self._lock:
            return self._by[key]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._by

    def __len__(self) -> int:
        with self._lock:
            return len(self._by)

    def get(self, job: str, rank: int) -> RankStore | None:
        with self._lock:
            return self._by.get((job, rank))

    def get_or_make(
        self, job: str, rank: int, make: Callable[[], RankStore]
    ) -> tuple[RankStore, bool]:
        """Rank ``rank``'s store, made by ``make`` (under the lock: never twice) when there
        is none yet; and whether it was made now."""
        with self._lock:
            found = self._by.get((job, rank))
            if found is not None:
                return found, False
            store = self._by[(job, rank)] = make()
            return store, True

    def of_job(self, job: str) -> list[RankStore]:
        with self._lock:
            return [s for (j, _), s in self._by.items() if j == job]

    def take_job(self, job: str) -> list[RankStore]:
        """Remove the job's stores, and return them."""
        with self._lock:
            return [self._by.pop(k) for k in list(self._by) if k[0] == job]

    def all(self) -> list[RankStore]:
        with self._lock:
            return list(self._by.values())


class Reporter:
    """The engine's catalog under an agent: report each landing, never commit locally."""

    def __init__(self, node: str, publish: Publish, holder: dict[str, str | None]) -> None:
        self.node = node
        self.publish = publish
        self.holder = holder
        self.store: RankStore | None = None

    def landed(
        self, tier: str, key: ShardKey, checksum: str, nbytes: int, *, staged_by: int | None = None
    ) -> TierManifest | None:
        """Report a shard landed at ``tier``, saved by the generation that saved the step
        here; ``staged_by``: a copy of it a restore of that generation staged in RAM."""
        if self.store is not None:
            self.store.landed[(tier, key.step)] = checksum
        if staged_by is not None:
            generation = staged_by
        else:
            generation = self.store.generation_of.get(key.step, 0) if self.store else 0
        self.publish(
            wire.CkptLanding(
                node=self.node,
                job=key.job,
                step=key.step,
                rank=key.rank,
                tier=tier,
                event="landed" if staged_by is None else "staged",
                nbytes=nbytes,
                checksum=checksum,
                holder=self.holder.get(tier),
                generation=generation,
                at=time.time(),
            )
        )
        return None
