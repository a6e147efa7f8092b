"""What the REST API serves of the supervisor: :class:`Backend`, the part of
``supervisor.daemon.Supervisor`` that ``make_app`` and each route module read."""

from __future__ import annotations

from typing import Protocol

from phalanx.link import MqttLinks
from phalanx.loopwatch import LoopWatch
from supervisor.backup import StoreBackups
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.publisher import CatalogPublisher
from supervisor.config import SupervisorSettings
from supervisor.control.controller import JobController
from supervisor.fleet.commands import Commands
from supervisor.fleet.registry import Registry
from supervisor.leadership import Leadership
from supervisor.store import Store
from supervisor.sweeps import Sweeps
from supervisor.telemetry.training import TrainingMetrics
from supervisor.telemetry.wire_stats import WireStats


class Backend(Protocol):
    """What the API serves of the supervisor (``supervisor.daemon.Supervisor``)."""

    token: str  # the bootstrap (admin) bearer token
    agent_token: str  # the fleet agent secret: a node's token, to fetch its logs, derives from it
    settings: SupervisorSettings
    registry: Registry
    jobs: JobController
    store: Store
    backups: StoreBackups | None  # the store's rolling backups (None: off)
    catalog: CheckpointCatalog
    publisher: CatalogPublisher  # the catalogs out: its last flushes and publishes
    commands: Commands
    link: MqttLinks
    metrics: TrainingMetrics
    sweeps: Sweeps
    bad_messages: int
    wire_stats: WireStats
    loopwatch: LoopWatch  # the event loop's stalls
    leadership: Leadership | None  # None: a supervisor alone (SQLite)
