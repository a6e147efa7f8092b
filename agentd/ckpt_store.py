"""What the agent keeps of one rank's checkpoints on this node, and how it refuses a
rank's request: shared by the checkpoint service (``agentd.ckpt``) and its restores
(``agentd.ckpt_restore``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt import Engine, RamTier, ShardKey, Tier, TierEvent, TierManifest
from ckpt.ram import Slot
from phalanx import wire

if TYPE_CHECKING:
    from agentd.ckpt import CkptService

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
    renews: int = 0  # times a newer generation renewed the store (CkptService._renew) ...
    renewed_from: int = 0  # ... and the step the last renewal took effect from
    lock: threading.Lock = field(default_factory=threading.Lock)

    def report_reused(self, before: set[int]) -> None:
        """Report as deleted at RAM the sealed steps whose slots were reused since the RAM
        tier held ``before`` (its ``steps`` then)."""
        for gone in sorted(before - set(self.ram.steps(self.job))):
            self.engine.report(TierEvent("deleted", "ram", ShardKey(self.job, gone, self.rank)))


class Reporter:
    """The engine's catalog under an agent: report each landing, never commit locally."""

    def __init__(self, service: CkptService, holder: dict[str, str | None]) -> None:
        self.service = service
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
        self.service.publish(
            wire.CkptLanding(
                node=self.service.node,
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
