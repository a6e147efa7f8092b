"""A node's messages: its health, its birth and death, its heartbeats and its ranks' events;
and the supervisor's status."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Annotated, Final, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from phalanx.wire._base import (
    MAX_BATCHED,
    MAX_I64,
    MAX_RANK,
    MAX_STEP,
    JobId,
    Msg,
    NodeId,
    Term,
    kind_or,
    of_one_node,
    pack_leading,
)

# --- health ---------------------------------------------------------------


class HealthStatus(enum.StrEnum):
    """A node's health as its agent judges it; ordered by severity."""

    OK = "ok"
    WARN = "warn"
    DRAIN = "drain"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {HealthStatus.OK: 0, HealthStatus.WARN: 1, HealthStatus.DRAIN: 2}


class Reason(Msg):
    """One machine-readable reason behind a health status."""

    code: str = Field(description="stable code, e.g. ecc_dbe, xid_79, disk_low")
    severity: Literal["warn", "drain"]
    gpu: int | None = Field(default=None, description="GPU index, None for host-wide reasons")
    detail: str = ""


class GpuGauges(Msg):
    """The numbers of one GPU worth graphing (a subset of a sample)."""

    index: int
    temperature_c: float | None = None
    power_w: float | None = None
    util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    retired_pages: int | None = None
    throttle: list[str] = Field(default_factory=list)


class HostGauges(Msg):
    """Host health from psutil."""

    disk_free_bytes: int
    disk_total_bytes: int
    mem_available_bytes: int
    mem_total_bytes: int
    load1: float
    cpu_count: int


class Health(Msg):
    status: HealthStatus
    reasons: list[Reason] = Field(default_factory=list)
    gpus: list[GpuGauges] = Field(default_factory=list)
    host: HostGauges | None = None
    sampled_at: float = 0.0


# --- node lifecycle ---------------------------------------------------------


class GpuDescriptor(Msg):
    index: int = Field(ge=0)
    uuid: str
    model: str
    memory_bytes: int = Field(ge=0)


class Topology(Msg):
    rack: str = "default"
    nvlink_domain: str | None = None


# What an agent can do that an older one cannot, as its birth announces it
# (``NodeBirth.features``): the supervisor asks only for what the node announced.
FEATURE_PROBE_BOTH_WAYS: Final = "probe_both_ways"  # ProbeLinkArgs.both_ways, POST /v1/probe


class NodeBirth(Msg):
    kind: Literal["birth"] = "birth"
    node: NodeId
    seq: int = Field(ge=0, description="birth sequence; grows with every (re)connect")
    hostname: str
    address: str = Field(description="address peers and the supervisor reach the agent at")
    http_port: int = Field(ge=0, le=65535)
    gpus: list[GpuDescriptor]
    gpu_backend: str
    topology: Topology
    version: str
    started_at: float
    health: Health
    features: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=64,
        description="what this agent can do that an older one cannot (e.g. "
        "FEATURE_PROBE_BOTH_WAYS); left out when empty, so an older agent's birth is what "
        "it was (an older supervisor refuses a birth that has it: it is upgraded first)",
        exclude_if=lambda features: not features,
    )


class NodeDeath(Msg):
    kind: Literal["death"] = "death"
    node: NodeId
    seq: int = Field(ge=0)
    cause: Literal["lost", "shutdown"] = "lost"


class JobRanks(Msg):
    """The ranks of one job generation that an agent runs now."""

    job: JobId
    generation: int = Field(ge=1)
    ranks: list[int]


class Heartbeat(Msg):
    kind: Literal["heartbeat"] = "heartbeat"
    node: NodeId
    seq: int = Field(ge=0, description="birth sequence this heartbeat belongs to")
    n: int = Field(ge=0, description="heartbeat counter within this birth")
    sent_at: float
    health: Health
    jobs: list[JobRanks] = Field(default_factory=list)
    port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="a TCP port free on the node when sent: the rendezvous port of the next "
        "launch whose rank 0 runs there, taken without asking (`alloc_port`); left out by "
        "agents from before it (a supervisor takes both, so it is upgraded first)",
    )


class FlightPoint(Msg):
    """One rank's place in one process group, from its NCCL flight-recorder dump
    (``phalanx.flight``): the newest collective it entered (``seq``, ``op``, ``state``)
    and the newest it completed (-1: none)."""

    rank: int = Field(ge=0, le=MAX_RANK)
    pg: str = Field(max_length=64)
    seq: int = Field(ge=0, le=MAX_I64)
    completed: int = Field(ge=-1, le=MAX_I64)
    op: str = Field(max_length=64)
    state: str = Field(max_length=16)


MAX_FLIGHT_POINTS: Final = 256  # in one hung event: a node's ranks, 8 process groups each


class RankEvent(Msg):
    """A rank process started or ended on a node (``code`` or ``signal`` set on exit), or
    the node's ranks of a job stopped making progress (``hung``).

    ``step`` is the last step the rank reported through ``phalanx.rank.step`` (None: it
    never reported one). A ``hung`` event names this node's likeliest culprit: a rank
    whose process is stopped (``stopped``), else the one furthest behind, else the one
    silent longest; ``idle_s`` is how long the node's ranks have made no progress and
    ``detail`` says why this rank was named. ``dumps`` lists the flight-recorder dump
    files the node's ranks left for this generation (NCCL writes them on a timeout).

    ``restored`` (once per rank and generation): the rank restored checkpoint step
    ``step`` in ``took_s`` seconds (``step`` None: it found nothing to restore).
    ``stepped`` (once per rank and generation): the rank reported its first step,
    ``step``. The supervisor times a recovery's restore and first-step phases by them.

    ``guard`` (once per node and generation): a rank's loss guard tripped at step
    ``step`` (``phalanx.guard``): ``guard`` says why (``nan``: a NaN or infinite loss;
    ``loss_spike``: a loss above the guard's ratio for its patience), ``onset`` the step
    the loss went bad, ``value`` the first bad loss (None when not finite) and
    ``baseline`` the mean of the losses before it (None when not yet known).

    ``digest``: the digest of the rank's parameters after step ``step``
    (``phalanx.digest``, every ``sdc.every`` steps), in ``digest``.
    """

    kind: Literal["rank"] = "rank"
    node: NodeId
    job: JobId
    generation: int = Field(ge=1)
    rank: int = Field(ge=0)
    event: Literal["started", "exited", "hung", "restored", "stepped", "guard", "digest"]
    code: int | None = None
    signal: int | None = None
    pid: int | None = None
    step: int | None = Field(default=None, ge=0, le=MAX_STEP)
    stopped: bool = False
    idle_s: float | None = Field(default=None, ge=0)
    detail: str = Field(default="", max_length=1000)
    dumps: list[str] = Field(default_factory=list, max_length=64)
    # What the node's ranks' flight-recorder dumps say (a ``hung`` event; left out when
    # empty, so an agent with none sends what it sent before the field).
    flight: list[FlightPoint] = Field(
        default_factory=list, max_length=MAX_FLIGHT_POINTS, exclude_if=lambda v: not v
    )
    took_s: float | None = Field(default=None, ge=0)
    guard: Literal["nan", "loss_spike"] | None = None
    onset: int | None = Field(default=None, ge=0, le=MAX_STEP)
    value: float | None = Field(default=None, allow_inf_nan=False)
    baseline: float | None = Field(default=None, allow_inf_nan=False)
    digest: int | None = Field(default=None, ge=0, le=2**64 - 1)
    at: float


class RankEvents(Msg):
    """Several rank events of one node in one message, in the order they happened: what
    the agent's outbox holds when it sends (a generation's ranks starting, restoring,
    stepping, exiting: 65,536 events a recovery at 2,048 nodes, issue 22). Same topic
    as ``RankEvent``; a supervisor takes both, so it is upgraded before the agents."""

    kind: Literal["rank_batch"] = "rank_batch"
    node: NodeId
    events: list[RankEvent] = Field(min_length=1, max_length=MAX_BATCHED)

    @model_validator(mode="after")
    def _of_its_node(self) -> RankEvents:
        of_one_node(self.node, self.events, "an event")
        return self


def pack_rank_events(queued: Iterable[BaseModel]) -> tuple[BaseModel, int]:
    """The head of an agent's rank-event outbox: its first event, or the events that lead
    it as one :class:`RankEvents` (one naming flight-recorder dumps goes alone)."""
    return pack_leading(
        queued,
        RankEvent,
        lambda m: not m.dumps,
        lambda leading: RankEvents(node=leading[0].node, events=list(leading)),
    )


RankReport = Annotated[
    Annotated[RankEvent, Tag("rank")] | Annotated[RankEvents, Tag("rank_batch")],
    Discriminator(kind_or("rank")),
]


class SupervisorStatus(Msg):
    kind: Literal["supervisor"] = "supervisor"
    online: bool
    since: float
    term: Term = 0
