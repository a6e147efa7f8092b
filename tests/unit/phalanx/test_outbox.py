"""An outbox sends every message put in it, in order, also across a shutdown's flush."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from pydantic import BaseModel

from phalanx.link import LinkDown, MqttLink, Outbox
from tests.wait import settle, until


class Event(BaseModel):
    n: int


class GatedLink:
    """The I/O boundary: a publish that completes when the test lets it (``gate``)."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.started: list[int] = []
        self.gate = asyncio.Event()
        self.in_flight = asyncio.Event()  # a publish has started
        self.down = False
        self.connects = 1

    async def until_connected(self) -> None:
        return None

    async def publish(self, topic: str, payload: bytes, **_: Any) -> None:
        n = Event.model_validate_json(payload).n
        self.started.append(n)
        self.in_flight.set()
        if self.down:
            raise LinkDown("broker unreachable")
        await self.gate.wait()
        self.sent.append(n)


def outbox(link: GatedLink) -> Outbox:
    return Outbox(cast(MqttLink, link), "phalanx/v1/node/n1/rank", "rank event")


async def first_publish(link: GatedLink) -> None:
    async with asyncio.timeout(5):
        await link.in_flight.wait()
    assert link.started == [1]


async def test_a_flush_during_a_send_keeps_the_order_of_the_messages() -> None:
    link = GatedLink()
    box = outbox(link)
    for n in (1, 2, 3):
        box.put(Event(n=n))
    runner = asyncio.create_task(box.run())
    await first_publish(link)  # run holds message 1, its publish in flight
    flush = asyncio.create_task(box.flush(timeout=5.0))
    await settle()  # the flush waits behind the publish in flight
    link.gate.set()
    await flush
    runner.cancel()
    assert link.sent == [1, 2, 3]


async def test_the_message_being_sent_when_run_is_cancelled_is_sent_by_the_flush() -> None:
    link = GatedLink()
    box = outbox(link)
    box.put(Event(n=1))
    box.put(Event(n=2))
    runner = asyncio.create_task(box.run())
    await first_publish(link)
    runner.cancel()  # shutdown cancels the loop while it publishes message 1
    await asyncio.gather(runner, return_exceptions=True)
    link.gate.set()
    await box.flush(timeout=5.0)
    assert link.sent == [1, 2]


async def test_a_flush_stops_at_its_limit_and_keeps_what_it_could_not_send() -> None:
    link = GatedLink()
    box = outbox(link)
    box.put(Event(n=1))
    await box.flush(timeout=0.05)  # the publish never completes: the limit ends the flush
    assert link.sent == [] and len(box) == 1
    link.gate.set()
    await box.flush(timeout=5.0)
    assert link.sent == [1] and len(box) == 0


async def test_a_flush_with_the_link_down_gives_up_and_keeps_the_messages() -> None:
    link = GatedLink()
    link.down = True
    box = outbox(link)
    box.put(Event(n=1))
    await box.flush(timeout=5.0)
    assert link.sent == [] and len(box) == 1


async def test_a_gated_outbox_sends_nothing_until_the_gate_opens() -> None:
    link = GatedLink()
    link.gate.set()
    gate = asyncio.Event()  # the supervisor is not (yet) online
    box = Outbox(cast(MqttLink, link), "phalanx/v1/node/n1/ckpt", "landing", gate=gate)
    box.put(Event(n=1))
    runner = asyncio.create_task(box.run())
    await settle()
    assert link.started == [] and len(box) == 1
    gate.set()
    await first_publish(link)
    await until(lambda: link.sent == [1], 5.0, "the publish, let through, to complete")
    runner.cancel()
    assert link.sent == [1] and len(box) == 0


async def test_a_flush_at_shutdown_sends_even_with_the_gate_closed() -> None:
    link = GatedLink()
    link.gate.set()
    box = Outbox(cast(MqttLink, link), "phalanx/v1/node/n1/ckpt", "landing", gate=asyncio.Event())
    box.put(Event(n=1))
    await box.flush(timeout=5.0)
    assert link.sent == [1]


class ReconnectingLink(GatedLink):
    """A link that drops as a publish starts: the publish waits for the next connection,
    and raises (as MqttLink does) when it was tied to an earlier one."""

    def __init__(self) -> None:
        super().__init__()
        self.connected = asyncio.Event()

    async def publish(
        self, topic: str, payload: bytes, *, connection: int | None = None, **_: Any
    ) -> None:
        self.in_flight.set()
        await self.connected.wait()
        if connection is not None and connection != self.connects:
            raise LinkDown("connected again before publishing")
        self.sent.append(Event.model_validate_json(payload).n)


async def test_a_send_that_waited_across_a_reconnect_waits_for_the_gate_again() -> None:
    link = ReconnectingLink()
    gate = asyncio.Event()
    gate.set()  # the supervisor's status was seen on the old connection
    box = Outbox(cast(MqttLink, link), "phalanx/v1/node/n1/ckpt", "landing", gate=gate)
    box.put(Event(n=1))
    runner = asyncio.create_task(box.run())
    async with asyncio.timeout(5):
        await link.in_flight.wait()  # the publish waits for the link, which is down

    link.connects += 1  # the broker is back (it lost its sessions): a new connection,
    gate.clear()  # whose first act closes the gate
    link.connected.set()
    await settle()

    assert link.sent == [] and len(box) == 1  # not sent before the supervisor is known
    gate.set()
    await until(lambda: link.sent == [1], 5.0, "the send once the gate opened")
    runner.cancel()
    assert link.sent == [1] and len(box) == 0


async def test_a_full_outbox_drops_the_oldest_not_being_sent_and_counts_it() -> None:
    link = GatedLink()
    box = Outbox(cast(MqttLink, link), "phalanx/v1/node/n1/rank", "rank event", max_queued=3)
    box.put(Event(n=1))
    runner = asyncio.create_task(box.run())
    await first_publish(link)  # message 1 is on its way: it is never the one dropped
    for n in (2, 3, 4, 5):
        box.put(Event(n=n))
    assert len(box) == 3 and box.dropped == 2  # 2 and 3 made room for 4 and 5
    link.gate.set()
    await box.flush(timeout=5.0)
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    assert link.sent == [1, 4, 5] and box.dropped == 2


async def test_an_outbox_bound_of_one_with_its_message_in_flight_drops_the_new_one() -> None:
    link = GatedLink()
    box = Outbox(cast(MqttLink, link), "phalanx/v1/node/n1/rank", "rank event", max_queued=1)
    box.put(Event(n=1))
    runner = asyncio.create_task(box.run())
    await first_publish(link)
    box.put(Event(n=2))
    assert len(box) == 1 and box.dropped == 1
    link.gate.set()
    await box.flush(timeout=5.0)
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    assert link.sent == [1]


def test_an_outbox_bound_under_one_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_queued 0"):
        Outbox(cast(MqttLink, GatedLink()), "t", "rank event", max_queued=0)


class RefusingLink:
    """The I/O boundary: connected, but every publish refused at once (paho's socket
    closed before the link saw its connection end, as in a broker restart)."""

    connects = 1

    def __init__(self) -> None:
        self.tries = 0

    async def until_connected(self) -> None:
        return None

    async def publish(self, topic: str, payload: bytes, **_: Any) -> None:
        self.tries += 1
        if self.tries > 100:  # a loop that never waits: end it, for the test to say so
            raise RuntimeError("the outbox tried 100 times without letting the loop run")
        raise LinkDown("could not publish: the client is not connected")


async def test_a_send_refused_at_once_is_tried_again_after_a_pause_not_in_a_tight_loop() -> None:
    link = RefusingLink()
    box = Outbox(cast(MqttLink, link), "phalanx/v1/node/n1/metrics", "metrics batch")
    box.put(Event(n=1))
    runner = asyncio.create_task(box.run())
    turns = 0
    for _ in range(5):  # the loop's other work goes on (the link's own task, heartbeats)
        await asyncio.sleep(0.05)
        turns += 1

    assert not runner.done(), runner.exception()
    runner.cancel()
    assert turns == 5 and 1 <= link.tries <= 3
    assert len(box) == 1  # still queued, for when the link is back
