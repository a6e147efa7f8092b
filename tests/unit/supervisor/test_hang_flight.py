"""A hang's culprit (supervisor.recovery.executor): the ranks' flight recorders, where
they name one, over the agents' progress-based pick; a stopped process over both.

The controller, store, registry and planner are real (the fake fleet of ``fake_fleet``);
the hung events come as the agents send them."""

from __future__ import annotations

import time

from phalanx import wire
from supervisor.jobs import JobState
from tests.unit.supervisor.conftest import MakeFleet
from tests.unit.supervisor.fake_fleet import FakeFleet

# Ranks 0-1 on n0, 2-3 on n1. Every rank waits in all-reduce #12 but rank 3 (newest #11).
FLIGHT = [
    wire.FlightPoint(
        rank=r,
        pg="0:default_pg",
        seq=11 if r == 3 else 12,
        completed=11,
        op="nccl:all_reduce",
        state="completed" if r == 3 else "started",
    )
    for r in range(4)
]


def hung(node: str, rank: int, *, stopped: bool = False, flight: bool = True) -> wire.RankEvent:
    return wire.RankEvent(
        node=node,
        job="j-1",
        generation=1,
        rank=rank,
        event="hung",
        step=40,
        stopped=stopped,
        idle_s=30.0,
        detail="no step for 30.0s; all at step 40, this rank silent longest (30.0s)",
        flight=[p for p in FLIGHT if (p.rank // 2 == int(node[1]))] if flight else [],
        at=time.time(),
    )


async def failure_of(fleet: FakeFleet, *events: wire.RankEvent) -> dict[str, object]:
    for ev in events:
        fleet.ctl.on_rank_event(ev)
    await fleet.until(lambda: fleet.job.generation == 2 and fleet.job.state is JobState.RUNNING)
    (incident,) = fleet.job.incidents
    (failure,) = incident.failures
    return failure.to_record()


async def test_the_flight_recorders_culprit_is_the_hangs(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    failure = await failure_of(fleet, hung("n0", 0), hung("n1", 2))

    assert (failure["kind"], failure["node"], failure["rank"]) == ("hang", "n1", 3)
    assert "flight recorder: rank 3 never entered collective #12" in str(failure["detail"])
    kinds = [e.kind for e in fleet.store.events(job="j-1")]
    assert "hang_flight_recorder" in kinds


async def test_a_stopped_process_is_the_culprit_whatever_the_dumps_say(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    failure = await failure_of(fleet, hung("n0", 1, stopped=True), hung("n1", 2))

    assert (failure["node"], failure["rank"]) == ("n0", 1)


async def test_without_dumps_the_agents_pick_stands(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    failure = await failure_of(fleet, hung("n0", 0, flight=False), hung("n1", 2, flight=False))

    assert failure["rank"] in (0, 2) and "flight recorder" not in str(failure["detail"])
