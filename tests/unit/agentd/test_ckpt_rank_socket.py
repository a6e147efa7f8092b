"""The rank socket's routes against malformed requests, on the real unix socket: a body or
query that does not follow ``ckpt.protocol`` is answered 400, naming each wrong field and
what is wrong with it (never ``KeyError('job')``), and the service is not reached."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentd.ckpt import CkptService, Standalone, start_rank_socket
from phalanx import wire


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[CkptService]:
    (tmp_path / "shm").mkdir()
    landings: list[wire.CkptLanding | wire.CkptReleased] = []
    service = CkptService(
        "n01",
        tmp_path / "data",
        tmp_path / "shm",
        (tmp_path / "objects").as_uri(),
        landings.append,
    )
    try:
        yield service
    finally:
        await service.close(timeout=10)


@pytest.fixture
async def session(tmp_path: Path, service: CkptService) -> AsyncIterator[aiohttp.ClientSession]:
    socket = tmp_path / "agent.sock"
    async with (
        start_rank_socket(Standalone("n01", service), socket),
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket))) as session,
    ):
        yield session


async def post(session: aiohttp.ClientSession, route: str, data: bytes) -> tuple[int, Any]:
    async with session.post(f"http://agent/v1/ckpt/{route}", data=data) as resp:
        return resp.status, await resp.json()


async def test_a_body_without_the_job_is_refused_with_400_naming_the_field(
    session: aiohttp.ClientSession, service: CkptService
) -> None:
    status, answer = await post(
        session, "acquire", b'{"generation": 1, "rank": 0, "step": 3, "nbytes": 10}'
    )

    assert status == 400
    assert answer["error"] == "bad body: job: Field required"
    assert len(service.stores) == 0  # the service was not reached


async def test_a_field_of_the_wrong_type_is_refused_with_400_naming_it_and_its_value(
    session: aiohttp.ClientSession,
) -> None:
    status, answer = await post(
        session, "wait", b'{"job": "job-1", "generation": 1, "rank": 0, "step": "ten"}'
    )

    assert status == 400
    assert answer["error"].startswith("bad body: step: Input should be a valid integer")
    assert answer["error"].endswith("(got 'ten')")


async def test_each_wrong_field_of_a_body_is_named(session: aiohttp.ClientSession) -> None:
    status, answer = await post(
        session,
        "submit",
        b'{"job": "job-1", "generation": -1, "rank": 0, "step": 3, "nbytes": 10, "slott": 0}',
    )

    assert status == 400
    assert "generation: Input should be greater than or equal to 0 (got -1)" in answer["error"]
    assert "slot: Field required" in answer["error"]
    assert "slott: Extra inputs are not permitted (got 0)" in answer["error"]


async def test_a_tier_the_agent_does_not_have_is_refused_with_400_naming_the_field(
    session: aiohttp.ClientSession,
) -> None:
    body = b'{"job": "job-1", "generation": 1, "rank": 0, "step": 3, "tier": "tape"}'
    status, answer = await post(session, "report", body)

    assert status == 400
    assert answer["error"].startswith("bad body: tier: Input should be 'ram', 'nvme', 'peer'")


async def test_a_body_that_is_not_a_json_object_is_refused_with_400(
    session: aiohttp.ClientSession,
) -> None:
    assert await post(session, "hello", b"[1, 2]") == (
        400,
        {"error": "bad body: body: Input should be an object (got [1, 2])", "corrupt": False},
    )
    status, answer = await post(session, "hello", b"{not json")
    assert status == 400
    assert answer["error"].startswith("bad body: body: Invalid JSON")


async def test_a_query_with_a_rank_that_is_not_a_number_is_refused_with_400_naming_it(
    session: aiohttp.ClientSession,
) -> None:
    async with session.get(
        "http://agent/v1/ckpt/restore", params={"job": "job-1", "rank": "first"}
    ) as resp:
        answer = await resp.json()

    assert resp.status == 400
    assert answer["error"].startswith("bad query: rank: Input should be a valid integer")


async def test_a_well_formed_body_reaches_the_service(
    session: aiohttp.ClientSession, service: CkptService
) -> None:
    service.configure("job-1", 1, wire.CkptPlan(tiers=["ram"]))

    status, answer = await post(session, "hello", b'{"job": "job-1", "generation": 1, "rank": 0}')

    assert (status, answer["tiers"], answer["node"]) == (200, ["ram"], "n01")
