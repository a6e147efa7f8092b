"""The REST routes of the API tokens (:mod:`supervisor.auth.tokens`): an admin creates, lists
and revokes them; any valid token asks who it is.

``POST /v1/tokens`` answers the new token with its ``secret``, the only answer that ever
holds it; ``GET /v1/tokens`` lists every token without secret or hash.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from phalanx.http import json_body, json_response
from supervisor.api.access import PRINCIPAL
from supervisor.auth.tokens import TokenRequest, Tokens, request_error
from supervisor.store import Store

log = logging.getLogger(__name__)

NOT_SHOWN_AGAIN = "the secret is shown this once: it is stored hashed and cannot be shown again"


def add_token_routes(app: web.Application, tokens: Tokens, store: Store) -> None:
    async def whoami(request: web.Request) -> web.Response:
        return json_response(request[PRINCIPAL].view())

    async def create(request: web.Request) -> web.Response:
        data: Any = await json_body(request) if request.can_read_body else {}
        if not isinstance(data, dict):
            return json_response({"error": "request body must be an object"}, status=400)
        try:
            req = TokenRequest.model_validate(data)
        except ValidationError as exc:
            return json_response({"error": request_error(exc)}, status=400)
        by = request[PRINCIPAL]
        info, secret = tokens.create(req, by)
        store.add_event(
            "token_created",
            None,
            {
                "token": info.id,
                "name": info.name,
                "role": info.role.value,
                "team": info.team,
                "by": by.id,
            },
        )
        log.info("token %s (%s) created by %s", info.id, info.role, by.id)
        view = info.model_dump(mode="json")
        return json_response({**view, "secret": secret, "note": NOT_SHOWN_AGAIN}, status=201)

    async def listed(request: web.Request) -> web.Response:
        return json_response([t.model_dump(mode="json") for t in tokens.list()])

    async def revoke(request: web.Request) -> web.Response:
        by = request[PRINCIPAL]
        info = tokens.revoke(request.match_info["id"], by)
        store.add_event("token_revoked", None, {"token": info.id, "name": info.name, "by": by.id})
        log.info("token %s revoked by %s", info.id, by.id)
        return json_response(info.model_dump(mode="json"))

    app.router.add_get("/v1/whoami", whoami)
    app.router.add_post("/v1/tokens", create)
    app.router.add_get("/v1/tokens", listed)
    app.router.add_post("/v1/tokens/{id}/revoke", revoke)
