"""The MQTT link survives failures that are not MQTT errors (no broker needed)."""

from __future__ import annotations

import asyncio

from phalanx.link import MqttLink, Will
from phalanx.settings import MqttSettings


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
