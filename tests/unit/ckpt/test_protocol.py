"""The rank socket's protocol (``ckpt.protocol``) as the rank's ``AgentClient`` speaks it:
its requests are checked before they are sent, and an answer that does not follow its
model is an ``AgentError`` naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from pydantic import ValidationError

from ckpt import AgentError, ShardCorrupt, TierError, protocol
from ckpt.remote import AgentClient, AgentEnv
from phalanx.http import serve


def client(socket: Path) -> AgentClient:
    return AgentClient(AgentEnv(str(socket), "job-1", 1, 0, 1), timeout_s=10)


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[Path, dict[str, web.Response]]]:
    """An agent on a unix socket answering each route with what the test puts in the dict
    (by path), and recording nothing else."""
    answers: dict[str, web.Response] = {}

    async def answer(request: web.Request) -> web.Response:
        return answers[request.path]

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    socket = tmp_path / "agent.sock"
    async with serve(app, lambda runner: web.UnixSite(runner, str(socket)), "test agent"):
        yield socket, answers


async def test_an_answer_that_does_not_follow_its_model_is_an_agent_error_naming_the_field(
    agent: tuple[Path, dict[str, web.Response]],
) -> None:
    socket, answers = agent
    answers["/v1/ckpt/acquire"] = web.json_response({"slot": "the first", "path": "/dev/shm/x"})

    with pytest.raises(AgentError, match=r"malformed answer: slot: Input should be a valid int"):
        await asyncio.to_thread(client(socket).acquire, 1, 10, when_busy="wait", timeout=1)


async def test_a_refusal_naming_a_corrupt_copy_is_a_shard_corrupt(
    agent: tuple[Path, dict[str, web.Response]],
) -> None:
    socket, answers = agent
    answers["/v1/ckpt/stage"] = web.json_response(
        {"error": "tier object: bad seal", "tier": "object", "step": 4, "corrupt": True},
        status=502,
    )

    with pytest.raises(ShardCorrupt, match="bad seal") as refused:
        await asyncio.to_thread(client(socket).stage, 4, "object")
    assert refused.value.step == 4


async def test_a_refusal_naming_a_tier_is_a_tier_error(
    agent: tuple[Path, dict[str, web.Response]],
) -> None:
    socket, answers = agent
    answers["/v1/ckpt/wait"] = web.json_response(
        {"error": "tier nvme: disk full", "tier": "nvme", "step": 4}, status=409
    )

    with pytest.raises(TierError, match="disk full") as refused:
        await asyncio.to_thread(client(socket).wait, 4, 1.0)
    assert refused.value.tier == "nvme"


async def test_a_refusal_that_is_not_json_is_an_agent_error_with_its_text_and_status(
    agent: tuple[Path, dict[str, web.Response]],
) -> None:
    socket, answers = agent
    answers["/v1/ckpt/stage"] = web.Response(text="404: Not Found", status=404)

    with pytest.raises(AgentError, match="404: Not Found") as refused:
        await asyncio.to_thread(client(socket).stage, 4, "peer")
    assert refused.value.status == 404


def test_a_request_the_client_cannot_send_is_refused_before_it_is_sent() -> None:
    with pytest.raises(ValidationError, match="nbytes"):
        protocol.AcquireRequest(job="job-1", generation=1, rank=0, step=1, nbytes=-1)


def test_a_request_names_a_job_the_tiers_can_name() -> None:
    with pytest.raises(ValidationError, match=r"job.*no '/'"):
        protocol.RankQuery(job="../etc", rank=0)
