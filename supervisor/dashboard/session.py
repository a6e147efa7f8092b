"""The dashboard's session: an API token, asked once, kept in a cookie.

A browser logs in with ``POST /ui/login`` and a token (any valid one,
:mod:`supervisor.auth.tokens`) in a JSON body; the answer sets
the cookie :data:`COOKIE`: ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no
other site's page sends it) and ``Secure`` when the request came over HTTPS (or a TLS
proxy's ``X-Forwarded-Proto`` says it did). Its value
is not the token but ``v2.<token id>.<expiry>.<HMAC>``, the HMAC keyed by the token's
session key (its stored hash HMAC'd with the bootstrap token, which the store never
holds: ``Tokens.session_key``): a copied cookie dies after :data:`SESSION_S`, the session
has the rights of that token and no other, revoking the token ends its sessions (each
request looks the token up again) and rotating the bootstrap token ends them all.

The API accepts the cookie as well as the bearer header. A state-changing request
(not GET/HEAD/OPTIONS) authenticated by the cookie must also carry
:data:`CSRF_HEADER`: another site's page cannot add a custom header to a request to the
supervisor without a CORS preflight, which the supervisor never grants.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

from aiohttp import web

from supervisor.auth.tokens import Principal

COOKIE = "phalanx_session"
CSRF_HEADER = "X-Phalanx-CSRF"
SESSION_S = 12 * 3600  # a login lasts this long (or until its token expires)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_VERSION = "v2"


def _mac(key: str, token_id: str, expires: int) -> str:
    message = f"phalanx dashboard session {_VERSION}.{token_id}.{expires}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def session_value(who: Principal, *, now: float | None = None) -> str:
    """A cookie value for ``who``'s token, valid for :data:`SESSION_S` from ``now`` (less
    when the token expires sooner)."""
    expires = int((time.time() if now is None else now) + SESSION_S)
    if who.expires_at is not None:
        expires = min(expires, int(who.expires_at))
    if not who.session_key:
        raise ValueError(f"token {who.id} has no session key: made by Tokens only")
    return f"{_VERSION}.{who.id}.{expires}.{_mac(who.session_key, who.id, expires)}"


def session_of(
    request: web.Request,
    lookup: Callable[[str], Principal | None],
    *,
    now: float | None = None,
) -> Principal | None:
    """The token of the request's unexpired session cookie; None when it has none or a
    forged or stale one. ``lookup``: a token id to its valid token (None: unknown; it
    raises ``Unauthorized`` for a revoked or expired one, which ends its sessions)."""
    parts = request.cookies.get(COOKIE, "").split(".")
    if len(parts) != 4 or parts[0] != _VERSION or not parts[2].isdigit():
        return None
    _, token_id, expires_text, mac = parts
    expires = int(expires_text)
    if expires < (time.time() if now is None else now):
        return None
    who = lookup(token_id)
    if (
        who is None
        or not who.session_key
        or not hmac.compare_digest(mac.encode(), _mac(who.session_key, who.id, expires).encode())
    ):
        return None
    return who


def csrf_ok(request: web.Request) -> bool:
    """A safe method, or a request that carries :data:`CSRF_HEADER` (the dashboard's)."""
    return request.method in SAFE_METHODS or request.headers.get(CSRF_HEADER) == "1"


def over_https(request: web.Request) -> bool:
    """The browser reached the supervisor over HTTPS: directly, or through a proxy that
    says so (``X-Forwarded-Proto``). Believing a client that lies only makes its own
    cookie stricter (Secure), never another's looser."""
    return request.secure or request.headers.get("X-Forwarded-Proto", "").lower() == "https"


def set_session(response: web.StreamResponse, request: web.Request, who: Principal) -> None:
    response.set_cookie(
        COOKIE,
        session_value(who),
        max_age=SESSION_S,
        path="/",
        httponly=True,
        samesite="Strict",
        secure=over_https(request),
    )


def clear_session(response: web.StreamResponse, request: web.Request) -> None:
    response.del_cookie(
        COOKIE, path="/", httponly=True, samesite="Strict", secure=over_https(request)
    )
