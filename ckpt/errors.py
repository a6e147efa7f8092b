"""The checkpoint package's exception family.

Every error carries the ids known where it was raised (job, step, rank, path)
as attributes and at the end of its message, so one log line is enough to find
the shard. Chain the cause with ``raise ... from exc``.

* ``CheckpointError`` — the base; catch it to catch them all.
* ``FormatError`` — the bytes are not a valid shard (bad magic, unsupported
  version, a header field out of bounds). ``UnsafeShard`` is the case where the
  bytes are a pickle stream or a ``torch.save`` archive, which is never loaded.
* ``ShardCorrupt`` — the bytes are not the ones that were sealed: a checksum
  mismatch, a truncated or unsealed shard.
* ``ShardMismatch`` — a valid shard, but not the one asked for (its header
  names another job, step or rank).
* ``TierError`` — a tier failed to store or serve a shard; names the tier.
* ``UnsupportedValue`` — a state holds a value the format cannot store
  faithfully (raised when planning a save; also a ``TypeError``).
* ``ShardGone`` — a copy a restore plan listed was not there when read.
* ``AgentError`` — under Phalanx, the node's agent refused a rank's request or
  could not be reached.
* ``PeerError`` — a buddy agent (the peer tier's store) answered with an error or
  not at all; also an ``OSError``, as every object store's error is.
* ``ObjectTooLarge`` — an object, or what it decompresses to, is past what its
  reader allows; also an ``OSError``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class ShardRef:
    """Who a shard belongs to; every field is optional.

    A shard's header records ``job``, ``step`` and ``rank``; ``path`` is where
    the bytes were read from (a file, a shared-memory segment, a URL) and is
    never stored.
    """

    job: str | None = None
    step: int | None = None
    rank: int | None = None
    path: str | None = None

    def merged(self, other: ShardRef) -> ShardRef:
        """This reference with its unknown fields filled in from ``other``."""
        return ShardRef(
            job=self.job if self.job is not None else other.job,
            step=self.step if self.step is not None else other.step,
            rank=self.rank if self.rank is not None else other.rank,
            path=self.path if self.path is not None else other.path,
        )

    def __str__(self) -> str:
        known = [
            f"{f.name}={value}"
            for f in fields(self)
            if (value := getattr(self, f.name)) is not None
        ]
        return " ".join(known)


class CheckpointError(Exception):
    """Base of every error raised by the ``ckpt`` package."""

    def __init__(self, message: str, *, ref: ShardRef | None = None) -> None:
        self.reason = message
        self.ref = ref if ref is not None else ShardRef()
        ids = str(self.ref)
        super().__init__(f"{message} ({ids})" if ids else message)

    @property
    def job(self) -> str | None:
        return self.ref.job

    @property
    def step(self) -> int | None:
        return self.ref.step

    @property
    def rank(self) -> int | None:
        return self.ref.rank

    @property
    def path(self) -> str | None:
        return self.ref.path

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Keep the ids when an error crosses a process boundary.
        return (functools.partial(type(self), ref=self.ref), (self.reason,))


class FormatError(CheckpointError):
    """The bytes do not follow the shard format; nothing in them was trusted."""


class UnsafeShard(FormatError):
    """The bytes are a pickle stream or a ``torch.save`` archive; never loaded."""


class UnsupportedVersion(FormatError):
    """A shard of a format version this reader does not know (a newer writer, say during
    a rolling upgrade): not proof that the copy is bad, so it is not reported as one."""


class ShardCorrupt(CheckpointError):
    """The bytes differ from the ones that were sealed (checksum, truncation)."""


class ShardMismatch(CheckpointError):
    """A valid shard whose header names another job, step or rank."""


class UnsupportedValue(CheckpointError, TypeError):
    """A state holds a value the format cannot store faithfully."""


class TierError(CheckpointError):
    """A tier could not store, list, read or delete a shard (a full disk, an
    unreachable object store). ``tier`` names the tier; ``path`` where it failed.
    A failing tier never costs a checkpoint committed there or at another tier.
    ``corrupt``: the tier answered, and what it holds is bad (it does not
    decompress, or is longer than its manifest says), as opposed to a tier that
    could not be reached or read."""

    def __init__(
        self, message: str, *, tier: str, ref: ShardRef | None = None, corrupt: bool = False
    ) -> None:
        self.tier = tier
        self.corrupt = corrupt
        super().__init__(f"tier {tier}: {message}", ref=ref)
        self.reason = message

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (
            functools.partial(type(self), tier=self.tier, ref=self.ref, corrupt=self.corrupt),
            (self.reason,),
        )


class ShardGone(CheckpointError):
    """The copy a restore plan listed was not there when read."""


class AgentError(CheckpointError):
    """The agent refused a request (``status``: its HTTP status) or could not be reached
    (``status`` is ``None``)."""

    def __init__(
        self, message: str, *, ref: ShardRef | None = None, status: int | None = None
    ) -> None:
        super().__init__(message, ref=ref)
        self.status = status

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (functools.partial(type(self), ref=self.ref, status=self.status), (self.reason,))


class PeerError(CheckpointError, OSError):
    """The buddy answered with an error or not at all. An ``OSError`` too: the peer
    tier is an object store, whose errors the ``ObjectTier`` turns into a ``TierError``
    naming the URL."""


class ObjectTooLarge(CheckpointError, OSError):
    """An object (or what it decompresses to) is longer than its reader allows;
    ``what`` names it, ``limit`` is the allowance in bytes. An ``OSError`` too, as
    every object store's error is."""

    def __init__(self, what: str, limit: int, detail: str = "") -> None:
        self.what = what
        self.limit = limit
        self.detail = detail
        super().__init__(f"{what} is larger than the {limit}-byte limit{detail}")

    def __reduce__(self) -> tuple[object, tuple[str, int, str]]:
        return (type(self), (self.what, self.limit, self.detail))
