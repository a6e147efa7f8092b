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
checkpoint the whole gang can read (:mod:`supervisor.recovery`).

A job runs as numbered *generations*: every launch and every in-place restart
increments it, and every command and rank event carries it, so nothing from an
older generation can touch a newer one.
"""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from phalanx.jobspec import JobSpec
from supervisor.errors import IllegalTransition


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
    waiting: dict[str, Any] | None = None
    # Where a stop leads, and why (shown as the job's reason once it ends).
    stop_target: JobState | None = None
    reason: str = ""
    preemptions: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    # Recovery: restarts used, every incident with its phases and lost work (newest
    # last), the one in progress (persisted: a restarted supervisor finishes it), and
    # when the job first started (for its ETTR).
    restarts: int = 0
    incidents: list[dict[str, Any]] = field(default_factory=list)
    recovery: dict[str, Any] | None = None
    first_started_at: float | None = None
    # Seconds the generations before the current one ran since the job last started
    # (recoveries keep counting against max_runtime; a preemption starts it afresh).
    ran_before_s: float = 0.0
    # Per generation: [first step, its time, last step seen, its time] (for lost work).
    progress: dict[str, list[float]] = field(default_factory=dict)

    @staticmethod
    def new_id(name: str) -> str:
        return f"{name}-{secrets.token_hex(3)}"

    def move(self, to: JobState, why: str = "") -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.id, self.state, to)
        self.history.append(
            {"at": time.time(), "from": self.state.value, "to": to.value, "why": why}
        )
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
            "world_size": self.spec.world_size,
            "nodes": list(self.nodes),
            "ranks": [
                {
                    "rank": r.rank,
                    "node": r.node,
                    "local_rank": r.local_rank,
                    "exit_code": r.code,
                    "signal": r.signal,
                    "lost": r.lost,
                }
                for r in self.ranks
            ],
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
            "waiting": self.waiting,
            "reason": self.reason or None,
            "preemptions": self.preemptions,
            "restarts": self.restarts,
            "max_restarts": self.spec.restart.max_restarts,
            "recovery": self.recovery,
            "incidents": self.incidents[-MAX_INCIDENTS_SHOWN:],
            "goodput": self.goodput(),
            "summary": summary,
            "spec": self.spec.redacted(),
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
        trained after the step it restored, at that generation's step time."""
        if self.first_started_at is None:
            return {
                "ettr": None,
                "wall_s": 0.0,
                "lost_s": 0.0,
                "downtime_s": 0.0,
                "lost_work_s": 0.0,
            }
        end = self.ended_at or (now if now is not None else time.time())
        wall = max(end - self.first_started_at, 1e-9)
        down = sum(i.get("downtime_s") or 0.0 for i in self.incidents)
        work = sum(i.get("lost_work_s") or 0.0 for i in self.incidents)
        if self.recovery is not None and self.recovery.get("detected_at"):
            down += max(0.0, end - self.recovery["detected_at"])  # the one going on now
        lost = min(wall, down + work)
        return {
            "ettr": round((wall - lost) / wall, 4),
            "wall_s": round(wall, 2),
            "lost_s": round(lost, 2),
            "downtime_s": round(down, 2),
            "lost_work_s": round(work, 2),
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
            "waiting": self.waiting,
            "stop_target": self.stop_target.value if self.stop_target else None,
            "reason": self.reason,
            "preemptions": self.preemptions,
            "history": self.history[-100:],
            "restarts": self.restarts,
            "incidents": self.incidents[-MAX_INCIDENTS_KEPT:],
            "recovery": self.recovery,
            "first_started_at": self.first_started_at,
            "ran_before_s": self.ran_before_s,
            "progress": self.progress,
        }

    @classmethod
    def from_record(cls, job_id: str, rec: dict[str, Any]) -> Job:
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
            waiting=rec.get("waiting"),
            stop_target=JobState(rec["stop_target"]) if rec.get("stop_target") else None,
            reason=rec.get("reason", ""),
            preemptions=rec.get("preemptions", 0),
            history=rec.get("history", []),
            restarts=rec.get("restarts", 0),
            incidents=list(rec.get("incidents", [])),
            recovery=rec.get("recovery"),
            first_started_at=rec.get("first_started_at"),
            ran_before_s=rec.get("ran_before_s", 0.0),
            progress=dict(rec.get("progress", {})),
        )
