"""Reserved starts for blocked jobs, projected from when running jobs must end.

Every job that holds GPUs (running before the pass or started in it) is due
to release them at ``start + max_runtime``. Replaying those releases in time
order on a copy of the free GPUs gives the earliest time the blocked job's
placement can be met, and on which nodes. Nodes already reserved for a
higher-ordered job are left out, so two reservations never share a node.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from supervisor.scheduler._capacity import Capacity
from supervisor.scheduler._model import Placement
from supervisor.scheduler._placement import select_nodes

Allocation = tuple[tuple[int, int], ...]  # (node index, GPUs) pairs


@dataclass(frozen=True, slots=True)
class Release:
    """A job's GPUs coming back at ``end``; ``key`` (the job id) makes the order total."""

    end: float
    key: str
    ordinal: int
    allocation: Allocation


@dataclass(frozen=True, slots=True)
class Reservation:
    at: float
    nodes: list[int]
    avail_at: list[int]  # available GPUs on each of ``nodes`` at ``at``


class Timeline:
    """The releases due, in order; preempted jobs are skipped, not removed."""

    def __init__(self, releases: list[Release]) -> None:
        self.releases = sorted(releases, key=lambda r: (r.end, r.key))
        self.cancelled: set[int] = set()

    def add(self, release: Release) -> None:
        bisect.insort(self.releases, release, key=lambda r: (r.end, r.key))


_NEVER = -(1 << 40)


def find_reservation(
    capacity: Capacity,
    timeline: Timeline,
    excluded: set[int],
    t: int,
    n: int,
    g: int,
    placement: Placement,
    required: bool,
    max_racks: int | None,
) -> Reservation | None:
    """The earliest start for a job of type ``t`` on nodes outside ``excluded``, or None."""
    layout = capacity.layout
    if g >= capacity.width:
        return None
    node_type = layout.node_type
    node_rack = layout.node_rack
    pos = layout.rack_pos[t]
    avail = list(capacity.free)
    counts = [0] * len(layout.type_racks[t])
    total = 0
    usable = capacity.usable
    for i in layout.type_nodes[t]:
        if not usable[i] or i in excluded:
            avail[i] = _NEVER
        elif avail[i] >= g:
            counts[pos[node_rack[i]]] += 1
            total += 1
    dom_nodes = layout.dom_nodes

    def dom_count(d: int) -> int:
        return sum(1 for i in dom_nodes[d] if avail[i] >= g)

    releases = timeline.releases
    cancelled = timeline.cancelled
    changed = False
    k = 0
    while k < len(releases):
        end = releases[k].end
        while k < len(releases) and releases[k].end == end:
            release = releases[k]
            k += 1
            if release.ordinal in cancelled:
                continue
            for i, gpus in release.allocation:
                if node_type[i] != t:
                    continue
                old = avail[i]
                avail[i] = old + gpus
                if old < g <= old + gpus:
                    counts[pos[node_rack[i]]] += 1
                    total += 1
                    changed = True
        if changed and total >= n:
            changed = False
            nodes = select_nodes(
                layout, t, n, g, placement, required, max_racks, counts, dom_count, avail
            )
            if nodes is not None:
                return Reservation(end, nodes, [avail[i] for i in nodes])
    return None
