"""The supervisor's REST API (aiohttp), behind bearer tokens with roles.

``make_app`` builds the application: the middlewares (the access check and error
answers, compression), the dashboard, and the routes of each resource, each module
with the table of its own:

========================  =====================================================
module                    routes
========================  =====================================================
``status_routes``         ``/healthz``, ``/v1/leader`` (both need no token),
                          ``/v1/events``, ``/v1/stats``, ``/metrics``
``supervisor.dashboard``  ``/ui/`` (its page and assets need no token, its data
                          calls do); ``POST /ui/login``, ``/ui/logout`` with body
                          ``{"token": "..."}`` set (clear) the session cookie the
                          API accepts as well as the bearer token
``token_routes``          ``/v1/whoami``, ``/v1/tokens...`` (admin)
``sweep_routes``          ``/v1/sweeps...``
``node_routes``           ``/v1/nodes``, ``/v1/nodes/{id}...``: drain, undrain, ping
``job_routes``            ``/v1/jobs``, ``/v1/jobs/{id}...``: cancel, logs,
                          checkpoints, metrics
========================  =====================================================

Every other path needs a token (:mod:`supervisor.auth.tokens`: the bootstrap token of
``api.token_file``, an admin, or one an admin created) as a bearer header, or the
dashboard's session cookie of one; a request that changes state on the cookie's word
must carry ``X-Phalanx-CSRF: 1`` too (403 otherwise, see
:mod:`supervisor.dashboard.session`). What a token may do is its role's
(:mod:`supervisor.auth.roles`); each route's action is in :data:`supervisor.api.access.RULES`.
A missing, wrong, expired or revoked token is a 401 saying which; a request outside
the token's role is a 403 naming what it needs, recorded as an ``auth_denied`` event.

It serves HTTPS with ``api.tls_cert_file`` and ``api.tls_key_file`` (``job_routes``
fetches rank logs from the agents over HTTPS with ``agent_tls``).

Errors are ``{"error": "message"}`` with a 4xx/5xx status; :data:`HTTP_STATUS` says
which error of :mod:`supervisor.errors` answers which.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from phalanx.http import serve
from supervisor import dashboard
from supervisor.api.access import Access
from supervisor.api.backend import Backend
from supervisor.api.handlers import Handler, error
from supervisor.api.job_routes import add_job_routes
from supervisor.api.node_routes import add_node_routes
from supervisor.api.status_routes import add_status_routes
from supervisor.api.sweep_routes import add_sweep_routes
from supervisor.api.token_routes import add_token_routes
from supervisor.auth.tokens import Tokens
from supervisor.errors import (
    CommandTimeout,
    Forbidden,
    Refused,
    RegistryError,
    StoreError,
    SupervisorError,
    Unauthorized,
    UnknownJob,
    UnknownNode,
    UnknownToken,
)

log = logging.getLogger(__name__)

SHUTDOWN_S = 2.0  # requests in flight when the supervisor stops get this long to answer
# An answer larger than this is compressed for a client that accepts it (the dashboard's
# browser; the CLI does not ask): /v1/nodes of 2,048 nodes is 2.3 MB, 72 KB gzipped.
COMPRESS_OVER = 32 * 1024


# The operator's request errors and their HTTP status, the most specific first; any other
# error is a 500 (logged: the supervisor's fault, not the request's).
HTTP_STATUS: tuple[tuple[type[SupervisorError], int], ...] = (
    (Unauthorized, 401),
    (Forbidden, 403),
    (UnknownNode, 404),
    (UnknownJob, 404),
    (UnknownToken, 404),
    (Refused, 409),
    (RegistryError, 400),
    (CommandTimeout, 504),
    (StoreError, 503),  # the state database cannot be read or written (damaged, disk full)
)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status that answers ``exc``; None: not a request error (a 500)."""
    return next((status for kind, status in HTTP_STATUS if isinstance(exc, kind)), None)


def make_app(sup: Backend) -> web.Application:
    tokens = Tokens(sup.store, sup.token)
    access = Access(tokens, sup.store, lambda job: sup.jobs.get(job).spec.team)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.match_info.http_exception is not None:  # no route: 404 or 405
                access.authenticate(request)
            else:
                access.check(request)
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:
            status = http_status(exc)
            if status is not None:
                return error(status, str(exc))
            log.exception("API %s %s failed", request.method, request.path)
            return error(500, "internal error; see the supervisor log")

    @web.middleware
    async def compress(request: web.Request, handler: Handler) -> web.StreamResponse:
        resp = await handler(request)
        body = resp.body if isinstance(resp, web.Response) else None
        if isinstance(body, bytes | bytearray) and len(body) > COMPRESS_OVER:
            resp.enable_compression()  # by Accept-Encoding; aiohttp zlibs off the loop
        return resp

    app = web.Application(middlewares=[guard, compress], client_max_size=64 * 1024)
    add_status_routes(app, sup)
    dashboard.add_routes(app, tokens)
    add_token_routes(app, tokens, sup.store)
    add_sweep_routes(app, access, sup.sweeps)
    add_node_routes(app, sup)
    add_job_routes(app, access, sup)
    return app


@contextlib.asynccontextmanager
async def start_api(sup: Backend) -> AsyncIterator[int]:
    api = sup.settings.api
    tls = api.server_ssl()  # None: plain HTTP
    async with serve(
        make_app(sup),
        lambda runner: web.TCPSite(runner, api.host, api.port, ssl_context=tls),
        f"supervisor API ({'https' if tls else 'http'}) on {api.host}:{api.port}",
        shutdown_timeout=SHUTDOWN_S,
    ) as runner:
        yield int(runner.addresses[0][1])
