"""A buddy's listing of keys that is not a JSON list of strings is a ``PeerError`` naming
the buddy, whatever its bytes (deep nesting, not UTF-8), never another exception."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from ckpt import HttpPeerStore, PeerError
from phalanx.http import serve


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"[" * 50_000 + b"]" * 50_000, "sent no JSON: recursion limit exceeded"),
        (b"\xff\xfe", "sent no JSON"),
        (b'["a", NaN]', "sent no JSON"),
        (b'{"keys": []}', "sent no list of keys"),
        (b'["a", 1]', "sent no list of keys"),
    ],
    ids=["deep", "not UTF-8", "NaN", "an object", "not strings"],
)
async def test_a_listing_that_is_no_list_of_keys_is_a_peer_error(body: bytes, problem: str) -> None:
    async def keys(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/ckpt/peer/keys", keys)
    async with serve(app, lambda runner: web.TCPSite(runner, "127.0.0.1", 0), "buddy") as runner:
        store = HttpPeerStore("n02", "127.0.0.1", runner.addresses[0][1], "token", timeout_s=10)

        with pytest.raises(PeerError, match=f"listing job-1/: peer n02 {problem}"):
            await asyncio.to_thread(store.keys, "job-1/")
