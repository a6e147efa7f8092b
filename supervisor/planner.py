"""The recovery planner: a failed job's state in, one recovery decision out.

Pure, like the scheduler: no I/O, no clock (``now`` is an input), so every
rule below is tested exhaustively and the planner can be timed at 16k GPUs.

The rules, in the order they are applied:

1. **Classify.** A node that went offline or turned ``drain`` is a hardware
   failure of that node. A rank exit or a hang is hardware when its node is
   now ``drain`` or ``offline``, or when that node was involved in a failure of
   another job within ``node_window_s`` (quarantine follows the hardware);
   otherwise it is a software failure of the process and its nodes are healthy.
2. **Follows the code.** A software failure at the same step as an earlier rank
   exit of the job (whichever rank and exit were reported first: a bystander
   that aborted when the culprit died is often first), or whose rank failed the
   same way on another node, is the code's, not the hardware's: the job fails
   with that reason; no spare and no restart is spent on it.
3. **Budget.** A job that has used ``max_restarts`` recoveries fails, with its
   history; so does one whose last three recoveries restored the same step
   (no checkpoint progress).
4. **Placement.** Software: the gang restarts in place, same nodes. Hardware:
   each failed node is quarantined and its ranks (same GROUP_RANK, same global
   ranks) go to a healthy node: a spare in the failed node's rack first, then one
   in its NVLink domain, then any spare, then any idle healthy node; always of the
   job's GPU model with enough GPUs; never a drained or offline node. With none,
   the job waits (as ``recovering``, with the reason); a failed node that an
   operator undrained and that passed its burn-in since (``JobView.cleared``)
   takes its own ranks back.
5. **Restore.** The newest committed step every rank can read from where it
   will run (a dead node's RAM and disk are gone), and per rank the nearest tier
   that holds it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from supervisor.catalog import gang_step

TIER_ORDER = ("ram", "nvme", "peer", "object")


class FailureKind(enum.StrEnum):
    RANK_EXIT = "rank_exit"
    NODE_DRAIN = "node_drain"
    NODE_OFFLINE = "node_offline"
    HANG = "hang"


class Cause(enum.StrEnum):
    HARDWARE = "hardware"
    SOFTWARE = "software"


class Action(enum.StrEnum):
    RESTART_IN_PLACE = "restart_in_place"
    REPLACE = "replace"
    WAIT = "wait"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Failure:
    """One classified failure signal and its culprit."""

    kind: FailureKind
    node: str
    rank: int | None = None
    code: int | None = None
    signal: int | None = None
    step: int | None = None  # the culprit's last reported step
    detail: str = ""
    generation: int = 0
    # False for a node whose agent was stopped on purpose: replaced, but not drained.
    quarantine: bool = True

    def describe(self) -> str:
        where = (
            f"node {self.node}" if self.rank is None else f"rank {self.rank} on node {self.node}"
        )
        match self.kind:
            case FailureKind.RANK_EXIT if self.signal is not None:
                what = f"{where} was killed by signal {self.signal}"
            case FailureKind.RANK_EXIT if self.code is not None:
                what = f"{where} exited with code {self.code}"
            case FailureKind.RANK_EXIT:
                what = f"{where} was lost"
            case FailureKind.NODE_DRAIN:
                what = f"{where} was drained"
            case FailureKind.NODE_OFFLINE:
                what = f"{where} went offline"
            case FailureKind.HANG:
                what = f"the gang hung; culprit {where}"
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{what}{at}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True, slots=True)
class PastFailure:
    """A failure the job recovered from (or tried to), as the job's history keeps it."""

    kind: FailureKind
    node: str
    rank: int | None
    code: int | None
    signal: int | None
    step: int | None
    restored_step: int | None  # what the recovery that followed restored (None: none)


@dataclass(frozen=True, slots=True)
class NodeView:
    id: str
    rack: str
    nvlink_domain: str
    gpu_type: str
    gpus: int
    state: str  # "up" | "warn" | "drain" | "offline" (supervisor.registry.NodeState)
    busy: bool = False  # runs (or holds) another job
    spare: bool = False  # held back in the spare pool
    burned_in: bool = True  # passed its burn-in since it last came back


@dataclass(frozen=True, slots=True)
class CatalogView:
    """The job's committed checkpoints: step -> tier -> commit time, and where each
    rank's copy of each step lies: (step, rank, tier) -> (landed on node, holder)."""

    committed: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    where: Mapping[tuple[int, int, str], tuple[str, str | None]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JobView:
    id: str
    nodes: tuple[str, ...]  # by GROUP_RANK
    ranks_per_node: int
    gpu_type: str | None
    max_restarts: int
    restarts_used: int
    use_spares: bool
    history: tuple[PastFailure, ...] = ()
    # Failed nodes of this recovery that were undrained and passed a burn-in since: the
    # gang may go back onto them (a job waiting for a node resumes where it was).
    cleared: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class NodeIncident:
    """A failure some job had on a node (for rule 1's cross-job window)."""

    job: str
    node: str
    at: float


@dataclass(frozen=True, slots=True)
class Plan:
    action: Action
    reason: str
    cause: Cause
    nodes: tuple[str, ...] = ()  # the next generation's nodes, by GROUP_RANK
    quarantine: tuple[str, ...] = ()  # nodes to drain, the failure as reason
    swaps: tuple[tuple[str, str], ...] = ()  # (failed node, its replacement)
    restore_step: int | None = None
    restore_note: str = ""
    restore_from: Mapping[int, str] = field(default_factory=dict)  # rank -> tier


NODE_WINDOW_S = 3600.0
NO_PROGRESS_RESTORES = 3
HEALTHY = frozenset({"up", "warn"})
PLACEABLE = frozenset({"up"})  # new work goes to "up" nodes only, as the scheduler's does


def plan_recovery(
    job: JobView,
    failures: Sequence[Failure],
    nodes: Mapping[str, NodeView],
    catalog: CatalogView,
    *,
    now: float,
    node_incidents: Sequence[NodeIncident] = (),
    node_window_s: float = NODE_WINDOW_S,
) -> Plan:
    """Decide how ``job`` recovers from ``failures`` (one signal or several that arrived
    together, e.g. every rank of a lost node). ``nodes`` is the fleet."""
    if not failures:
        raise ValueError(f"job {job.id}: a recovery plan needs a failure")
    bad = _hardware_nodes(job, failures, nodes, now, node_incidents, node_window_s)
    first = failures[0]
    cause = Cause.HARDWARE if bad else Cause.SOFTWARE

    if cause is Cause.SOFTWARE:
        repeated = _follows_the_code(job, failures)
        if repeated:
            return Plan(Action.FAIL, repeated, cause)
    quarantine = tuple(sorted(bad - {f.node for f in failures if not f.quarantine}))
    if job.restarts_used >= job.max_restarts:
        if job.max_restarts == 0:  # no recovery asked for: the failure is the reason
            return Plan(Action.FAIL, first.describe(), cause, quarantine=quarantine)
        return Plan(
            Action.FAIL,
            f"restart budget spent: {job.restarts_used} of "
            f"max_restarts {job.max_restarts} used; last failure: {first.describe()}",
            cause,
            quarantine=quarantine,
        )

    new_nodes = list(job.nodes)
    swaps: list[tuple[str, str]] = []
    if bad:
        taken = set(job.nodes)
        for failed in sorted(bad, key=job.nodes.index):
            spare = _replacement(job, nodes.get(failed), nodes, taken)
            if spare is None:
                why = f"no healthy node to take node {failed}'s ranks: " + _shortage(
                    job, nodes, taken
                )
                return Plan(Action.WAIT, why, cause, quarantine=quarantine)
            taken.add(spare)
            new_nodes[job.nodes.index(failed)] = spare
            swaps.append((failed, spare))

    placement = {
        gr * job.ranks_per_node + lr: node
        for gr, node in enumerate(new_nodes)
        for lr in range(job.ranks_per_node)
    }
    # A node reported offline is dead even while the fleet view still says otherwise.
    alive = {n for n, v in nodes.items() if v.state != "offline"} - {
        f.node for f in failures if f.kind is FailureKind.NODE_OFFLINE
    }
    world = len(new_nodes) * job.ranks_per_node
    step, note = gang_step(catalog.committed, catalog.where, world, placement, alive)
    if step is not None:
        same = [h.restored_step for h in job.history[-NO_PROGRESS_RESTORES:]]
        if len(same) == NO_PROGRESS_RESTORES and all(s == step for s in same):
            return Plan(
                Action.FAIL,
                f"no checkpoint progress: the last {NO_PROGRESS_RESTORES} "
                f"recoveries all restored step {step}; last failure: "
                f"{first.describe()}",
                cause,
                quarantine=quarantine,
            )
    restore_from = _tiers(step, catalog, placement, alive) if step is not None else {}
    action = Action.REPLACE if swaps else Action.RESTART_IN_PLACE
    how = (
        "restart in place on the same nodes"
        if not swaps
        else "; ".join(f"node {a}'s ranks move to {b}" for a, b in swaps)
    )
    frm = f"from step {step}" if step is not None else "from scratch (nothing committed)"
    return Plan(
        action,
        f"{first.describe()}: {how}, {frm}",
        cause,
        nodes=tuple(new_nodes),
        quarantine=quarantine,
        swaps=tuple(swaps),
        restore_step=step,
        restore_note=note,
        restore_from=restore_from,
    )


def _hardware_nodes(
    job: JobView,
    failures: Sequence[Failure],
    nodes: Mapping[str, NodeView],
    now: float,
    incidents: Sequence[NodeIncident],
    window: float,
) -> set[str]:
    bad: set[str] = set()
    for f in failures:
        if f.kind in (FailureKind.NODE_DRAIN, FailureKind.NODE_OFFLINE):
            bad.add(f.node)
    # Any node of the gang that is unhealthy now is replaced along with the culprit.
    for n in job.nodes:
        view = nodes.get(n)
        if view is None or view.state not in HEALTHY:
            bad.add(n)
    for f in failures:
        others = {
            i.job
            for i in incidents
            if i.node == f.node and i.job != job.id and now - i.at <= window
        }
        if others:
            bad.add(f.node)
    for n in job.cleared:
        view = nodes.get(n)
        if view is not None and view.state in PLACEABLE and view.burned_in and not view.busy:
            bad.discard(n)
    return bad & set(job.nodes)


# SIGKILL comes from outside the rank (an operator, a node's OOM killer, a crashed agent's
# cleanup): the same rank killed on two nodes says nothing of the code by itself. (Seen in
# the rig's soak: two kills of rank 2, minutes apart, failed a job that had restarts left.)
SIGKILL = 9


def _follows_the_code(job: JobView, failures: Sequence[Failure]) -> str:
    """A rank exit at the same step as an earlier one (whatever the exit: the first rank
    reported may be a bystander that aborted when the culprit died), or the same rank's
    same exit, SIGKILL aside, on another node."""
    for f in failures:
        if f.kind is not FailureKind.RANK_EXIT or (f.code is None and f.signal is None):
            continue
        exit_ = f"signal {f.signal}" if f.signal is not None else f"code {f.code}"
        for past in job.history:
            if past.kind is not FailureKind.RANK_EXIT or (
                past.code is None and past.signal is None
            ):
                continue
            if f.step is not None and past.step == f.step:
                return (
                    f"the failure follows the code: rank {f.rank} failed with {exit_} at "
                    f"step {f.step}, where the gang failed before too (rank {past.rank} "
                    f"on node {past.node}), after a restore; not retried"
                )
            if (past.code, past.signal) != (f.code, f.signal) or f.signal == SIGKILL:
                continue
            if f.rank is not None and past.rank == f.rank and past.node != f.node:
                return (
                    f"the failure follows the code: rank {f.rank} failed with {exit_} on "
                    f"node {past.node} and again on node {f.node}; not retried"
                )
    return ""


def _replacement(
    job: JobView, failed: NodeView | None, nodes: Mapping[str, NodeView], taken: set[str]
) -> str | None:
    def fits(v: NodeView) -> bool:
        return (
            v.state in PLACEABLE
            and v.id not in taken
            and not v.busy
            and v.burned_in
            and v.gpus >= job.ranks_per_node
            and (job.gpu_type is None or v.gpu_type == job.gpu_type)
            and (failed is None or job.gpu_type is not None or v.gpu_type == failed.gpu_type)
        )

    # use_spares: false keeps the job off the spare pool (a plain idle node only).
    candidates = [v for v in nodes.values() if fits(v) and (job.use_spares or not v.spare)]
    if not candidates:
        return None

    def rank(v: NodeView) -> tuple[int, int, int, int, str]:
        rack = failed is not None and v.rack == failed.rack
        domain = (
            failed is not None and bool(v.nvlink_domain) and v.nvlink_domain == failed.nvlink_domain
        )
        # Spares first (that is what they are kept for); a plain idle node only after.
        pool = 0 if v.spare else 1
        return (pool, 0 if rack else 1, 0 if domain else 1, v.gpus, v.id)

    return min(candidates, key=rank).id


def _shortage(job: JobView, nodes: Mapping[str, NodeView], taken: set[str]) -> str:
    spares = [v for v in nodes.values() if v.spare]
    healthy_idle = [
        v for v in nodes.values() if v.state in PLACEABLE and not v.busy and v.id not in taken
    ]
    wrong = [
        v
        for v in healthy_idle
        if v.gpus < job.ranks_per_node or (job.gpu_type and v.gpu_type != job.gpu_type)
    ]
    unburned = [v for v in healthy_idle if not v.burned_in]
    parts = [f"{len(spares)} spare(s)", f"{len(healthy_idle)} idle healthy node(s)"]
    if wrong:
        parts.append(f"{len(wrong)} without {job.ranks_per_node} {job.gpu_type or 'matching'} GPUs")
    if unburned:
        parts.append(f"{len(unburned)} not yet burned in")
    return ", ".join(parts)


def _tiers(
    step: int, catalog: CatalogView, placement: Mapping[int, str], alive: set[str]
) -> dict[int, str]:
    tiers = catalog.committed.get(step, {})
    out: dict[int, str] = {}
    for rank, node in placement.items():
        for tier in TIER_ORDER:
            if tier not in tiers:
                continue
            if tier == "object":
                out[rank] = tier
                break
            landed, holder = catalog.where.get((step, rank, tier), ("", None))
            if tier == "peer":
                if holder is not None and holder in alive:
                    out[rank] = tier
                    break
            elif landed == node and node in alive:
                out[rank] = tier
                break
    return out
