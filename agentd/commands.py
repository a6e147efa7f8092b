"""At-most-once, never-late execution of the supervisor's commands.

MQTT QoS 1 delivers at least once, so a command can arrive twice; a command
can also sit in a broker queue past its usefulness. The ledger remembers the
ack of every command it has run (bounded, oldest forgotten first, and far
longer than any deadline), so a redelivery gets the first result again,
marked ``duplicate``, and the command is not run a second time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from phalanx.wire import AckStatus, Command, CommandAck

log = logging.getLogger(__name__)

Executor = Callable[[Command], Awaitable[dict[str, Any]]]


class CommandError(RuntimeError):
    """An executor's way to fail a command with a message for the ack."""


class CommandLedger:
    def __init__(
        self,
        node: str,
        executor: Executor,
        *,
        remember: int = 4096,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self._executor = executor
        self._remember = remember
        self._clock = clock
        self._acks: OrderedDict[str, CommandAck] = OrderedDict()
        self._running: dict[str, asyncio.Future[CommandAck]] = {}
        self.executed = 0

    async def handle(self, cmd: Command) -> CommandAck:
        known = self._acks.get(cmd.id)
        if known is not None:
            log.info("command %s redelivered; repeating its ack (%s)", cmd.id, known.status)
            return known.model_copy(update={"duplicate": True, "acked_at": self._clock()})
        running = self._running.get(cmd.id)
        if running is not None:  # redelivered while the first copy still runs
            first = await asyncio.shield(running)
            return first.model_copy(update={"duplicate": True, "acked_at": self._clock()})
        now = self._clock()
        if now > cmd.deadline:
            ack = self._ack(
                cmd,
                AckStatus.EXPIRED,
                f"arrived {now - cmd.deadline:.1f}s after its deadline; not executed",
            )
            self._record(ack)
            return ack
        future: asyncio.Future[CommandAck] = asyncio.get_running_loop().create_future()
        self._running[cmd.id] = future
        try:
            try:
                result = await self._executor(cmd)
                ack = self._ack(cmd, AckStatus.DONE, result=result)
            except CommandError as exc:
                ack = self._ack(cmd, AckStatus.FAILED, str(exc))
            except Exception as exc:
                log.exception("command %s (%s) failed", cmd.id, cmd.args.op)
                ack = self._ack(cmd, AckStatus.FAILED, f"{type(exc).__name__}: {exc}")
            self.executed += 1
            self._record(ack)
            future.set_result(ack)
            return ack
        finally:
            if not future.done():
                future.cancel()
            self._running.pop(cmd.id, None)

    def _ack(
        self,
        cmd: Command,
        status: AckStatus,
        detail: str = "",
        result: dict[str, Any] | None = None,
    ) -> CommandAck:
        return CommandAck(
            id=cmd.id,
            node=self.node,
            status=status,
            detail=detail,
            result=result or {},
            acked_at=self._clock(),
        )

    def _record(self, ack: CommandAck) -> None:
        self._acks[ack.id] = ack
        while len(self._acks) > self._remember:
            self._acks.popitem(last=False)
