"""The checkpoint catalog: which steps of a job are committed at which tier.

Agents report every shard that lands at (or is deleted from) a tier
(``CkptLanding``). A step is *committed* at a tier once every rank of the job
has a shard there, each checked against its seal by the agent that stored it;
the catalog (in the supervisor's SQLite store) then records the commit and
the job's ``CkptCatalog`` is published, retained, on ``phalanx/v1/job/JOB/ckpt``.
Agents write the step's manifest at their tiers and apply retention when
they see it, and answer their ranks' restores from it. A deletion (retention)
removes the step at that tier from the catalog.

``pick_buddies`` chooses each node's peer-tier buddy: a pure function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx import wire
from supervisor.store import Store

log = logging.getLogger(__name__)


def pick_buddies(nodes: Sequence[str], racks: Mapping[str, str]) -> dict[str, str]:
    """Each node's buddy: another node of the gang, in another rack where one exists.

    The nodes are ordered rack by rack and each node's buddy is the next one in
    the ring, shifted by half a ring when that lands in another rack: with two
    racks or more, every copy leaves its rack; no node holds more than one
    other node's copies. A gang of one node has no buddy.
    """
    if len(nodes) < 2:
        return {}
    ring = sorted(nodes, key=lambda n: (racks.get(n, ""), n))
    size = len(ring)
    best = 1
    for shift in range(1, size):
        if all(racks.get(ring[i], "") != racks.get(ring[(i + shift) % size], "")
               for i in range(size)):
            best = shift
            break
    else:
        # No shift moves every copy off its rack: take the one that moves the most.
        best = max(range(1, size), key=lambda s: (sum(
            racks.get(ring[i], "") != racks.get(ring[(i + s) % size], "")
            for i in range(size)), -s))
    return {ring[i]: ring[(i + best) % size] for i in range(size)}


class CheckpointCatalog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def on_landing(self, msg: wire.CkptLanding, world_size: int) -> bool:
        """Record a landing or deletion; True when a commit appeared or went."""
        if msg.event == "failed":
            self.store.add_event("ckpt_failed", msg.node, {
                "job": msg.job, "step": msg.step, "rank": msg.rank, "tier": msg.tier,
                "error": msg.error})
            return False
        if msg.event == "deleted":
            # Retention is the same on every node, and one agent's deletion at a shared
            # tier (the object store) removes every rank's shard: the step is gone there.
            return self.store.drop_step(msg.job, msg.step, msg.tier)
        self.store.add_shard(msg.job, msg.step, msg.tier, msg.rank, msg.node, msg.holder,
                             msg.nbytes, msg.checksum, msg.at)
        if self.store.shard_ranks(msg.job, msg.step, msg.tier) < world_size:
            return False
        if not self.store.add_commit(msg.job, msg.step, msg.tier, time.time()):
            return False
        self.store.add_event("ckpt_committed", None, {"job": msg.job, "step": msg.step,
                                                      "tier": msg.tier})
        log.info("job %s: step %d committed at tier %s", msg.job, msg.step, msg.tier,
                 extra={"job": msg.job, "event": "ckpt_committed", "step": msg.step,
                        "tier": msg.tier})
        return True

    def message(self, job: str, world_size: int) -> wire.CkptCatalog:
        """The job's committed steps, newest ``MAX_CATALOG_STEPS``, for the agents."""
        committed: dict[int, dict[str, float]] = {}
        for step, tier, at in self.store.commits(job):
            committed.setdefault(step, {})[tier] = at
        # Every step lists every rank's checksum (~80 bytes each): fewer steps for big jobs,
        # so that the message stays under the wire's payload limit.
        fit = max(1, (wire.MAX_PAYLOAD_BYTES * 3 // 4) // (80 * world_size))
        keep = sorted(committed)[-min(wire.MAX_CATALOG_STEPS, fit):]
        shards: dict[int, dict[int, wire.CkptShard]] = {s: {} for s in keep}
        for step, _tier, rank, _node, _holder, nbytes, checksum in self.store.shards(job):
            if step in shards and rank not in shards[step]:
                shards[step][rank] = wire.CkptShard(rank=rank, checksum=checksum, nbytes=nbytes)
        return wire.CkptCatalog(job=job, world_size=world_size, steps=[
            wire.CkptStep(step=s, committed=committed[s],
                          shards=sorted(shards[s].values(), key=lambda x: x.rank))
            for s in keep])

    def view(self, job: str, world_size: int, tiers: Sequence[str]) -> dict[str, Any]:
        """Every step with a shard anywhere: committed tiers, and partial ones (ranks there)."""
        steps: dict[int, dict[str, Any]] = {}
        for step, tier, rank, node, holder, nbytes, _checksum in self.store.shards(job):
            entry = steps.setdefault(step, {"step": step, "committed": {}, "partial": {},
                                            "bytes": {}, "where": {}})
            entry["partial"][tier] = entry["partial"].get(tier, 0) + 1
            entry["bytes"][tier] = entry["bytes"].get(tier, 0) + nbytes
            entry["where"].setdefault(tier, {})[str(rank)] = holder or node
        for step, tier, at in self.store.commits(job):
            if step in steps:
                steps[step]["committed"][tier] = at
                steps[step]["partial"].pop(tier, None)
        return {"job": job, "world_size": world_size, "tiers": list(tiers),
                "steps": [steps[s] for s in sorted(steps)]}
