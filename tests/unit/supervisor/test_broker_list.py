"""A supervisor on two brokers (``mqtt.brokers``): a command goes out where its node's
heartbeats come in, and the nodes of a broker that is lost while the other stays up get
a whole heartbeat timeout to reach the other, instead of timing out with it.

The supervisor and its registry are real; the links are not started (their state is
set), the registry's clock is the test's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx import wire
from phalanx.settings import MqttSettings
from supervisor.config import SupervisorSettings
from supervisor.daemon import OFFLINE_CONFIRM_S, Supervisor
from supervisor.fleet.registry import NodeState
from tests.unit.supervisor.fake_fleet import birth
from tests.unit.supervisor.test_metrics import Clock


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[tuple[Supervisor, Clock]]:
    settings = SupervisorSettings(
        state_dir=tmp_path,
        offline_after_s=15.0,
        mqtt=MqttSettings(brokers=["127.0.0.1:1883", "127.0.0.1:1884"]),
    )
    sup = Supervisor(settings, "t" * 24)
    clock = Clock()
    sup.registry.clock = clock
    for link in sup.link.links:
        link._connected.set()  # both links up (not started: nothing is sent)
    sup._link_up = [True, True]
    sup.link_since = clock.now - 100.0
    try:
        yield sup, clock
    finally:
        sup.store.close()


async def beat(s: Supervisor, node: str, via: int) -> None:
    health = s.registry.nodes[node].birth.health  # type: ignore[union-attr]
    heartbeat = wire.Heartbeat(node=node, seq=1, n=0, sent_at=time.time(), health=health)
    await s._on_link_message(via, wire.heartbeat_topic(node), wire.encode(heartbeat))


async def test_a_command_goes_to_the_broker_its_node_is_heard_on(
    sup: tuple[Supervisor, Clock],
) -> None:
    s, _ = sup
    for node in ("n1", "n2"):
        s.registry.on_birth(birth(node))
    await beat(s, "n1", 0)
    await beat(s, "n2", 1)

    assert s._route(wire.command_topic("n1")) == 0
    assert s._route(wire.command_topic("n2")) == 1
    assert s._route(wire.command_topic("n9")) is None  # never heard: every broker
    assert s._route(wire.catalog_topic("j1", "n2")) is None  # retained: every broker

    await beat(s, "n2", 0)  # it moved
    assert s._route(wire.command_topic("n2")) == 0


async def test_the_nodes_of_a_lost_broker_get_a_timeout_to_reach_the_other(
    sup: tuple[Supervisor, Clock],
) -> None:
    s, clock = sup
    for node in ("n1", "n2"):
        s.registry.on_birth(birth(node))
        await beat(s, node, 0 if node == "n1" else 1)
    clock.now += 10.0  # neither heard for 10 s of a 15 s timeout

    s.link.links[0]._connected.clear()  # broker 0 dies; broker 1 stays
    s._check_links()
    assert s._link_up == [False, True]
    assert s.link.connected

    clock.now += 10.0  # 20 s: n2 (broker 1, still up) timed out; n1 was on the lost one
    assert s.registry.check_timeouts() == ["n2"]
    assert s.registry.nodes["n1"].state is not NodeState.OFFLINE
    clock.now += 6.0  # n1 did not come back through broker 1 within its timeout either
    assert s.registry.check_timeouts() == ["n1"]
    offline_at = s.registry.nodes["n1"].offline_at
    clock.now += OFFLINE_CONFIRM_S
    assert s.offline_confirmed(offline_at)


async def test_wills_a_lost_broker_sent_as_it_went_down_are_taken_back(
    sup: tuple[Supervisor, Clock],
) -> None:
    s, clock = sup
    for node in ("n1", "n2"):
        s.registry.on_birth(birth(node))
        await beat(s, node, 0 if node == "n1" else 1)
    # broker 0 shuts down, sending n1's will first; n2 (on broker 1) dies for real
    s.registry.on_death(wire.NodeDeath(node="n1", seq=1, cause="lost"))
    s.registry.on_death(wire.NodeDeath(node="n2", seq=1, cause="lost"))
    clock.now += 0.5
    s.link.links[0]._connected.clear()
    s._check_links()

    assert s.registry.nodes["n1"].state is not NodeState.OFFLINE  # waits to be heard again
    assert s.registry.nodes["n2"].state is NodeState.OFFLINE


async def test_a_stale_heartbeat_from_the_old_broker_does_not_move_the_node_back(
    sup: tuple[Supervisor, Clock],
) -> None:
    s, _ = sup
    s.registry.on_birth(birth("n1"))
    await beat(s, "n1", 0)
    newer = birth("n1").model_copy(update={"seq": 2})
    await s._on_link_message(1, wire.birth_topic("n1"), wire.encode(newer))
    fresh = wire.Heartbeat(node="n1", seq=2, n=1, sent_at=time.time(), health=newer.health)
    await s._on_link_message(1, wire.heartbeat_topic("n1"), wire.encode(fresh))
    assert s._route(wire.command_topic("n1")) == 1

    await beat(s, "n1", 0)  # seq 1, from broker 0's backlog, handled late
    assert s._route(wire.command_topic("n1")) == 1


async def test_a_node_that_moved_gets_its_waiting_commands_again_on_its_new_broker(
    sup: tuple[Supervisor, Clock],
) -> None:
    s, _ = sup
    sent: list[tuple[str, bytes, int | None]] = []

    async def publish(topic: str, payload: bytes, *, timeout: float = 5.0) -> None:
        sent.append((topic, payload, s._route(topic)))

    s.commands._publish = publish  # type: ignore[assignment]
    for node in ("n1", "n2"):
        s.registry.on_birth(birth(node))
        await beat(s, node, 0)
    # a stop order to n1 went out on broker 0 as n1 left it; one to n2 waits too
    s.commands._waiting["c1"] = ("n1", b"stop n1")
    s.commands._waiting["c2"] = ("n2", b"stop n2")

    await beat(s, "n1", 1)  # n1 is heard through broker 1 now
    await asyncio.sleep(0)
    assert sent == [(wire.command_topic("n1"), b"stop n1", 1)]
    await beat(s, "n1", 1)  # still there: nothing sent again
    await asyncio.sleep(0)
    assert len(sent) == 1
