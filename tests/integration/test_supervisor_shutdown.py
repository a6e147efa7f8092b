"""The supervisor's shutdown drains what it received: nothing acknowledged to the broker
is left behind in its queues.

The supervisor runs in this process against a real Mosquitto; the test speaks MQTT as
the nodes do. The publisher's batch delay of landings and releases is made long (the
fault: the shutdown comes before a batch is due), so only the shutdown can handle them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiomqtt
import pytest

import supervisor.checkpoints.publisher
from phalanx import wire
from phalanx.jobspec import validate_spec
from phalanx.settings import MqttSettings
from supervisor.checkpoints.rows import CkptRows
from supervisor.config import ApiSettings, SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.store import Store
from tests import wait
from tests.harness import TOKEN, Broker

pytestmark = pytest.mark.integration

NODES = ("n01", "n02")


def settings_for(tmp_path: Path, broker: Broker) -> SupervisorSettings:
    return SupervisorSettings(
        state_dir=tmp_path / "supervisor",
        mqtt=MqttSettings(port=broker.port, reconnect_max_s=1.0),
        api=ApiSettings(port=0),
    )


def landing(job: str, rank: int, step: int) -> wire.CkptLanding:
    return wire.CkptLanding(
        node=NODES[rank],
        job=job,
        step=step,
        rank=rank,
        tier="nvme",
        nbytes=100,
        checksum=f"xxh3_128:{rank:032x}",
        at=time.time(),
    )


class Nodes:
    """The nodes' side of the broker: what they publish, and the catalogs they are sent."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.catalogs: dict[str, list[bytes]] = {}

    async def listen(self) -> None:
        async for message in self.client.messages:
            payload = message.payload if isinstance(message.payload, bytes) else b""
            self.catalogs.setdefault(str(message.topic), []).append(payload)

    async def send(self, message: wire.CkptLanding | wire.CkptReleased) -> None:
        await self.client.publish(wire.ckpt_topic(message.node), wire.encode(message), qos=1)

    def last(self, job: str, node: str) -> wire.CkptCatalog | None:
        """The newest catalog the node was sent for the job (None: none, or cleared)."""
        sent = self.catalogs.get(wire.catalog_topic(job, node))
        if not sent or not sent[-1]:
            return None
        msg = wire.parse(wire.catalog_topic(job, node), sent[-1]).message
        assert isinstance(msg, wire.CkptCatalog)
        return msg


@contextlib.asynccontextmanager
async def nodes_on(broker: Broker) -> AsyncIterator[Nodes]:
    async with aiomqtt.Client("127.0.0.1", broker.port, identifier="test-nodes") as client:
        await client.subscribe("phalanx/v1/job/+/ckpt/+", qos=1)
        nodes = Nodes(client)
        listener = asyncio.create_task(nodes.listen())
        try:
            yield nodes
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener


def committed(catalog: wire.CkptCatalog | None) -> list[int] | None:
    return None if catalog is None else [s.step for s in catalog.steps]


async def until(check: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    await wait.until(check, timeout, what)


async def handled(sup: Supervisor, nodes: Nodes) -> None:
    """Wait until the supervisor has handled what the nodes sent so far: a heartbeat sent
    after it (one client, delivered in order) has been counted."""
    seen = sup.registry.heartbeats
    beat = wire.Heartbeat(
        node=NODES[0],
        seq=0,
        n=0,
        sent_at=time.time(),
        health=wire.Health(status=wire.HealthStatus.OK),
    )
    await nodes.client.publish(wire.heartbeat_topic(NODES[0]), wire.encode(beat), qos=1)
    await until(lambda: sup.registry.heartbeats > seen, "the supervisor to handle the messages")


def submit(sup: Supervisor) -> str:
    spec = validate_spec(
        {
            "name": "drain",
            "team": "t",
            "command": ["true"],
            "workdir": "/tmp",
            "nodes": 2,
            "ranks_per_node": 1,
            "checkpoint": {"tiers": ["nvme"]},
        }
    )
    return sup.jobs.submit(spec).id


async def test_releases_received_just_before_shutdown_clear_their_catalogs(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tmp_path, broker)
    async with nodes_on(broker) as nodes:
        async with Supervisor(settings, TOKEN) as sup:
            await until(lambda: sup.link.connected, "the supervisor's link")
            job = submit(sup)
            for rank in range(2):
                await nodes.send(landing(job, rank, step=4))
            await until(
                lambda: all(committed(nodes.last(job, n)) == [4] for n in NODES),
                "the catalogs of step 4",
            )
            sup.jobs.cancel(job)
            await until(
                lambda: all((c := nodes.last(job, n)) and c.ended for n in NODES),
                "the ended catalogs",
            )
            monkeypatch.setattr(supervisor.checkpoints.publisher, "BATCH_S", 60.0)
            for node in NODES:  # both nodes let go of the job; then the supervisor stops
                await nodes.send(wire.CkptReleased(node=node, job=job, at=time.time()))
            await handled(sup, nodes)
        # The supervisor has stopped; the broker delivers its clears (empty retained messages).
        await until(
            lambda: all(nodes.catalogs[wire.catalog_topic(job, n)][-1] == b"" for n in NODES),
            "the catalogs cleared",
        )

    store = Store(settings.state_dir / "state.db")
    try:
        assert CkptRows.of(store).ended_catalogs_released(job)
    finally:
        store.close()


async def test_landings_received_just_before_shutdown_are_recorded_and_their_catalogs_sent(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tmp_path, broker)
    async with nodes_on(broker) as nodes:
        async with Supervisor(settings, TOKEN) as sup:
            await until(lambda: sup.link.connected, "the supervisor's link")
            job = submit(sup)
            monkeypatch.setattr(supervisor.checkpoints.publisher, "BATCH_S", 60.0)
            for rank in range(2):
                await nodes.send(landing(job, rank, step=4))
            await handled(sup, nodes)
        await until(
            lambda: all(committed(nodes.last(job, n)) == [4] for n in NODES),
            "the catalogs of step 4",
        )

    store = Store(settings.state_dir / "state.db")
    try:
        assert [step for step, _, _ in CkptRows.of(store).commits(job)] == [4]
    finally:
        store.close()
