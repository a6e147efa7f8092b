"""Phalanx's tiered write-back checkpoint store (the ``ckpt`` package).

The public surface: the rank-side ``Checkpointer`` (standalone with ``dir=``,
or under Phalanx, talking to its agent: ``ckpt.remote``); the tiers (``RamTier``,
``DiskTier``, ``ObjectTier`` over a ``LocalFolderStore`` or ``S3Store``) and the
write-down ``Engine`` that agentd runs too; the shard format (``plan`` /
``write_into`` / ``seal`` to save, ``decode`` to restore, ``checksum`` /
``verify``); the rank socket's ``protocol`` (the models both the rank's
``AgentClient`` and agentd's routes speak); the byte-level pieces agentd builds
its side of the tiers from (``Slot``, ``ShardReader``, ``AtomicFile``,
``AlignedBuffer``, ``SealCheck``, ``place_writer_thread``, ...); and the
package's exception family.
"""

from __future__ import annotations

from ckpt import protocol
from ckpt.checkpointer import Checkpointer
from ckpt.engine import Catalog, Engine, LocalCatalog, TierEvent
from ckpt.errors import (
    AgentError,
    CheckpointError,
    FormatError,
    ObjectTooLarge,
    PeerError,
    ShardCorrupt,
    ShardGone,
    ShardMismatch,
    ShardRef,
    TierError,
    UnsafeShard,
    UnsupportedValue,
    UnsupportedVersion,
)
from ckpt.files import AlignedBuffer, AtomicFile
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
from ckpt.objects import ObjectTier, ShardReader
from ckpt.pacing import Pacing, place_writer_thread
from ckpt.peer import PEER_KEY_RE, HttpPeerStore, SealCheck
from ckpt.policy import Interval
from ckpt.ram import RamTier, Slot, namespace_for
from ckpt.stores import PART_NBYTES, LocalFolderStore, ObjectStore, S3Store, open_store
from ckpt.tiers import DiskTier, ShardKey, StoredShard, Tier, TierManifest

__all__ = [
    "CHECKSUM_ALGORITHM",
    "PART_NBYTES",
    "PEER_KEY_RE",
    "AgentError",
    "AlignedBuffer",
    "AtomicFile",
    "Catalog",
    "CheckpointError",
    "Checkpointer",
    "DiskTier",
    "Engine",
    "FormatError",
    "HttpPeerStore",
    "Interval",
    "LocalCatalog",
    "LocalFolderStore",
    "ObjectStore",
    "ObjectTier",
    "ObjectTooLarge",
    "Pacing",
    "PeerError",
    "RamTier",
    "S3Store",
    "SealCheck",
    "ShardCorrupt",
    "ShardGone",
    "ShardKey",
    "ShardMismatch",
    "ShardPlan",
    "ShardReader",
    "ShardRef",
    "Slot",
    "StoredShard",
    "Tier",
    "TierError",
    "TierEvent",
    "TierManifest",
    "UnsafeShard",
    "UnsupportedValue",
    "UnsupportedVersion",
    "checksum",
    "decode",
    "encode",
    "namespace_for",
    "open_store",
    "place_writer_thread",
    "plan",
    "protocol",
    "read_ref",
    "seal",
    "shard_nbytes",
    "verify",
    "write_into",
]
