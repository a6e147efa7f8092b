"""A preempted job's save before its stop (``GangOrders.save_first``): the commit it waits
for is the save it asked for, not a checkpoint that was already in flight.

The controller, its store and catalog are real; the ``save_now`` acks are the fake
fleet's, scripted as agents answer (the ranks asked and the step each reported last).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from phalanx import wire
from supervisor.control.orders import reported_steps
from tests.unit.supervisor.conftest import MakeFleet
from tests.unit.supervisor.fake_fleet import FakeFleet

OBJECT = {"tiers": ["ram", "object"], "interval": {"steps": 10}}


def commit(fleet: FakeFleet, step: int) -> None:
    """``step`` committed at the object store by every rank of the job."""
    job = fleet.job
    with fleet.store.batch():
        for place in job.ranks:
            fleet.publisher.catalog.on_landing(
                wire.CkptLanding(
                    node=place.node,
                    job=job.id,
                    step=step,
                    rank=place.rank,
                    tier="object",
                    event="landed",
                    nbytes=100,
                    checksum=f"xxh3_128:{place.rank:032x}",
                    at=time.time(),
                    generation=job.generation,
                ),
                len(job.ranks),
            )


def saved(fleet: FakeFleet) -> list[dict[str, Any]]:
    return [e.detail for e in fleet.events("job_preempt_checkpoint")]


def preemptible(make_fleet: MakeFleet) -> FakeFleet:
    """A preemptible job on n0 and n1 that committed step 20 at the object store."""
    fleet = make_fleet(["n0", "n1"])
    fleet.running(["n0", "n1"], preemptible=True, checkpoint=OBJECT, grace_period=30)
    commit(fleet, 20)
    return fleet


async def save_first(fleet: FakeFleet) -> asyncio.Future[None]:
    """The job's save before its stop, running, once both nodes were asked."""
    saving = asyncio.ensure_future(fleet.ctl.orders.save_first(fleet.job))
    await fleet.until(lambda: len(fleet.ops("save_now")) == 2)
    return saving


async def test_a_checkpoint_in_flight_when_the_save_is_asked_is_not_taken_for_it(
    make_fleet: MakeFleet,
) -> None:
    # Seen in the suite: the ranks had reported step 29 when the request reached them;
    # step 30's periodic save (ckpt.save(step + 1)) committed a moment later and the stop
    # went ahead on it, while the save asked for, step 31, was still landing.
    fleet = preemptible(make_fleet)
    fleet.answer("save_now", result={"ranks": [0, 1], "steps": {"0": 29, "1": 29}}, node="n0")
    fleet.answer("save_now", result={"ranks": [2, 3], "steps": {"2": 29, "3": 30}}, node="n1")
    saving = await save_first(fleet)

    commit(fleet, 30)  # in flight when asked
    await asyncio.sleep(0.5)  # save_first looks every 0.2 s
    assert not saving.done()

    commit(fleet, 31)  # the save asked for
    await asyncio.wait_for(saving, 5)
    assert saved(fleet) == [{"job": "j-1", "step": 31, "tier": "object", "committed": True}]


async def test_without_the_steps_an_older_agent_acks_any_newer_commit_is_the_save(
    make_fleet: MakeFleet,
) -> None:
    fleet = preemptible(make_fleet)
    fleet.answer("save_now", result={"ranks": [0, 1]})
    saving = await save_first(fleet)
    commit(fleet, 24)
    await asyncio.wait_for(saving, 5)
    assert saved(fleet) == [{"job": "j-1", "step": 24, "tier": "object", "committed": True}]


def test_the_reported_steps_are_read_from_each_ack_and_garbage_is_left_out() -> None:
    def ack(result: dict[str, Any]) -> wire.CommandAck:
        return wire.CommandAck(
            id="c", node="n0", status=wire.AckStatus.DONE, result=result, acked_at=time.time()
        )

    acks = [
        ack({"ranks": [0, 1], "steps": {"0": 29, "1": 30}}),
        ack({"ranks": [2], "steps": {"2": "29", "3": True, "4": None}}),
        ack({"ranks": [5], "steps": [7]}),
        ack({"ranks": [6]}),
    ]
    assert reported_steps(acks) == [29, 30]
