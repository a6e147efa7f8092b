"""The cluster's fixed shape for one pass: nodes, racks, NVLink domains and GPU types as integers.

Every name is replaced by its position in sorted order, so integer
comparisons are the stable tie-breaks "by id" everywhere else.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.scheduler._model import ClusterNode, InvalidInput


@dataclass(frozen=True, slots=True)
class Layout:
    node_ids: tuple[str, ...]  # sorted; a node's index is its position
    index: dict[str, int]
    node_rack: tuple[int, ...]
    node_type: tuple[int, ...]
    node_dom: tuple[int, ...]
    node_gpus: tuple[int, ...]
    schedulable: tuple[bool, ...]
    racks: tuple[str, ...]  # sorted rack names
    types: tuple[str, ...]  # sorted GPU type names
    type_index: dict[str, int]
    max_gpus: int
    type_racks: tuple[tuple[int, ...], ...]  # per type: racks holding nodes of it, sorted
    rack_doms: tuple[dict[int, tuple[int, ...]], ...]  # per type: rack -> its domains, sorted
    dom_nodes: tuple[tuple[int, ...], ...]  # per domain: its nodes, sorted
    dom_rack: tuple[int, ...]
    flat_racks: tuple[frozenset[int], ...]  # per type: racks where every domain is one node
    type_nodes: tuple[tuple[int, ...], ...]  # per type: its nodes, sorted
    rack_pos: tuple[dict[int, int], ...]  # per type: rack -> its position in type_racks
    max_dom_size: tuple[int, ...]  # per type: nodes in its largest NVLink domain

    @classmethod
    def build(cls, nodes: Sequence[ClusterNode]) -> Layout:
        ordered = sorted(nodes, key=lambda node: node.id)
        for before, after in itertools.pairwise(ordered):
            if before.id == after.id:
                raise InvalidInput("nodes", f"node id {after.id!r} appears twice")
        node_ids = tuple(node.id for node in ordered)
        racks = tuple(sorted({node.rack for node in ordered}))
        types = tuple(sorted({node.gpu_type for node in ordered}))
        rack_index = {rack: i for i, rack in enumerate(racks)}
        type_index = {gpu_type: i for i, gpu_type in enumerate(types)}
        node_rack = tuple(rack_index[node.rack] for node in ordered)
        node_type = tuple(type_index[node.gpu_type] for node in ordered)

        # A domain is (rack, type, NVLink name); a node without one is its own domain.
        dom_keys = sorted(
            {
                (
                    node_rack[i],
                    node_type[i],
                    node.nvlink_domain is None,
                    node.nvlink_domain if node.nvlink_domain is not None else node.id,
                )
                for i, node in enumerate(ordered)
            }
        )
        dom_index = {key: d for d, key in enumerate(dom_keys)}
        node_dom = tuple(
            dom_index[
                (
                    node_rack[i],
                    node_type[i],
                    node.nvlink_domain is None,
                    node.nvlink_domain if node.nvlink_domain is not None else node.id,
                )
            ]
            for i, node in enumerate(ordered)
        )
        dom_members: list[list[int]] = [[] for _ in dom_keys]
        for i, d in enumerate(node_dom):
            dom_members[d].append(i)
        dom_rack = tuple(key[0] for key in dom_keys)

        rack_doms: list[dict[int, list[int]]] = [{} for _ in types]
        for d, (rack, gpu_type, _, _) in enumerate(dom_keys):
            rack_doms[gpu_type].setdefault(rack, []).append(d)
        flat_racks = tuple(
            frozenset(
                rack
                for rack, doms in per_type.items()
                if all(len(dom_members[d]) == 1 for d in doms)
            )
            for per_type in rack_doms
        )
        type_racks = tuple(tuple(sorted(per_type)) for per_type in rack_doms)
        return cls(
            node_ids=node_ids,
            index={node_id: i for i, node_id in enumerate(node_ids)},
            node_rack=node_rack,
            node_type=node_type,
            node_dom=node_dom,
            node_gpus=tuple(node.gpus for node in ordered),
            schedulable=tuple(node.schedulable for node in ordered),
            racks=racks,
            types=types,
            type_index=type_index,
            max_gpus=max((node.gpus for node in ordered), default=0),
            type_racks=type_racks,
            rack_doms=tuple(
                {rack: tuple(doms) for rack, doms in per_type.items()} for per_type in rack_doms
            ),
            dom_nodes=tuple(tuple(members) for members in dom_members),
            dom_rack=dom_rack,
            flat_racks=flat_racks,
            type_nodes=tuple(
                tuple(i for i, node_t in enumerate(node_type) if node_t == gpu_type)
                for gpu_type in range(len(types))
            ),
            rack_pos=tuple({rack: j for j, rack in enumerate(per_type)} for per_type in type_racks),
            max_dom_size=tuple(
                max(len(dom_members[d]) for doms in per_type.values() for d in doms)
                for per_type in rack_doms
            ),
        )
