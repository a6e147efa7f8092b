"""A standby supervisor: it waits for the lead, and meanwhile points clients at the leader.

While it stands by it holds no state, connects to no broker and sends nothing: it tries
to take the lead every ``ha.poll_s`` (``Leadership.try_lead``), and its API port answers
every request with 503, ``X-Phalanx-Standby: 1`` and the leader's URL in the
``X-Phalanx-Leader`` header (the CLI
follows it; a browser asking for a dashboard page is redirected there), except
``GET /v1/leader``, which says who leads. Once it leads, the standby API stops and
the whole supervisor starts on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from phalanx.http import json_response, serve
from supervisor.config import SupervisorSettings
from supervisor.errors import StoreError
from supervisor.leadership import LEADER_HEADER, STANDBY_HEADER, Leader, Leadership

log = logging.getLogger(__name__)


def leader_view(leader: Leader | None, *, leading: bool, url: str) -> dict[str, object]:
    """What ``GET /v1/leader`` says, on a leader (``leading``) or a standby."""
    return {
        "leading": leading,
        "url": url,  # this supervisor's own
        "leader": leader.api_url if leader is not None else None,
        "term": leader.term if leader is not None else None,
        "holder": leader.holder if leader is not None else None,
        "since": leader.since if leader is not None else None,
    }


def standby_app(leadership: Leadership, known: list[Leader | None]) -> web.Application:
    """The standby's API: ``known[0]`` is the leader as last read (the wait loop reads
    it every poll; a request never waits on PostgreSQL)."""

    async def who(request: web.Request) -> web.Response:
        return json_response(leader_view(known[0], leading=False, url=leadership.api_url))

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        leader = known[0]
        headers = {"Retry-After": "1", STANDBY_HEADER: "1"}
        if leader is not None and leader.api_url != leadership.api_url:
            headers[LEADER_HEADER] = leader.api_url
            wants_page = request.method in ("GET", "HEAD") and not request.path.startswith("/v1/")
            if wants_page and request.path != "/metrics":
                raise web.HTTPTemporaryRedirect(leader.api_url + request.path_qs)
            detail = f"this supervisor stands by; the leader's API is at {leader.api_url}"
        else:
            detail = "this supervisor stands by and no supervisor leads yet; try again shortly"
        return json_response(
            {"error": detail, "leader": headers.get(LEADER_HEADER)}, status=503, headers=headers
        )

    app = web.Application()
    app.router.add_get("/v1/leader", who)
    app.router.add_route("*", "/{tail:.*}", elsewhere)
    return app


@contextlib.asynccontextmanager
async def standby_api(
    settings: SupervisorSettings, leadership: Leadership, known: list[Leader | None]
) -> AsyncIterator[int]:
    api = settings.api
    async with serve(
        standby_app(leadership, known),
        lambda runner: web.TCPSite(runner, api.host, api.port, ssl_context=api.server_ssl()),
        f"standby supervisor API on {api.host}:{api.port}",
        shutdown_timeout=1.0,
    ) as runner:
        yield int(runner.addresses[0][1])


async def wait_for_lead(
    settings: SupervisorSettings,
    leadership: Leadership,
    stop: asyncio.Event,
    *,
    on_lost: Callable[[], None],
    ready: Callable[[str], object] = lambda _status: None,
) -> int | None:
    """Stand by until this supervisor leads: its term, or None if ``stop`` was set first.
    PostgreSQL out of reach is waited out (logged once per outage). The first attempt
    comes before the standby API opens, so that it never answers without naming a
    leader that was there to name; ``ready`` is called once it serves.

    The lease is renewed from the moment the lock is ours (``Leadership.keep``, with
    ``on_lost``), and the new leader waits one ``ha.poll_s`` before it acts: a leader
    whose session ended under it (a server restart, a killed backend) while it ran
    learns so at its next renewal, within that time, and stops."""
    known: list[Leader | None] = [None]
    away = [False]

    async def attempt() -> int | None:
        try:
            term = await asyncio.to_thread(leadership.try_lead)
            if term is not None:
                leadership.keep(on_lost)
                log.info("leading now, term %d (%s)", term, leadership.api_url)
                return term
            known[0] = await asyncio.to_thread(leadership.leader)
            if away[0]:
                log.info("the store is back; standing by")
            away[0] = False
        except StoreError as exc:
            if not away[0]:
                log.error("standing by, the store out of reach: %s", exc)
            away[0] = True
        return None

    term = await attempt()
    if term is None:
        async with standby_api(settings, leadership, known) as port:
            log.info(
                "standing by: API on port %d, trying for the lead every %.1fs",
                port,
                settings.ha.poll_s,
            )
            ready(f"standing by: API on port {port}")
            while term is None and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), settings.ha.poll_s)
                if not stop.is_set():
                    term = await attempt()
    if term is not None and known[0] is not None:
        await asyncio.sleep(settings.ha.poll_s)  # another led: let it find out it lost
    return term
