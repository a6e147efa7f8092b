"""The point-to-point bandwidth probe: how fast bytes go between this node and another.

A replacement node may pass every health check and still reach the rest of its gang
through a degraded link (a NIC fallen back to a lower speed, a cable dropping packets);
every step of a synchronous gang then waits for it. The supervisor asks a node to probe
(``wire.ProbeLinkArgs``): the node reads a stream of zeros from the other node's
``GET /v1/probe?bytes=N`` for at most ``max_s`` and reports the rate, which the
supervisor compares with the fleet's (``supervisor.fleet.screening``).

A degraded link may be slow one way only. With ``both_ways`` (an agent that announces
``wire.FEATURE_PROBE_BOTH_WAYS`` in its birth) the node then sends as many zeros to the
other node's ``POST /v1/probe?bytes=N`` (for at most ``max_s`` too), which times what it
reads as the GET's prober does and answers ``{"mb_s", "nbytes", "seconds"}``: one command
measures both ways. The node reports that figure under ``back``; a back way that could
not be measured leaves the forward figure standing, with ``back_error`` and
``back_reached`` saying why.

The routes are peer routes (``agentd.access``): the node's own token or a peer's
credential opens them, nothing else. At most ``MAX_STREAMS`` probe streams, of either
direction, run on a node at once (a second prober would halve the first one's figure);
one more is answered 429. What it measures is what one HTTP stream of this process
carries: a link much faster than Python's own loop (a 400 Gb/s NIC) reads as about a few
GB/s either way, so the probe finds links degraded far below what a node normally gets,
not a few per cent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
from collections.abc import AsyncIterator
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
# How long the back way asks again while the peer answers 429: the forward way's stream
# may still hold the peer's route for a moment after the prober hung up on it.
BUSY_RETRY_S = 1.0
_BUSY_PAUSE_S = 0.05


class ProbeFailed(RuntimeError):
    """The probe could not measure. ``reached``: the peer's agent answered (it refused the
    probe, or is too old to know it): no word on the link. Otherwise the link itself
    failed (no connection, a stream that stalled): the supervisor treats that as a link
    too slow to use."""

    def __init__(self, message: str, *, reached: bool) -> None:
        super().__init__(message)
        self.reached = reached


def add_probe_route(app: web.Application, access: Access) -> None:
    """``GET`` and ``POST`` on :data:`PROBE_ROUTE`: stream zeros to a prober, or time
    what a prober sends; one stream of either kind at a time."""
    streams = asyncio.Semaphore(MAX_STREAMS)

    def refused(request: web.Request) -> web.Response | int:
        """The answer to a request that may not stream now, or the bytes it asked for."""
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
        return int(raw)

    def cut_off(request: web.Request, what: str) -> None:
        log.warning(
            "a probe stream %s %s ran past %.0f s: cut off",
            what,
            request.headers.get(NODE_HEADER, request.remote),
            MAX_STREAM_S,
        )
        if request.transport is not None:
            request.transport.close()

    async def serve_probe(request: web.Request) -> web.StreamResponse:
        if isinstance(nbytes := refused(request), web.Response):
            return nbytes
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
                cut_off(request, "to")
            return response

    async def take_probe(request: web.Request) -> web.StreamResponse:
        if isinstance(nbytes := refused(request), web.Response):
            return nbytes
        async with streams:
            # Read as it streams (never whole: up to a GiB), timed as ``probe`` times
            # the GET: from the end of the first chunk, which is not counted.
            reader = request.content
            got = 0
            try:
                async with asyncio.timeout(MAX_STREAM_S):
                    first = await reader.readany()
                    started = time.monotonic()
                    while first and len(first) + got < nbytes:
                        chunk = await reader.readany()
                        if not chunk:
                            break  # the prober stopped sending: it measured long enough
                        got += len(chunk)
                    ended = time.monotonic()
            except TimeoutError:
                cut_off(request, "from")
                return web.json_response(
                    {"error": f"the upload ran past {MAX_STREAM_S:.0f} s"}, status=408
                )
            except (ConnectionError, web.RequestPayloadError) as exc:
                # Gone, or a body that is not HTTP: whoever sent it gets no figure.
                return web.json_response(
                    {"error": f"the upload broke off: {type(exc).__name__}: {exc}"[:300]},
                    status=400,
                )
            total = min(len(first) + got, nbytes)
            seconds = ended - started
            if got <= 0 or seconds <= 0:
                return web.json_response(
                    {
                        "error": f"the upload came in one chunk ({total} bytes) or none: "
                        "too small to time"
                    },
                    status=400,
                )
            return web.json_response(
                {
                    "mb_s": round(got / seconds / 1e6, 3),
                    "nbytes": got,
                    "seconds": round(seconds, 4),
                }
            )

    app.router.add_get(PROBE_ROUTE, serve_probe)
    app.router.add_post(PROBE_ROUTE, take_probe)


def _url(peer: wire.PeerAddr, tls: bool, nbytes: int) -> str:
    host = f"[{peer.address}]" if ":" in peer.address else peer.address
    return f"{'https' if tls else 'http'}://{host}:{peer.http_port}{PROBE_ROUTE}?bytes={nbytes}"


def _headers(node: str, peer: wire.PeerAddr) -> dict[str, str]:
    token = peer.token.get_secret_value() if peer.token is not None else ""
    return {"Authorization": f"Bearer {token}", NODE_HEADER: node}


async def probe(
    node: str,
    peer: wire.PeerAddr,
    nbytes: int,
    max_s: float,
    ssl_context: ssl.SSLContext | None,
    *,
    both_ways: bool = False,
    connect_s: float = 5.0,
) -> dict[str, Any]:
    """Read ``nbytes`` (at most ``max_s`` seconds of them) from ``peer``'s probe route as
    ``node``; ``{"mb_s", "nbytes", "seconds", "peer"}``. The time runs from the first
    of its first chunk (not counted): the connection's setup, the TLS handshake and what
    arrived before the first read are not the link's rate.
    Raises :class:`ProbeFailed` saying why when it cannot measure.

    ``both_ways``: then send ``nbytes`` (at most ``max_s`` seconds of them) to the peer,
    which times them; its figure is added under ``back``, or, when that way could not be
    measured, ``back_error`` and ``back_reached`` (:attr:`ProbeFailed.reached`)."""
    found = await _read(node, peer, nbytes, max_s, ssl_context, connect_s=connect_s)
    if both_ways:
        try:
            found["back"] = await _send(node, peer, nbytes, max_s, ssl_context, connect_s)
        except ProbeFailed as exc:
            found["back_error"] = str(exc)
            found["back_reached"] = exc.reached
    return found


async def _read(
    node: str,
    peer: wire.PeerAddr,
    nbytes: int,
    max_s: float,
    ssl_context: ssl.SSLContext | None,
    *,
    connect_s: float,
) -> dict[str, Any]:
    headers = _headers(node, peer)
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


async def _zeros(nbytes: int, max_s: float) -> AsyncIterator[bytes]:
    """``nbytes`` zeros in chunks of ``CHUNK``; fewer once ``max_s`` has passed since the
    first chunk went out."""
    left = nbytes
    started: float | None = None
    while left > 0:
        chunk = _ZEROS if left >= CHUNK else _ZEROS[:left]
        yield chunk  # resumed once it is written
        left -= len(chunk)
        if started is None:
            started = time.monotonic()
        elif time.monotonic() - started >= max_s:
            return


async def _send(
    node: str,
    peer: wire.PeerAddr,
    nbytes: int,
    max_s: float,
    ssl_context: ssl.SSLContext | None,
    connect_s: float,
) -> dict[str, Any]:
    """Send ``nbytes`` zeros (at most ``max_s`` seconds of them) to ``peer``'s probe
    route; the peer's figure, ``{"mb_s", "nbytes", "seconds"}``. Raises
    :class:`ProbeFailed` when it cannot measure."""
    where = f"node {peer.node} ({peer.address}:{peer.http_port})"
    timeout = aiohttp.ClientTimeout(sock_connect=connect_s)
    try:
        async with (
            asyncio.timeout(connect_s + max_s + 5.0),
            aiohttp.ClientSession(timeout=timeout) as session,
        ):
            busy_until = time.monotonic() + BUSY_RETRY_S
            while True:
                async with session.post(
                    _url(peer, ssl_context is not None, nbytes),
                    data=_zeros(nbytes, max_s),
                    headers=_headers(node, peer),
                    ssl=ssl_context if ssl_context is not None else False,
                ) as response:
                    status = response.status
                    text = await response.text(errors="replace")
                if status != 429 or time.monotonic() >= busy_until:
                    break
                await asyncio.sleep(_BUSY_PAUSE_S)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ProbeFailed(
            f"could not probe the link to {where}: {type(exc).__name__}: {exc}",
            reached=False,
        ) from exc
    if status != 200:
        raise ProbeFailed(
            f"the probe route of node {peer.node} answered {status} to the upload: {text[:300]}",
            reached=True,
        )
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    figure = (
        {k: answer.get(k) for k in ("mb_s", "nbytes", "seconds")}
        if isinstance(answer, dict)
        else {}
    )
    if not figure or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        for v in figure.values()
    ):
        raise ProbeFailed(
            f"node {peer.node} timed the upload with no figure: {text[:200]!r}", reached=True
        )
    return figure
