"""Commands out, acks in: one command to one agent, and the wait for its ack.

Every command carries an id and a deadline (its timeout, also the agent's: it never
runs one past it); the ack naming the id ends the wait (:meth:`Commands.on_ack`).
A command to a node the registry does not know is refused before it is sent.

A supervisor behind on its messages (``behind``: how long it has had messages received
and not yet handled) waits that much longer for an ack, at most ``LATE_ACK_MAX_S``: the
ack may be among them. At 2,048 nodes and 256 small jobs (issue 22) the supervisor ran
20-30 s behind, and 102 of the jobs failed their launch on "no ack" that had come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from phalanx import wire
from phalanx.link import LinkDown, Publish
from supervisor.errors import CommandTimeout
from supervisor.fleet.registry import Registry

log = logging.getLogger(__name__)

REBIRTH_EVERY_S = 5.0  # the most often one node is asked to announce itself again
LATE_ACK_MAX_S = 60.0  # the most a command's wait is extended for a supervisor behind


class CommandSender(Protocol):
    """What sends one command and waits for its ack (:meth:`Commands.send`): raises
    :class:`~supervisor.errors.CommandTimeout` without an ack in time, ``LinkDown``
    when the broker is unreachable, ``UnknownNode`` for a node never seen."""

    async def __call__(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck: ...


class Commands:
    """``timeout_s``: a command's timeout when its sender names none; ``term``: the
    supervisor's leadership term, carried by every command (``wire.Command.term``)."""

    def __init__(
        self,
        publish: Publish,
        registry: Registry,
        *,
        timeout_s: float,
        term: int = 0,
        behind: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._publish = publish
        self._registry = registry
        self._behind = behind
        self.timeout_s = timeout_s
        self.term = term
        self._acks: dict[str, asyncio.Future[wire.CommandAck]] = {}
        self._waiting: dict[str, tuple[str, bytes]] = {}  # id -> (node, the command sent)
        self._rebirth_asked: dict[str, float] = {}
        self._resends: set[asyncio.Task[None]] = set()

    async def send(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        """Send one command and wait for its ack (the deadline is the timeout)."""
        self._registry.get(node)
        timeout = timeout or self.timeout_s
        cmd = wire.Command.new(node, args, ttl=timeout, term=self.term)
        future: asyncio.Future[wire.CommandAck] = asyncio.get_running_loop().create_future()
        self._acks[cmd.id] = future
        payload = wire.encode(cmd)
        self._waiting[cmd.id] = (node, payload)
        try:
            await self._publish(wire.command_topic(node), payload, timeout=timeout)
            loop = asyncio.get_running_loop()
            wait, latest = timeout, loop.time() + timeout + LATE_ACK_MAX_S
            while True:
                await asyncio.wait([future], timeout=wait)
                if future.done():
                    return future.result()
                # Not in time, unless it came and waits among the messages not handled yet.
                wait = min(self._behind(), latest - loop.time())
                if wait <= 0:
                    raise CommandTimeout(node, args.op, cmd.id, timeout)
        except TimeoutError:  # the publish's
            raise CommandTimeout(node, args.op, cmd.id, timeout) from None
        finally:
            self._acks.pop(cmd.id, None)
            self._waiting.pop(cmd.id, None)

    def resend(self, node: str) -> int:
        """Publish again every command to ``node`` still waiting for its ack (same id and
        deadline: the agent runs an id once, and never past its deadline), in the
        background; how many."""
        again = [payload for n, payload in self._waiting.values() if n == node]
        for payload in again:
            task = asyncio.get_running_loop().create_task(self._resend(node, payload))
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)
        return len(again)

    async def _resend(self, node: str, payload: bytes) -> None:
        try:
            await self._publish(wire.command_topic(node), payload, timeout=5.0)
        except LinkDown as exc:
            log.warning("a command to %s was not sent again: %s", node, exc)

    def on_ack(self, ack: wire.CommandAck) -> None:
        future = self._acks.pop(ack.id, None)
        if future is not None and not future.done():
            future.set_result(ack)

    def cancel_waits(self) -> None:
        """At shutdown: end every wait for an ack. Only once the tasks that wait are done
        or cancelled, or a launch would read its cancelled acks as node failures."""
        for future in self._acks.values():
            future.cancel()

    async def ask_rebirth(self, node: str) -> None:
        """A heartbeat from a node whose birth we lack: ask it to announce itself again
        (no ack awaited; at most every ``REBIRTH_EVERY_S``)."""
        now = time.monotonic()
        if now - self._rebirth_asked.get(node, -1e9) < REBIRTH_EVERY_S:
            return
        self._rebirth_asked[node] = now
        log.info("heartbeat from %s without a known birth; asking for a rebirth", node)
        cmd = wire.Command.new(node, wire.RebirthArgs(), ttl=self.timeout_s, term=self.term)
        with contextlib.suppress(LinkDown):
            await self._publish(wire.command_topic(node), wire.encode(cmd), timeout=2.0)
