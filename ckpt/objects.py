"""The object-store tier: zstd-compressed shards and a manifest written last.

``ObjectTier`` stores each shard as ``PREFIX/JOB/STEP/rank-RANK.phx.zst``
(streamed through zstd level 1 by default, one frame per chunk; a chunk
whose sample would not shrink by ``Pacing.compress_min_saving`` goes as a raw
frame: zstd only where it pays) and, once the step is
committed, ``PREFIX/JOB/STEP/manifest.json`` listing every rank's checksum,
size and the compression: the copy describes itself, and a step without a
manifest is not listed.

Two stores: ``LocalFolderStore`` (a folder; the embedded default) and
``S3Store`` (any S3-protocol server through aiobotocore; its event loop runs
in a thread the store owns, and every call has a timeout).
``open_store("s3://bucket/prefix")`` / ``open_store("file:///path")`` picks one.

Nothing read from a store is trusted to be small: a shard is read as a
``ShardReader`` (decompressed in pieces of at most ``PART_NBYTES``, never past
the manifest's ``nbytes``), and ``ObjectStore.get`` (manifests, listings) stops
at ``MAX_GET_NBYTES``. A zstd bomb or a lying size ends in a ``TierError``
naming the object, never in gigabytes of memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Final, TypeVar, cast
from urllib.parse import urlparse

import zstandard

from ckpt.errors import CheckpointError, TierError
from ckpt.format import BufferLike, Hasher
from ckpt.tiers import (
    LOCAL_FILESYSTEMS,
    MANIFEST_NAME,
    AlignedBuffer,
    Pacing,
    ShardKey,
    StoredShard,
    Tier,
    TierManifest,
    checked_chunks,
    digest_text,
    filesystem_type,
    parse_part,
    parse_step,
    part_name,
    place_writer_thread,
    step_dir,
    write_file_atomic,
)

__all__ = [
    "LocalFolderStore",
    "ObjectStore",
    "ObjectTier",
    "ObjectTooLarge",
    "S3Store",
    "ShardReader",
    "open_store",
]

T = TypeVar("T")
PART_NBYTES: Final = 8 << 20  # S3 multipart parts: at least 5 MiB but the last
MAX_GET_NBYTES: Final = 64 << 20  # ObjectStore.get: manifests and listings, never shards


class ObjectTooLarge(OSError):
    """An object (or what it decompresses to) is longer than its reader allows;
    ``what`` names it, ``limit`` is the allowance in bytes."""

    def __init__(self, what: str, limit: int, detail: str = "") -> None:
        self.what = what
        self.limit = limit
        super().__init__(f"{what} is larger than the {limit}-byte limit{detail}")


class ObjectStore(ABC):
    """A flat key → bytes store; every method raises ``OSError``-like errors
    the tier turns into ``TierError``."""

    url: str
    #: ``put_stream`` is done with each part before it asks for the next, so the tier
    #: may hand it one page-aligned buffer refilled for every part (no allocation per
    #: part, and a folder on a disk can take it by ``O_DIRECT``).
    parts_in_turn: bool = False

    @abstractmethod
    def put_stream(self, key: str, parts: Iterable[BufferLike]) -> None:
        """Store the concatenation of ``parts``; visible only once whole."""

    @abstractmethod
    def get_stream(self, key: str) -> Iterator[bytes]:
        """The object's bytes in pieces; ``FileNotFoundError`` when absent."""

    @abstractmethod
    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix``."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Remove keys (absent ones are ignored)."""

    def get(self, key: str, *, max_nbytes: int = MAX_GET_NBYTES) -> bytes:
        """A small object whole (a manifest); ``ObjectTooLarge`` past ``max_nbytes``."""
        out = bytearray()
        pieces = self.get_stream(key)
        try:
            for piece in pieces:
                out += piece
                if len(out) > max_nbytes:
                    raise ObjectTooLarge(f"{self.url}{key}", max_nbytes)
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()  # a generator: let go of its file or connection now
        return bytes(out)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Let go of connections and threads."""


class LocalFolderStore(ObjectStore):
    """Objects as files under a folder, each written to a temp name and renamed.

    On a local filesystem (``LOCAL_FILESYSTEMS``) page-aligned parts go by ``O_DIRECT``
    (with ``pacing.direct_io``), as the NVMe tier writes: no copy into the page cache
    and no writeback by the kernel's threads next to the training loop. A folder shared
    over the network is written through the cache (``direct`` says which)."""

    parts_in_turn = True

    def __init__(self, root: str | os.PathLike[str], *, pacing: Pacing | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.resolve().as_uri() + "/"  # + a key: the object's URL
        self.pacing = pacing if pacing is not None else Pacing()
        self.direct = filesystem_type(self.root) in LOCAL_FILESYSTEMS

    def put_stream(self, key: str, parts: Iterable[BufferLike]) -> None:
        write_file_atomic(self.root / key, parts, pacing=self.pacing, tier="object",
                          ref=ShardKey("-", 0, 0).ref(str(self.root / key)),
                          direct=self.direct)  # fmt: skip

    def get_stream(self, key: str) -> Iterator[bytes]:
        with open(self.root / key, "rb") as f:
            while piece := f.read(PART_NBYTES):
                yield piece

    def keys(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root)) for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )  # fmt: skip

    def delete(self, keys: list[str]) -> None:
        dirs = set()
        for key in keys:
            (self.root / key).unlink(missing_ok=True)
            dirs.add((self.root / key).parent)
        for d in dirs:
            with contextlib.suppress(OSError):  # not empty: other ranks' objects
                d.rmdir()


class S3Store(ObjectStore):
    """An S3-protocol bucket through aiobotocore, driven from a private event loop.

    Credentials, region and endpoint follow botocore's usual sources (the
    ``AWS_*`` environment, config files) unless given. ``timeout_s`` bounds
    every call. The loop's thread (TLS, request signing) runs on ``pacing``'s
    CPUs and niceness, as the write-down's threads do.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        timeout_s: float = 120.0,
        pacing: Pacing | None = None,
    ) -> None:
        from aiobotocore.config import AioConfig  # type: ignore[import-untyped]
        from aiobotocore.session import get_session  # type: ignore[import-untyped]

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        placed = pacing if pacing is not None else Pacing()

        def run() -> None:
            place_writer_thread(placed)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="ckpt-s3", daemon=True)
        self.thread.start()
        config = AioConfig(
            connect_timeout=min(10.0, timeout_s), read_timeout=timeout_s,
            retries={"max_attempts": 3, "mode": "standard"},
        )  # fmt: skip

        async def connect() -> Any:
            ctx = get_session().create_client(
                "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
                aws_access_key_id=access_key, aws_secret_access_key=secret_key, config=config,
            )  # fmt: skip
            return ctx, await ctx.__aenter__()

        self._ctx, self.client = self._run(connect())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.url}: no answer within {self.timeout_s:g} s") from None

    def put_stream(self, key: str, parts: Iterable[BufferLike]) -> None:
        full = self.prefix + key
        # botocore takes bytes for a body, not views (this store gets bytes: parts_in_turn).
        it = (p if isinstance(p, bytes | bytearray) else bytes(p) for p in parts)
        first = next(it, b"")
        second = next(it, None)
        if second is None:
            self._run(self.client.put_object(Bucket=self.bucket, Key=full, Body=first))
            return
        upload = self._run(self.client.create_multipart_upload(Bucket=self.bucket, Key=full))
        upload_id = upload["UploadId"]
        done: list[dict[str, Any]] = []
        try:
            for number, part in enumerate(_chain(first, second, it), start=1):
                answer = self._run(self.client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=part,
                ))  # fmt: skip
                done.append({"PartNumber": number, "ETag": answer["ETag"]})
            self._run(self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": done},
            ))  # fmt: skip
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: the first error matters
                self._run(self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id))  # fmt: skip
            raise

    def get_stream(self, key: str) -> Iterator[bytes]:
        try:
            answer = self._run(self.client.get_object(Bucket=self.bucket, Key=self.prefix + key))
        except Exception as exc:
            if _is_missing(exc):
                raise FileNotFoundError(f"{self.url}{key}") from exc
            raise
        body = answer["Body"]
        try:
            while piece := self._run(body.read(PART_NBYTES)):
                yield piece
        finally:
            body.close()

    def keys(self, prefix: str) -> list[str]:
        async def walk() -> list[str]:
            keys: list[str] = []
            paginator = self.client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                keys.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
            return keys

        return sorted(self._run(walk()))

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self.prefix + k} for k in keys[start : start + 1000]]
            self._run(self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch}))

    def close(self) -> None:
        if not self.loop.is_running():
            return
        try:
            self._run(self._ctx.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(self.timeout_s)
            self.loop.close()


def _chain(first: BufferLike, second: BufferLike,
           rest: Iterator[BufferLike]) -> Iterator[BufferLike]:  # fmt: skip
    yield first
    yield second
    yield from rest


def _is_missing(exc: Exception) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code")
    return code in ("NoSuchKey", "404", "NotFound")


def open_store(url: str, *, pacing: Pacing | None = None) -> ObjectStore:
    """``s3://bucket/prefix`` (endpoint from ``AWS_ENDPOINT_URL``) or a folder
    (``file:///path`` or a plain path)."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"object_store {url!r}: an s3 URL needs a bucket (s3://BUCKET/PREFIX)")
        return S3Store(parsed.netloc, parsed.path, pacing=pacing)
    if parsed.scheme in ("", "file"):
        return LocalFolderStore(parsed.path if parsed.scheme else url, pacing=pacing)
    raise ValueError(f"object_store {url!r}: the scheme must be s3 or file")


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
                tier=self.name, ref=key.ref(self.store.url + where),
            )  # fmt: skip
        return self.store.url + where

    def _compressed(self, pieces: Iterable[memoryview],
                    buffer: AlignedBuffer | None) -> Iterator[BufferLike]:  # fmt: skip
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
            part = TierManifest(manifest.job, manifest.step, manifest.shards, self.compression,
                                manifest.committed_at, manifest.world_size)  # fmt: skip
            first, last = min(manifest.shards), max(manifest.shards)
            writes.append((f"{step}/{part_name(first, last)}", part))
            manifest = TierManifest(manifest.job, manifest.step, {}, self.compression,
                                    manifest.committed_at, manifest.world_size)  # fmt: skip
        else:
            manifest = TierManifest(manifest.job, manifest.step, manifest.shards,
                                    self.compression, manifest.committed_at,
                                    manifest.world_size)  # fmt: skip
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
            found = TierManifest.from_json(self.store.get(where), where=self.store.url + where)
        except FileNotFoundError:
            return None
        except CheckpointError:
            return None
        except Exception as exc:
            raise self._fail("reading", where, exc) from exc
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
                part = TierManifest.from_json(self.store.get(key), where=self.store.url + key)
            except (FileNotFoundError, CheckpointError):
                continue
            except Exception as exc:
                raise self._fail("reading", key, exc) from exc
            if (part.job == job and part.step == step and rank in part.shards
                    and (newest is None or part.committed_at >= newest.committed_at)):  # fmt: skip
                newest = part
        shards = {**found.shards, **(newest.shards if newest is not None else {})}
        return TierManifest(found.job, found.step, shards, found.compression,
                            found.committed_at, found.world_size)  # fmt: skip

    def reader(self, key: ShardKey, nbytes: int | None = None,
               checksum: str | None = None) -> ShardReader | None:  # fmt: skip
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
            raise TierError(f"the manifest of {url} lists {listed} bytes{wanted}",
                            tier=self.name, ref=key.ref(url))  # fmt: skip
        raw = self.store.get_stream(where)
        try:
            first = next(raw, b"")
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._fail("downloading", where, exc, key) from exc
        return ShardReader(self.name, key, url, listed, expected, first, raw,
                           compressed=manifest.compression == "zstd")  # fmt: skip

    def open(self, key: ShardKey) -> StoredShard | None:
        reader = self.reader(key)
        if reader is None:
            return None
        # The manifest's size is not trusted with memory: an anonymous map costs only the
        # pages written, so a manifest that lies upward holds no more than the content.
        # One byte more than it lists, to tell a content that runs long.
        try:
            buffer = mmap.mmap(-1, reader.nbytes + 1,
                               flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0))
        except (OSError, OverflowError) as exc:
            reader.close()
            raise TierError(f"{reader.url}: no room for the {reader.nbytes} bytes its "
                            f"manifest lists: {exc}", tier=self.name,
                            ref=key.ref(reader.url)) from exc  # fmt: skip
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
        return sorted(s for s, keys in self._step_keys(job).items()
                      if any(k.endswith("/" + MANIFEST_NAME) for k in keys))  # fmt: skip

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

    def __init__(self, tier: str, key: ShardKey, url: str, nbytes: int, expected: str,
                 first: bytes, raw: Iterator[bytes], *, compressed: bool) -> None:  # fmt: skip
        self.tier = tier
        self.key = key
        self.url = url
        self.nbytes = nbytes
        self.expected = expected
        self.received = 0
        self._raw = raw
        self._source = _IterReader(first, raw)
        self._zstd = zstandard.ZstdDecompressor().stream_reader(
            cast(IO[bytes], self._source), read_size=1 << 17, read_across_frames=True,
            closefd=False) if compressed else None  # fmt: skip

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
                raise TierError(f"{self.url} ended after {got} of the {self.nbytes} bytes its "
                                "manifest lists", tier=self.tier, ref=self.key.ref(self.url),
                                corrupt=True)  # fmt: skip
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
            raise TierError(f"{self.url} does not decompress: {exc}", tier=self.tier,
                            ref=self.key.ref(self.url), corrupt=True) from exc  # fmt: skip
        except Exception as exc:
            self.close()
            raise TierError(f"downloading {self.url} failed: {exc}", tier=self.tier,
                            ref=self.key.ref(self.url)) from exc  # fmt: skip

    def _count(self, n: int) -> None:
        self.received += n
        if self.received > self.nbytes:
            self.close()
            raise TierError(f"{self.url} holds more than the {self.nbytes} bytes its manifest "
                            "lists: refused", tier=self.tier, ref=self.key.ref(self.url),
                            corrupt=True)  # fmt: skip

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


def _compression_pays(compressor: zstandard.ZstdCompressor, piece: memoryview,
                      min_saving: float) -> bool:  # fmt: skip
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


def _regroup(pieces: Iterable[BufferLike],
             buffer: AlignedBuffer | None = None) -> Iterator[BufferLike]:  # fmt: skip
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
