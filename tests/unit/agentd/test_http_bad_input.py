"""The agent's HTTP port and rank socket answer any body, path and query with a status
under 500.

A real ``Agent`` on the sim backend, built but never started (no broker): its HTTP app
and its rank-socket app are served by aiohttp's test server on loopback ports.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import zstandard
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agentd.ckpt import Standalone
from agentd.ckpt.rank_routes import make_rank_app
from agentd.config import AgentSettings, CkptSettings, GpuSettings, HttpSettings, Thresholds
from agentd.daemon import Agent
from agentd.gpu.sim import SimBackend
from agentd.http import make_app
from ckpt import protocol
from tests.unit.served import Served, json_values, path_parts

NODE = "n01"
TOKEN = "agent-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

Client = TestClient[object, object]


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    settings = AgentSettings(
        node_id=NODE,
        data_dir=tmp_path / "data",
        gpu=GpuSettings(backend="sim", sim_gpus=1),
        http=HttpSettings(port=0, token_file=token_file),
        ckpt=CkptSettings(shm_dir=tmp_path / "shm"),
        thresholds=Thresholds(disk_drain_bytes=0, disk_warn_fraction=0),
    )
    (tmp_path / "shm").mkdir()
    backend = SimBackend(settings.sim_path(), node_id=NODE, gpus=1, model="sim")
    a = Agent(settings, backend)
    try:
        yield a
    finally:
        await a.ckpt.close()
        a._sampler.shutdown(wait=True)
        backend.close()


@pytest.fixture
async def http(agent: Agent) -> AsyncIterator[Client]:
    async with TestClient(TestServer(make_app(agent))) as client:
        yield client


@pytest.fixture
async def ranks(agent: Agent) -> AsyncIterator[Client]:
    async with TestClient(TestServer(make_rank_app(Standalone(NODE, agent.ckpt)))) as client:
        yield client


def nested(depth: int) -> bytes:
    return ("[" * depth + "]" * depth).encode()


async def test_a_deeply_nested_peer_delete_body_is_a_400(http: Client) -> None:
    resp = await http.post("/v1/ckpt/peer/delete", data=nested(5000), headers=AUTH)

    assert resp.status == 400
    assert "recursion limit exceeded" in (await resp.json())["error"]


async def test_a_deeply_nested_keys_list_is_a_400(http: Client) -> None:
    body = b'{"keys": ' + nested(5000) + b"}"

    resp = await http.post("/v1/ckpt/peer/delete", data=body, headers=AUTH)

    assert resp.status == 400


async def test_a_peer_delete_body_past_a_mib_is_refused_with_413(http: Client) -> None:
    body = json.dumps({"keys": ["job-1/000000000001/manifest.json"] * 40_000}).encode()
    assert len(body) > 1 << 20

    resp = await http.post("/v1/ckpt/peer/delete", data=io.BytesIO(body), headers=AUTH)

    assert resp.status == 413


async def test_a_rank_request_past_64_kib_is_refused_with_413(ranks: Client) -> None:
    body = json.dumps({"job": "job-1", "generation": 1, "rank": 0, "error": "x" * 70_000})

    resp = await ranks.post("/v1/ckpt/report", data=body.encode())

    assert resp.status == 413


@pytest.mark.parametrize("route", ["hello", "acquire", "submit", "wait", "stage", "report"])
async def test_a_deeply_nested_rank_request_is_a_400(ranks: Client, route: str) -> None:
    resp = await ranks.post(f"/v1/ckpt/{route}", data=nested(5000))

    assert resp.status == 400
    assert "recursion limit exceeded" in (await resp.json())["error"]


# --- any request --------------------------------------------------------------------------

PEER_KEYS = [
    "job-1/000000000001/rank-00000.phx",
    "job-1/000000000001/rank-00000.phx.zst",
    "job-1/000000000001/manifest.json",
    "job-1/000000000001/manifest-r00000-r00001.json",
]
keys = st.sampled_from(PEER_KEYS) | path_parts | st.lists(path_parts, max_size=4).map("/".join)
raw_bodies = st.one_of(
    st.none(),
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(st.sampled_from(PEER_KEYS) | json_values).map(
        lambda v: json.dumps({"keys": v}).encode()
    ),
    st.integers(1, 20_000).map(nested),
    st.binary(max_size=300).map(zstandard.ZstdCompressor().compress),
)
headers = st.sampled_from([AUTH, {}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
SLOW = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
Request = tuple[str, str, dict[str, str], bytes | None, dict[str, str]]


@st.composite
def agent_requests(draw: st.DrawFn) -> Request:
    route = draw(st.sampled_from(["healthz", "metrics", "log", "put", "get", "keys", "delete"]))
    method, path = {
        "healthz": ("GET", "/healthz"),
        "metrics": ("GET", "/metrics"),
        "log": ("GET", f"/v1/jobs/{quote(draw(path_parts), safe='')}/ranks/"
                       f"{quote(draw(path_parts), safe='')}/log"),
        "put": ("PUT", f"/v1/ckpt/peer/objects/{quote(draw(keys), safe='/')}"),
        "get": ("GET", f"/v1/ckpt/peer/objects/{quote(draw(keys), safe='/')}"),
        "keys": ("GET", "/v1/ckpt/peer/keys"),
        "delete": ("POST", "/v1/ckpt/peer/delete"),
    }[route]  # fmt: skip
    params = draw(
        st.dictionaries(
            st.sampled_from(["offset", "limit", "prefix"]) | st.text(max_size=5), st.text()
        )
    )
    return method, path, params, draw(raw_bodies), draw(headers)


@pytest.fixture(scope="module")
def served_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    """The agent's HTTP app and rank-socket app, each on a loop of its own thread."""
    root = tmp_path_factory.mktemp("agent")
    built: list[tuple[Agent, SimBackend]] = []

    async def build_http() -> web.Application:
        token_file = root / "token"
        token_file.write_text(TOKEN)
        (root / "shm").mkdir()
        settings = AgentSettings(
            node_id=NODE,
            data_dir=root / "data",
            gpu=GpuSettings(backend="sim", sim_gpus=1),
            http=HttpSettings(port=0, token_file=token_file),
            ckpt=CkptSettings(shm_dir=root / "shm"),
            thresholds=Thresholds(disk_drain_bytes=0, disk_warn_fraction=0),
        )
        backend = SimBackend(settings.sim_path(), node_id=NODE, gpus=1, model="sim")
        built.append((Agent(settings, backend), backend))
        return make_app(built[0][0])

    http = Served(build_http)

    async def build_ranks() -> web.Application:
        return make_rank_app(Standalone(NODE, built[0][0].ckpt))

    ranks = Served(build_ranks)
    try:
        yield http, ranks
    finally:
        ranks.close()
        agent, backend = built[0]

        async def close() -> None:
            await agent.ckpt.close()

        http.run(close)
        http.close()
        agent._sampler.shutdown(wait=True)
        backend.close()


@SLOW
@given(data=st.data())
def test_any_request_to_the_agent_http_port_is_answered_under_500(
    served_agent: tuple[Served, Served], data: st.DataObject
) -> None:
    method, path, params, body, auth = data.draw(agent_requests())

    status, answer = served_agent[0].request(method, path, params=params, data=body, headers=auth)

    assert status < 500, (status, answer[:300])


RANK_BODY: dict[str, Any] = {
    "job": "job-1",
    "generation": 1,
    "rank": 0,
    "step": 1,
    "nbytes": 4096,
    "slot": 0,
    "tier": "nvme",
    "timeout": 0.05,
    "when_busy": "skip",
    "world_size": 1,
    "error": "x",
    "abort": True,
}
RANK_ROUTES: dict[str, type[BaseModel]] = {
    "hello": protocol.HelloRequest,
    "acquire": protocol.AcquireRequest,
    "submit": protocol.SubmitRequest,
    "reserve": protocol.ReserveRequest,
    "wait": protocol.WaitRequest,
    "stage": protocol.StageRequest,
    "report": protocol.ReportRequest,
    "restore": protocol.RestoreQuery,
    "shard": protocol.ShardQuery,
}


@st.composite
def rank_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes | None]:
    """A valid request of a route with one field replaced, removed or added; ``timeout``
    stays short (a wait of the default hour is a rank's right, not a fault)."""
    route = draw(st.sampled_from(sorted(RANK_ROUTES)))
    model = RANK_ROUTES[route]
    fields: dict[str, Any] = {k: v for k, v in RANK_BODY.items() if k in model.model_fields}
    key = draw(st.sampled_from([*sorted(set(fields) - {"timeout"}), "extra"]))
    action = draw(st.sampled_from(["keep", "replace", "remove"]))
    if action == "replace":
        fields[key] = draw(json_values | st.sampled_from([-1, 2**63, 10**12, "..", "a/b", "\x00"]))
    elif action == "remove":
        fields.pop(key, None)
    if route in ("restore", "shard"):
        params = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
        return "GET", f"/v1/ckpt/{route}", params, None
    valid = draw(st.integers(0, 3)) > 0
    body = json.dumps(fields).encode() if valid else draw(raw_bodies)
    return "POST", f"/v1/ckpt/{route}", {}, body


@SLOW
@given(data=st.data())
def test_any_request_on_the_rank_socket_is_answered_under_500(
    served_agent: tuple[Served, Served], data: st.DataObject
) -> None:
    method, path, params, body = data.draw(rank_requests())

    status, answer = served_agent[1].request(method, path, params=params, data=body)

    timed_out = path.endswith("/wait") and status == 504  # not committed within its timeout
    assert status < 500 or timed_out, (status, answer[:300])
