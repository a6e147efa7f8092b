"""The wire contract: every MQTT topic and every message, in one place.

Both daemons import this module; nothing else builds a topic string or reads a
payload dict. Version 1 lives under ``phalanx/v1/``.

Topics (``{node}`` is a node id):

=====================================  =========  =======  ==========================
topic                                  publisher  retain   payload
=====================================  =========  =======  ==========================
``phalanx/v1/node/{node}/birth``       agent      yes      :class:`NodeBirth`
``phalanx/v1/node/{node}/death``       broker     yes      :class:`NodeDeath` (will)
``phalanx/v1/node/{node}/heartbeat``   agent      no       :class:`Heartbeat`
``phalanx/v1/node/{node}/cmd``         supervisor no       :class:`Command`
``phalanx/v1/node/{node}/ack``         agent      no       :class:`CommandAck`
``phalanx/v1/node/{node}/rank``        agent      no       :class:`RankEvent`
``phalanx/v1/node/{node}/ckpt``        agent      no       :class:`CkptLanding`,
                                                           :class:`CkptReleased`
``phalanx/v1/job/{job}/ckpt/{node}``   supervisor yes      :class:`CkptCatalog`
``phalanx/v1/supervisor/status``       supervisor yes      :class:`SupervisorStatus`
=====================================  =========  =======  ==========================

Birth and death carry the agent's birth sequence number. A death only counts
for the birth with the same or an older sequence, so the retained pair read
back by a restarted supervisor tells it which of the two is newer.

Every inbound payload goes through :func:`parse`, which bounds its size,
checks it is JSON and validates it against the model of its topic. Anything
else raises :class:`WireError`; the daemons log it and drop the message.
"""

from __future__ import annotations

import enum
import re
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
)

PREFIX = "phalanx/v1"
MAX_PAYLOAD_BYTES = 256 * 1024
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
_NODE_ID_RE = re.compile(NODE_ID_PATTERN)


class WireError(ValueError):
    """A message that does not follow the contract; carries the topic."""

    def __init__(self, topic: str, reason: str) -> None:
        super().__init__(f"bad message on {topic!r}: {reason}")
        self.topic = topic
        self.reason = reason


class _Msg(BaseModel):
    """Base of every message: strict about unknown fields, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


NodeId = Annotated[str, Field(pattern=NODE_ID_PATTERN)]

# What the checkpoint store can name (``ckpt.tiers``: a step's folder has 12 digits, a
# shard's file a 5-digit rank), and what the supervisor's SQLite store holds (i64): a
# landing past these is refused when parsed, never left to fail in a store batch.
MAX_STEP: Final = 10**12 - 1
MAX_RANK: Final = 10**5 - 1
MAX_I64: Final = 2**63 - 1


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


class Reason(_Msg):
    """One machine-readable reason behind a health status."""

    code: str = Field(description="stable code, e.g. ecc_dbe, xid_79, disk_low")
    severity: Literal["warn", "drain"]
    gpu: int | None = Field(default=None, description="GPU index, None for host-wide reasons")
    detail: str = ""


class GpuGauges(_Msg):
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


class HostGauges(_Msg):
    """Host health from psutil."""

    disk_free_bytes: int
    disk_total_bytes: int
    mem_available_bytes: int
    mem_total_bytes: int
    load1: float
    cpu_count: int


class Health(_Msg):
    status: HealthStatus
    reasons: list[Reason] = Field(default_factory=list)
    gpus: list[GpuGauges] = Field(default_factory=list)
    host: HostGauges | None = None
    sampled_at: float = 0.0


# --- node lifecycle ---------------------------------------------------------


class GpuDescriptor(_Msg):
    index: int = Field(ge=0)
    uuid: str
    model: str
    memory_bytes: int = Field(ge=0)


class Topology(_Msg):
    rack: str = "default"
    nvlink_domain: str | None = None


class NodeBirth(_Msg):
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


class NodeDeath(_Msg):
    kind: Literal["death"] = "death"
    node: NodeId
    seq: int = Field(ge=0)
    cause: Literal["lost", "shutdown"] = "lost"


class JobRanks(_Msg):
    """The ranks of one job generation that an agent runs now."""

    job: str
    generation: int = Field(ge=1)
    ranks: list[int]


class Heartbeat(_Msg):
    kind: Literal["heartbeat"] = "heartbeat"
    node: NodeId
    seq: int = Field(ge=0, description="birth sequence this heartbeat belongs to")
    n: int = Field(ge=0, description="heartbeat counter within this birth")
    sent_at: float
    health: Health
    jobs: list[JobRanks] = Field(default_factory=list)


class RankEvent(_Msg):
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
    """

    kind: Literal["rank"] = "rank"
    node: NodeId
    job: str
    generation: int = Field(ge=1)
    rank: int = Field(ge=0)
    event: Literal["started", "exited", "hung", "restored", "stepped"]
    code: int | None = None
    signal: int | None = None
    pid: int | None = None
    step: int | None = Field(default=None, ge=0, le=MAX_STEP)
    stopped: bool = False
    idle_s: float | None = Field(default=None, ge=0)
    detail: str = Field(default="", max_length=1000)
    dumps: list[str] = Field(default_factory=list, max_length=64)
    took_s: float | None = Field(default=None, ge=0)
    at: float


# --- checkpoints ------------------------------------------------------------

CkptTierName = Literal["ram", "nvme", "peer", "object"]


class CkptLanding(_Msg):
    """One rank's shard of one step landed at (or was deleted from) a tier of a node.

    ``landed`` means the bytes are whole and checked against the seal; ``staged`` that
    they are a verified copy of a save already landed elsewhere (the catalog's checksum
    of it), read into a RAM slot for a rank's restore; ``deleted``
    that retention removed them; ``failed`` that the tier could not take them
    (``error`` says why); ``corrupt`` that a rank found the copy unusable when it
    restored (``error`` says why: the catalog stops offering it). For the peer tier
    ``holder`` is the buddy that keeps the copy.
    """

    kind: Literal["ckpt"] = "ckpt"
    node: NodeId
    job: str
    step: int = Field(ge=0, le=MAX_STEP)
    rank: int = Field(ge=0, le=MAX_RANK)
    tier: CkptTierName
    event: Literal["landed", "staged", "deleted", "failed", "corrupt"] = "landed"
    nbytes: int = Field(default=0, ge=0, le=MAX_I64)
    checksum: str = ""
    holder: str | None = None
    error: str = ""
    generation: int = Field(
        default=0,
        ge=0,
        le=MAX_I64,
        description="the job generation "
        "whose rank saved the shard (0: not known, an agent restarted "
        "since; for ``staged``, the generation that copied it)",
    )
    at: float


class CkptReleased(_Msg):
    """A node let go of an ended job's checkpoints here: its catalog said ``ended`` and
    the agent finished the job's write-downs and freed its RAM tier. The supervisor
    then clears the job's retained catalog for the node, which the broker would
    otherwise deliver at every reconnect for good. Same topic as ``CkptLanding``."""

    kind: Literal["ckpt_released"] = "ckpt_released"
    node: NodeId
    job: str
    at: float


class PeerAddr(_Msg):
    """A buddy node's agent, where the peer tier pushes this node's shards."""

    node: NodeId
    address: str
    http_port: int = Field(ge=1, le=65535)


class CkptShard(_Msg):
    rank: int = Field(ge=0, le=MAX_RANK)
    checksum: str
    nbytes: int = Field(ge=0, le=MAX_I64)
    peer: PeerAddr | None = Field(
        default=None,
        description="the buddy holding this rank's "
        "peer-tier copy of the step, where it is committed there",
    )


class CkptStep(_Msg):
    """A step committed at one tier or more: when, and the checksum and size of the
    shards of the ranks the receiving node holds or runs."""

    step: int = Field(ge=0, le=MAX_STEP)
    committed: dict[CkptTierName, float] = Field(description="tier -> commit time")
    shards: list[CkptShard]


class CkptCatalog(_Msg):
    """The committed checkpoints of one job, as one node needs them.

    One message per (job, node), retained on ``phalanx/v1/job/JOB/ckpt/NODE``, so
    an agent that (re)connects learns them at once; republished on every commit
    or deletion. It lists every committed step (the newest ``MAX_CATALOG_STEPS``)
    with the tiers it is committed at, and the shards of the ranks this node runs
    now or landed before: its size grows with the ranks per node, not with the job.

    ``restore_step`` is the newest step every rank of the current generation can
    read from where it now runs (a RAM or NVMe copy on its node, the peer copy on a
    live buddy, the object store); the whole gang restores from it, so that no rank
    falls back to an older step on its own. ``None`` with committed steps listed
    means none is readable by every rank (``restore_note`` says which rank lacks what).
    """

    kind: Literal["ckpt_catalog"] = "ckpt_catalog"
    job: str
    node: NodeId
    world_size: int = Field(ge=1)
    generation: int = Field(default=0, ge=0, description="the job's generation when sent")
    steps: list[CkptStep] = Field(default_factory=list)
    restore_step: int | None = None
    restore_note: str = ""
    ended: bool = Field(
        default=False,
        description="the job succeeded or was cancelled, or "
        "failed `ckpt_failed_ram_linger_s` ago: agents free its RAM tier (the "
        "lower tiers keep what `keep` says)",
    )


MAX_CATALOG_STEPS = 16


# --- commands ------------------------------------------------------------


class PingArgs(_Msg):
    op: Literal["ping"] = "ping"


class ResampleArgs(_Msg):
    """Sample health now and publish it, instead of waiting for the next heartbeat."""

    op: Literal["resample"] = "resample"


class RebirthArgs(_Msg):
    """Publish the birth again (the supervisor lost it, e.g. its retained copy was cleared)."""

    op: Literal["rebirth"] = "rebirth"


class EnvFromFile(_Msg):
    """An env value the agent reads from a file on its node (a secret never on the wire)."""

    from_file: str


class RankSlot(_Msg):
    rank: int = Field(ge=0, description="global rank")
    local_rank: int = Field(ge=0)
    gpu: int | None = Field(default=None, description="GPU index on the node, None on CPU")


JOB_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,80}$"


class CkptPlan(_Msg):
    """How the agent writes this job's checkpoints down (from the job spec)."""

    tiers: list[CkptTierName] = Field(min_length=1)
    keep: dict[CkptTierName, int] = Field(default_factory=dict)
    interval: str | float | int = Field(
        default="auto",
        description="what ``Checkpointer.due`` uses: steps (int), seconds (float) or 'auto'",
    )
    buddy: PeerAddr | None = Field(default=None, description="the peer tier's target")
    mtbf_s: float | None = Field(
        default=None,
        gt=0,
        description="the job's mean time between "
        "failures (the fleet's node MTBF over its nodes), for 'auto'",
    )


class StartRanksArgs(_Msg):
    """Start this node's ranks of one job generation (idempotent for the same generation)."""

    op: Literal["start_ranks"] = "start_ranks"
    job: str = Field(pattern=JOB_ID_PATTERN)
    generation: int = Field(ge=1)
    command: list[str] = Field(min_length=1)
    workdir: str
    env: dict[str, str | EnvFromFile] = Field(default_factory=dict)
    world_size: int = Field(ge=1)
    group_rank: int = Field(ge=0, description="this node's index in the gang")
    master_addr: str
    master_port: int = Field(ge=1, le=65535)
    ranks: list[RankSlot] = Field(min_length=1)
    assign_gpus: bool = Field(
        default=True,
        description="the agent gives each slot without a GPU a free GPU index of its own "
        "(jobs can share a node by GPU count; only the agent knows which GPUs are free)",
    )
    grace_s: float = Field(default=30.0, gt=0)
    ckpt: CkptPlan | None = Field(
        default=None, description="the checkpoint tiers; None: the agent's defaults"
    )
    hang_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="the ranks are hung once none of this node's has "
        "reported a step for this long (None: derived from the observed step time, "
        "never under the agent's floor)",
    )


class StopRanksArgs(_Msg):
    """Stop every rank of ``job`` up to ``generation``: SIGTERM, ``grace_s``, SIGKILL."""

    op: Literal["stop_ranks"] = "stop_ranks"
    job: str = Field(pattern=JOB_ID_PATTERN)
    generation: int = Field(ge=1)
    grace_s: float = Field(default=30.0, gt=0)
    reason: str = ""


class AllocPortArgs(_Msg):
    """Find a free TCP port on the node (the rendezvous port of a gang's rank 0)."""

    op: Literal["alloc_port"] = "alloc_port"


class BurnInArgs(_Msg):
    """Run the node's short health test before it is trusted with ranks (a spare, or a
    node back from a drain): on a GPU a matmul check on every GPU, on the simulated
    backend a fresh health sample. The ack's result says ``passed`` and why not."""

    op: Literal["burn_in"] = "burn_in"


class SaveNowArgs(_Msg):
    """Ask the job's ranks on this node to checkpoint at their next step (before a
    preemption); they see it through ``phalanx.rank.step``."""

    op: Literal["save_now"] = "save_now"
    job: str = Field(pattern=JOB_ID_PATTERN)
    generation: int = Field(ge=1)


CommandArgsType = (
    PingArgs
    | ResampleArgs
    | RebirthArgs
    | StartRanksArgs
    | StopRanksArgs
    | AllocPortArgs
    | BurnInArgs
    | SaveNowArgs
)
CommandArgs = Annotated[CommandArgsType, Field(discriminator="op")]


class Command(_Msg):
    """An order for one agent. Executed at most once per id, never after its deadline."""

    kind: Literal["cmd"] = "cmd"
    id: str = Field(min_length=1, max_length=128)
    node: NodeId
    issued_at: float
    deadline: float
    args: CommandArgs

    @classmethod
    def new(cls, node: str, args: CommandArgsType, ttl: float = 30.0) -> Command:
        now = time.time()
        return cls(id=uuid.uuid4().hex, node=node, issued_at=now, deadline=now + ttl, args=args)


class AckStatus(enum.StrEnum):
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


class CommandAck(_Msg):
    kind: Literal["ack"] = "ack"
    id: str
    node: NodeId
    status: AckStatus
    duplicate: bool = Field(default=False, description="a redelivery; the first result is repeated")
    detail: str = ""
    result: dict[str, Any] = Field(default_factory=dict)
    acked_at: float


class SupervisorStatus(_Msg):
    kind: Literal["supervisor"] = "supervisor"
    online: bool
    since: float


Message = (
    NodeBirth
    | NodeDeath
    | Heartbeat
    | Command
    | CommandAck
    | SupervisorStatus
    | RankEvent
    | CkptLanding
    | CkptReleased
    | CkptCatalog
)


def _ckpt_kind(value: Any) -> str:
    """Which message a ``ckpt`` payload is: its ``kind``, ``ckpt`` (a landing) when it
    names none, as a landing's ``kind`` has a default."""
    kind = value.get("kind", "ckpt") if isinstance(value, dict) else getattr(value, "kind", "")
    return kind if isinstance(kind, str) else ""


CkptReport = Annotated[
    Annotated[CkptLanding, Tag("ckpt")] | Annotated[CkptReleased, Tag("ckpt_released")],
    Discriminator(_ckpt_kind),
]


# --- topics --------------------------------------------------------------


def _node(node: str) -> str:
    if not _NODE_ID_RE.match(node):
        raise ValueError(f"invalid node id {node!r}: must match {NODE_ID_PATTERN}")
    return node


def birth_topic(node: str) -> str:
    return f"{PREFIX}/node/{_node(node)}/birth"


def death_topic(node: str) -> str:
    return f"{PREFIX}/node/{_node(node)}/death"


def heartbeat_topic(node: str) -> str:
    return f"{PREFIX}/node/{_node(node)}/heartbeat"


def command_topic(node: str) -> str:
    return f"{PREFIX}/node/{_node(node)}/cmd"


def ack_topic(node: str) -> str:
    return f"{PREFIX}/node/{_node(node)}/ack"


def rank_topic(node: str) -> str:
    return f"{PREFIX}/node/{_node(node)}/rank"


def ckpt_topic(node: str) -> str:
    return f"{PREFIX}/node/{_node(node)}/ckpt"


_JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,80}$")


def catalog_topic(job: str, node: str) -> str:
    if not _JOB_ID_RE.match(job):
        raise ValueError(f"invalid job id {job!r}")
    return f"{PREFIX}/job/{job}/ckpt/{_node(node)}"


SUPERVISOR_STATUS_TOPIC = f"{PREFIX}/supervisor/status"

# Subscriptions, one per consumer.
SUPERVISOR_SUBSCRIPTIONS = (
    f"{PREFIX}/node/+/birth",
    f"{PREFIX}/node/+/death",
    f"{PREFIX}/node/+/heartbeat",
    f"{PREFIX}/node/+/ack",
    f"{PREFIX}/node/+/rank",
    f"{PREFIX}/node/+/ckpt",
)


def agent_subscriptions(node: str) -> tuple[str, ...]:
    return (command_topic(node), f"{PREFIX}/job/+/ckpt/{_node(node)}")


_MODELS: dict[str, type[_Msg]] = {
    "birth": NodeBirth,
    "death": NodeDeath,
    "heartbeat": Heartbeat,
    "cmd": Command,
    "ack": CommandAck,
    "rank": RankEvent,
    "ckpt": CkptLanding,  # or CkptReleased: see _CKPT_REPORT
}
_CKPT_REPORT: TypeAdapter[CkptLanding | CkptReleased] = TypeAdapter(CkptReport)
_TOPIC_RE = re.compile(r"^phalanx/v1/node/([^/]+)/(birth|death|heartbeat|cmd|ack|rank|ckpt)$")
_CATALOG_RE = re.compile(r"^phalanx/v1/job/([^/]+)/ckpt/([^/]+)$")


@dataclass(frozen=True)
class Inbound:
    """A parsed message and the node its topic names (None for fleet-wide topics)."""

    node: str | None
    message: Message | None  # None: a retained message was cleared (empty payload)


def encode(message: _Msg) -> bytes:
    return message.model_dump_json().encode()


def parse(topic: str, payload: bytes | bytearray | str | None) -> Inbound:
    """Validate one inbound message against the model its topic promises.

    An empty payload is how MQTT clears a retained message; it parses to
    ``Inbound(node, None)``. Everything else must be a valid message whose
    ``node`` field (when it has one) matches the topic.
    """
    if isinstance(payload, str):
        payload = payload.encode()
    payload = bytes(payload or b"")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(topic, f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    if topic == SUPERVISOR_STATUS_TOPIC:
        if not payload:
            return Inbound(None, None)
        return Inbound(None, _validate(topic, SupervisorStatus, payload))
    if (job_match := _CATALOG_RE.match(topic)) is not None:
        if not payload:
            return Inbound(None, None)
        catalog = _validate(topic, CkptCatalog, payload)
        assert isinstance(catalog, CkptCatalog)
        if catalog.job != job_match.group(1):
            raise WireError(
                topic,
                f"payload names job {catalog.job!r} but the topic names {job_match.group(1)!r}",
            )
        if catalog.node != job_match.group(2):
            raise WireError(
                topic,
                f"payload names node {catalog.node!r} but the topic names {job_match.group(2)!r}",
            )
        return Inbound(catalog.node, catalog)
    match = _TOPIC_RE.match(topic)
    if match is None:
        raise WireError(topic, "not a phalanx/v1 topic")
    node, kind = match.group(1), match.group(2)
    if not _NODE_ID_RE.match(node):
        raise WireError(topic, f"invalid node id {node!r}")
    if not payload:
        return Inbound(node, None)
    if kind == "ckpt":
        message = _validate(topic, _CKPT_REPORT, payload, "CkptLanding or CkptReleased")
    else:
        message = _validate(topic, _MODELS[kind], payload)
    named = getattr(message, "node", node)
    if named != node:
        raise WireError(topic, f"payload names node {named!r} but the topic names {node!r}")
    return Inbound(node, message)


def _validate(
    topic: str, model: type[_Msg] | TypeAdapter[Any], payload: bytes, name: str = ""
) -> Message:
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_json(payload)  # type: ignore[no-any-return]
        return model.model_validate_json(payload)  # type: ignore[return-value]
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()[:5]
        )
        raise WireError(
            topic, f"{name or getattr(model, '__name__', model)} invalid: {errors}"
        ) from exc
