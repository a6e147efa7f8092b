"""The API client with several supervisors (``PHALANX_API`` a comma-separated list): it
follows a standby's ``X-Phalanx-Leader`` and passes over one it cannot connect to."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from phalanx.client import ApiError, Client
from phalanx.local import free_port


class Supervisor:
    """A real HTTP server on loopback: a leader answers 200, a standby 503 naming
    ``leader`` (none: it names no one). Every request's method and path is kept."""

    def __init__(self, leader: str | None = None, *, standby: bool = False) -> None:
        self.seen: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                owner.seen.append(f"{self.command} {self.path}")
                if standby:
                    body = json.dumps({"error": "this supervisor stands by"}).encode()
                    self.send_response(503)
                    self.send_header("X-Phalanx-Standby", "1")
                    if leader:
                        self.send_header("X-Phalanx-Leader", leader)
                else:
                    body = json.dumps({"from": owner.url}).encode()
                    self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def leader() -> Iterator[Supervisor]:
    s = Supervisor()
    yield s
    s.close()


def test_a_standby_sends_the_client_to_the_leader_which_it_keeps_asking(
    leader: Supervisor,
) -> None:
    standby = Supervisor(leader.url, standby=True)
    try:
        client = Client(standby.url, "t", timeout=2)
        assert client.post("/v1/jobs", {"spec": {}}) == {"from": leader.url}
        assert client.get("/v1/nodes") == {"from": leader.url}
        assert client.base_url == leader.url
        assert standby.seen == ["POST /v1/jobs"]  # asked once, then no more
        assert leader.seen == ["POST /v1/jobs", "GET /v1/nodes"]  # the POST went once
    finally:
        standby.close()


def test_a_supervisor_that_refuses_connections_is_passed_over(leader: Supervisor) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = Client(f"{dead}, {leader.url}", "t", timeout=2)
    assert client.get("/v1/jobs") == {"from": leader.url}
    assert client.base_url == leader.url


def test_with_no_leader_to_be_found_the_error_names_every_supervisor_tried() -> None:
    standby = Supervisor(standby=True)  # names no leader: none leads yet
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        with pytest.raises(ApiError) as err:
            Client(f"{standby.url},{dead}", "t", timeout=2).get("/v1/jobs")
        assert err.value.status == 503  # the first error met: the standby's
        assert standby.url in str(err.value) and dead in str(err.value)
        with pytest.raises(ApiError) as alone:
            Client(standby.url, "t", timeout=2).get("/v1/jobs")
        assert alone.value.status == 503 and "stands by" in str(alone.value)
    finally:
        standby.close()


def test_an_empty_list_of_urls_is_refused() -> None:
    with pytest.raises(ApiError, match="no supervisor URL"):
        Client(" , ", "t")


def test_a_leaders_own_503_is_the_answer_and_no_other_supervisor_is_asked() -> None:
    """A 503 without ``X-Phalanx-Standby`` (the leader's store away, say) is not a
    standby's: the request is not sent to another supervisor."""

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.dumps({"error": "the store cannot be written"}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    other = Supervisor()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ApiError, match="the store cannot be written") as err:
            Client(f"{url},{other.url}", "t", timeout=2).post("/v1/jobs", {})
        assert err.value.status == 503 and other.seen == []
    finally:
        server.shutdown()
        server.server_close()
        other.close()
