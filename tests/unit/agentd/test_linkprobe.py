"""The point-to-point probe: a real aiohttp server with the agent's probe route, read by
the agent's probe over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from agentd.access import Access
from agentd.linkprobe import MAX_PROBE_BYTES, ProbeFailed, add_probe_route, probe
from phalanx import wire
from phalanx.agent_tokens import NODE_HEADER, AgentKeys
from phalanx.local import free_port
from tests.wait import until

KEYS = AgentKeys("s" * 32)


STREAMING = web.AppKey("streaming", asyncio.Event)


@web.middleware
async def note_streams(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Set the app's ``STREAMING`` event as a request is handed to the route: by the time
    the test sees it, the route took its stream (before its first await)."""
    request.app[STREAMING].set()
    return await handler(request)


@pytest.fixture
def streaming() -> asyncio.Event:
    return asyncio.Event()


@pytest.fixture
async def peer(streaming: asyncio.Event) -> AsyncIterator[int]:
    """Node n2's probe route; its port. ``streaming`` is set once a request reached it."""
    app = web.Application(middlewares=[note_streams])
    app[STREAMING] = streaming
    add_probe_route(app, Access("n2", KEYS.node_token("n2")))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


def addr(port: int, token: str | None) -> wire.PeerAddr:
    return wire.PeerAddr(node="n2", address="127.0.0.1", http_port=port, token=token)


async def test_a_probe_reads_what_it_asked_for_and_reports_the_rate(peer: int) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")

    found = await probe("n1", addr(peer, credential), 8 << 20, 10.0, None)

    assert 0 < found["nbytes"] <= 8 << 20 and found["peer"] == "n2"  # less the first chunk
    assert found["mb_s"] > 0 and found["seconds"] > 0


async def test_a_probe_stops_reading_after_its_time(peer: int) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")

    found = await probe("n1", addr(peer, credential), MAX_PROBE_BYTES, 0.05, None)

    assert 0 < found["nbytes"] < MAX_PROBE_BYTES


async def test_another_nodes_credential_is_refused_and_that_says_nothing_of_the_link(
    peer: int,
) -> None:
    stolen = KEYS.peer_credential(holder="n2", peer="n3")  # n3's, presented as n1
    with pytest.raises(ProbeFailed, match="answered 401") as refused:
        await probe("n1", addr(peer, stolen), 1 << 20, 1.0, None)
    assert refused.value.reached


async def test_a_peer_that_cannot_be_reached_is_a_failed_link() -> None:
    with pytest.raises(ProbeFailed, match="could not probe the link from node n2") as failed:
        await probe("n1", addr(free_port(), "x"), 1 << 20, 1.0, None, connect_s=2.0)
    assert not failed.value.reached


@pytest.mark.parametrize(
    "size", ["", "0", "-1", "1e9", "%C2%B2", "9" * 5000, str(MAX_PROBE_BYTES + 1)]
)
async def test_a_bad_size_is_a_400_naming_it(peer: int, size: str) -> None:
    headers = {"Authorization": f"Bearer {KEYS.node_token('n2')}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{peer}/v1/probe?bytes={size}", headers=headers) as got,
    ):
        assert got.status == 400
        assert "bytes must be an integer" in (await got.json())["error"]


async def test_a_second_probe_while_one_streams_is_told_to_wait(
    peer: int, streaming: asyncio.Event
) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")
    first = asyncio.create_task(probe("n1", addr(peer, credential), MAX_PROBE_BYTES, 1.0, None))
    await asyncio.wait_for(streaming.wait(), 10.0)  # the first probe's stream is out
    headers = {"Authorization": f"Bearer {credential}", NODE_HEADER: "n1"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{peer}/v1/probe?bytes=65536", headers=headers) as got,
    ):
        assert got.status == 429
    assert (await first)["nbytes"] > 0


async def test_a_prober_that_stops_reading_is_cut_off_and_frees_the_route(
    peer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agentd.linkprobe.MAX_STREAM_S", 0.5)
    credential = KEYS.peer_credential(holder="n2", peer="n1")
    _reader, writer = await asyncio.open_connection("127.0.0.1", peer)
    writer.write(
        f"GET /v1/probe?bytes={MAX_PROBE_BYTES} HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {credential}\r\n{NODE_HEADER}: n1\r\n\r\n".encode()
    )
    await writer.drain()  # and never reads: the stream fills the socket's buffers

    async def taken() -> dict[str, object] | None:
        try:
            return await probe("n1", addr(peer, credential), 1 << 20, 1.0, None)
        except ProbeFailed as exc:
            if "answered 429" in str(exc):
                return None  # the stalled stream still holds the route
            raise

    try:
        found = await until(taken, 10.0, "the stalled stream to be cut off")
        assert found["peer"] == "n2"  # not a 429: the stalled stream was cut off
    finally:
        writer.close()
