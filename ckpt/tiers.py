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

import contextlib
import errno
import itertools
import json
import logging
import mmap
import operator
import os
import re
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ckpt.errors import CheckpointError, ShardRef, TierError
from ckpt.format import CHECKSUM_ALGORITHM, BufferLike, Hasher

__all__ = [
    "DiskTier",
    "Pacing",
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
_tmp_counter = itertools.count()


@dataclass(frozen=True, slots=True, order=True)
class ShardKey:
    """Which shard: one rank's state at one step of one job. A step or rank its files
    cannot be named by (``MAX_STEP``, ``MAX_RANK``) is a ``ValueError`` naming it."""

    job: str
    step: int
    rank: int

    def __post_init__(self) -> None:
        for name, top, digits in (("step", MAX_STEP, _STEP_DIGITS),
                                  ("rank", MAX_RANK, _RANK_DIGITS)):  # fmt: skip
            value = getattr(self, name)
            try:
                number = operator.index(value)  # a numpy or torch integer too
            except TypeError:
                number = -1
            if isinstance(value, bool) or not 0 <= number <= top:
                raise ValueError(f"{name} {value!r} must be an integer in [0, {top}] (the "
                                 f"{name} is named with {digits} digits in file names)")
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
            raw = json.loads(data)
            shards = {int(s["rank"]): (str(s["checksum"]), int(s["nbytes"])) for s in raw["shards"]}
            return cls(
                str(raw["job"]),
                int(raw["step"]),
                shards,
                raw.get("compression"),
                float(raw["committed_at"]),
                int(raw["world_size"]) if raw.get("world_size") is not None else None,
            )
        except (ValueError, KeyError, TypeError) as exc:
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


# --------------------------------------------------------------------------- pacing


@dataclass(frozen=True, slots=True)
class Pacing:
    """How gently the write-down runs next to the training loop.

    The writer thread writes ``chunk_bytes`` at a time. A shard file goes
    with ``O_DIRECT`` where it can (``direct_io``): the device reads the bytes
    straight from the RAM slot by DMA, with no copy into the page cache (on 2
    cores, 1 GiB took 0.07 s of CPU that way against 0.86 s buffered: the
    kernel's copy and page-cache bookkeeping are most of what a disk
    write-down takes from the training loop). Otherwise (a filesystem that
    refuses ``O_DIRECT``, a source not page-aligned, small files) it writes
    through the page cache, flushes every ``sync_bytes`` with ``fdatasync``
    (waiting on the device, not the CPU) and drops what it flushed from the
    cache (``drop_cache``: the RAM tier already holds the bytes; caching them
    twice costs memory and reclaim CPU later). ``max_bytes_per_s`` caps the
    rate (``None``: as fast as the device goes).

    ``compress_level`` is the zstd level of the tiers that compress (the
    object store; negative levels are zstd's fast ones). Level 1 costs about
    2.4 s of CPU per GiB here and saves 8% on fp32 noise; level -3 costs 0.5 s
    and saves nothing on it: a store whose bandwidth is well above the
    compressor's is better served by ``compression=None``.
    ``compress_min_saving``: zstd goes where it pays. Each chunk is compressed
    only when 128 KiB from its middle shrink by at least this fraction at that
    level (the sample costs ~1.5% of compressing the chunk); any other goes as
    a raw zstd frame, one copy. Measured at level 1: fp32 noise saves 7.6%
    (sent raw at the default 0.10), bf16 noise 22% (compressed); a state's
    JSON header and zero padding always compress. 0 compresses everything.

    ``nice`` lowers the writer threads' CPU priority (Linux sets it per
    thread) and ``idle`` puts them in ``SCHED_IDLE`` (they run only on a core
    nothing else wants). Both are off by default. Measured with bench/ckpt.py
    at 1 GiB on 2 cores, disk tier only (the writer used 0.23 s of CPU either
    way): at nice 0 the matmul loop lost 0.39 s of compute and the write-down
    took 1.2 s; at nice 19 it lost 2.0 s over 14 s, and at ``SCHED_IDLE`` 15 s
    over 136 s. A deprioritized writer that holds the GIL is starved by the
    loop's own threads, which then wait for the GIL (a priority inversion).
    Where the engine runs in a process of its own (the agent, under Phalanx)
    there is no GIL to share, but on cores the loop keeps busy it still only
    trades compute for time: the agent's full write-down (zstd included) took
    6 s at nice 0, 34 s at nice 10 with no compute saved, 262 s at nice 19
    (agentd's ``ckpt.write_nice``).

    ``cpus`` keeps the writer threads on those CPUs (empty: wherever the
    scheduler puts them): the way to take the write-down off the training
    cores where a node has cores the ranks do not use (agentd's
    ``ckpt.write_cpus``, which also keeps the ranks off them). A CPU this
    process may not use is refused here.
    """

    chunk_bytes: int = 8 << 20
    sync_bytes: int = 64 << 20
    nice: int = 0
    max_bytes_per_s: float | None = None
    drop_cache: bool = True
    direct_io: bool = True
    idle: bool = False
    compress_level: int = 1
    compress_min_saving: float = 0.10
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.cpus:
            usable = os.sched_getaffinity(0)
            if not set(self.cpus) <= usable:
                raise ValueError(f"Pacing.cpus {sorted(self.cpus)}: CPU(s) "
                                 f"{sorted(set(self.cpus) - usable)} are not among those this "
                                 f"process may use ({_cpu_list(usable)})")  # fmt: skip
        if self.chunk_bytes <= 0 or self.sync_bytes < self.chunk_bytes:
            raise ValueError("Pacing needs chunk_bytes > 0 and sync_bytes >= chunk_bytes")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"Pacing.nice is {self.nice}; it must be in [0, 19]")
        if not -7 <= self.compress_level <= 22:
            raise ValueError(f"Pacing.compress_level is {self.compress_level}; zstd takes -7..22")
        if not 0 <= self.compress_min_saving < 1:
            raise ValueError(f"Pacing.compress_min_saving is {self.compress_min_saving}; it "
                             "must be in [0, 1)")  # fmt: skip


class Throttle:
    """Sleeps just enough to hold a byte rate (no-op without a cap)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.start = time.monotonic()
        self.done = 0

    def __call__(self, nbytes: int) -> None:
        if self.rate is None:
            return
        self.done += nbytes
        ahead = self.done / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)


def lower_thread_priority(nice: int, idle: bool = False) -> None:
    """Make the calling thread nicer, and with ``idle`` put it in ``SCHED_IDLE``
    (Linux: a thread id is a PRIO_PROCESS target, and pid 0 of
    ``sched_setscheduler`` is the calling thread)."""
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(current, nice))
        except OSError as exc:  # a sandbox may refuse; pacing still works without it
            log.debug("could not renice the writer thread: %s", exc)
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            log.debug("could not make the writer thread SCHED_IDLE: %s", exc)


def place_writer_thread(pacing: Pacing) -> None:
    """Apply ``pacing``'s niceness, ``SCHED_IDLE`` and CPUs to the calling thread (Linux:
    pid 0 of ``sched_setaffinity`` is the calling thread). Not fatal where refused."""
    lower_thread_priority(pacing.nice, pacing.idle)
    if pacing.cpus:
        try:
            os.sched_setaffinity(0, pacing.cpus)
        except OSError as exc:
            log.warning("could not keep the writer thread on CPUs %s: %s",
                        _cpu_list(pacing.cpus), exc)  # fmt: skip


def _cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_DIRECT_ALIGN: Final = 4096  # O_DIRECT: address, length and offset, for any block size


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; whether it is now on."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return False
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | o_direct if on else flags & ~o_direct)
    except OSError:  # a filesystem without O_DIRECT (tmpfs) refuses it
        return False
    return on


def _aligned_prefix(view: memoryview) -> int:
    """How many leading bytes of ``view`` an ``O_DIRECT`` write can take."""
    if view.readonly or len(view) < _DIRECT_ALIGN:
        return 0
    import ctypes

    anchor = ctypes.c_char.from_buffer(view)
    try:
        address = ctypes.addressof(anchor)
    finally:
        del anchor  # it pins the buffer: release it at once
    return 0 if address % _DIRECT_ALIGN else len(view) - len(view) % _DIRECT_ALIGN


# Filesystems on this node's own devices (or memory), where O_DIRECT is the fast path. On a
# network or FUSE filesystem (NFS, Lustre, CephFS, ...) it makes every write wait for the
# server with no write-behind, and some FUSE filesystems take the flag and misbehave.
LOCAL_FILESYSTEMS: Final = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs",
                                      "bcachefs"})  # fmt: skip


def filesystem_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` lies on (``/proc/self/mountinfo``: the mount
    point that is the longest prefix of the resolved path), ``None`` if not known."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = str(path.resolve())
    best, kind = -1, None
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = parts[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), rest.split()[0]
    return kind


class AlignedBuffer:
    """A page-aligned buffer of ``nbytes`` (an anonymous map): what an ``O_DIRECT`` write
    takes from memory, for bytes that do not already lie in such memory."""

    def __init__(self, nbytes: int) -> None:
        self.memory = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.memory)
        self.held = 0  # the bytes filled so far

    def fill(self, data: BufferLike) -> Iterator[memoryview]:
        """Copy ``data`` in after what it holds, yielding the whole buffer each time it
        is full (the view is good until the next is asked for; it starts over then)."""
        view = memoryview(data).cast("B")
        size = len(self.view)
        while len(view):
            take = min(len(view), size - self.held)
            self.view[self.held : self.held + take] = view[:take]
            self.held += take
            view = view[take:]
            if self.held == size:
                self.held = 0
                yield self.view

    def rest(self) -> memoryview:
        """What it holds that was not yielded full."""
        return self.view[: self.held]

    def close(self) -> None:
        """Unmap it now (a view of it still held elsewhere keeps it until that goes)."""
        with contextlib.suppress(BufferError):
            self.view.release()
            self.memory.close()


class AtomicFile:
    """A file written piece by piece under a temp name beside ``path``, and on a clean
    exit from its ``with`` block fsynced, renamed to ``path`` and its directory fsynced.
    On any error the temp file is removed and an ``OSError`` becomes a ``TierError``
    naming the path (``ENOSPC`` says the disk is full). ``written``: the bytes so far.

    ``direct`` asks for ``O_DIRECT`` (with ``pacing.direct_io``): pieces that are
    page-aligned go by DMA from their memory, bypassing the page cache; the first
    piece that is not (a short tail) and everything after it go through the cache;
    a filesystem that refuses ``O_DIRECT`` gets the cache throughout.
    """

    def __init__(self, path: Path, *, pacing: Pacing, tier: str, ref: ShardRef,
                 direct: bool = False) -> None:  # fmt: skip
        self.path = path
        self.pacing = pacing
        self.tier = tier
        self.ref = ref
        self.tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{next(_tmp_counter)}"
        self.throttle = Throttle(pacing.max_bytes_per_s)
        self.written = self.synced = 0
        self.fd = -1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                              0o644)  # fmt: skip
        except BaseException as exc:
            raise self._failed(exc) from exc
        self.direct = direct and pacing.direct_io and _set_direct(self.fd, True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:  # fmt: skip
        if exc is None:
            try:
                self._commit()
                return
            except BaseException as failed:
                exc = failed
        self.abort()
        if isinstance(exc, OSError):
            raise self._failed(exc) from exc
        if exc_type is None:  # the commit's own error, not an OSError
            raise exc

    def write(self, piece: BufferLike) -> None:
        """Append ``piece``; a ``TierError`` naming the path if that fails (the file is
        left for the ``with`` block's exit, or ``abort``, to remove)."""
        try:
            self._write(piece)
        except OSError as exc:
            raise self._failed(exc) from exc

    def _write(self, piece: BufferLike) -> None:
        view = memoryview(piece).cast("B")
        if self.direct:
            aligned = _aligned_prefix(view)
            while aligned:
                try:
                    n = os.write(self.fd, view[:aligned])
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    n = 0  # this file or device refuses it after all
                if n <= 0:
                    break
                view, aligned = view[n:], aligned - n
                self.written += n
                self.synced = self.written  # nothing of it sits in the page cache
                self.throttle(n)
                if n % _DIRECT_ALIGN:  # a short write: the offset is unaligned now
                    break
            if view:
                self.direct = _set_direct(self.fd, False)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
            self.written += n
            self.throttle(n)
        if self.written - self.synced >= self.pacing.sync_bytes:
            os.fdatasync(self.fd)
            if self.pacing.drop_cache:
                os.posix_fadvise(self.fd, self.synced, self.written - self.synced,
                                 os.POSIX_FADV_DONTNEED)  # fmt: skip
            self.synced = self.written

    def _commit(self) -> None:
        os.fsync(self.fd)
        if self.pacing.drop_cache:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Close and remove the temp file (nothing was renamed into place)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)

    def _failed(self, exc: BaseException) -> BaseException:
        if not isinstance(exc, OSError):
            return exc
        why = "the disk is full" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
        return TierError(f"writing {self.path} failed: {why}", tier=self.tier,
                         ref=self.ref.merged(ShardRef(path=str(self.path))))  # fmt: skip


def write_file_atomic(
    path: Path,
    pieces: Iterable[BufferLike],
    *,
    pacing: Pacing,
    tier: str,
    ref: ShardRef,
    direct: bool = False,
) -> int:
    """Write ``pieces`` to ``path`` as an ``AtomicFile`` (see there: temp name, fsync,
    rename, ``O_DIRECT`` with ``direct``). Returns the bytes written."""
    with AtomicFile(path, pacing=pacing, tier=tier, ref=ref, direct=direct) as out:
        for piece in pieces:
            out.write(piece)
    return out.written


class DiskTier(Tier):
    """The NVMe tier: shard files under ``root``, written with ``write_file_atomic``.

    A shard file exists under its final name only once it is whole and
    fsynced; a step is committed once its ``manifest.json`` is. Construction
    rescans ``root`` and removes temp files left by a crash.
    """

    compresses = False

    def __init__(self, root: str | os.PathLike[str], *, name: str = "disk",
                 pacing: Pacing | None = None) -> None:  # fmt: skip
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
            path, [manifest.to_json()], pacing=self.pacing, tier=self.name,
            ref=ShardRef(job=manifest.job, step=manifest.step),
        )  # fmt: skip

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
