"""Who may do what through the REST API: a pure decision, no I/O.

A token has a :class:`Role`, and a member's token a team. Each route of the API is one
:class:`Action` (:mod:`supervisor.api.access` maps them); an action on a job (cancel, read
its logs, submit one) also names the job's team. :func:`decide` answers None (allowed)
or what the token lacks, in words an operator can act on.

=========  ==============================================================================
role       may
=========  ==============================================================================
viewer     read everything but rank logs (a rank's output may print a secret: an API key,
           a password from the environment), and the token list (admin only)
member     what a viewer may, and for its own team: submit jobs, cancel them, read their
           logs. A member token always has a team.
operator   what a viewer may, and drain, undrain and ping nodes, cancel any job, read any
           job's logs, submit for any team
admin      everything, managing tokens included (the bootstrap token of ``api.token_file``
           is an admin)
=========  ==============================================================================
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    VIEWER = "viewer"
    MEMBER = "member"
    OPERATOR = "operator"
    ADMIN = "admin"


class Action(enum.StrEnum):
    PUBLIC = "public"  # the health check, the dashboard's page, assets, login, logout
    READ = "read"  # every GET but logs and tokens; /metrics and whoami too
    READ_LOGS = "read logs of"  # a job's rank logs (of a team)
    SUBMIT = "submit"  # a job (for a team)
    CANCEL = "cancel"  # a job (of a team)
    MANAGE_NODES = "drain, undrain or ping nodes"
    MANAGE_TOKENS = "manage tokens"


# Actions on a job of a team: a member may do them for its own team.
TEAM_ACTIONS = frozenset({Action.READ_LOGS, Action.SUBMIT, Action.CANCEL})

# What each role may do whatever the team.
_ANY_TEAM: dict[Role, frozenset[Action]] = {
    Role.VIEWER: frozenset({Action.PUBLIC, Action.READ}),
    Role.MEMBER: frozenset({Action.PUBLIC, Action.READ}),
    Role.OPERATOR: frozenset(
        {
            Action.PUBLIC,
            Action.READ,
            Action.READ_LOGS,
            Action.SUBMIT,
            Action.CANCEL,
            Action.MANAGE_NODES,
        }
    ),
    Role.ADMIN: frozenset(Action),
}


def decide(role: Role, team: str | None, action: Action, target: str | None = None) -> str | None:
    """None when a token of ``role`` (of ``team``) may do ``action`` on something of the
    team ``target`` (a job's; None for an action on no team, or a team not known yet);
    else what it needs, e.g. ``"needs role operator, or member of team vision"``."""
    if action in _ANY_TEAM[role]:
        return None
    if (
        role is Role.MEMBER
        and action in TEAM_ACTIONS
        and team is not None
        and (target is None or target == team)
    ):
        return None
    lowest = min_role(action)
    if action in TEAM_ACTIONS and target is not None:
        return f"needs role {lowest}, or member of team {target}"
    return f"needs role {lowest}"


def min_role(action: Action) -> Role:
    """The least role that may do ``action`` on any team."""
    return next(r for r in (Role.VIEWER, Role.OPERATOR, Role.ADMIN) if action in _ANY_TEAM[r])


def describe(name: str, role: Role, team: str | None) -> str:
    """A token as a denial names it: ``token 'alice' (member of team nlp)``."""
    what = f"{role} of team {team}" if team is not None else str(role)
    return f"token {name!r} ({what})"
