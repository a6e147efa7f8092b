"""The ranks' unix socket (``PHALANX_AGENT_SOCKET``, mode 0600): the rank-side protocol
that ``ckpt.remote`` documents, each body parsed and each answer built with the models
of ``ckpt.protocol``. A body that does not follow its model is answered 400, naming each
wrong field; a refusal of the service (``CkptRequestError``) with its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from agentd.ckpt.errors import CkptRequestError, copy_failed
from agentd.ckpt.host import CkptHost
from ckpt import TierError, protocol
from phalanx.http import read_body, serve

__all__ = ["make_rank_app", "start_rank_socket"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 64 * 1024


def error_response(status: int, message: str, **extra: Any) -> web.Response:
    """A refusal, as ``ckpt.protocol.ErrorReply`` reads it."""
    return reply(protocol.ErrorReply(error=message, **extra), status=status)


def reply(answer: BaseModel, *, status: int = 200) -> web.Response:
    return web.json_response(answer.model_dump(mode="json", exclude_none=True), status=status)


async def body(request: web.Request, model: type[M]) -> M:
    """The request's JSON body as ``model``; a 400 naming each wrong field."""
    try:
        return model.model_validate_json(await read_body(request))
    except ValidationError as exc:
        raise CkptRequestError(f"bad body: {protocol.problems(exc)}") from exc


def query(request: web.Request, model: type[M]) -> M:
    """The request's query as ``model``; a 400 naming each wrong parameter."""
    params: Mapping[str, str] = request.query
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        raise CkptRequestError(f"bad query: {protocol.problems(exc)}") from exc


def make_rank_app(host: CkptHost) -> web.Application:
    ck = host.ckpt
    progress = host.progress

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except CkptRequestError as exc:
            return error_response(exc.status, str(exc), **exc.extra)
        except ValueError as exc:  # what the tiers refuse to name (a job, a size)
            return error_response(400, f"bad request: {exc}")
        except TierError as exc:
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EFBIG):
                # The RAM tier's file system cannot hold the slot asked for: too large a
                # request for this node, answered as such (the message names the path).
                return error_response(413, str(exc))
            log.exception("ckpt %s %s failed", request.method, request.path)
            return error_response(500, f"internal error: {exc!r}")
        except web.HTTPException:
            raise
        except Exception as exc:
            log.exception("ckpt %s %s failed", request.method, request.path)
            return error_response(500, f"internal error: {exc!r}")

    async def hello(request: web.Request) -> web.Response:
        req = await body(request, protocol.HelloRequest)
        plan = ck.jobs.plans.get(req.job)
        return reply(
            protocol.HelloReply(
                tiers=ck.jobs.tiers_of(req.job),
                node=host.node,
                interval=plan.interval if plan else None,
                mtbf_s=plan.mtbf_s if plan else None,
            )
        )

    async def acquire(request: web.Request) -> web.Response:
        req = await body(request, protocol.AcquireRequest)
        with progress.waiting(req.job, req.rank):  # waiting for a slot to drain is no hang
            got = await ck.acquire(req)
        if got.slot is not None and (request.transport is None or request.transport.is_closing()):
            # The rank went away while it waited: it will never fill the slot.
            ck.submit(
                protocol.SubmitRequest(
                    job=req.job,
                    generation=req.generation,
                    rank=req.rank,
                    step=req.step,
                    slot=got.slot,
                    nbytes=req.nbytes,
                    abort=True,
                )
            )
        return reply(got)

    async def submit(request: web.Request) -> web.Response:
        return reply(ck.submit(await body(request, protocol.SubmitRequest)))

    async def reserve(request: web.Request) -> web.Response:
        return reply(await ck.reserve(await body(request, protocol.ReserveRequest)))

    async def wait(request: web.Request) -> web.Response:
        req = await body(request, protocol.WaitRequest)
        with progress.waiting(req.job, req.rank):  # a rank waiting on commits is not hung
            return reply(await ck.wait(req))

    async def restore(request: web.Request) -> web.Response:
        req = query(request, protocol.RestoreQuery)
        return reply(await ck.restores.plan(req.job, req.rank, req.step))

    async def shard(request: web.Request) -> web.StreamResponse:
        """The shard streamed from its tier, piece by piece, with the catalog's size as its
        Content-Length; an empty body when the tier has no copy. A copy that fails or
        turns out longer or shorter once bytes went out is cut off mid-body: the rank
        sees a short read and tries its next tier. One proven bad here (it does not
        decompress, runs past its size, or the store's answer ends short) is reported to
        the supervisor here, since the rank cannot tell it from a cut connection."""
        req = query(request, protocol.ShardQuery)
        job, rank, step, tier = req.job, req.rank, req.step, req.tier
        reader = await ck.restores.fetch(job, rank, step, tier)
        if reader is None:
            return web.Response(body=b"", content_type="application/octet-stream")
        loop = asyncio.get_running_loop()

        def pull() -> bytes:
            return next(reader, b"")

        try:
            try:  # the first piece before any header: an early failure is a JSON error
                piece = await loop.run_in_executor(ck.slow, pull)
            except TierError as exc:
                raise copy_failed(exc, tier=tier, step=step) from exc
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
                    ck.restores.report(job, rank, step, tier, str(exc))
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
        req = await body(request, protocol.StageRequest)
        return reply(await ck.restores.stage(req.job, req.generation, req.rank, req.step, req.tier))

    async def report(request: web.Request) -> web.Response:
        req = await body(request, protocol.ReportRequest)
        ck.restores.report(req.job, req.rank, req.step, req.tier, req.error)
        return reply(protocol.ReportReply())

    # A rank's requests are small JSON objects; a shard goes through shared memory.
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
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
async def start_rank_socket(host: CkptHost, path: Path) -> AsyncIterator[None]:
    """Serve the rank protocol on a unix socket at ``path`` (mode 0600) until the block ends."""
    os.makedirs(path.parent, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    async with contextlib.AsyncExitStack() as stack:
        old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            await stack.enter_async_context(
                serve(
                    make_rank_app(host),
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
