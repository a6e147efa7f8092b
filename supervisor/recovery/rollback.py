"""The rollback planner: a loss guard's trip in, one decision out. Pure, like
:mod:`supervisor.recovery.planner` (no I/O, no clock: ``now`` is an input).

A rank's loss guard (:mod:`phalanx.guard`) tripped at step ``trip`` on a loss that went
bad at step ``onset`` (a NaN, or a spike that lasted ``patience`` steps). The rules:

1. **Budget.** ``max_rollbacks`` rollbacks within ``rollback_window`` (seconds); one
   more fails the job, with a reason that says so.
2. **Restore.** The newest committed step at or before ``onset - margin`` that every
   rank can read where it runs (the gang restarts in place, same nodes). A checkpoint
   labelled ``s`` holds the state before step ``s``: step ``onset`` itself is clean.
   When nothing was ever committed, the gang starts afresh; when steps were committed
   but none that old is readable, the job fails (a rollback past every checkpoint
   would throw the whole run away).
3. **Skip.** The steps from the restored one through the trip, ``[restore, trip + 1)``:
   the data read between the checkpoint and the onset, and the spike's own steps.

Every checkpoint the rolled-back generations saved after the restored step holds (or
may hold) the spike's weights: :func:`void` names them, and the supervisor forgets them
and ignores their late landings (:mod:`supervisor.recovery.rollbacks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from phalanx.guard import merge_ranges
from supervisor.checkpoints.catalog import gang_restore
from supervisor.recovery.planner import Action, CatalogView, Cause, Failure, Plan


@dataclass(frozen=True, slots=True)
class RollbackView:
    """What a rollback needs of the job: its gang and its ``guard:`` block, and when its
    earlier rollbacks happened."""

    id: str
    nodes: tuple[str, ...]  # by GROUP_RANK
    ranks_per_node: int
    margin: int
    max_rollbacks: int
    rollback_window_s: float
    past: tuple[float, ...] = ()  # the times of its earlier rollbacks
    replicated: bool = False  # an elastic job's: a step saved at another size restores
    reshards: bool = False  # elastic.reshard: every node reads every shard saved at another size


def plan_rollback(
    job: RollbackView,
    failure: Failure,
    catalog: CatalogView,
    *,
    now: float,
    alive: Set[str] | None = None,
) -> Plan:
    """Decide how ``job`` rolls back from a guard's ``failure`` (``step``: the trip,
    ``onset``: where the loss went bad). ``alive``: the nodes not offline (None: all)."""
    trip = failure.step if failure.step is not None else (failure.onset or 0)
    onset = min(failure.onset if failure.onset is not None else trip, trip)
    recent = [t for t in job.past if now - t <= job.rollback_window_s]
    if len(recent) >= job.max_rollbacks:
        return Plan(
            Action.FAIL,
            f"rollback budget spent: {len(recent)} rollback(s) within "
            f"{_duration(job.rollback_window_s)} (guard.max_rollbacks {job.max_rollbacks}); "
            f"last: {failure.describe()}",
            Cause.SOFTWARE,
        )
    ceiling = onset - job.margin
    older = {s: tiers for s, tiers in catalog.committed.items() if s <= ceiling}
    placement = {
        gr * job.ranks_per_node + lr: node
        for gr, node in enumerate(job.nodes)
        for lr in range(job.ranks_per_node)
    }
    world = len(job.nodes) * job.ranks_per_node
    found = gang_restore(
        older,
        catalog.where,
        world,
        placement,
        alive,
        elastic=job.replicated,
        sharded=job.reshards,
    )
    step, note = found.step, found.note
    if step is None and catalog.committed:
        why = note or (
            f"none of the {len(catalog.committed)} committed step(s) is at or before step "
            f"{ceiling} (the onset, {onset}, less guard.margin {job.margin})"
        )
        return Plan(
            Action.FAIL,
            f"{failure.describe()}: no checkpoint before the spike to roll back to: {why}",
            Cause.SOFTWARE,
        )
    start = step if step is not None else 0
    skip = (start, max(trip + 1, start))
    frm = f"step {step}" if step is not None else "scratch (nothing committed)"
    return Plan(
        Action.ROLLBACK,
        f"{failure.describe()}: roll back to {frm} and skip steps {skip[0]}-{skip[1] - 1}",
        Cause.SOFTWARE,
        nodes=tuple(job.nodes),
        restore_step=step,
        restore_note=note if step is None else "",
        skip=skip,
    )


def void(
    commits: Iterable[tuple[int, str]], rollbacks: Sequence[Mapping[str, int]]
) -> list[tuple[int, str]]:
    """The committed (step, tier) pairs that a rollback voids: newer than the step it
    restored (``after``; -1: none, every step). Generations are not looked at here: the
    pairs are those committed when the rollback is applied, all of the rolled-back run."""
    if not rollbacks:
        return []
    after = rollbacks[-1]["after"]
    return sorted((s, t) for s, t in commits if s > after)


def skip_ranges(rollbacks: Sequence[Mapping[str, object]]) -> tuple[tuple[int, int], ...]:
    """Every rollback's skipped steps, merged."""
    ranges = []
    for r in rollbacks:
        skip = r.get("skip")
        if isinstance(skip, list | tuple) and len(skip) == 2:
            ranges.append((int(skip[0]), int(skip[1])))
    return merge_ranges(ranges)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
