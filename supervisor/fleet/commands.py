"""Commands out, acks in: one command to one agent, and the wait for its ack.

Every command carries an id and a deadline (its timeout, also the agent's: it never
runs one past it); the ack naming the id ends the wait (:meth:`Commands.on_ack`).
A command to a node the registry does not know is refused before it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from phalanx import wire
from phalanx.link import LinkDown, Publish
from supervisor.errors import CommandTimeout
from supervisor.fleet.registry import Registry

log = logging.getLogger(__name__)

REBIRTH_EVERY_S = 5.0  # the most often one node is asked to announce itself again


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
        self, publish: Publish, registry: Registry, *, timeout_s: float, term: int = 0
    ) -> None:
        self._publish = publish
        self._registry = registry
        self.timeout_s = timeout_s
        self.term = term
        self._acks: dict[str, asyncio.Future[wire.CommandAck]] = {}
        self._rebirth_asked: dict[str, float] = {}

    async def send(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        """Send one command and wait for its ack (the deadline is the timeout)."""
        self._registry.get(node)
        timeout = timeout or self.timeout_s
        cmd = wire.Command.new(node, args, ttl=timeout, term=self.term)
        future: asyncio.Future[wire.CommandAck] = asyncio.get_running_loop().create_future()
        self._acks[cmd.id] = future
        try:
            await self._publish(wire.command_topic(node), wire.encode(cmd), timeout=timeout)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise CommandTimeout(node, args.op, cmd.id, timeout) from None
        finally:
            self._acks.pop(cmd.id, None)

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
