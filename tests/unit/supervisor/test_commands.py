"""A command's wait for its ack (``supervisor.fleet.commands``): it ends with the ack, or
at its timeout; a supervisor behind on its messages waits that much longer (the ack may
be among them), at most ``LATE_ACK_MAX_S`` (issue 22: at 2,048 nodes and 256 small jobs
the supervisor ran 20-30 s behind, and jobs failed their launch on acks that had come).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from phalanx import wire
from supervisor.errors import CommandTimeout
from supervisor.fleet import commands as commands_module
from supervisor.fleet.commands import Commands
from supervisor.fleet.registry import Registry
from supervisor.store import Store
from tests.unit.supervisor.fake_fleet import birth


class Node:
    """One node's side: the commands published to it, and the ack it sends for each after
    ``ack_after`` s (None: never)."""

    def __init__(self, tmp_path: Path, behind: list[float]) -> None:
        self.store = Store(tmp_path / "state.db")
        registry = Registry(self.store, offline_after_s=10.0)
        registry.on_birth(birth("n1"))
        self.ack_after: float | None = None
        self.commands = Commands(self.publish, registry, timeout_s=0.2, behind=lambda: behind[0])
        self.sent: list[wire.Command] = []

    async def publish(self, topic: str, payload: bytes, **kw: Any) -> None:
        cmd = wire.parse(topic, payload).message
        assert isinstance(cmd, wire.Command)
        self.sent.append(cmd)
        if self.ack_after is not None:
            ack = wire.CommandAck(
                id=cmd.id, node="n1", status=wire.AckStatus.DONE, result={}, acked_at=0
            )
            asyncio.get_running_loop().call_later(self.ack_after, self.commands.on_ack, ack)


async def test_an_ack_in_time_ends_the_wait(tmp_path: Path) -> None:
    node = Node(tmp_path, behind=[0.0])
    node.ack_after = 0.05
    ack = await node.commands.send("n1", wire.PingArgs())
    assert ack.status is wire.AckStatus.DONE and ack.id == node.sent[0].id
    node.store.close()


async def test_no_ack_by_the_timeout_is_a_command_timeout_when_nothing_waits_unread(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, behind=[0.0])
    node.ack_after = 30.0  # late: it counts for nothing
    with pytest.raises(CommandTimeout, match="no ack from node 'n1' for ping"):
        await node.commands.send("n1", wire.PingArgs())
    node.store.close()


async def test_a_supervisor_behind_its_messages_waits_for_an_ack_that_may_be_among_them(
    tmp_path: Path,
) -> None:
    behind = [1.0]  # it has had messages unread for a second
    node = Node(tmp_path, behind=behind)
    node.ack_after = 0.5  # handled after the timeout (0.2 s), while it was behind
    ack = await node.commands.send("n1", wire.PingArgs())
    assert ack.id == node.sent[0].id
    node.store.close()


async def test_a_supervisor_behind_for_ever_gives_up_at_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands_module, "LATE_ACK_MAX_S", 0.3)
    node = Node(tmp_path, behind=[5.0])
    began = time.monotonic()
    with pytest.raises(CommandTimeout):
        await node.commands.send("n1", wire.PingArgs())
    assert time.monotonic() - began >= 0.5  # the timeout (0.2 s), then the bound (0.3 s)
    node.store.close()
