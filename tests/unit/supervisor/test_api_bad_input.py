"""The REST API answers any body, path and query with a status under 500.

The supervisor here is the real one, built but never started (no broker): its app is
served by aiohttp's test server on a loopback port, and requests go through aiohttp's
client. Commands need the broker, so a ping answers 503; everything else is served.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.api import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor

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


async def test_a_body_with_an_unknown_charset_is_read_as_bytes_not_a_500(
    api: TestClient[object, object],
) -> None:
    resp = await api.post(
        "/v1/jobs",
        data=json.dumps({"spec": SPEC}).encode(),
        headers={**AUTH, "Content-Type": "application/json; charset=no-such-charset"},
    )

    assert resp.status == 201
