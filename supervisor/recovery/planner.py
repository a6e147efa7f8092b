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
   with that reason; no spare and no restart is spent on it. A rank that failed
   before its first step of a generation that restored step S failed at S: at
   the same step as a failure after step S - 1 or S (a checkpoint's step counts
   the steps done, as most loops save it, or names the last one done).
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
   takes its own ranks back. A *suspect* node (bad only for rank exits and hangs
   of this job and others within the window, healthy but for this recovery's
   quarantine) with no replacement is burned in at once (``Plan.burn_in``); once
   it passed (``JobView.vetted``) it takes its own ranks back (``Plan.reinstate``)
   rather than the job waiting ``spare_wait`` for a spare that cannot come.
5. **Restore.** The newest committed step every rank can read from where it
   will run (a dead node's RAM and disk are gone), and per rank the nearest tier
   that holds it.
6. **Elastic.** A job whose spec is elastic (``JobView.sizes``) and that would wait
   for a replacement (or at once, with ``shrink_first``) shrinks instead: onto its
   healthy nodes (and any replacement found), cut to the largest allowed size, in
   their order. Its global batch stays (the ranks accumulate more micro batches).
   The state is replicated, so each rank of the smaller gang restores a shard saved
   at the larger size: the one its own node saved where it can (RAM), else one read
   from a buddy or the object store (``Plan.sources``). A job whose ranks reshard
   their sharded state (``JobView.reshards``) restores the newest step every node
   of the smaller gang can read every saved shard of (its ranks read those they
   need). A job with no allowed size that fits, or whose state is sharded and not
   resharded (``shrink_blocked``), waits as above, and the reason says why.
7. **Grow.** A shrunk elastic job grows back (:func:`plan_grow`, no failure): onto
   free healthy nodes (``up``, burned in, not spares), to the largest allowed size
   they make up, once the larger gang can read a committed step (the new nodes read
   a buddy's copy or the object store's). The controller asks for it after
   ``elastic.grow_after`` at the size and at the next commit; it costs no restart.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from supervisor.checkpoints.catalog import GangRestore, gang_restore
from supervisor.records import Failure as Failure  # the planner's input, kept below the job
from supervisor.records import FailureKind as FailureKind

TIER_ORDER = ("ram", "nvme", "peer", "object")


GUARD_KINDS = frozenset({FailureKind.LOSS_SPIKE, FailureKind.NAN})


class Cause(enum.StrEnum):
    HARDWARE = "hardware"
    SOFTWARE = "software"


class Action(enum.StrEnum):
    RESTART_IN_PLACE = "restart_in_place"
    REPLACE = "replace"
    WAIT = "wait"
    FAIL = "fail"
    ROLLBACK = "rollback"  # in place, from a checkpoint before a loss spike, data skipped
    SHRINK = "shrink"  # an elastic job, on fewer nodes (rule 6)
    GROW = "grow"  # a shrunk elastic job, back onto more nodes (rule 7)


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
    from_restore: int | None = None  # as Failure.from_restore


@dataclass(frozen=True, slots=True)
class NodeView:
    id: str
    rack: str
    nvlink_domain: str
    gpu_type: str
    gpus: int
    state: str  # "up" | "warn" | "drain" | "offline" (supervisor.fleet.registry.NodeState)
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
    # Nodes of the gang drained by this recovery's own quarantine, and for nothing else
    # since (their "drain" state is then no hardware evidence of its own).
    quarantined: frozenset[str] = frozenset()
    # Suspect nodes (rule 4) that passed a burn-in in this recovery after their quarantine.
    vetted: frozenset[str] = frozenset()
    # Elastic (rule 6): the node counts the job may run on, smallest first (empty: it
    # never changes size); shrink rather than take a replacement; why it may not shrink.
    sizes: tuple[int, ...] = ()
    shrink_first: bool = False
    shrink_blocked: str = ""
    # Its state is replicated (an elastic job): a step saved by a gang of another size
    # restores through ``reshape_sources``.
    replicated: bool = False
    # Its ranks reshard their sharded state (``elastic.reshard``): a step saved by a gang
    # of another size restores when every node can read every saved shard of it.
    reshards: bool = False


@dataclass(frozen=True, slots=True)
class NodeIncident:
    """A failure some job had on a node (for rule 1's cross-job window)."""

    job: str
    node: str
    at: float
    kind: str = ""  # the FailureKind that struck it ("": not known)


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
    # Suspect nodes with no replacement: burn them in now (the plan waits for it) ...
    burn_in: tuple[str, ...] = ()
    # ... and those that passed: undrained, the gang restarts on them (no swap).
    reinstate: tuple[str, ...] = ()
    skip: tuple[int, int] | None = None  # a rollback's steps to skip: [start, stop)
    # A shrink (rule 6): rank -> the saved rank whose shard of ``restore_step`` it
    # restores, for the ranks that do not restore their own.
    sources: Mapping[int, int] = field(default_factory=dict)


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
    suspects = _suspects(job, bad, failures, nodes, now, node_incidents, node_window_s)
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
    reinstate: list[str] = []
    stranded: list[str] = []  # failed nodes with no replacement
    shrink = bool(job.sizes) and not job.shrink_blocked
    not_shrinking = job.shrink_blocked
    if bad and shrink and job.shrink_first and not (bad & suspects):
        # prefer: shrink: no replacement sought, unless the job cannot shrink
        at_once = _shrink(job, failures, job.nodes, sorted(bad), catalog, nodes, cause, quarantine)
        if isinstance(at_once, Plan):
            return at_once
        not_shrinking = at_once
    if bad:
        taken = set(job.nodes)
        for failed in sorted(bad, key=job.nodes.index):
            spare = _replacement(job, nodes.get(failed), nodes, taken)
            if spare is None and failed in suspects and failed in job.vetted:
                reinstate.append(failed)  # it keeps its own ranks
                continue
            if spare is None:
                stranded.append(failed)
                continue
            taken.add(spare)
            new_nodes[job.nodes.index(failed)] = spare
            swaps.append((failed, spare))
        # A stranded suspect is burned in first (rule 4): it may take its ranks back.
        if stranded and shrink and not (set(stranded) & suspects):
            smaller = _shrink(
                job, failures, new_nodes, stranded, catalog, nodes, cause, quarantine, reinstate
            )
            if isinstance(smaller, Plan):
                return smaller
            not_shrinking = smaller
        if stranded:
            failed = stranded[0]
            why = f"no healthy node to take node {failed}'s ranks: " + _shortage(job, nodes, taken)
            if job.sizes:
                why += f"; not shrinking: {not_shrinking}"
            burn_in = tuple(n for n in stranded if n in suspects)
            if burn_in:
                why += (
                    f"; node(s) {', '.join(burn_in)} quarantined on evidence that looks "
                    "like software (rank exits, hangs; no hardware reason): burned in now, "
                    "to take their own ranks back if they pass"
                )
            return Plan(Action.WAIT, why, cause, quarantine=quarantine, burn_in=burn_in)

    placement = _placement(new_nodes, job.ranks_per_node)
    alive = _alive(nodes, failures)
    world = len(new_nodes) * job.ranks_per_node
    found = _gang_restore(job, catalog, world, placement, alive)
    step, note, sources = found.step, found.note, found.sources
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
    restore_from = (
        _tiers(step, catalog, placement, alive, _via(sources), sharded=job.reshards)
        if step is not None
        else {}
    )
    action = Action.REPLACE if swaps else Action.RESTART_IN_PLACE
    how = (
        "restart in place on the same nodes"
        if not swaps
        else "; ".join(f"node {a}'s ranks move to {b}" for a, b in swaps)
    )
    if reinstate:
        how += (
            f"; node(s) {', '.join(reinstate)}, quarantined on evidence that looks like "
            "software (rank exits, hangs; no hardware reason), passed a burn-in and no "
            "other node can take their ranks: the gang restarts on them"
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
        reinstate=tuple(reinstate),
        sources=sources,
    )


SOFTWARE_LIKE = frozenset({FailureKind.RANK_EXIT.value, FailureKind.HANG.value})


def _suspects(
    job: JobView,
    bad: set[str],
    failures: Sequence[Failure],
    nodes: Mapping[str, NodeView],
    now: float,
    incidents: Sequence[NodeIncident],
    window: float,
) -> set[str]:
    """The bad nodes whose only evidence looks like software: this job's rank exits or
    hangs on it and other jobs' within the window (rule 1's cross-job strikes), the node
    healthy but for this recovery's own quarantine. Without a replacement such a node is
    burned in, and takes its own ranks back once it passes (rule 4)."""
    out = set()
    for n in bad:
        view = nodes.get(n)
        if view is None or not (
            view.state in HEALTHY or (view.state == "drain" and n in job.quarantined)
        ):
            continue
        here = [f for f in failures if f.node == n]
        if not here or any(f.kind.value not in SOFTWARE_LIKE for f in here):
            continue
        strikes = [i for i in incidents if i.node == n and i.job != job.id and now - i.at <= window]
        if strikes and all(i.kind in SOFTWARE_LIKE for i in strikes):
            out.add(n)
    return out


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
        if f.kind in (FailureKind.NODE_DRAIN, FailureKind.NODE_OFFLINE) or (
            f.kind is FailureKind.SDC and f.quarantine
        ):
            bad.add(f.node)  # (an SDC no node could be blamed for restarts in place)
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
        steps = _steps(f.step, f.from_restore)
        where = (
            f"at step {f.step}"
            if f.step is not None
            else f"before its first step after restoring step {f.from_restore}"
        )
        for past in job.history:
            if past.kind is not FailureKind.RANK_EXIT or (
                past.code is None and past.signal is None
            ):
                continue
            if steps & _steps(past.step, past.from_restore):
                was = (
                    f" at step {past.step}"
                    if past.step is not None
                    else f" before its first step after restoring step {past.from_restore}"
                )
                return (
                    f"the failure follows the code: rank {f.rank} failed with {exit_} "
                    f"{where}, where the gang failed before too (rank {past.rank} "
                    f"on node {past.node}{was if f.step is None else ''}), after a "
                    "restore; not retried"
                )
            if (past.code, past.signal) != (f.code, f.signal) or f.signal == SIGKILL:
                continue
            if f.rank is not None and past.rank == f.rank and past.node != f.node:
                return (
                    f"the failure follows the code: rank {f.rank} failed with {exit_} on "
                    f"node {past.node} and again on node {f.node}; not retried"
                )
    return ""


def _steps(step: int | None, from_restore: int | None) -> set[int]:
    """The steps a failure struck at: the last one it reported, or, failing before the
    first step after restoring step S, S - 1 or S (as the checkpoint counted it)."""
    if step is not None:
        return {step}
    if from_restore is not None:
        return {from_restore - 1, from_restore}
    return set()


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
    step: int,
    catalog: CatalogView,
    placement: Mapping[int, str],
    alive: set[str],
    source: Callable[[int], int] = lambda rank: rank,
    *,
    sharded: bool = False,
) -> dict[int, str]:
    """rank -> the tier it restores ``step`` from (the nearest that holds its copy).
    ``sharded``: a resharding job's (``JobView.reshards``): where ``step`` was saved by
    another set of ranks, each rank may read any saved shard, so its tier is the
    farthest its node reads one of them from."""
    tiers = catalog.committed.get(step, {})
    if sharded:
        saved = {r for (s, r, _t) in catalog.where if s == step}
        if saved and saved != set(placement):
            return _sharded_tiers(step, catalog, placement, alive, saved)
    out: dict[int, str] = {}
    for rank, node in placement.items():
        for tier in TIER_ORDER:
            if tier not in tiers:
                continue
            if tier == "object":
                out[rank] = tier
                break
            landed, holder = catalog.where.get((step, source(rank), tier), ("", None))
            if tier == "peer":
                if holder is not None and holder in alive:
                    out[rank] = tier
                    break
            elif landed == node and node in alive:
                out[rank] = tier
                break
    return out


def _sharded_tiers(
    step: int,
    catalog: CatalogView,
    placement: Mapping[int, str],
    alive: set[str],
    saved: set[int],
) -> dict[int, str]:
    tiers = catalog.committed.get(step, {})

    def nearest(node: str, rank: int) -> int:
        for i, tier in enumerate(TIER_ORDER):
            if tier not in tiers:
                continue
            if tier == "object":
                return i
            landed, holder = catalog.where.get((step, rank, tier), ("", None))
            if tier == "peer" and holder is not None and holder in alive:
                return i
            if tier in ("ram", "nvme") and landed == node and node in alive:
                return i
        return len(TIER_ORDER)

    farthest = {node: max(nearest(node, r) for r in saved) for node in set(placement.values())}
    return {
        rank: TIER_ORDER[farthest[node]]
        for rank, node in placement.items()
        if farthest[node] < len(TIER_ORDER)
    }


def _shrink(
    job: JobView,
    failures: Sequence[Failure],
    new_nodes: Sequence[str],
    stranded: Sequence[str],
    catalog: CatalogView,
    nodes: Mapping[str, NodeView],
    cause: Cause,
    quarantine: tuple[str, ...],
    reinstate: Sequence[str] = (),
) -> Plan | str:
    """Rule 6: the gang on its healthy nodes, cut to the largest allowed size, restoring
    the newest step every rank of it can read; else why not. Its own healthy nodes come
    first (they hold its copies), then the replacements found for failed ones."""
    own = [n for n, m in zip(job.nodes, new_nodes, strict=True) if n == m and n not in stranded]
    healthy = own + [m for n, m in zip(job.nodes, new_nodes, strict=True) if n != m]
    fits = [n for n in job.sizes if n <= len(healthy)]
    if not fits:
        return (
            f"no allowed size ({', '.join(map(str, job.sizes))} nodes) fits the "
            f"{len(healthy)} healthy node(s) left"
        )
    size = fits[-1]
    kept = tuple(healthy[:size])
    placement = _placement(kept, job.ranks_per_node)
    alive = _alive(nodes, failures)
    world = size * job.ranks_per_node
    found = _gang_restore(job, catalog, world, placement, alive)
    step, note, sources = found.step, found.note, found.sources
    if step is None and catalog.committed:
        # Committed steps, none this gang can read whole: restarting from scratch would
        # throw away the run. Wait (a node may come back with its copies).
        return f"no committed step the {size}-node gang can read whole ({note})"
    restore_from = (
        _tiers(step, catalog, placement, alive, _via(sources), sharded=job.reshards)
        if step is not None
        else {}
    )
    first = failures[0]
    dropped = [n for n in job.nodes if n not in kept]
    frm = f"from step {step}" if step is not None else "from scratch (nothing committed)"
    return Plan(
        Action.SHRINK,
        f"{first.describe()}: no healthy node to take node(s) {', '.join(stranded)}'s "
        f"ranks; elastic: shrinking from {len(job.nodes)} to {size} node(s) "
        f"({', '.join(kept)}; leaving {', '.join(dropped)}), the global batch kept, {frm}",
        cause,
        nodes=kept,
        quarantine=quarantine,
        swaps=tuple(
            (a, b) for a, b in zip(job.nodes, new_nodes, strict=True) if a != b and b in kept
        ),
        restore_step=step,
        restore_note=note if step is None else "",
        restore_from=restore_from,
        reinstate=tuple(n for n in reinstate if n in kept),
        sources=sources,
    )


def _gang_restore(
    job: JobView,
    catalog: CatalogView,
    world: int,
    placement: Mapping[int, str],
    alive: set[str],
) -> GangRestore:
    """The step a gang of ``world`` ranks on ``placement`` restores (``gang_restore``, as
    the job's state allows: replicated, resharded by its ranks, or neither)."""
    return gang_restore(
        catalog.committed,
        catalog.where,
        world,
        placement,
        alive,
        elastic=job.replicated,
        sharded=job.reshards,
    )


def _placement(nodes: Sequence[str], ranks_per_node: int) -> dict[int, str]:
    """rank -> node of a gang on ``nodes`` (by GROUP_RANK)."""
    return {
        gr * ranks_per_node + lr: node
        for gr, node in enumerate(nodes)
        for lr in range(ranks_per_node)
    }


def _via(sources: Mapping[int, int]) -> Callable[[int], int]:
    """rank -> the saved rank whose shard it reads."""
    return lambda rank: sources.get(rank, rank)


def _alive(nodes: Mapping[str, NodeView], failures: Sequence[Failure]) -> set[str]:
    """The nodes not offline: one reported offline is dead even while the fleet view
    still says otherwise."""
    return {n for n, v in nodes.items() if v.state != "offline"} - {
        f.node for f in failures if f.kind is FailureKind.NODE_OFFLINE
    }


def plan_grow(job: JobView, nodes: Mapping[str, NodeView], catalog: CatalogView) -> Plan | None:
    """Rule 7: the job on its nodes and free healthy ones, at the largest allowed size
    larger than its own that they make up and that can restore a committed step
    (nothing committed: from scratch); None when there is none."""
    size = len(job.nodes)
    if any(n not in nodes or nodes[n].state not in HEALTHY for n in job.nodes):
        return None  # a node of its own failed meanwhile: that is a recovery's to plan
    gang = [nodes[n] for n in job.nodes if n in nodes]
    gpu_type = job.gpu_type or (gang[0].gpu_type if gang else None)
    racks = {v.rack for v in gang}
    free = sorted(
        (
            v
            for v in nodes.values()
            if v.id not in job.nodes
            and v.state in PLACEABLE
            and not v.busy
            and not v.spare  # kept for failures
            and v.burned_in
            and v.gpus >= job.ranks_per_node
            and (gpu_type is None or v.gpu_type == gpu_type)
        ),
        key=lambda v: (v.rack not in racks, v.rack, v.id),
    )
    alive = _alive(nodes, ())
    for target in sorted((n for n in job.sizes if size < n <= size + len(free)), reverse=True):
        added = tuple(v.id for v in free[: target - size])
        grown = (*job.nodes, *added)
        placement = _placement(grown, job.ranks_per_node)
        found = _gang_restore(job, catalog, target * job.ranks_per_node, placement, alive)
        if found.step is None and catalog.committed:
            continue  # the new nodes can read no committed step yet
        sources = found.sources
        restore_from = (
            _tiers(found.step, catalog, placement, alive, _via(sources), sharded=job.reshards)
            if found.step is not None
            else {}
        )
        frm = f"from step {found.step}" if found.step is not None else "from scratch"
        return Plan(
            Action.GROW,
            f"elastic: growing from {size} to {target} node(s) onto {', '.join(added)}, "
            f"the global batch kept, {frm}",
            Cause.SOFTWARE,
            nodes=grown,
            restore_step=found.step,
            restore_from=restore_from,
            sources=sources,
        )
    return None


def plan_regrow(job: JobView, nodes: Mapping[str, NodeView], catalog: CatalogView) -> Plan:
    """A grow's plan once its gang is stopped: :func:`plan_grow`, or, when the nodes it
    was to take are gone meanwhile, the gang again on its own nodes."""
    grown = plan_grow(job, nodes, catalog)
    if grown is not None:
        return grown
    placement = _placement(job.nodes, job.ranks_per_node)
    alive = _alive(nodes, ())
    found = _gang_restore(job, catalog, len(placement), placement, alive)
    return Plan(
        Action.RESTART_IN_PLACE,
        f"elastic: the nodes to grow onto are taken or cannot read a checkpoint: "
        f"restarting on the same {len(job.nodes)} node(s)",
        Cause.SOFTWARE,
        nodes=tuple(job.nodes),
        restore_step=found.step,
        restore_note=found.note,
        restore_from=_tiers(
            found.step, catalog, placement, alive, _via(found.sources), sharded=job.reshards
        )
        if found.step is not None
        else {},
        sources=found.sources,
    )
