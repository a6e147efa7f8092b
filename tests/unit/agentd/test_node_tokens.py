"""A node's agent token opens that node's rank logs and peer tier only; a peer's
credential opens the holder's peer tier only, and only as that peer (issue 16).

A real ``Agent`` per node on the sim backend, built but never started (no broker), its
HTTP app served by aiohttp's test server on a loopback port; the tokens derive from one
fleet secret as the supervisor derives them (``phalanx.agent_tokens``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentd.config import AgentSettings, CkptSettings, GpuSettings, HttpSettings, Thresholds
from agentd.daemon import Agent
from agentd.gpu.sim import SimBackend
from agentd.http import make_app
from phalanx.agent_tokens import AgentKeys, node_token, peer_credential

SECRET = "fleet-agent-secret-0123456789abcdef"
KEYS = AgentKeys(SECRET)
JOB = "job-1"
LOG = "/v1/jobs/job-1/ranks/0/log"
OBJECT = "/v1/ckpt/peer/objects/job-1/000000000001/manifest.json"
KEYS_ROUTE = "/v1/ckpt/peer/keys?prefix=job-1/"

Client = TestClient[object, object]


def bearer(token: str, node: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    if node is not None:
        headers["X-Phalanx-Node"] = node
    return headers


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[dict[str, Client]]:
    """Agents n01 and n02 with their own tokens, and n03 with none configured; each holds
    a log of job-1 rank 0."""
    agents: list[tuple[Agent, SimBackend]] = []
    clients: dict[str, Client] = {}
    try:
        for node in ("n01", "n02", "n03"):
            root = tmp_path / node
            (root / "shm").mkdir(parents=True)
            token_file = None
            if node != "n03":
                token_file = root / "agent-token"
                token_file.write_text(KEYS.node_token(node) + "\n")
            log = root / "data" / "jobs" / JOB / "g1" / "rank-0.log"
            log.parent.mkdir(parents=True)
            log.write_text(f"rank 0 on {node}\n")
            settings = AgentSettings(
                node_id=node,
                data_dir=root / "data",
                gpu=GpuSettings(backend="sim", sim_gpus=1),
                http=HttpSettings(port=0, token_file=token_file),
                ckpt=CkptSettings(shm_dir=root / "shm"),
                thresholds=Thresholds(disk_drain_bytes=0, disk_warn_fraction=0),
            )
            backend = SimBackend(settings.sim_path(), node_id=node, gpus=1, model="sim")
            agent = Agent(settings, backend)
            agents.append((agent, backend))
            client: Client = TestClient(TestServer(make_app(agent)))
            await client.start_server()
            clients[node] = client
        yield clients
    finally:
        for client in clients.values():
            await client.close()
        for agent, backend in agents:
            await agent.ckpt.close()
            agent._sampler.shutdown(wait=True)
            backend.close()


async def put(client: Client, headers: dict[str, str]) -> int:
    resp = await client.put(OBJECT, data=b'{"step": 1}', headers=headers)
    return resp.status


async def test_a_nodes_own_token_opens_its_rank_log_and_its_peer_routes(
    nodes: dict[str, Client],
) -> None:
    own = bearer(KEYS.node_token("n01"))

    log = await nodes["n01"].get(LOG, headers=own)
    stored = await put(nodes["n01"], own)
    listed = await nodes["n01"].get(KEYS_ROUTE, headers=own)

    assert (log.status, await log.text()) == (200, "rank 0 on n01\n")
    assert stored == 200
    assert await listed.json() == ["job-1/000000000001/manifest.json"]


async def test_a_nodes_token_opens_nothing_on_another_node(nodes: dict[str, Client]) -> None:
    theirs = bearer(KEYS.node_token("n01"))

    log = await nodes["n02"].get(LOG, headers=theirs)
    stored = await put(nodes["n02"], theirs)
    listed = await nodes["n02"].get(KEYS_ROUTE, headers=theirs)

    assert (log.status, stored, listed.status) == (401, 401, 401)


async def test_a_nodes_token_presented_as_a_peer_opens_nothing_on_another_node(
    nodes: dict[str, Client],
) -> None:
    as_peer = bearer(KEYS.node_token("n01"), "n01")

    assert await put(nodes["n02"], as_peer) == 401
    assert (await nodes["n02"].get(LOG, headers=as_peer)).status == 401


async def test_a_peers_credential_opens_the_holders_peer_routes_as_that_peer(
    nodes: dict[str, Client],
) -> None:
    credential = KEYS.peer_credential("n02", "n01")  # n01's at n02, as the supervisor sends

    stored = await put(nodes["n02"], bearer(credential, "n01"))
    fetched = await nodes["n02"].get(OBJECT, headers=bearer(credential, "n01"))
    listed = await nodes["n02"].get(KEYS_ROUTE, headers=bearer(credential, "n01"))

    assert stored == 200
    assert await fetched.read() == b'{"step": 1}'
    assert await listed.json() == ["job-1/000000000001/manifest.json"]


async def test_a_peers_credential_holders_verify_from_their_own_token_alone() -> None:
    # What n02 recomputes from its own token is what the supervisor derived from the secret.
    assert peer_credential(node_token(SECRET, "n02"), "n01") == KEYS.peer_credential("n02", "n01")


async def test_a_peers_credential_under_another_nodes_name_is_refused(
    nodes: dict[str, Client],
) -> None:
    credential = KEYS.peer_credential("n02", "n01")

    resp = await nodes["n02"].put(OBJECT, data=b"{}", headers=bearer(credential, "n03"))

    assert resp.status == 401
    assert "wrong credential for node n03 (X-Phalanx-Node)" in (await resp.json())["error"]


async def test_a_peers_credential_does_not_open_the_holders_rank_logs(
    nodes: dict[str, Client],
) -> None:
    resp = await nodes["n02"].get(LOG, headers=bearer(KEYS.peer_credential("n02", "n01"), "n01"))

    assert resp.status == 401
    assert "rank logs" in (await resp.json())["error"]


async def test_a_peers_credential_at_one_holder_opens_nothing_at_another(
    nodes: dict[str, Client],
) -> None:
    credential = KEYS.peer_credential("n02", "n03")  # n03's at n02

    assert await put(nodes["n01"], bearer(credential, "n03")) == 401


async def test_the_old_shared_token_form_is_refused_naming_the_missing_header(
    nodes: dict[str, Client],
) -> None:
    shared = bearer(SECRET)  # what every node and the supervisor once shared

    resp = await nodes["n01"].put(OBJECT, data=b"{}", headers=shared)

    assert resp.status == 401
    error = (await resp.json())["error"]
    assert "no X-Phalanx-Node header" in error and "shared agent token" in error


async def test_a_request_without_a_bearer_token_is_refused_saying_so(
    nodes: dict[str, Client],
) -> None:
    resp = await nodes["n01"].get(LOG, headers={"X-Phalanx-Node": "n02"})

    assert resp.status == 401
    assert "missing bearer token" in (await resp.json())["error"]


async def test_a_node_without_a_token_answers_403_on_every_token_route(
    nodes: dict[str, Client],
) -> None:
    anyone = bearer(KEYS.node_token("n03"))

    log = await nodes["n03"].get(LOG, headers=anyone)
    stored = await put(nodes["n03"], anyone)

    assert (log.status, stored) == (403, 403)


async def test_an_invalid_node_name_in_the_header_is_a_401_not_a_crash(
    nodes: dict[str, Client],
) -> None:
    resp = await nodes["n01"].put(OBJECT, data=b"{}", headers=bearer("x", "../../n02\u00e9"))

    assert resp.status == 401
    assert "invalid node id" in (await resp.json())["error"]
