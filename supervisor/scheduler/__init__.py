"""The gang scheduler: a pure function from cluster state to decisions.

    decisions = schedule(ClusterState(now=..., nodes=..., running=..., pending=...))

The supervisor builds the state from its registry and store, runs a pass
and carries the decisions out; the pass itself reads no clock and does no
I/O, so the same state always gives the same decisions.

* `_model` — the input and output values and the errors;
* `_pass` — `schedule`, with the rules in the order they apply;
* `_placement` — which nodes a gang gets (racks, NVLink domains, best fit);
* `_capacity` — the free-GPU index a pass updates as it goes;
* `_reservation` — reserved starts of blocked jobs, which backfill respects;
* `_preemption` — choosing victims that lose the least work;
* `_spares` — which idle nodes are held back as hot spares;
* `_layout` — the cluster's racks, domains and types as integers.
"""

from __future__ import annotations

from supervisor.scheduler._model import (
    ClusterNode,
    ClusterState,
    Decisions,
    InvalidInput,
    PendingJob,
    Placement,
    Preempt,
    RunningJob,
    SchedulerError,
    Start,
    TeamShare,
    Wait,
    WaitReason,
)
from supervisor.scheduler._pass import schedule

__all__ = [
    "ClusterNode",
    "ClusterState",
    "Decisions",
    "InvalidInput",
    "PendingJob",
    "Placement",
    "Preempt",
    "RunningJob",
    "SchedulerError",
    "Start",
    "TeamShare",
    "Wait",
    "WaitReason",
    "schedule",
]
