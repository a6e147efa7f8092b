"""The dashboard beside the REST API: its assets need no token; a login sets a session
cookie the API accepts like the bearer token; a change by cookie needs the CSRF header.

The real app (``supervisor.api.app.make_app``) of the real supervisor, built but never
started (no broker), on aiohttp's test server.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from supervisor.api.app import make_app
from supervisor.auth.rows import TokenRows
from supervisor.auth.tokens import Tokens
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.dashboard.session import COOKIE, SESSION_S, session_value
from tests.unit.supervisor.fake_fleet import birth

TOKEN = "op-token-0123456789abcdef"
CSRF = {"X-Phalanx-CSRF": "1"}
_NO_ROWS = cast(TokenRows, None)  # the bootstrap token needs no store
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    """The real supervisor, built but never started (no broker), knowing node n1."""
    built = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    built.registry.on_birth(birth("n1"))
    yield built
    built.store.close()


@pytest.fixture
async def client(sup: Supervisor) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(make_app(sup))) as c:
        yield c


async def _login(client: TestClient[Any, Any], token: str = TOKEN) -> Any:
    return await client.post("/ui/login", json={"token": token}, headers=CSRF)


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/ui/", "text/html"),
        ("/ui/static/index.html", "text/html"),
        ("/ui/static/js/main.js", "text/javascript"),
        ("/ui/static/app.css", "text/css"),
        ("/ui/static/vendor/uplot/uPlot.iife.min.js", "text/javascript"),
        ("/ui/static/vendor/uplot/uPlot.min.css", "text/css"),
        ("/ui/static/vendor/uplot/LICENSE", "text/plain"),
    ],
)
async def test_the_dashboards_assets_are_served_without_a_token_with_their_content_type(
    client: TestClient[Any, Any], path: str, content_type: str
) -> None:
    resp = await client.get(path)

    assert resp.status == 200
    assert resp.content_type == content_type
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
    assert await resp.read()


async def test_an_unchanged_asset_is_answered_not_modified(client: TestClient[Any, Any]) -> None:
    first = await client.get("/ui/static/js/main.js")

    again = await client.get(
        "/ui/static/js/main.js", headers={"If-None-Match": first.headers["ETag"]}
    )

    assert again.status == 304


async def test_an_unknown_asset_is_not_found(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/ui/static/nothing.js")

    assert resp.status == 404


@pytest.mark.parametrize(
    "path",
    ["/ui/static/../session.py", "/ui/static/%2e%2e/routes.py", "/ui/static/..%2f..%2fapi.py"],
)
async def test_no_file_outside_the_shipped_assets_is_served(
    client: TestClient[Any, Any], path: str
) -> None:
    resp = await client.get(URL(path, encoded=True))

    assert resp.status in (401, 404)
    assert "import" not in await resp.text()


@pytest.mark.parametrize(
    "path", ["/ui/../v1/nodes", "/ui/%2e%2e/v1/nodes", "/ui/static/../../v1/nodes", "/ui//v1/nodes"]
)
async def test_no_spelling_of_a_path_through_the_dashboard_reaches_the_api_without_a_token(
    client: TestClient[Any, Any], path: str
) -> None:
    resp = await client.get(URL(path, encoded=True))

    assert resp.status in (401, 404)
    assert "n1" not in await resp.text()


async def test_the_root_leads_to_the_dashboard(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/", allow_redirects=False)

    assert resp.status == 302
    assert resp.headers["Location"] == "/ui/"


async def test_the_api_refuses_a_request_with_neither_token_nor_cookie(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.get("/v1/nodes")

    assert resp.status == 401
    assert "token" in (await resp.json())["error"]


async def test_a_login_with_a_wrong_token_is_refused_and_sets_no_cookie(
    client: TestClient[Any, Any],
) -> None:
    resp = await _login(client, "not-the-token")

    assert resp.status == 401
    assert COOKIE not in resp.cookies
    assert (await client.get("/v1/nodes")).status == 401


async def test_a_login_sets_an_httponly_strict_cookie_that_is_not_the_token(
    client: TestClient[Any, Any],
) -> None:
    resp = await _login(client)

    assert resp.status == 200
    morsel = resp.cookies[COOKIE]
    assert morsel["httponly"] is True
    assert morsel["samesite"] == "Strict"
    assert morsel["path"] == "/"
    assert int(morsel["max-age"]) == SESSION_S
    assert TOKEN not in morsel.value


async def test_a_login_over_plain_http_sets_no_secure_flag_one_behind_a_tls_proxy_does(
    client: TestClient[Any, Any],
) -> None:
    plain = await _login(client)
    proxied = await client.post(
        "/ui/login", json={"token": TOKEN}, headers={**CSRF, "X-Forwarded-Proto": "https"}
    )

    assert plain.cookies[COOKIE]["secure"] == ""
    assert proxied.cookies[COOKIE]["secure"] is True


async def test_the_api_accepts_the_session_cookie_in_place_of_the_token(
    client: TestClient[Any, Any],
) -> None:
    await _login(client)

    resp = await client.get("/v1/nodes")

    assert resp.status == 200
    (node,) = await resp.json()
    assert node["id"] == "n1"
    assert node["gauges"]["temperature_max_c"] == 57.5
    assert node["gauges"]["ecc_sbe_volatile"] == 5
    assert node["gauges"]["ecc_dbe_volatile"] == 1


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"not json", 400), (b"[" * 5000, 400), (b'{"token": 42}', 400), (b"[]", 400)],
    ids=["not-json", "too-deep", "token-not-a-string", "not-an-object"],
)
async def test_a_login_whose_body_is_not_a_token_is_a_bad_request(
    client: TestClient[Any, Any], body: bytes, status: int
) -> None:
    resp = await client.post("/ui/login", data=body, headers=CSRF)

    assert resp.status == status
    assert "error" in await resp.json()
    assert COOKIE not in resp.cookies


async def test_a_login_without_the_csrf_header_is_refused(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/ui/login", json={"token": TOKEN})

    assert resp.status == 403
    assert COOKIE not in resp.cookies


@pytest.mark.parametrize(
    "cookie",
    [
        "v2.bootstrap.9999999999.0123456789abcdef",  # a made-up MAC
        session_value(Tokens(_NO_ROWS, "another-token-0123456789").bootstrap),  # another key
        session_value(Tokens(_NO_ROWS, TOKEN).bootstrap, now=time.time() - SESSION_S - 1),
        f"v2.t1.9999999999.{'0' * 64}",  # a token that does not exist
        TOKEN,  # the token itself is no session
        "",
    ],
    ids=["forged", "other-token", "expired", "unknown-token", "raw-token", "empty"],
)
async def test_a_wrong_or_expired_session_cookie_is_refused(
    client: TestClient[Any, Any], cookie: str
) -> None:
    resp = await client.get("/v1/nodes", headers={"Cookie": f"{COOKIE}={cookie}"})

    assert resp.status == 401


async def test_a_change_by_cookie_without_the_csrf_header_is_refused(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    await _login(client)

    resp = await client.post("/v1/nodes/n1/drain", json={"reason": "cable swap"})

    assert resp.status == 403
    assert "X-Phalanx-CSRF" in (await resp.json())["error"]
    assert sup.registry.nodes["n1"].drain is None


async def test_a_change_by_cookie_with_the_csrf_header_is_done(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    await _login(client)

    resp = await client.post("/v1/nodes/n1/drain", json={"reason": "cable swap"}, headers=CSRF)

    assert resp.status == 200
    drain = sup.registry.nodes["n1"].drain
    assert drain is not None and drain.reason == "cable swap"


async def test_a_change_by_bearer_token_needs_no_csrf_header(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    resp = await client.post("/v1/nodes/n1/drain", json={"reason": "cli"}, headers=BEARER)

    assert resp.status == 200


async def test_a_logout_clears_the_cookie_and_the_api_refuses_again(
    client: TestClient[Any, Any],
) -> None:
    await _login(client)
    assert (await client.get("/v1/nodes")).status == 200

    resp = await client.post("/ui/logout", headers=CSRF)

    assert resp.status == 200
    assert resp.cookies[COOKIE].value == ""
    assert (await client.get("/v1/nodes")).status == 401


async def test_a_large_answer_is_gzipped_for_a_client_that_accepts_it(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    for i in range(100):  # about 110 KB of node views
        sup.registry.on_birth(birth(f"n{i + 2:03d}", gpus=8))

    zipped = await client.get("/v1/nodes", headers={**BEARER, "Accept-Encoding": "gzip"})
    plain = await client.get("/v1/nodes", headers={**BEARER, "Accept-Encoding": "identity"})

    assert zipped.headers["Content-Encoding"] == "gzip"
    assert "Content-Encoding" not in plain.headers
    assert await zipped.json() == await plain.json()


async def test_a_small_answer_is_sent_as_it_is(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/v1/nodes", headers={**BEARER, "Accept-Encoding": "gzip"})

    assert "Content-Encoding" not in resp.headers
