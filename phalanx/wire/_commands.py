"""The supervisor's commands to one agent, and the agent's acks.

Every command carries an id and a deadline: an agent executes it at most once per
id (QoS 1 redelivers) and never after its deadline."""

from __future__ import annotations

import enum
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from phalanx.wire._base import JobId, Msg, NodeId, Term
from phalanx.wire._ckpt import CkptPlan, PeerAddr


class PingArgs(Msg):
    op: Literal["ping"] = "ping"


class ResampleArgs(Msg):
    """Sample health now and publish it, instead of waiting for the next heartbeat."""

    op: Literal["resample"] = "resample"


class RebirthArgs(Msg):
    """Publish the birth again (the supervisor lost it, e.g. its retained copy was cleared)."""

    op: Literal["rebirth"] = "rebirth"


class EnvFromFile(Msg):
    """An env value the agent reads from a file on its node (a secret never on the wire)."""

    from_file: str


class RankSlot(Msg):
    rank: int = Field(ge=0, description="global rank")
    local_rank: int = Field(ge=0)
    gpu: int | None = Field(default=None, description="GPU index on the node, None on CPU")


class WarmPlan(Msg):
    """The job keeps warm interpreters on the node: ready processes, one per local rank
    slot, that become the slot's rank at its next start instead of a cold launch."""

    imports: list[str] = Field(
        default_factory=list, description="modules a warm interpreter imports while it waits"
    )


class StartRanksArgs(Msg):
    """Start this node's ranks of one job generation (idempotent for the same generation)."""

    op: Literal["start_ranks"] = "start_ranks"
    job: JobId
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
    warm: WarmPlan | None = Field(
        default=None,
        description="keep warm interpreters behind the ranks (None: cold launches only)",
    )
    in_process: bool = Field(
        default=False,
        description="an in-process restart: a live rank of the job's older generation in "
        "a slot of this start, parked by phalanx.rank.run, becomes the slot's rank of this "
        "generation in its own process; the others are stopped and started as usual "
        "(left out when false, so that older agents take the order)",
        exclude_if=lambda in_process: not in_process,
    )


class StopRanksArgs(Msg):
    """Stop every rank of ``job`` up to ``generation``: SIGTERM, ``grace_s``, SIGKILL."""

    op: Literal["stop_ranks"] = "stop_ranks"
    job: JobId
    generation: int = Field(ge=1)
    grace_s: float = Field(default=30.0, gt=0)
    reason: str = ""
    keep_warm: bool = Field(
        default=False,
        description="a stop on the way to the job's next generation (a recovery): the "
        "job's warm interpreters stay, for it; otherwise they go with the ranks",
    )


class PrewarmArgs(Msg):
    """Keep warm interpreters for a job on this node (a hot spare) that has none of its
    ranks: one per local rank slot, started as a rank of this start order would be, so
    that ranks moved here from a failed node start in them instead of a cold launch.
    They go ``lease_s`` after the last prewarm, unless a rank of the job runs here by
    then; a prewarm repeated with the same order only renews the lease."""

    op: Literal["prewarm"] = "prewarm"
    start: StartRanksArgs = Field(
        description="the start order the node would get (its ranks: the local rank slots)"
    )
    lease_s: float = Field(gt=0, le=3600)


class AllocPortArgs(Msg):
    """Find a free TCP port on the node (the rendezvous port of a gang's rank 0)."""

    op: Literal["alloc_port"] = "alloc_port"


class BurnInArgs(Msg):
    """Run the node's short health test before it is trusted with ranks (a spare, or a
    node back from a drain): on a GPU a matmul check on every GPU, on the simulated
    backend a fresh health sample. The ack's result says ``passed`` and why not."""

    op: Literal["burn_in"] = "burn_in"


class ProbeLinkArgs(Msg):
    """Measure the network from ``peer`` to this node: read up to ``nbytes`` from the
    peer agent's probe route (``GET /v1/probe``, opened by ``peer.token``) for at most
    ``max_s`` seconds, timed from its first byte. The ack's result: ``mb_s`` (10^6 bytes
    a second), ``nbytes`` read and ``seconds``.

    ``both_ways``: then send as many bytes to the peer (``POST /v1/probe``, at most
    ``max_s`` seconds too), which times them; the result adds ``back`` (``mb_s``,
    ``nbytes``, ``seconds`` as the peer measured them), or ``back_error`` and
    ``back_reached`` when that way could not be measured. Sent only where the births of
    both agents announce ``FEATURE_PROBE_BOTH_WAYS`` (an older one refuses the field, or
    does not serve the upload)."""

    op: Literal["probe_link"] = "probe_link"
    peer: PeerAddr
    nbytes: int = Field(ge=1 << 16, le=1 << 30)
    max_s: float = Field(default=2.0, gt=0, le=30, description="at most, each way")
    both_ways: bool = Field(
        default=False,
        description="measure from this node to the peer too, in the same command (left "
        "out when false, so that older agents take a one-way probe)",
        exclude_if=lambda both_ways: not both_ways,
    )


class SaveNowArgs(Msg):
    """Ask the job's ranks on this node to checkpoint at their next step (before a
    preemption); they see it through ``phalanx.rank.step``."""

    op: Literal["save_now"] = "save_now"
    job: JobId
    generation: int = Field(ge=1)


CommandArgsType = (
    PingArgs
    | ResampleArgs
    | RebirthArgs
    | StartRanksArgs
    | StopRanksArgs
    | PrewarmArgs
    | AllocPortArgs
    | BurnInArgs
    | ProbeLinkArgs
    | SaveNowArgs
)
CommandArgs = Annotated[CommandArgsType, Field(discriminator="op")]


class Command(Msg):
    """An order for one agent. Executed at most once per id, never after its deadline."""

    kind: Literal["cmd"] = "cmd"
    id: str = Field(min_length=1, max_length=128)
    node: NodeId
    issued_at: float
    deadline: float
    args: CommandArgs
    term: Term = 0

    @classmethod
    def new(cls, node: str, args: CommandArgsType, ttl: float = 30.0, term: int = 0) -> Command:
        now = time.time()
        return cls(
            id=uuid.uuid4().hex,
            node=node,
            issued_at=now,
            deadline=now + ttl,
            args=args,
            term=term,
        )


class AckStatus(enum.StrEnum):
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


class CommandAck(Msg):
    kind: Literal["ack"] = "ack"
    id: str
    node: NodeId
    status: AckStatus
    duplicate: bool = Field(default=False, description="a redelivery; the first result is repeated")
    detail: str = ""
    result: dict[str, Any] = Field(default_factory=dict)
    acked_at: float
