"""The tier interface, and the NVMe tier (``DiskTier``).

A tier holds sealed shards, keyed by (job, step, rank). Nearest first: RAM
(``ckpt.ram.RamTier``), NVMe (``DiskTier``), peer (an ``ObjectTier`` over
``ckpt.peer.HttpPeerStore``: a buddy node's agent over HTTP), object store
(``ckpt.objects.ObjectTier``). Every tier:

* ``put`` stores a shard from a buffer, checking the bytes it wrote against the
  checksum that ``seal`` recorded, and makes it visible only once it is whole
  (a partial write is never visible);
* ``commit`` records that a step is complete at this tier (every rank's shard
  landed) by writing the step's manifest last; ``steps`` lists committed steps
  only, so "latest" never points at an incomplete checkpoint;
* ``open`` returns a landed shard for reading (never trusted: the caller
  decodes and verifies it), ``delete`` drops a step, ``close`` lets go.

Errors are ``TierError``, naming the tier and the path.

The layout of a file-backed tier under its root::

    JOB/STEP(12 digits)/rank-RANK(5 digits).phx     the shard, sealed
    JOB/STEP/manifest.json                          written last, at commit
    JOB/STEP/.rank-RANK.phx.tmp-PID-N               in flight; removed on rescan
"""

from __future__ import annotations

import json
import logging
import mmap
import operator
import os
import re
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pydantic_core

from ckpt.errors import CheckpointError, ShardRef, TierError
from ckpt.files import write_file_atomic
from ckpt.format import CHECKSUM_ALGORITHM, BufferLike, Hasher
from ckpt.pacing import Pacing

__all__ = [
    "DiskTier",
    "ShardKey",
    "StoredShard",
    "Tier",
    "TierManifest",
]

log = logging.getLogger(__name__)

MANIFEST_NAME: Final = "manifest.json"
_STEP_DIGITS: Final = 12
_RANK_DIGITS: Final = 5
MAX_STEP: Final = 10**_STEP_DIGITS - 1
MAX_RANK: Final = 10**_RANK_DIGITS - 1


@dataclass(frozen=True, slots=True, order=True)
class ShardKey:
    """Which shard: one rank's state at one step of one job. A step or rank its files
    cannot be named by (``MAX_STEP``, ``MAX_RANK``) is a ``ValueError`` naming it."""

    job: str
    step: int
    rank: int

    def __post_init__(self) -> None:
        for name, top, digits in (
            ("step", MAX_STEP, _STEP_DIGITS),
            ("rank", MAX_RANK, _RANK_DIGITS),
        ):
            value = getattr(self, name)
            try:
                number = operator.index(value)  # a numpy or torch integer too
            except TypeError:
                number = -1
            if isinstance(value, bool) or not 0 <= number <= top:
                raise ValueError(
                    f"{name} {value!r} must be an integer in [0, {top}] (the "
                    f"{name} is named with {digits} digits in file names)"
                )
            object.__setattr__(self, name, number)

    def ref(self, path: str | None = None) -> ShardRef:
        return ShardRef(job=self.job, step=self.step, rank=self.rank, path=path)

    def relpath(self, suffix: str = "") -> str:
        return f"{self.job}/{step_dir(self.step)}/rank-{self.rank:05d}.phx{suffix}"


def step_dir(step: int) -> str:
    return f"{step:0{_STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    return int(name) if len(name) == _STEP_DIGITS and name.isdigit() else None


_PART_RE = re.compile(r"^manifest-r(\d{5})-r(\d{5})\.json$")


def part_name(first: int, last: int) -> str:
    """The name of a manifest part listing ranks ``first`` .. ``last`` (some of them)."""
    return f"manifest-r{first:05d}-r{last:05d}.json"


def parse_part(name: str) -> tuple[int, int] | None:
    found = _PART_RE.match(name)
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_job(job: str) -> str:
    if not job or "/" in job or job.startswith(".") or len(job) > 200:
        raise ValueError(f"job {job!r} must be 1-200 characters, no '/', not starting with '.'")
    return job


@dataclass(frozen=True, slots=True)
class TierManifest:
    """What a committed step holds at a tier: every rank's checksum and size.

    ``world_size`` (when known) says how many ranks the step has; a manifest that
    lists fewer is a *part*: under Phalanx each node learns the checksums of its
    own ranks only, and a shared tier (the object store, a buddy) gets one part per
    node beside a step manifest that lists none (see ``ObjectTier.commit``)."""

    job: str
    step: int
    shards: dict[int, tuple[str, int]]  # rank -> (checksum, nbytes)
    compression: str | None = None
    committed_at: float = field(default_factory=time.time)
    world_size: int | None = None

    @property
    def partial(self) -> bool:
        return self.world_size is not None and len(self.shards) < self.world_size

    def to_json(self) -> bytes:
        raw: dict[str, object] = {
            "format": "phalanx-step-manifest/1",
            "job": self.job,
            "step": self.step,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "compression": self.compression,
            "committed_at": self.committed_at,
            "shards": [
                {"rank": r, "checksum": c, "nbytes": n} for r, (c, n) in sorted(self.shards.items())
            ],
        }
        if self.world_size is not None:
            raw["world_size"] = self.world_size
        return json.dumps(raw, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> TierManifest:
        try:
            # jiter, not json.loads: nesting past 200 levels is a ValueError, not a
            # RecursionError; 1e999 and a 400-digit float are an OverflowError below.
            raw = pydantic_core.from_json(data, allow_inf_nan=False)
            shards = {int(s["rank"]): (str(s["checksum"]), int(s["nbytes"])) for s in raw["shards"]}
            return cls(
                str(raw["job"]),
                int(raw["step"]),
                shards,
                raw.get("compression"),
                float(raw["committed_at"]),
                int(raw["world_size"]) if raw.get("world_size") is not None else None,
            )
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise CheckpointError(f"manifest {where} is not valid: {exc}") from exc


@dataclass(slots=True)
class StoredShard:
    """A shard read from a tier: ``buffer`` holds its bytes (untrusted until
    decoded with verification). ``reused`` says the buffer is shared memory that
    a later save may overwrite, so decoding must copy."""

    key: ShardKey
    buffer: BufferLike
    path: str
    expected: str | None = None
    reused: bool = False
    release: Any = None  # called once the caller is done with a reused buffer

    def close(self) -> None:
        if self.release is not None:
            self.release()
            self.release = None


class Tier(ABC):
    """A place that holds sealed shards; see the module docstring."""

    name: str
    compresses: bool = False

    @abstractmethod
    def put(self, key: ShardKey, shard: memoryview, checksum: str) -> str:
        """Store a sealed shard; returns where it landed. Raises ``TierError``."""

    def commit(self, manifest: TierManifest) -> None:  # noqa: B027 - optional hook
        """Record that ``manifest.step`` is complete here (default: nothing to write)."""

    @abstractmethod
    def open(self, key: ShardKey) -> StoredShard | None:
        """The landed shard for ``key``, or ``None`` when this tier has none."""

    @abstractmethod
    def steps(self, job: str) -> list[int]:
        """Committed steps of ``job`` at this tier, ascending."""

    def landed_steps(self, job: str) -> list[int]:
        """Steps with any data here, committed or not (what retention may delete)."""
        return self.steps(job)

    def manifest(self, job: str, step: int) -> TierManifest | None:
        """The committed manifest of a step, where this tier keeps one."""
        return None

    @abstractmethod
    def delete(self, job: str, step: int) -> None:
        """Drop every shard of a step at this tier."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Let go of resources (files, connections, threads)."""


def chunks(view: memoryview, size: int) -> Iterator[memoryview]:
    for start in range(0, len(view), size):
        yield view[start : start + size]


def checked_chunks(view: memoryview, size: int, hasher: Any, body_end: int) -> Iterator[memoryview]:
    """``view`` in chunks, feeding the hasher every byte before ``body_end``."""
    for start in range(0, len(view), size):
        piece = view[start : start + size]
        if start < body_end:
            hasher.update(piece[: body_end - start])
        yield piece


def digest_text(hasher: Any) -> str:
    return f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}"


# --------------------------------------------------------------------------- disk


class DiskTier(Tier):
    """The NVMe tier: shard files under ``root``, written with ``write_file_atomic``.

    A shard file exists under its final name only once it is whole and
    fsynced; a step is committed once its ``manifest.json`` is. Construction
    rescans ``root`` and removes temp files left by a crash.
    """

    compresses = False

    def __init__(
        self, root: str | os.PathLike[str], *, name: str = "disk", pacing: Pacing | None = None
    ) -> None:
        self.name = name
        self.root = Path(root)
        self.pacing = pacing if pacing is not None else Pacing()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierError(f"cannot create {self.root}: {exc}", tier=name) from exc
        self.rescan()

    def rescan(self) -> None:
        """Remove temp files of writes that never finished."""
        for tmp in self.root.glob("*/*/.*.tmp-*"):
            log.info("tier %s: removing an unfinished write %s", self.name, tmp)
            tmp.unlink(missing_ok=True)

    def path(self, key: ShardKey) -> Path:
        return self.root / key.relpath()

    def put(self, key: ShardKey, shard: memoryview, checksum: str) -> str:
        path = self.path(key)
        hasher = Hasher()
        body_end = len(shard) - 32
        write_file_atomic(
            path,
            checked_chunks(shard, self.pacing.chunk_bytes, hasher, body_end),
            pacing=self.pacing,
            tier=self.name,
            ref=key.ref(),
            direct=True,
        )
        if digest_text(hasher) != checksum:
            path.unlink(missing_ok=True)
            raise TierError(
                f"the bytes written hash to {digest_text(hasher)}, not the sealed {checksum}: "
                "the source buffer changed during the write",
                tier=self.name,
                ref=key.ref(str(path)),
            )
        return str(path)

    def commit(self, manifest: TierManifest) -> None:
        path = self.root / manifest.job / step_dir(manifest.step) / MANIFEST_NAME
        write_file_atomic(
            path,
            [manifest.to_json()],
            pacing=self.pacing,
            tier=self.name,
            ref=ShardRef(job=manifest.job, step=manifest.step),
        )

    def manifest(self, job: str, step: int) -> TierManifest | None:
        path = self.root / job / step_dir(step) / MANIFEST_NAME
        try:
            return TierManifest.from_json(path.read_bytes(), where=str(path))
        except FileNotFoundError:
            return None
        except (OSError, CheckpointError) as exc:
            log.warning("tier %s: unreadable manifest %s: %s", self.name, path, exc)
            return None

    def open(self, key: ShardKey) -> StoredShard | None:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierError(f"cannot open {path}: {exc}", tier=self.name, ref=key.ref()) from exc
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return StoredShard(key, b"", str(path))
            # A private, copy-on-write map: tensors decode as zero-copy views of the
            # page cache, and writing to them never reaches the file.
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
            buffer.madvise(mmap.MADV_SEQUENTIAL)
        finally:
            os.close(fd)
        manifest = self.manifest(key.job, key.step)
        expected = manifest.shards.get(key.rank, (None, 0))[0] if manifest else None
        return StoredShard(key, buffer, str(path), expected=expected)

    def _step_dirs(self, job: str) -> Iterator[tuple[int, Path]]:
        base = self.root / job
        try:
            entries = list(os.scandir(base))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TierError(f"cannot list {base}: {exc}", tier=self.name) from exc
        for entry in entries:
            step = parse_step(entry.name)
            if step is not None and entry.is_dir():
                yield step, Path(entry.path)

    def steps(self, job: str) -> list[int]:
        return sorted(s for s, d in self._step_dirs(job) if (d / MANIFEST_NAME).exists())

    def landed_steps(self, job: str) -> list[int]:
        return sorted(s for s, _ in self._step_dirs(job))

    def delete(self, job: str, step: int) -> None:
        path = self.root / job / step_dir(step)
        try:
            # The manifest goes first: a half-deleted step is never "committed".
            (path / MANIFEST_NAME).unlink(missing_ok=True)
            shutil.rmtree(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TierError(f"cannot delete {path}: {exc}", tier=self.name) from exc
