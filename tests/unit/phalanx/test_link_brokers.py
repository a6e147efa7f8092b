"""A list of brokers: an agent's link moves to the next when its broker is lost; the
supervisor's links are on every broker at once and send where the node is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiomqtt
import pytest

from phalanx.link import LinkDown, MqttLink, MqttLinks
from phalanx.local import free_port
from phalanx.settings import MqttSettings
from tests.harness import Broker, CuttableLink
from tests.wait import until


def _settings(*ports: int) -> MqttSettings:
    return MqttSettings(
        brokers=[f"127.0.0.1:{port}" for port in ports],
        reconnect_initial_s=0.05,
        reconnect_max_s=0.2,
        connect_timeout_s=2.0,
    )


async def _noop(topic: str, payload: bytes) -> None:
    return None


def _until(what: str, check: Callable[[], object]) -> Awaitable[object]:
    return until(check, 15.0, what, interval=0.02)


async def test_a_link_skips_a_broker_that_refuses_and_moves_on_when_its_broker_dies(
    brokers: tuple[Broker, Broker],
) -> None:
    a, b = brokers
    dead = free_port()
    connects: list[str] = []

    async def on_connect() -> None:
        connects.append(link.broker)

    link = MqttLink(
        _settings(dead, a.port, b.port),
        "agentd-n1",
        subscriptions=(),
        handler=_noop,
        on_connect=on_connect,
    )
    async with link:
        await link.wait_connected(15)
        assert link.broker == f"127.0.0.1:{a.port}"  # the first listed refused

        a.stop()  # the broker the node is on dies
        await _until("on b", lambda: link.connected and link.broker.endswith(f":{b.port}"))
        await link.publish("phalanx/t", b"on b", timeout=5)

    assert connects == [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]


async def test_moving_to_a_broker_ends_the_session_left_there_on_an_earlier_visit(
    brokers: tuple[Broker, Broker],
) -> None:
    """A command queued for the agent on a broker it left long ago is stale: moving there
    again must not deliver it."""
    a, b = brokers
    # An earlier visit to b left a persistent session subscribed to the node's commands,
    # and a command was queued in it after the node left.
    async with aiomqtt.Client(
        "127.0.0.1", b.port, identifier="agentd-n1", clean_session=False
    ) as earlier:
        await earlier.subscribe("phalanx/node/n1/cmd", qos=1)
    async with aiomqtt.Client("127.0.0.1", b.port) as old_supervisor:
        await old_supervisor.publish("phalanx/node/n1/cmd", b"stale", qos=1)

    got: list[bytes] = []

    async def handler(topic: str, payload: bytes) -> None:
        got.append(payload)

    link = MqttLink(
        _settings(a.port, b.port),
        "agentd-n1",
        subscriptions=("phalanx/node/n1/cmd",),
        handler=handler,
        persistent_session=True,
    )
    async with link:
        await link.wait_connected(15)
        a.stop()
        await _until("on b", lambda: link.connected and link.broker.endswith(f":{b.port}"))
        async with aiomqtt.Client("127.0.0.1", b.port) as supervisor:
            await supervisor.publish("phalanx/node/n1/cmd", b"fresh", qos=1)
        await _until("the fresh command", lambda: got)
        await asyncio.sleep(0.2)

    assert got == [b"fresh"]


async def test_the_supervisors_links_hear_every_broker_and_send_where_the_node_is(
    brokers: tuple[Broker, Broker],
) -> None:
    a, b = brokers
    heard: list[tuple[int, str]] = []
    up: list[int] = []

    async def handler(index: int, topic: str, payload: bytes) -> None:
        heard.append((index, payload.decode()))

    async def on_connect(index: int) -> None:
        up.append(index)

    links = MqttLinks(
        _settings(a.port, b.port),
        "phalanx-supervisor",
        subscriptions=("phalanx/node/+/hb",),
        handler=handler,
        on_connect=on_connect,
        route=lambda topic: 1 if topic == "phalanx/node/n2/cmd" else None,
    )
    on_a: list[bytes] = []
    on_b: list[bytes] = []

    async def listen(port: int, into: list[bytes], ready: asyncio.Event) -> None:
        with contextlib.suppress(aiomqtt.MqttError):  # its broker is stopped below
            await _listen(port, into, ready)

    async def _listen(port: int, into: list[bytes], ready: asyncio.Event) -> None:
        async with aiomqtt.Client("127.0.0.1", port) as client:
            await client.subscribe("phalanx/node/+/cmd", qos=1)
            ready.set()
            async for message in client.messages:
                into.append(message.payload)  # type: ignore[arg-type]

    ready_a, ready_b = asyncio.Event(), asyncio.Event()
    async with links, asyncio.TaskGroup() as group:
        listeners = [
            group.create_task(listen(a.port, on_a, ready_a)),
            group.create_task(listen(b.port, on_b, ready_b)),
        ]
        await _until("both links", lambda: links.up(0) and links.up(1))
        await ready_a.wait()
        await ready_b.wait()
        assert sorted(up) == [0, 1]
        for index, broker in enumerate((a, b)):
            async with aiomqtt.Client("127.0.0.1", broker.port) as node:
                await node.publish("phalanx/node/n1/hb", f"via {index}".encode(), qos=1)
        await _until("both heartbeats", lambda: len(heard) == 2)
        assert sorted(heard) == [(0, "via 0"), (1, "via 1")]

        await links.publish("phalanx/node/n2/cmd", b"routed")  # to b alone
        await links.publish("phalanx/node/n3/cmd", b"anywhere")  # node not heard yet: both
        await _until("the commands", lambda: len(on_a) == 1 and len(on_b) == 2)
        assert on_a == [b"anywhere"] and sorted(on_b) == [b"anywhere", b"routed"]

        b.stop()  # the routed node's broker is lost: its commands go to the others
        await _until("b lost", lambda: not links.up(1))
        assert links.connected
        await links.publish("phalanx/node/n2/cmd", b"rerouted")
        await _until("rerouted", lambda: len(on_a) == 2)
        assert on_a[-1] == b"rerouted"

        a.stop()
        await _until("all lost", lambda: not links.connected)
        with pytest.raises(LinkDown, match="no broker reachable"):
            await links.publish("phalanx/node/n2/cmd", b"nowhere", timeout=0.3)
        for listener in listeners:
            listener.cancel()


async def _retained(port: int, topic: str) -> bytes | None:
    """What broker ``port`` holds retained on ``topic`` (None: nothing)."""
    async with aiomqtt.Client("127.0.0.1", port) as client:
        await client.subscribe(topic, qos=1)
        try:
            async with asyncio.timeout(1.0):
                async for message in client.messages:
                    return bytes(message.payload)  # type: ignore[arg-type]
        except TimeoutError:
            return None
    return None


async def test_a_broker_back_gets_the_newest_retained_messages_before_on_connect(
    brokers: tuple[Broker, Broker],
) -> None:
    a, b = brokers
    topic = "phalanx/job/j1/ckpt/n1"
    seen_at_connect: list[bytes | None] = []

    async def on_connect(index: int) -> None:
        if index == 1 and links.connects > 2:
            seen_at_connect.append(await _retained(b.port, topic))

    links = MqttLinks(
        _settings(a.port, b.port), "sup", subscriptions=(), handler=_ignore, on_connect=on_connect
    )
    async with links:
        await _until("both", lambda: links.up(0) and links.up(1))
        await links.publish(topic, b"v1", retain=True)
        b.stop()  # b goes away (and, restarted without persistence, forgets v1)
        await _until("b lost", lambda: not links.up(1))
        await links.publish(topic, b"v2", retain=True)  # a alone takes it
        b.start()
        await _until("b back", lambda: links.up(1) and bool(seen_at_connect))
        assert seen_at_connect == [b"v2"]
        await links.publish(topic, b"", retain=True)  # cleared everywhere: not kept
        assert topic not in links._retained
    assert await _retained(b.port, topic) is None


async def test_a_retained_message_a_connected_broker_did_not_take_is_an_error(
    brokers: tuple[Broker, Broker],
) -> None:
    a, b = brokers
    relay = CuttableLink(b.port)
    links = MqttLinks(_settings(a.port, relay.port), "sup", subscriptions=(), handler=_ignore)
    try:
        async with links:
            await _until("both", lambda: links.up(0) and links.up(1))
            relay.cut()  # b's acknowledgements never come; its connection stays up
            with pytest.raises(LinkDown, match=f"not taken by broker 127.0.0.1:{relay.port}"):
                await links.publish("phalanx/job/j1/ckpt/n1", b"v1", retain=True, timeout=0.5)
            await links.publish("phalanx/node/n1/cmd", b"c1", timeout=0.5)  # a took it: enough
    finally:
        relay.close()


async def test_an_agent_moves_on_when_asked_and_not_with_one_broker(
    brokers: tuple[Broker, Broker],
) -> None:
    a, b = brokers
    link = MqttLink(_settings(a.port, b.port), "agentd-n1", subscriptions=(), handler=_noop)
    alone = MqttLink(_settings(a.port), "agentd-n2", subscriptions=(), handler=_noop)
    async with link, alone:
        await link.wait_connected(15)
        await alone.wait_connected(15)
        assert link.move_on("the supervisor left")
        await _until("on b", lambda: link.connected and link.broker.endswith(f":{b.port}"))
        assert not alone.move_on("nowhere to go") and alone.connected


async def _ignore(index: int, topic: str, payload: bytes) -> None:
    return None
