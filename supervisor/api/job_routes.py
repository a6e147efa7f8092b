"""The REST routes of the jobs (:mod:`supervisor.control.controller`): submit, list, look,
cancel, and what a job leaves: its ranks' logs, its checkpoints, its training series.

=======  ============================  ==========================================
method   path                          what
=======  ============================  ==========================================
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
=======  ============================  ==========================================

A job's submission is checked against the spec's team by its handler
(:meth:`supervisor.api.access.Access.require`); every other route here by the job's
team, before the handler. Rank logs are fetched from the agents over HTTPS with
``agent_tls`` (verified against ``agent_ca_file``), with the node's own token.
"""

from __future__ import annotations

import bisect
import math
import re
from typing import Any

import aiohttp
from aiohttp import web

from phalanx import wire
from phalanx.agent_tokens import node_token
from phalanx.http import json_response
from phalanx.jobspec import JobSpecError, validate_spec
from supervisor.api import job_pages
from supervisor.api.access import PRINCIPAL, Access
from supervisor.api.backend import Backend
from supervisor.api.handlers import body, error
from supervisor.auth.roles import Action
from supervisor.jobs import Job
from supervisor.telemetry.series import Point
from supervisor.telemetry.training import MAX_SERIES, json_number

_SERIES_NAME = re.compile(wire.SCALAR_NAME_PATTERN)
POINT_COLUMNS = ("step", "ts", "value", "min", "max", "n")

SUMMARY_CHECKPOINTS = 8  # a job's summary lists its newest committed steps, this many
LOG_LIMIT = 2**20  # the most bytes of a rank's log one request fetches (the agent's default)


def add_job_routes(app: web.Application, access: Access, sup: Backend) -> None:
    agent_tls = sup.settings.agent_ssl()  # how rank logs are fetched from the agents
    agent_scheme = "https" if agent_tls is not None else "http"

    async def submit(request: web.Request) -> web.Response:
        data = await body(request)
        spec = data.get("spec")
        if not isinstance(spec, dict):
            return error(400, "field 'spec': a job spec object is required")
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
            return error(400, str(exc))
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
        tiers = sup.catalog.rows.committed_tiers(found.id)
        committed = sorted(tiers.items())[-SUMMARY_CHECKPOINTS:]
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
                return error(
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
                return error(400, "query 'since': a time in seconds since the epoch")
        step_from: int | None = None
        if "step_from" in q:
            try:
                step_from = int(q["step_from"])
            except ValueError:
                step_from = -1
            if not 0 <= step_from <= wire.MAX_STEP:
                return error(400, f"query 'step_from': an integer in [0, {wire.MAX_STEP}]")
        after: int | None = None
        if "after" in q:
            try:
                after = int(q["after"])
            except ValueError:
                after = -1
            if not 0 <= after < 2**63:
                return error(400, "query 'after': a cursor (a non-negative integer) it gave")
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
            return error(400, "query 'rank', 'offset' and 'limit' must be integers")
        if not 1 <= limit <= LOG_LIMIT:
            return error(400, f"query 'limit': from 1 to {LOG_LIMIT} bytes")
        place = found.place(rank)
        if place is None:
            return error(404, f"job {found.id} has no rank {rank} placed")
        node = sup.registry.get(place.node)
        if node.birth is None:
            return error(503, f"node {place.node} has not announced its address")
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
                    return error(
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
            return error(
                502,
                f"cannot fetch the log from node {place.node} at "
                f"{node.birth.address}:{node.birth.http_port}: {exc}",
            )

    async def checkpoints(request: web.Request) -> web.Response:
        return json_response(checkpoint_view(sup.jobs.get(request.match_info["id"])))

    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs", jobs)
    app.router.add_get("/v1/jobs/{id}", job)
    app.router.add_post("/v1/jobs/{id}/cancel", cancel)
    app.router.add_get("/v1/jobs/{id}/logs", logs)
    app.router.add_get("/v1/jobs/{id}/checkpoints", checkpoints)
    app.router.add_get("/v1/jobs/{id}/metrics", metrics)


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
