"""Who a REST request is, and whether it may do what it asks: the API's access check.

:meth:`Access.check` runs before every handler. It authenticates the request by its
bearer token or the dashboard's session cookie (:mod:`supervisor.auth.tokens`,
:mod:`supervisor.dashboard.session`), maps its route to an :class:`~supervisor.auth.roles.Action`
(:data:`RULES`: every route has one; a test walks the router), and asks the pure
:func:`supervisor.auth.roles.decide`. A job's route is checked against the job's team; a
submission is checked by its handler once the spec's team is known (:meth:`require`).

A refusal is :class:`~supervisor.errors.Forbidden` (403) naming the token, what it asked
and what it lacks, and is recorded as an ``auth_denied`` event (the token's id and name,
never its secret). So that a client repeating a refused request cannot flood the event
log, identical denials (same token, route, target) within :data:`DENIAL_WINDOW_S` are
coalesced: the first is recorded, the next one after the window carries ``repeats``, the
count of those left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from supervisor.auth.roles import Action, decide, describe
from supervisor.auth.tokens import Principal, Tokens
from supervisor.dashboard.session import CSRF_HEADER, csrf_ok, session_of
from supervisor.errors import Forbidden, Unauthorized
from supervisor.store import Store

log = logging.getLogger(__name__)

DENIAL_WINDOW_S = 60.0  # identical denials within this are one event
MAX_DENIAL_KEYS = 4096  # denials remembered for coalescing; the oldest are forgotten
PRINCIPAL = web.RequestKey("phalanx_principal", Principal)


@dataclass(frozen=True)
class Rule:
    action: Action
    job: bool = False  # the route's {id} is a job, whose team the action is checked against


# Every route of the API, by method and path (a GET route's HEAD too), and its action.
RULES: dict[tuple[str, str], Rule] = {
    ("GET", "/healthz"): Rule(Action.PUBLIC),
    ("GET", "/v1/leader"): Rule(Action.PUBLIC),
    ("GET", "/"): Rule(Action.PUBLIC),
    ("GET", "/ui"): Rule(Action.PUBLIC),
    ("GET", "/ui/"): Rule(Action.PUBLIC),
    ("GET", "/ui/static/{path}"): Rule(Action.PUBLIC),
    ("POST", "/ui/login"): Rule(Action.PUBLIC),
    ("POST", "/ui/logout"): Rule(Action.PUBLIC),
    ("GET", "/metrics"): Rule(Action.READ),
    ("GET", "/v1/whoami"): Rule(Action.READ),
    ("GET", "/v1/nodes"): Rule(Action.READ),
    ("GET", "/v1/nodes/{id}"): Rule(Action.READ),
    ("POST", "/v1/nodes/{id}/drain"): Rule(Action.MANAGE_NODES),
    ("POST", "/v1/nodes/{id}/undrain"): Rule(Action.MANAGE_NODES),
    ("POST", "/v1/nodes/{id}/ping"): Rule(Action.MANAGE_NODES),
    ("GET", "/v1/events"): Rule(Action.READ),
    ("GET", "/v1/stats"): Rule(Action.READ),
    ("POST", "/v1/jobs"): Rule(Action.SUBMIT),  # the team: checked by the handler
    ("GET", "/v1/jobs"): Rule(Action.READ),
    ("GET", "/v1/jobs/{id}"): Rule(Action.READ),
    ("POST", "/v1/jobs/{id}/cancel"): Rule(Action.CANCEL, job=True),
    ("GET", "/v1/jobs/{id}/logs"): Rule(Action.READ_LOGS, job=True),
    ("GET", "/v1/jobs/{id}/checkpoints"): Rule(Action.READ),
    ("GET", "/v1/jobs/{id}/metrics"): Rule(Action.READ),
    # A sweep's team is checked by the handlers of submit and cancel (supervisor.sweeps).
    ("POST", "/v1/sweeps"): Rule(Action.SUBMIT),
    ("GET", "/v1/sweeps"): Rule(Action.READ),
    ("GET", "/v1/sweeps/{id}"): Rule(Action.READ),
    ("POST", "/v1/sweeps/{id}/cancel"): Rule(Action.CANCEL),
    ("POST", "/v1/tokens"): Rule(Action.MANAGE_TOKENS),
    ("GET", "/v1/tokens"): Rule(Action.MANAGE_TOKENS),
    ("POST", "/v1/tokens/{id}/revoke"): Rule(Action.MANAGE_TOKENS),
}


def rule_of(method: str, path: str) -> Rule | None:
    """The rule of a route (``path``: its resource's canonical form)."""
    return RULES.get(("GET" if method == "HEAD" else method, path))


class Access:
    """The access check of one app: ``tokens`` to authenticate, ``store`` for the
    ``auth_denied`` events, ``job_team``: a job id to its team (``UnknownJob`` if none)."""

    def __init__(
        self,
        tokens: Tokens,
        store: Store,
        job_team: Callable[[str], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokens = tokens
        self._store = store
        self._job_team = job_team
        self._clock = clock
        self._denied: dict[tuple[str, ...], list[float]] = {}  # key: [since, left out]

    def authenticate(self, request: web.Request) -> Principal:
        """The request's token, by its bearer header or else its session cookie;
        :class:`Unauthorized` naming why not (a change by cookie without the CSRF header
        is :class:`Forbidden`)."""
        given = request.headers.get("Authorization", "")
        if given:
            if not given.startswith("Bearer "):
                raise Unauthorized("the Authorization header must be 'Bearer <token>'")
            return self.tokens.authenticate(given[7:])
        try:
            who = session_of(request, self.tokens.principal)
        except Unauthorized as exc:
            raise Unauthorized(f"the dashboard's session ended: {exc}") from None
        if who is None:
            raise Unauthorized("missing or wrong bearer token (PHALANX_TOKEN) or session")
        if not csrf_ok(request):
            raise Forbidden(
                f"a change by the dashboard's session needs {CSRF_HEADER}: 1",
                action="change by session",
                needs=f"header {CSRF_HEADER}",
                target=None,
            )
        return who

    def check(self, request: web.Request) -> Principal | None:
        """Authenticate and authorize ``request`` by its route's rule; None for a public
        route. Raises :class:`Unauthorized`, :class:`Forbidden`, or ``UnknownJob`` for a
        job's route naming no known job."""
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else request.path
        rule = rule_of(request.method, path)
        if rule is not None and rule.action is Action.PUBLIC:
            return None
        who = self.authenticate(request)
        request[PRINCIPAL] = who
        if rule is None:  # a route added without a rule: refused, never open
            log.error("API route %s %s has no access rule", request.method, path)
            self.refuse(request, who, Action.MANAGE_TOKENS, None, f"{request.method} {path}")
            return who
        if rule.job:
            job = request.match_info["id"]
            team = self._job_team(job)
            self.require(request, rule.action, team, f"job {job} of team {team}", job=job)
        elif rule.action is Action.SUBMIT:  # the spec's team: its handler checks that
            self.require(request, rule.action, None, "a job")
        else:
            self.require(request, rule.action, None, None)
        return who

    def require(
        self,
        request: web.Request,
        action: Action,
        team: str | None,
        what: str | None,
        *,
        job: str | None = None,
    ) -> None:
        """:class:`Forbidden` (recorded) unless the request's token may do ``action`` on
        something of ``team``; ``what``: that thing in words (``job j-1 of team nlp``)."""
        who = request[PRINCIPAL]
        if decide(who.role, who.team, action, team) is not None:
            self.refuse(request, who, action, team, what, job=job)

    def refuse(
        self,
        request: web.Request,
        who: Principal,
        action: Action,
        team: str | None,
        what: str | None,
        *,
        job: str | None = None,
    ) -> None:
        needs = decide(who.role, who.team, action, team) or "no rule for this route"
        asked = f"{action}{f' {what}' if what else ''}"
        message = f"{describe(who.name, who.role, who.team)} cannot {asked}: {needs}"
        self._record(request, who, asked, needs, job)
        raise Forbidden(message, action=action.value, needs=needs, target=what)

    def _record(
        self, request: web.Request, who: Principal, asked: str, needs: str, job: str | None
    ) -> None:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else request.path
        key = (who.id, request.method, route, asked)
        now = self._clock()
        seen = self._denied.get(key)
        if seen is not None and now - seen[0] < DENIAL_WINDOW_S:
            seen[1] += 1
            return
        repeats = int(seen[1]) if seen is not None else 0
        self._denied.pop(key, None)
        while len(self._denied) >= MAX_DENIAL_KEYS:
            self._denied.pop(next(iter(self._denied)))
        self._denied[key] = [now, 0]
        detail: dict[str, Any] = {
            "token": who.id,
            "name": who.name,
            "role": who.role.value,
            "team": who.team,
            "method": request.method,
            "path": request.path[:256],
            "asked": asked,
            "needs": needs,
        }
        if job is not None:
            detail["job"] = job
        if repeats:
            detail["repeats"] = repeats
        self._store.add_event("auth_denied", None, detail)
        log.warning("API %s %s refused: token %s %s", request.method, route, who.id, needs)
