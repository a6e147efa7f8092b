"""API tokens with roles and teams (issue 16): an admin creates, lists and revokes them;
each role may do what ``supervisor.auth.roles`` says and is refused the rest with a 403 naming
what it lacks, recorded as an ``auth_denied`` event; a spec without a team takes the
token's; a dashboard session has its token's rights and ends with it.

The real app (``supervisor.api.app.make_app``) of the real supervisor and its real SQLite
store, built but never started (no broker), on aiohttp's test server.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from phalanx.jobspec import validate_spec
from supervisor.api import access
from supervisor.api.access import RULES, rule_of
from supervisor.api.app import make_app
from supervisor.auth.roles import Role
from supervisor.auth.tokens import Principal, TokenRequest, Tokens
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.dashboard.session import COOKIE, session_of, session_value
from tests.unit.supervisor.fake_fleet import birth

TOKEN = "bootstrap-token-0123456789abcdef"
CSRF = {"X-Phalanx-CSRF": "1"}
SPEC: dict[str, Any] = {
    "name": "train",
    "command": ["python", "train.py"],
    "workdir": "/work",
    "nodes": 1,
    "ranks_per_node": 1,
}
SECRET = re.compile(r"^phx_t[0-9]+_[A-Za-z0-9_-]{43}$")


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


ADMIN = bearer(TOKEN)


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    built = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    built.registry.on_birth(birth("n1"))
    yield built
    built.store.close()


@pytest.fixture
async def client(sup: Supervisor) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(make_app(sup))) as c:
        yield c


async def make_token(client: TestClient[Any, Any], **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/tokens", json=body, headers=ADMIN)
    assert resp.status == 201, await resp.text()
    made: dict[str, Any] = await resp.json()
    return made


def job_of(sup: Supervisor, team: str) -> str:
    return sup.jobs.submit(validate_spec({**SPEC, "team": team})).id


def denials(sup: Supervisor) -> list[dict[str, Any]]:
    return [e.detail for e in sup.store.events(limit=1000) if e.kind == "auth_denied"]


# --- every route has a rule -------------------------------------------------------------


def test_every_route_of_the_api_has_an_access_rule(sup: Supervisor) -> None:
    app = make_app(sup)

    missing = [
        f"{r.method} {r.resource.canonical}"
        for r in app.router.routes()
        if r.resource is not None and rule_of(r.method, r.resource.canonical) is None
    ]

    assert missing == []


def test_every_access_rule_is_of_a_route_the_api_has(sup: Supervisor) -> None:
    app = make_app(sup)
    routes = {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.resource is not None and r.method != "HEAD"
    }

    assert set(RULES) - routes == set()


# --- create, list, revoke ---------------------------------------------------------------


async def test_an_admin_creates_a_token_and_its_secret_is_shown_once(
    client: TestClient[Any, Any],
) -> None:
    made = await make_token(client, role="member", team="nlp", name="alice", expires="30d")

    assert SECRET.match(made["secret"])
    assert "cannot be shown again" in made["note"]
    assert (made["id"], made["name"], made["role"], made["team"]) == (
        "t1",
        "alice",
        "member",
        "nlp",
    )
    assert made["expires_at"] == pytest.approx(time.time() + 30 * 86400, abs=60)
    listed = await (await client.get("/v1/tokens", headers=ADMIN)).json()
    assert [t["id"] for t in listed] == ["t1"]
    assert made["secret"] not in str(listed)
    assert not {"secret", "secret_sha256", "key"} & set(listed[0])


async def test_the_store_holds_a_tokens_hash_never_its_secret(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    made = await make_token(client, role="viewer")
    secret = made["secret"].encode()

    on_disk = b"".join(p.read_bytes() for p in sup.store.path.parent.glob("state.db*"))

    assert secret not in on_disk
    random_part = made["secret"].split("_", 2)[2]  # phx_<id>_<random>; the random part may hold "_"
    assert random_part.encode() not in on_disk


async def test_a_created_token_answers_whoami_with_its_role_team_and_expiry(
    client: TestClient[Any, Any],
) -> None:
    made = await make_token(client, role="member", team="nlp", name="alice", expires="1d")

    me = await (await client.get("/v1/whoami", headers=bearer(made["secret"]))).json()

    assert me == {
        "id": "t1",
        "name": "alice",
        "role": "member",
        "team": "nlp",
        "expires_at": made["expires_at"],
    }


async def test_the_bootstrap_token_is_an_admin_with_no_team(client: TestClient[Any, Any]) -> None:
    me = await (await client.get("/v1/whoami", headers=ADMIN)).json()

    assert (me["id"], me["role"], me["team"]) == ("bootstrap", "admin", None)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"role": "member"}, "team"),
        ({"role": "root"}, "role"),
        ({"role": "viewer", "expires": "forever"}, "expires"),
        ({"role": "viewer", "team": "a b"}, "team"),
        ({"role": "viewer", "secret": "mine"}, "secret"),
    ],
    ids=["member-without-team", "unknown-role", "bad-expiry", "bad-team", "unknown-field"],
)
async def test_a_bad_token_request_is_a_400_naming_the_field(
    client: TestClient[Any, Any], body: dict[str, Any], field: str
) -> None:
    resp = await client.post("/v1/tokens", json=body, headers=ADMIN)

    assert resp.status == 400
    assert f"field '{field}'" in (await resp.json())["error"]


async def test_a_revoked_token_is_a_401_saying_when_it_was_revoked(
    client: TestClient[Any, Any],
) -> None:
    made = await make_token(client, role="operator")

    revoked = await client.post("/v1/tokens/t1/revoke", headers=ADMIN)
    resp = await client.get("/v1/nodes", headers=bearer(made["secret"]))

    assert revoked.status == 200
    assert (await revoked.json())["state"] == "revoked"
    assert resp.status == 401
    assert re.match(r"token t1 was revoked at \d{4}-", (await resp.json())["error"])


async def test_revoking_a_revoked_token_is_refused_and_an_unknown_one_not_found(
    client: TestClient[Any, Any],
) -> None:
    await make_token(client, role="viewer")
    await client.post("/v1/tokens/t1/revoke", headers=ADMIN)

    again = await client.post("/v1/tokens/t1/revoke", headers=ADMIN)
    unknown = await client.post("/v1/tokens/t9/revoke", headers=ADMIN)

    assert again.status == 409
    assert unknown.status == 404
    assert "t9" in (await unknown.json())["error"]


async def test_the_bootstrap_token_cannot_be_revoked_through_the_api(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.post("/v1/tokens/bootstrap/revoke", headers=ADMIN)

    assert resp.status == 409
    assert "api.token_file" in (await resp.json())["error"]


async def test_an_expired_token_is_a_401_saying_when_it_expired(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    # Made a day ago, valid for an hour: the clock of its making is the past.
    past = Tokens(sup.store, TOKEN, clock=lambda: time.time() - 86400)
    _, secret = past.create(TokenRequest(role=Role.VIEWER, expires=3600), past.bootstrap)

    resp = await client.get("/v1/jobs", headers=bearer(secret))

    assert resp.status == 401
    assert re.match(r"token t1 expired at \d{4}-", (await resp.json())["error"])
    listed = await (await client.get("/v1/tokens", headers=ADMIN)).json()
    assert listed[0]["state"] == "expired"


async def test_a_made_up_secret_of_a_real_id_is_a_401(client: TestClient[Any, Any]) -> None:
    await make_token(client, role="admin")

    resp = await client.get("/v1/nodes", headers=bearer("phx_t1_" + "A" * 43))

    assert resp.status == 401


# --- roles ------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["viewer", "member", "operator"])
async def test_no_role_but_admin_may_manage_tokens(client: TestClient[Any, Any], role: str) -> None:
    made = await make_token(client, role=role, team="nlp", name="someone")

    resp = await client.post("/v1/tokens", json={"role": "admin"}, headers=bearer(made["secret"]))

    assert resp.status == 403
    assert (await resp.json())["error"].endswith("cannot manage tokens: needs role admin")


@pytest.mark.parametrize(
    "path", ["/v1/nodes", "/v1/nodes/n1", "/v1/jobs", "/v1/events", "/v1/stats", "/metrics"]
)
async def test_a_viewer_reads_the_fleet_and_prometheus(
    client: TestClient[Any, Any], path: str
) -> None:
    viewer = await make_token(client, role="viewer")

    resp = await client.get(path, headers=bearer(viewer["secret"]))

    assert resp.status == 200


async def test_a_viewer_may_not_drain_and_the_refusal_is_an_event_without_the_secret(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    viewer = await make_token(client, role="viewer", name="dash")

    resp = await client.post(
        "/v1/nodes/n1/drain", json={"reason": "x"}, headers=bearer(viewer["secret"])
    )

    assert resp.status == 403
    assert (await resp.json())["error"] == (
        "token 'dash' (viewer) cannot drain, undrain or ping nodes: needs role operator"
    )
    assert sup.registry.nodes["n1"].drain is None
    [event] = denials(sup)
    assert event["token"] == "t1"
    assert event["name"] == "dash"
    assert event["method"] == "POST"
    assert event["path"] == "/v1/nodes/n1/drain"
    assert event["needs"] == "needs role operator"
    assert viewer["secret"] not in str(sup.store.events(limit=1000))


async def test_a_viewer_may_not_read_rank_logs(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    viewer = await make_token(client, role="viewer")
    job = job_of(sup, "nlp")

    resp = await client.get(f"/v1/jobs/{job}/logs", headers=bearer(viewer["secret"]))

    assert resp.status == 403
    assert f"cannot read logs of job {job} of team nlp" in (await resp.json())["error"]


async def test_a_member_may_not_cancel_another_teams_job(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    alice = await make_token(client, role="member", team="nlp", name="alice")
    job = job_of(sup, "vision")

    resp = await client.post(f"/v1/jobs/{job}/cancel", headers=bearer(alice["secret"]))

    assert resp.status == 403
    assert (await resp.json())["error"] == (
        f"token 'alice' (member of team nlp) cannot cancel job {job} of team vision: "
        "needs role operator, or member of team vision"
    )
    assert sup.jobs.get(job).state.value == "pending"
    [event] = denials(sup)
    assert event["job"] == job


async def test_a_member_cancels_its_own_teams_job(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    alice = await make_token(client, role="member", team="nlp")
    job = job_of(sup, "nlp")

    resp = await client.post(f"/v1/jobs/{job}/cancel", headers=bearer(alice["secret"]))

    assert resp.status == 200
    assert (await resp.json())["state"] == "cancelled"


async def test_a_member_may_not_read_another_teams_logs_but_reaches_its_own(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    alice = await make_token(client, role="member", team="nlp")
    own, other = job_of(sup, "nlp"), job_of(sup, "vision")

    theirs = await client.get(f"/v1/jobs/{other}/logs", headers=bearer(alice["secret"]))
    ours = await client.get(f"/v1/jobs/{own}/logs", headers=bearer(alice["secret"]))

    assert theirs.status == 403
    assert ours.status == 404  # allowed: the pending job has no rank placed yet
    assert "has no rank 0 placed" in (await ours.json())["error"]


async def test_a_member_may_not_drain_nodes(client: TestClient[Any, Any]) -> None:
    alice = await make_token(client, role="member", team="nlp")

    resp = await client.post("/v1/nodes/n1/undrain", json={}, headers=bearer(alice["secret"]))

    assert resp.status == 403


async def test_an_operator_drains_nodes_and_cancels_any_teams_job(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    ops = await make_token(client, role="operator")
    job = job_of(sup, "vision")

    drained = await client.post(
        "/v1/nodes/n1/drain", json={"reason": "cable"}, headers=bearer(ops["secret"])
    )
    cancelled = await client.post(f"/v1/jobs/{job}/cancel", headers=bearer(ops["secret"]))

    assert drained.status == 200
    assert cancelled.status == 200


async def test_an_operator_may_not_manage_tokens(client: TestClient[Any, Any]) -> None:
    ops = await make_token(client, role="operator")

    resp = await client.get("/v1/tokens", headers=bearer(ops["secret"]))

    assert resp.status == 403


async def test_identical_denials_are_one_event(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    viewer = await make_token(client, role="viewer")

    for _ in range(5):
        resp = await client.get("/v1/tokens", headers=bearer(viewer["secret"]))
        assert resp.status == 403

    assert len(denials(sup)) == 1


async def test_the_first_denial_after_the_window_counts_those_left_out(
    client: TestClient[Any, Any], sup: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    viewer = await make_token(client, role="viewer")
    for _ in range(3):
        await client.get("/v1/tokens", headers=bearer(viewer["secret"]))
    monkeypatch.setattr(access, "DENIAL_WINDOW_S", 0.0)  # the window has passed

    await client.get("/v1/tokens", headers=bearer(viewer["secret"]))

    assert [e.get("repeats") for e in denials(sup)] == [None, 2]


# --- submit -----------------------------------------------------------------------------


async def test_a_members_spec_without_a_team_takes_the_tokens_team(
    client: TestClient[Any, Any],
) -> None:
    alice = await make_token(client, role="member", team="nlp")

    resp = await client.post("/v1/jobs", json={"spec": SPEC}, headers=bearer(alice["secret"]))

    assert resp.status == 201
    assert (await resp.json())["team"] == "nlp"


async def test_a_member_may_not_submit_for_another_team(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    alice = await make_token(client, role="member", team="nlp", name="alice")

    resp = await client.post(
        "/v1/jobs", json={"spec": {**SPEC, "team": "vision"}}, headers=bearer(alice["secret"])
    )

    assert resp.status == 403
    assert (await resp.json())["error"] == (
        "token 'alice' (member of team nlp) cannot submit a job for team vision: "
        "needs role operator, or member of team vision"
    )
    assert sup.jobs.jobs == {}


async def test_a_spec_without_a_team_from_a_token_without_one_is_a_400_naming_team(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.post("/v1/jobs", json={"spec": SPEC}, headers=ADMIN)

    assert resp.status == 400
    assert [f["field"] for f in (await resp.json())["fields"]] == ["team"]


async def test_an_operator_submits_for_any_team(client: TestClient[Any, Any]) -> None:
    ops = await make_token(client, role="operator", team="infra")

    resp = await client.post(
        "/v1/jobs", json={"spec": {**SPEC, "team": "vision"}}, headers=bearer(ops["secret"])
    )

    assert resp.status == 201
    assert (await resp.json())["team"] == "vision"


async def test_a_viewer_may_not_submit(client: TestClient[Any, Any]) -> None:
    viewer = await make_token(client, role="viewer", team="nlp")

    resp = await client.post(
        "/v1/jobs", json={"spec": {**SPEC, "team": "nlp"}}, headers=bearer(viewer["secret"])
    )

    assert resp.status == 403
    assert "cannot submit a job" in (await resp.json())["error"]


# --- the dashboard ----------------------------------------------------------------------


async def test_a_dashboard_session_has_its_tokens_rights(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    viewer = await make_token(client, role="viewer", name="wall")
    job = job_of(sup, "nlp")

    login = await client.post("/ui/login", json={"token": viewer["secret"]}, headers=CSRF)
    me = await (await client.get("/v1/whoami")).json()
    cancel = await client.post(f"/v1/jobs/{job}/cancel", headers=CSRF)

    assert login.status == 200
    assert client.session.cookie_jar.filter_cookies(client.make_url("/"))[COOKIE].value.startswith(
        "v2.t1."
    )
    assert me["name"] == "wall"
    assert cancel.status == 403
    assert "token 'wall' (viewer) cannot cancel" in (await cancel.json())["error"]


async def test_revoking_a_token_ends_its_dashboard_sessions(client: TestClient[Any, Any]) -> None:
    ops = await make_token(client, role="operator")
    await client.post("/ui/login", json={"token": ops["secret"]}, headers=CSRF)
    before = await client.get("/v1/nodes")

    await client.post("/v1/tokens/t1/revoke", headers=ADMIN)
    after = await client.get("/v1/nodes")

    assert before.status == 200
    assert after.status == 401
    assert "session ended: token t1 was revoked" in (await after.json())["error"]


async def test_a_login_with_a_revoked_token_is_a_401_saying_so(
    client: TestClient[Any, Any],
) -> None:
    viewer = await make_token(client, role="viewer")
    await client.post("/v1/tokens/t1/revoke", headers=ADMIN)

    resp = await client.post("/ui/login", json={"token": viewer["secret"]}, headers=CSRF)

    assert resp.status == 401
    assert "revoked" in (await resp.json())["error"]
    assert COOKIE not in resp.cookies


def test_a_session_cookie_made_for_one_token_is_not_valid_for_another(sup: Supervisor) -> None:
    tokens = Tokens(sup.store, TOKEN)
    _, secret = tokens.create(TokenRequest(role=Role.VIEWER), tokens.bootstrap)
    viewer = tokens.authenticate(secret)
    forged = Principal(
        id="bootstrap", name="x", role=Role.ADMIN, key=viewer.key, session_key=viewer.session_key
    )

    value = session_value(forged)  # the viewer's key, the bootstrap's id
    request = make_mocked_request("GET", "/v1/nodes", headers={"Cookie": f"{COOKIE}={value}"})

    assert session_of(request, tokens.principal) is None


def test_a_session_cannot_be_forged_from_what_the_store_holds(sup: Supervisor) -> None:
    tokens = Tokens(sup.store, TOKEN)
    _, secret = tokens.create(TokenRequest(role=Role.ADMIN), tokens.bootstrap)
    admin = tokens.authenticate(secret)
    # A reader of state.db has the token's id and stored hash, not the bootstrap token.
    from_store = Principal(
        id=admin.id, name=admin.name, role=admin.role, key=admin.key, session_key=admin.key
    )

    value = session_value(from_store)
    request = make_mocked_request("GET", "/v1/nodes", headers={"Cookie": f"{COOKIE}={value}"})

    assert admin.session_key not in (admin.key, "")
    assert session_of(request, tokens.principal) is None
    good = make_mocked_request(
        "GET", "/v1/nodes", headers={"Cookie": f"{COOKIE}={session_value(admin)}"}
    )
    assert session_of(good, tokens.principal) == admin


def test_replacing_the_bootstrap_token_ends_every_session(sup: Supervisor) -> None:
    tokens = Tokens(sup.store, TOKEN)
    _, secret = tokens.create(TokenRequest(role=Role.VIEWER), tokens.bootstrap)
    value = session_value(tokens.authenticate(secret))
    request = make_mocked_request("GET", "/v1/nodes", headers={"Cookie": f"{COOKIE}={value}"})

    assert session_of(request, tokens.principal) is not None
    assert session_of(request, Tokens(sup.store, TOKEN + "-rotated").principal) is None
