"""What the daemons' HTTP servers share: serving an aiohttp app, the bearer-token check,
and reading a JSON body."""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import pydantic_core
from aiohttp import web

# How deep a JSON document may nest: the limit of pydantic's parser (jiter), which every
# model's ``model_validate_json`` applies too. A body nested deeper is refused with 400,
# never parsed by recursion (``json.loads`` of a few thousand ``[`` is a RecursionError).
MAX_JSON_DEPTH: Final = 200


def loads(data: bytes | str) -> Any:
    """JSON text as Python values, as every HTTP body of the daemons is read: a
    ``ValueError`` naming line and column for anything that is not strict JSON (bytes
    that are not UTF-8, a lone surrogate escape, ``NaN``, a number of over 4300 digits,
    nesting past :data:`MAX_JSON_DEPTH`), and no other exception."""
    return pydantic_core.from_json(data, allow_inf_nan=False)


async def json_body(request: web.Request) -> Any:
    """The request's body read by :func:`loads`; ``web.HTTPBadRequest`` (400, an
    ``{"error": ...}`` body) when it is not JSON. A body past the app's
    ``client_max_size`` is aiohttp's 413 before any of it is parsed."""
    try:
        return loads(await request.read())
    except ValueError as exc:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"request body is not JSON: {exc}"}),
            content_type="application/json",
        ) from None


def bearer_ok(request: web.Request, token: bytes | None) -> bool:
    """True when the request carries ``Authorization: Bearer <token>`` (constant-time);
    never true when no token is configured."""
    given = request.headers.get("Authorization", "")
    return (
        token is not None
        and given.startswith("Bearer ")
        and hmac.compare_digest(given[7:].strip().encode(), token)
    )


@contextlib.asynccontextmanager
async def serve(
    app: web.Application,
    site: Callable[[web.AppRunner], web.BaseSite],
    what: str,
    *,
    shutdown_timeout: float = 60.0,
) -> AsyncIterator[web.AppRunner]:
    """Serve ``app`` on the site ``site`` makes until the block ends; a bind failure is an
    ``OSError`` naming ``what`` (e.g. "agent HTTP server on 0.0.0.0:9400"). At the end it
    stops listening at once, and gives the requests in flight ``shutdown_timeout`` s."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
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
