"""The point-to-point bandwidth probe: how fast bytes come from another node to this one.

A replacement node may pass every health check and still reach the rest of its gang
through a degraded link (a NIC fallen back to a lower speed, a cable dropping packets);
every step of a synchronous gang then waits for it. The supervisor asks a node to probe
(``wire.ProbeLinkArgs``): the node reads a stream of zeros from the other node's
``GET /v1/probe?bytes=N`` for at most ``max_s`` and reports the rate, which the
supervisor compares with the fleet's (``supervisor.fleet.screening``).

The route is a peer route (``agentd.access``): the node's own token or a peer's
credential opens it, nothing else. At most ``MAX_STREAMS`` probes stream from a node at
once (a second prober would halve the first one's figure); one more is answered 429.
What it measures is what one HTTP stream of this process carries: a link much faster
than Python's own loop (a 400 Gb/s NIC) reads as about a few GB/s either way, so the
probe finds links degraded far below what a node normally gets, not a few per cent.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

import aiohttp
from aiohttp import web

from agentd.access import Access
from phalanx import wire
from phalanx.agent_tokens import NODE_HEADER

log = logging.getLogger(__name__)

__all__ = ["MAX_PROBE_BYTES", "PROBE_ROUTE", "ProbeFailed", "add_probe_route", "probe"]

PROBE_ROUTE = "/v1/probe"
MAX_PROBE_BYTES = 1 << 30
MAX_STREAMS = 1
# A stream ends by this time, whatever the prober does (one that stops reading would hold
# the route): the longest probe the wire allows, and room for a slow start.
MAX_STREAM_S = 45.0
CHUNK = 1 << 20
_ZEROS = bytes(CHUNK)


class ProbeFailed(RuntimeError):
    """The probe could not measure. ``reached``: the peer's agent answered (it refused the
    probe, or is too old to know it): no word on the link. Otherwise the link itself
    failed (no connection, a stream that stalled): the supervisor treats that as a link
    too slow to use."""

    def __init__(self, message: str, *, reached: bool) -> None:
        super().__init__(message)
        self.reached = reached


def add_probe_route(app: web.Application, access: Access) -> None:
    streams = asyncio.Semaphore(MAX_STREAMS)

    async def serve_probe(request: web.Request) -> web.StreamResponse:
        if (denied := access.check(request, peer_route=True)) is not None:
            return denied.response()
        raw = request.query.get("bytes", "")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 10) or not (
            1 <= int(raw) <= MAX_PROBE_BYTES
        ):
            return web.json_response(
                {"error": f"bytes must be an integer from 1 to {MAX_PROBE_BYTES}, not {raw!r}"},
                status=400,
            )
        if streams.locked():
            return web.json_response(
                {"error": f"node {access.node} is streaming another probe; try again"},
                status=429,
            )
        nbytes = int(raw)
        async with streams:
            response = web.StreamResponse(
                headers={"Content-Type": "application/octet-stream"},
            )
            response.content_length = nbytes
            await response.prepare(request)
            left = nbytes
            # The prober hangs up once it has measured long enough: that ends the stream.
            try:
                async with asyncio.timeout(MAX_STREAM_S):
                    while left > 0:
                        chunk = _ZEROS if left >= CHUNK else _ZEROS[:left]
                        await response.write(chunk)
                        left -= len(chunk)
                    await response.write_eof()
            except ConnectionError:
                pass
            except TimeoutError:
                log.warning(
                    "a probe stream to %s ran past %.0f s: cut off",
                    request.headers.get(NODE_HEADER, request.remote),
                    MAX_STREAM_S,
                )
                if request.transport is not None:
                    request.transport.close()
            return response

    app.router.add_get(PROBE_ROUTE, serve_probe)


def _url(peer: wire.PeerAddr, tls: bool, nbytes: int) -> str:
    host = f"[{peer.address}]" if ":" in peer.address else peer.address
    return f"{'https' if tls else 'http'}://{host}:{peer.http_port}{PROBE_ROUTE}?bytes={nbytes}"


async def probe(
    node: str,
    peer: wire.PeerAddr,
    nbytes: int,
    max_s: float,
    ssl_context: ssl.SSLContext | None,
    *,
    connect_s: float = 5.0,
) -> dict[str, Any]:
    """Read ``nbytes`` (at most ``max_s`` seconds of them) from ``peer``'s probe route as
    ``node``; ``{"mb_s", "nbytes", "seconds", "peer"}``. The time runs from the first
    of its first chunk (not counted): the connection's setup, the TLS handshake and what
    arrived before the first read are not the link's rate.
    Raises :class:`ProbeFailed` saying why when it cannot measure."""
    token = peer.token.get_secret_value() if peer.token is not None else ""
    headers = {"Authorization": f"Bearer {token}", NODE_HEADER: node}
    timeout = aiohttp.ClientTimeout(total=connect_s + max_s + 5.0, sock_connect=connect_s)
    got = 0
    first = b""
    started: float | None = None
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(
                _url(peer, ssl_context is not None, nbytes),
                headers=headers,
                ssl=ssl_context if ssl_context is not None else False,
            ) as response,
        ):
            if response.status != 200:
                text = (await response.text(errors="replace"))[:300]
                raise ProbeFailed(
                    f"the probe route of node {peer.node} answered {response.status}: {text}",
                    reached=True,
                )
            # Timed from the first chunk, which is not counted: what arrived with the
            # headers, or before the first read, came in no measured time.
            reader = response.content
            first = await reader.readany()
            started = time.monotonic()
            while first and len(first) + got < nbytes:
                chunk = await reader.readany()
                if not chunk:
                    break
                got += len(chunk)
                if time.monotonic() - started >= max_s:
                    break
            ended = time.monotonic()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ProbeFailed(
            f"could not probe the link from node {peer.node} "
            f"({peer.address}:{peer.http_port}): {type(exc).__name__}: {exc}",
            reached=False,
        ) from exc
    seconds = ended - started if started is not None else 0.0
    total = len(first) + got
    if got <= 0 or seconds <= 0:
        whole = total >= nbytes  # all of it in the first chunk: too small to time
        raise ProbeFailed(
            f"the probe of node {peer.node} "
            + (
                f"came in one chunk ({total} bytes): too small to time"
                if whole
                else f"stopped after {total} of {nbytes} bytes"
            ),
            reached=whole,
        )
    if total < nbytes and seconds < max_s:
        raise ProbeFailed(
            f"the probe of node {peer.node} stopped after {total} of {nbytes} bytes",
            reached=False,
        )
    return {
        "mb_s": round(got / seconds / 1e6, 3),
        "nbytes": got,
        "seconds": round(seconds, 4),
        "peer": peer.node,
    }
