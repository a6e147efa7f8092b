"""A link hands what was published to the broker at once when asked (``write_now``),
before the loop goes on to other work, and leaves no writer behind once all is out."""

from __future__ import annotations

import asyncio
import selectors
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from phalanx.link import MqttLink
from phalanx.settings import MqttSettings
from tests.harness import Broker
from tests.unit.phalanx.links import connected, noop

HOLD_S = 1.0  # the loop held, as a long build would hold it


def _hold(seconds: float) -> None:
    """Hold the event loop (called on it), as a long build would."""
    time.sleep(seconds)


def _subscriber(
    port: int, topic: str, expect: int
) -> tuple[mqtt.Client, list[float], threading.Event, threading.Event]:
    got: list[float] = []
    ready, done = threading.Event(), threading.Event()

    def on_message(*_: object) -> None:
        got.append(time.monotonic())
        if len(got) >= expect:
            done.set()

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watch")
    sub.on_connect = lambda c, *_: c.subscribe(topic, 0)
    sub.on_subscribe = lambda *_: ready.set()
    sub.on_message = on_message
    sub.connect("127.0.0.1", port)
    sub.loop_start()
    return sub, got, ready, done


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (still made) in the list returned."""
    calls = [0]
    real = getattr(owner, name)

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _writing(link: MqttLink) -> bool:
    """Whether the loop watches the link's socket for writing."""
    client = link._client
    assert client is not None
    sock = client._client.socket()
    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    try:
        key = selector.get_key(sock.fileno())
    except KeyError:
        return False
    return bool(key.events & selectors.EVENT_WRITE)


async def test_messages_written_now_reach_the_broker_while_the_loop_is_held(
    broker: Broker,
) -> None:
    sub, got, ready, done = _subscriber(broker.port, "phalanx/test/now/+", 50)
    try:
        assert ready.wait(10)
        async with connected(broker, "t") as link:
            sends = [
                asyncio.create_task(link.publish(f"phalanx/test/now/{i}", b"x", qos=1))
                for i in range(50)
            ]
            await asyncio.sleep(0)  # each task has published (held in the client)
            link.write_now()
            held_until = time.monotonic() + HOLD_S
            _hold(HOLD_S)  # nothing else writes meanwhile
            async with asyncio.timeout(10):
                await asyncio.gather(*sends)
            assert await asyncio.to_thread(done.wait, 10)
            assert len(got) == 50
            assert max(got) < held_until  # all of them delivered during the hold

            await asyncio.sleep(0.1)  # acks read; a writer added late would stay
            assert not _writing(link)
    finally:
        sub.loop_stop()
        sub.disconnect()


async def test_a_link_not_connected_writes_nothing_and_raises_nothing() -> None:
    settings = MqttSettings(port=1, reconnect_initial_s=0.01, reconnect_max_s=0.02)
    async with MqttLink(settings, "t", subscriptions=(), handler=noop) as link:
        link.write_now()


async def test_a_publish_on_the_loop_adds_its_writer_without_waking_the_loop_through_its_pipe(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # call_soon_threadsafe writes to the loop's self pipe: a system call a publish that
    # found the client's queue empty, for nothing, on the loop's own thread.
    async with connected(broker, "t") as link:
        wakes = _count_calls(monkeypatch, asyncio.get_running_loop(), "_write_to_self")
        for i in range(50):  # each finds the queue empty (the last one written)
            await link.publish(f"phalanx/test/wake/{i}", b"x", qos=1)
            assert not _writing(link)  # and no writer left behind
        monkeypatch.undo()
    assert wakes[0] < 5, wakes[0]  # one a publish before


async def test_a_publish_with_room_in_the_socket_is_written_without_watching_the_socket(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A writer added and removed for every message is two epoll system calls; the
    # queue is written at the loop's next turn instead, watched only when it is full.
    async with connected(broker, "t") as link:
        added = _count_calls(monkeypatch, asyncio.get_running_loop(), "add_writer")
        for i in range(50):
            await link.publish(f"phalanx/test/room/{i}", b"x", qos=1)
        burst = [link.publish(f"phalanx/test/room/b{i}", b"y" * 100, qos=1) for i in range(200)]
        await asyncio.gather(*burst)
        assert await link.written(5)
        monkeypatch.undo()
    assert added[0] == 0
