"""The dashboard's session: the operators' token, asked once, kept in a cookie.

A browser logs in with ``POST /ui/login`` and the token in a JSON body; the answer sets
the cookie :data:`COOKIE`: ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no
other site's page sends it) and ``Secure`` when the request came over HTTPS (or a TLS
proxy's ``X-Forwarded-Proto`` says it did). Its value
is not the token but an expiry and an HMAC of it keyed by the token, so a copied cookie
dies after :data:`SESSION_S` and rotating the token ends every session.

The API accepts the cookie as well as the bearer header. A state-changing request
(not GET/HEAD/OPTIONS) authenticated by the cookie must also carry
:data:`CSRF_HEADER`: another site's page cannot add a custom header to a request to the
supervisor without a CORS preflight, which the supervisor never grants.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from aiohttp import web

COOKIE = "phalanx_session"
CSRF_HEADER = "X-Phalanx-CSRF"
SESSION_S = 12 * 3600  # a login lasts this long
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_VERSION = "v1"


def _mac(token: bytes, expires: int) -> str:
    message = f"phalanx dashboard session {_VERSION}.{expires}".encode()
    return hmac.new(token, message, hashlib.sha256).hexdigest()


def session_value(token: bytes, *, now: float | None = None) -> str:
    """A cookie value valid for :data:`SESSION_S` from ``now``."""
    expires = int((time.time() if now is None else now) + SESSION_S)
    return f"{_VERSION}.{expires}.{_mac(token, expires)}"


def session_ok(request: web.Request, token: bytes, *, now: float | None = None) -> bool:
    """True when the request carries an unexpired session cookie made with ``token``."""
    version, _, rest = request.cookies.get(COOKIE, "").partition(".")
    expires_text, _, mac = rest.partition(".")
    if version != _VERSION or not expires_text.isdigit() or not token:
        return False
    expires = int(expires_text)
    if expires < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, expires).encode())


def csrf_ok(request: web.Request) -> bool:
    """A safe method, or a request that carries :data:`CSRF_HEADER` (the dashboard's)."""
    return request.method in SAFE_METHODS or request.headers.get(CSRF_HEADER) == "1"


def over_https(request: web.Request) -> bool:
    """The browser reached the supervisor over HTTPS: directly, or through a proxy that
    says so (``X-Forwarded-Proto``). Believing a client that lies only makes its own
    cookie stricter (Secure), never another's looser."""
    return request.secure or request.headers.get("X-Forwarded-Proto", "").lower() == "https"


def set_session(response: web.StreamResponse, request: web.Request, token: bytes) -> None:
    response.set_cookie(
        COOKIE,
        session_value(token),
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
