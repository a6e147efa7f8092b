"""Every HTTP server of the daemons bounds what a client can hold: a connection that
sends nothing, or trickles its request head or its body one byte a second, is cut off;
one address has at most so many requests in flight at the agent.

Real apps (the supervisor's and the agent's, built but never started) served by
``phalanx.http.serve`` on loopback ports with short limits, and raw sockets as clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agentd.access import Access
from agentd.ckpt import add_peer_routes
from agentd.config import AgentSettings, CkptSettings, GpuSettings, HttpSettings, Thresholds
from agentd.daemon import Agent
from agentd.gpu.sim import SimBackend
from agentd.http import make_app as agent_app
from phalanx.http import BODY_TIMEOUT, serve
from supervisor.api.app import make_app as supervisor_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from tests.wait import until

TOKEN = "t" * 32
IDLE_S = 1.0
SHARD_KEY = "job-1/000000000001/rank-00000.phx"


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[int]:
    async with serve(
        app, lambda runner: web.TCPSite(runner, "127.0.0.1", 0), "test", idle_timeout_s=IDLE_S
    ) as runner:
        yield int(runner.addresses[0][1])


@pytest.fixture
async def supervisor_port(tmp_path: Path) -> AsyncIterator[int]:
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    app = supervisor_app(sup)
    app[BODY_TIMEOUT] = 1.5
    try:
        async with served(app) as port:
            yield port
    finally:
        sup.store.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    (tmp_path / "shm").mkdir()
    settings = AgentSettings(
        node_id="n01",
        data_dir=tmp_path / "data",
        gpu=GpuSettings(backend="sim", sim_gpus=1),
        http=HttpSettings(port=0, token_file=token_file, max_requests_per_peer=2),
        ckpt=CkptSettings(shm_dir=tmp_path / "shm"),
        thresholds=Thresholds(disk_drain_bytes=0, disk_warn_fraction=0),
    )
    backend = SimBackend(settings.sim_path(), node_id="n01", gpus=1, model="sim")
    a = Agent(settings, backend)
    try:
        yield a
    finally:
        a._sampler.shutdown(wait=True)
        backend.close()


@pytest.fixture
async def agent_port(agent: Agent) -> AsyncIterator[int]:
    try:
        async with served(agent_app(agent)) as port:
            yield port
    finally:
        await agent.ckpt.close()


class Trickler:
    """A raw client: sends ``data`` one byte every ``every`` s (``data`` empty: sends
    nothing) until the server answers or closes; records when, and how much it sent."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.settimeout(0.05)
        self.sent = 0

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def trickle(
        self, data: bytes, *, every: float = 1.0, limit_s: float = 20.0
    ) -> tuple[float, bytes]:
        """(seconds until the server answered or closed, what it answered)."""
        start = time.monotonic()
        next_at = start
        while time.monotonic() - start < limit_s:
            if self.sent < len(data) and time.monotonic() >= next_at:
                try:
                    self.sock.send(data[self.sent : self.sent + 1])
                except OSError:  # reset: closed by the server
                    return time.monotonic() - start, b""
                self.sent += 1
                next_at += every
            try:
                answer = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return time.monotonic() - start, b""
            return time.monotonic() - start, answer
        raise AssertionError(f"the server neither answered nor closed within {limit_s} s")

    def close(self) -> None:
        self.sock.close()


def head(method: str, path: str, length: int, *, auth: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {length}"]
    if auth:
        lines.append(f"Authorization: Bearer {TOKEN}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def trickled(port: int, before: bytes, data: bytes) -> tuple[float, bytes, int]:
    client = Trickler(port)
    try:
        if before:
            client.send(before)
        took, answer = await asyncio.to_thread(client.trickle, data)
        return took, answer, client.sent
    finally:
        client.close()


@pytest.fixture(params=["supervisor", "agent"])
async def any_port(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[int]:
    """The supervisor's API, then the agent's HTTP port."""
    if request.param == "supervisor":
        sup = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
        try:
            async with served(supervisor_app(sup)) as port:
                yield port
        finally:
            sup.store.close()
        return
    agent = request.getfixturevalue("agent")
    try:
        async with served(agent_app(agent)) as port:
            yield port
    finally:
        await agent.ckpt.close()


async def test_a_client_that_connects_and_sends_nothing_is_cut_off_after_the_idle_timeout(
    any_port: int,
) -> None:
    port = any_port
    took, answer, _ = await trickled(port, b"", b"")

    assert answer == b""  # closed, without a word
    assert IDLE_S - 0.1 <= took < IDLE_S + 2


async def test_a_request_head_trickled_one_byte_a_second_is_cut_off_before_it_is_whole(
    any_port: int,
) -> None:
    port = any_port
    whole = head("POST", "/v1/jobs", 2)

    took, answer, sent = await trickled(port, b"", whole)

    assert answer == b""
    assert sent < len(whole) and took < IDLE_S + 2


async def test_a_json_body_trickled_one_byte_a_second_is_answered_408(
    supervisor_port: int,
) -> None:
    took, answer, sent = await trickled(
        supervisor_port, head("POST", "/v1/nodes/n01/drain", 100), b'{"reason": "' + b"x" * 90
    )

    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"request body not received whole within 1.5 s" in answer
    assert sent < 100 and took < 1.5 + 2


@contextlib.asynccontextmanager
async def peer_routes(agent: Agent) -> AsyncIterator[int]:
    """The agent's peer routes alone, with a 1.5 s idle limit and a 1 KiB/s floor."""
    app = web.Application()
    add_peer_routes(app, agent, Access("n01", TOKEN), idle_s=1.5, min_rate=1024)
    try:
        async with served(app) as port:
            yield port
    finally:
        await agent.ckpt.close()


async def test_a_peer_push_trickled_one_byte_a_second_is_cut_off_with_408(agent: Agent) -> None:
    async with peer_routes(agent) as port:
        took, answer, sent = await trickled(
            port, head("PUT", f"/v1/ckpt/peer/objects/{SHARD_KEY}", 4096), bytes(4096)
        )

    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"under 1024 bytes/s" in answer
    assert sent <= 3 and took < 4
    assert not list((agent.ckpt.peer_root).rglob("*.phx"))


async def test_a_peer_push_that_stalls_after_its_head_is_cut_off_with_408(agent: Agent) -> None:
    async with peer_routes(agent) as port:
        took, answer, _ = await trickled(
            port, head("PUT", f"/v1/ckpt/peer/objects/{SHARD_KEY}", 4096), b""
        )

    assert answer.startswith(b"HTTP/1.1 408 ")
    assert f"no byte of {SHARD_KEY} for 1.5 s".encode() in answer
    assert took < 3.5


async def test_an_address_with_its_limit_of_requests_in_flight_is_answered_429_until_one_ends(
    agent_port: int,
) -> None:
    stalled = [Trickler(agent_port) for _ in range(2)]  # max_requests_per_peer=2
    for client in stalled:  # each holds a push's handler, waiting for its body
        client.send(head("PUT", f"/v1/ckpt/peer/objects/{SHARD_KEY}", 4096))

    async def healthz(want: int) -> tuple[int, str] | None:
        got = await get(agent_port, "/healthz")
        return got if got[0] == want else None

    try:
        _, answer = await until(lambda: healthz(429), 5.0, "both pushes held in flight")
        assert "has 2 requests in flight already" in answer
    finally:
        for client in stalled:
            client.close()

    # The handlers end once their connections are gone.
    await until(lambda: healthz(200), 5.0, "a 200 once the stalled pushes closed")


async def get(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}") as resp,
    ):
        return resp.status, await resp.text()


@pytest.mark.parametrize(
    ("request_bytes", "problem"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "Missing 'Host' header"),
        (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "Got more than 8190 bytes"),
    ],
    ids=["no Host", "a line past 8 KiB"],
)
async def test_a_request_aiohttp_cannot_parse_is_a_400_logged_as_one_warning_line(
    any_port: int, caplog: pytest.LogCaptureFixture, request_bytes: bytes, problem: str
) -> None:
    client = Trickler(any_port)
    try:
        client.send(request_bytes)
        _, answer = await asyncio.to_thread(client.trickle, b"")
    finally:
        client.close()

    assert answer.startswith(b"HTTP/1.0 400 Bad Request")
    [record] = [r for r in caplog.records if r.name == "phalanx.http.server"]
    assert record.levelname == "WARNING" and record.exc_info is None
    assert problem in record.getMessage()


class SlowReader:
    """A raw client that asks for a peer object and reads it slowly through a small
    receive buffer; records what it got (head and body)."""

    def __init__(self, port: int, key: str, *, rcvbuf: int = 16384) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(0.05)
        lines = [f"GET /v1/ckpt/peer/objects/{key} HTTP/1.1", "Host: test"]
        lines.append(f"Authorization: Bearer {TOKEN}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.received = b""

    def read(self, rate: float, for_s: float) -> bool:
        """Read at most ``rate`` bytes/s for ``for_s`` s, then the rest as fast as it
        comes; True when the connection ended (closed or reset) within 20 s more. What
        the server sent before it gave up sits in the sockets' buffers: only once that
        is read does the end show."""
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < for_s + 20:
            slow = elapsed < for_s
            try:
                piece = self.sock.recv(max(1, min(1 << 16, int(rate / 10))) if slow else 1 << 20)
            except TimeoutError:
                continue
            except OSError:  # reset: dropped by the server
                return True
            if not piece:
                return True
            self.received += piece
            if slow:  # wait until the average is back under the rate
                time.sleep(max(0.0, len(self.received) / rate - (time.monotonic() - start)))
        return False

    def body_and_length(self) -> tuple[int, int]:
        head, _, body = self.received.partition(b"\r\n\r\n")
        [length] = [
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if b"Content-Length" in line
        ]
        assert head.startswith(b"HTTP/1.1 200 ")
        return len(body), length

    def close(self) -> None:
        self.sock.close()


def peer_object(agent: Agent, nbytes: int) -> str:
    key = "job-1/000000000001/manifest.json"  # any object: the route never parses it
    path = agent.ckpt.peer_root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(nbytes))
    return key


async def test_a_peer_object_read_one_byte_a_second_is_cut_off_and_logged_naming_the_key(
    agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    key = peer_object(agent, 64 << 20)  # far past what the sockets' buffers can hold
    async with peer_routes(agent) as port:
        client = SlowReader(port, key)
        try:
            closed = await asyncio.to_thread(client.read, 1, 4.0)
        finally:
            client.close()

    assert closed
    got, length = client.body_and_length()
    assert length == 64 << 20 and got < length  # short: never mistaken for a whole copy
    [line] = [r.getMessage() for r in caplog.records if r.name == "agentd.ckpt.peer_routes"]
    assert line.startswith(f"cut off {key} read by peer 127.0.0.1: ")
    assert "the peer did not take the next piece" in line and "within 1.5 s" in line


async def test_a_peer_object_read_under_the_rate_floor_is_cut_off_once_the_idle_time_passed(
    agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    key = peer_object(agent, 64 << 20)
    app = web.Application()  # a floor of 64 MiB/s; the reader takes 8 MiB/s
    add_peer_routes(app, agent, Access("n01", TOKEN), idle_s=1.0, min_rate=64 << 20)
    try:
        async with served(app) as port:
            client = SlowReader(port, key, rcvbuf=1 << 20)
            try:
                closed = await asyncio.to_thread(client.read, 8 << 20, 3.0)
            finally:
                client.close()
    finally:
        await agent.ckpt.close()

    assert closed
    got, length = client.body_and_length()
    assert 0 < got < length
    [line] = [r.getMessage() for r in caplog.records if r.name == "agentd.ckpt.peer_routes"]
    assert line.startswith(f"cut off {key} read by peer 127.0.0.1: the peer took ")
    assert "under 67108864 bytes/s" in line


async def test_a_peer_object_read_at_full_speed_arrives_whole_with_its_length(
    agent: Agent,
) -> None:
    data = bytes(range(256)) * (12 << 12)  # 12 MiB: more than one piece and one block
    key = "job-1/000000000001/rank-00000.phx"
    (agent.ckpt.peer_root / "job-1/000000000001").mkdir(parents=True)
    (agent.ckpt.peer_root / key).write_bytes(data)
    async with peer_routes(agent) as port, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v1/ckpt/peer/objects/{key}"
        async with session.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200 and resp.content_length == len(data)
            assert await resp.read() == data
        async with session.get(
            url.replace("rank-00000", "rank-00001"), headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:
            assert resp.status == 404


async def test_a_peer_object_reader_that_hangs_up_midway_ends_the_answer_without_an_error(
    agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="agentd.ckpt.peer_routes")
    key = peer_object(agent, 64 << 20)
    async with peer_routes(agent) as port:
        client = SlowReader(port, key, rcvbuf=1 << 20)
        await asyncio.to_thread(client.sock.recv, 1 << 16)  # the answer has begun
        client.close()
        deadline = time.monotonic() + 10
        while not [r for r in caplog.records if r.name == "agentd.ckpt.peer_routes"]:
            assert time.monotonic() < deadline, "the answer did not end 10 s after the hang-up"
            await asyncio.sleep(0.05)

    [line] = [r for r in caplog.records if r.name == "agentd.ckpt.peer_routes"]
    assert line.levelname == "DEBUG" and "closed the connection reading" in line.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
