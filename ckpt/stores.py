"""Object stores: where the object tier (and, over HTTP, the peer tier) keeps its
objects. ``LocalFolderStore`` (a folder; the embedded default) and ``S3Store``
(any S3-protocol server through aiobotocore; its event loop runs in a thread the
store owns, and every call has a timeout). ``open_store("s3://bucket/prefix")`` /
``open_store("file:///path")`` picks one.

``ObjectStore.get`` (manifests, listings) stops at ``MAX_GET_NBYTES``: nothing
read from a store is trusted to be small.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import urlparse

from ckpt.errors import ObjectTooLarge
from ckpt.files import LOCAL_FILESYSTEMS, filesystem_type, write_file_atomic
from ckpt.format import BufferLike
from ckpt.pacing import Pacing, place_writer_thread
from ckpt.tiers import ShardKey

__all__ = [
    "MAX_GET_NBYTES",
    "PART_NBYTES",
    "LocalFolderStore",
    "ObjectStore",
    "ObjectTooLarge",
    "S3Store",
    "open_store",
]

T = TypeVar("T")
PART_NBYTES: Final = 8 << 20  # S3 multipart parts: at least 5 MiB but the last
MAX_GET_NBYTES: Final = 64 << 20  # ObjectStore.get: manifests and listings, never shards


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
        write_file_atomic(
            self.root / key,
            parts,
            pacing=self.pacing,
            tier="object",
            ref=ShardKey("-", 0, 0).ref(str(self.root / key)),
            direct=self.direct,
        )

    def get_stream(self, key: str) -> Iterator[bytes]:
        with open(self.root / key, "rb") as f:
            while piece := f.read(PART_NBYTES):
                yield piece

    def keys(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        # os.walk, not rglob: another node's retention may remove a step's folder while
        # this walks it (rglob then raises FileNotFoundError; os.walk skips it).
        found = []
        for folder, _dirs, files in os.walk(base):
            for name in files:
                if not name.startswith("."):
                    found.append(str((Path(folder) / name).relative_to(self.root)))
        return sorted(found)

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
            connect_timeout=min(10.0, timeout_s),
            read_timeout=timeout_s,
            retries={"max_attempts": 3, "mode": "standard"},
        )

        async def connect() -> Any:
            ctx = get_session().create_client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region or "us-east-1",
                aws_access_key_id=access_key,
                aws_secret_access_key=secret_key,
                config=config,
            )
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
                answer = self._run(
                    self.client.upload_part(
                        Bucket=self.bucket,
                        Key=full,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=part,
                    )
                )
                done.append({"PartNumber": number, "ETag": answer["ETag"]})
            self._run(
                self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                )
            )
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: the first error matters
                self._run(
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=full, UploadId=upload_id
                    )
                )
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


def _chain(
    first: BufferLike, second: BufferLike, rest: Iterator[BufferLike]
) -> Iterator[BufferLike]:
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
