"""Which idle healthy nodes are held back as hot spares.

A spare must be schedulable and completely idle, so a failed node's ranks
can move onto it at once. Spares that were spares before and still qualify
stay spares (the pool does not churn between passes); the rest of the pool
is spread over racks, the rack holding the fewest spares first (ties: rack
order), lowest node id within a rack, so most racks have a spare close by.
When fewer nodes qualify than the pool wants, the pool is short.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

from supervisor.scheduler._layout import Layout


def choose_spares(
    layout: Layout, free: list[int], previous: Collection[str], pool: int
) -> list[int]:
    """Node indices of the spares, sorted."""
    if pool <= 0:
        return []
    idle = [
        i
        for i in range(len(layout.node_ids))
        if layout.schedulable[i] and free[i] == layout.node_gpus[i]
    ]
    kept = [i for i in idle if layout.node_ids[i] in previous][:pool]
    taken = set(kept)
    per_rack: dict[int, list[int]] = {}
    for i in idle:
        if i not in taken:
            per_rack.setdefault(layout.node_rack[i], []).append(i)
    held = dict.fromkeys(per_rack, 0)
    for i in kept:
        if layout.node_rack[i] in held:
            held[layout.node_rack[i]] += 1
    heap = [(held[rack], rack) for rack in per_rack]
    heapq.heapify(heap)
    chosen = list(kept)
    cursor = dict.fromkeys(per_rack, 0)
    while heap and len(chosen) < pool:
        count, rack = heapq.heappop(heap)
        chosen.append(per_rack[rack][cursor[rack]])
        cursor[rack] += 1
        if cursor[rack] < len(per_rack[rack]):
            heapq.heappush(heap, (count + 1, rack))
    return sorted(chosen)
