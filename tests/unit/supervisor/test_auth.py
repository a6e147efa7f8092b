"""Who may do what (``supervisor.auth.roles.decide``): every role, every action, on a job of
the token's own team, of another team, and on no team."""

from __future__ import annotations

import pytest

from supervisor.auth.roles import Action, Role, decide, describe, min_role

OWN, OTHER = "nlp", "vision"

# (role, action) -> allowed on: (own team's, another team's, no team's)
ALLOWED: dict[tuple[Role, Action], tuple[bool, bool, bool]] = {
    (Role.VIEWER, Action.PUBLIC): (True, True, True),
    (Role.VIEWER, Action.READ): (True, True, True),
    (Role.VIEWER, Action.READ_LOGS): (False, False, False),
    (Role.VIEWER, Action.SUBMIT): (False, False, False),
    (Role.VIEWER, Action.CANCEL): (False, False, False),
    (Role.VIEWER, Action.MANAGE_NODES): (False, False, False),
    (Role.VIEWER, Action.MANAGE_TOKENS): (False, False, False),
    (Role.MEMBER, Action.PUBLIC): (True, True, True),
    (Role.MEMBER, Action.READ): (True, True, True),
    (Role.MEMBER, Action.READ_LOGS): (True, False, True),
    (Role.MEMBER, Action.SUBMIT): (True, False, True),
    (Role.MEMBER, Action.CANCEL): (True, False, True),
    (Role.MEMBER, Action.MANAGE_NODES): (False, False, False),
    (Role.MEMBER, Action.MANAGE_TOKENS): (False, False, False),
    (Role.OPERATOR, Action.PUBLIC): (True, True, True),
    (Role.OPERATOR, Action.READ): (True, True, True),
    (Role.OPERATOR, Action.READ_LOGS): (True, True, True),
    (Role.OPERATOR, Action.SUBMIT): (True, True, True),
    (Role.OPERATOR, Action.CANCEL): (True, True, True),
    (Role.OPERATOR, Action.MANAGE_NODES): (True, True, True),
    (Role.OPERATOR, Action.MANAGE_TOKENS): (False, False, False),
    (Role.ADMIN, Action.PUBLIC): (True, True, True),
    (Role.ADMIN, Action.READ): (True, True, True),
    (Role.ADMIN, Action.READ_LOGS): (True, True, True),
    (Role.ADMIN, Action.SUBMIT): (True, True, True),
    (Role.ADMIN, Action.CANCEL): (True, True, True),
    (Role.ADMIN, Action.MANAGE_NODES): (True, True, True),
    (Role.ADMIN, Action.MANAGE_TOKENS): (True, True, True),
}


def test_the_table_covers_every_role_and_action() -> None:
    assert set(ALLOWED) == {(r, a) for r in Role for a in Action}


@pytest.mark.parametrize(("role", "action"), sorted(ALLOWED))
@pytest.mark.parametrize("token_team", [OWN, None], ids=["with-team", "no-team"])
def test_each_role_may_do_what_the_table_says_on_each_team(
    role: Role, action: Action, token_team: str | None
) -> None:
    own, other, none = ALLOWED[(role, action)]
    if role is Role.MEMBER and token_team is None:  # cannot be made; grants nothing of a team
        own = other = none = action in (Action.PUBLIC, Action.READ)

    assert (decide(role, token_team, action, OWN) is None) == (own if token_team else other)
    assert (decide(role, token_team, action, OTHER) is None) == other
    assert (decide(role, token_team, action, None) is None) == none


def test_a_member_refused_another_teams_job_is_told_both_ways_in() -> None:
    assert (
        decide(Role.MEMBER, OWN, Action.CANCEL, OTHER)
        == "needs role operator, or member of team vision"
    )


@pytest.mark.parametrize(
    ("action", "needs"),
    [
        (Action.MANAGE_TOKENS, "needs role admin"),
        (Action.MANAGE_NODES, "needs role operator"),
        (Action.READ_LOGS, "needs role operator"),
    ],
)
def test_a_refusal_on_no_team_names_the_least_role_that_may(action: Action, needs: str) -> None:
    assert decide(Role.VIEWER, None, action) == needs


def test_the_least_role_of_reading_is_viewer() -> None:
    assert min_role(Action.READ) is Role.VIEWER


def test_a_token_is_described_with_its_role_and_team() -> None:
    assert describe("alice", Role.MEMBER, OWN) == "token 'alice' (member of team nlp)"
    assert describe("ci", Role.VIEWER, None) == "token 'ci' (viewer)"
