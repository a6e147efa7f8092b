"""A link connected to a test's broker, for the link's own tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from phalanx.link import Handler, MqttLink
from phalanx.settings import MqttSettings
from tests.harness import Broker


async def noop(topic: str, payload: bytes) -> None:
    return None


@asynccontextmanager
async def connected(
    broker: Broker,
    client_id: str = "t",
    *,
    subscriptions: tuple[str, ...] = (),
    handler: Handler = noop,
) -> AsyncIterator[MqttLink]:
    """An :class:`MqttLink` to ``broker``, connected (10 s at most), closed after."""
    settings = MqttSettings(host="127.0.0.1", port=broker.port)
    async with MqttLink(settings, client_id, subscriptions=subscriptions, handler=handler) as link:
        await link.wait_connected(10)
        yield link
