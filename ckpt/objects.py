"""The object-store tier: zstd-compressed shards and a manifest written last.

``ObjectTier`` stores each shard as ``PREFIX/JOB/STEP/rank-RANK.phx.zst``
(streamed through zstd level 1 by default, one frame per chunk; a chunk
whose sample would not shrink by ``Pacing.compress_min_saving`` goes as a raw
frame: zstd only where it pays) and, once the step is
committed, ``PREFIX/JOB/STEP/manifest.json`` listing every rank's checksum,
size and the compression: the copy describes itself, and a step without a
manifest is not listed.

The stores it keeps them in (a folder, an S3-protocol server) are ``ckpt.stores``.

Nothing read from a store is trusted to be small: a shard is read as a
``ShardReader`` (decompressed in pieces of at most ``PART_NBYTES``, never past
the manifest's ``nbytes``), and ``ObjectStore.get`` (manifests, listings) stops
at ``MAX_GET_NBYTES``. A zstd bomb or a lying size ends in a ``TierError``
naming the object, never in gigabytes of memory.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, Final, TypeVar, cast

import zstandard

from ckpt.errors import CheckpointError, TierError
from ckpt.files import AlignedBuffer
from ckpt.format import BufferLike, Hasher
from ckpt.pacing import Pacing
from ckpt.stores import PART_NBYTES, ObjectStore
from ckpt.tiers import (
    MANIFEST_NAME,
    ShardKey,
    StoredShard,
    Tier,
    TierManifest,
    checked_chunks,
    digest_text,
    parse_part,
    parse_step,
    part_name,
    step_dir,
)

__all__ = ["ObjectTier", "ShardReader"]

T = TypeVar("T")


class ObjectTier(Tier):
    """Shards in an ``ObjectStore``, zstd-compressed unless ``compression=None``."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        name: str = "object",
        compression: str | None = "zstd",
        level: int = 1,
        pacing: Pacing | None = None,
    ) -> None:
        if compression not in ("zstd", None):
            raise ValueError(f"compression {compression!r} must be 'zstd' or None")
        self.name = name
        self.store = store
        self.compression = compression
        self.compresses = compression is not None
        self.level = level
        self.pacing = pacing if pacing is not None else Pacing()

    def _key(self, key: ShardKey) -> str:
        return key.relpath(".zst" if self.compression else "")

    def _fail(
        self, what: str, where: str, exc: BaseException, key: ShardKey | None = None
    ) -> TierError:
        ref = key.ref(f"{self.store.url}{where}") if key else None
        return TierError(f"{what} {self.store.url}{where} failed: {exc}", tier=self.name, ref=ref)

    def put(self, key: ShardKey, shard: memoryview, checksum: str) -> str:
        where = self._key(key)
        hasher = Hasher()
        pieces = checked_chunks(shard, self.pacing.chunk_bytes, hasher, len(shard) - 32)
        buffer = AlignedBuffer(PART_NBYTES) if self.store.parts_in_turn else None
        parts = self._compressed(pieces, buffer) if self.compression else _regroup(pieces, buffer)
        try:
            self.store.put_stream(where, parts)
        except TierError:
            raise
        except Exception as exc:
            raise self._fail("uploading", where, exc, key) from exc
        finally:
            if buffer is not None:
                buffer.close()
        if digest_text(hasher) != checksum:
            self.store.delete([where])
            raise TierError(
                f"the bytes sent hash to {digest_text(hasher)}, not the sealed {checksum}",
                tier=self.name,
                ref=key.ref(self.store.url + where),
            )
        return self.store.url + where

    def _compressed(
        self, pieces: Iterable[memoryview], buffer: AlignedBuffer | None
    ) -> Iterator[BufferLike]:
        """One zstd frame per piece, regrouped into parts: a piece whose sample would not
        shrink by ``pacing.compress_min_saving`` goes as a raw frame (see ``Pacing``)."""
        compressor = zstandard.ZstdCompressor(level=self.level)
        min_saving = self.pacing.compress_min_saving

        def frames() -> Iterator[bytes | memoryview]:
            for piece in pieces:
                if min_saving > 0 and not _compression_pays(compressor, piece, min_saving):
                    yield from zstd_raw_frame(piece)
                else:
                    yield compressor.compress(piece)

        return _regroup(frames(), buffer)

    def commit(self, manifest: TierManifest) -> None:
        """Write the step's manifest, last. A partial manifest (one node's ranks) goes to
        its own part, ``JOB/STEP/manifest-rFIRST-rLAST.json``, then the step manifest
        (every node writes the same one, listing no shard) marks the step committed."""
        step = f"{manifest.job}/{step_dir(manifest.step)}"
        writes = []
        if manifest.partial and manifest.shards:
            part = TierManifest(
                manifest.job,
                manifest.step,
                manifest.shards,
                self.compression,
                manifest.committed_at,
                manifest.world_size,
            )
            first, last = min(manifest.shards), max(manifest.shards)
            writes.append((f"{step}/{part_name(first, last)}", part))
            manifest = TierManifest(
                manifest.job,
                manifest.step,
                {},
                self.compression,
                manifest.committed_at,
                manifest.world_size,
            )
        else:
            manifest = TierManifest(
                manifest.job,
                manifest.step,
                manifest.shards,
                self.compression,
                manifest.committed_at,
                manifest.world_size,
            )
        writes.append((f"{step}/{MANIFEST_NAME}", manifest))
        for where, content in writes:
            try:
                self.store.put_stream(where, [content.to_json()])
            except Exception as exc:
                raise self._fail("writing the manifest", where, exc) from exc

    def manifest(self, job: str, step: int, rank: int | None = None) -> TierManifest | None:
        """The step's manifest; for a step committed in parts, with the part that lists
        ``rank`` merged in (found by its name: one listing, one read)."""
        where = f"{job}/{step_dir(step)}/{MANIFEST_NAME}"
        try:
            raw = self.store.get(where)
        except FileNotFoundError:
            return None
        except Exception as exc:  # a store's error (PeerError, ObjectTooLarge, ...)
            raise self._fail("reading", where, exc) from exc
        try:
            found = TierManifest.from_json(raw, where=self.store.url + where)
        except CheckpointError:  # not a manifest: as good as none
            return None
        if not found.partial or rank is None or rank in found.shards:
            return found
        # Parts are named by the span of ranks they list, so a step saved again after the
        # gang was placed anew (a step no tier had committed) can leave an older part
        # whose span also holds ``rank``: the newest part that lists it wins.
        newest: TierManifest | None = None
        for key in self._step_keys(job).get(step, []):
            span = parse_part(key.rsplit("/", 1)[-1])
            if span is None or not span[0] <= rank <= span[1]:
                continue
            try:
                raw = self.store.get(key)
            except FileNotFoundError:
                continue
            except Exception as exc:
                raise self._fail("reading", key, exc) from exc
            try:
                part = TierManifest.from_json(raw, where=self.store.url + key)
            except CheckpointError:
                continue
            if (
                part.job == job
                and part.step == step
                and rank in part.shards
                and (newest is None or part.committed_at >= newest.committed_at)
            ):
                newest = part
        shards = {**found.shards, **(newest.shards if newest is not None else {})}
        return TierManifest(
            found.job, found.step, shards, found.compression, found.committed_at, found.world_size
        )

    def reader(
        self, key: ShardKey, nbytes: int | None = None, checksum: str | None = None
    ) -> ShardReader | None:
        """Rank ``key.rank``'s shard of a committed step, to read in bounded pieces, or
        ``None`` when this tier has none. ``nbytes``, when the caller knows it (the
        catalog's), must be what the step's manifest lists. With the catalog's
        ``checksum`` and ``nbytes`` too, a step committed in parts is read against them,
        not against its part for this rank: one that is not written yet (its node died
        first) or one an earlier placement of the gang left (see ``manifest``)."""
        manifest = self.manifest(key.job, key.step, key.rank)
        if manifest is None:
            return None
        if manifest.partial and checksum is not None and nbytes is not None:
            expected, listed = checksum, nbytes  # what the fleet committed wins over a part
        elif key.rank in manifest.shards:
            expected, listed = manifest.shards[key.rank]
        else:
            return None
        where = self._key(key)
        url = self.store.url + where
        if listed < 0 or (nbytes is not None and listed != nbytes):
            wanted = f", not the {nbytes} bytes the catalog lists" if nbytes is not None else ""
            raise TierError(
                f"the manifest of {url} lists {listed} bytes{wanted}",
                tier=self.name,
                ref=key.ref(url),
            )
        raw = self.store.get_stream(where)
        try:
            first = next(raw, b"")
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._fail("downloading", where, exc, key) from exc
        return ShardReader(
            self.name,
            key,
            url,
            listed,
            expected,
            first,
            raw,
            compressed=manifest.compression == "zstd",
        )

    def open(self, key: ShardKey) -> StoredShard | None:
        reader = self.reader(key)
        if reader is None:
            return None
        # The manifest's size is not trusted with memory: an anonymous map costs only the
        # pages written, so a manifest that lies upward holds no more than the content.
        # One byte more than it lists, to tell a content that runs long.
        try:
            buffer = mmap.mmap(
                -1, reader.nbytes + 1, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0)
            )
        except (OSError, OverflowError) as exc:
            reader.close()
            raise TierError(
                f"{reader.url}: no room for the {reader.nbytes} bytes its manifest lists: {exc}",
                tier=self.name,
                ref=key.ref(reader.url),
            ) from exc
        view = memoryview(buffer)
        with contextlib.closing(reader):
            while reader.readinto(view[reader.received : reader.received + PART_NBYTES]):
                pass
        # Short, decode reports the truncation as corrupt.
        return StoredShard(key, view[: reader.received], reader.url, expected=reader.expected)

    def _step_keys(self, job: str) -> dict[int, list[str]]:
        try:
            keys = self.store.keys(f"{job}/")
        except Exception as exc:
            raise self._fail("listing", f"{job}/", exc) from exc
        out: dict[int, list[str]] = {}
        for k in keys:
            parts = k.split("/")
            step = parse_step(parts[1]) if len(parts) == 3 else None
            if step is not None:
                out.setdefault(step, []).append(k)
        return out

    def steps(self, job: str) -> list[int]:
        return sorted(
            s
            for s, keys in self._step_keys(job).items()
            if any(k.endswith("/" + MANIFEST_NAME) for k in keys)
        )

    def landed_steps(self, job: str) -> list[int]:
        return sorted(self._step_keys(job))

    def delete(self, job: str, step: int) -> None:
        keys = self._step_keys(job).get(step, [])
        manifest = [k for k in keys if k.endswith("/" + MANIFEST_NAME)]
        try:
            self.store.delete(manifest)  # first: a half-deleted step is never "committed"
            self.store.delete([k for k in keys if k not in manifest])
        except Exception as exc:
            raise self._fail("deleting", f"{job}/{step_dir(step)}", exc) from exc

    def close(self) -> None:
        self.store.close()


class ShardReader:
    """One shard's content from an object store, as an iterator of pieces of at most
    ``PART_NBYTES``: zstd is decompressed one bounded piece at a time (a bomb never
    expands in memory) and the content may not run past ``nbytes`` (a ``TierError``
    naming the object as soon as it does). A short content just ends: ``received``
    says how much came, for the caller to compare with ``nbytes``. Every failure is a
    ``TierError``; ``close`` lets go of the connection or file."""

    def __init__(
        self,
        tier: str,
        key: ShardKey,
        url: str,
        nbytes: int,
        expected: str,
        first: bytes,
        raw: Iterator[bytes],
        *,
        compressed: bool,
    ) -> None:
        self.tier = tier
        self.key = key
        self.url = url
        self.nbytes = nbytes
        self.expected = expected
        self.received = 0
        self._raw = raw
        self._source = _IterReader(first, raw)
        self._zstd = (
            zstandard.ZstdDecompressor().stream_reader(
                cast(IO[bytes], self._source),
                read_size=1 << 17,
                read_across_frames=True,
                closefd=False,
            )
            if compressed
            else None
        )

    def __iter__(self) -> ShardReader:
        return self

    def __next__(self) -> bytes:
        # One byte past nbytes is enough to know the content is too long.
        want = min(PART_NBYTES, self.nbytes - self.received + 1)
        piece: bytes = self._guarded(lambda source: source.read(want))
        if not piece:
            self.close()
            raise StopIteration
        self._count(len(piece))
        return piece

    def readinto(self, view: memoryview) -> int:
        """Like ``next``, into ``view`` (no piece of its own: ``open`` fills its buffer with
        it); 0 at the end. ``view`` needs room for one byte past ``nbytes`` to tell a
        content that runs long."""
        want = min(len(view), self.nbytes - self.received + 1)
        n: int = self._guarded(lambda source: source.readinto(view[:want]))
        if n:
            self._count(n)
        else:
            self.close()
        return n

    def fill(self, view: memoryview) -> None:
        """Read the whole content into ``view`` (``nbytes`` long) and make sure nothing
        follows it; closed after. One that ends short or runs long is a ``TierError``
        naming the object (``corrupt``: the store answered, and what it holds is bad)."""
        if len(view) != self.nbytes:
            raise ValueError(f"fill needs a view of {self.nbytes} bytes, not {len(view)}")
        try:
            got = 0
            while got < len(view) and (n := self.readinto(view[got : got + PART_NBYTES])):
                got += n
            if got < self.nbytes:
                raise TierError(
                    f"{self.url} ended after {got} of the {self.nbytes} bytes its manifest lists",
                    tier=self.tier,
                    ref=self.key.ref(self.url),
                    corrupt=True,
                )
            self.readinto(memoryview(bytearray(1)))  # raises if the content runs long
        finally:
            self.close()

    def _guarded(self, read: Callable[[Any], T]) -> T:
        """``read`` of the content's source (the decompressor, or the raw pieces), every
        failure a ``TierError`` naming the object (closed)."""
        try:
            return read(self._zstd if self._zstd is not None else self._source)
        except zstandard.ZstdError as exc:
            self.close()
            raise TierError(
                f"{self.url} does not decompress: {exc}",
                tier=self.tier,
                ref=self.key.ref(self.url),
                corrupt=True,
            ) from exc
        except Exception as exc:
            self.close()
            raise TierError(
                f"downloading {self.url} failed: {exc}", tier=self.tier, ref=self.key.ref(self.url)
            ) from exc

    def _count(self, n: int) -> None:
        self.received += n
        if self.received > self.nbytes:
            self.close()
            raise TierError(
                f"{self.url} holds more than the {self.nbytes} bytes its manifest lists: refused",
                tier=self.tier,
                ref=self.key.ref(self.url),
                corrupt=True,
            )

    def close(self) -> None:
        close = getattr(self._raw, "close", None)
        if close is not None:
            with contextlib.suppress(ValueError):  # still running in another thread: GC closes
                close()


class _IterReader:
    """``read(n)`` over an iterator of byte pieces: at most ``n`` bytes a call."""

    def __init__(self, first: bytes, rest: Iterator[bytes]) -> None:
        self.pending = memoryview(first)
        self.rest = rest

    def read(self, n: int = -1) -> bytes:
        if not self._fill():
            return b""
        n = len(self.pending) if n < 0 else n
        out, self.pending = self.pending[:n], self.pending[n:]
        return bytes(out)

    def readinto(self, view: memoryview) -> int:
        if not self._fill():
            return 0
        n = min(len(view), len(self.pending))
        view[:n], self.pending = self.pending[:n], self.pending[n:]
        return n

    def _fill(self) -> bool:
        """Whether bytes are pending, taking the next piece when none is."""
        while not self.pending:
            piece = next(self.rest, None)
            if piece is None:
                return False
            self.pending = memoryview(piece)
        return True


_SAMPLE_NBYTES: Final = 128 << 10
_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
_RAW_BLOCK_NBYTES: Final = 128 << 10


def _compression_pays(
    compressor: zstandard.ZstdCompressor, piece: memoryview, min_saving: float
) -> bool:
    """Whether 128 KiB from the middle of ``piece`` shrink by ``min_saving``."""
    start = max(0, (len(piece) - _SAMPLE_NBYTES) // 2)
    sample = piece[start : start + _SAMPLE_NBYTES]
    return len(compressor.compress(sample)) <= len(sample) * (1 - min_saving)


def zstd_raw_frame(data: memoryview) -> list[bytes | memoryview]:
    """``data`` as one zstd frame of raw (stored) blocks, RFC 8878 section 3.1.1, in
    pieces that view ``data`` (no copy): any zstd decoder reads their concatenation.
    Frame header: no content size, no checksum, a 128 KiB window (descriptor 0x38);
    blocks of at most 128 KiB, each behind a 3-byte header (last-block bit, type 0 =
    raw, size)."""
    out: list[bytes | memoryview] = [_ZSTD_MAGIC + b"\x00\x38"]
    n = len(data)
    for start in range(0, max(n, 1), _RAW_BLOCK_NBYTES):
        size = min(_RAW_BLOCK_NBYTES, n - start)
        last = start + _RAW_BLOCK_NBYTES >= n
        out += [((size << 3) | last).to_bytes(3, "little"), data[start : start + size]]
    return out


def _regroup(
    pieces: Iterable[BufferLike], buffer: AlignedBuffer | None = None
) -> Iterator[BufferLike]:
    """Pieces regrouped into parts of ``PART_NBYTES``, each part copied once: joined
    into new bytes, or into ``buffer`` (``PART_NBYTES`` long; each part yielded is a
    view of it, good until the next is asked for)."""
    if buffer is not None:
        for piece in pieces:
            yield from buffer.fill(piece)
        yield buffer.rest()
        return
    pending: list[memoryview] = []
    held = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while len(view):
            take = min(len(view), PART_NBYTES - held)
            pending.append(view[:take])
            held += take
            view = view[take:]
            if held == PART_NBYTES:
                yield b"".join(pending)
                pending, held = [], 0
    yield b"".join(pending)
