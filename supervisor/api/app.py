"""The supervisor's REST API (aiohttp), behind bearer tokens with roles.

=======  ============================  ==========================================
method   path                          what
=======  ============================  ==========================================
GET      /healthz                      liveness (no token); ``store_ok``: false once the
                                       state database was found damaged
GET      /v1/leader                    (no token) whether this supervisor leads, and who
                                       does (``supervisor.standby``: a standby answers
                                       every other request 503, naming the leader)
GET      /ui/                          the web dashboard (``supervisor.dashboard``; its page
                                       and assets need no token, its data calls do)
POST     /ui/login, /ui/logout         body ``{"token": "..."}``: set (clear) the session
                                       cookie the API accepts as well as the bearer token
GET      /v1/nodes                     every node (see ``Node.view``)
GET      /v1/nodes/{id}                one node, with each GPU's gauges and the host's;
                                       404 when unknown
POST     /v1/nodes/{id}/drain          body ``{"reason": "..."}``
POST     /v1/nodes/{id}/undrain        body ``{"force": false}``; 409 while sick
POST     /v1/nodes/{id}/ping           round trip of a command to the agent
POST     /v1/jobs                      body ``{"spec": {...}}``; 400 names the bad fields
GET      /v1/jobs                      every job (see ``Job.view``), oldest first;
                                       ``?state=running,pending&team=T`` filters, and
                                       ``limit=N&before=CURSOR`` pages, newest first:
                                       ``X-Phalanx-Next`` is the next page's cursor,
                                       ``X-Phalanx-Total`` the jobs on all pages
                                       (``supervisor.api.job_pages``)
GET      /v1/jobs/{id}                 one job; 404 when unknown
POST     /v1/jobs/{id}/cancel          stop every rank, then ``cancelled``
GET      /v1/jobs/{id}/logs            ``?rank=N&offset=K&limit=L``: bytes of a rank's log,
                                       fetched from its node; ``X-Phalanx-Offset`` is where
                                       to go on, ``X-Phalanx-Size`` the log's size
GET      /v1/jobs/{id}/checkpoints     the catalog: every step with a shard somewhere,
                                       the tiers it is committed at, partial tiers
GET      /v1/jobs/{id}/metrics         ``?names=loss,grad_norm&after=CURSOR&since=TS&step_from=N``:
                                       the job's training series (``telemetry.training``),
                                       each point ``[step, ts, value, min, max, n]``;
                                       ``cursor`` in the answer: ``after`` it returns the
                                       points inserted since, late windows included
                                       (``since`` filters by a window's time: it misses
                                       those; see ``supervisor.telemetry.rows``)
GET      /metrics                      Prometheus (``supervisor.api.prom``), any valid token
GET      /v1/events                    ``?node=ID&job=ID&limit=N&after=ID``
GET      /v1/stats                     counters (heartbeats handled, bad messages, messages
                                       taken by kind, heartbeat lag histogram, how far
                                       behind its broker the supervisor is: behind_s)
GET      /v1/whoami                    the request's token: id, name, role, team, expiry
GET/POST /v1/sweeps...                 hyperparameter sweeps (``supervisor.api.sweep_routes``)
POST     /v1/tokens                    admin: body ``{"role": ..., "team": ..., "name": ...,
                                       "expires": "30d"}``; the answer holds the secret,
                                       once (``supervisor.api.token_routes``)
GET      /v1/tokens                    admin: every token, never a secret or hash
POST     /v1/tokens/{id}/revoke        admin: the token and its dashboard sessions end
=======  ============================  ==========================================

Every other path needs a token (:mod:`supervisor.auth.tokens`: the bootstrap token of
``api.token_file``, an admin, or one an admin created) as a bearer header, or the
dashboard's session cookie of one; a request that changes state on the cookie's word
must carry ``X-Phalanx-CSRF: 1`` too (403 otherwise, see
:mod:`supervisor.dashboard.session`). What a token may do is its role's
(:mod:`supervisor.auth.roles`); each route's action is in :data:`supervisor.api.access.RULES`.
A missing, wrong, expired or revoked token is a 401 saying which; a request outside
the token's role is a 403 naming what it needs, recorded as an ``auth_denied`` event.

It serves HTTPS with ``api.tls_cert_file`` and ``api.tls_key_file``, and fetches rank
logs from the agents over HTTPS with ``agent_tls`` (verified against ``agent_ca_file``).

Errors are ``{"error": "message"}`` with a 4xx/5xx status; :data:`HTTP_STATUS` says
which error of :mod:`supervisor.errors` answers which.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from phalanx import wire
from phalanx.agent_tokens import node_token
from phalanx.http import json_body, json_response, serve
from phalanx.jobspec import JobSpecError, validate_spec
from phalanx.link import MqttLinks
from supervisor import dashboard
from supervisor.api import job_pages
from supervisor.api.access import PRINCIPAL, Access
from supervisor.api.prom import registry_of
from supervisor.api.sweep_routes import add_sweep_routes
from supervisor.api.token_routes import add_token_routes
from supervisor.auth.roles import Action
from supervisor.auth.tokens import Tokens
from supervisor.backup import StoreBackups
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.config import SupervisorSettings
from supervisor.control.controller import JobController
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
from supervisor.fleet.commands import Commands
from supervisor.fleet.registry import Node, Registry
from supervisor.jobs import Job
from supervisor.leadership import Leader, Leadership
from supervisor.standby import leader_view
from supervisor.store import Store
from supervisor.sweeps import Sweeps
from supervisor.telemetry.series import Point
from supervisor.telemetry.training import MAX_SERIES, TrainingMetrics, json_number
from supervisor.telemetry.wire_stats import WireStats

log = logging.getLogger(__name__)

_SERIES_NAME = re.compile(wire.SCALAR_NAME_PATTERN)
POINT_COLUMNS = ("step", "ts", "value", "min", "max", "n")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SUMMARY_CHECKPOINTS = 8  # a job's summary lists its newest committed steps, this many
SHUTDOWN_S = 2.0  # requests in flight when the supervisor stops get this long to answer
LOG_LIMIT = 2**20  # the most bytes of a rank's log one request fetches (the agent's default)
# An answer larger than this is compressed for a client that accepts it (the dashboard's
# browser; the CLI does not ask): /v1/nodes of 2,048 nodes is 2.3 MB, 72 KB gzipped.
COMPRESS_OVER = 32 * 1024


class Backend(Protocol):
    """What the API serves of the supervisor (``supervisor.daemon.Supervisor``)."""

    token: str  # the bootstrap (admin) bearer token
    agent_token: str  # the fleet agent secret: a node's token, to fetch its logs, derives from it
    settings: SupervisorSettings
    registry: Registry
    jobs: JobController
    store: Store
    backups: StoreBackups | None  # the store's rolling backups (None: off)
    catalog: CheckpointCatalog
    commands: Commands
    link: MqttLinks
    metrics: TrainingMetrics
    sweeps: Sweeps
    bad_messages: int
    wire_stats: WireStats
    leadership: Leadership | None  # None: a supervisor alone (SQLite)


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


def _error(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status=status)


def gauge_summary(health: wire.Health) -> dict[str, Any]:
    """A node's GPU gauges in a few numbers (the hottest GPU, ECC and retired pages
    summed over its GPUs, the GPUs throttled): what a fleet view of thousands shows."""
    gpus = health.gpus

    def total(field: str) -> int | None:
        values = [getattr(g, field) for g in gpus if getattr(g, field) is not None]
        return sum(values) if values else None

    temps = [g.temperature_c for g in gpus if g.temperature_c is not None]
    return {
        "temperature_max_c": max(temps) if temps else None,
        "ecc_sbe_volatile": total("ecc_sbe_volatile"),
        "ecc_dbe_volatile": total("ecc_dbe_volatile"),
        "retired_pages": total("retired_pages"),
        "throttled_gpus": [g.index for g in gpus if g.throttle],
    }


def make_app(sup: Backend) -> web.Application:
    tokens = Tokens(sup.store, sup.token)
    access = Access(tokens, sup.store, lambda job: sup.jobs.get(job).spec.team)
    agent_tls = sup.settings.agent_ssl()  # how rank logs are fetched from the agents
    agent_scheme = "https" if agent_tls is not None else "http"

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
                return _error(status, str(exc))
            log.exception("API %s %s failed", request.method, request.path)
            return _error(500, "internal error; see the supervisor log")

    @web.middleware
    async def compress(request: web.Request, handler: Handler) -> web.StreamResponse:
        resp = await handler(request)
        body = resp.body if isinstance(resp, web.Response) else None
        if isinstance(body, bytes | bytearray) and len(body) > COMPRESS_OVER:
            resp.enable_compression()  # by Accept-Encoding; aiohttp zlibs off the loop
        return resp

    async def body(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        data = await json_body(request)
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(
                text=json.dumps({"error": "request body must be an object"}),
                content_type="application/json",
            )
        return data

    async def healthz(request: web.Request) -> web.Response:
        return json_response(
            {
                "ok": True,
                "mqtt_connected": sup.link.connected,  # to any broker listed
                "mqtt_brokers": {link.broker: link.connected for link in sup.link.links},
                "store_ok": sup.store.corrupt is None,  # False: damage met (the log says)
            }
        )

    async def leader(request: web.Request) -> web.Response:
        lead = sup.leadership
        if lead is None:
            return json_response({"leading": True, "url": "", "leader": None, "term": 0})
        found = Leader(lead.term, lead.holder, lead.api_url, 0.0)
        return json_response(leader_view(found, leading=lead.leads(), url=lead.api_url))

    def jobs_by_node() -> dict[str, list[str]]:
        """Each node's jobs that hold it, looked up once for a whole listing (per node it
        was a scan of every job's nodes: quadratic in the fleet, issue 22)."""
        held: dict[str, list[str]] = {}
        for j in sup.jobs.jobs.values():
            if j.state.holds_nodes:
                for node in set(j.nodes):
                    held.setdefault(node, []).append(j.id)
        return held

    # Each node's gauge summary, made once per heartbeat (its health), not per request.
    gauges_of: dict[str, tuple[wire.Health, dict[str, Any]]] = {}

    def node_view(
        n: Node, *, gauges: bool = False, held: dict[str, list[str]] | None = None
    ) -> dict[str, Any]:
        view = n.view()
        view["jobs"] = sorted((held if held is not None else jobs_by_node()).get(n.id, []))
        view["spare"] = n.id in sup.jobs.spares
        seen = gauges_of.get(n.id)
        if seen is None or seen[0] is not n.health:  # a new heartbeat since
            seen = gauges_of[n.id] = (n.health, gauge_summary(n.health))
        view["gauges"] = dict(seen[1])
        if gauges:  # one node: every GPU's numbers, and the host's
            view["gpu_gauges"] = [g.model_dump() for g in n.health.gpus]
            view["host"] = n.health.host.model_dump() if n.health.host else None
        return view

    async def nodes(request: web.Request) -> web.Response:
        held = jobs_by_node()
        return json_response(
            [node_view(n, held=held) for _, n in sorted(sup.registry.nodes.items())]
        )

    async def node(request: web.Request) -> web.Response:
        found = sup.registry.get(request.match_info["id"])
        return json_response(node_view(found, gauges=True))

    async def drain(request: web.Request) -> web.Response:
        data = await body(request)
        reason = data.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return _error(400, "field 'reason': a drain needs a non-empty reason")
        return json_response(sup.registry.drain(request.match_info["id"], reason).view())

    async def undrain(request: web.Request) -> web.Response:
        data = await body(request)
        force = data.get("force", False)
        if not isinstance(force, bool):
            return _error(400, "field 'force': must be true or false")
        return json_response(sup.registry.undrain(request.match_info["id"], force=force).view())

    async def ping(request: web.Request) -> web.Response:
        try:
            ack = await sup.commands.send(request.match_info["id"], wire.PingArgs())
        except ConnectionError as exc:  # the broker is unreachable
            return _error(503, str(exc))
        return json_response(ack.model_dump(mode="json"))

    async def events(request: web.Request) -> web.Response:
        q = request.query
        try:
            limit = max(1, min(int(q.get("limit", "100")), 10_000))
            after = int(q.get("after", "0"))
        except ValueError:
            return _error(400, "query 'limit' and 'after' must be integers")
        found = sup.store.events(node=q.get("node"), job=q.get("job"), limit=limit, after=after)
        return json_response([e.as_dict() for e in found])

    async def submit(request: web.Request) -> web.Response:
        data = await body(request)
        spec = data.get("spec")
        if not isinstance(spec, dict):
            return _error(400, "field 'spec': a job spec object is required")
        who = request[PRINCIPAL]
        try:
            parsed = validate_spec(spec, default_team=lambda: who.team)
        except JobSpecError as exc:
            return json_response(
                {
                    "error": str(exc),
                    "fields": [{"field": f, "line": ln, "message": m} for f, ln, m in exc.errors],
                },
                status=400,
            )
        team = parsed.team
        access.require(request, Action.SUBMIT, team, f"a job for team {team}")
        job = sup.jobs.submit(parsed)
        return json_response(job.view(), status=201)

    async def jobs(request: web.Request) -> web.Response:
        try:
            found = job_pages.page(sup.jobs.jobs.values(), request.query)
        except job_pages.PageQueryError as exc:
            return _error(400, str(exc))
        headers = {}
        if "limit" in request.query or "before" in request.query:
            headers["X-Phalanx-Total"] = str(found.total)
            if found.next is not None:
                headers["X-Phalanx-Next"] = found.next
        # The training summary of the jobs that still train only: the list grows with the
        # job history, and each summary costs queries (GET /v1/jobs/{id} has it always).
        return json_response(
            [
                j.view(summary=None if j.state.final else sup.metrics.summary(j.id))
                for j in found.jobs
            ],
            headers=headers,
        )

    def checkpoint_view(found: Job) -> dict[str, Any]:
        view = sup.catalog.view(found.id, found.world_size, found.spec.checkpoint.tiers)
        view["lineage"] = found.spec.lineage()
        add_losses(view["steps"], sup.metrics.rows.series(found.id, ["loss"]).get("loss", []))
        return view

    async def job(request: web.Request) -> web.Response:
        found = sup.jobs.get(request.match_info["id"])
        summary = sup.metrics.summary(found.id)
        # The newest committed steps, each with its tiers and the loss at it: from the
        # commits, not the catalog view (every shard row), as the dashboard polls this.
        committed = sorted(sup.store.committed_tiers(found.id).items())[-SUMMARY_CHECKPOINTS:]
        refs = [{"step": step, "tiers": tiers} for step, tiers in committed]
        add_losses(refs, sup.metrics.rows.series(found.id, ["loss"]).get("loss", []))
        summary["checkpoints"] = refs
        return json_response(found.view(summary=summary))

    async def metrics(request: web.Request) -> web.Response:
        found = sup.jobs.get(request.match_info["id"])
        q = request.query
        names: list[str] | None = None
        if "names" in q:
            names = [n for n in q["names"].split(",") if n]
            bad = [n for n in names if not _SERIES_NAME.match(n)]
            if bad or not names or len(names) > MAX_SERIES:
                return _error(
                    400,
                    f"query 'names': a comma-separated list of at most {MAX_SERIES} series "
                    f"names (identifiers){f'; not one: {bad[0][:80]!r}' if bad else ''}",
                )
        since: float | None = None
        if "since" in q:
            try:
                since = float(q["since"])
            except ValueError:
                since = math.nan
            if not math.isfinite(since):
                return _error(400, "query 'since': a time in seconds since the epoch")
        step_from: int | None = None
        if "step_from" in q:
            try:
                step_from = int(q["step_from"])
            except ValueError:
                step_from = -1
            if not 0 <= step_from <= wire.MAX_STEP:
                return _error(400, f"query 'step_from': an integer in [0, {wire.MAX_STEP}]")
        after: int | None = None
        if "after" in q:
            try:
                after = int(q["after"])
            except ValueError:
                after = -1
            if not 0 <= after < 2**63:
                return _error(400, "query 'after': a cursor (a non-negative integer) it gave")
        # The high-water mark first, and no row above it: the rows inserted meanwhile
        # come with the next poll's after=cursor.
        cursor = sup.metrics.rows.cursor(found.id)
        series = sup.metrics.rows.series(
            found.id, names, since=since, step_from=step_from, after=after, upto=cursor
        )
        return json_response(
            {
                "job": found.id,
                "generation": found.generation,
                "cursor": cursor,
                "columns": list(POINT_COLUMNS),
                "series": {
                    name: [
                        [
                            p.step,
                            p.ts,
                            json_number(p.value),
                            json_number(p.low),
                            json_number(p.high),
                            p.n,
                        ]
                        for p in points
                    ]
                    for name, points in series.items()
                },
                "summary": sup.metrics.summary(found.id),
            }
        )

    async def cancel(request: web.Request) -> web.Response:
        return json_response(sup.jobs.cancel(request.match_info["id"]).view())

    async def logs(request: web.Request) -> web.StreamResponse:
        # Who may read them: ``access.check`` (an operator, or a member of the job's team).
        found = sup.jobs.get(request.match_info["id"])
        try:
            rank = int(request.query.get("rank", "0"))
            offset = int(request.query.get("offset", "0"))
            limit = int(request.query.get("limit", str(LOG_LIMIT)))
        except ValueError:
            return _error(400, "query 'rank', 'offset' and 'limit' must be integers")
        if not 1 <= limit <= LOG_LIMIT:
            return _error(400, f"query 'limit': from 1 to {LOG_LIMIT} bytes")
        place = found.place(rank)
        if place is None:
            return _error(404, f"job {found.id} has no rank {rank} placed")
        node = sup.registry.get(place.node)
        if node.birth is None:
            return _error(503, f"node {place.node} has not announced its address")
        url = (
            f"{agent_scheme}://{node.birth.address}:{node.birth.http_port}/v1/jobs/{found.id}/ranks/"
            f"{rank}/log?offset={offset}&limit={limit}"
        )
        # The node's own token (phalanx.agent_tokens): it opens that node's logs alone.
        bearer = node_token(sup.agent_token, place.node) if sup.agent_token else ""
        try:
            async with (
                aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=10),
                    connector=aiohttp.TCPConnector(ssl=agent_tls or True),
                ) as http,
                http.get(url, headers={"Authorization": f"Bearer {bearer}"}) as resp,
            ):
                data = await resp.read()
                if resp.status != 200:
                    return _error(
                        502 if resp.status != 404 else 404,
                        f"node {place.node}: {data.decode(errors='replace')[:300]}",
                    )
                return web.Response(
                    body=data,
                    content_type="text/plain",
                    headers={
                        "X-Phalanx-Offset": resp.headers.get("X-Phalanx-Offset", str(offset)),
                        "X-Phalanx-Size": resp.headers.get("X-Phalanx-Size", ""),
                        "X-Phalanx-Node": place.node,
                    },
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _error(
                502,
                f"cannot fetch the log from node {place.node} at "
                f"{node.birth.address}:{node.birth.http_port}: {exc}",
            )

    async def checkpoints(request: web.Request) -> web.Response:
        return json_response(checkpoint_view(sup.jobs.get(request.match_info["id"])))

    async def stats(request: web.Request) -> web.Response:
        return json_response(
            {
                "heartbeats": sup.registry.heartbeats,
                "bad_messages": sup.bad_messages,
                "nodes": len(sup.registry.nodes),
                "mqtt_connects": sup.link.connects,
                # how long messages received have waited for the handler (0: none wait)
                "behind_s": round(sup.link.behind_s, 3),
                "jobs": len(sup.jobs.jobs),
                "last_schedule_pass_s": sup.jobs.last_pass_s,
                "metrics_batches": sup.metrics.batches,
                "metrics_dropped": sup.metrics.dropped,
                **sup.wire_stats.view(),
            }
        )

    prometheus = registry_of(sup)

    async def prometheus_metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(prometheus),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    app = web.Application(middlewares=[guard, compress], client_max_size=64 * 1024)
    app.router.add_get("/metrics", prometheus_metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/leader", leader)
    dashboard.add_routes(app, tokens)
    add_token_routes(app, tokens, sup.store)
    add_sweep_routes(app, access, sup.sweeps)
    app.router.add_get("/v1/nodes", nodes)
    app.router.add_get("/v1/nodes/{id}", node)
    app.router.add_post("/v1/nodes/{id}/drain", drain)
    app.router.add_post("/v1/nodes/{id}/undrain", undrain)
    app.router.add_post("/v1/nodes/{id}/ping", ping)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/v1/stats", stats)
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs", jobs)
    app.router.add_get("/v1/jobs/{id}", job)
    app.router.add_post("/v1/jobs/{id}/cancel", cancel)
    app.router.add_get("/v1/jobs/{id}/logs", logs)
    app.router.add_get("/v1/jobs/{id}/checkpoints", checkpoints)
    app.router.add_get("/v1/jobs/{id}/metrics", metrics)
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


def add_losses(steps: list[dict[str, Any]], losses: list[Point]) -> None:
    """Each checkpoint step's loss: the loss series' point at that step or the nearest
    before it (``loss_step`` says which; the newest such point after a roll-back)."""
    ordered = sorted(losses, key=lambda p: (p.step, p.ts))
    at = [p.step for p in ordered]
    for entry in steps:
        i = bisect.bisect_right(at, entry["step"])
        point = ordered[i - 1] if i else None
        entry["loss"] = json_number(point.value) if point is not None else None
        entry["loss_step"] = point.step if point is not None else None
