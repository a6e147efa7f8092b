"""agentd's checkpoint routes: the ranks' unix socket, and the peer tier on the HTTP port.

The unix socket (``PHALANX_AGENT_SOCKET``, mode 0600) serves the rank-side
protocol that ``ckpt.remote`` documents. The HTTP port serves buddies the
peer tier's objects (``ckpt.peer`` documents the routes), behind the fleet's
agent token.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zstandard
from aiohttp import web

from agentd.ckpt import CkptRequestError
from agentd.config import CkptSettings
from ckpt.errors import ShardRef, TierError
from ckpt.files import AlignedBuffer, AtomicFile
from ckpt.peer import PEER_KEY_RE, SealCheck
from ckpt.stores import PART_NBYTES, ObjectTooLarge
from phalanx.http import serve

if TYPE_CHECKING:
    from agentd.daemon import Agent

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def make_rank_app(agent: Agent) -> web.Application:
    ck = agent.ckpt
    # The ranks' progress (absent where only the checkpoint routes are served, as in
    # tests): a rank waiting on its checkpoints is not hung.
    progress = getattr(agent, "progress", None)

    def waiting(job: str, rank: int) -> contextlib.AbstractContextManager[None]:
        return progress.waiting(job, rank) if progress is not None else contextlib.nullcontext()

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except CkptRequestError as exc:
            return _error(exc.status, str(exc), **exc.extra)
        except (KeyError, ValueError, TypeError) as exc:
            return _error(400, f"bad request: {exc!r}")
        except web.HTTPException:
            raise
        except Exception as exc:
            log.exception("ckpt %s %s failed", request.method, request.path)
            return _error(500, f"internal error: {exc!r}")

    async def body(request: web.Request) -> dict[str, Any]:
        data = await request.json()
        if not isinstance(data, dict):
            raise ValueError("the body must be a JSON object")
        return data

    async def hello(request: web.Request) -> web.Response:
        b = await body(request)
        job = str(b["job"])
        plan = ck.plans.get(job)
        return web.json_response(
            {
                "tiers": ck.tiers_of(job),
                "node": agent.node,
                "interval": plan.interval if plan else None,
                "mtbf_s": plan.mtbf_s if plan else None,
            }
        )

    async def acquire(request: web.Request) -> web.Response:
        b = await body(request)
        job, generation, rank = str(b["job"]), int(b["generation"]), int(b["rank"])
        with waiting(job, rank):  # waiting for a slot to drain is no hang
            got = await ck.acquire(
                job,
                generation,
                rank,
                int(b["step"]),
                int(b["nbytes"]),
                str(b.get("when_busy", "wait")),
                float(b.get("timeout", 600)),
            )
        if "slot" in got and (request.transport is None or request.transport.is_closing()):
            # The rank went away while it waited: it will never fill the slot.
            ck.submit(
                job, generation, rank, int(b["step"]), got["slot"], int(b["nbytes"]), abort=True
            )
        return web.json_response(got)

    async def submit(request: web.Request) -> web.Response:
        b = await body(request)
        return web.json_response(
            ck.submit(
                str(b["job"]),
                int(b["generation"]),
                int(b["rank"]),
                int(b["step"]),
                int(b["slot"]),
                int(b["nbytes"]),
                bool(b.get("abort", False)),
            )
        )

    async def reserve(request: web.Request) -> web.Response:
        b = await body(request)
        paths = await ck.reserve(
            str(b["job"]), int(b["generation"]), int(b["rank"]), int(b["nbytes"])
        )
        return web.json_response({"paths": paths})

    async def wait(request: web.Request) -> web.Response:
        b = await body(request)
        job, rank = str(b["job"]), int(b["rank"])
        with waiting(job, rank):  # a rank waiting on commits is not hung
            return web.json_response(
                await ck.wait(job, rank, int(b["step"]), float(b.get("timeout", 3600)))
            )

    async def restore(request: web.Request) -> web.Response:
        q = request.query
        step = int(q["step"]) if "step" in q else None
        return web.json_response(await ck.restore_plan(q["job"], int(q["rank"]), step))

    async def shard(request: web.Request) -> web.StreamResponse:
        """The shard streamed from its tier, piece by piece, with the catalog's size as its
        Content-Length; an empty body when the tier has no copy. A copy that fails or
        turns out longer or shorter once bytes went out is cut off mid-body: the rank
        sees a short read and tries its next tier. One proven bad here (it does not
        decompress, runs past its size, or the store's answer ends short) is reported to
        the supervisor here, since the rank cannot tell it from a cut connection."""
        q = request.query
        job, rank, step, tier = q["job"], int(q["rank"]), int(q["step"]), q["tier"]
        reader = await ck.fetch(job, rank, step, tier)
        if reader is None:
            return web.Response(body=b"", content_type="application/octet-stream")
        loop = asyncio.get_running_loop()

        def pull() -> bytes:
            return next(reader, b"")

        try:
            try:  # the first piece before any header: an early failure is a JSON error
                piece = await loop.run_in_executor(ck.slow, pull)
            except TierError as exc:
                raise CkptRequestError(
                    str(exc), status=502, tier=tier, step=step, corrupt=exc.corrupt
                ) from exc
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = reader.nbytes
            await resp.prepare(request)
            try:
                while piece:
                    await resp.write(piece)
                    piece = await loop.run_in_executor(ck.slow, pull)
                if reader.received != reader.nbytes:
                    # The store ended its answer without an error: the copy itself is short
                    # (a cut transfer raises instead). Only here is that known for sure.
                    raise TierError(
                        f"{reader.url} ended after {reader.received} of the "
                        f"{reader.nbytes} bytes its manifest lists",
                        tier=tier,
                        ref=reader.key.ref(reader.url),
                        corrupt=True,
                    )
            except TierError as exc:
                if exc.corrupt:  # the rank sees only a cut-off read and cannot tell
                    ck.report(job, rank, step, tier, str(exc))
                else:
                    log.warning(
                        "job %s rank %d: cut off the copy of step %d from tier %s: %s",
                        job,
                        rank,
                        step,
                        tier,
                        exc,
                        extra={"job": job},
                    )
                resp.force_close()
                if request.transport is not None:
                    request.transport.close()  # the rank sees fewer bytes than announced
            return resp
        finally:
            await loop.run_in_executor(ck.slow, reader.close)  # a store's close may block

    async def stage(request: web.Request) -> web.Response:
        b = await body(request)
        return web.json_response(
            await ck.stage(
                str(b["job"]), int(b["generation"]), int(b["rank"]), int(b["step"]), str(b["tier"])
            )
        )

    async def report(request: web.Request) -> web.Response:
        b = await body(request)
        ck.report(
            str(b["job"]), int(b["rank"]), int(b["step"]), str(b["tier"]), str(b.get("error", ""))
        )
        return web.json_response({"reported": True})

    app = web.Application(middlewares=[errors])
    app.router.add_post("/v1/ckpt/hello", hello)
    app.router.add_post("/v1/ckpt/acquire", acquire)
    app.router.add_post("/v1/ckpt/submit", submit)
    app.router.add_post("/v1/ckpt/reserve", reserve)
    app.router.add_post("/v1/ckpt/wait", wait)
    app.router.add_get("/v1/ckpt/restore", restore)
    app.router.add_get("/v1/ckpt/shard", shard)
    app.router.add_post("/v1/ckpt/stage", stage)
    app.router.add_post("/v1/ckpt/report", report)
    return app


@contextlib.asynccontextmanager
async def start_rank_socket(agent: Agent, path: Path) -> AsyncIterator[None]:
    """Serve the rank protocol on a unix socket at ``path`` (mode 0600) until the block ends."""
    os.makedirs(path.parent, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    async with contextlib.AsyncExitStack() as stack:
        old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            await stack.enter_async_context(
                serve(
                    make_rank_app(agent),
                    lambda runner: web.UnixSite(runner, str(path)),
                    f"agent rank socket {path}",
                )
            )
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def add_peer_routes(
    app: web.Application,
    agent: Agent,
    authorised: Callable[[web.Request], bool],
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """The peer tier's objects, kept for buddies under ``DATA_DIR/ckpt-peer``: each body
    (and what it decompresses to) is at most ``max_shard_bytes`` (the agent's
    ``ckpt.peer_max_shard_bytes``; ``None``: that setting's default), refused with 413
    as soon as it crosses it; nothing is stored then."""
    root = agent.ckpt.peer_root
    pool = agent.ckpt.peer_io
    max_limit = max_shard_bytes or CkptSettings().peer_max_shard_bytes  # content, decompressed
    body_limit = max_limit + max_limit // 128 + (1 << 17)  # room for zstd's worst-case growth

    async def io(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def check(request: web.Request) -> web.Response | None:
        if not authorised(request):
            return _error(401, "missing or wrong bearer token (http.token_file)")
        return None

    def key_path(key: str) -> Path | None:
        return root / key if PEER_KEY_RE.match(key) else None

    async def put(request: web.Request) -> web.StreamResponse:
        if (denied := check(request)) is not None:
            return denied
        key = request.match_info["key"]
        path = key_path(key)
        if path is None:
            return _error(400, "not a checkpoint object key")
        if request.content_length is not None and request.content_length > body_limit:
            return too_large(
                key, ObjectTooLarge(f"a body of {request.content_length} bytes", body_limit)
            )
        seal = (
            SealCheck(path.name.endswith(".zst"), max_limit, "its content")
            if ".phx" in path.name
            else None
        )
        try:
            out = await io(
                functools.partial(
                    AtomicFile,
                    path,
                    pacing=agent.ckpt.pacing,
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
            async for chunk in request.content.iter_chunked(PART_NBYTES):
                received += len(chunk)
                if received > body_limit:
                    raise ObjectTooLarge("its body", body_limit)
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
        return _error(
            413, f"refused {key}: {exc} (ckpt.peer_max_shard_bytes is {max_limit})", limit=max_limit
        )

    async def get(request: web.Request) -> web.StreamResponse:
        if (denied := check(request)) is not None:
            return denied
        path = key_path(request.match_info["key"])
        if path is None:
            return _error(400, "not a checkpoint object key")
        if not path.is_file():
            return _error(404, f"no {request.match_info['key']} on node {agent.node}")
        return web.FileResponse(path)

    async def keys(request: web.Request) -> web.Response:
        if (denied := check(request)) is not None:
            return denied
        prefix = request.query.get("prefix", "")
        if ".." in prefix or prefix.startswith("/"):
            return _error(400, "bad prefix")
        return web.json_response(await io(agent.ckpt.peer_store.keys, prefix))

    async def delete(request: web.Request) -> web.Response:
        if (denied := check(request)) is not None:
            return denied
        try:
            wanted = json.loads(await request.read())["keys"]
        except (ValueError, KeyError, TypeError):
            return _error(400, 'body must be {"keys": [...]}')
        if not isinstance(wanted, list) or not all(
            isinstance(k, str) and PEER_KEY_RE.match(k) for k in wanted
        ):
            return _error(400, "not checkpoint object keys")
        await io(agent.ckpt.peer_store.delete, wanted)
        return web.json_response({"deleted": len(wanted)})

    app.router.add_put("/v1/ckpt/peer/objects/{key:.+}", put)
    app.router.add_get("/v1/ckpt/peer/objects/{key:.+}", get)
    app.router.add_get("/v1/ckpt/peer/keys", keys)
    app.router.add_post("/v1/ckpt/peer/delete", delete)


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
