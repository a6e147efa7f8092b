"""What the daemons' HTTP servers share: serving an aiohttp app, and the bearer-token check."""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator, Callable

from aiohttp import web


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
