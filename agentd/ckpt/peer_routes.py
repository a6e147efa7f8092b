"""The peer tier on the agent's HTTP port: the objects this node keeps for its buddies
under ``DATA_DIR/ckpt-peer`` (``ckpt.peer`` documents the routes), behind this node's
own agent token or a peer's credential for it (``agentd.access``): a buddy presents
``X-Phalanx-Node: ITS_ID`` and the credential the supervisor sent it for this node.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, BinaryIO

import zstandard
from aiohttp import StreamReader, web

from agentd.access import Access
from agentd.ckpt.host import CkptHost
from agentd.config import CkptSettings
from ckpt import (
    PART_NBYTES,
    PEER_KEY_RE,
    AlignedBuffer,
    AtomicFile,
    CheckpointError,
    ObjectTooLarge,
    SealCheck,
    ShardRef,
    TierError,
)
from ckpt.stores import MAX_GET_NBYTES
from phalanx.http import json_body

__all__ = ["PUSH_IDLE_S", "PUSH_MIN_RATE", "Staging", "add_peer_routes"]

log = logging.getLogger(__name__)

# A buddy's push that sends nothing this long is cut off; so is one averaging under
# PUSH_MIN_RATE once this long has passed (a push runs at disk or network speed,
# hundreds of MB/s: 1 MiB/s is a stalled or hostile sender, not a slow one). A reader
# of an object is held to the same two limits.
PUSH_IDLE_S = 60.0
PUSH_MIN_RATE = float(1 << 20)
# A read (GET) of an object is sent in pieces of this size, each awaited until the
# client has taken it: the same two limits apply to a reader as to a pusher.
SEND_NBYTES = 1 << 20


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def add_peer_routes(
    app: web.Application,
    host: CkptHost,
    access: Access,
    *,
    max_shard_bytes: int | None = None,
    idle_s: float = PUSH_IDLE_S,
    min_rate: float = PUSH_MIN_RATE,
) -> None:
    """The peer tier's objects, kept for buddies under ``DATA_DIR/ckpt-peer``. A shard's
    body (and what it decompresses to) is at most ``max_shard_bytes`` (the agent's
    ``ckpt.peer_max_shard_bytes``; ``None``: that setting's default) and at most the
    size its own preamble declares; any other object (a manifest) at most
    ``MAX_GET_NBYTES``, what its readers accept. Past either: 413 as soon as it
    crosses; a shard whose first bytes are no shard's preamble: 422 at once. A push
    that sends nothing for ``idle_s``, or averages under ``min_rate`` bytes/s once
    ``idle_s`` has passed, is cut off with 408. Nothing is stored then. A read (GET)
    whose client takes nothing for ``idle_s``, or takes under ``min_rate`` bytes/s once
    ``idle_s`` has passed, is cut off the same way: its connection is dropped mid-body
    (short of its Content-Length) and one warning line names the peer and the key.
    ``access`` lets in this node's own token and its peers' credentials (401 otherwise,
    403 when the node has no token)."""
    root = host.ckpt.peer_root
    pool = host.ckpt.peer_io
    max_limit = max_shard_bytes or CkptSettings().peer_max_shard_bytes  # content, decompressed
    body_limit = max_limit + max_limit // 128 + (1 << 17)  # room for zstd's worst-case growth

    async def io(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def check(request: web.Request) -> web.Response | None:
        denied = access.check(request, peer_route=True)
        return None if denied is None else denied.response()

    def key_path(key: str) -> Path | None:
        return root / key if PEER_KEY_RE.match(key) else None

    async def put(request: web.Request) -> web.StreamResponse:
        if (denied := check(request)) is not None:
            return denied
        key = request.match_info["key"]
        path = key_path(key)
        if path is None:
            return _error(400, "not a checkpoint object key")
        seal = (
            SealCheck(path.name.endswith(".zst"), max_limit, "its content")
            if ".phx" in path.name
            else None
        )
        limit = body_limit if seal is not None else MAX_GET_NBYTES
        if request.content_length is not None and request.content_length > limit:
            return too_large(
                key, ObjectTooLarge(f"a body of {request.content_length} bytes", limit)
            )
        try:
            out = await io(
                functools.partial(
                    AtomicFile,
                    path,
                    pacing=host.ckpt.pacing,
                    tier="peer",
                    ref=ShardRef(path=str(path)),
                    direct=True,
                )
            )
        except TierError as exc:
            return cannot_store(key, exc)
        # The body lands in one page-aligned buffer that goes to disk by O_DIRECT each
        # time it fills, as the NVMe tier writes: through the page cache, a GiB took
        # 2-3 s of this node's CPU (the fsync writing it back) next to its training.
        staged: Staging | None = None
        received = 0
        problem: str | None = None
        try:
            staged = Staging(out, seal)
            async for chunk in paced(request.content, key, idle_s, min_rate):
                received += len(chunk)
                if received > limit:
                    raise ObjectTooLarge("its body", limit)
                await io(staged.take, chunk)
            problem = seal.problem() if seal is not None else None
            if problem is None:
                await io(staged.finish)
        except BaseException as exc:
            await io(out.abort)
            if isinstance(exc, zstandard.ZstdError):
                return _error(422, f"{key} does not decompress: {exc}")
            if isinstance(exc, ObjectTooLarge):
                return too_large(key, exc)
            if isinstance(exc, TierError):
                return cannot_store(key, exc)
            if isinstance(exc, CheckpointError):  # its preamble is no shard's
                log.warning("refused %s pushed by a peer: %s", key, exc)
                return _error(422, f"{key}: {exc}")
            if isinstance(exc, TimeoutError):
                log.warning("cut off %s pushed by a peer: %s", key, exc)
                return _error(408, f"{key}: {exc}")
            raise
        finally:
            if staged is not None:
                staged.buffer.close()
        if problem is not None:
            await io(out.abort)
            log.warning("refused %s pushed by a peer: %s", key, problem)
            return _error(422, f"{key}: {problem}")
        return web.json_response({"stored": key})

    def cannot_store(key: str, exc: TierError) -> web.Response:
        log.error("cannot store %s pushed by a peer: %s", key, exc)
        full = isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOSPC
        return _error(507 if full else 500, f"cannot store {key}: {exc}")

    def too_large(key: str, exc: ObjectTooLarge) -> web.Response:
        log.warning("refused %s pushed by a peer: %s", key, exc)
        if ".phx" not in key:
            return _error(413, f"refused {key}: {exc}", limit=exc.limit)
        return _error(
            413, f"refused {key}: {exc} (ckpt.peer_max_shard_bytes is {max_limit})", limit=max_limit
        )

    async def get(request: web.Request) -> web.StreamResponse:
        if (denied := check(request)) is not None:
            return denied
        path = key_path(request.match_info["key"])
        if path is None:
            return _error(400, "not a checkpoint object key")
        key = request.match_info["key"]
        try:
            # Opened and closed on the loop, not in a thread: a request cancelled while a
            # thread opened the file would leave that file open, with no one to close it.
            source = open_object(path)
        except (FileNotFoundError, IsADirectoryError):
            return _error(404, f"no {key} on node {host.node}")
        try:
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = os.fstat(source.fileno()).st_size
            await resp.prepare(request)
            try:
                await drained(resp, source, io, key, idle_s, min_rate)
            except TimeoutError as exc:
                # The client holds this file, a slot and a connection: drop it. It reads
                # a body shorter than the Content-Length it was promised, so never takes
                # the cut-off copy for a whole one.
                log.warning("cut off %s read by peer %s: %s", key, request.remote, exc)
                if request.transport is not None:
                    request.transport.abort()
                return resp
            except ConnectionError:  # the reader went away (had what it wanted, or died)
                log.debug("peer %s closed the connection reading %s", request.remote, key)
                return resp
            await resp.write_eof()
            return resp
        finally:
            source.close()

    async def keys(request: web.Request) -> web.Response:
        if (denied := check(request)) is not None:
            return denied
        prefix = request.query.get("prefix", "")
        if ".." in prefix or prefix.startswith("/"):
            return _error(400, "bad prefix")
        return web.json_response(await io(host.ckpt.peer_store.keys, prefix))

    async def delete(request: web.Request) -> web.Response:
        if (denied := check(request)) is not None:
            return denied
        data = await json_body(request)
        wanted = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(wanted, list):
            return _error(400, 'body must be {"keys": [...]}')
        if not all(isinstance(k, str) and PEER_KEY_RE.match(k) for k in wanted):
            return _error(400, "not checkpoint object keys")
        await io(host.ckpt.peer_store.delete, wanted)
        return web.json_response({"deleted": len(wanted)})

    app.router.add_put("/v1/ckpt/peer/objects/{key:.+}", put)
    app.router.add_get("/v1/ckpt/peer/objects/{key:.+}", get)
    app.router.add_get("/v1/ckpt/peer/keys", keys)
    app.router.add_post("/v1/ckpt/peer/delete", delete)


async def paced(
    content: StreamReader, key: str, idle_s: float, min_rate: float
) -> AsyncIterator[bytes]:
    """The pieces of a pushed body as they arrive; a ``TimeoutError`` naming the limit
    when no byte came for ``idle_s``, or when the body averages under ``min_rate``
    bytes/s once ``idle_s`` has passed (a buddy trickling one byte a second holds a
    file, a buffer and a thread of this node's: it is cut off)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    received = 0
    while True:
        try:
            async with asyncio.timeout(idle_s):
                chunk = await content.read(PART_NBYTES)
        except TimeoutError:
            raise TimeoutError(f"no byte of {key} for {idle_s:g} s") from None
        if not chunk:
            return
        received += len(chunk)
        elapsed = loop.time() - start
        if elapsed > idle_s and received < min_rate * elapsed:
            raise TimeoutError(
                f"{received} bytes of {key} in {elapsed:.1f} s: under {min_rate:g} bytes/s"
            )
        yield chunk


def open_object(path: Path) -> BinaryIO:
    """``path`` opened for reading; a directory (a job's folder) reads as absent."""
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a folder, not an object", str(path))
    return path.open("rb")


async def drained(
    resp: web.StreamResponse,
    source: BinaryIO,
    io: Callable[..., Any],
    key: str,
    idle_s: float,
    min_rate: float,
) -> None:
    """Send ``source`` through ``resp`` in ``SEND_NBYTES`` pieces, each awaited until the
    client has taken it in (``write`` waits for the transport to drain); a
    ``TimeoutError`` naming the limit when a piece is not taken within ``idle_s``, or
    when the client averages under ``min_rate`` bytes/s once ``idle_s`` has passed (a
    reader taking one byte a second of a GiB object would hold the file, a request slot
    and a connection of this node's for years)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent = 0
    while block := await io(source.read, PART_NBYTES):
        view = memoryview(block)
        for at in range(0, len(view), SEND_NBYTES):
            piece = view[at : at + SEND_NBYTES]
            try:
                async with asyncio.timeout(idle_s):
                    await resp.write(piece)
            except TimeoutError:
                raise TimeoutError(
                    f"the peer did not take the next piece of {key} within {idle_s:g} s "
                    f"({sent} bytes sent)"
                ) from None
            sent += len(piece)
            elapsed = loop.time() - start
            if elapsed > idle_s and sent < min_rate * elapsed:
                raise TimeoutError(
                    f"the peer took {sent} bytes of {key} in {elapsed:.1f} s: "
                    f"under {min_rate:.0f} bytes/s"
                )


class Staging:
    """A pushed body on its way to an ``AtomicFile``: each piece checked against the seal
    (``seal``, when the object is a shard) and copied into one page-aligned buffer of
    ``PART_NBYTES`` that is written out, by ``O_DIRECT``, each time it fills."""

    def __init__(self, out: AtomicFile, seal: SealCheck | None) -> None:
        self.out = out
        self.seal = seal
        self.buffer = AlignedBuffer(PART_NBYTES)

    def take(self, data: bytes) -> None:
        if self.seal is not None:
            self.seal.feed(data)
        for part in self.buffer.fill(data):
            self.out.write(part)

    def finish(self) -> None:
        """Write what is held, then fsync and rename the file into place."""
        with self.out:
            self.out.write(self.buffer.rest())
