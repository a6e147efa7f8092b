"""Writing a tier's files: ``AtomicFile`` (a temporary name, written in chunks by
``O_DIRECT`` where the filesystem and the source allow it, fsynced, renamed),
``write_file_atomic``, ``fsync_dir``, the page-aligned ``AlignedBuffer`` an
``O_DIRECT`` write takes, and ``filesystem_type`` (which filesystems count as
local: ``LOCAL_FILESYSTEMS``)."""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

from ckpt.errors import ShardRef, TierError
from ckpt.format import BufferLike
from ckpt.pacing import Pacing, Throttle

_tmp_counter = itertools.count()


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
LOCAL_FILESYSTEMS: Final = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "bcachefs"}
)


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

    def __init__(
        self, path: Path, *, pacing: Pacing, tier: str, ref: ShardRef, direct: bool = False
    ) -> None:
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
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except BaseException as exc:
            raise self._failed(exc) from exc
        self.direct = direct and pacing.direct_io and _set_direct(self.fd, True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
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
                os.posix_fadvise(
                    self.fd, self.synced, self.written - self.synced, os.POSIX_FADV_DONTNEED
                )
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
        return TierError(
            f"writing {self.path} failed: {why}",
            tier=self.tier,
            ref=self.ref.merged(ShardRef(path=str(self.path))),
        )


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
