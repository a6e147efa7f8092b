"""Choosing preemption victims that lose the least work.

A victim is a running job that is preemptible and of strictly lower priority
than the job that needs its GPUs. Its lost work is the GPU-seconds since its
last checkpoint.

For each node the job could use, the cheapest way to make it eligible is
found: its victims in order of lost work (then id) until enough GPUs are
freed, then any that turn out unnecessary are dropped again. The job's nodes
are then picked by that cost under its placement constraint, the victims
are evicted, and the ordinary placement runs on what is free. Only victims
on nodes the job actually needed freeing are kept; the rest are put back,
so a preemption happens only when it lets the job start. Costs are counted
per node, so a victim spanning several chosen nodes is counted more than
once while choosing: a heuristic, not an optimum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from supervisor.scheduler._capacity import LONG, Capacity
from supervisor.scheduler._model import Placement
from supervisor.scheduler._reservation import Allocation


@dataclass(frozen=True, slots=True)
class Victim:
    ordinal: int
    job_id: str
    team: str
    priority: int
    gpus_per_node: int
    total_gpus: int
    lost_work: float
    end: float
    allocation: Allocation


@dataclass(frozen=True, slots=True)
class Eviction:
    nodes: list[int]
    victims: list[Victim]


def by_node(victims: Sequence[Victim], n_nodes: int) -> list[list[Victim]]:
    """Each node's candidate victims, cheapest first."""
    per_node: list[list[Victim]] = [[] for _ in range(n_nodes)]
    for victim in sorted(victims, key=lambda v: (v.lost_work, v.job_id)):
        for i, _ in victim.allocation:
            per_node[i].append(victim)
    return per_node


def _node_cost(
    candidates: list[Victim], priority: int, evicted: set[int], deficit: int
) -> tuple[float, tuple[Victim, ...]] | None:
    chosen: list[Victim] = []
    freed = 0
    for victim in candidates:
        if victim.priority >= priority or victim.ordinal in evicted:
            continue
        chosen.append(victim)
        freed += victim.gpus_per_node
        if freed >= deficit:
            break
    else:
        return None
    for victim in sorted(chosen, key=lambda v: (-v.lost_work, v.job_id)):
        if freed - victim.gpus_per_node >= deficit:
            chosen.remove(victim)
            freed -= victim.gpus_per_node
    return sum(v.lost_work for v in chosen), tuple(chosen)


def _pick(
    capacity: Capacity,
    costs: list[tuple[float, int, tuple[Victim, ...]]],
    n: int,
    placement: Placement,
    required: bool,
    max_racks: int | None,
) -> list[tuple[float, int, tuple[Victim, ...]]] | None:
    """``n`` of the costed nodes, cheapest first, within the placement's rack limits."""
    node_rack = capacity.layout.node_rack
    costs.sort(key=lambda c: (c[0], c[1]))
    if not required or (placement is Placement.PACK and max_racks is None):
        return costs[:n] if len(costs) >= n else None
    per_rack: dict[int, list[tuple[float, int, tuple[Victim, ...]]]] = {}
    for cost in costs:
        per_rack.setdefault(node_rack[cost[1]], []).append(cost)
    if placement is Placement.SPREAD:
        firsts = sorted((rows[0] for rows in per_rack.values()), key=lambda c: (c[0], c[1]))
        return firsts[:n] if len(firsts) >= n else None
    assert max_racks is not None
    if max_racks == 1:
        fits = [rows[:n] for rows in per_rack.values() if len(rows) >= n]
        if not fits:
            return None
        return min(fits, key=lambda rows: (math.fsum(c[0] for c in rows), node_rack[rows[0][1]]))
    # A gang over several racks: the racks that can offer the most nodes, then the cheapest.
    racks = sorted(
        per_rack,
        key=lambda rack: (-len(per_rack[rack]), math.fsum(c[0] for c in per_rack[rack]), rack),
    )[:max_racks]
    pool = sorted((c for rack in racks for c in per_rack[rack]), key=lambda c: (c[0], c[1]))
    return pool[:n] if len(pool) >= n else None


def find_eviction(
    capacity: Capacity,
    victims_by_node: list[list[Victim]],
    evicted: set[int],
    v: int,
    t: int,
    n: int,
    g: int,
    placement: Placement,
    required: bool,
    max_racks: int | None,
    priority: int,
) -> Eviction | None:
    """Evict the cheapest victims that let the job start, and return its nodes; or None.

    On success the victims' GPUs are already released in ``capacity`` (the
    caller occupies the job's nodes); on failure ``capacity`` is unchanged.
    """
    layout = capacity.layout
    avail = capacity.avail[v]
    usable = capacity.usable
    node_gpus = layout.node_gpus
    reserved_at = capacity.reserved_at
    costs: list[tuple[float, int, tuple[Victim, ...]]] = []
    for i in layout.type_nodes[t]:
        if not usable[i] or node_gpus[i] < g:
            continue
        a = avail[i]
        if a >= g:
            costs.append((0.0, i, ()))
            continue
        if v == LONG and reserved_at[i] != math.inf:
            continue  # what it may use there depends on the reservation; leave it alone
        cost = _node_cost(victims_by_node[i], priority, evicted, g - a)
        if cost is not None:
            costs.append((cost[0], i, cost[1]))
    picked = _pick(capacity, costs, n, placement, required, max_racks)
    if picked is None:
        return None
    chosen: dict[int, Victim] = {}
    for _, _, node_victims in picked:
        for victim in node_victims:
            chosen.setdefault(victim.ordinal, victim)
    if not chosen:
        return None
    before = {i: avail[i] for victim in chosen.values() for i, _ in victim.allocation}
    for victim in chosen.values():
        for i, gpus in victim.allocation:
            capacity.release(i, gpus, victim.end)
    nodes = capacity.place(v, t, n, g, placement, required, max_racks)
    if nodes is None:
        _restore(capacity, chosen.values())
        return None
    needed = {i for i in nodes if before.get(i, g) < g}
    kept = [victim for victim in chosen.values() if any(i in needed for i, _ in victim.allocation)]
    kept_ordinals = {victim.ordinal for victim in kept}
    _restore(capacity, (vic for vic in chosen.values() if vic.ordinal not in kept_ordinals))
    kept.sort(key=lambda victim: (victim.lost_work, victim.job_id))
    return Eviction(nodes, kept)


def _restore(capacity: Capacity, victims: Iterable[Victim]) -> None:
    for victim in victims:
        for i, gpus in victim.allocation:
            capacity.occupy(i, gpus, victim.end)
