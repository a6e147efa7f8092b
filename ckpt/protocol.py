"""The rank socket's protocol: every body a rank sends its agent, and every answer.

Both sides import these models: the rank's ``AgentClient`` (``ckpt.remote``, which
lists the routes) builds each request from its model and reads each answer with
one; agentd's rank routes parse each request with its model and build each answer
from one. A request names the rank asking (``job``, ``generation``, ``rank``; a
``GET`` names ``job`` and ``rank`` in its query).

A request that does not follow its model is refused with 400, and an ``ErrorReply``
whose ``error`` names each wrong field and what is wrong with it (``problems``):
``step: Input should be greater than or equal to 0 (got -1)``. Requests forbid
unknown fields (a misspelt field is an error, not a default silently taken);
answers ignore them, so that a rank reads an agent that says more than it knows.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from ckpt.tiers import MAX_RANK, MAX_STEP, check_job

__all__ = [
    "AcquireReply",
    "AcquireRequest",
    "Candidate",
    "ErrorReply",
    "HelloReply",
    "HelloRequest",
    "RankQuery",
    "RankRequest",
    "ReportReply",
    "ReportRequest",
    "ReserveReply",
    "ReserveRequest",
    "RestorePlan",
    "RestoreQuery",
    "RestoreStep",
    "ShardQuery",
    "StageReply",
    "StageRequest",
    "SubmitReply",
    "SubmitRequest",
    "TierName",
    "WaitReply",
    "WaitRequest",
    "problems",
]

JobId = Annotated[str, AfterValidator(check_job)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Rank = Annotated[int, Field(ge=0, le=MAX_RANK)]
Generation = Annotated[int, Field(ge=0)]
NBytes = Annotated[int, Field(ge=0)]
TierName = Literal["ram", "nvme", "peer", "object"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# --- who asks -------------------------------------------------------------------------


class RankQuery(_Request):
    """The rank asking, in the query of a ``GET``."""

    job: JobId
    rank: Rank


class RankRequest(RankQuery):
    """The rank asking, in the body of a ``POST``, with the generation it runs in (an
    older generation's request is refused with 409)."""

    generation: Generation


# --- saving ---------------------------------------------------------------------------


class HelloRequest(RankRequest):
    """``POST /v1/ckpt/hello``: a rank's ``Checkpointer`` starts."""

    world_size: int | None = Field(default=None, ge=1)


class HelloReply(_Reply):
    """The job's checkpoint plan on this node."""

    tiers: list[str] = Field(default_factory=list, description="nearest first, ram included")
    node: str = ""
    interval: str | float | int | None = Field(
        default=None, description="the job spec's interval; None: the rank's own"
    )
    mtbf_s: float | None = None


class AcquireRequest(RankRequest):
    """``POST /v1/ckpt/acquire``: a free RAM slot for ``step``, of ``nbytes``."""

    step: Step
    nbytes: NBytes
    when_busy: Literal["wait", "skip"] = "wait"
    timeout: float = Field(default=600.0, description="seconds to wait for a slot")


class AcquireReply(_Reply):
    """The slot to write (``slot``, ``path``, ``capacity``), or ``skipped`` and ``why``
    (every slot busy, under ``when_busy="skip"``)."""

    slot: int | None = None
    path: str | None = None
    capacity: int | None = None
    skipped: bool = False
    why: str = ""


class SubmitRequest(RankRequest):
    """``POST /v1/ckpt/submit``: ``slot`` now holds ``step`` (``abort``: it holds nothing)."""

    step: Step
    slot: int = Field(ge=0)
    nbytes: NBytes
    abort: bool = False


class SubmitReply(_Reply):
    submitted: int | None = None
    aborted: bool = False


class ReserveRequest(RankRequest):
    """``POST /v1/ckpt/reserve``: allocate every slot for ``nbytes`` now."""

    nbytes: NBytes


class ReserveReply(_Reply):
    paths: list[str] = Field(default_factory=list, description="the slots' files, to map")


class WaitRequest(RankRequest):
    """``POST /v1/ckpt/wait``: until ``step`` is committed on every tier of the job."""

    step: Step
    timeout: float = 3600.0


class WaitReply(_Reply):
    committed: dict[str, int] = Field(default_factory=dict, description="tier -> step")


# --- restoring ------------------------------------------------------------------------


class RestoreQuery(RankQuery):
    """``GET /v1/ckpt/restore``: the step the gang restores from (or ``step``)."""

    step: Step | None = None


class Candidate(_Reply):
    """One copy of the rank's shard: ``path`` to read it from (RAM, disk), or none (the
    peer and object tiers: staged or streamed through the agent)."""

    tier: TierName
    path: str | None = None
    checksum: str | None = None
    nbytes: NBytes | None = None


class RestoreStep(_Reply):
    step: Step
    rank: Rank | None = Field(
        default=None,
        description="whose shard the candidates are, when not the asking rank's own: an "
        "elastic gang that changed size restores the shards saved at its earlier size",
    )
    candidates: list[Candidate] = Field(default_factory=list, description="nearest first")
    world_size: int | None = Field(
        default=None,
        ge=1,
        description="how many ranks saved the step (None: an agent that does not say)",
    )


class RestorePlan(_Reply):
    """At most one step; ``unavailable`` says why there is none when committed steps
    exist."""

    steps: list[RestoreStep] = Field(default_factory=list)
    unavailable: str | None = None


class ShardQuery(RankQuery):
    """``GET /v1/ckpt/shard``: the rank's copy of ``step`` at ``tier``, streamed."""

    step: Step
    tier: TierName


class StageRequest(RankRequest):
    """``POST /v1/ckpt/stage``: the rank's copy of ``step`` at ``tier`` read into a free
    RAM slot of its own."""

    step: Step
    tier: TierName


class StageReply(_Reply):
    """``path`` (and ``slot``): staged there; ``gone``: the tier has no copy; ``staged``
    false: no slot was free (stream it instead). An agent that stages nothing (before
    ``/v1/ckpt/stage``) leaves them all unset."""

    path: str | None = None
    slot: int | None = None
    gone: bool = False
    staged: bool | None = None


class ReportRequest(RankRequest):
    """``POST /v1/ckpt/report``: the rank's copy of ``step`` at ``tier`` is unusable."""

    step: Step
    tier: TierName
    error: str = ""


class ReportReply(_Reply):
    reported: bool = True


# --- refusals -------------------------------------------------------------------------


class ErrorReply(_Reply):
    """Any refusal (a status of 300 or more): ``tier`` names a tier that failed (409 from
    ``wait``, 502 from a copy's tier), ``corrupt`` says the copy itself is bad (not
    merely unreachable), ``limit`` is a size limit crossed."""

    error: str
    tier: str | None = None
    step: int | None = None
    corrupt: bool = False
    limit: int | None = None


def problems(exc: ValidationError) -> str:
    """What is wrong with a body, field by field, for an error message:
    ``step: Input should be a valid integer (got 'x'); job: Field required``."""
    out = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "body"
        got = "" if error["type"] in ("missing", "json_invalid") else _shown(error["input"])
        out.append(f"{where}: {error['msg']}{got}")
    return "; ".join(out)


def _shown(value: Any) -> str:
    text = repr(value)
    return f" (got {text if len(text) <= 80 else text[:77] + '...'})"
