"""The checkpoint messages: a node's landings and releases, the catalog the supervisor
sends each node of a job, and the tiers a job's start order names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    field_serializer,
    model_validator,
)

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

CkptTierName = Literal["ram", "nvme", "peer", "object"]


class CkptLanding(Msg):
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
    job: JobId
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


MAX_LANDINGS_BATCHED = MAX_BATCHED  # landings in one CkptLandings (~300 bytes each)
MAX_BATCHED_ERROR = 1024  # a landing with a longer error goes alone


class CkptLandings(Msg):
    """Several landings of one node in one message, in the order they happened: what
    the agent's outbox holds when it sends (a step's ranks at a tier, retention's
    deletions). At 2,048 nodes a checkpoint is 65,536 landings and as many deletions;
    one message per rank made the broker and the supervisor carry eight times the
    messages (issue 22). Same topic as ``CkptLanding``; a supervisor takes both, so
    it is upgraded before the agents (docs/rollout.md)."""

    kind: Literal["ckpt_batch"] = "ckpt_batch"
    node: NodeId
    landings: list[CkptLanding] = Field(min_length=1, max_length=MAX_LANDINGS_BATCHED)

    @model_validator(mode="after")
    def _of_its_node(self) -> CkptLandings:
        of_one_node(self.node, self.landings, "a landing")
        return self


def pack_landings(queued: Iterable[BaseModel]) -> tuple[BaseModel, int]:
    """The head of an agent's landing outbox: its first report, or the landings that
    lead it as one :class:`CkptLandings` (a landing with a long error goes alone)."""
    return pack_leading(
        queued,
        CkptLanding,
        lambda m: len(m.error) <= MAX_BATCHED_ERROR,
        lambda leading: CkptLandings(node=leading[0].node, landings=list(leading)),
    )


class CkptReleased(Msg):
    """A node let go of an ended job's checkpoints here: its catalog said ``ended`` and
    the agent finished the job's write-downs and freed its RAM tier. The supervisor
    then clears the job's retained catalog for the node, which the broker would
    otherwise deliver at every reconnect for good. Same topic as ``CkptLanding``."""

    kind: Literal["ckpt_released"] = "ckpt_released"
    node: NodeId
    job: JobId
    at: float


class PeerAddr(Msg):
    """A buddy node's agent, where the peer tier pushes this node's shards (or where a
    rank's peer copy lies), and the credential the receiving node presents there.

    ``token`` is the receiving node's own credential at ``node`` (``phalanx.agent_tokens``
    ``peer_credential``): every message carrying a ``PeerAddr`` goes to one node, and
    carries that node's credential only. It is sent in JSON and hidden everywhere else
    (repr, ``str``, a Python dump)."""

    node: NodeId
    address: str
    http_port: int = Field(ge=1, le=65535)
    token: SecretStr | None = Field(
        default=None,
        description="the receiving node's credential at the buddy's peer routes, "
        "presented with ``X-Phalanx-Node`` naming the receiving node",
    )

    @field_serializer("token", when_used="json")
    def _reveal(self, token: SecretStr | None) -> str | None:
        return None if token is None else token.get_secret_value()


class CkptShard(Msg):
    rank: int = Field(ge=0, le=MAX_RANK)
    checksum: str
    nbytes: int = Field(ge=0, le=MAX_I64)
    peer: PeerAddr | None = Field(
        default=None,
        description="the buddy holding this rank's "
        "peer-tier copy of the step, where it is committed there",
    )


class CkptStep(Msg):
    """A step committed at one tier or more: when, and the checksum and size of the
    shards of the ranks the receiving node holds or runs."""

    step: int = Field(ge=0, le=MAX_STEP)
    committed: dict[CkptTierName, float] = Field(description="tier -> commit time")
    shards: list[CkptShard]
    world_size: int | None = Field(
        default=None,
        ge=1,
        # Left out unless set: an agent from before it refuses a step that has it.
        exclude_if=lambda world: world is None,
        description="the ranks that saved the step, where not the catalog's `world_size` "
        "(an elastic job's step saved at another size): its manifests say so",
    )


class CkptCatalog(Msg):
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
    job: JobId
    node: NodeId
    world_size: int = Field(ge=1)
    generation: int = Field(default=0, ge=0, description="the job's generation when sent")
    term: Term = 0
    steps: list[CkptStep] = Field(default_factory=list)
    restore_step: int | None = None
    restore_note: str = ""
    hold: list[int] = Field(
        default_factory=list,
        max_length=8,
        description="committed steps the tiers below RAM keep beyond `keep`: those the "
        "loss guard may roll back to (see supervisor.catalog.guard_hold)",
    )
    ended: bool = Field(
        default=False,
        description="the job succeeded or was cancelled, or "
        "failed `ckpt_failed_ram_linger_s` ago: agents free its RAM tier (the "
        "lower tiers keep what `keep` says)",
    )
    sources: dict[int, int] = Field(
        default_factory=dict,
        max_length=4096,
        # Left out when empty: an agent from before it refuses a catalog that has it
        # (the supervisor is upgraded first), and only an elastic job's resize needs it.
        exclude_if=lambda sources: not sources,
        description="an elastic gang of another size than the one that saved "
        "`restore_step`: rank -> the saved rank whose shard of it the rank restores (this "
        "node's ranks); a rank not listed restores its own",
    )


MAX_CATALOG_STEPS = 16


class CkptPlan(Msg):
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


CkptReport = Annotated[
    Annotated[CkptLanding, Tag("ckpt")]
    | Annotated[CkptReleased, Tag("ckpt_released")]
    | Annotated[CkptLandings, Tag("ckpt_batch")],
    Discriminator(kind_or("ckpt")),
]
