"""What every message shares: the base model, the id patterns, the numeric limits."""

from __future__ import annotations

from typing import Annotated, Final

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
