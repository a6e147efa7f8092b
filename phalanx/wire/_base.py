"""What every message shares: the base model, the id patterns, the numeric limits."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field

NODE_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
JOB_ID_PATTERN: Final = r"^[a-z0-9][a-z0-9-]{0,80}$"

# What the checkpoint store can name (``ckpt.tiers``: a step's folder has 12 digits, a
# shard's file a 5-digit rank), and what the supervisor's SQLite store holds (i64): a
# landing past these is refused when parsed, never left to fail in a store batch.
MAX_STEP: Final = 10**12 - 1
MAX_RANK: Final = 10**5 - 1
MAX_I64: Final = 2**63 - 1


class Msg(BaseModel):
    """Base of every message: strict about unknown fields, immutable, and every number
    finite. No sender has a use for NaN or infinity (this package's own encoder writes
    them as null), and one that got through would end in the supervisor's store (a
    landing's ``at`` of NaN fails its NOT NULL column) or in a wait without end (a
    command's ``grace_s`` of infinity)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


NodeId = Annotated[str, Field(pattern=NODE_ID_PATTERN)]
JobId = Annotated[str, Field(pattern=JOB_ID_PATTERN)]
# The leadership term of the supervisor that sent a message (docs/wire.md, "Leadership
# term"): 0 from a supervisor alone, and then left out, so that such a supervisor sends
# what it sent before the field (an agent of before it refuses an unknown field).
Term = Annotated[
    int,
    Field(
        ge=0,
        description="the sending supervisor's leadership term (0: a supervisor alone); "
        "an agent refuses a command, catalog or status older than the newest term it saw",
        exclude_if=lambda term: term == 0,
    ),
]


MAX_BATCHED: Final = 64  # messages in one batch (CkptLandings, RankEvents)
# The encoded messages of one batch, at most: half of what a payload may be (the codec's
# MAX_PAYLOAD_BYTES, 256 KiB), whatever the strings in them (a control character takes
# six bytes in JSON, so 64 errors of 1,000 characters could pass the payload's limit).
MAX_BATCH_BYTES: Final = 128 * 1024

M = TypeVar("M", bound=BaseModel)


def pack_leading(
    queued: Iterable[BaseModel],
    kind: type[M],
    fits: Callable[[M], bool],
    batch: Callable[[Sequence[M]], BaseModel],
) -> tuple[BaseModel, int]:
    """What an outbox sends for its queue's head: the first message, or the messages of
    ``kind`` that lead the queue and ``fits`` (up to ``MAX_BATCHED`` of them and
    ``MAX_BATCH_BYTES`` encoded) as one ``batch``; and how many queued messages that is."""
    leading: list[M] = []
    first: BaseModel | None = None
    size = 0
    for message in queued:
        first = message if first is None else first
        if not isinstance(message, kind) or not fits(message) or len(leading) == MAX_BATCHED:
            break
        size += len(message.model_dump_json().encode())
        if leading and size > MAX_BATCH_BYTES:
            break
        leading.append(message)
    if first is None:
        raise ValueError("nothing queued")
    if len(leading) < 2:
        return first, 1
    return batch(leading), len(leading)


def of_one_node(node: str, items: Iterable[Any], what: str) -> None:
    """A batch's messages must all be its node's: raise naming the first that is not."""
    for item in items:
        if item.node != node:
            raise ValueError(f"{what} of node {item.node!r} in a batch of node {node!r}")


def kind_or(default: str) -> Callable[[Any], str]:
    """A discriminator for a topic that carries several kinds: a payload's ``kind``, or
    ``default`` when it names none (the single message's ``kind`` has a default)."""

    def kind(value: Any) -> str:
        found = (
            value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", "")
        )
        return found if isinstance(found, str) else ""

    return kind
