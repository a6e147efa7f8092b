"""The MQTT link survives failures: some that are not MQTT errors, a connection lost."""

from __future__ import annotations

import asyncio

import aiomqtt
import pytest

from phalanx.link import LinkDown, MqttLink, Will
from phalanx.settings import MqttSettings
from tests.harness import Broker, CuttableLink


async def _noop(topic: str, payload: bytes) -> None:
    return None


async def test_a_will_that_cannot_be_written_is_retried_not_fatal() -> None:
    calls = 0

    def will() -> Will:
        nonlocal calls
        calls += 1
        raise OSError(28, "No space left on device")

    settings = MqttSettings(port=1, reconnect_initial_s=0.01, reconnect_max_s=0.02)
    async with MqttLink(settings, "t", subscriptions=(), handler=_noop, will=will) as link:
        for _ in range(200):
            if calls >= 3:
                break
            await asyncio.sleep(0.01)
        assert calls >= 3
        assert link._task is not None and not link._task.done()


async def test_a_publish_whose_connection_drops_fails_at_once_not_after_its_timeout(
    broker: Broker,
) -> None:
    relay = CuttableLink(broker.port)
    settings = MqttSettings(
        host="127.0.0.1", port=relay.port, reconnect_initial_s=0.05, reconnect_max_s=0.1
    )
    try:
        async with MqttLink(settings, "t", subscriptions=(), handler=_noop) as link:
            await link.wait_connected(10)
            relay.cut()  # the broker's acknowledgement will never come on this connection
            send = asyncio.create_task(link.publish("phalanx/test", b"x", timeout=60))
            await asyncio.sleep(0.2)
            assert not send.done()

            relay.close()  # the connection is lost (a broker crash)

            async with asyncio.timeout(10):  # far below the publish's own 60 s
                with pytest.raises(LinkDown, match="lost while publishing"):
                    await send
    finally:
        relay.close()


async def test_messages_received_before_a_connection_drops_are_handled_after_it(
    broker: Broker,
) -> None:
    """The broker counts a QoS 1 message delivered once paho acknowledged it; those still
    waiting for the handler when the connection drops must not go with it (aiomqtt hands
    out what its queue holds before it says the connection is gone)."""
    relay = CuttableLink(broker.port)
    settings = MqttSettings(
        host="127.0.0.1", port=relay.port, reconnect_initial_s=0.05, reconnect_max_s=0.1
    )
    got: list[bytes] = []
    release = asyncio.Event()

    async def slow(topic: str, payload: bytes) -> None:
        got.append(payload)
        if len(got) == 1:
            await release.wait()  # a supervisor far behind its messages

    sent = [str(i).encode() for i in range(20)]
    try:
        async with MqttLink(settings, "slow", subscriptions=("phalanx/t/#",), handler=slow) as link:
            await link.wait_connected(10)
            async with aiomqtt.Client("127.0.0.1", broker.port) as sender:
                for payload in sent:
                    await sender.publish("phalanx/t/x", payload, qos=1)
            # The first taken by the handler, the rest queued (read in one turn or several:
            # the link reads the socket 64 KB at a time, so the queue may fill first).
            async with asyncio.timeout(10):
                while (  # noqa: ASYNC110
                    not got or link._client is None or len(link._client.messages) < len(sent) - 1
                ):
                    await asyncio.sleep(0.01)
            assert link.behind_s >= 0.0 and len(got) == 1
            client = link._client
            relay.drop()  # the connection ends with 19 messages received, not handled
            async with asyncio.timeout(10):
                while not client._disconnected.done():  # noqa: ASYNC110 - paho's, not ours
                    await asyncio.sleep(0.01)
            release.set()
            async with asyncio.timeout(10):
                while len(got) < len(sent):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            assert got == sent  # every one, in order, once
    finally:
        relay.close()
