"""Choosing a gang's nodes from per-rack counts of eligible nodes.

A node is *eligible* when it has at least ``g`` available GPUs of the job's
type. The same selection serves the live capacity (starting a job now) and
a projected one (a reservation at a future time), so both take the eligible
count per rack, a per-domain counter and the per-node availability.

``pack`` chooses, in this order: the fewest racks (the largest racks first;
the last rack is the smallest that still covers the remainder, a best fit
that leaves big racks whole), then the fewest NVLink domains inside each
rack (same rule), then the nodes with the fewest available GPUs (best fit),
then the lowest ids. ``spread`` takes one node per rack from the racks with
the most eligible nodes, round-robin when there are more nodes than racks.
The returned node order is rank order: rack, domain, node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from supervisor.scheduler._layout import Layout
from supervisor.scheduler._model import Placement

DomCount = Callable[[int], int]


def min_racks(counts: Sequence[int], n: int) -> int | None:
    """How many racks with these eligible counts hold ``n`` nodes at least; None if all can't."""
    total = 0
    for k, count in enumerate(sorted(counts, reverse=True), start=1):
        if count <= 0:
            break
        total += count
        if total >= n:
            return k
    return None


def select_nodes(
    layout: Layout,
    gpu_type: int,
    n: int,
    g: int,
    placement: Placement,
    required: bool,
    max_racks: int | None,
    rack_counts: Sequence[int],
    dom_count: DomCount,
    avail: Sequence[int],
) -> list[int] | None:
    """``n`` eligible nodes for the job, or None when its placement cannot be met.

    ``rack_counts`` is aligned with ``layout.type_racks[gpu_type]``;
    ``max_racks`` is the rack limit of a required pack (None: no limit).
    """
    racks = layout.type_racks[gpu_type]
    order = sorted(
        (j for j, count in enumerate(rack_counts) if count > 0),
        key=lambda j: (-rack_counts[j], racks[j]),
    )
    if placement is Placement.SPREAD:
        chosen = _spread(order, rack_counts, n, required)
    else:
        chosen = _pack(layout, gpu_type, order, rack_counts, n, max_racks, dom_count)
    if chosen is None:
        return None
    nodes: list[int] = []
    for j, take in chosen:
        nodes.extend(
            _take_from_rack(
                layout,
                gpu_type,
                racks[j],
                take,
                rack_counts[j],
                g,
                dom_count,
                avail,
                by_domain=placement is Placement.PACK,
            )
        )
    node_dom = layout.node_dom
    nodes.sort(key=lambda i: (node_dom[i], i))  # domains sort by rack first
    return nodes


def _spread(
    order: list[int], rack_counts: Sequence[int], n: int, required: bool
) -> list[tuple[int, int]] | None:
    if required:
        return [(j, 1) for j in order[:n]] if len(order) >= n else None
    if sum(rack_counts[j] for j in order) < n:
        return None
    takes = [0] * len(order)
    left = n
    while left:
        for pos, j in enumerate(order):
            if takes[pos] < rack_counts[j]:
                takes[pos] += 1
                left -= 1
                if not left:
                    break
    return [(j, take) for j, take in zip(order, takes, strict=True) if take]


def _pack(
    layout: Layout,
    gpu_type: int,
    order: list[int],
    rack_counts: Sequence[int],
    n: int,
    max_racks: int | None,
    dom_count: DomCount,
) -> list[tuple[int, int]] | None:
    total = 0
    k = 0
    for j in order:
        total += rack_counts[j]
        k += 1
        if total >= n:
            break
    if total < n or (max_racks is not None and k > max_racks):
        return None
    full = order[: k - 1]
    left = n - sum(rack_counts[j] for j in full)
    last = _best_rack(layout, gpu_type, order[k - 1 :], rack_counts, left, dom_count)
    return [(j, rack_counts[j]) for j in full] + [(last, left)]


def _best_rack(
    layout: Layout,
    gpu_type: int,
    candidates: list[int],
    rack_counts: Sequence[int],
    m: int,
    dom_count: DomCount,
) -> int:
    """The rack (position) holding ``m`` nodes in the fewest domains, then the tightest fit."""
    racks = layout.type_racks[gpu_type]
    fitting = sorted(
        (j for j in candidates if rack_counts[j] >= m), key=lambda j: (rack_counts[j], racks[j])
    )
    flat = layout.flat_racks[gpu_type]
    floor = -(-m // layout.max_dom_size[gpu_type])
    best = fitting[0]
    best_domains: int | None = None
    for j in fitting:
        if racks[j] in flat:
            domains = m
        else:
            domains = _domains_needed(layout.rack_doms[gpu_type][racks[j]], m, dom_count)
        if best_domains is None or domains < best_domains:
            best, best_domains = j, domains
            if domains <= floor:
                break
    return best


def _domains_needed(doms: Sequence[int], m: int, dom_count: DomCount) -> int:
    total = 0
    for k, count in enumerate(sorted((dom_count(d) for d in doms), reverse=True), start=1):
        total += count
        if total >= m:
            return k
    return len(doms) + 1  # cannot happen when the rack's count covers m


def _take_from_rack(
    layout: Layout,
    gpu_type: int,
    rack: int,
    take: int,
    eligible: int,
    g: int,
    dom_count: DomCount,
    avail: Sequence[int],
    *,
    by_domain: bool,
) -> list[int]:
    doms = layout.rack_doms[gpu_type][rack]
    dom_nodes = layout.dom_nodes
    if take >= eligible:
        return [i for d in doms for i in dom_nodes[d] if avail[i] >= g]
    if not by_domain or rack in layout.flat_racks[gpu_type]:
        return _best_fit([i for d in doms for i in dom_nodes[d] if avail[i] >= g], take, avail)
    counts = [(dom_count(d), d) for d in doms]
    order = sorted((pair for pair in counts if pair[0] > 0), key=lambda pair: (-pair[0], pair[1]))
    total = 0
    k = 0
    for count, _ in order:
        total += count
        k += 1
        if total >= take:
            break
    nodes = [i for _, d in order[: k - 1] for i in dom_nodes[d] if avail[i] >= g]
    left = take - len(nodes)
    _, last = min(pair for pair in order[k - 1 :] if pair[0] >= left)
    nodes.extend(_best_fit([i for i in dom_nodes[last] if avail[i] >= g], left, avail))
    return nodes


def _best_fit(nodes: list[int], take: int, avail: Sequence[int]) -> list[int]:
    """The ``take`` nodes with the fewest available GPUs (ties: lowest id)."""
    if take >= len(nodes):
        return nodes
    return sorted(nodes, key=lambda i: (avail[i], i))[:take]
