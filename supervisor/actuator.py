"""What the job controller's helpers may use of it.

The recoveries (:mod:`supervisor.recovery.executor`), their incident record
(:mod:`supervisor.recovery.incidents`) and the gang's orders (:mod:`supervisor.control.orders`)
act on the jobs through this surface, which
:class:`~supervisor.control.controller.JobController` implements. They import nothing
of the controller: no import circle, and the surface is written down here.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.config import SupervisorSettings
from supervisor.fleet.burnin import BurnIns
from supervisor.fleet.registry import Registry
from supervisor.jobs import Job, JobState
from supervisor.store import Store


class JobControl(Protocol):
    jobs: dict[str, Job]
    spares: tuple[str, ...]  # the spare pool of the last scheduling pass
    registry: Registry
    store: Store
    settings: SupervisorSettings
    burnins: BurnIns
    agent_keys: AgentKeys  # the nodes' peer credentials, for their checkpoint plans
    catalog: CheckpointCatalog  # the committed checkpoints, for the recovery planner

    async def command(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        """Send one command and wait for its ack (see ``commands.CommandSender``)."""
        ...

    def move(self, job: Job, to: JobState, why: str) -> None:
        """Move ``job`` to state ``to`` (persisted, logged)."""
        ...

    def save(self, job: Job) -> None:
        """Persist the job's record."""
        ...

    def event(self, kind: str, job: Job, node: str | None = None, **detail: Any) -> None:
        """Record an event of ``job`` in the event log."""
        ...

    def spawn(self, job: Job, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (a launch, stop or recovery of ``job``) as the job's task."""
        ...

    async def launch(self, job: Job, nodes: list[str]) -> None:
        """Launch the job's next generation on ``nodes``."""
        ...

    async def stop(self, job: Job) -> None:
        """Stop the job's ranks everywhere; it then takes its ``stop_target`` state."""
        ...

    def wake(self) -> None:
        """Something changed: a scheduling pass soon, waiting recoveries look again."""
        ...
