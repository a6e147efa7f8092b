"""The agent role's leader discovery (tasks/leader.yml), which rolling-upgrade.yml and the
agent role's own API calls use: with standby supervisors (issue 26) the first host of
`supervisors` may answer every call 503. Played against a real standby API
(``supervisor.standby.standby_app``) and a fake leader, each on its own port."""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml
from aiohttp import web

from supervisor.leadership import Leader, Leadership
from supervisor.standby import standby_app
from tests.rollout.rollout_env import run_playbook, tail

pytestmark = pytest.mark.rollout

PLAYBOOK = """
- name: Find the leader as the agent role does
  hosts: agents
  gather_facts: false
  tasks:
    - name: Leader discovery
      ansible.builtin.include_role:
        name: agent
        tasks_from: leader.yml
    - name: Say what it found
      ansible.builtin.debug:
        msg: "LEADER={{ _phalanx_api_leader }} FOUND={{ _phalanx_api_leader_found }}"
"""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.contextmanager
def serving(
    app: web.Application, tls: ssl.SSLContext | None = None
) -> Iterator[tuple[int, list[str]]]:
    """``app`` on a free port of 127.0.0.1 in a thread of its own; the paths it was asked."""
    asked: list[str] = []

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        asked.append(request.path)
        return await handler(request)

    app.middlewares.append(record)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
        return int(runner.addresses[0][1])

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(10), asked
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def leader_app() -> web.Application:
    async def leads(request: web.Request) -> web.Response:
        return web.json_response({"leading": True, "url": "", "leader": None, "term": 7})

    app = web.Application()
    app.router.add_get("/v1/leader", leads)
    return app


def standby(leader_url: str | None) -> web.Application:
    known = [Leader(7, "sup-b", leader_url, 0.0) if leader_url else None]
    own = cast(Leadership, SimpleNamespace(api_url="http://sup-a.invalid:8740"))
    return standby_app(own, known)


@pytest.fixture
def two_supervisors() -> Iterator[tuple[int, int, list[str]]]:
    """sup-a stands by, naming sup-b, which leads: (sup-a's port, sup-b's, what sup-a was asked)."""
    with (
        serving(leader_app()) as (lead_port, _),
        serving(standby(f"http://127.0.0.1:{lead_port}")) as (standby_port, asked),
    ):
        yield standby_port, lead_port, asked


def find(tmp_path: Path, ports: tuple[int, int], *args: str) -> tuple[str, str, str]:
    inventory: dict[str, Any] = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "phalanx_http_tls": False,
            },
            "children": {
                "supervisors": {
                    "hosts": {
                        name: {"phalanx_supervisor_api_url": f"http://127.0.0.1:{port}"}
                        for name, port in zip(("sup-a", "sup-b"), ports, strict=True)
                    }
                },
                "agents": {"hosts": {"gpu-x1": None, "gpu-x2": None}},
            },
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    ran = run_playbook(
        str(tmp_path / "play.yml"), tmp_path / "hosts.yml", tmp_path / "home", *args, timeout=120
    )
    assert ran.returncode == 0, tail(ran.stdout)
    found = set(re.findall(r"LEADER=([\w-]+) FOUND=(\w+)", ran.stdout))
    assert len(found) == 1, tail(ran.stdout)  # the same for every host of the play
    leader, ok = found.pop()
    return leader, ok, ran.stdout


def test_the_supervisor_that_leads_is_found_when_the_first_stands_by(
    tmp_path: Path, two_supervisors: tuple[int, int, list[str]]
) -> None:
    standby_port, lead_port, asked = two_supervisors

    leader, found, _ = find(tmp_path, (standby_port, lead_port))

    assert (leader, found) == ("sup-b", "True")
    assert asked == ["/v1/leader"]  # once for the play, not once per host


def test_an_explicit_api_delegate_wins_and_nobody_is_asked(
    tmp_path: Path, two_supervisors: tuple[int, int, list[str]]
) -> None:
    standby_port, lead_port, asked = two_supervisors

    leader, found, _ = find(tmp_path, (standby_port, lead_port), "-e", "phalanx_api_delegate=sup-a")

    assert (leader, found) == ("sup-a", "True")
    assert asked == []


def test_without_a_leader_the_first_host_is_used_and_said_not_found(tmp_path: Path) -> None:
    # A standby that knows of no leader yet, and a second supervisor that does not answer.
    with serving(leader_app()) as (gone, _):
        pass
    with serving(standby(None)) as (standby_port, asked):
        leader, found, _ = find(tmp_path, (standby_port, gone))

    assert (leader, found) == ("sup-a", "False")
    assert asked == ["/v1/leader"]
