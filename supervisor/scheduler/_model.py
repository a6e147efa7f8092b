"""What the gang scheduler reads and what it decides.

Everything here is a frozen value: the supervisor builds a `ClusterState`
from its registry and store, calls `schedule`, and acts on the `Decisions`.
Times are seconds on one clock the caller chooses (``now`` included); the
scheduler never reads a clock of its own.

Single values are checked where they are built (a negative GPU count names
its field); facts that need the whole state (unknown node ids, an overbooked
node, duplicate ids) are checked by `schedule`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class SchedulerError(Exception):
    """Base of the scheduler's errors."""


class InvalidInput(SchedulerError, ValueError):
    """A field of the scheduler's input is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _check_id(field: str, value: str) -> None:
    if not value:
        raise InvalidInput(field, "must be a non-empty string")


def _check_positive(field: str, value: float) -> None:
    if not value > 0 or math.isinf(value):
        raise InvalidInput(field, f"must be a positive finite number, got {value!r}")


def _check_finite(field: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidInput(field, f"must be a finite number, got {value!r}")


class Placement(enum.StrEnum):
    """How a multi-node job's nodes relate to racks."""

    PACK = "pack"  # as few racks (then NVLink domains) as possible
    SPREAD = "spread"  # as many racks as possible (one node per rack when it can)


class WaitReason(enum.StrEnum):
    """Why a pending job did not start in this pass."""

    RESOURCES = "resources"  # not enough free nodes of its shape, even before this pass's starts
    QUOTA = "quota"  # starting it would exceed its team's hard GPU quota
    PRIORITY = "priority"  # the capacity it needs went to higher-ordered jobs in this pass
    TOPOLOGY = "topology"  # enough free nodes, but not in the racks its placement requires
    RESERVATION = "reservation"  # it fits now, but would delay a reserved higher-ordered job


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One GPU node as the scheduler sees it.

    ``schedulable`` is False for a node that is drained, in ``warn`` or
    offline (the registry decides); such a node is never used, and never held
    as a spare. ``nvlink_domain`` names the node's NVLink/NVSwitch domain
    within its rack (for example one NVL72 tray set); None means the node is a
    domain of its own.
    """

    id: str
    rack: str
    gpus: int
    gpu_type: str
    nvlink_domain: str | None = None
    schedulable: bool = True

    def __post_init__(self) -> None:
        _check_id("node.id", self.id)
        _check_id(f"node {self.id}: rack", self.rack)
        _check_id(f"node {self.id}: gpu_type", self.gpu_type)
        if self.gpus < 1:
            raise InvalidInput(f"node {self.id}: gpus", f"must be at least 1, got {self.gpus}")


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job that holds GPUs now.

    It holds ``gpus_per_node`` GPUs on each of ``nodes``. Its reserved end is
    ``start_time + max_runtime`` (clamped to ``now`` if it overran); lost work
    if it is preempted is ``(now - last_checkpoint_time) x its GPUs``, counted
    from ``start_time`` when it never checkpointed.
    """

    id: str
    team: str
    priority: int
    nodes: tuple[str, ...]
    gpus_per_node: int
    preemptible: bool
    start_time: float
    max_runtime: float
    last_checkpoint_time: float | None = None

    def __post_init__(self) -> None:
        _check_id("running.id", self.id)
        _check_id(f"running job {self.id}: team", self.team)
        if not self.nodes:
            raise InvalidInput(f"running job {self.id}: nodes", "must name at least one node")
        if len(set(self.nodes)) != len(self.nodes):
            raise InvalidInput(f"running job {self.id}: nodes", "names a node twice")
        if self.gpus_per_node < 1:
            raise InvalidInput(
                f"running job {self.id}: gpus_per_node",
                f"must be at least 1, got {self.gpus_per_node}",
            )
        _check_finite(f"running job {self.id}: start_time", self.start_time)
        _check_positive(f"running job {self.id}: max_runtime", self.max_runtime)
        if self.last_checkpoint_time is not None:
            _check_finite(f"running job {self.id}: last_checkpoint_time", self.last_checkpoint_time)

    @property
    def total_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A job waiting for its gang.

    It needs ``nodes`` nodes with ``gpus_per_node`` free GPUs each (its
    ``ranks_per_node``), all of one ``gpu_type`` (any one type when None).
    ``placement_required`` turns the placement into a constraint: ``pack``
    then only starts in the fewest racks the job could ever occupy on this
    cluster, ``spread`` only with every node in its own rack. ``preemptible``
    is carried for the caller (it matters once the job runs); the pass does
    not read it.
    """

    id: str
    team: str
    priority: int
    nodes: int
    gpus_per_node: int
    max_runtime: float
    submit_time: float
    gpu_type: str | None = None
    placement: Placement = Placement.PACK
    placement_required: bool = False
    preemptible: bool = False

    def __post_init__(self) -> None:
        _check_id("pending.id", self.id)
        _check_id(f"pending job {self.id}: team", self.team)
        if self.nodes < 1:
            raise InvalidInput(
                f"pending job {self.id}: nodes", f"must be at least 1, got {self.nodes}"
            )
        if self.gpus_per_node < 1:
            raise InvalidInput(
                f"pending job {self.id}: gpus_per_node",
                f"must be at least 1, got {self.gpus_per_node}",
            )
        _check_positive(f"pending job {self.id}: max_runtime", self.max_runtime)
        _check_finite(f"pending job {self.id}: submit_time", self.submit_time)
        if self.gpu_type is not None:
            _check_id(f"pending job {self.id}: gpu_type", self.gpu_type)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class TeamShare:
    """A team's hard GPU quota (None: no cap) and its fair-share standing.

    Pending jobs of equal priority go in order of ``usage / weight``, lowest
    first. ``usage`` is the team's recent consumption in whatever unit the
    caller keeps (decayed GPU-seconds, say); only its ratio matters. A team
    without a `TeamShare` has no quota and counts as zero usage.
    """

    team: str
    gpu_quota: int | None = None
    weight: float = 1.0
    usage: float = 0.0

    def __post_init__(self) -> None:
        _check_id("team.team", self.team)
        if self.gpu_quota is not None and self.gpu_quota < 0:
            raise InvalidInput(
                f"team {self.team}: gpu_quota", f"must be 0 or more, got {self.gpu_quota}"
            )
        _check_positive(f"team {self.team}: weight", self.weight)
        if not (math.isfinite(self.usage) and self.usage >= 0):
            raise InvalidInput(f"team {self.team}: usage", f"must be 0 or more, got {self.usage}")


@dataclass(frozen=True, slots=True)
class ClusterState:
    """The whole input of one scheduling pass.

    ``spare_pool`` idle healthy nodes are held back as hot spares; the pass
    picks which ones, keeping ``previous_spares`` where they are still idle
    and healthy so the choice does not churn. ``reservation_depth`` is how
    many of the highest-ordered blocked jobs get a reserved start that
    backfill must not delay; ``max_preemptions`` caps how many jobs may start
    by preemption in one pass (each may evict several victims).
    """

    now: float
    nodes: tuple[ClusterNode, ...]
    running: tuple[RunningJob, ...] = ()
    pending: tuple[PendingJob, ...] = ()
    teams: tuple[TeamShare, ...] = ()
    spare_pool: int = 0
    previous_spares: frozenset[str] = frozenset()
    reservation_depth: int = 4
    max_preemptions: int = 8

    def __post_init__(self) -> None:
        _check_finite("now", self.now)
        if self.spare_pool < 0:
            raise InvalidInput("spare_pool", f"must be 0 or more, got {self.spare_pool}")
        if self.reservation_depth < 0:
            raise InvalidInput(
                "reservation_depth", f"must be 0 or more, got {self.reservation_depth}"
            )
        if self.max_preemptions < 0:
            raise InvalidInput("max_preemptions", f"must be 0 or more, got {self.max_preemptions}")


@dataclass(frozen=True, slots=True)
class Start:
    """Start ``job_id`` on ``nodes`` (rank order: rack, NVLink domain, node id).

    ``preempts`` lists the running jobs that must stop (gracefully) before the
    ranks can start: their GPUs are the ones this start uses.
    """

    job_id: str
    nodes: tuple[str, ...]
    gpus_per_node: int
    preempts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Preempt:
    """Stop ``victim_id`` (checkpoint, SIGTERM, grace, SIGKILL) so ``for_job_id`` can start.

    ``lost_work`` is GPU-seconds since its last checkpoint; the victim goes
    back to the queue.
    """

    victim_id: str
    for_job_id: str
    lost_work: float


@dataclass(frozen=True, slots=True)
class Wait:
    """A pending job that does not start in this pass, and why.

    ``reserved_start``/``reserved_nodes`` are set when the job holds a
    reservation: backfill in this pass did not delay it, on the assumption
    that running jobs end by their ``max_runtime``.
    """

    job_id: str
    reason: WaitReason
    detail: str
    reserved_start: float | None = None
    reserved_nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Decisions:
    """The outcome of one pass: every pending job appears in ``starts`` or ``waits``.

    ``waits`` is in scheduling order (the queue position the CLI shows);
    ``spares`` are the node ids held back as hot spares, sorted.
    """

    starts: tuple[Start, ...]
    preemptions: tuple[Preempt, ...]
    waits: tuple[Wait, ...]
    spares: tuple[str, ...]
