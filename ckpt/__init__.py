"""Phalanx's tiered write-back checkpoint store (the ``ckpt`` package).

The public surface so far: the shard format (``plan`` / ``write_into`` /
``seal`` to save, ``decode`` to restore, ``checksum`` / ``verify``) and the
package's exception family.
"""

from __future__ import annotations

from ckpt.errors import (
    CheckpointError,
    FormatError,
    ShardCorrupt,
    ShardMismatch,
    ShardRef,
    UnsafeShard,
    UnsupportedValue,
)
from ckpt.format import (
    CHECKSUM_ALGORITHM,
    ShardPlan,
    checksum,
    decode,
    encode,
    plan,
    read_ref,
    seal,
    shard_nbytes,
    verify,
    write_into,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CheckpointError",
    "FormatError",
    "ShardCorrupt",
    "ShardMismatch",
    "ShardPlan",
    "ShardRef",
    "UnsafeShard",
    "UnsupportedValue",
    "checksum",
    "decode",
    "encode",
    "plan",
    "read_ref",
    "seal",
    "shard_nbytes",
    "verify",
    "write_into",
]
