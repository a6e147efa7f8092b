"""The agent's HTTP port and rank socket answer any body, path and query with a status
under 500.

A real ``Agent`` on the sim backend, built but never started (no broker): its HTTP app
and its rank-socket app are served by aiohttp's test server on loopback ports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentd.ckpt import Standalone
from agentd.ckpt.rank_routes import make_rank_app
from agentd.config import AgentSettings, CkptSettings, GpuSettings, HttpSettings, Thresholds
from agentd.daemon import Agent
from agentd.gpu.sim import SimBackend
from agentd.http import make_app

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


@pytest.mark.parametrize("route", ["hello", "acquire", "submit", "wait", "stage", "report"])
async def test_a_deeply_nested_rank_request_is_a_400(ranks: Client, route: str) -> None:
    resp = await ranks.post(f"/v1/ckpt/{route}", data=nested(5000))

    assert resp.status == 400
    assert "recursion limit exceeded" in (await resp.json())["error"]
