"""A link reads a bounded number of packets a turn of the event loop: a backlog of
thousands (the broker's acknowledgements of a recovery's start orders, the acks and
events behind them) is parsed in slices, with the loop's other work (timers, HTTP, the
rest of the writes) between them, not in one callback."""

from __future__ import annotations

import asyncio
import itertools
import time

from phalanx.link import READ_PACKETS
from tests.harness import Broker
from tests.unit.phalanx.links import connected

IN_FLIGHT = 3000
BUFFERED = 1000


def _hold(seconds: float) -> None:
    """Hold the event loop (called on it): the acknowledgements pile up in the socket."""
    time.sleep(seconds)


async def test_a_backlog_of_acknowledgements_is_read_in_slices_with_the_loop_turning_between(
    broker: Broker,
) -> None:
    async with connected(broker, "t") as link:
        client = link._client
        assert client is not None
        sends = [
            asyncio.create_task(link.publish(f"phalanx/test/pile/{i}", b"x", qos=1))
            for i in range(IN_FLIGHT)
        ]
        await asyncio.sleep(0)  # each is published, in flight
        link.write_now()
        _hold(1.0)  # their acknowledgements arrive meanwhile, unread

        # A callback that counts, at every turn of the loop, what is still in flight.
        in_flight = client._client._out_messages
        seen: list[int] = []
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def look() -> None:
            seen.append(len(in_flight))
            if seen[-1] > 0:
                loop.call_soon(look)
            else:
                done.set()

        look()
        async with asyncio.timeout(20):
            await done.wait()
            await asyncio.gather(*sends)

    steps = [a - b for a, b in itertools.pairwise(seen)]
    assert max(steps) <= READ_PACKETS, steps  # never the whole backlog in one turn
    assert len([s for s in steps if s > 0]) >= IN_FLIGHT // READ_PACKETS  # in slices


async def test_packets_are_read_from_a_buffer_filled_many_at_a_time_whole_and_in_order(
    broker: Broker,
) -> None:
    # paho reads each packet in three reads of the socket or more; here one read
    # takes up to READ_BYTES of them. Big payloads (over READ_BYTES) among small ones.
    payloads = [(b"%05d" % i) + (b"y" * (200_000 if i % 97 == 0 else 300)) for i in range(BUFFERED)]
    got: list[bytes] = []
    done = asyncio.Event()

    async def take(topic: str, payload: bytes) -> None:
        got.append(payload)
        if len(got) == len(payloads):
            done.set()

    async with connected(
        broker, "reader", subscriptions=("phalanx/test/buffered",), handler=take
    ) as link:
        client = link._client
        assert client is not None
        reads = [0]
        real = client._read_from_socket

        def counted(size: int) -> bytes:
            reads[0] += 1
            data: bytes = real(size)
            return data

        client._read_from_socket = counted
        async with connected(broker, "writer") as writer:
            await asyncio.gather(
                *(writer.publish("phalanx/test/buffered", p, qos=1) for p in payloads)
            )
        async with asyncio.timeout(30):
            await done.wait()
    assert got == payloads  # whole, once, in order
    assert reads[0] < 3 * len(payloads) // 10, reads[0]  # paho alone: 3 or more a packet
