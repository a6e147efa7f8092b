"""The controller's loop skips a scheduling pass that could decide nothing new (issue 22):
no job pending and no node, job or burn-in changed since the last pass. A change of any
of them, a pending job, or ``FULL_PASS_S`` since the last pass runs one again.

The controller, its store, registry, burn-ins and the pure scheduler are real; the
commands it sends are answered by the fake fleet (``fake_fleet``), whose nodes pass
every burn-in.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from phalanx import wire
from phalanx.jobspec import validate_spec
from supervisor.control import controller as controller_mod
from tests.unit.supervisor.fake_fleet import FakeFleet, birth

NODES = ["n0", "n1", "n2", "n3"]


class Fleet(FakeFleet):
    """Four nodes, one spare; the scheduling passes the controller ran are counted."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, NODES, spares=1)
        self.passes = 0
        full = self.ctl.schedule_pass

        def counted() -> Any:
            self.passes += 1
            return full()

        self.ctl.schedule_pass = counted  # type: ignore[method-assign]

    async def turn(self) -> None:
        """A turn of the loop, and the spares' burn-ins it started answered."""
        self.tick()
        burnins = self.ctl.burnins
        await self.until(lambda: all(burnins.passed(spare) for spare in self.ctl.spares))


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    await f.close()


async def test_a_pass_with_nothing_changed_is_skipped(fleet: Fleet) -> None:
    await fleet.turn()
    assert fleet.passes == 1
    assert len(fleet.ctl.spares) == 1
    await fleet.turn()  # the spare's burn-in passed: a change the next pass sees
    passes = fleet.passes
    for _ in range(5):
        await fleet.turn()
    assert fleet.passes == passes  # nothing changed: no pass
    fleet.registry.on_heartbeat(
        wire.Heartbeat(node="n1", seq=1, n=1, sent_at=time.time(), health=birth("n1").health)
    )
    await fleet.turn()
    assert fleet.passes == passes  # a heartbeat that changes nothing changes nothing


async def test_a_node_change_a_job_or_the_full_pass_interval_runs_a_pass(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(3):
        await fleet.turn()
    passes = fleet.passes
    spare = fleet.ctl.spares[0]
    fleet.registry.drain(spare, "bad fan")
    await fleet.turn()
    assert fleet.passes == passes + 1
    assert spare not in fleet.ctl.spares  # the pass replaced the drained spare
    for _ in range(3):
        await fleet.turn()
    passes = fleet.passes

    # A pending job: a pass every turn while it waits (its reservations move with time).
    spec = validate_spec(
        {
            "name": "big",
            "team": "t",
            "command": ["true"],
            "workdir": "/tmp",
            "nodes": 8,
            "ranks_per_node": 2,
        }
    )
    job = fleet.ctl.submit(spec)
    for _ in range(3):
        await fleet.turn()
    assert fleet.passes == passes + 3
    assert job.waiting is not None  # it can never start on four nodes: said so
    fleet.ctl.jobs.pop(job.id)
    await fleet.turn()
    passes = fleet.passes
    await fleet.turn()
    assert fleet.passes == passes

    monkeypatch.setattr(controller_mod, "FULL_PASS_S", 0.0)
    await fleet.turn()
    assert fleet.passes == passes + 1
