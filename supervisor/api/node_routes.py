"""The REST routes of the nodes (:mod:`supervisor.fleet.registry`).

=======  ============================  ==========================================
method   path                          what
=======  ============================  ==========================================
GET      /v1/nodes                     every node (see ``Node.view``)
GET      /v1/nodes/{id}                one node, with each GPU's gauges and the host's;
                                       404 when unknown
POST     /v1/nodes/{id}/drain          body ``{"reason": "..."}``
POST     /v1/nodes/{id}/undrain        body ``{"force": false}``; 409 while sick
POST     /v1/nodes/{id}/ping           round trip of a command to the agent
=======  ============================  ==========================================

Each node's view carries the jobs that hold it, whether it is a spare, and its
:func:`gauge_summary` (made once per heartbeat, not per request). The listing keeps
each node's entry encoded until something it shows changes (:class:`_Entry`), its last
heartbeat's time and gauges put in apart: at 2,048 nodes building and encoding every
view took 110-130 ms a request, on the event loop.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from phalanx import wire
from phalanx.http import json_response
from phalanx.jsonenc import dumps
from supervisor.api.backend import Backend
from supervisor.api.handlers import body, error
from supervisor.fleet.registry import GPU_GAUGES, Gauges, Node


def gauge_summary(gauges: Gauges) -> dict[str, Any]:
    """A node's GPU gauges in a few numbers (the hottest GPU, ECC and retired pages
    summed over its GPUs, the GPUs throttled): what a fleet view of thousands shows.
    Read off the flat tuple (each GPU's fields one after the other), not per GPU's dict:
    at 2,048 nodes the listing made 400 nodes' summaries a request (issue 22)."""
    flat, n = gauges.gpus, len(GPU_GAUGES)

    def column(field: str) -> list[Any]:
        return [v for v in flat[_AT[field] :: n] if v is not None]

    def total(field: str) -> int | None:
        values = column(field)
        return sum(values) if values else None

    temps = column("temperature_c")
    return {
        "temperature_max_c": max(temps) if temps else None,
        "ecc_sbe_volatile": total("ecc_sbe_volatile"),
        "ecc_dbe_volatile": total("ecc_dbe_volatile"),
        "retired_pages": total("retired_pages"),
        "throttled_gpus": [
            index
            for index, throttle in zip(flat[_AT["index"] :: n], flat[n - 1 :: n], strict=True)
            if throttle
        ],
    }


_AT = {field: i for i, field in enumerate(GPU_GAUGES)}  # a field's place in a GPU's run
assert GPU_GAUGES[-1] == "throttle"  # last: Gauges.of puts its tuple there


def add_node_routes(app: web.Application, sup: Backend) -> None:
    def jobs_by_node() -> dict[str, list[str]]:
        """Each node's jobs that hold it, looked up once for a whole listing (per node it
        was a scan of every job's nodes: quadratic in the fleet, issue 22)."""
        held: dict[str, list[str]] = {}
        for j in sup.jobs.jobs.values():
            if j.state.holds_nodes:
                for node in set(j.nodes):
                    held.setdefault(node, []).append(j.id)
        return held

    # Each node's gauge summary, and it encoded, made once per heartbeat (its gauges)
    # when asked for, not per request.
    gauges_of: dict[str, tuple[Gauges, dict[str, Any], bytes]] = {}

    def summary(n: Node) -> tuple[Gauges, dict[str, Any], bytes]:
        seen = gauges_of.get(n.id)
        if seen is None or seen[0] is not n.gauges:  # a new heartbeat since
            made = gauge_summary(n.gauges)
            seen = gauges_of[n.id] = (n.gauges, made, dumps(made))
        return seen

    def node_view(
        n: Node, *, gauges: bool = False, held: dict[str, list[str]] | None = None
    ) -> dict[str, Any]:
        view = n.view()
        view["jobs"] = sorted((held if held is not None else jobs_by_node()).get(n.id, []))
        view["spare"] = n.id in sup.jobs.spares
        view["gauges"] = dict(summary(n)[1])
        if gauges:  # one node: every GPU's numbers, and the host's
            view["gpu_gauges"] = n.gauges.gpu_dicts()
            view["host"] = n.gauges.host_dict()
        return view

    # node -> its listing's entry, kept meanwhile (see :class:`_Entry`).
    entries: dict[str, _Entry] = {}

    async def nodes(request: web.Request) -> web.Response:
        held = jobs_by_node()
        spares = set(sup.jobs.spares)
        parts: list[bytes] = []
        for node_id, n in sorted(sup.registry.nodes.items()):
            entry = entries.get(node_id)
            if entry is None:
                entry = entries[node_id] = _Entry()
            shows = _listed(n, sorted(held.get(node_id, [])), node_id in spares)
            if entry.shows != shows:
                entry.rest(shows, node_view(n, held=held))
            parts.append(entry.encoded(n.last_seen_wall, summary(n)[2]))
        for gone in entries.keys() - sup.registry.nodes.keys():
            del entries[gone]
        return web.Response(body=b"[" + b",".join(parts) + b"]", content_type="application/json")

    async def node(request: web.Request) -> web.Response:
        found = sup.registry.get(request.match_info["id"])
        return json_response(node_view(found, gauges=True))

    async def drain(request: web.Request) -> web.Response:
        data = await body(request)
        reason = data.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return error(400, "field 'reason': a drain needs a non-empty reason")
        return json_response(sup.registry.drain(request.match_info["id"], reason).view())

    async def undrain(request: web.Request) -> web.Response:
        data = await body(request)
        force = data.get("force", False)
        if not isinstance(force, bool):
            return error(400, "field 'force': must be true or false")
        return json_response(sup.registry.undrain(request.match_info["id"], force=force).view())

    async def ping(request: web.Request) -> web.Response:
        try:
            ack = await sup.commands.send(request.match_info["id"], wire.PingArgs())
        except ConnectionError as exc:  # the broker is unreachable
            return error(503, str(exc))
        return json_response(ack.model_dump(mode="json"))

    app.router.add_get("/v1/nodes", nodes)
    app.router.add_get("/v1/nodes/{id}", node)
    app.router.add_post("/v1/nodes/{id}/drain", drain)
    app.router.add_post("/v1/nodes/{id}/undrain", undrain)
    app.router.add_post("/v1/nodes/{id}/ping", ping)


def _listed(n: Node, jobs: list[str], spare: bool) -> tuple[Any, ...]:
    """Everything a node's listed view is made of (``Node.view`` and the route's own
    fields) but what each heartbeat changes (its time, the gauges): equal tuples, equal
    views but those. The health, birth and slow-node record are compared by value only
    when they are not the same objects."""
    d = n.drain
    return (
        n.online,
        n.offline_cause,
        n.birth_seq,
        (d.by, d.reason, d.since, tuple(d.codes)) if d is not None else None,
        n.health,
        n.birth,
        n.slow,
        tuple(jobs),
        spare,
    )


class _Entry:
    """A node's entry of the listing, encoded and kept until something it shows changes:
    the rest of its view (:func:`_listed`) encoded once, the heartbeat's time and gauge
    summary put after it. At 2,048 nodes building and encoding every view took 110-130 ms
    a request; kept whole, the entries of the nodes heard since the last request (a
    fifth of the fleet a second) were built and encoded again, 16 ms a request of the
    loaded supervisor's loop (issue 22)."""

    __slots__ = ("body", "head", "heard", "shows", "summary")

    def __init__(self) -> None:
        self.shows: tuple[Any, ...] | None = None
        self.head = b""  # the view but "last_seen" and "gauges", up to its closing brace
        self.heard: float | None = None
        self.summary: bytes | None = None  # the gauge summary in ``body``, made per heartbeat
        self.body = b""

    def rest(self, shows: tuple[Any, ...], view: dict[str, Any]) -> None:
        """What the node's view shows now but its heartbeat's figures (which it drops)."""
        del view["last_seen"], view["gauges"]
        self.shows = shows
        self.head = dumps(view)[:-1] + b',"last_seen":'
        self.heard = None

    def encoded(self, heard: float, summary: bytes) -> bytes:
        """The whole entry, with the last heartbeat's time and gauge summary (encoded)."""
        if heard != self.heard or summary is not self.summary:
            self.body = self.head + dumps(heard or None) + b',"gauges":' + summary + b"}"
            self.heard, self.summary = heard, summary
        return self.body
