"""The REST API answers any body, path and query with a status under 500.

The supervisor here is the real one, built but never started (no broker): its app is
served by aiohttp's test server on a loopback port, and requests go through aiohttp's
client. Commands need the broker, so a ping answers 503; everything else is served.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from tests.unit.phalanx.test_wire import _birth
from tests.unit.served import Served, json_values, path_parts

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC = {
    "name": "train",
    "team": "ml",
    "command": ["python", "train.py"],
    "workdir": "/work",
    "nodes": 1,
    "ranks_per_node": 1,
}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[TestClient[object, object]]:
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    async with TestClient(TestServer(make_app(sup))) as client:
        yield client
    sup.store.close()


def nested(depth: int) -> bytes:
    return ("[" * depth + "]" * depth).encode()


@pytest.mark.parametrize(
    "path",
    ["/v1/jobs", "/v1/nodes/n01/drain", "/v1/nodes/n01/undrain"],
)
async def test_a_deeply_nested_body_is_a_400_naming_the_json_problem(
    api: TestClient[object, object], path: str
) -> None:
    resp = await api.post(path, data=nested(5000), headers=AUTH)

    assert resp.status == 400
    assert "request body is not JSON: recursion limit exceeded" in (await resp.json())["error"]


async def test_a_spec_nested_deep_inside_an_object_is_a_400(
    api: TestClient[object, object],
) -> None:
    body = b'{"spec": {"env": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}}"

    resp = await api.post("/v1/jobs", data=body, headers=AUTH)

    assert resp.status == 400


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"9" * 5000, "number out of range"),
        (b'{"reason": "\\ud800"}', "unexpected end of hex escape"),
        (b'{"reason": NaN}', "expected value"),
        (b"\xff\xfe", "expected value"),
    ],
    ids=["5000-digit number", "lone surrogate", "NaN", "not UTF-8"],
)
async def test_a_body_json_cannot_hold_faithfully_is_a_400(
    api: TestClient[object, object], body: bytes, problem: str
) -> None:
    resp = await api.post("/v1/nodes/n01/drain", data=body, headers=AUTH)

    assert resp.status == 400
    assert problem in (await resp.json())["error"]


async def test_a_body_past_64_kib_is_refused_with_413(api: TestClient[object, object]) -> None:
    body = json.dumps({"reason": "x" * (64 * 1024)}).encode()

    resp = await api.post("/v1/nodes/n01/drain", data=body, headers=AUTH)

    assert resp.status == 413


async def test_a_body_with_an_unknown_charset_is_read_as_bytes_not_a_500(
    api: TestClient[object, object],
) -> None:
    resp = await api.post(
        "/v1/jobs",
        data=json.dumps({"spec": SPEC}).encode(),
        headers={**AUTH, "Content-Type": "application/json; charset=no-such-charset"},
    )

    assert resp.status == 201


# --- any request --------------------------------------------------------------------------

NODE = "n01"
ROUTES = [
    ("GET", "/healthz"),
    ("GET", "/v1/nodes"),
    ("GET", "/v1/nodes/{id}"),
    ("POST", "/v1/nodes/{id}/drain"),
    ("POST", "/v1/nodes/{id}/undrain"),
    ("POST", "/v1/nodes/{id}/ping"),
    ("GET", "/v1/events"),
    ("GET", "/v1/stats"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/{id}"),
    ("POST", "/v1/jobs/{id}/cancel"),
    ("GET", "/v1/jobs/{id}/logs"),
    ("GET", "/v1/jobs/{id}/checkpoints"),
    ("GET", "/v1/jobs/{id}/metrics"),
    ("GET", "/metrics"),
    # the tokens (supervisor.api.token_routes)
    ("GET", "/v1/whoami"),
    ("POST", "/v1/tokens"),
    ("GET", "/v1/tokens"),
    ("POST", "/v1/tokens/{id}/revoke"),
    # the dashboard (supervisor.dashboard): its page, an asset, login, logout
    ("GET", "/"),
    ("GET", "/ui/"),
    ("GET", "/ui/static/{id}"),
    ("POST", "/ui/login"),
    ("POST", "/ui/logout"),
]
# Statuses that say another process did not answer, not that the request was bad: a ping
# needs the broker (never connected here), a log the rank's node.
GATEWAY = {"/ping": {503, 504}, "/logs": {502, 503}}
QUERY_KEYS = ["limit", "after", "node", "job", "rank", "offset", "names", "since", "step_from"]


def spec_bodies() -> st.SearchStrategy[bytes]:
    def mutate(pair: tuple[str, object]) -> bytes:
        key, value = pair
        return json.dumps({"spec": {**SPEC, key: value}}).encode()

    return st.tuples(
        st.sampled_from([*SPEC, "env", "checkpoint", "restart", "x"]), json_values
    ).map(mutate)


bodies = st.one_of(
    st.none(),
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={"reason": json_values, "force": json_values}).map(
        lambda v: json.dumps(v).encode()
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["admin", "member", "viewer", "x"]) | json_values,
            "team": json_values,
            "name": json_values,
            "expires": json_values,
        },
    ).map(lambda v: json.dumps(v).encode()),
    spec_bodies(),
    st.integers(1, 20_000).map(nested),
)
ids = st.sampled_from([NODE, "ghost", "j-unknown", "t1", "t0", "bootstrap"]) | path_parts


Request = tuple[str, str, dict[str, str], Any, dict[str, str]]


@st.composite
def requests(
    draw: st.DrawFn, job_ids: list[str]
) -> tuple[str, str, dict[str, str], Any, dict[str, str]]:
    method, template = draw(st.sampled_from(ROUTES))
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    ident = draw(ids | st.sampled_from(job_ids)) if job_ids else draw(ids)
    path = template.replace("{id}", quote(ident, safe=""))
    params = draw(st.dictionaries(st.sampled_from(QUERY_KEYS) | st.text(max_size=5), st.text()))
    headers = draw(
        st.sampled_from(
            [
                AUTH,
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": TOKEN},
                {"X-Phalanx-CSRF": "1"},  # the dashboard's login, without a session
                {"X-Phalanx-CSRF": "1", "Cookie": "phalanx_session=v1.99999999999.00"},
                {"X-Phalanx-CSRF": "1", "Cookie": "phalanx_session=v2.t1.99999999999.00"},
                {"Cookie": "phalanx_session=v2.bootstrap.99999999999.00"},
                {"Authorization": "Bearer phx_t1_" + "A" * 43},
                {"Authorization": "Bearer phx_t99999999999999999999999_x"},
            ]
        )
    )
    content_type = draw(
        st.sampled_from([None, "application/json", "text/plain; charset=nope", "multipart/x"])
    )
    if content_type is not None:
        headers = {**headers, "Content-Type": content_type}
    return method, path, params, draw(bodies), headers


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, list[str]]]:
    """The real supervisor's app on a loop of its own, knowing one node (n01) and one
    pending job (whose id the requests use)."""
    state = tmp_path_factory.mktemp("sup")
    sups: list[Supervisor] = []

    async def build() -> web.Application:
        sup = Supervisor(SupervisorSettings(state_dir=state, command_timeout_s=0.2), TOKEN)
        sups.append(sup)
        sup.registry.on_birth(_birth(NODE))
        return make_app(sup)

    app = Served(build)
    status, body = app.request(
        "POST", "/v1/jobs", data=json.dumps({"spec": SPEC}).encode(), headers=AUTH
    )
    assert status == 201
    try:
        yield app, [json.loads(body)["id"]]
    finally:
        app.close()
        sups[0].store.close()


@settings(
    max_examples=400,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_request_is_answered_under_500(
    served: tuple[Served, list[str]], data: st.DataObject
) -> None:
    app, job_ids = served
    method, path, params, body, headers = data.draw(requests(job_ids))

    status, answer = app.request(method, path, params=params, data=body, headers=headers)

    gateway = next((codes for end, codes in GATEWAY.items() if path.endswith(end)), set())
    assert status < 500 or status in gateway, (status, answer[:300])
