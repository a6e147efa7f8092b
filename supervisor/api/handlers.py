"""What the route handlers share: their type, the error answer, a request's JSON object."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from phalanx.http import json_body, json_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, message: str) -> web.Response:
    """The answer of a failed request: ``{"error": message}`` with ``status``."""
    return json_response({"error": message}, status=status)


async def body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object ({} without a body); 400 when it is not an object."""
    if not request.can_read_body:
        return {}
    data = await json_body(request)
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(
            text=json.dumps({"error": "request body must be an object"}),
            content_type="application/json",
        )
    return data
