"""A link's batch of publishes (``publish_many``), on a real Mosquitto: every message
reaches the broker once and in order, never more than ``BULK_IN_FLIGHT`` of them with the
broker at once; a lost connection fails the rest at once, a silent broker after the
timeout, a cancelled wait sends no more; on several brokers, retained, each takes all."""

from __future__ import annotations

import asyncio
import gc

import aiomqtt
import pytest

from phalanx import link as link_module
from phalanx.link import LinkDown, MqttLink, MqttLinks
from phalanx.settings import MqttSettings
from tests.harness import Broker, CuttableLink
from tests.unit.phalanx.links import connected
from tests.wait import until


async def _noop(topic: str, payload: bytes) -> None:
    return None


async def _ignore(index: int, topic: str, payload: bytes) -> None:
    return None


async def test_every_message_reaches_the_broker_once_in_order_a_window_at_a_time(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "BULK_IN_FLIGHT", 16)
    items = [(f"phalanx/t/{i % 7}", b"%04d" % i + b"x" * 2000) for i in range(600)]
    got: list[bytes] = []
    most_out = 0
    async with aiomqtt.Client("127.0.0.1", broker.port) as reader:
        await reader.subscribe("phalanx/t/#", qos=1)

        async def read() -> None:
            async for message in reader.messages:
                got.append(bytes(message.payload))  # type: ignore[arg-type]
                if len(got) == len(items):
                    return

        reading = asyncio.create_task(read())
        async with connected(broker) as link:
            client = link._client
            assert client is not None

            async def watch() -> None:
                nonlocal most_out
                while True:
                    most_out = max(most_out, len(client._client._out_messages))
                    await asyncio.sleep(0)

            watching = asyncio.create_task(watch())
            try:
                results = await link.publish_many(items, timeout=30)
            finally:
                watching.cancel()
            assert results == [None] * len(items)
            assert not client._bulk and not client._bulk_out and not client._batches
        async with asyncio.timeout(30):
            await reading
    assert got == [payload for _, payload in items]  # each once, in the order given
    assert 0 < most_out <= 16


async def test_a_settled_batch_leaves_no_cycle_for_the_collector(broker: Broker) -> None:
    # Its publishes named the batch and the batch them: a step's 2,048 catalogs (~10 MB at
    # 2,048 nodes) waited for a pass of the cyclic collector (issue 22).
    async with connected(broker) as link:
        await link.publish_many([("phalanx/t/warm", b"w")], timeout=30)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a pass finds is kept in gc.garbage
        try:
            items = [(f"phalanx/t/{i}", b"x" * 1000) for i in range(100)]
            assert await link.publish_many(items, timeout=30) == [None] * len(items)
            await asyncio.sleep(0)  # the batch's future's callbacks run
            gc.collect()
            found = {type(o).__name__ for o in gc.garbage}
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert not found & {"_Batch", "_Bulk"}, found


async def test_a_batch_whose_connection_drops_fails_at_once_not_after_its_timeout(
    broker: Broker,
) -> None:
    relay = CuttableLink(broker.port)
    settings = MqttSettings(
        host="127.0.0.1", port=relay.port, reconnect_initial_s=0.05, reconnect_max_s=0.1
    )
    try:
        async with MqttLink(settings, "t", subscriptions=(), handler=_noop) as link:
            await link.wait_connected(10)
            relay.cut()  # no acknowledgement will come on this connection
            items = [(f"phalanx/t/{i}", b"x") for i in range(300)]
            sending = asyncio.create_task(link.publish_many(items, timeout=60))
            await asyncio.sleep(0.2)
            assert not sending.done()

            relay.close()  # the connection is lost (a broker crash)

            async with asyncio.timeout(10):  # far below the batch's own 60 s
                results = await sending
            assert len(results) == len(items)
            assert all(isinstance(r, LinkDown) for r in results)
            assert "lost while publishing" in str(results[0])
            assert "phalanx/t/0" in str(results[0])
    finally:
        relay.close()


async def test_a_batch_the_broker_never_acknowledges_fails_after_its_silence(
    broker: Broker,
) -> None:
    relay = CuttableLink(broker.port)
    settings = MqttSettings(host="127.0.0.1", port=relay.port)
    try:
        async with MqttLink(settings, "t", subscriptions=(), handler=_noop) as link:
            await link.wait_connected(10)
            relay.cut()  # a partition: the connection stays, nothing comes back
            async with asyncio.timeout(10):
                results = await link.publish_many(
                    [("phalanx/t/a", b"1"), ("phalanx/t/b", b"2")], timeout=0.3
                )
            assert all(isinstance(r, LinkDown) for r in results)
            assert "no acknowledgement from the broker for 0.3s" in str(results[1])
            client = link._client
            assert client is not None and not client._bulk_out and not client._batches
    finally:
        relay.close()


async def test_a_cancelled_batch_sends_nothing_more(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "BULK_IN_FLIGHT", 4)
    relay = CuttableLink(broker.port)
    settings = MqttSettings(host="127.0.0.1", port=relay.port)
    try:
        async with MqttLink(settings, "t", subscriptions=(), handler=_noop) as link:
            await link.wait_connected(10)
            client = link._client
            assert client is not None
            relay.cut()
            sending = asyncio.create_task(
                link.publish_many([(f"phalanx/t/{i}", b"x") for i in range(100)], timeout=60)
            )
            await until(lambda: len(client._bulk_out) == 4, 5.0, "four out, the rest waiting")
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
            assert not client._bulk and not client._bulk_out and not client._batches
            assert len(client._client._out_messages) == 4  # the rest never went to paho
    finally:
        relay.close()


async def test_a_batch_waits_for_the_link_and_says_so_when_it_never_comes() -> None:
    settings = MqttSettings(port=1, reconnect_initial_s=0.05, reconnect_max_s=0.1)
    async with MqttLink(settings, "t", subscriptions=(), handler=_noop) as link:
        results = await link.publish_many([("phalanx/t/a", b"1")], timeout=0.2)
    assert isinstance(results[0], LinkDown)
    assert "broker unreachable (phalanx/t/a)" in str(results[0])
    assert await link.publish_many([]) == []


async def _retained(port: int, topics: list[str]) -> dict[str, bytes]:
    """What broker ``port`` holds retained on ``topics`` (all of job j1's catalogs)."""
    found: dict[str, bytes] = {}
    async with aiomqtt.Client("127.0.0.1", port) as client:
        await client.subscribe("phalanx/v1/job/j1/ckpt/+", qos=1)
        try:
            async with asyncio.timeout(2.0):
                async for message in client.messages:
                    found[str(message.topic)] = bytes(message.payload)  # type: ignore[arg-type]
                    if len(found) == len(topics):
                        break
        except TimeoutError:
            pass
    return found


async def test_on_several_brokers_each_takes_every_retained_message_and_one_back_gets_them(
    brokers: tuple[Broker, Broker],
) -> None:
    a, b = brokers
    settings = MqttSettings(
        brokers=[f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"],
        reconnect_initial_s=0.05,
        reconnect_max_s=0.2,
        connect_timeout_s=2.0,
    )
    topics = [f"phalanx/v1/job/j1/ckpt/n{i:03d}" for i in range(300)]
    async with MqttLinks(settings, "sup", subscriptions=(), handler=_ignore) as links:
        await until(lambda: links.up(0) and links.up(1), 15.0, "both brokers")
        results = await links.publish_many([(t, b"v1 " + t.encode()) for t in topics], retain=True)
        assert results == [None] * len(topics)
        for port in (a.port, b.port):
            assert await _retained(port, topics) == {t: b"v1 " + t.encode() for t in topics}

        b.stop()  # restarted without persistence, it forgets them
        await until(lambda: not links.up(1), 15.0, "b lost")
        again = await links.publish_many([(t, b"v2") for t in topics[:10]], retain=True)
        assert again == [None] * 10  # a alone took them: enough while b is away
        b.start()
        await until(
            lambda: all(1 in took for _, took in links._retained.values()),
            15.0,
            "b back, and every retained message taken by it",
        )
        want = {t: b"v2" if i < 10 else b"v1 " + t.encode() for i, t in enumerate(topics)}
        assert await _retained(b.port, topics) == want  # all again, each as it is now
