"""The REST routes of the supervisor's own state: is it alive, does it lead, what has
happened (its event log), its counters, and the Prometheus view of it all.

=======  ============================  ==========================================
method   path                          what
=======  ============================  ==========================================
GET      /healthz                      liveness (no token); ``store_ok``: false once the
                                       state database was found damaged
GET      /v1/leader                    (no token) whether this supervisor leads, and who
                                       does (``supervisor.standby``: a standby answers
                                       every other request 503, naming the leader)
GET      /v1/events                    ``?node=ID&job=ID&limit=N&after=ID``
GET      /v1/stats                     counters (heartbeats handled, bad messages, messages
                                       taken by kind, heartbeat lag histogram, how far
                                       behind its broker the supervisor is: behind_s;
                                       the event loop's stalls, and where: loop; the
                                       last flushes of checkpoint landings and publishes
                                       of catalogs, each with its phases: catalogs)
GET      /metrics                      Prometheus (``supervisor.api.prom``), any valid token
=======  ============================  ==========================================
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import generate_latest

from phalanx.http import json_response
from supervisor import gcpolicy
from supervisor.api.backend import Backend
from supervisor.api.handlers import error
from supervisor.api.prom import registry_of
from supervisor.leadership import Leader
from supervisor.standby import leader_view


def add_status_routes(app: web.Application, sup: Backend) -> None:
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

    async def events(request: web.Request) -> web.Response:
        q = request.query
        try:
            limit = max(1, min(int(q.get("limit", "100")), 10_000))
            after = int(q.get("after", "0"))
        except ValueError:
            return error(400, "query 'limit' and 'after' must be integers")
        found = sup.store.events(node=q.get("node"), job=q.get("job"), limit=limit, after=after)
        return json_response([e.as_dict() for e in found])

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
                # stretches the event loop ran without a yield, and where (phalanx.loopwatch)
                "loop": sup.loopwatch.view(),
                # the cyclic collector's passes, each a pause of the loop (supervisor.gcpolicy)
                "gc": gcpolicy.PAUSES.view(),
                # the last flushes of checkpoint landings and publishes of catalogs
                "catalogs": {
                    "recorded": list(sup.publisher.recorded),
                    "published": list(sup.publisher.published),
                },
            }
        )

    prometheus = registry_of(sup)

    async def prometheus_metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(prometheus),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    app.router.add_get("/metrics", prometheus_metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/leader", leader)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/v1/stats", stats)
