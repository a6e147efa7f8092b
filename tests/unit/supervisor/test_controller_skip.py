"""The controller's loop skips a scheduling pass that could decide nothing new (issue 22):
no job pending and no node, job or burn-in changed since the last pass. A change of any
of them, a pending job, or ``FULL_PASS_S`` since the last pass runs one again.

The controller, its store, registry, burn-ins and the pure scheduler are real; the
commands it sends are answered by a fake node that passes every burn-in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from phalanx import wire
from phalanx.jobspec import validate_spec
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.publisher import CatalogPublisher
from supervisor.config import SupervisorSettings
from supervisor.control import controller as controller_mod
from supervisor.control.controller import JobController
from supervisor.fleet.registry import Registry
from supervisor.store import Store
from tests.unit.supervisor.test_dashboard_auth import birth

NODES = ["n0", "n1", "n2", "n3"]


async def nowhere(topic: str, payload: bytes, **kw: Any) -> None:
    """The link's publish: nothing listens in this test."""


class Fleet:
    def __init__(self, tmp_path: Path) -> None:
        self.store = Store(tmp_path / "state.db")
        self.registry = Registry(self.store, offline_after_s=15.0)
        for node in NODES:
            self.registry.on_birth(birth(node, gpus=2))
        self.sent: list[tuple[str, str]] = []
        publisher = CatalogPublisher(
            CheckpointCatalog(self.store),
            nowhere,
            job=lambda job_id: self.ctl.jobs.get(job_id),
            registry=self.registry,
            ram_linger_s=900.0,
        )
        self.ctl = JobController(
            self.store,
            self.registry,
            SupervisorSettings(state_dir=tmp_path, spares=1),
            send=self.send,
            publisher=publisher,
            offline_confirmed=lambda since: True,
        )
        self.passes = 0
        full = self.ctl.schedule_pass

        def counted() -> Any:
            self.passes += 1
            return full()

        self.ctl.schedule_pass = counted  # type: ignore[method-assign]

    async def send(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        self.sent.append((node, args.op))
        result = {"passed": True} if args.op == "burn_in" else {}
        return wire.CommandAck(
            id="c", node=node, status=wire.AckStatus.DONE, result=result, acked_at=time.time()
        )

    async def tick(self) -> None:
        self.ctl.tick()
        await asyncio.sleep(0)  # the burn-ins it started answer
        await asyncio.sleep(0)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.ctl.close()
    await f.ctl.shutdown(1.0)
    f.store.close()


async def test_a_pass_with_nothing_changed_is_skipped(fleet: Fleet) -> None:
    await fleet.tick()
    assert fleet.passes == 1
    assert len(fleet.ctl.spares) == 1
    await fleet.tick()  # the spare's burn-in passed: a change the next pass sees
    passes = fleet.passes
    for _ in range(5):
        await fleet.tick()
    assert fleet.passes == passes  # nothing changed: no pass
    fleet.registry.on_heartbeat(
        wire.Heartbeat(node="n1", seq=1, n=1, sent_at=time.time(), health=birth("n1").health)
    )
    await fleet.tick()
    assert fleet.passes == passes  # a heartbeat that changes nothing changes nothing


async def test_a_node_change_a_job_or_the_full_pass_interval_runs_a_pass(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(3):
        await fleet.tick()
    passes = fleet.passes
    spare = fleet.ctl.spares[0]
    fleet.registry.drain(spare, "bad fan")
    await fleet.tick()
    assert fleet.passes == passes + 1
    assert spare not in fleet.ctl.spares  # the pass replaced the drained spare
    for _ in range(3):
        await fleet.tick()
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
        await fleet.tick()
    assert fleet.passes == passes + 3
    assert job.waiting is not None  # it can never start on four nodes: said so
    fleet.ctl.jobs.pop(job.id)
    await fleet.tick()
    passes = fleet.passes
    await fleet.tick()
    assert fleet.passes == passes

    monkeypatch.setattr(controller_mod, "FULL_PASS_S", 0.0)
    await fleet.tick()
    assert fleet.passes == passes + 1
