"""The intake: every failure signal of a job, turned into a :class:`Report`.

A job's failure reaches the supervisor in one of a few shapes: a rank's exit (or ranks a
node lost without saying), a node of the gang that went offline or was drained for its
health, the hang reports of a gang whose steps stopped, a loss guard's trip, replicas
whose digests diverged. Each is turned here (or, for the guard and the digests, in
:mod:`~supervisor.recovery.rollbacks` and :mod:`~supervisor.recovery.sdc_watch`) into one
:class:`Report`: the :class:`~supervisor.recovery.planner.Failure` the planner takes, when
it happened, and the events to record with it. The controller routes every report the
same way (:meth:`supervisor.control.controller.JobController.route`): into
:meth:`supervisor.recovery.executor.Recoveries.begin`, then a recovery task.

Pure: a job's state and the signal in, a report (or None: no failure) out; no I/O and no
clock (the caller passes ``now``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx import flight, wire
from supervisor.fleet.registry import Node, NodeState
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.records import GuardTrip, Recheck
from supervisor.recovery.planner import Failure, FailureKind


@dataclass(frozen=True, slots=True)
class Noted:
    """An event to record in the log with the failure (``kind``, its node, its detail)."""

    kind: str
    node: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Report:
    """A failure of a job's current generation, ready for the recovery.

    ``fault_at``: when it happened (None: when it was seen); ``also``: failures that came
    with it, planned for together; ``recheck``: the nodes to recheck before it plans
    (replicas that diverged with no majority); ``guard``: the loss guard's trip it rolls
    back from; ``noted``: events recorded before it is routed."""

    failure: Failure
    fault_at: float | None = None
    also: tuple[Failure, ...] = ()
    recheck: Recheck | None = None
    guard: GuardTrip | None = None
    noted: tuple[Noted, ...] = ()


def rank_exit(
    job: Job, place: RankPlace, *, step: int | None = None, at: float | None = None
) -> Report | None:
    """A rank of the job's current generation exited (or was lost with its node's agent
    still up): a failure while the job runs, unless it exited 0."""
    if job.state is not JobState.RUNNING or place.clean:
        return None
    return Report(
        Failure(
            FailureKind.RANK_EXIT,
            place.node,
            rank=place.rank,
            code=place.code,
            signal=place.signal,
            step=step,
            generation=job.generation,
            detail="lost: its node no longer runs it" if place.lost else "",
        ),
        fault_at=at,
    )


def node_failure(
    job: Job,
    nodes: Mapping[str, Node],
    *,
    settling: bool,
    offline_confirmed: Callable[[float], bool],
) -> Report | None:
    """A running job's first node that went offline (for sure: ``offline_confirmed(since)``
    says it is no broker restart) or was drained for its health; None when every node of
    the gang is fine. ``settling``: a restarted supervisor that has heard from no one yet
    does not judge nodes it has not seen (they may be announcing themselves)."""
    if job.state is not JobState.RUNNING:
        return None
    for node_id in job.nodes:
        node = nodes.get(node_id)
        if node is not None and settling and node.last_seen == 0.0:
            continue
        if (
            node is not None
            and node.state is NodeState.OFFLINE
            and not offline_confirmed(node.offline_at)
        ):
            continue  # perhaps the broker restarting: confirmed in a moment
        if node is None or node.state is NodeState.OFFLINE:
            cause = node.offline_cause if node else "unknown"
            return Report(
                Failure(
                    FailureKind.NODE_OFFLINE,
                    node_id,
                    detail=cause,
                    generation=job.generation,
                    quarantine=cause != "clean shutdown",
                )
            )
        # A drain for the node's health is a hardware failure under the job; an
        # operator's drain lets the job finish (a rolling upgrade waits for it).
        if node.state is NodeState.DRAIN and node.drain is not None and node.drain.by == "auto":
            return Report(
                Failure(
                    FailureKind.NODE_DRAIN,
                    node_id,
                    detail=node.drain.reason,
                    generation=job.generation,
                ),
                fault_at=node.drain.since,
            )
    return None


class HangReports:
    """The hang reports of a job generation's nodes, gathered until every node of the
    gang reported or the first report is ``HANG_COLLECT_FLIGHT_S`` old (the caller's
    timer): the culprit is named from all of them (:func:`hang`)."""

    def __init__(self) -> None:
        self._reports: dict[tuple[str, int], list[wire.RankEvent]] = {}

    def add(self, job: Job, ev: wire.RankEvent) -> tuple[bool, bool]:
        """Keep ``ev``; (whether it is the first report of its generation, whether every
        node of the gang has reported now)."""
        key = (job.id, ev.generation)
        first = key not in self._reports
        reports = self._reports.setdefault(key, [])
        reports.append(ev)
        return first, {r.node for r in reports} >= set(job.nodes)

    def take(self, key: tuple[str, int]) -> list[wire.RankEvent]:
        """The reports gathered for (job, generation), forgotten here."""
        return self._reports.pop(key, [])


def hang(
    job: Job, generation: int, reports: Sequence[wire.RankEvent], *, now: float
) -> Report | None:
    """The hang of ``generation`` its nodes reported: the culprit named from every report
    (a stopped process first, then the rank furthest behind, then the longest silent; the
    ranks' NCCL flight recorders, where they name one, before progress). None when the
    generation is no longer the job's, or a rank finished (the others wait for it at the
    end: they are not hung)."""
    if not reports or job.generation != generation:
        return None
    if any(r.clean for r in job.ranks):
        return None
    culprit = min(
        reports,
        key=lambda e: (not e.stopped, e.step if e.step is not None else -1, -(e.idle_s or 0.0)),
    )
    idle = max(e.idle_s or 0.0 for e in reports)
    node, rank, step, why = culprit.node, culprit.rank, culprit.step, culprit.detail
    noted: list[Noted] = []
    # Every rank of a gang stuck in a collective stops stepping at once: the flight
    # recorders know better than progress; a stopped process is plainer still.
    named = flight.culprit(
        flight.Point(p.rank, p.pg, p.seq, p.completed, p.op, p.state)
        for r in reports
        for p in r.flight
    )
    place = job.place(named.rank) if named is not None else None
    if named is not None and not culprit.stopped:
        found = {"rank": named.rank, "pg": named.pg, "detail": named.detail}
        noted.append(Noted("hang_flight_recorder", None, found))
        if place is not None:
            node, rank, why = place.node, named.rank, f"flight recorder: {named.detail}"
            step = next((r.step for r in reports if r.rank == rank), culprit.step)
    failure = Failure(
        FailureKind.HANG,
        node,
        rank=rank,
        step=step,
        detail=why
        if why.startswith("no step for")
        else f"no step for {idle:.1f}s; {why}".strip("; "),
        generation=generation,
    )
    dumps = [d for r in reports for d in r.dumps]
    if dumps:
        noted.append(Noted("hang_dumps", node, {"dumps": dumps[:64]}))
    return Report(failure, fault_at=now - idle, noted=tuple(noted))


__all__ = ["HangReports", "Noted", "Report", "hang", "node_failure", "rank_exit"]
