"""A link hands its queued MQTT packets to the socket together, up to ``WRITE_BYTES`` a
send, not one send each: every byte goes once and in order, a packet cut by a full
socket goes on from where it stopped, and the packets paho acts on once written (a
QoS 0 publish, a disconnect) still get paho's own handling."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.client import DISCONNECT, PUBLISH, PUBREL

from phalanx.link import WRITE_BYTES, _write_joined
from tests.harness import Broker
from tests.unit.phalanx.links import connected

BIG = b"x" * 256 * 1024
FULL_MESSAGES = 200  # 50 MB: more than loopback's socket buffers hold
MESSAGES = 900  # under Mosquitto's 1,000 queued a subscriber (max_queued_messages)


class _Socket:
    """A socket that takes at most the next of ``takes`` bytes a send (0: it is full,
    ``BlockingIOError``), then everything."""

    def __init__(self, takes: list[int]) -> None:
        self.takes = list(takes)
        self.sent = bytearray()
        self.sends = 0

    def send(self, data: Any) -> int:
        self.sends += 1
        take = self.takes.pop(0) if self.takes else len(data)
        if take == 0:
            raise BlockingIOError
        took = bytes(data)[:take]
        self.sent += took
        return len(took)

    def close(self) -> None:
        pass


def _client(sock: _Socket) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="writes")
    client._sock = sock  # type: ignore[assignment]
    return client


def _queue(client: mqtt.Client, command: int, body: bytes, qos: int = 1) -> Any:
    info = mqtt.MQTTMessageInfo(len(client._out_packet))
    client._out_packet.append(
        {
            "command": command,
            "mid": info.mid,
            "qos": qos,
            "pos": 0,
            "to_process": len(body),
            "packet": bytearray(body),
            "info": info,
        }
    )
    return info


def test_queued_packets_go_in_few_sends_every_byte_once_and_in_order() -> None:
    sock = _Socket([])
    client = _client(sock)
    bodies = [bytes([0x32]) + (b"%05d" % i) * 200 for i in range(300)]  # 1 KB each
    for body in bodies:
        _queue(client, PUBLISH | 2, body)

    assert _write_joined(client) == 0
    assert bytes(sock.sent) == b"".join(bodies)
    assert not client._out_packet
    assert sock.sends <= len(b"".join(bodies)) // WRITE_BYTES + 1  # 300 one by one


def test_a_full_socket_leaves_the_rest_queued_and_the_cut_packet_goes_on_where_it_stopped() -> None:
    bodies = [bytes([0x32]) + bytes([i]) * 999 for i in range(10)]
    sock = _Socket([1500, 0])  # a packet and a half, then full
    client = _client(sock)
    for body in bodies:
        _queue(client, PUBLISH | 2, body)

    assert _write_joined(client) == mqtt.MQTT_ERR_AGAIN
    assert bytes(sock.sent) == b"".join(bodies)[:1500]
    assert len(client._out_packet) == 9  # the first left whole, the second half written
    assert client._out_packet[0]["pos"] == 500

    assert _write_joined(client) == 0  # writable again
    assert bytes(sock.sent) == b"".join(bodies)
    assert not client._out_packet


def test_a_qos0_publish_is_marked_published_and_a_disconnect_closes_as_paho_does() -> None:
    sock = _Socket([])
    client = _client(sock)
    published: list[int] = []
    client.on_publish = lambda _c, _u, mid, *_: published.append(mid)
    first = _queue(client, PUBLISH | 2, b"\x32" + b"a" * 100)
    zero = _queue(client, PUBLISH, b"\x30" + b"b" * 100, qos=0)
    _queue(client, PUBREL | 2, b"\x62\x02\x00\x01")
    bye = [b"\xe0\x00"]
    _queue(client, DISCONNECT, bye[0], qos=0)
    _queue(client, PUBLISH | 2, b"\x32" + b"c" * 100)  # after the disconnect: not sent

    assert _write_joined(client) == 0
    assert (
        bytes(sock.sent)
        == (b"\x32" + b"a" * 100) + (b"\x30" + b"b" * 100) + (b"\x62\x02\x00\x01") + bye[0]
    )
    assert zero.is_published() and published == [zero.mid]
    assert not first.is_published()  # QoS 1: published once the broker acknowledges it
    assert client._sock is None  # the disconnect closed the socket


async def test_a_burst_reaches_a_subscriber_whole_and_in_order_in_few_sends(
    broker: Broker,
) -> None:
    got: list[bytes] = []
    ready, done = threading.Event(), threading.Event()

    def on_message(_c: object, _u: object, message: mqtt.MQTTMessage) -> None:
        got.append(message.payload)
        if len(got) >= MESSAGES:
            done.set()

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watch")
    sub.on_connect = lambda c, *_: c.subscribe("phalanx/test/burst", 1)
    sub.on_subscribe = lambda *_: ready.set()
    sub.on_message = on_message
    sub.connect("127.0.0.1", broker.port)
    sub.loop_start()
    try:
        assert await asyncio.to_thread(ready.wait, 10)
        async with connected(broker, "t") as link:
            client = link._client
            assert client is not None
            paho = client._client
            sends = [0]
            real = paho._sock_send

            def counted(buf: Any) -> int:
                sends[0] += 1
                return real(buf)

            paho._sock_send = counted  # type: ignore[method-assign]
            payloads = [b"%06d" % i + b"x" * 1000 for i in range(MESSAGES)]
            # QoS 1 and now and then QoS 0, as the supervisor's orders and telemetry
            publishes = [
                asyncio.create_task(
                    link.publish("phalanx/test/burst", p, qos=0 if i % 500 == 0 else 1)
                )
                for i, p in enumerate(payloads)
            ]
            await asyncio.sleep(0)  # each is queued in the client
            link.write_now()
            async with asyncio.timeout(30):
                await asyncio.gather(*publishes)
            assert await asyncio.to_thread(done.wait, 30)
    finally:
        sub.loop_stop()
        sub.disconnect()
    assert sorted(got) == payloads  # every one, once
    # in order: the broker sends a QoS 0 message past QoS 1 ones waiting for the
    # subscriber's acknowledgements, so the order is the QoS 1 ones'
    once = [p for i, p in enumerate(payloads) if i % 500]
    assert [p for p in got if p in set(once)] == once
    # one send each before (900); now a few per 64 KB, and one per QoS 0 publish
    assert sends[0] < MESSAGES // 10, sends[0]


async def test_written_waits_until_a_full_socket_took_everything_or_its_timeout(
    broker: Broker,
) -> None:
    async with connected(broker, "t") as link:
        assert await link.written(1.0)  # nothing queued
        os.kill(broker.process.pid, signal.SIGSTOP)  # the broker reads no more
        try:
            publishes = [
                asyncio.create_task(link.publish(f"phalanx/test/full/{i}", BIG, qos=1))
                for i in range(FULL_MESSAGES)
            ]
            await asyncio.sleep(0)
            link.write_now()
            assert not await link.written(0.3)  # more than the socket's buffers hold
        finally:
            os.kill(broker.process.pid, signal.SIGCONT)
        assert await link.written(20)
        client = link._client
        assert client is not None and not client._client.want_write()
        async with asyncio.timeout(30):
            await asyncio.gather(*publishes)
