"""The RAM tier: shard buffers in named shared memory that outlive the saver.

Each buffer (a *slot*) is a file in a tmpfs (``/dev/shm`` by default) named
``NAMESPACE.slotN``, mapped shared: a page of slot header, then the shard. The
namespace names the owner's job and rank (``phalanx-JOB-rRANK``); under
Phalanx the agent creates and keeps the files, so a rank's checkpoint survives
the rank (``kill -9`` included), and a restarted rank, or any process that
knows the namespace, maps them back by name. Standalone, the ``Checkpointer``
creates them and leaves them behind only if it dies.

Slots are allocated once, their pages allocated and mapped writable up front
(``fallocate``, ``MAP_POPULATE`` and ``MADV_POPULATE_WRITE``: the first save
copies at the speed of a touched buffer), and reused. A slot is *busy* from the moment a save starts
copying into it until the write-down has finished reading it, and a busy slot
is never handed out: a new save never overwrites a buffer still being written
down. The ``keep`` most recently sealed slots are *protected*: the newest
committed RAM copy is never overwritten before a newer one is sealed. When no
slot is free, ``acquire`` waits (up to a timeout) or returns ``None`` (skip),
as the caller chooses. A wait gives the newest saves ``commit_wait_s`` to be
committed; past that the oldest of them is reused (its copies below stay, and
its RAM copy is reported gone), so a catalog that lags or lost a landing costs
one save that long, not every save its whole timeout.

Slot header (64 bytes, little-endian): magic ``b"PHXSLOT\\0"``, version u32,
state u32 (0 free, 1 writing, 2 sealed), step i64, nbytes u64, capacity u64,
seq u64 (save order), xxh3-128 digest 16 bytes. ``sealed`` is written last;
a slot found ``writing`` after a crash holds nothing.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from ckpt.errors import ShardCorrupt, ShardRef, TierError
from ckpt.files import filesystem_type
from ckpt.format import CHECKSUM_ALGORITHM, sealed_digest, shard_nbytes, verify
from ckpt.tiers import ShardKey, StoredShard, Tier, check_job

__all__ = [
    "RamTier",
    "Slot",
    "namespace_for",
    "pin_for_dma",
    "populate_for_write",
    "read_slot_view",
    "unmap",
    "unpin_for_dma",
]

log = logging.getLogger(__name__)

HEADER_NBYTES: Final = 4096
_HEAD: Final = struct.Struct("<8sIIqQQQ16s")
_MAGIC: Final = b"PHXSLOT\x00"
_VERSION: Final = 1
FREE, WRITING, SEALED = 0, 1, 2
_GROW_ALIGN: Final = 2 << 20
_MAX_NBYTES: Final = 2**63 - 1 - HEADER_NBYTES - _GROW_ALIGN  # what the slot header holds
# Filesystems whose files are memory: a shared map of one is a copy into RAM and nothing more.
MEMORY_FILESYSTEMS: Final = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
_warned_dirs: set[Path] = set()

WhenBusy = Literal["wait", "skip"]


def _check_nbytes(nbytes: int, why: str) -> None:
    """``why`` (with ``{}`` for the size) when no slot header can hold ``nbytes``."""
    if type(nbytes) is not int or not 0 <= nbytes <= _MAX_NBYTES:
        raise ValueError(why.format(repr(nbytes)))


def namespace_for(job: str, rank: int) -> str:
    """The shared-memory name prefix of one rank's slots, as agent and rank agree on it."""
    return f"phalanx-{check_job(job)}-r{rank}"


def read_slot_view(mm: mmap.mmap, step: int) -> memoryview | None:
    """The shard in a mapped slot file when it is sealed and holds ``step``, else
    ``None`` (the caller decodes it, verifying the checksum, with a copy: a
    slot can be reused)."""
    if len(mm) < HEADER_NBYTES:
        return None
    magic, version, state, found, nbytes, _cap, _seq, _digest = _HEAD.unpack_from(mm, 0)
    if magic != _MAGIC or version != _VERSION or state != SEALED or found != step:
        return None
    if nbytes > len(mm) - HEADER_NBYTES:
        return None
    return memoryview(mm)[HEADER_NBYTES : HEADER_NBYTES + nbytes]


@dataclass(slots=True, eq=False)
class Slot:
    """One shared-memory shard buffer; state lives in its header and here."""

    index: int
    path: Path
    mm: mmap.mmap
    capacity: int
    state: int = FREE
    step: int = -1
    nbytes: int = 0
    seq: int = 0
    digest: bytes = bytes(16)
    busy: bool = False  # being written into, sealed or written down
    pins: int = 0  # readers decoding it
    pinned: int | None = None  # the address registered with CUDA (pin_for_dma), if it is
    staged: bool = False  # holds a copy read from a lower tier for a restore (RamTier.stage)

    def unmap(self) -> None:
        """Unpin and close the mapping (see ``unmap``)."""
        unmap(self.mm, self.pinned)
        self.pinned = None

    def view(self, nbytes: int | None = None) -> memoryview:
        n = self.nbytes if nbytes is None else nbytes
        return memoryview(self.mm)[HEADER_NBYTES : HEADER_NBYTES + n]

    def write_head(self) -> None:
        self.mm[: _HEAD.size] = _HEAD.pack(
            _MAGIC,
            _VERSION,
            self.state,
            self.step,
            self.nbytes,
            self.capacity,
            self.seq,
            self.digest,
        )

    @property
    def checksum(self) -> str:
        return f"{CHECKSUM_ALGORITHM}:{self.digest.hex()}"


_MADV_POPULATE_WRITE: Final = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def populate_for_write(mm: mmap.mmap) -> None:
    """Map every page of a shared mapping writable now, content unchanged.

    ``MAP_POPULATE`` maps a shared file's existing pages read-only, so the first
    write to each still faults: measured through an agent at 1 GiB, the first
    save into each slot took 0.20-0.30 s against 0.09-0.12 s once populated.
    A kernel without ``MADV_POPULATE_WRITE`` leaves it to the faults."""
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(_MADV_POPULATE_WRITE)


_CUDA_HOST_REGISTER_PORTABLE: Final = 1  # pinned for every CUDA context (as torch pins)


def pin_for_dma(mm: mmap.mmap, nbytes: int) -> int | None:
    """Register the mapping with CUDA so device-to-host copies DMA straight in.

    Returns the address registered, to hand to ``unpin_for_dma`` before the map is
    closed (CUDA holds pinned pages until they are unregistered, mapped or not), or
    ``None`` without a GPU or when CUDA refused: pinning is an optimisation, never
    fatal, and a refusal is logged with CUDA's error code."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        import ctypes

        address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        code = int(
            torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                address, nbytes, _CUDA_HOST_REGISTER_PORTABLE
            )
        )
    except Exception as exc:
        log.warning("could not pin a RAM-tier slot of %d bytes for DMA: %s", nbytes, exc)
        return None
    if code != 0:
        log.warning(
            "could not pin a RAM-tier slot of %d bytes for DMA: cudaHostRegister "
            "returned CUDA error %d (device-to-host copies into it stage through "
            "CUDA's own buffers)",
            nbytes,
            code,
        )
        return None
    return address


def unpin_for_dma(address: int | None) -> None:
    """Undo ``pin_for_dma`` (``None``: nothing was pinned); a refusal is logged."""
    if address is None:
        return
    try:
        import torch

        code = int(torch.cuda.cudart().cudaHostUnregister(address))  # type: ignore[no-untyped-call]
    except Exception as exc:
        log.warning("could not unpin a RAM-tier slot at %#x: %s", address, exc)
        return
    if code != 0:
        log.warning(
            "could not unpin a RAM-tier slot at %#x: cudaHostUnregister returned CUDA error %d",
            address,
            code,
        )


def unmap(mm: mmap.mmap, pinned: int | None) -> None:
    """Unpin a mapping (``pinned``: what ``pin_for_dma`` returned), then close it; a view
    still exported (tensors decoded from it) keeps it mapped until that view goes."""
    unpin_for_dma(pinned)
    with contextlib.suppress(BufferError):
        mm.close()


def _past(when: float, when_busy: WhenBusy) -> bool:
    return when_busy == "wait" and time.monotonic() >= when


class RamTier(Tier):
    """Named shared-memory slots for one job's rank; see the module docstring."""

    compresses = False

    def __init__(
        self,
        namespace: str,
        *,
        job: str,
        directory: str | os.PathLike[str] = "/dev/shm",
        slots: int = 2,
        keep: int = 1,
        name: str = "ram",
        pin: bool = True,
        commit_wait_s: float = 10.0,
    ) -> None:
        if slots < 2 or not 1 <= keep < slots:
            raise ValueError(f"RamTier needs slots >= 2 and 1 <= keep < slots, not {slots}, {keep}")
        self.name = name
        self.namespace = namespace
        self.job = job
        self.directory = Path(directory)
        self.nslots = slots
        self.keep = keep
        # The newest step committed at this tier (set by the engine): its slot is never reused
        # while it is the newest committed copy, whatever newer steps are merely sealed.
        self.newest_committed: int | None = None
        self.pin = pin  # an agent does not: the rank that copies into a slot pins its own map
        # How long a waiting save gives the newest saves (protected, not yet committed) to
        # be committed before it reuses the oldest of them: a catalog that lags or lost a
        # landing (a broker crash) must not stall every later save until its timeout.
        self.commit_wait_s = commit_wait_s
        self.cond = threading.Condition()
        self.slots: list[Slot | None] = [None] * slots
        self._allocating: set[int] = set()  # slots being (re)allocated, the lock released
        self._warn_unless_memory()
        self._attach()

    def _warn_unless_memory(self) -> None:
        """Say so (once per folder) when the slots would be files on a disk: every save
        into them is then dirty page cache the kernel writes back, and the stall follows
        the disk (measured through an agent at 1 GiB on ext4: up to 2.3x a memcpy)."""
        kind = filesystem_type(self.directory)
        where = self.directory.resolve()
        if kind is None or kind in MEMORY_FILESYSTEMS or where in _warned_dirs:
            return
        _warned_dirs.add(where)
        log.warning(
            "tier %s: %s is on a %s filesystem, not in memory: every save into its "
            "slots is also written back to that disk; put the RAM tier on a tmpfs "
            "(/dev/shm)",
            self.name,
            where,
            kind,
        )

    # ----------------------------------------------------------------- slots

    def _slot_path(self, index: int) -> Path:
        return self.directory / f"{self.namespace}.slot{index}"

    def _attach(self) -> None:
        """Map the slots a previous owner left (a crashed rank's checkpoint)."""
        pattern = re.compile(re.escape(self.namespace) + r"\.slot(\d+)$")
        try:
            names = os.listdir(self.directory)
        except OSError as exc:
            raise TierError(f"cannot list {self.directory}: {exc}", tier=self.name) from exc
        for entry in names:
            match = pattern.match(entry)
            if match is None or int(match[1]) >= self.nslots:
                continue
            index, path = int(match[1]), self.directory / entry
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    size = os.fstat(fd).st_size
                    if size < HEADER_NBYTES:
                        continue
                    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                finally:
                    os.close(fd)
            except OSError as exc:
                log.warning("tier %s: cannot map %s: %s", self.name, path, exc)
                continue
            slot = Slot(
                index,
                path,
                mm,
                size - HEADER_NBYTES,
                pinned=pin_for_dma(mm, size) if self.pin else None,
            )
            magic, version, state, step, nbytes, _cap, seq, digest = _HEAD.unpack_from(mm, 0)
            if (
                magic == _MAGIC
                and version == _VERSION
                and state == SEALED
                and (nbytes <= slot.capacity)
            ):
                slot.state, slot.step, slot.nbytes, slot.seq, slot.digest = (
                    SEALED,
                    step,
                    nbytes,
                    seq,
                    digest,
                )
            slot.write_head()
            self.slots[index] = slot

    def _allocate_unlocked(self, index: int, capacity: int) -> Slot:
        """(Re)allocate slot ``index`` with ``cond`` released (held on entry and on return):
        fresh memory takes seconds per GiB, and a reader of this tier (an agent's event
        loop listing its steps, a save of the rank waiting for another slot) must not wait
        on it. Meanwhile the slot is out of play: ``_pick`` passes it over, and the slot it
        replaces (never one a reader holds: not pinned) is busy and no longer sealed."""
        old = self.slots[index]
        if old is not None:
            old.busy, old.state = True, FREE
        self._allocating.add(index)
        self.cond.release()
        try:
            return self._allocate(index, capacity)
        finally:
            self.cond.acquire()
            self._allocating.discard(index)
            self.cond.notify_all()

    def _allocate(self, index: int, capacity: int) -> Slot:
        path = self._slot_path(index)
        size = HEADER_NBYTES + capacity
        old = self.slots[index]
        if old is not None:
            old.unmap()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)  # the pages exist now: no faults on first save
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            self.slots[index] = None
            raise TierError(
                f"cannot allocate {size} bytes of shared memory at {path}: {exc}",
                tier=self.name,
                ref=ShardRef(path=str(path)),
            ) from exc
        populate_for_write(mm)
        slot = Slot(index, path, mm, capacity, pinned=pin_for_dma(mm, size) if self.pin else None)
        slot.write_head()
        self.slots[index] = slot
        log.info("tier %s: allocated slot %s, %d bytes", self.name, path, size)
        return slot

    def reserve(self, nbytes: int) -> None:
        """Allocate and touch every slot for shards of up to ``nbytes`` now,
        so that no save pays for it (call it once the state exists)."""
        _check_nbytes(nbytes, "cannot reserve RAM-tier slots of {} bytes")
        capacity = -(-nbytes // _GROW_ALIGN) * _GROW_ALIGN
        with self.cond:
            for index in range(self.nslots):
                slot = self.slots[index]
                if index in self._allocating:
                    continue
                if slot is None or (
                    (slot.capacity < capacity or not slot.path.exists())
                    and not slot.busy
                    and not slot.pins
                    and slot.state != SEALED
                ):
                    self._allocate_unlocked(index, max(capacity, slot.capacity if slot else 0))

    def acquire(
        self, key: ShardKey, nbytes: int, *, when_busy: WhenBusy, timeout: float
    ) -> Slot | None:
        """A slot of at least ``nbytes`` for ``key``, marked busy and ``writing``.

        ``when_busy="skip"`` returns ``None`` at once when every slot is busy or
        protected; ``"wait"`` waits for one up to ``timeout`` seconds, then
        raises ``TimeoutError``.
        """
        _check_nbytes(nbytes, "a shard of {} bytes cannot have a RAM-tier slot")
        now = time.monotonic()
        deadline = now + timeout
        # Past this, a "wait" may reuse the oldest save protected only for its commit.
        unprotect_at = now + min(timeout, self.commit_wait_s)
        with self.cond:
            while (choice := self._pick(key, unprotect=_past(unprotect_at, when_busy))) is None:
                # A slot being allocated (reserved behind a save or a restore) is one about
                # to be free: "skip" waits for it, within the timeout, as for its own.
                if when_busy == "skip" and not self._allocating:
                    return None
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    if when_busy == "skip":
                        return None
                    raise TimeoutError(
                        f"no free RAM-tier slot for step {key.step} after {timeout:g} s "
                        f"(every one of {self.nslots} is being written down or pinned)"
                    )
                self.cond.wait(min(left, unprotect_at - now) if now < unprotect_at else left)
            capacity = -(-nbytes // _GROW_ALIGN) * _GROW_ALIGN
            if isinstance(choice, int):
                slot = self._allocate_unlocked(choice, capacity)
            elif choice.capacity < nbytes or not choice.path.exists():
                # Too small, or its file was removed under it (a /dev/shm cleaner): a rank
                # maps a slot by its path, so it gets a new file.
                slot = self._allocate_unlocked(choice.index, max(capacity, choice.capacity))
            else:
                slot = choice
            slot.busy, slot.staged = True, False
            slot.state, slot.step, slot.nbytes = WRITING, key.step, nbytes
            slot.seq = 1 + max((s.seq for s in self.slots if s is not None), default=0)
            slot.digest = bytes(16)
            slot.write_head()
            return slot

    def _pick(self, key: ShardKey | None = None, *, unprotect: bool = False) -> Slot | int | None:
        """A slot to reuse, the index of a slot to allocate, or ``None``. ``unprotect``:
        the newest saves not yet committed may go too (the oldest first), never the
        newest committed step's copy."""
        live = [s for s in self.slots if s is not None and s.index not in self._allocating]
        # A staged copy (``stage``) is a restore's, with a copy below: never among the
        # ``keep`` newest saves, and the first to go (else a rank that restored an older
        # step could find every slot protected at its first save).
        sealed = sorted(
            (s for s in live if s.state == SEALED and not s.staged), key=lambda s: -s.seq
        )
        protected = {id(s) for s in sealed[: self.keep]}
        # The newest copy of the newest committed step (``find`` reads that one): a step
        # saved twice must not hold two slots for good.
        committed = next((s for s in sealed if s.step == self.newest_committed), None)
        if committed is not None:
            protected.add(id(committed))
        candidates = [s for s in live if not s.busy and not s.pins and id(s) not in protected]
        free = [s for s in candidates if s.state != SEALED]
        if free:
            return min(free, key=lambda s: s.seq)
        empty = next(
            (i for i, s in enumerate(self.slots) if s is None and i not in self._allocating), None
        )
        if empty is not None:
            return empty
        if candidates:
            return min(candidates, key=lambda s: (not s.staged, s.seq))
        if not unprotect:
            return None
        waiting = [
            s
            for s in live
            if not s.busy and not s.pins and (committed is None or s is not committed)
        ]
        if not waiting:
            return None
        oldest = min(waiting, key=lambda s: s.seq)
        log.warning(
            "tier %s: %s: no commit of step %s came within %g s; its slot takes step %s "
            "(that step stays on the tiers below)",
            self.name,
            self.namespace,
            oldest.step,
            self.commit_wait_s,
            key.step if key is not None else "?",
        )
        return oldest

    def stage(
        self,
        key: ShardKey,
        nbytes: int,
        fill: Callable[[memoryview], None],
        expected: str | None = None,
    ) -> Slot | None:
        """Put a copy of ``key`` read from a lower tier into a free slot, to be read as a
        RAM copy: one copy out of memory already touched, pages the next saves reuse.

        ``fill`` writes the shard's ``nbytes`` into the view it is given (raising when it
        cannot). The slot is sealed only once the copy verifies (and matches ``expected``,
        a catalog's checksum); on any failure it is left free and the error raised:
        ``ShardCorrupt`` for a copy that does not verify, ``UnsupportedVersion`` for one
        of a format this reader does not know. ``None`` when no slot is free: nothing is
        waited for, and no busy or protected slot is touched."""
        slot = self.acquire(key, nbytes, when_busy="skip", timeout=0.0)
        if slot is None:
            return None
        try:
            view = slot.view(nbytes)
            try:
                fill(view)
                declared = shard_nbytes(view)  # a newer writer's version raises here
                if declared != nbytes:
                    raise ShardCorrupt(
                        f"the copy declares {declared} bytes, not the {nbytes} it was read as",
                        ref=key.ref(),
                    )
                verify(view, expected, ref=key.ref())
                digest = sealed_digest(view)
            finally:
                with contextlib.suppress(BufferError):
                    view.release()
        except BaseException:
            self.release(slot, keep_content=False)
            raise
        slot.staged = True
        self.sealed(slot, digest)
        self.release(slot)
        return slot

    def sealed(self, slot: Slot, digest: bytes) -> None:
        """Mark a slot's shard sealed (committed at this tier); it stays busy."""
        with self.cond:
            slot.digest = digest
            slot.state = SEALED
            slot.write_head()
            self.cond.notify_all()

    def release(self, slot: Slot, *, keep_content: bool = True) -> None:
        """The write-down has finished reading the slot: it may be reused."""
        with self.cond:
            slot.busy = False
            if not keep_content:
                slot.state = FREE
                slot.write_head()
            self.cond.notify_all()

    # ----------------------------------------------------------------- Tier

    def put(self, key: ShardKey, shard: memoryview, checksum: str) -> str:
        slot = self.acquire(key, len(shard), when_busy="wait", timeout=60.0)
        assert slot is not None
        try:
            slot.view(len(shard))[:] = shard
            self.sealed(slot, bytes.fromhex(checksum.split(":", 1)[1]))
        finally:
            self.release(slot)
        return str(slot.path)

    def _find(self, step: int) -> Slot | None:
        found = [s for s in self.slots if s is not None and s.state == SEALED and s.step == step]
        return max(found, key=lambda s: s.seq, default=None)

    def find(self, step: int) -> Slot | None:
        """The newest sealed slot holding ``step``, if any (read it verified: it can be
        reused once it is neither busy nor pinned)."""
        with self.cond:
            return self._find(step)

    def open(self, key: ShardKey) -> StoredShard | None:
        if key.job != self.job:
            return None
        with self.cond:
            slot = self._find(key.step)
            if slot is None:
                return None
            slot.pins += 1

        def unpin() -> None:
            with self.cond:
                slot.pins -= 1
                self.cond.notify_all()

        return StoredShard(
            key, slot.view(), str(slot.path), expected=slot.checksum, reused=True, release=unpin
        )

    def steps(self, job: str) -> list[int]:
        if job != self.job:
            return []
        with self.cond:
            return sorted({s.step for s in self.slots if s is not None and s.state == SEALED})

    def delete(self, job: str, step: int) -> None:
        if job != self.job:
            return
        with self.cond:
            for slot in self.slots:
                if slot is not None and slot.step == step and not slot.busy and not slot.pins:
                    slot.state = FREE
                    slot.write_head()
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            for slot in self.slots:
                if slot is not None and not slot.pins:
                    slot.unmap()

    def unlink(self) -> None:
        """Remove the segments (the owner is done with them)."""
        self.close()
        for index in range(self.nslots):
            self._slot_path(index).unlink(missing_ok=True)
