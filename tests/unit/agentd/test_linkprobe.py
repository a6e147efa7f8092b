"""The point-to-point probe: a real aiohttp server with the agent's probe route, read by
(and sent to by) the agent's probe over loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

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


@contextlib.asynccontextmanager
async def serving(streaming: asyncio.Event, *middlewares: Middleware) -> AsyncIterator[int]:
    """Node n2's probe route, behind ``middlewares``; its port. ``streaming`` is set once a
    request reached it."""
    app = web.Application(middlewares=[note_streams, *middlewares])
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


@pytest.fixture
async def peer(streaming: asyncio.Event) -> AsyncIterator[int]:
    """Node n2's probe route; its port. ``streaming`` is set once a request reached it."""
    async with serving(streaming) as port:
        yield port


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


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize(
    "size", ["", "0", "-1", "1e9", "%C2%B2", "9" * 5000, str(MAX_PROBE_BYTES + 1)]
)
async def test_a_bad_size_is_a_400_naming_it(peer: int, size: str, method: str) -> None:
    headers = {"Authorization": f"Bearer {KEYS.node_token('n2')}"}
    url = f"http://127.0.0.1:{peer}/v1/probe?bytes={size}"
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, headers=headers, data=b"\0" * 1000) as got,
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


def headers_of(node: str, credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}", NODE_HEADER: node}


async def zeros(chunks: int, held: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """A body of ``chunks`` MiB of zeros; after its first, it waits for ``held`` if given."""
    for i in range(chunks):
        if i == 1 and held is not None:
            await held.wait()
        yield bytes(1 << 20)


async def upload(
    port: int, size: int, body: object, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{port}/v1/probe?bytes={size}", data=body, headers=headers
        ) as got,
    ):
        return got.status, await got.json()


async def test_an_upload_is_timed_by_the_peer_and_answered_with_its_rate(peer: int) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")

    status, found = await upload(peer, 8 << 20, zeros(8), headers_of("n1", credential))

    assert status == 200
    assert set(found) == {"mb_s", "nbytes", "seconds"}
    assert 0 < found["nbytes"] <= 8 << 20  # less the first chunk
    assert found["mb_s"] > 0 and found["seconds"] > 0


async def test_an_upload_that_ends_before_its_size_is_timed_as_far_as_it_came(peer: int) -> None:
    # The prober stops sending once it has sent for its time: the figure is what came.
    credential = KEYS.peer_credential(holder="n2", peer="n1")

    status, found = await upload(peer, MAX_PROBE_BYTES, zeros(4), headers_of("n1", credential))

    assert status == 200
    assert 0 < found["nbytes"] < 4 << 20


@pytest.mark.parametrize("body", [b"", b"\0" * 1000], ids=["nothing", "one-chunk"])
async def test_an_upload_too_short_to_time_is_a_400_saying_so(peer: int, body: bytes) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")

    status, found = await upload(peer, 1 << 20, body, headers_of("n1", credential))

    assert status == 400
    assert "too small to time" in str(found["error"])


@pytest.mark.parametrize(
    "presented", [None, KEYS.peer_credential(holder="n2", peer="n3")], ids=["none", "stolen"]
)
async def test_an_upload_without_the_peers_credential_is_refused(
    peer: int, presented: str | None
) -> None:
    headers = headers_of("n1", presented) if presented is not None else {}

    status, found = await upload(peer, 1 << 20, zeros(2), headers)

    assert status == 401 and "error" in found


async def test_an_upload_while_a_probe_streams_is_told_to_wait(
    peer: int, streaming: asyncio.Event
) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")
    first = asyncio.create_task(probe("n1", addr(peer, credential), MAX_PROBE_BYTES, 1.0, None))
    await asyncio.wait_for(streaming.wait(), 10.0)  # the first probe's stream is out

    status, found = await upload(peer, 1 << 20, zeros(2), headers_of("n1", credential))

    assert status == 429 and "streaming another probe" in str(found["error"])
    assert (await first)["nbytes"] > 0


async def test_a_probe_of_either_kind_while_an_upload_streams_is_told_to_wait(
    peer: int, streaming: asyncio.Event
) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")
    headers = headers_of("n1", credential)
    held = asyncio.Event()
    first = asyncio.create_task(upload(peer, 4 << 20, zeros(4, held), headers))
    await asyncio.wait_for(streaming.wait(), 10.0)  # the upload holds the route
    try:
        with pytest.raises(ProbeFailed, match="answered 429"):
            await probe("n1", addr(peer, credential), 1 << 20, 1.0, None)
        status, _ = await upload(peer, 1 << 20, zeros(2), headers)
        assert status == 429
    finally:
        held.set()
    assert (await first)[0] == 200


async def test_an_upload_whose_connection_breaks_off_frees_the_route(peer: int) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")
    _reader, writer = await asyncio.open_connection("127.0.0.1", peer)
    writer.write(
        f"POST /v1/probe?bytes={8 << 20} HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {credential}\r\n{NODE_HEADER}: n1\r\n"
        f"Content-Length: {8 << 20}\r\n\r\n".encode()
        + bytes(1 << 20)
    )
    await writer.drain()
    writer.close()  # 1 MiB of the 8 declared, and gone

    async def taken() -> dict[str, object] | None:
        try:
            return await probe("n1", addr(peer, credential), 1 << 20, 1.0, None, both_ways=True)
        except ProbeFailed as exc:
            if "answered 429" in str(exc):
                return None  # the broken upload still holds the route
            raise

    found = await until(taken, 10.0, "the broken upload to free the route")
    assert "back" in found


async def test_an_upload_of_garbage_is_cut_off_and_frees_the_route(
    peer: int, streaming: asyncio.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agentd.linkprobe.MAX_STREAM_S", 0.5)
    credential = KEYS.peer_credential(holder="n2", peer="n1")
    reader, writer = await asyncio.open_connection("127.0.0.1", peer)
    writer.write(
        f"POST /v1/probe?bytes={1 << 20} HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {credential}\r\n{NODE_HEADER}: n1\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    await writer.drain()
    try:
        await asyncio.wait_for(streaming.wait(), 10.0)  # the route reads the body
        writer.write(b"4\r\n\0\0\0\0\r\nnot a chunk size\r\n\r\n")
        await writer.drain()
        answered = await asyncio.wait_for(reader.read(), 10.0)  # until it hangs up
    finally:
        writer.close()

    assert not answered or answered.split()[1].startswith(b"4"), answered  # never a 5xx
    found = await probe("n1", addr(peer, credential), 1 << 20, 1.0, None, both_ways=True)
    assert "back" in found  # the route is free


async def test_a_probe_both_ways_reads_then_sends_and_reports_the_peers_figure(peer: int) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")

    found = await probe("n1", addr(peer, credential), 8 << 20, 10.0, None, both_ways=True)

    assert found["peer"] == "n2" and 0 < found["nbytes"] <= 8 << 20
    back = found["back"]
    assert set(back) == {"mb_s", "nbytes", "seconds"}
    assert 0 < back["nbytes"] <= 8 << 20 and back["mb_s"] > 0
    assert "back_error" not in found


@web.middleware
async def too_old_for_uploads(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A peer agent from before the upload route. It reads the body first: a body left
    unread keeps the test server lingering over it (aiohttp's 10 s) when it stops."""
    if request.method == "POST":
        while await request.content.readany():
            pass
        return web.json_response({"error": "405: Method Not Allowed"}, status=405)
    return await handler(request)


@web.middleware
async def uploads_cut(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A link that carries nothing toward the peer: the upload's connection drops."""
    if request.method == "POST" and request.transport is not None:
        request.transport.abort()
    return await handler(request)


@pytest.mark.parametrize(
    ("middleware", "reached", "why"),
    [
        (too_old_for_uploads, True, "answered 405 to the upload"),
        (uploads_cut, False, "could not probe the link to node n2"),
    ],
    ids=["refused", "cut"],
)
async def test_a_way_back_that_cannot_be_measured_keeps_the_forward_figure(
    streaming: asyncio.Event, middleware: Middleware, reached: bool, why: str
) -> None:
    credential = KEYS.peer_credential(holder="n2", peer="n1")
    async with serving(streaming, middleware) as port:
        found = await probe("n1", addr(port, credential), 8 << 20, 10.0, None, both_ways=True)

    assert found["mb_s"] > 0 and 0 < found["nbytes"] <= 8 << 20
    assert "back" not in found
    assert why in found["back_error"] and found["back_reached"] is reached
