"""What the daemons' HTTP servers share: serving an aiohttp app, reading a JSON body, and
the bounds every server keeps (who may call is each server's own: ``supervisor.api.access``,
``agentd.access``).

The bounds, where each is enforced:

* **body size**: each app's ``client_max_size`` (aiohttp answers 413 before parsing);
  a streamed body (the peer tier's pushes) is capped by its route.
* **a client that sends nothing, or trickles its request head**: ``serve`` gives
  aiohttp a ``keepalive_timeout`` of ``idle_timeout_s`` (:data:`IDLE_TIMEOUT_S`):
  aiohttp arms that timer when a connection opens and closes the connection when it
  fires while no complete request head has arrived, however many bytes trickled in.
* **a body that trickles once its head is complete**: aiohttp sets no limit there;
  :func:`json_body` answers 408 past the app's :data:`BODY_TIMEOUT` (streamed routes
  keep their own pace).
* **requests at once from one address**: :func:`per_peer_limit`, a middleware
  answering 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final

import pydantic_core
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware

from phalanx.jsonenc import dumps

# How deep a JSON document may nest: the limit of pydantic's parser (jiter; 201 levels
# parse, 202 do not), which every model's ``model_validate_json`` applies too. A body
# nested deeper is refused with 400, never parsed by recursion (``json.loads`` of a few
# thousand ``[`` is a RecursionError).
MAX_JSON_DEPTH: Final = 200

# A connection that has not sent a whole request head this long after it opened (or
# after its last answer) is closed.
IDLE_TIMEOUT_S: Final = 15.0
# A JSON body that has not arrived whole this long after its head is answered 408; an
# app sets its own in ``app[BODY_TIMEOUT]``.
BODY_TIMEOUT_S: Final = 10.0
BODY_TIMEOUT: Final = web.AppKey("phalanx_body_timeout_s", float)
# After an answer sent before the request's body was read (a 408, a 413), how long the
# rest of that body is read and dropped before the connection closes (aiohttp: 10 s).
LINGER_S: Final = 2.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (no Host header, a line past 8 KiB) as an
    ERROR with a traceback, one per request: any client could fill the daemon's log.
    Such a request is the client's fault, answered 400: logged as one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            said = record.getMessage()
            record.msg, record.args = "%s: %s", (said, " ".join(str(exc).split()))
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


# The logger of the daemons' HTTP servers (aiohttp's "aiohttp.server" otherwise).
server_log = logging.getLogger("phalanx.http.server")
server_log.addFilter(_MalformedRequests())


def json_response(
    data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """``aiohttp.web.json_response``, encoded by :func:`dumps`."""
    return web.Response(
        body=dumps(data), status=status, headers=headers, content_type="application/json"
    )


def loads(data: bytes | str) -> Any:
    """JSON text as Python values, as every HTTP body of the daemons is read: a
    ``ValueError`` naming line and column for anything that is not strict JSON (bytes
    that are not UTF-8, a lone surrogate escape, ``NaN``, a number of over 4300 digits,
    nesting past :data:`MAX_JSON_DEPTH`), and no other exception."""
    return pydantic_core.from_json(data, allow_inf_nan=False)


async def read_body(request: web.Request) -> bytes:
    """The request's whole body; ``web.HTTPRequestTimeout`` (408) when it has not arrived
    within the app's ``BODY_TIMEOUT`` (:data:`BODY_TIMEOUT_S` unless set)."""
    limit = request.app.get(BODY_TIMEOUT, BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(limit):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=json.dumps({"error": f"request body not received whole within {limit:g} s"}),
            content_type="application/json",
        ) from None


async def json_body(request: web.Request) -> Any:
    """The request's body read by :func:`read_body` and parsed by :func:`loads`;
    ``web.HTTPBadRequest`` (400, an ``{"error": ...}`` body) when it is not JSON. A body
    past the app's ``client_max_size`` is aiohttp's 413 before any of it is parsed."""
    data = await read_body(request)
    try:
        return loads(data)
    except ValueError as exc:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"request body is not JSON: {exc}"}),
            content_type="application/json",
        ) from None


def per_peer_limit(limit: int) -> Middleware:
    """A middleware answering 429 to a request from an address that has ``limit``
    requests in flight already (counted until its handler returns)."""
    busy: dict[str, int] = {}

    @web.middleware
    async def bounded(request: web.Request, handler: Handler) -> web.StreamResponse:
        peer = request.remote or ""
        if busy.get(peer, 0) >= limit:
            return web.json_response(
                {"error": f"{peer} has {limit} requests in flight already; retry later"},
                status=429,
                headers={"Retry-After": "1"},
            )
        busy[peer] = busy.get(peer, 0) + 1
        try:
            return await handler(request)
        finally:
            busy[peer] -= 1
            if not busy[peer]:
                del busy[peer]

    return bounded


@contextlib.asynccontextmanager
async def serve(
    app: web.Application,
    site: Callable[[web.AppRunner], web.BaseSite],
    what: str,
    *,
    shutdown_timeout: float = 60.0,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> AsyncIterator[web.AppRunner]:
    """Serve ``app`` on the site ``site`` makes until the block ends; a bind failure is an
    ``OSError`` naming ``what`` (e.g. "agent HTTP server on 0.0.0.0:9400"). A connection
    without a whole request head ``idle_timeout_s`` after it opened or was last answered
    is closed. At the end it stops listening at once, and gives the requests in flight
    ``shutdown_timeout`` s."""
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=idle_timeout_s,
        lingering_time=LINGER_S,
        logger=server_log,
    )
    await runner.setup()
    try:
        await site(runner).start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(exc.errno, f"{what} cannot bind: {exc.strerror}") from exc
    try:
        yield runner
    finally:
        await runner.cleanup()
