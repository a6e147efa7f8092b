"""One scheduling pass: `schedule(state) -> Decisions`.

The pass is a pure function of its input: no clock, no I/O, no randomness,
and no dependence on the order of the input's tuples (everything is sorted
by id first), so the same state always gives the same decisions.

Pending jobs are considered one at a time in queue order: priority (highest
first), then the team's fair share (``usage / weight``, lowest first), then
submit time, then id. Fair share is read from the input; the starts of this
pass do not re-rank a team within the pass (the caller's next usage figure
does). For each job, in this order:

1. A job that cannot fit the nodes in service (too big, unknown GPU type, a
   required spread over more racks than have such nodes) waits for
   ``resources`` or ``topology`` and gets no reservation. Its detail says
   "can never start" only when it could not fit even with every node the
   cluster knows; else "cannot start yet", counting the nodes that are
   drained, sick or offline (they can return) and those held as spares.
2. A job whose start would take its team past its hard GPU quota waits for
   ``quota``. Quota-blocked jobs never hold others back.
3. It starts if its whole gang can be placed now (see `_placement`). A job
   that would still run when an earlier reservation starts can only use
   GPUs that reservation does not need (see `_capacity`): this is backfill,
   which therefore never delays a reserved start.
4. Otherwise it may preempt (see `_preemption`), at most
   ``max_preemptions`` starts per pass.
5. Otherwise, if it would fit by using reserved GPUs, it waits for
   ``reservation``.
6. Otherwise it waits: ``topology`` when enough nodes are free but not in
   the racks its required placement allows, ``priority`` when enough were
   free at the start of the pass but higher-ordered jobs took them,
   ``resources`` otherwise. The first ``reservation_depth`` such jobs get a
   reserved start (see `_reservation`) that later jobs may not delay.

Placement shares nodes at GPU granularity: a node can run several jobs as
long as their GPUs fit, and each node of a gang needs ``gpus_per_node``
free GPUs. Which GPU indices a job gets on a node is the agent's business;
the scheduler guarantees the count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from supervisor.scheduler._capacity import LONG, SHORT, Capacity
from supervisor.scheduler._layout import Layout
from supervisor.scheduler._model import (
    ClusterState,
    Decisions,
    InvalidInput,
    PendingJob,
    Placement,
    Preempt,
    RunningJob,
    Start,
    TeamShare,
    Wait,
    WaitReason,
)
from supervisor.scheduler._placement import min_racks
from supervisor.scheduler._preemption import Victim, by_node, find_eviction
from supervisor.scheduler._reservation import Allocation, Release, Timeline, find_reservation
from supervisor.scheduler._spares import choose_spares


def schedule(state: ClusterState) -> Decisions:
    """Decide which pending jobs start where, whom they preempt, and why the rest wait.

    Raises `InvalidInput` when the state is inconsistent (a running job on an
    unknown or overbooked node, a duplicate id); the message names the field
    and the ids.
    """
    return _Pass(state).run()


@dataclass(frozen=True, slots=True)
class _Shape:
    """What a pending job's shape allows on this cluster, whatever is free."""

    types: tuple[tuple[int, int | None], ...]  # (GPU type, rack limit of a required pack)
    never: Wait | None  # set when no type can ever hold the job
    text: str  # "4 nodes with 8 free h100 GPUs each"


class _Pass:
    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.now = now = state.now
        self.layout = layout = Layout.build(state.nodes)
        running = sorted(state.running, key=lambda job: job.id)
        free, allocations = _holdings(layout, running, state.pending)

        spares = choose_spares(layout, free, state.previous_spares, state.spare_pool)
        self.spares = spares
        spare_set = set(spares)
        usable = [layout.schedulable[i] and i not in spare_set for i in range(len(layout.node_ids))]
        self.capacity = Capacity(layout, free, usable)
        self.initial_ge = [list(per_type) for per_type in self.capacity.total_ge[SHORT]]

        self.teams: dict[str, TeamShare] = {}
        for team in state.teams:
            if team.team in self.teams:
                raise InvalidInput("teams", f"team {team.team!r} appears twice")
            self.teams[team.team] = team
        self.used: dict[str, int] = {}
        for job in running:
            self.used[job.team] = self.used.get(job.team, 0) + job.total_gpus

        releases = []
        victims = []
        for ordinal, (job, allocation) in enumerate(zip(running, allocations, strict=True)):
            end = max(now, job.start_time + job.max_runtime)
            releases.append(Release(end, job.id, ordinal, allocation))
            if job.preemptible:
                since = (
                    job.start_time
                    if job.last_checkpoint_time is None
                    else (job.last_checkpoint_time)
                )
                victims.append(
                    Victim(
                        ordinal,
                        job.id,
                        job.team,
                        job.priority,
                        job.gpus_per_node,
                        job.total_gpus,
                        max(0.0, now - since) * job.total_gpus,
                        end,
                        allocation,
                    )
                )
        self.timeline = Timeline(releases)
        self.next_ordinal = len(running)
        self.victims_by_node = by_node(victims, len(layout.node_ids))
        self.lowest_victim = min((v.priority for v in victims), default=None)
        self.evicted: set[int] = set()

        self.reserved_nodes: set[int] = set()
        self.first_reserved = math.inf
        self.reservation_tries = 0
        self.preemptions_left = state.max_preemptions
        self.shapes: dict[tuple[str | None, int, int, Placement, bool], _Shape] = {}
        self.static_counts: dict[tuple[int, int], list[int]] = {}
        self.place_fails: dict[tuple[object, ...], int] = {}
        self.evict_fails: dict[tuple[object, ...], int] = {}

        self.starts: list[Start] = []
        self.preemptions: list[Preempt] = []
        self.waits: list[Wait] = []

    # -- the pass ----------------------------------------------------------

    def run(self) -> Decisions:
        teams = self.teams

        def share(team: str) -> float:
            entry = teams.get(team)
            return 0.0 if entry is None else entry.usage / entry.weight

        shares = {job.team: share(job.team) for job in self.state.pending}
        queue = sorted(
            self.state.pending,
            key=lambda job: (-job.priority, shares[job.team], job.submit_time, job.id),
        )
        for job in queue:
            self._consider(job)
        node_ids = self.layout.node_ids
        return Decisions(
            starts=tuple(self.starts),
            preemptions=tuple(self.preemptions),
            waits=tuple(self.waits),
            spares=tuple(node_ids[i] for i in self.spares),
        )

    def _consider(self, job: PendingJob) -> None:
        n = job.nodes
        g = job.gpus_per_node
        shape = self._shape(job)
        if shape.never is not None:
            self.waits.append(shape.never)
            return
        team = self.teams.get(job.team)
        gpus = n * g
        if team is not None and team.gpu_quota is not None:
            used = self.used.get(job.team, 0)
            if used + gpus > team.gpu_quota:
                self.waits.append(
                    Wait(
                        job.id,
                        WaitReason.QUOTA,
                        f"needs {gpus} GPUs; team {job.team} holds {used} of its "
                        f"{team.gpu_quota}-GPU quota",
                    )
                )
                return
        end = self.now + job.max_runtime
        view = SHORT if end <= self.first_reserved else LONG
        for t, max_racks in shape.types:
            nodes = self._place(view, t, job, max_racks)
            if nodes is not None:
                self._start(job, nodes, end, ())
                return
        held_back = None
        if view == LONG:
            for t, max_racks in shape.types:
                held_back = self._place(SHORT, t, job, max_racks)
                if held_back is not None:
                    break
        if self._preempt(job, shape, view, end):
            return
        if held_back is not None:
            self.waits.append(self._blocked_by_reservation(job, held_back))
            return
        self._wait(job, shape, view)

    def _shape(self, job: PendingJob) -> _Shape:
        key = (job.gpu_type, job.nodes, job.gpus_per_node, job.placement, job.placement_required)
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = self._make_shape(job)
        if shape.never is not None and shape.never.job_id != job.id:
            never = Wait(job.id, shape.never.reason, shape.never.detail)
            shape = _Shape(shape.types, never, shape.text)
        return shape

    def _make_shape(self, job: PendingJob) -> _Shape:
        layout = self.layout
        n, g = job.nodes, job.gpus_per_node
        text = _shape_text(job)
        if job.gpu_type is None:
            candidates = list(range(len(layout.types)))
        elif job.gpu_type in layout.type_index:
            candidates = [layout.type_index[job.gpu_type]]
        else:
            detail = f"can never start: no node has GPU type {job.gpu_type}"
            return _Shape((), Wait(job.id, WaitReason.RESOURCES, detail), text)
        types: list[tuple[int, int | None]] = []
        most = 0
        most_racks = 0
        for t in candidates:
            counts = self._static_counts(t, g)
            total = sum(counts)
            racks = sum(1 for count in counts if count)
            most = max(most, total)
            most_racks = max(most_racks, racks)
            if total < n:
                continue
            if job.placement_required and job.placement is Placement.SPREAD:
                if racks < n:
                    continue
                types.append((t, None))
            elif job.placement_required:
                types.append((t, min_racks(counts, n)))
            else:
                types.append((t, None))
        if types:
            return _Shape(tuple(types), None, text)
        # Not with the nodes in service now. Whether it ever could counts every node the
        # cluster knows: a drained, sick or offline node can return, a spare be let go.
        known = max((self._known_counts(t, g) for t in candidates), key=lambda c: c[0])
        known_nodes, known_racks, out, spare = known
        gpus = f"{g} {_gpu_text(job)}GPUs"
        if most >= n:
            if known_racks < n:
                detail = (
                    f"can never start: spread required over {n} racks, but only "
                    f"{known_racks} racks have nodes with {gpus}"
                )
            else:
                detail = (
                    f"cannot start yet: spread required over {n} racks, but only {most_racks} "
                    f"racks have nodes with {gpus} in service; {known_racks} racks have such "
                    f"nodes in all ({_out_text(out, spare)})"
                )
            return _Shape((), Wait(job.id, WaitReason.TOPOLOGY, detail), text)
        if known_nodes < n:
            detail = f"can never start: needs {text}, the cluster has {known_nodes} such nodes"
            if out or spare:
                detail += f" in all ({most} in service, {_out_text(out, spare)})"
        else:
            detail = (
                f"cannot start yet: needs {text}, the cluster has {most} such nodes in "
                f"service, {_out_text(out, spare)}"
            )
        return _Shape((), Wait(job.id, WaitReason.RESOURCES, detail), text)

    def _known_counts(self, t: int, g: int) -> tuple[int, int, int, int]:
        """Of type ``t``'s nodes with at least ``g`` GPUs, in any state: how many, in how
        many racks, how many out of service (drained, sick or offline), how many spares."""
        layout = self.layout
        spares = set(self.spares)
        nodes = [i for i in layout.type_nodes[t] if layout.node_gpus[i] >= g]
        out = sum(1 for i in nodes if not layout.schedulable[i])
        spare = sum(1 for i in nodes if layout.schedulable[i] and i in spares)
        return len(nodes), len({layout.node_rack[i] for i in nodes}), out, spare

    def _static_counts(self, t: int, g: int) -> list[int]:
        """Per rack of type ``t``: usable nodes with at least ``g`` GPUs, busy or not."""
        counts = self.static_counts.get((t, g))
        if counts is None:
            layout = self.layout
            usable = self.capacity.usable
            pos = layout.rack_pos[t]
            counts = [0] * len(layout.type_racks[t])
            for i in layout.type_nodes[t]:
                if usable[i] and layout.node_gpus[i] >= g:
                    counts[pos[layout.node_rack[i]]] += 1
            self.static_counts[(t, g)] = counts
        return counts

    def _place(self, view: int, t: int, job: PendingJob, max_racks: int | None) -> list[int] | None:
        n = job.nodes
        g = job.gpus_per_node
        if self.capacity.count(view, t, g) < n:
            return None
        key = (view, t, g, job.placement, job.placement_required, max_racks)
        failed = self.place_fails.get(key)
        if failed is not None and n >= failed:
            return None
        nodes = self.capacity.place(view, t, n, g, job.placement, job.placement_required, max_racks)
        if nodes is None:
            self.place_fails[key] = n if failed is None else min(n, failed)
        return nodes

    def _start(
        self, job: PendingJob, nodes: list[int], end: float, preempts: tuple[str, ...]
    ) -> None:
        capacity = self.capacity
        g = job.gpus_per_node
        for i in nodes:
            capacity.occupy(i, g, end)
        self.used[job.team] = self.used.get(job.team, 0) + job.nodes * g
        self.timeline.add(Release(end, job.id, self.next_ordinal, tuple((i, g) for i in nodes)))
        self.next_ordinal += 1
        node_ids = self.layout.node_ids
        self.starts.append(Start(job.id, tuple(node_ids[i] for i in nodes), g, preempts))

    def _preempt(self, job: PendingJob, shape: _Shape, view: int, end: float) -> bool:
        if (
            self.preemptions_left <= 0
            or self.lowest_victim is None
            or job.priority <= self.lowest_victim
        ):
            return False
        for t, max_racks in shape.types:
            key = (
                view,
                t,
                job.gpus_per_node,
                job.placement,
                job.placement_required,
                max_racks,
                job.priority,
            )
            failed = self.evict_fails.get(key)
            if failed is not None and job.nodes >= failed:
                continue
            eviction = find_eviction(
                self.capacity,
                self.victims_by_node,
                self.evicted,
                view,
                t,
                job.nodes,
                job.gpus_per_node,
                job.placement,
                job.placement_required,
                max_racks,
                job.priority,
            )
            if eviction is None:
                self.evict_fails[key] = job.nodes if failed is None else min(job.nodes, failed)
                continue
            for victim in eviction.victims:
                self.evicted.add(victim.ordinal)
                self.timeline.cancelled.add(victim.ordinal)
                self.used[victim.team] -= victim.total_gpus
                self.preemptions.append(Preempt(victim.job_id, job.id, victim.lost_work))
            self.preemptions_left -= 1
            self.place_fails.clear()  # capacity grew: earlier failures may fit now
            self.evict_fails.clear()
            self._start(job, eviction.nodes, end, tuple(v.job_id for v in eviction.victims))
            self._hold_while_stopping(job, eviction.victims, eviction.nodes)
            return True
        return False

    def _hold_while_stopping(
        self, job: PendingJob, victims: list[Victim], nodes: list[int]
    ) -> None:
        """Keep victims' GPUs that the preemptor does not take out of this pass.

        Victims stop gracefully, so their GPUs are busy for a while yet: only
        the job they make way for (whose start waits for them) may use them.
        The rest count as released at ``now`` for reservations, and can be
        given out by the next pass.
        """
        capacity = self.capacity
        freed: dict[int, int] = {}
        for victim in victims:
            for i, gpus in victim.allocation:
                if capacity.usable[i]:
                    freed[i] = freed.get(i, 0) + gpus
        taken = set(nodes)
        g = job.gpus_per_node
        held = tuple(
            (i, left)
            for i, gpus in sorted(freed.items())
            if (left := gpus - (g if i in taken else 0)) > 0
        )
        if not held:
            return
        for i, gpus in held:
            capacity.occupy(i, gpus, self.now)
        key = f"{job.id} (victims stopping)"
        self.timeline.add(Release(self.now, key, self.next_ordinal, held))
        self.next_ordinal += 1

    def _blocked_by_reservation(self, job: PendingJob, nodes: list[int]) -> Wait:
        capacity = self.capacity
        holders = sorted(
            {
                (capacity.reserved_at[i], capacity.reserved_for[i] or "")
                for i in nodes
                if capacity.reserved_for[i] is not None
            }
        )
        at, holder = holders[0] if holders else (self.first_reserved, "?")
        return Wait(
            job.id,
            WaitReason.RESERVATION,
            f"fits now, but running for up to {job.max_runtime:.0f} s would delay job {holder}, "
            f"reserved to start in {at - self.now:.0f} s",
        )

    def _wait(self, job: PendingJob, shape: _Shape, view: int) -> None:
        n, g = job.nodes, job.gpus_per_node
        capacity = self.capacity
        types = shape.types
        # A shape with types has a node with >= g GPUs, so g indexes the counts.
        if len(types) == 1:
            t = types[0][0]
            free_now = capacity.total_ge[view][t][g]
            at_start = self.initial_ge[t][g]
        else:
            free_now = max(capacity.total_ge[view][t][g] for t, _ in types)
            at_start = max(self.initial_ge[t][g] for t, _ in types)
        if free_now >= n:
            reason = WaitReason.TOPOLOGY
            limit = (
                "every node in its own rack"
                if job.placement is Placement.SPREAD
                else f"at most {max(r or 0 for _, r in types)} racks"
            )
            detail = (
                f"needs {shape.text} in {limit}; {free_now} such nodes are free, "
                f"but not in racks that allow it"
            )
        else:
            if at_start >= n:
                reason = WaitReason.PRIORITY
                detail = (
                    f"needs {shape.text}; {at_start} were free when this pass began, "
                    f"but higher-ordered jobs took them"
                )
            else:
                reason = WaitReason.RESOURCES
                detail = f"needs {shape.text}; {free_now} such nodes are free"
        if self.reservation_tries >= self.state.reservation_depth:
            self.waits.append(Wait(job.id, reason, detail))
            return
        self.reservation_tries += 1
        best = None
        for t, max_racks in shape.types:
            found = find_reservation(
                capacity,
                self.timeline,
                self.reserved_nodes,
                t,
                n,
                g,
                job.placement,
                job.placement_required,
                max_racks,
            )
            if found is not None and (best is None or found.at < best.at):
                best = found
        if best is None:
            detail += "; no reserved start: running jobs' end times do not free enough nodes"
            self.waits.append(Wait(job.id, reason, detail))
            return
        for i, avail in zip(best.nodes, best.avail_at, strict=True):
            capacity.reserve(i, best.at, avail - g, job.id)
            self.reserved_nodes.add(i)
        self.first_reserved = min(self.first_reserved, best.at)
        node_ids = self.layout.node_ids
        self.waits.append(
            Wait(
                job.id,
                reason,
                f"{detail}; reserved to start in {best.at - self.now:.0f} s",
                best.at,
                tuple(node_ids[i] for i in best.nodes),
            )
        )


def _holdings(
    layout: Layout, running: list[RunningJob], pending: tuple[PendingJob, ...]
) -> tuple[list[int], list[Allocation]]:
    """Free GPUs per node and each running job's (node, GPUs); rejects inconsistent ids."""
    pending_ids: set[str] = set()
    for waiting in pending:
        if waiting.id in pending_ids:
            raise InvalidInput("pending", f"job id {waiting.id!r} appears twice")
        pending_ids.add(waiting.id)
    free = list(layout.node_gpus)
    allocations: list[Allocation] = []
    previous_id = None
    for job in running:
        if job.id == previous_id:
            raise InvalidInput("running", f"job id {job.id!r} appears twice")
        previous_id = job.id
        if job.id in pending_ids:
            raise InvalidInput("running", f"job {job.id!r} is both running and pending")
        held: list[tuple[int, int]] = []
        for node_id in job.nodes:
            i = layout.index.get(node_id)
            if i is None:
                raise InvalidInput(
                    f"running job {job.id}: nodes", f"node {node_id!r} is not in the cluster"
                )
            free[i] -= job.gpus_per_node
            held.append((i, job.gpus_per_node))
        allocations.append(tuple(sorted(held)))
    for i, left in enumerate(free):
        if left < 0:
            holders = sorted(job.id for job in running if layout.node_ids[i] in job.nodes)
            raise InvalidInput(
                "running",
                f"node {layout.node_ids[i]!r} has {layout.node_gpus[i]} GPUs but jobs "
                f"{', '.join(holders)} hold {layout.node_gpus[i] - left}",
            )
    return free, allocations


def _out_text(out: int, spare: int) -> str:
    """'2 drained, sick or offline (they can return: `phalanx undrain`), 1 held as a
    hot spare'."""
    parts = []
    if out or not spare:
        parts.append(f"{out} drained, sick or offline (they can return: `phalanx undrain`)")
    if spare:
        parts.append(f"{spare} held as {'a hot spare' if spare == 1 else 'hot spares'}")
    return ", ".join(parts)


def _gpu_text(job: PendingJob) -> str:
    return "" if job.gpu_type is None else f"{job.gpu_type} "


def _shape_text(job: PendingJob) -> str:
    """'4 nodes with 8 free h100 GPUs each', '1 node with 2 free GPUs'."""
    nodes = "1 node" if job.nodes == 1 else f"{job.nodes} nodes"
    each = "" if job.nodes == 1 else " each"
    return f"{nodes} with {job.gpus_per_node} free {_gpu_text(job)}GPUs{each}"
