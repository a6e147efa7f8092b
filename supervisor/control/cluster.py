"""The fleet and the jobs as the pure scheduler sees them (:class:`ClusterState`).

The controller builds one before every scheduling pass, from the registry's
nodes, its jobs and the settings (teams, spare pool); the scheduler
(:func:`supervisor.scheduler.schedule`) then decides from it alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from supervisor.config import SupervisorSettings
from supervisor.fleet.registry import Node, NodeState
from supervisor.jobs import Job, JobState
from supervisor.scheduler import (
    ClusterNode,
    ClusterState,
    PendingJob,
    Placement,
    RunningJob,
    TeamShare,
)

USAGE_WINDOW_S = 86400.0  # a team's fair share counts its GPU-seconds of the last day


def cluster_state(
    nodes: Iterable[Node],
    jobs: Collection[Job],
    settings: SupervisorSettings,
    *,
    needs_burn_in: Callable[[str], bool],
    previous_spares: Iterable[str],
    now: float,
) -> ClusterState:
    """``needs_burn_in(node)``: back from a drain, not burned in since (not schedulable);
    ``previous_spares``: the spare pool of the last pass."""
    found = []
    for node in nodes:
        if node.birth is None or not node.birth.gpus:
            continue
        found.append(
            ClusterNode(
                id=node.id,
                rack=node.birth.topology.rack,
                gpus=len(node.birth.gpus),
                gpu_type=node.birth.gpus[0].model,
                nvlink_domain=node.birth.topology.nvlink_domain,
                # Back from a drain, a node takes work once its burn-in passed.
                schedulable=node.state is NodeState.UP and not needs_burn_in(node.id),
            )
        )
    known = {n.id for n in found}
    running, pending = [], []
    for job in jobs:
        spec = job.spec
        held = list(job.nodes)
        if job.recovery is not None and job.recovery.plan is not None:
            # the nodes its relaunch will use are held too
            held += [n for n in job.recovery.plan.nodes if n not in held]
        if job.state.holds_nodes and all(n in known for n in held):
            running.append(
                RunningJob(
                    id=job.id,
                    team=spec.team,
                    priority=spec.priority,
                    nodes=tuple(held),
                    gpus_per_node=spec.ranks_per_node,
                    preemptible=spec.preemptible,
                    start_time=job.started_at or now,
                    max_runtime=spec.max_runtime,
                )
            )
        elif job.state is JobState.PENDING:
            pending.append(
                PendingJob(
                    id=job.id,
                    team=spec.team,
                    priority=spec.priority,
                    nodes=spec.nodes,
                    gpus_per_node=spec.ranks_per_node,
                    max_runtime=spec.max_runtime,
                    submit_time=job.submitted_at,
                    gpu_type=spec.gpu_type,
                    placement=Placement(spec.placement.policy),
                    placement_required=spec.placement.required,
                    preemptible=spec.preemptible,
                )
            )
    teams = tuple(
        TeamShare(
            team=name, gpu_quota=t.gpu_quota, weight=t.weight, usage=team_usage(jobs, name, now)
        )
        for name, t in sorted(settings.teams.items())
    )
    return ClusterState(
        now=now,
        nodes=tuple(sorted(found, key=lambda n: n.id)),
        running=tuple(running),
        pending=tuple(pending),
        teams=teams,
        spare_pool=settings.spares,
        previous_spares=frozenset(previous_spares),
    )


def team_usage(jobs: Iterable[Job], team: str, now: float) -> float:
    """GPU-seconds of the team's jobs over the last day (a plain window, no decay)."""
    total = 0.0
    for job in jobs:
        if job.spec.team != team or job.started_at is None:
            continue
        end = job.ended_at or now
        start = max(job.started_at, now - USAGE_WINDOW_S)
        if end > start:
            total += (end - start) * job.world_size
    return total
