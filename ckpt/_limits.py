"""The shard format's torch-free constants, so byte-level code (the agent's write-down,
checksums, the peer tier) can import ``ckpt.format`` on a node without torch."""

from __future__ import annotations

from typing import Any, Final, TypeAlias

Json: TypeAlias = Any

ALIGN: Final = 64
MAX_DEPTH: Final = 64
MAX_NDIM: Final = 64


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


def is_uint(value: Json) -> bool:
    return type(value) is int and value >= 0
