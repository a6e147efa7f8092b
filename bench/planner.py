"""Benchmark of the recovery planner; prints one JSON object.

The wall time of one `plan_recovery` call for a node of a large job going
offline, median, p95 and min over ``--runs`` calls, on a simulated fleet
(default 2,048 nodes x 8 GPUs in 64 racks, NVLink domains of 8 nodes, 128
spares: the last two nodes of each rack) running one job on every other node
(1,920 nodes, 15,360 ranks). The job's catalog holds ``--steps`` committed
steps, each with a copy of every rank's shard in RAM and on NVMe where the rank
runs, at its node's peer-tier buddy (``pick_buddies``) and in the object store.

Two catalogs are timed:

* ``object_all``: every step is committed at all four tiers (the newest step
  is whole at the object store, so the gang's step is found at once and the
  time is the spare search and each rank's tier);
* ``object_lag``: the newest ``--object-lag`` steps are not at the object store
  yet (its upload trails), so the planner checks every rank's copies of the
  newest step: the dead node's ranks read theirs from their buddies.

    .venv/bin/python bench/planner.py                      # full scale
    .venv/bin/python bench/planner.py --nodes 256 --racks 8 --job-nodes 240 --spares 16
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from supervisor.checkpoints.catalog import pick_buddies
from supervisor.recovery.planner import (
    TIER_ORDER,
    CatalogView,
    Failure,
    FailureKind,
    JobView,
    NodeIncident,
    NodeView,
    PastFailure,
    Plan,
    plan_recovery,
)

GPU_TYPE = "h100"
STEP_EVERY = 500
NOW = 1_000_000.0


def build_fleet(
    n_nodes: int, n_racks: int, gpus: int, domain_size: int, spares_per_rack: int
) -> dict[str, NodeView]:
    """Nodes n00000... rack by rack; the last ``spares_per_rack`` of each rack are spares."""
    per_rack = math.ceil(n_nodes / n_racks)
    fleet = {}
    for i in range(n_nodes):
        rack, slot = divmod(i, per_rack)
        spare = slot >= per_rack - spares_per_rack
        node_id = f"n{i:05d}"
        fleet[node_id] = NodeView(
            id=node_id,
            rack=f"r{rack:03d}",
            nvlink_domain=f"r{rack:03d}-nvl{slot // domain_size}",
            gpu_type=GPU_TYPE,
            gpus=gpus,
            state="up",
            busy=not spare,
            spare=spare,
        )
    return fleet


def build_catalog(
    nodes: Sequence[str],
    racks: dict[str, str],
    ranks_per_node: int,
    steps: int,
    object_lag: int,
) -> CatalogView:
    buddy = pick_buddies(nodes, racks)
    committed: dict[int, dict[str, float]] = {}
    where: dict[tuple[int, int, str], tuple[str, str | None]] = {}
    newest = steps * STEP_EVERY
    for k in range(1, steps + 1):
        step = k * STEP_EVERY
        tiers = TIER_ORDER if step <= newest - object_lag * STEP_EVERY else TIER_ORDER[:3]
        committed[step] = {tier: NOW - (newest - step) for tier in tiers}
        for gr, node in enumerate(nodes):
            holder = buddy[node]
            for lr in range(ranks_per_node):
                rank = gr * ranks_per_node + lr
                where[(step, rank, "ram")] = (node, None)
                where[(step, rank, "nvme")] = (node, None)
                where[(step, rank, "peer")] = (node, holder)
    return CatalogView(committed, where)


def time_plans(
    job: JobView,
    failures: list[Failure],
    fleet: dict[str, NodeView],
    catalog: CatalogView,
    incidents: list[NodeIncident],
    runs: int,
) -> dict[str, object]:
    times = []
    plan: Plan | None = None
    for _ in range(runs):
        began = time.perf_counter()
        plan = plan_recovery(job, failures, fleet, catalog, now=NOW, node_incidents=incidents)
        times.append(time.perf_counter() - began)
    assert plan is not None
    times.sort()
    tiers: dict[str, int] = {}
    for tier in plan.restore_from.values():
        tiers[tier] = tiers.get(tier, 0) + 1
    return {
        "median_ms": round(statistics.median(times) * 1000, 2),
        "p95_ms": round(times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)] * 1000, 2),
        "min_ms": round(times[0] * 1000, 2),
        "action": plan.action.value,
        "swaps": [list(swap) for swap in plan.swaps],
        "restore_step": plan.restore_step,
        "ranks_by_tier": dict(sorted(tiers.items())),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=2048, help="GPU nodes in the fleet")
    parser.add_argument("--racks", type=int, default=64, help="racks they are spread over")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node (= ranks per node)")
    parser.add_argument("--domain-size", type=int, default=8, help="nodes per NVLink domain")
    parser.add_argument(
        "--spares", type=int, default=128, help="spare nodes, spread evenly over the racks"
    )
    parser.add_argument("--job-nodes", type=int, default=1920, help="nodes the job runs on")
    parser.add_argument("--steps", type=int, default=16, help="committed steps in the catalog")
    parser.add_argument(
        "--object-lag",
        type=int,
        default=2,
        help="newest steps not yet at the object store, in the object_lag case",
    )
    parser.add_argument("--runs", type=int, default=21, help="timed calls per case")
    args = parser.parse_args(argv)

    fleet = build_fleet(
        args.nodes, args.racks, args.gpus, args.domain_size, max(1, args.spares // args.racks)
    )
    workers = [n for n, v in fleet.items() if not v.spare]
    if len(workers) < args.job_nodes:
        parser.error(f"--job-nodes {args.job_nodes}: only {len(workers)} nodes are not spares")
    members = workers[: args.job_nodes]
    for idle in workers[args.job_nodes :]:
        fleet[idle] = replace(fleet[idle], busy=False)
    dead = members[len(members) // 2 + 3]  # a node mid-job, not at a rack's edge
    fleet[dead] = replace(fleet[dead], state="offline")
    job = JobView(
        id="big",
        nodes=tuple(members),
        ranks_per_node=args.gpus,
        gpu_type=GPU_TYPE,
        max_restarts=10,
        restarts_used=3,
        use_spares=True,
        history=tuple(
            PastFailure(
                FailureKind.RANK_EXIT,
                members[k * 97],
                k * 97 * args.gpus,
                1,
                None,
                (k + 5) * STEP_EVERY,
                (k + 4) * STEP_EVERY,
            )
            for k in range(3)
        ),
    )
    failures = [Failure(FailureKind.NODE_OFFLINE, dead, detail="heartbeats stopped")]
    incidents = [
        NodeIncident(f"other{k}", f"n{k * 7 % args.nodes:05d}", NOW - k * 60.0) for k in range(50)
    ]
    racks = {n: fleet[n].rack for n in members}

    began = time.perf_counter()
    catalogs = {
        "object_all": build_catalog(members, racks, args.gpus, args.steps, 0),
        "object_lag": build_catalog(members, racks, args.gpus, args.steps, args.object_lag),
    }
    build_s = time.perf_counter() - began
    result: dict[str, object] = {
        "fleet": {
            "nodes": args.nodes,
            "racks": args.racks,
            "gpus_per_node": args.gpus,
            "gpus": args.nodes * args.gpus,
            "nvlink_domain_nodes": args.domain_size,
            "spares": sum(v.spare for v in fleet.values()),
        },
        "job": {"nodes": len(members), "ranks": len(members) * args.gpus, "failed_node": dead},
        "catalog": {
            "steps": args.steps,
            "tiers": len(TIER_ORDER),
            "copies": len(catalogs["object_all"].where),
            "build_s": round(build_s, 2),
        },
        "python": platform.python_version(),
        "runs": args.runs,
        "plan": {
            name: time_plans(job, failures, fleet, cat, incidents, args.runs)
            for name, cat in catalogs.items()
        },
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
