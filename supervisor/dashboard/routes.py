"""The dashboard's routes: its page and static assets (no token needed), login, logout.

The assets ship in the package (``static/``) and are read once, when the app is made:
no build step, nothing fetched at run time, no path from a request ever reaches the
file system. Every answer carries a content security policy that lets the page run only
its own scripts and styles and talk only to its own origin, and forbids framing it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from phalanx.http import json_body, json_response
from supervisor.auth.tokens import Tokens
from supervisor.dashboard.session import clear_session, csrf_ok, set_session
from supervisor.errors import Unauthorized

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
PREFIX = "/ui/"
CONTENT_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".txt": "text/plain",
    "": "text/plain",  # LICENSE
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate (ETag): an upgraded supervisor serves new assets
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets(root: Path = STATIC) -> dict[str, Asset]:
    """Every file under ``root`` of a known type, by its path relative to ``root``."""
    assets = {}
    for path in sorted(root.rglob("*")):
        kind = CONTENT_TYPES.get(path.suffix)
        if not path.is_file() or kind is None:
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        assets[path.relative_to(root).as_posix()] = Asset(body, kind, etag)
    if "index.html" not in assets:
        raise FileNotFoundError(f"the dashboard's index.html is missing from {root}")
    return assets


def _json_error(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status=status, headers=HEADERS)


def add_routes(app: web.Application, tokens: Tokens) -> frozenset[web.AbstractResource]:
    """The dashboard under ``/ui/`` (``/`` leads there); ``tokens``: those a login takes.

    Returns the resources it added, which need no token (its page, assets, login and
    logout): the API's guard asks which resource a request resolved to, not what its
    path looks like, so no spelling of a path reaches another route without the token."""
    assets = load_assets()

    def serve(request: web.Request, name: str) -> web.Response:
        asset = assets.get(name)
        if asset is None:
            return _json_error(404, f"no dashboard asset {name!r}")
        headers = {**HEADERS, "ETag": asset.etag}
        if request.headers.get("If-None-Match") == asset.etag:
            return web.Response(status=304, headers=headers)
        charset = "utf-8" if asset.content_type.startswith("text/") else None
        return web.Response(
            body=asset.body, content_type=asset.content_type, charset=charset, headers=headers
        )

    async def to_dashboard(request: web.Request) -> web.Response:
        raise web.HTTPFound(PREFIX)

    async def index(request: web.Request) -> web.Response:
        return serve(request, "index.html")

    async def static(request: web.Request) -> web.Response:
        return serve(request, request.match_info["path"])

    async def login(request: web.Request) -> web.Response:
        if not csrf_ok(request):
            return _json_error(403, "a login must come from the dashboard (X-Phalanx-CSRF)")
        data = await json_body(request)  # 400 if not JSON, 408 if it trickles
        given = data.get("token") if isinstance(data, dict) else None
        if not isinstance(given, str):
            return _json_error(400, "field 'token': an API token (PHALANX_TOKEN)")
        try:
            who = tokens.authenticate(given)
        except Unauthorized as exc:
            log.warning("dashboard login refused from %s: %s", request.remote, exc)
            return _json_error(401, str(exc))
        response = json_response({"ok": True, "token": who.view()}, headers=HEADERS)
        set_session(response, request, who)
        return response

    async def logout(request: web.Request) -> web.Response:
        if not csrf_ok(request):
            return _json_error(403, "a logout must come from the dashboard (X-Phalanx-CSRF)")
        response = json_response({"ok": True}, headers=HEADERS)
        clear_session(response, request)
        return response

    routes = [
        app.router.add_get("/", to_dashboard),
        app.router.add_get("/ui", to_dashboard),
        app.router.add_get(PREFIX, index),
        app.router.add_get(PREFIX + "static/{path:.+}", static),
        app.router.add_post(PREFIX + "login", login),
        app.router.add_post(PREFIX + "logout", logout),
    ]
    return frozenset(r.resource for r in routes if r.resource is not None)
