"""A job's record and its state machine.

States and the only legal moves between them (anything else raises
:class:`IllegalTransition`)::

    pending ──► starting ──► running ──► succeeded
       │  ▲        │   ▲  │     │  │
       │  │        │   │  ▼     │  │
       │  │        │  recovering ◄─┘ ──► failed | cancelled
       │  │        ▼      │
       │  └─────── stopping ◄─┘ ──► failed | cancelled | pending (preempted)
       └──► cancelled

``recovering``: a rank, GPU or node failed and the job has restarts left; its
ranks are stopped everywhere (each node keeps the job's RAM tier), a failed
node is swapped for a spare, and the next generation starts from the newest
checkpoint the whole gang can read (:mod:`supervisor.recovery.executor`).

A job runs as numbered *generations*: every launch and every in-place restart
increments it, and every command and rank event carries it, so nothing from an
older generation can touch a newer one.
"""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx import wire
from phalanx.jobspec import JobSpec
from supervisor.errors import IllegalTransition
from supervisor.records import Incident, Recovery


class JobState(enum.StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    @property
    def holds_nodes(self) -> bool:
        return self in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING, JobState.RECOVERING)


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.STARTING, JobState.CANCELLED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.STOPPING, JobState.RECOVERING}),
    JobState.RUNNING: frozenset({JobState.STOPPING, JobState.SUCCEEDED, JobState.RECOVERING}),
    JobState.RECOVERING: frozenset(
        {JobState.STARTING, JobState.STOPPING, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.STOPPING: frozenset(
        {JobState.FAILED, JobState.CANCELLED, JobState.PENDING, JobState.SUCCEEDED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


MAX_INCIDENTS_KEPT = 200  # per job, in its record; the events keep every one
MAX_INCIDENTS_SHOWN = 50
MAX_PROGRESS_GENERATIONS = 8


@dataclass
class RankPlace:
    rank: int
    node: str
    local_rank: int
    code: int | None = None
    signal: int | None = None
    lost: bool = False

    @property
    def exited(self) -> bool:
        return self.code is not None or self.signal is not None or self.lost

    @property
    def clean(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        if self.lost:
            return f"rank {self.rank} on node {self.node} was lost"
        if self.signal is not None:
            return f"rank {self.rank} on node {self.node} was killed by signal {self.signal}"
        return f"rank {self.rank} on node {self.node} exited with code {self.code}"


@dataclass(frozen=True, slots=True)
class Transition:
    """One move of a job's state machine (``Job.history``): when, from, to, and why."""

    at: float
    from_: JobState
    to: JobState
    why: str = ""

    def to_record(self) -> dict[str, Any]:
        return {"at": self.at, "from": self.from_.value, "to": self.to.value, "why": self.why}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Transition:
        return cls(rec["at"], JobState(rec["from"]), JobState(rec["to"]), rec.get("why", ""))


@dataclass(frozen=True, slots=True)
class Waiting:
    """Why a job waits (``Job.waiting``): the scheduler's reason (``resources``,
    ``preemption``, ...) or a recovery's (``no_spare``), and its detail for a person."""

    reason: str
    detail: str

    def to_record(self) -> dict[str, Any]:
        return {"reason": self.reason, "detail": self.detail}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Waiting:
        return cls(rec.get("reason", ""), rec.get("detail", ""))


@dataclass
class Job:
    id: str
    spec: JobSpec
    state: JobState = JobState.PENDING
    generation: int = 0
    nodes: list[str] = field(default_factory=list)
    ranks: list[RankPlace] = field(default_factory=list)
    master_addr: str | None = None
    master_port: int | None = None
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    waiting: Waiting | None = None
    # Where a stop leads, and why (shown as the job's reason once it ends).
    stop_target: JobState | None = None
    reason: str = ""
    preemptions: int = 0
    history: list[Transition] = field(default_factory=list)
    # Recovery: restarts used, every incident with its phases and lost work (newest
    # last), the one in progress (persisted: a restarted supervisor finishes it), and
    # when the job first started (for its ETTR).
    restarts: int = 0
    incidents: list[Incident] = field(default_factory=list)
    recovery: Recovery | None = None
    first_started_at: float | None = None
    # Seconds the generations before the current one ran since the job last started
    # (recoveries keep counting against max_runtime; a preemption starts it afresh).
    ran_before_s: float = 0.0
    # Per generation: [first step, its time, last step seen, its time] (for lost work).
    progress: dict[str, list[float]] = field(default_factory=dict)
    # Every rollback of a loss guard's trip (supervisor.recovery.rollbacks), oldest first: when,
    # the generation it rolled back, the step restored ("after"), the steps skipped.
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    # A loss guard's trip that came while a recovery's launch was being acknowledged
    # (the ranks hold meanwhile): taken once the generation runs. Not persisted.
    guard_pending: Any = None
    # The step the gang restores from, as the catalog last published it (None: nothing
    # committed). Not persisted: each launch publishes it (an elastic job's before its
    # start orders, which carry the samples consumed up to it).
    published_restore: int | None = None
    # The newest step whose parameter digests agreed in every replica group (``sdc``;
    # supervisor.recovery.sdc_watch): a divergence's newest clean checkpoint is one past
    # it, also after a supervisor restart.
    sdc_agreed: int | None = None
    # Each recent generation's world size (an elastic job's change): a late landing of
    # an earlier generation commits when that generation's ranks all landed.
    worlds: dict[str, int] = field(default_factory=dict)
    # ``ranks`` indexed by rank and by node, built once per list of places (a new
    # generation assigns a new list): a 16,384-rank gang looked a rank up in the whole
    # list for every rank event, 268 million comparisons a step (issue 22).
    _index: tuple[list[RankPlace], dict[int, RankPlace], dict[str, list[RankPlace]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    _clean: tuple[list[RankPlace] | None, int] = field(
        default=(None, 0), init=False, repr=False, compare=False
    )

    _held: tuple[list[str] | None, int, frozenset[str]] = field(
        default=(None, 0, frozenset()), init=False, repr=False, compare=False
    )

    # The ranks as view() shows them, made again only when the gang or an exit changed:
    # (ranks list, its length, exits recorded) -> view. The API's job views are polled
    # (the dashboard, `phalanx status`), and a 16,384-rank list cost ~10 ms a view.
    _ranks_shown: tuple[list[RankPlace] | None, int, int, list[dict[str, Any]]] = field(
        default=(None, 0, 0, []), init=False, repr=False, compare=False
    )
    _exits: int = field(default=0, init=False, repr=False, compare=False)

    def rank_exited(self, place: RankPlace, code: int | None, signal: int | None) -> None:
        """Record a rank's exit (set a rank's exit here, never on it directly: the view
        of the ranks is made again when this counts one)."""
        place.code, place.signal = code, signal
        self._exits += 1

    def ranks_lost(self, places: list[RankPlace]) -> None:
        """Record ranks whose node was lost with them (see :meth:`rank_exited`)."""
        for place in places:
            place.lost = True
        self._exits += 1

    def _ranks_view(self) -> list[dict[str, Any]]:
        of, size, exits, shown = self._ranks_shown
        if of is not self.ranks or size != len(self.ranks) or exits != self._exits:
            shown = [
                {
                    "rank": r.rank,
                    "node": r.node,
                    "local_rank": r.local_rank,
                    "exit_code": r.code,
                    "signal": r.signal,
                    "lost": r.lost,
                }
                for r in self.ranks
            ]
            self._ranks_shown = (self.ranks, len(self.ranks), self._exits, shown)
        return shown

    def holds(self, node: str) -> bool:
        """Whether ``node`` is one of the job's nodes (``node in job.nodes``, without a
        scan of 2,048 names at each node's heartbeat: issue 22). ``nodes`` is replaced,
        never changed in place, when the job moves."""
        of, size, held = self._held
        if of is not self.nodes or size != len(self.nodes):
            held = frozenset(self.nodes)
            self._held = (self.nodes, len(self.nodes), held)
        return node in held

    def _places(self) -> tuple[dict[int, RankPlace], dict[str, list[RankPlace]]]:
        index = self._index
        if index is None or index[0] is not self.ranks or len(index[1]) != len(self.ranks):
            by_rank = {r.rank: r for r in self.ranks}
            by_node: dict[str, list[RankPlace]] = {}
            for r in self.ranks:
                by_node.setdefault(r.node, []).append(r)
            index = self._index = (self.ranks, by_rank, by_node)
        return index[1], index[2]

    def all_exited_clean(self) -> bool:
        """Whether every rank of the generation exited 0. Asked at each rank's exit: it
        goes on from where it stopped last time (a rank that exited 0 stays so)."""
        ranks, (of, upto) = self.ranks, self._clean
        i = upto if of is ranks else 0
        while i < len(ranks) and ranks[i].exited and ranks[i].clean:
            i += 1
        self._clean = (ranks, i)
        return i == len(ranks)

    @property
    def world_size(self) -> int:
        """The current generation's ranks: an elastic job's may be fewer than its spec's."""
        return len(self.nodes) * self.spec.ranks_per_node if self.nodes else self.spec.world_size

    def place(self, rank: int) -> RankPlace | None:
        """Where ``rank`` runs in the current generation (None: not placed)."""
        return self._places()[0].get(rank)

    def places_on(self, node: str) -> list[RankPlace]:
        """The current generation's ranks on ``node``, in rank order."""
        return list(self._places()[1].get(node, ()))

    @staticmethod
    def new_id(name: str) -> str:
        return f"{name}-{secrets.token_hex(3)}"

    def move(self, to: JobState, why: str = "") -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.id, self.state, to)
        self.history.append(Transition(time.time(), self.state, to, why))
        self.state = to
        if to.final:
            self.ended_at = time.time()

    def view(self, summary: dict[str, Any] | None = None) -> dict[str, Any]:
        """The job as the API and ``phalanx status -o json`` show it (stable keys);
        ``summary``: its latest training figures (``TrainingMetrics.summary``)."""
        return {
            "id": self.id,
            "name": self.spec.name,
            "team": self.spec.team,
            "priority": self.spec.priority,
            "state": self.state.value,
            "world_size": self.world_size,
            "nodes": list(self.nodes),
            "elastic": self.elastic_view(),
            "ranks": self._ranks_view(),
            "generation": self.generation,
            "master": (
                f"{self.master_addr}:{self.master_port}"
                if self.master_addr and self.master_port
                else None
            ),
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,  # this generation's start
            "first_started_at": self.first_started_at,  # the first generation's
            "ended_at": self.ended_at,
            "waiting": self.waiting.to_record() if self.waiting is not None else None,
            "reason": self.reason or None,
            "preemptions": self.preemptions,
            "restarts": self.restarts,
            "max_restarts": self.spec.restart.max_restarts,
            "rollbacks": sum(1 for r in self.rollbacks if r.get("kind") != "sdc"),
            "skipped_steps": [r["skip"] for r in self.rollbacks if r.get("skip")],
            "recovery": self.recovery.to_record() if self.recovery is not None else None,
            "incidents": [i.to_record() for i in self.incidents[-MAX_INCIDENTS_SHOWN:]],
            "goodput": self.goodput(),
            "summary": summary,
            "spec": self.spec.redacted(),
        }

    def world_size_of(self, generation: int) -> int:
        """The world size generation ``generation`` ran with (the current one's when not
        recorded: a job from before they were)."""
        return self.worlds.get(str(generation), self.world_size)

    def size(self) -> dict[str, Any]:
        """The current generation's size: nodes, ranks and (elastic) accumulation steps;
        each incident keeps the one of the generation it ended."""
        e, n = self.spec.elastic, len(self.nodes) or self.spec.nodes
        return {
            "nodes": n,
            "world_size": n * self.spec.ranks_per_node,
            "accumulation": e.accumulation(n, self.spec.ranks_per_node) if e else None,
        }

    def elastic_view(self) -> dict[str, Any] | None:
        """An elastic job's size now: nodes, data-parallel size, accumulation steps."""
        e = self.spec.elastic
        if e is None:
            return None
        n = len(self.nodes) or self.spec.nodes
        return {
            "nodes": n,
            "of_nodes": self.spec.nodes,
            "min_nodes": e.min_nodes,
            "sizes": self.spec.elastic_sizes(),
            "dp_size": n * self.spec.ranks_per_node,
            "global_batch": e.global_batch,
            "micro_batch": e.micro_batch,
            "accumulation": e.accumulation(n, self.spec.ranks_per_node),
        }

    def note_step(self, generation: int, step: int, at: float) -> None:
        """A rank of ``generation`` reported ``step`` at ``at`` (first or last seen)."""
        entry = self.progress.setdefault(str(generation), [step, at, step, at])
        if step < entry[0] or (step == entry[0] and at < entry[1]):
            entry[0], entry[1] = step, at
        # The last step, at the earliest time it was heard of (an exit reported after a
        # stop says the step, not when it was taken).
        if step > entry[2] or (step == entry[2] and at < entry[3]):
            entry[2], entry[3] = step, at
        if len(self.progress) > MAX_PROGRESS_GENERATIONS:
            del self.progress[min(self.progress, key=int)]

    def step_time(self, generation: int) -> float | None:
        """Seconds per step of a generation, from its first and last step seen."""
        entry = self.progress.get(str(generation))
        if entry is None or entry[2] <= entry[0] or entry[3] <= entry[1]:
            return None
        return (entry[3] - entry[1]) / (entry[2] - entry[0])

    def goodput(self, now: float | None = None) -> dict[str, Any]:
        """ETTR: time on steps that count over wall time since the first start. Lost: each
        recovery's downtime (failure to the next generation's first step) and the steps
        trained after the step it restored, at that generation's step time.

        A job that reports no steps leaves an incident's lost work unknown (what it
        trained since its own last snapshot, Phalanx cannot see) and its downtime ending
        at the start acks: ``lost_work_unknown`` counts such incidents, and ``ettr`` is
        then an upper bound (``ettr_upper_bound``), never a figure that calls it 0."""
        if self.first_started_at is None:
            return {
                "ettr": None,
                "ettr_upper_bound": False,
                "wall_s": 0.0,
                "lost_s": 0.0,
                "downtime_s": 0.0,
                "lost_work_s": 0.0,
                "lost_work_unknown": 0,
            }
        end = self.ended_at or (now if now is not None else time.time())
        wall = max(end - self.first_started_at, 1e-9)
        down = sum(i.downtime_s or 0.0 for i in self.incidents)
        work = sum(i.lost_work_s or 0.0 for i in self.incidents)
        unknown = sum(1 for i in self.incidents if i.has("lost_work_s") and i.lost_work_s is None)
        # downtime to the start acks only: the first step never came (or not yet)
        untimed = any(
            i.outcome == "recovered" and i.has("mttr_s") and i.mttr_s is None
            for i in self.incidents
        )
        if self.recovery is not None and self.recovery.detected_at:
            down += max(0.0, end - self.recovery.detected_at)  # the one going on now
        lost = min(wall, down + work)
        return {
            "ettr": round((wall - lost) / wall, 4),
            "ettr_upper_bound": bool(unknown) or untimed,
            "wall_s": round(wall, 2),
            "lost_s": round(lost, 2),
            "downtime_s": round(down, 2),
            "lost_work_s": round(work, 2),
            "lost_work_unknown": unknown,
        }

    def record(self) -> dict[str, Any]:
        return {
            "spec": self.spec.model_dump(mode="json"),
            "state": self.state.value,
            "generation": self.generation,
            "nodes": self.nodes,
            "ranks": [vars(r) for r in self.ranks],
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "waiting": self.waiting.to_record() if self.waiting is not None else None,
            "stop_target": self.stop_target.value if self.stop_target else None,
            "reason": self.reason,
            "preemptions": self.preemptions,
            "history": [t.to_record() for t in self.history[-100:]],
            "restarts": self.restarts,
            "incidents": [i.to_record() for i in self.incidents[-MAX_INCIDENTS_KEPT:]],
            "recovery": self.recovery.to_record() if self.recovery is not None else None,
            "first_started_at": self.first_started_at,
            "ran_before_s": self.ran_before_s,
            "progress": self.progress,
            "rollbacks": self.rollbacks,
            "worlds": self.worlds,
            "sdc_agreed": self.sdc_agreed,
        }

    @classmethod
    def from_record(cls, job_id: str, rec: dict[str, Any]) -> Job:
        waiting, recovery = rec.get("waiting"), rec.get("recovery")
        return cls(
            id=job_id,
            spec=JobSpec.model_validate(rec["spec"]),
            state=JobState(rec["state"]),
            generation=rec["generation"],
            nodes=list(rec["nodes"]),
            ranks=[RankPlace(**r) for r in rec["ranks"]],
            master_addr=rec.get("master_addr"),
            master_port=rec.get("master_port"),
            submitted_at=rec["submitted_at"],
            started_at=rec.get("started_at"),
            ended_at=rec.get("ended_at"),
            waiting=Waiting.from_record(waiting) if waiting is not None else None,
            stop_target=JobState(rec["stop_target"]) if rec.get("stop_target") else None,
            reason=rec.get("reason", ""),
            preemptions=rec.get("preemptions", 0),
            history=[Transition.from_record(t) for t in rec.get("history", [])],
            restarts=rec.get("restarts", 0),
            incidents=[Incident.from_record(i) for i in rec.get("incidents", [])],
            recovery=Recovery.from_record(recovery) if recovery is not None else None,
            first_started_at=rec.get("first_started_at"),
            ran_before_s=rec.get("ran_before_s", 0.0),
            progress=dict(rec.get("progress", {})),
            rollbacks=list(rec.get("rollbacks", [])),
            worlds={str(k): int(v) for k, v in rec.get("worlds", {}).items()},
            sdc_agreed=rec.get("sdc_agreed"),
        )


def is_void(step: int, generation: int, rollbacks: Sequence[Mapping[str, int]]) -> bool:
    """Whether a save of ``step`` by ``generation`` is one a rollback voided: the step is
    newer than the one a rollback restored, and the generation is one it rolled back."""
    return any(step > r["after"] and generation <= r["generation"] for r in rollbacks)


def void_landing(job: Job, msg: wire.CkptLanding) -> bool:
    """Whether a checkpoint landing is a late one of a save a rollback voided."""
    return bool(job.rollbacks) and is_void(msg.step, msg.generation, job.rollbacks)


def hold_steps(job: Job) -> int | None:
    """How far back retention keeps one committed step for the guard (None: no guard)."""
    return job.spec.guard.hold_steps if job.spec.guard is not None else None
