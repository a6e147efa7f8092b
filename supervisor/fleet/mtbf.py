"""The fleet's mean time between node failures, for the ``auto`` checkpoint interval.

A job checkpoints every sqrt(2 x C x MTBF) seconds under ``interval: auto``
(``ckpt.policy``), MTBF being the job's: a node's MTBF over the number of its
nodes. The node MTBF is learned from the supervisor's event log once it has
seen enough failures (``ckpt_mtbf_min_failures``), else the configured
``ckpt_node_mtbf_h``:

* the exposure: for every node, the time since it first joined (its
  ``node_joined`` event), summed;
* the failures: a node going offline other than by a clean shutdown (a last
  will, a heartbeat timeout) and every automatic drain (an ECC error, an XID, a
  lost GPU, ...). An operator's drain or a clean agent stop is no failure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from supervisor.store import Store

__all__ = ["NodeMtbf", "node_mtbf"]


@dataclass(frozen=True, slots=True)
class NodeMtbf:
    seconds: float
    source: str  # "learned" or "configured"
    failures: int
    node_hours: float

    def for_job(self, nodes: int) -> float:
        """The MTBF of a job spread over ``nodes`` nodes (any one failing stops it)."""
        return self.seconds / max(1, nodes)


def node_mtbf(
    store: Store, *, configured_s: float, min_failures: int, now: float | None = None
) -> NodeMtbf:
    now = time.time() if now is None else now
    joined = store.first_events("node_joined")
    exposure = sum(max(0.0, now - ts) for ts in joined.values())
    failures = store.count_node_failures()
    hours = exposure / 3600.0
    if failures >= min_failures and exposure > 0:
        return NodeMtbf(exposure / failures, "learned", failures, hours)
    return NodeMtbf(configured_s, "configured", failures, hours)
