"""GET /v1/nodes keeps each node's entry encoded until something it shows changes: after
every kind of change the listing is what each node's own view says (never a stale entry).

The real app of the real supervisor and its SQLite store, built but never started (no
broker), on aiohttp's test server; nodes changed through the registry as their messages
and the operator would change them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from phalanx import wire
from phalanx.jsonenc import dumps
from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.telemetry.slow_nodes import SlowJob, SlowNode
from tests.unit.supervisor.fake_fleet import birth, drain_health, heartbeat

TOKEN = "bootstrap-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NODES = ["n1", "n2", "n3"]


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    built = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    for node in NODES:
        built.registry.on_birth(birth(node))
    yield built
    built.store.close()


@pytest.fixture
async def client(sup: Supervisor) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(make_app(sup))) as c:
        yield c


async def listing(client: TestClient[Any, Any]) -> list[dict[str, Any]]:
    resp = await client.get("/v1/nodes", headers=ADMIN)
    assert resp.status == 200 and resp.content_type == "application/json"
    found: list[dict[str, Any]] = await resp.json()
    return found


async def each_view(client: TestClient[Any, Any]) -> list[dict[str, Any]]:
    """Every node's own view (``GET /v1/nodes/{id}``), less what only it shows."""
    views = []
    for node in NODES:
        view = await (await client.get(f"/v1/nodes/{node}", headers=ADMIN)).json()
        del view["gpu_gauges"], view["host"]
        views.append(view)
    return views


async def test_the_listing_shows_every_change_of_a_node_never_a_kept_stale_entry(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    reg = sup.registry
    first = await listing(client)
    assert first == await each_view(client)
    assert await listing(client) == first  # nothing changed: the same entries

    warm = wire.Health(
        status=wire.HealthStatus.WARN,
        reasons=[wire.Reason(code="thermal", severity="warn", gpu=1, detail="89 C")],
    )
    hot = wire.Health(
        status=wire.HealthStatus.OK,
        gpus=[wire.GpuGauges(index=0, temperature_c=77.0, ecc_sbe_volatile=9, throttle=["hw"])],
    )
    changes = [
        lambda: reg.on_heartbeat(heartbeat("n2", n=2)),  # heard again: its time alone
        lambda: reg.on_heartbeat(heartbeat("n2", n=3, health=hot)),  # new gauges alone
        lambda: reg.on_heartbeat(heartbeat("n1", health=warm)),  # a new health
        lambda: reg.on_heartbeat(heartbeat("n2", health=drain_health())),  # auto drain
        lambda: reg.drain("n2", "also swapping its fan"),  # the same drain's reason, in place
        lambda: reg.drain("n3", "maintenance"),
        lambda: reg.undrain("n3"),
        lambda: reg.mark_slow(
            {"n3": SlowNode("n3", (SlowJob("j-1", 4, 1.8, time.time()),), time.time())}
        ),
        lambda: reg.on_death(wire.NodeDeath(node="n1", seq=1, cause="lost")),
        lambda: setattr(sup.jobs, "spares", ("n3",)),
    ]
    for change in changes:
        before = await listing(client)
        change()
        after = await listing(client)
        assert after == await each_view(client)
        assert dumps(after) != dumps(before)
    assert [n["state"] for n in after] == ["offline", "drain", "warn"]
    assert after[1]["drain"]["reason"].endswith("operator: also swapping its fan")
    assert after[2]["spare"] is True


async def test_a_node_gone_from_the_registry_leaves_the_listing(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    await listing(client)
    del sup.registry.nodes["n2"]
    assert [n["id"] for n in await listing(client)] == ["n1", "n3"]
