"""The REST routes of the sweeps (:mod:`supervisor.sweeps.manager`).

=======  ============================  ==========================================
method   path                          what
=======  ============================  ==========================================
POST     /v1/sweeps                    body ``{"spec": {...}}`` (a sweep spec, see
                                       ``phalanx.sweepspec``); 400 names the bad fields;
                                       a member submits for its own team only
GET      /v1/sweeps                    every sweep, oldest first: state, trial counts, best
GET      /v1/sweeps/{id}               one sweep with its trials; 404 when unknown
POST     /v1/sweeps/{id}/cancel        every running trial stopped; 409 once it ended; a
                                       member cancels its own team's only
=======  ============================  ==========================================
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from phalanx.http import json_body, json_response
from phalanx.sweepspec import SweepSpecError, validate_sweep
from supervisor.api.access import PRINCIPAL, Access
from supervisor.api.handlers import error
from supervisor.auth.roles import Action
from supervisor.sweeps.manager import Sweeps, UnknownSweep


def add_sweep_routes(app: web.Application, access: Access, sweeps: Sweeps) -> None:
    async def submit(request: web.Request) -> web.Response:
        data: Any = await json_body(request) if request.can_read_body else {}
        if not isinstance(data, dict) or not isinstance(data.get("spec"), dict):
            return error(400, "field 'spec': a sweep spec object is required")
        who = request[PRINCIPAL]
        try:
            spec = validate_sweep(data["spec"], default_team=lambda: who.team)
        except SweepSpecError as exc:
            return json_response(
                {
                    "error": str(exc),
                    "fields": [{"field": f, "line": ln, "message": m} for f, ln, m in exc.errors],
                },
                status=400,
            )
        access.require(request, Action.SUBMIT, spec.team, f"a sweep for team {spec.team}")
        return json_response(sweeps.view(sweeps.submit(spec)), status=201)

    async def listed(request: web.Request) -> web.Response:
        return json_response(
            [sweeps.view(sw, trials=False) for sw in sorted(sweeps.sweeps.values(), key=_age)]
        )

    async def one(request: web.Request) -> web.Response:
        try:
            found = sweeps.get(request.match_info["id"])
        except UnknownSweep as exc:
            return error(404, str(exc))
        return json_response(sweeps.view(found))

    async def cancel(request: web.Request) -> web.Response:
        sweep_id = request.match_info["id"]
        try:
            found = sweeps.get(sweep_id)
        except UnknownSweep as exc:
            return error(404, str(exc))
        team = found.spec.team
        access.require(request, Action.CANCEL, team, f"sweep {sweep_id} of team {team}")
        return json_response(sweeps.view(sweeps.cancel(sweep_id)))

    app.router.add_post("/v1/sweeps", submit)
    app.router.add_get("/v1/sweeps", listed)
    app.router.add_get("/v1/sweeps/{id}", one)
    app.router.add_post("/v1/sweeps/{id}/cancel", cancel)


def _age(sw: Any) -> tuple[float, str]:
    return (sw.created_at, sw.id)
