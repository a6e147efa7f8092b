"""The peer tier over HTTPS: a buddy's real peer routes served with a certificate from a
throw-away CA, and ``HttpPeerStore`` verifying it (address included) or refusing it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from agentd.access import Access
from agentd.ckpt import add_peer_routes
from ckpt import HttpPeerStore, LocalFolderStore, Pacing, PeerError
from phalanx.certs import Authority, Issued, make_authority
from phalanx.http import serve
from phalanx.tls import client_context, server_context

TOKEN = "peer-token-0123456789abcdef"
KEY = "job-1/000000000004/manifest.json"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def tls_buddy(root: Path, files: Issued) -> AsyncIterator[int]:
    """A buddy's peer routes over HTTPS on a loopback port; yields the port."""
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-peer")
    agent = SimpleNamespace(
        node="n02",
        ckpt=SimpleNamespace(
            peer_root=root, peer_io=pool, peer_store=LocalFolderStore(root), pacing=Pacing()
        ),
    )
    app = web.Application()
    add_peer_routes(
        app,
        agent,
        Access("n02", TOKEN),
        max_shard_bytes=1 << 30,
    )
    tls = server_context(files.cert, files.key)
    try:
        async with serve(
            app, lambda r: web.TCPSite(r, "127.0.0.1", 0, ssl_context=tls), "TLS buddy"
        ) as runner:
            yield int(runner.addresses[0][1])
    finally:
        pool.shutdown(wait=True)


def store(port: int, context: ssl.SSLContext | None) -> HttpPeerStore:
    return HttpPeerStore("n02", "127.0.0.1", port, TOKEN, timeout_s=10, ssl_context=context)


async def test_a_push_over_https_lands_on_the_buddy_and_reads_back(
    ca: Authority, tmp_path: Path
) -> None:
    async with tls_buddy(tmp_path / "peer", ca.issue("n02")) as port:
        peer = store(port, client_context(ca.ca))
        assert peer.url.startswith("https://127.0.0.1:")

        await asyncio.to_thread(peer.put_stream, KEY, [b'{"step": 4}'])
        got = await asyncio.to_thread(lambda: b"".join(peer.get_stream(KEY)))
        keys = await asyncio.to_thread(peer.keys, "job-1/")

    assert got == b'{"step": 4}'
    assert keys == [KEY]
    assert (tmp_path / "peer" / KEY).read_bytes() == got


async def test_a_buddy_whose_certificate_another_ca_signed_is_refused_and_sent_nothing(
    ca: Authority, tmp_path: Path
) -> None:
    other = make_authority(tmp_path / "other")
    async with tls_buddy(tmp_path / "peer", ca.issue("n02")) as port:
        peer = store(port, client_context(other.ca))

        with pytest.raises(PeerError, match=r"peer n02 failed: .*CERTIFICATE_VERIFY_FAILED"):
            await asyncio.to_thread(peer.put_stream, KEY, [b"{}"])

    assert not (tmp_path / "peer" / KEY).exists()


async def test_a_buddy_whose_certificate_names_another_address_is_refused(
    ca: Authority, tmp_path: Path
) -> None:
    elsewhere = ca.issue("n09", ips=("10.0.0.9",), dns=("n09.cluster",))
    async with tls_buddy(tmp_path / "peer", elsewhere) as port:
        peer = store(port, client_context(ca.ca))

        with pytest.raises(PeerError, match="IP address mismatch"):
            await asyncio.to_thread(peer.put_stream, KEY, [b"{}"])


async def test_a_plain_http_client_gets_nothing_from_a_tls_buddy(
    ca: Authority, tmp_path: Path
) -> None:
    async with tls_buddy(tmp_path / "peer", ca.issue("n02")) as port:
        with pytest.raises((PeerError, OSError)):
            await asyncio.to_thread(store(port, None).keys, "job-1/")
