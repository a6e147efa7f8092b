"""The controller's grow check (planner rule 7, issue 24): a shrunk elastic job grows back
once it ran ``grow_after`` at its size, nodes are free for a larger allowed size, and it
committed a step since they were; never while it recovers, and never onto a busy node.

The controller, its store, registry, catalog and planner are real (the fake fleet of
``fake_fleet``); it must send nothing, and the recovery it starts is recorded, not run.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from phalanx import wire
from supervisor.records import Recovery
from supervisor.recovery.planner import Failure, FailureKind
from tests.unit.supervisor.fake_fleet import FakeFleet

NODES = ["n0", "n1", "n2", "n3"]


class Grown(FakeFleet):
    """The controller with a shrunk elastic job on n0 and n1, and the failures it was told."""

    def __init__(self, tmp_path: Path, grow_after: float = 60.0) -> None:
        super().__init__(tmp_path, NODES)
        self.running(
            ["n0", "n1"],
            generation=2,
            name="grows",
            nodes=4,
            elastic={
                "min_nodes": 1,
                "global_batch": 32,
                "micro_batch": 1,
                "grow_after": grow_after,
            },
        )
        self.job.started_at = time.time() - 2 * grow_after
        self.told: list[Failure] = []
        self.ctl.route = lambda job, report: self.told.append(report.failure)  # type: ignore[method-assign]

    def commit(self, step: int) -> None:
        """Step ``step`` committed at the object store by the shrunk gang (4 ranks)."""
        world = len(self.job.ranks)
        with self.store.batch():
            for rank in range(world):
                self.publisher.catalog.on_landing(
                    wire.CkptLanding(
                        node=self.job.ranks[rank].node,
                        job="j-1",
                        step=step,
                        rank=rank,
                        tier="object",
                        event="landed",
                        nbytes=100,
                        checksum=f"xxh3_128:{rank:032x}",
                        at=time.time(),
                        generation=2,
                    ),
                    world,
                )

    async def close(self) -> None:
        assert self.sent == [], f"the grow check sent {self.ops_sent}: it only plans"
        await super().close()


@pytest.fixture
async def grown(tmp_path: Path) -> AsyncIterator[Grown]:
    g = Grown(tmp_path)
    yield g
    await g.close()


async def test_a_shrunk_job_grows_at_the_first_commit_after_nodes_were_free(grown: Grown) -> None:
    grown.commit(10)
    grown.ctl.check_growth()
    assert grown.told == []  # free now: it waits for a step the larger gang can restore

    grown.ctl.check_growth()
    assert grown.told == []  # no new commit yet
    grown.commit(20)
    grown.ctl.check_growth()

    assert len(grown.told) == 1
    failure = grown.told[0]
    assert failure.kind is FailureKind.GROW and failure.step == 20
    assert failure.node in ("n2", "n3") and not failure.quarantine
    assert "n2, n3 free since step 10" in failure.detail


async def test_no_growth_before_grow_after_has_passed_at_its_size(tmp_path: Path) -> None:
    g = Grown(tmp_path, grow_after=3600.0)
    try:
        g.job.started_at = time.time() - 60  # an hour to run at this size; a minute ran
        g.commit(10)
        g.ctl.check_growth()
        g.commit(20)
        g.ctl.check_growth()
        assert g.told == []
    finally:
        await g.close()


async def test_no_growth_onto_drained_nodes(grown: Grown) -> None:
    grown.registry.drain("n2", "cable swap", by="operator")
    grown.registry.drain("n3", "cable swap", by="operator")
    grown.commit(10)
    grown.ctl.check_growth()
    grown.commit(20)
    grown.ctl.check_growth()

    assert grown.told == []  # nothing free


async def test_no_growth_while_the_job_recovers_and_the_count_starts_again_after(
    grown: Grown,
) -> None:
    grown.job.recovery = Recovery(2, [], 0.0, 0.0)  # recovering: it plans itself
    grown.commit(10)
    grown.ctl.check_growth()
    grown.commit(20)
    grown.ctl.check_growth()
    assert grown.told == []

    grown.job.recovery = None  # free since step 20: it grows at the next commit, not now
    grown.ctl.check_growth()
    assert grown.told == []
    grown.commit(30)
    grown.ctl.check_growth()
    assert [f.step for f in grown.told] == [30]
