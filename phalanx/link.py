"""One daemon's link to the MQTT broker: connect, keep alive, reconnect, dispatch.

Both daemons use :class:`MqttLink`. It owns the reconnect loop (capped,
jittered exponential backoff), sets a fresh last will on every connection,
re-subscribes and calls the daemon's ``on_connect`` (where the agent publishes
its birth) after every reconnect, and hands every inbound message to the
daemon's handler. A handler that raises is logged; it never ends the link.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import aiomqtt
from paho.mqtt.client import DISCONNECT, PUBLISH
from paho.mqtt.enums import MQTTErrorCode
from pydantic import BaseModel

from phalanx.settings import MqttSettings

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
RETRY_AFTER_S = 0.2  # an outbox's pause before it tries a failed send again
# Messages handled from the queue before the link lets the event loop run its other
# work: a backlog of thousands is not handled in one turn of the loop.
YIELD_EVERY = 32
READ_PACKETS = 256  # MQTT packets one turn of the event loop reads at most, per link
WRITE_BYTES = 64 * 1024  # the most bytes of queued packets one send hands the socket
READ_BYTES = 64 * 1024  # what one read from the socket asks for (paho's reads are buffered)
# Publishes of :meth:`MqttLink.publish_many` a connection has with the broker at once, the
# rest waiting in the link, not in paho's queue: a message published meanwhile (a start
# order) waits behind at most these (~1.5 MB of a step's catalogs), not behind thousands.
BULK_IN_FLIGHT = 256

Handler = Callable[[str, bytes], Awaitable[None]]


class LinkDown(ConnectionError):
    """Raised by :meth:`MqttLink.publish` when the broker is not reachable in time."""


class Publish(Protocol):
    """What a component that only sends needs of the link: :meth:`MqttLink.publish`."""

    async def __call__(
        self, topic: str, payload: bytes, *, retain: bool = ..., timeout: float = ...
    ) -> None: ...


class PublishMany(Protocol):
    """:meth:`MqttLink.publish_many`: many messages, one result each (None: the broker took
    it; else why not). It may raise :class:`LinkDown` for all of them at once."""

    async def __call__(
        self, items: Sequence[tuple[str, bytes]], *, retain: bool = ..., timeout: float = ...
    ) -> list[BaseException | None]: ...


@dataclass(frozen=True)
class Will:
    topic: str
    payload: bytes
    retain: bool = True


class Backoff:
    """Capped exponential backoff with equal jitter: delays in [d/2, d], d doubling to ``cap``."""

    def __init__(self, initial: float = 0.2, cap: float = 10.0) -> None:
        self.initial = initial
        self.cap = cap
        self._attempt = 0

    def next(self) -> float:
        ceiling = min(self.cap, self.initial * (2**self._attempt))
        if ceiling < self.cap:  # stop counting at the cap: 2**n overflows a float past n=1023
            self._attempt += 1
        return float(ceiling / 2 + random.uniform(0, ceiling / 2))

    def reset(self) -> None:
        self._attempt = 0


class _Client(aiomqtt.Client):
    """aiomqtt 2.5's client, its socket watches made safe for many sockets in one loop.

    aiomqtt registers a socket's reader (at open) and writer (whenever paho has bytes to
    send) on the event loop through ``call_soon_threadsafe`` with the descriptor's
    number, to run later. When the socket closes before that runs (a connection refused
    or lost, by the hundred in a broker restart), the registration either fails (``Bad
    file descriptor``) or, once another socket got that number, puts the dead
    connection's callback in place of the new socket's: that connection never reads
    or writes again. Seen in bench/fleet_scale.py's simulators (512 links a process),
    where nodes' outboxes stalled after a broker restart; a daemon's HTTP sockets share
    its loop the same way. Here a registration runs only if paho still holds that
    socket."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sends: set[asyncio.Future[None]] = set()  # publishes waiting for the broker
        # send_many's publishes: waiting for room, and with the broker (mid -> publish)
        self._bulk: collections.deque[_Bulk] = collections.deque()
        self._bulk_out: dict[int, _Bulk] = {}
        self._batches: set[_Batch] = set()  # those not settled yet
        self._bulk_acked_at = 0.0  # when the broker last acknowledged one (monotonic)
        self._pump_queued = False
        self._drains: list[asyncio.Future[None]] = []  # waits for the queue written out
        # paho matches every message's topic against the per-topic callbacks, of which
        # the link has none: 4 % of the supervisor at 2,048 nodes (issue 22).
        self._client._on_message_filtered = _NoTopicCallbacks()  # type: ignore[assignment]
        # paho reads a packet in three reads or more (its first byte, its length a byte
        # at a time, the rest): a system call each. Its reads come from a buffer here,
        # filled READ_BYTES at a time: at 2,048 nodes the supervisor's reads were its
        # loop's longest stalls after its store's, their leaf the socket's recv.
        self._read_from_socket = self._client._sock_recv
        self._read: bytes = b""  # read from the socket, not yet given to paho from ...
        self._read_at = 0  # ... here on
        self._client._sock_recv = self._buffered_recv  # type: ignore[method-assign]

    def _buffered_recv(self, bufsize: int) -> bytes:
        """paho's ``_sock_recv``: up to ``bufsize`` bytes, from what was read before if
        any is left, else from one read of the socket of ``READ_BYTES`` at least (raising
        as paho's does: ``BlockingIOError`` when there is nothing, b"" at its end)."""
        data, at = self._read, self._read_at
        if at < len(data):
            self._read_at = at + bufsize
            return data[at : at + bufsize]
        got: bytes = self._read_from_socket(max(bufsize, READ_BYTES))
        if len(got) > bufsize:
            self._read, self._read_at = got, bufsize
            return got[:bufsize]
        self._read, self._read_at = b"", 0
        return got

    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        fd = sock.fileno()
        self._read, self._read_at = b"", 0  # a new connection: nothing of the last

        again: list[asyncio.Handle] = []  # a read of what was read already, to come

        def pending() -> bool:
            """Bytes read that the selector does not see: in the link's buffer, or
            decoded by an SSL socket."""
            if self._read_at < len(self._read):
                return True
            decoded = getattr(client.socket(), "pending", None)
            return decoded is not None and decoded() > 0

        def readable() -> None:
            # READ_PACKETS at most a turn of the loop (``_read_some``). What is left in
            # the socket makes the selector call again; what was read into the link's
            # buffer or an SSL socket's already, it does not see: that is read at the
            # next turn (one call queued).
            while again:  # this call reads what the one queued would have
                again.pop().cancel()
            try:
                while not _read_some(client):
                    if not pending():  # paho may not take every byte read at once
                        return
                if pending():
                    again.append(self._loop.call_soon(readable))
            except Exception as exc:  # a broken pipe: the connection is lost
                if not self._disconnected.done():
                    self._disconnected.set_exception(exc)

        def watch() -> None:
            if client.socket() is sock and sock.fileno() == fd:
                self._loop.add_reader(fd, readable)
                self._misc_task = self._loop.create_task(self._misc_loop())

        self._loop.call_soon_threadsafe(watch)  # paho may call from connect's thread

    def _on_socket_register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        fd = sock.fileno()

        def writable() -> None:
            try:
                _write(client)
            except Exception as exc:
                if not self._disconnected.done():
                    self._disconnected.set_exception(exc)
            self._drained()

        def watch() -> None:
            # Nothing left to write: written since by write_now, whose drain unregistered
            # a writer not yet added (one added now would fire forever, with nothing to
            # write and no unregistration to come).
            if client.socket() is sock and sock.fileno() == fd and client.want_write():
                self._loop.add_writer(fd, writable)

        def write_soon() -> None:
            # What was published in this turn of the loop goes in one write; the socket
            # is watched for writing only when it did not take all of it.
            if client.socket() is not sock or sock.fileno() != fd:
                return  # that connection is gone
            writable()
            if client.want_write():
                self._loop.add_writer(fd, writable)

        # paho asks at every publish that finds its queue empty. On the loop's own thread
        # the queue is written at the loop's next turn: a writer registered and removed
        # for every message is two system calls (epoll's), and call_soon_threadsafe a
        # third (the loop's self pipe): the simulators' largest stalls at 2,048 nodes,
        # 512 links a process (issue 22). From connect's thread, the writer is watched.
        if self._on_loop():
            self._loop.call_soon(write_soon)
        else:
            self._loop.call_soon_threadsafe(watch)

    def _on_loop(self) -> bool:
        """Whether this runs on the link's event loop's thread."""
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs in this thread
            return False

    def write_now(self) -> None:
        """Hand paho's queued messages to the socket now, as far as it takes them, not at
        the loop's next turn (the rest goes when the socket is writable). Called on the
        event loop only."""
        try:
            _write(self._client)
        except Exception as exc:
            if not self._disconnected.done():
                self._disconnected.set_exception(exc)
        self._drained()

    async def written(self, timeout: float) -> bool:
        """Wait until nothing published waits in the client any more (all of it handed
        to the socket), ``timeout`` at most: False when something still waits then, or
        the connection ended first."""
        if not self._client.want_write():
            return True
        drain = self._loop.create_future()
        self._drains.append(drain)
        try:
            async with asyncio.timeout(timeout):
                await drain
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._drains.remove(drain)
        return not self._client.want_write()

    def _drained(self, *, ended: bool = False) -> None:
        """Wake the waits of :meth:`written` once the client's queue is empty (``ended``:
        the connection is gone, whatever is left)."""
        if self._drains and (ended or not self._client.want_write()):
            for drain in self._drains:
                if not drain.done():
                    drain.set_result(None)
            self._drains.clear()

    async def send(
        self, topic: str, payload: bytes, qos: int, retain: bool, timeout: float
    ) -> None:
        """Publish and wait for the broker to take it (QoS 1: its PUBACK; QoS 0: written),
        with one future and one timer a message. aiomqtt's ``publish`` makes a task for
        the wait, an ``Event``, and counts every publish in flight at each publish: at a
        thousand in flight (a recovery's orders, a step's catalogs to 2,048 nodes) that
        was most of the cost of sending (issue 22). Raises ``aiomqtt.MqttCodeError`` if
        paho refuses it, ``TimeoutError`` after ``timeout``; a lost connection fails the
        wait through :meth:`fail_sends`."""
        info = self._client.publish(topic, payload, qos, retain)
        if info.rc != 0:  # MQTT_ERR_SUCCESS
            raise aiomqtt.MqttCodeError(info.rc, "Could not publish message")
        if info.is_published():
            return
        acked = _Acked(self._loop.create_future())
        mid = info.mid
        # aiomqtt's on_publish calls its set(), as it would an Event's
        pending: dict[int, Any] = self._pending_publishes
        pending[mid] = acked
        self._sends.add(acked.future)
        timer = self._loop.call_later(timeout, acked.expire)
        try:
            await acked.future
        finally:
            timer.cancel()
            self._sends.discard(acked.future)
            if pending.get(mid) is acked:
                del pending[mid]

    def send_many(
        self,
        items: Sequence[tuple[str, bytes]],
        qos: int,
        retain: bool,
        timeout: float,
    ) -> asyncio.Future[list[BaseException | None]]:
        """Publish every ``(topic, payload)``, in order, ``BULK_IN_FLIGHT`` at most with the
        broker at once (this connection's, all batches together): a future of one result
        each, None once the broker took it (QoS 1: its PUBACK), else the error (paho's
        refusal, ``TimeoutError``, or what :meth:`fail_sends` makes).

        One future and one timer for the lot: :meth:`send`'s task, future and timer a
        message were most of a step's hand-off of 2,048 catalogs (issue 22). The timeout
        is the broker's silence: the batch fails once none of this connection's batched
        publishes was acknowledged for ``timeout`` seconds, while some of it waits."""
        batch = _Batch(self._loop.create_future(), len(items))
        if not items:
            batch.future.set_result([])
            return batch.future
        batch.slots = [
            _Bulk(self, batch, i, topic, payload, qos, retain)
            for i, (topic, payload) in enumerate(items)
        ]
        self._bulk.extend(batch.slots)
        self._batches.add(batch)
        batch.began = time.monotonic()
        batch.timer = self._loop.call_later(timeout, self._bulk_check, batch, timeout)
        batch.future.add_done_callback(functools.partial(self._cancelled, batch))
        self._pump()
        return batch.future

    def _cancelled(self, batch: _Batch, future: asyncio.Future[Any]) -> None:
        """A batch whose wait was cancelled: what of it is not out yet never goes."""
        if future.cancelled():
            for slot in batch.slots:
                self._drop(slot, asyncio.CancelledError())
            self._pump()

    def _pump(self) -> None:
        """Hand paho the next batched publishes while fewer than ``BULK_IN_FLIGHT`` are out."""
        self._pump_queued = False
        while self._bulk and len(self._bulk_out) < BULK_IN_FLIGHT:
            slot = self._bulk.popleft()
            if slot.done:
                continue  # its batch failed meanwhile
            try:
                info = self._client.publish(slot.topic, slot.payload, slot.qos, slot.retain)
            except Exception as exc:  # paho's ValueError: a topic or payload it refuses
                self._settle(slot, exc)
                continue
            if info.rc != 0:  # MQTT_ERR_SUCCESS
                self._settle(slot, aiomqtt.MqttCodeError(info.rc, "Could not publish message"))
            elif info.is_published():
                self._settle(slot, None)
            else:
                slot.mid = info.mid
                self._bulk_out[info.mid] = slot
                pending: dict[int, Any] = self._pending_publishes
                pending[info.mid] = slot  # aiomqtt's on_publish calls its set(), as an Event's

    def _acked(self, slot: _Bulk) -> None:
        """The broker took ``slot`` (from aiomqtt's ``on_publish``, inside paho's read):
        the next ones go after the read, at the loop's next turn."""
        mid = slot.mid
        if mid is not None and self._bulk_out.get(mid) is slot:
            del self._bulk_out[mid]
            self._bulk_acked_at = time.monotonic()
        self._settle(slot, None)
        if self._bulk and not self._pump_queued:
            self._pump_queued = True
            self._loop.call_soon(self._pump)

    def _settle(self, slot: _Bulk, error: BaseException | None) -> None:
        if slot.done:
            return
        slot.done = True
        batch = slot.batch
        batch.results[slot.index] = error
        batch.left -= 1
        if batch.left == 0:
            self._batches.discard(batch)
            # Settled: its publishes (each naming the batch) go by their reference counts,
            # payloads and all; a cycle waited for the collector, with a step's catalogs
            # (~10 MB at 2,048 nodes) in it (issue 22).
            batch.slots = []
            if batch.timer is not None:
                batch.timer.cancel()
            if not batch.future.done():
                batch.future.set_result(batch.results)

    def _drop(self, slot: _Bulk, error: BaseException) -> None:
        """``slot`` fails with ``error``; if it was out, its room is free again."""
        if slot.done:
            return
        mid = slot.mid
        if mid is not None and self._bulk_out.get(mid) is slot:
            del self._bulk_out[mid]
            pending: dict[int, Any] = self._pending_publishes
            if pending.get(mid) is slot:
                del pending[mid]
        self._settle(slot, error)

    def _bulk_check(self, batch: _Batch, timeout: float) -> None:
        """``timeout`` after a batch began or its check last ran: it fails now if the broker
        acknowledged none of this connection's batched publishes since ``timeout`` ago."""
        batch.timer = None
        if batch.left == 0:
            return
        silent = time.monotonic() - max(batch.began, self._bulk_acked_at)
        if silent < timeout:
            batch.timer = self._loop.call_later(timeout - silent, self._bulk_check, batch, timeout)
            return
        for slot in batch.slots:
            self._drop(slot, TimeoutError(f"no acknowledgement from the broker for {timeout:g}s"))
        self._pump()

    def fail_sends(self, error: Callable[[], Exception]) -> None:
        """The connection ended: every publish still waiting for the broker fails now,
        with what ``error`` makes; a wait for the queue written out ends too."""
        for future in list(self._sends):
            if not future.done():
                future.set_exception(error())
        for batch in list(self._batches):
            for slot in batch.slots:
                self._drop(slot, error())
        self._bulk.clear()
        self._drained(ended=True)


def _read_some(client: Any) -> bool:
    """paho's ``loop_read``, but ``READ_PACKETS`` packets at most: True when it stopped
    there with more perhaps to read. ``loop_read`` reads as many packets as messages are
    in flight: a recovery's 2,048 start orders' acknowledgements and every node's acks,
    rank events and landings behind them, 0.6-0.9 s of the supervisor's loop in one
    callback at 2,048 nodes (the stall watch's samples), while the rest of the orders
    waited to be written and every HTTP request and timer waited too (issue 22)."""
    for _ in range(READ_PACKETS):
        if client._sock is None:
            return False  # MQTT_ERR_NO_CONN, as loop_read says
        rc = client._packet_read()
        if rc > 0:
            client._loop_rc_handle(rc)  # the connection is lost: paho says so
            return False
        if rc == MQTTErrorCode.MQTT_ERR_AGAIN:
            return False
    return True


def _write(client: Any) -> None:
    """paho's ``loop_write``, its queued packets handed to the socket together
    (:func:`_write_joined`), and the socket's writer registered or dropped after it as
    paho does."""
    if client._sock is None:
        return
    try:
        rc = _write_joined(client)
        if rc > 0:  # the connection is lost (MQTT_ERR_AGAIN, -1: the socket is full)
            client._loop_rc_handle(rc)
    finally:
        if client.want_write():
            client._call_socket_register_write()
        else:
            client._call_socket_unregister_write()


def _write_joined(client: Any) -> MQTTErrorCode:
    """paho's ``_packet_write``, but the queued packets go up to ``WRITE_BYTES`` a send,
    not one send each. A launch's 2,048 start orders were 2,048 sends of ~1 KB, each
    waking the broker: 0.3 s of the supervisor's loop at 2,048 nodes on a busy host, where
    2,048 on an idle one take 10-25 ms (the stall watch's samples, issue 22). A packet
    whose end paho acts on (a QoS 0 publish: its ``on_publish``; a disconnect: the
    socket closed) is written by paho itself, alone."""
    out: collections.deque[Any] = client._out_packet
    while out:
        head = out[0]
        if _paho_ends(head):
            rc = _write_one(client)
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or client._sock is None:
                return MQTTErrorCode(rc)
            if out and out[0] is head:
                break  # nothing written (paho's "else: break")
            continue
        batch: list[Any] = []
        size = 0
        for packet in out:
            if _paho_ends(packet) or (batch and size + packet["to_process"] > WRITE_BYTES):
                break
            batch.append(packet)
            size += packet["to_process"]
        if len(batch) == 1:
            data: bytes | bytearray | memoryview = memoryview(head["packet"])[head["pos"] :]
        else:
            data = b"".join(memoryview(p["packet"])[p["pos"] :] for p in batch)
        try:
            sent = client._sock_send(data)
        except (AttributeError, ValueError):  # no socket any more
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        except BlockingIOError:  # full: paho registered the writer
            return MQTTErrorCode.MQTT_ERR_AGAIN
        except OSError as exc:
            log.debug("an MQTT send failed: %s", exc)
            return MQTTErrorCode.MQTT_ERR_CONN_LOST
        if sent <= 0:
            break
        for packet in batch:  # the packets written whole leave the queue
            took = min(sent, packet["to_process"])
            packet["to_process"] -= took
            packet["pos"] += took
            sent -= took
            if packet["to_process"]:
                break
            out.popleft()
    with client._msgtime_mutex:
        client._last_msg_out = time.monotonic()  # paho's clock (its keepalive's)
    return MQTTErrorCode.MQTT_ERR_SUCCESS


def _paho_ends(packet: dict[str, Any]) -> bool:
    """Whether paho acts once ``packet`` is written: a QoS 0 publish, a disconnect."""
    kind: int = packet["command"] & 0xF0
    return (kind == PUBLISH and packet["qos"] == 0) or kind == DISCONNECT


def _write_one(client: Any) -> int:
    """paho's ``_packet_write`` on the queue's first packet alone (the rest set aside)."""
    rest: collections.deque[Any] = client._out_packet
    client._out_packet = collections.deque([rest.popleft()])
    try:
        return int(client._packet_write())
    finally:
        left, client._out_packet = client._out_packet, rest
        rest.extendleft(reversed(left))  # not written (all of it): first again


class _NoTopicCallbacks:
    """paho's per-topic callbacks (``message_callback_add``) when there are none: every
    message goes to ``on_message``, aiomqtt's queue."""

    def iter_match(self, topic: str) -> tuple[()]:
        return ()

    def __setitem__(self, topic: str, callback: object) -> None:
        raise NotImplementedError("phalanx.link takes every message through its handler")

    def __delitem__(self, topic: str) -> None:
        raise KeyError(topic)


class _Acked:
    """What :meth:`_Client.send` leaves with aiomqtt for one publish: ``set`` (aiomqtt's
    ``on_publish``) ends the wait."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future

    def set(self) -> None:
        if not self.future.done():
            self.future.set_result(None)

    def expire(self) -> None:
        if not self.future.done():
            self.future.set_exception(TimeoutError("no acknowledgement from the broker"))


class _Batch:
    """The publishes of one :meth:`_Client.send_many`: settled together."""

    __slots__ = ("began", "future", "left", "results", "slots", "timer")

    def __init__(self, future: asyncio.Future[list[BaseException | None]], count: int) -> None:
        self.future = future
        self.results: list[BaseException | None] = [None] * count
        self.left = count
        self.slots: list[_Bulk] = []
        self.began = 0.0
        self.timer: asyncio.TimerHandle | None = None


class _Bulk:
    """One publish of a :class:`_Batch`; ``set`` (aiomqtt's ``on_publish``) is its PUBACK."""

    __slots__ = ("batch", "client", "done", "index", "mid", "payload", "qos", "retain", "topic")

    def __init__(
        self,
        client: _Client,
        batch: _Batch,
        index: int,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
    ) -> None:
        self.client = client
        self.batch = batch
        self.index = index
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.mid: int | None = None
        self.done = False

    def set(self) -> None:
        self.client._acked(self)


class MqttLink:
    """A supervised connection to the broker, usable as ``async with MqttLink(...)``."""

    def __init__(
        self,
        settings: MqttSettings,
        client_id: str,
        *,
        subscriptions: Sequence[str],
        handler: Handler,
        will: Callable[[], Will] | None = None,
        on_connect: Callable[[], Awaitable[None]] | None = None,
        persistent_session: bool = False,
        before_connect: Callable[[], None] | None = None,
    ) -> None:
        """``before_connect`` is called before each connection attempt: a ``LinkDown``
        from it skips the attempt (the supervisor's, once it no longer leads)."""
        self._settings = settings
        # The brokers, used one at a time: a connection lost or refused moves to the next.
        self._endpoints = settings.endpoints()
        self._at = 0
        self._visited: int | None = None  # the broker of the last connection made
        self._before_connect = before_connect
        self._client_id = client_id
        self._subscriptions = tuple(subscriptions)
        self._handler = handler
        self._will = will
        self._on_connect = on_connect
        self._persistent = persistent_session
        self._client: _Client | None = None
        self._connected = asyncio.Event()
        self._gone = asyncio.Event()  # set when the current connection ends
        self._task: asyncio.Task[None] | None = None
        self._backoff = Backoff(settings.reconnect_initial_s, settings.reconnect_max_s)
        self.connects = 0
        self.caught_up_at = time.monotonic()  # when every message received was handled

    @property
    def behind_s(self) -> float:
        """How long the handler has had messages received and not yet handled (0: none
        waiting): the daemon is this far behind its broker."""
        client = self._client
        if client is None or not len(client.messages):
            return 0.0
        return max(0.0, time.monotonic() - self.caught_up_at)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def write_now(self) -> None:
        """What was published and waits in the client goes to the socket now, rather than
        after whatever the loop runs next (a recovery's start orders, before the catalogs'
        build: issue 22)."""
        if self._client is not None:
            self._client.write_now()

    async def written(self, timeout: float) -> bool:
        """Wait until what was published is all handed to the socket, ``timeout`` at
        most (False: not all of it, or the link is down)."""
        client = self._client
        if client is None:
            return False
        return await client.written(timeout)

    @property
    def broker(self) -> str:
        """``host:port`` of the broker the link is on (or tries next)."""
        host, port = self._endpoints[self._at]
        return f"{host}:{port}"

    async def __aenter__(self) -> MqttLink:
        self._task = asyncio.create_task(self._run(), name=f"mqtt-link:{self._client_id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            # aiomqtt waits for the broker's answer to its DISCONNECT without a timeout; a
            # link cancelled while it was still connecting has been seen to wait forever
            # there. Closing the process closes the socket anyway (the broker then sends
            # the will): never let a daemon's shutdown hang on it.
            done, _ = await asyncio.wait({self._task}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                log.warning(
                    "the MQTT link to %s did not close within %gs; leaving it",
                    self.broker,
                    CLOSE_TIMEOUT_S,
                )
                return
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def until_connected(self) -> None:
        """Return once the link is up (at once if it is); a loop's wait, no limit."""
        await self._connected.wait()

    async def wait_connected(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            brokers = ", ".join(f"{host}:{port}" for host, port in self._endpoints)
            raise TimeoutError(
                f"no connection to the MQTT broker {brokers} within {timeout:.1f}s"
            ) from None

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 5.0,
        connection: int | None = None,
    ) -> None:
        """Publish once the link is up; raise :class:`LinkDown` after ``timeout`` seconds.
        ``connection`` (a value of ``connects``): only on that connection; raise
        :class:`LinkDown` if the link has connected again since."""
        try:
            if not self._connected.is_set():
                await asyncio.wait_for(self._connected.wait(), timeout)
            client = self._client
            if client is None:
                raise LinkDown(f"MQTT link to {self.broker} dropped before publishing")
            if connection is not None and connection != self.connects:
                raise LinkDown(f"MQTT link to {self.broker} connected again before publishing")
            await self._publish_on(client, self._gone, topic, payload, qos, retain, timeout)
        except (TimeoutError, aiomqtt.MqttError) as exc:
            raise LinkDown(
                f"could not publish to {topic} within {timeout:.1f}s: {exc or 'broker unreachable'}"
            ) from exc

    async def publish_many(
        self,
        items: Sequence[tuple[str, bytes]],
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 5.0,
    ) -> list[BaseException | None]:
        """Publish every ``(topic, payload)`` once the link is up, in order, on one
        connection (:meth:`_Client.send_many`): one result each, None once the broker took
        it, else a :class:`LinkDown` saying why not (the link not up within ``timeout``,
        the connection lost, the broker silent for ``timeout`` seconds)."""
        if not items:
            return []
        try:
            if not self._connected.is_set():
                await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            down = f"could not publish within {timeout:.1f}s: broker unreachable"
            return [LinkDown(f"{down} ({topic})") for topic, _ in items]
        client = self._client
        if client is None or self._gone.is_set():
            return [
                LinkDown(f"MQTT link to {self.broker} lost before publishing to {topic}")
                for topic, _ in items
            ]
        results = await client.send_many(items, qos, retain, timeout)
        return [
            None
            if result is None
            else LinkDown(f"could not publish to {topic}: {result or type(result).__name__}")
            for (topic, _), result in zip(items, results, strict=True)
        ]

    async def _publish_on(
        self,
        client: _Client,
        gone: asyncio.Event,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        timeout: float,
    ) -> None:
        """Publish on one connection; raise :class:`LinkDown` as soon as it ends. aiomqtt
        would wait out the whole timeout for the acknowledgement of a publish whose
        connection was lost (seen after a broker crash: an outbox held for 30 s)."""
        if gone.is_set():
            raise LinkDown(f"MQTT link to {self.broker} lost before publishing to {topic}")
        try:
            await client.send(topic, payload, qos, retain, timeout)
        except TimeoutError:
            raise TimeoutError(
                f"no acknowledgement of a publish to {topic} within {timeout:.1f}s"
            ) from None

    def _tls(self) -> ssl.SSLContext | None:
        s = self._settings
        if not s.tls:
            return None
        ctx = ssl.create_default_context(cafile=str(s.ca_file) if s.ca_file else None)
        if s.cert_file:
            ctx.load_cert_chain(str(s.cert_file), str(s.key_file) if s.key_file else None)
        return ctx

    async def _run(self) -> None:
        while True:
            broker = self.broker
            try:
                await self._connect_once()
                delay = self._backoff.next()  # pragma: no cover - a connection ends by raising
            except (aiomqtt.MqttError, LinkDown) as exc:
                delay = self._backoff.next()
                log.warning(
                    "MQTT link to %s lost or refused (%s); %s in %.2fs",
                    broker,
                    exc,
                    self._next_broker(),
                    delay,
                )
            except Exception:  # a will that cannot be written, a TLS file gone: retry, never die
                delay = self._backoff.next()
                log.exception(
                    "MQTT link to %s failed; %s in %.2fs", broker, self._next_broker(), delay
                )
            finally:
                self._connected.clear()
                client, self._client = self._client, None
                self._gone.set()
                if client is not None:  # a publish waiting on that connection fails now
                    client.fail_sends(
                        functools.partial(LinkDown, f"MQTT link to {broker} lost while publishing")
                    )
            await asyncio.sleep(delay)

    def move_on(self, why: str) -> bool:
        """Leave the broker the link is on, cleanly (no will), for the next one listed;
        False (and nothing done) with one broker, or while not connected."""
        client = self._client
        if len(self._endpoints) < 2 or client is None or not self._connected.is_set():
            return False
        log.warning("leaving MQTT broker %s for the next one listed: %s", self.broker, why)
        client._client.disconnect()
        return True

    def _next_broker(self) -> str:
        """Move on to the next broker listed (the same one when there is one); say where."""
        if len(self._endpoints) == 1:
            return "reconnecting"
        self._at = (self._at + 1) % len(self._endpoints)
        return f"trying {self.broker}"

    def _new_client(self, *, clean: bool, will: Will | None) -> _Client:
        s = self._settings
        host, port = self._endpoints[self._at]
        return _Client(
            host,
            port,
            identifier=self._client_id,
            username=s.username,
            password=s.password.get_secret_value() if s.password else None,
            keepalive=s.keepalive_s,
            clean_session=clean,
            timeout=s.connect_timeout_s,
            tls_context=self._tls(),
            will=aiomqtt.Will(will.topic, will.payload, qos=1, retain=will.retain)
            if will
            else None,
            max_inflight_messages=s.max_inflight,
        )

    async def _connect_once(self) -> None:
        """One connection, from connect until it is lost (it ends by raising)."""
        s = self._settings
        if self._before_connect is not None:
            self._before_connect()
        if self._persistent and self._visited is not None and self._visited != self._at:
            # Moved to another broker: a session this client left there on an earlier
            # visit holds what was queued for it then (commands long stale). End it
            # first; the persistent session starts anew.
            async with self._new_client(clean=True, will=None):
                pass
        will = self._will() if self._will else None
        client = self._new_client(clean=not self._persistent, will=will)
        # aiomqtt logs a warning for every publish made while more than this wait for
        # their acknowledgement: a recovery's orders to a thousand nodes are no warning.
        client.pending_calls_threshold = max(s.max_inflight, 65536)
        async with client:
            self._client = client
            self._gone = asyncio.Event()
            for topic in self._subscriptions:
                await client.subscribe(topic, qos=1)
            self.connects += 1
            self._visited = self._at
            self._connected.set()
            self._backoff.reset()
            log.info("connected to MQTT broker %s as %s", self.broker, self._client_id)
            if self._on_connect is not None:
                await self._on_connect()
            await self._receive(client)

    async def _receive(self, client: _Client) -> None:
        """Hand every message to the handler, in order, until the connection ends.
        What is queued already is taken without waiting: aiomqtt's iterator makes a task
        and waits on it for every message, a tenth of the supervisor's time at 2,048 nodes
        (issue 22). It raises ``aiomqtt.MqttError`` once the queue is empty and the
        connection lost."""
        queue: asyncio.Queue[aiomqtt.Message] = client._queue
        messages = client.messages
        taken = 0
        while True:
            try:
                message = queue.get_nowait()
            except asyncio.QueueEmpty:
                self.caught_up_at = time.monotonic()
                message = await anext(messages)
            else:
                taken += 1
                if taken % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # the loop's other work (HTTP, timers) goes on
            await self._dispatch(str(message.topic), message.payload)

    async def _dispatch(self, topic: str, payload: object) -> None:
        data = payload if isinstance(payload, bytes | bytearray) else str(payload or "").encode()
        try:
            await self._handler(topic, bytes(data))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed on a message from %s; message dropped", topic)


# A handler of :class:`MqttLinks`: the index of the link a message came through, its
# topic and payload.
LinksHandler = Callable[[int, str, bytes], Awaitable[None]]


class MqttLinks:
    """One :class:`MqttLink` per broker of ``settings.endpoints()``, all up at once and
    used as one: the supervisor's. Agents each use one broker of the list at a time and
    move to the next when theirs is lost; a supervisor on every broker hears each node
    wherever it is, so that no broker's nodes are ever out of its sight while it reaches
    that broker.

    Every message of every link goes to ``handler`` with the index of its link.
    ``on_connect`` runs with the index of the link that (re)connected. A publish goes to
    the link ``via`` names, else to the link ``route`` names for its topic if that link is
    up (a command: the broker its node is heard on), else to every link that is up (a
    retained catalog or status must be on whichever broker a node is or moves to).

    Retained messages are kept (the newest payload of each topic; a cleared one until
    every broker took the clearing): a link that (re)connects gets them all again before
    ``on_connect`` runs, so that a broker that was away, or lost them, holds what the
    others hold. A retained publish that a connected broker failed raises
    :class:`LinkDown` (naming it) even where the others took it: its sender tries again.
    With one broker this is that broker's link, nothing more."""

    def __init__(
        self,
        settings: MqttSettings,
        client_id: str,
        *,
        subscriptions: Sequence[str],
        handler: LinksHandler,
        will: Callable[[], Will] | None = None,
        on_connect: Callable[[int], Awaitable[None]] | None = None,
        persistent_session: bool = False,
        before_connect: Callable[[], None] | None = None,
        route: Callable[[str], int | None] | None = None,
    ) -> None:
        self._route = route
        self._on_connect = on_connect
        # topic -> (its newest retained payload, the links that took it)
        self._retained: dict[str, tuple[bytes, set[int]]] = {}
        self.links: list[MqttLink] = []
        endpoints = settings.endpoints()
        for index, (host, port) in enumerate(endpoints):
            self.links.append(
                MqttLink(
                    settings.model_copy(update={"host": host, "port": port, "brokers": []}),
                    client_id,
                    subscriptions=subscriptions,
                    handler=functools.partial(handler, index),
                    will=will,
                    on_connect=functools.partial(self._connected, index)
                    if len(endpoints) > 1
                    else (functools.partial(on_connect, index) if on_connect else None),
                    persistent_session=persistent_session,
                    before_connect=before_connect,
                )
            )

    async def _connected(self, index: int) -> None:
        """Link ``index`` (re)connected: the retained messages again, each as it is now
        (one published meanwhile went to this link too, in order), then ``on_connect``."""
        link = self.links[index]
        items = [(topic, found[0]) for topic, found in self._retained.items()]
        results = await link.publish_many(items, retain=True, timeout=30.0)
        for (topic, payload), result in zip(items, results, strict=True):
            if result is None:
                self._took(topic, payload, index)
        failed = next((result for result in results if result is not None), None)
        if failed is not None:
            raise failed
        # One published meanwhile may have reached this broker before the batch's older
        # payload: whatever changed since goes again, as it is now.
        for topic, payload in items:
            found = self._retained.get(topic)
            if found is not None and found[0] != payload:
                await link.publish(topic, found[0], retain=True, timeout=30.0)
                self._took(topic, found[0], index)
        if self._on_connect is not None:
            await self._on_connect(index)

    def _took(self, topic: str, payload: bytes, index: int) -> None:
        found = self._retained.get(topic)
        if found is None or found[0] != payload:
            return  # a newer payload replaced it meanwhile
        found[1].add(index)
        if not payload and len(found[1]) == len(self.links):
            del self._retained[topic]  # cleared everywhere: nothing left to keep

    @property
    def connected(self) -> bool:
        """Whether any broker is reachable."""
        return any(link.connected for link in self.links)

    @property
    def connects(self) -> int:
        return sum(link.connects for link in self.links)

    @property
    def behind_s(self) -> float:
        return max(link.behind_s for link in self.links)

    def write_now(self) -> None:
        """:meth:`MqttLink.write_now` on every link."""
        for link in self.links:
            link.write_now()

    async def written(self, timeout: float) -> bool:
        """:meth:`MqttLink.written` on every link that is up: whether all of them wrote
        everything within ``timeout``."""
        up = [link for link in self.links if link.connected]
        return all(await asyncio.gather(*(link.written(timeout) for link in up)))

    def up(self, index: int) -> bool:
        return self.links[index].connected

    def broker(self, index: int) -> str:
        return self.links[index].broker

    async def __aenter__(self) -> MqttLinks:
        for link in self.links:
            await link.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.gather(*(link.__aexit__(exc_type, exc, tb) for link in self.links))

    async def until_connected(self) -> None:
        """Return once any link is up."""
        if self.connected:
            return
        waits = [asyncio.ensure_future(link.until_connected()) for link in self.links]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def wait_connected(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.until_connected(), timeout)
        except TimeoutError:
            brokers = ", ".join(link.broker for link in self.links)
            raise TimeoutError(
                f"no connection to any MQTT broker ({brokers}) within {timeout:.1f}s"
            ) from None

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 5.0,
        via: int | None = None,
    ) -> None:
        """Publish as the class says; raise :class:`LinkDown` when no broker took it (a
        broker that failed where another took it is logged)."""
        links = self.links
        if via is None and len(links) > 1 and self._route is not None:
            routed = self._route(topic)
            if routed is not None and 0 <= routed < len(links) and links[routed].connected:
                via = routed
        if via is not None or len(links) == 1:
            link = links[via or 0]
            await link.publish(topic, payload, qos=qos, retain=retain, timeout=timeout)
            if retain and len(links) > 1 and via is not None:
                self._took(topic, payload, via)
            return
        if retain:  # kept before the links are looked at: a link up from now gets it
            self._retained[topic] = (payload, set())
        if not self.connected:
            try:
                await asyncio.wait_for(self.until_connected(), timeout)
            except TimeoutError:
                raise LinkDown(
                    f"could not publish to {topic} within {timeout:.1f}s: no broker reachable"
                ) from None
        up = [link for link in links if link.connected]
        results = await asyncio.gather(
            *(link.publish(topic, payload, qos=qos, retain=retain, timeout=timeout) for link in up),
            return_exceptions=True,
        )
        failed = [(link, r) for link, r in zip(up, results, strict=True) if r is not None]
        for _, result in failed:
            if not isinstance(result, LinkDown):
                raise result
        if retain:
            for index, link in enumerate(links):
                if link in up and all(link is not f for f, _ in failed):
                    self._took(topic, payload, index)
        if len(failed) == len(up):
            raise failed[0][1]
        if retain and failed:  # a broker still connected holds an older one: try again
            raise LinkDown(
                f"retained {topic} not taken by "
                + "; ".join(f"broker {link.broker}: {result}" for link, result in failed)
            )
        for link, result in failed:
            log.warning("not sent to broker %s (the others took it): %s", link.broker, result)

    async def publish_many(
        self,
        items: Sequence[tuple[str, bytes]],
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 5.0,
    ) -> list[BaseException | None]:
        """Publish every ``(topic, payload)`` to every broker that is up, as :meth:`publish`
        does a message no route names (a catalog), with one batch a link
        (:meth:`MqttLink.publish_many`): one result each, None once it was taken, else a
        :class:`LinkDown` (no broker took it; or, retained, a broker that is up did not)."""
        links = self.links
        if len(links) == 1:
            return await links[0].publish_many(items, qos=qos, retain=retain, timeout=timeout)
        if not items:
            return []
        if retain:  # kept before the links are looked at: a link up from now gets them
            for topic, payload in items:
                self._retained[topic] = (payload, set())
        if not self.connected:
            try:
                await asyncio.wait_for(self.until_connected(), timeout)
            except TimeoutError:
                down = f"could not publish within {timeout:.1f}s: no broker reachable"
                return [LinkDown(f"{down} ({topic})") for topic, _ in items]
        up = [(index, link) for index, link in enumerate(links) if link.connected]
        each = await asyncio.gather(
            *(link.publish_many(items, qos=qos, retain=retain, timeout=timeout) for _, link in up)
        )
        out: list[BaseException | None] = []
        for i, (topic, payload) in enumerate(items):
            failed = [(link, got[i]) for (_, link), got in zip(up, each, strict=True) if got[i]]
            if retain:
                for (index, _), got in zip(up, each, strict=True):
                    if got[i] is None:
                        self._took(topic, payload, index)
            if len(failed) == len(up):
                out.append(failed[0][1])
            elif retain and failed:  # a broker still connected holds an older one
                out.append(
                    LinkDown(
                        f"retained {topic} not taken by "
                        + "; ".join(f"broker {link.broker}: {error}" for link, error in failed)
                    )
                )
            else:
                for link, error in failed:
                    log.warning(
                        "not sent to broker %s (the others took it): %s", link.broker, error
                    )
                out.append(None)
        return out


# What an outbox sends for its queue's head: one message standing for the first
# ``count`` queued (``count`` >= 1), e.g. ``wire.pack_landings``.
Pack = Callable[[Iterable[BaseModel]], tuple[BaseModel, int]]


class Outbox:
    """Messages that must reach the broker, in order, on one topic: while the link is down
    they wait (queued in memory), never dropped. ``run`` is the loop that sends them;
    ``flush`` sends what is left at shutdown.

    One message is sent at a time, whoever sends it, and it leaves the queue only once
    the broker took it: a ``run`` cancelled mid-publish leaves its message first in line
    for ``flush``, and a ``flush`` during a send waits for it, so the order holds. A
    message whose publish was cut short may be sent twice: at least once and in order,
    which is what QoS 1 promises anyway.

    ``pack``, when given, makes what is sent of the queue's head: several queued
    messages may go as one (the agent's landings, ``wire.pack_landings``), each still
    sent at least once and in order.

    ``gate``, when given, holds ``run`` until it is set: the agent sends what it owes the
    supervisor only once the broker is known to hold the supervisor's session (its
    retained status was seen), since a message published to a broker that lost its
    sessions, before the supervisor subscribed again, is acknowledged by the broker and
    delivered to nobody. The gate is looked at once the link is up (a new connection
    closes it before anything waiting for the link resumes), and the send is tied to
    that connection: one that waited for the link across a reconnect is not sent on the
    new connection until the gate opens there. ``flush`` does not wait for it.

    ``max_queued``, when given, bounds the queue: a message put in a full queue pushes
    out the oldest one not being sent (``dropped`` counts them, and the first drop and
    every 1,000th after it are logged), so that an agent cut off from every supervisor
    for hours keeps its memory and its newest news."""

    def __init__(
        self,
        link: MqttLink,
        topic: str,
        what: str,
        *,
        gate: asyncio.Event | None = None,
        pack: Pack | None = None,
        max_queued: int | None = None,
    ) -> None:
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"max_queued {max_queued} must be at least 1")
        self._link = link
        self._topic = topic
        self._what = what
        self._gate = gate
        self._pack = pack
        self._max = max_queued
        self._queue: collections.deque[BaseModel] = collections.deque()
        self._ready = asyncio.Event()
        self._sending = asyncio.Lock()
        self._in_flight = 0  # queued messages at the head being sent now
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, message: BaseModel) -> None:
        if self._max is not None and len(self._queue) >= self._max:
            if self._in_flight < len(self._queue):
                del self._queue[self._in_flight]  # the oldest not on its way
            else:  # the whole (tiny) bound is in flight: this one does not fit
                self._count_drop()
                return
            self._count_drop()
        self._queue.append(message)
        self._ready.set()

    def _count_drop(self) -> None:
        self.dropped += 1
        if self.dropped % 1000 == 1:
            log.warning(
                "%s queue on %s is full (%d): dropped the oldest, %d so far",
                self._what,
                self._topic,
                self._max,
                self.dropped,
            )

    async def _send_first(self, timeout: float, connection: int | None = None) -> int:
        """Send the head of the queue (what ``pack`` makes of it: one message, or several
        in one); return how many queued messages went."""
        message, count = self._pack(self._queue) if self._pack else (self._queue[0], 1)
        self._in_flight = count
        try:
            await self._link.publish(
                self._topic, _encode(message), timeout=timeout, connection=connection
            )
        finally:
            self._in_flight = 0
        for _ in range(count):
            self._queue.popleft()
        if not self._queue:
            self._ready.clear()
        return count

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            connection = None
            if self._gate is not None:
                await self._link.until_connected()
                if not self._gate.is_set():
                    await self._gate.wait()
                    continue  # look again: the link may have gone and come back meanwhile
                connection = self._link.connects
            async with self._sending:
                if not self._queue:
                    continue  # a flush sent it meanwhile
                try:
                    await self._send_first(timeout=30.0, connection=connection)
                except LinkDown as exc:
                    log.warning("%s not yet sent on %s: %s", self._what, self._topic, exc)
                else:
                    continue
            # A publish refused at once (paho's socket closed before the link saw the
            # connection end) is tried again after a pause: a loop that never waits
            # would starve the event loop, and the link would never see the end (an
            # agent wedged after a broker restart, bench/fleet_scale.py: issue 22).
            await asyncio.sleep(RETRY_AFTER_S)

    async def flush(self, timeout: float) -> None:
        """On shutdown: send what is queued, in order, as far as ``timeout`` allows (a send
        in flight is waited for within it). What is left is logged, and stays queued."""
        deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout), self._sending:
                while self._queue:
                    await self._send_first(timeout=max(0.1, deadline - time.monotonic()))
        except (TimeoutError, LinkDown) as exc:
            log.error(
                "%d %s(s) not sent on %s at shutdown (limit %.1f s): %s",
                len(self._queue),
                self._what,
                self._topic,
                timeout,
                exc or "the limit passed",
            )


def _encode(message: BaseModel) -> bytes:
    return message.model_dump_json().encode()
