"""CommandLedger: a command runs at most once, never after its deadline, and always gets an ack."""

from __future__ import annotations

import asyncio
from typing import Any

from agentd.commands import CommandError, CommandLedger
from phalanx.wire import AckStatus, Command, PingArgs

NODE = "n1"
T0 = 1_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Executor:
    """Counts the commands it runs; optionally fails or waits for a release."""

    def __init__(self, *, raises: Exception | None = None, gated: bool = False) -> None:
        self.ran: list[str] = []
        self.raises = raises
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        if not gated:
            self.release.set()

    async def __call__(self, cmd: Command) -> dict[str, Any]:
        self.ran.append(cmd.id)
        self.started.set()
        await self.release.wait()
        if self.raises is not None:
            raise self.raises
        return {"pong": cmd.id}


def _cmd(cmd_id: str = "c1", *, deadline: float = T0 + 30) -> Command:
    return Command(id=cmd_id, node=NODE, issued_at=T0, deadline=deadline, args=PingArgs())


async def test_a_command_is_executed_once_and_acked_done_with_its_result() -> None:
    executor = Executor()
    ledger = CommandLedger(NODE, executor, clock=Clock())

    ack = await ledger.handle(_cmd())

    assert (ack.id, ack.node, ack.status, ack.duplicate) == ("c1", NODE, AckStatus.DONE, False)
    assert ack.result == {"pong": "c1"}
    assert ack.acked_at == T0
    assert executor.ran == ["c1"]
    assert ledger.executed == 1


async def test_a_redelivered_command_returns_the_first_ack_marked_duplicate() -> None:
    clock = Clock()
    ledger = CommandLedger(NODE, Executor(), clock=clock)
    first = await ledger.handle(_cmd())
    clock.now += 5

    again = await ledger.handle(_cmd())

    assert again.duplicate is True
    assert (again.status, again.result) == (first.status, first.result)
    assert again.acked_at == T0 + 5


async def test_a_redelivered_command_is_not_executed_again() -> None:
    executor = Executor()
    ledger = CommandLedger(NODE, executor, clock=Clock())
    await ledger.handle(_cmd())

    await ledger.handle(_cmd())

    assert executor.ran == ["c1"]
    assert ledger.executed == 1


async def test_a_redelivery_while_the_first_still_runs_waits_for_it_and_is_not_executed_twice() -> (
    None
):
    executor = Executor(gated=True)
    ledger = CommandLedger(NODE, executor, clock=Clock())
    first = asyncio.create_task(ledger.handle(_cmd()))
    await asyncio.wait_for(executor.started.wait(), timeout=5)
    second = asyncio.create_task(ledger.handle(_cmd()))
    await asyncio.sleep(0)
    assert not second.done()

    executor.release.set()
    first_ack, second_ack = await asyncio.wait_for(asyncio.gather(first, second), timeout=5)

    assert executor.ran == ["c1"]
    assert first_ack.duplicate is False
    assert second_ack.duplicate is True
    assert second_ack.status is AckStatus.DONE
    assert second_ack.result == first_ack.result


async def test_a_command_past_its_deadline_is_acked_expired_and_not_executed() -> None:
    executor = Executor()
    ledger = CommandLedger(NODE, executor, clock=Clock(T0 + 31))

    ack = await ledger.handle(_cmd(deadline=T0 + 30))

    assert ack.status is AckStatus.EXPIRED
    assert "deadline" in ack.detail
    assert executor.ran == []
    assert ledger.executed == 0


async def test_a_command_at_exactly_its_deadline_is_still_executed() -> None:
    executor = Executor()
    ledger = CommandLedger(NODE, executor, clock=Clock(T0 + 30))

    ack = await ledger.handle(_cmd(deadline=T0 + 30))

    assert ack.status is AckStatus.DONE
    assert executor.ran == ["c1"]


async def test_an_expired_command_redelivered_in_time_is_still_not_executed() -> None:
    clock = Clock(T0 + 31)
    executor = Executor()
    ledger = CommandLedger(NODE, executor, clock=clock)
    await ledger.handle(_cmd(deadline=T0 + 30))
    clock.now = T0

    again = await ledger.handle(_cmd(deadline=T0 + 30))

    assert (again.status, again.duplicate) == (AckStatus.EXPIRED, True)
    assert executor.ran == []


async def test_a_command_error_gives_failed_with_its_message() -> None:
    ledger = CommandLedger(
        NODE, Executor(raises=CommandError("no GPUs to resample")), clock=Clock()
    )

    ack = await ledger.handle(_cmd())

    assert ack.status is AckStatus.FAILED
    assert ack.detail == "no GPUs to resample"


async def test_an_unexpected_exception_gives_failed_and_does_not_propagate() -> None:
    ledger = CommandLedger(NODE, Executor(raises=ValueError("boom")), clock=Clock())

    ack = await ledger.handle(_cmd())

    assert ack.status is AckStatus.FAILED
    assert ack.detail == "ValueError: boom"


async def test_a_failed_command_is_not_retried_on_redelivery() -> None:
    executor = Executor(raises=ValueError("boom"))
    ledger = CommandLedger(NODE, executor, clock=Clock())
    await ledger.handle(_cmd())

    again = await ledger.handle(_cmd())

    assert (again.status, again.duplicate) == (AckStatus.FAILED, True)
    assert executor.ran == ["c1"]


async def test_distinct_commands_are_each_executed() -> None:
    executor = Executor()
    ledger = CommandLedger(NODE, executor, clock=Clock())

    for cmd_id in ("a", "b", "c"):
        await ledger.handle(_cmd(cmd_id))

    assert executor.ran == ["a", "b", "c"]


async def test_the_ledger_remembers_only_the_last_remember_acks() -> None:
    executor = Executor()
    ledger = CommandLedger(NODE, executor, remember=2, clock=Clock())
    for cmd_id in ("a", "b", "c"):
        await ledger.handle(_cmd(cmd_id))

    forgotten = await ledger.handle(_cmd("a"))
    remembered = await ledger.handle(_cmd("c"))

    assert forgotten.duplicate is False
    assert remembered.duplicate is True
    assert executor.ran == ["a", "b", "c", "a"]
