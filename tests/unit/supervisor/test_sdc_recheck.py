"""Silent data corruption with no majority (issue 23): two replicas whose parameter
digests differ name no one, so the supervisor rechecks both nodes with their burn-in's
deterministic recompute check and quarantines the one that fails it; none failing, the
gang restarts in place from the newest clean step, nothing quarantined.

The controller, store, registry, catalog, planner and burn-ins are real; the commands go
to the fake fleet's recording ``send`` (``fake_fleet``), whose burn-in results the tests
set per node.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from phalanx import wire
from phalanx.jobspec import JobSpecError, validate_spec
from supervisor.jobs import Job, JobState
from supervisor.records import Incident
from supervisor.recovery.sdc_watch import agreed_floor
from tests.unit.supervisor.conftest import MakeFleet
from tests.unit.supervisor.fake_fleet import FakeFleet

SPEC = {
    "name": "a",
    "team": "t",
    "command": ["x"],
    "workdir": "/tmp",
    "nodes": 2,
    "ranks_per_node": 2,
}

FAILED = {
    "passed": False,
    "reasons": ["recompute on GPU 0: its result differs from the CPU's"],
    "checks": ["health", "recompute"],
}


def sdc_fleet(make_fleet: MakeFleet, nodes: list[str]) -> FakeFleet:
    """A running job on n0 and n1, 2 ranks each, two-way model parallel: the replica
    groups are ranks (0, 2) and (1, 3), each one rank on n0 and one on n1."""
    fleet = make_fleet(nodes, gang=["n0", "n1"])
    fleet.job.spec = validate_spec(
        {
            **fleet.job.spec.model_dump(exclude={"sdc"}),
            "sdc": {"every": 5, "model_parallel": 2},
        }
    )
    return fleet


def digests(fleet: FakeFleet, step: int, values: dict[int, int]) -> None:
    """Every rank's digest of ``step`` (``values``: rank -> digest)."""
    node_of = {p.rank: p.node for p in fleet.job.ranks}
    for rank, value in values.items():
        fleet.ctl.on_rank_event(
            wire.RankEvent(
                node=node_of[rank],
                job=fleet.job.id,
                generation=fleet.job.generation,
                rank=rank,
                event="digest",
                step=step,
                digest=value,
                at=time.time(),
            )
        )


def diverge(fleet: FakeFleet) -> None:
    # Step 5 agrees in both groups; after step 10, ranks 0 and 2 (group (0, 2)) differ.
    digests(fleet, 5, {0: 10, 1: 11, 2: 10, 3: 11})
    digests(fleet, 10, {0: 20, 1: 21, 2: 99, 3: 21})


async def recovered(fleet: FakeFleet) -> dict[str, Any]:
    """Diverge; the job's one incident once its next generation runs."""
    diverge(fleet)
    await fleet.until(lambda: fleet.job.generation == 2)
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    (incident,) = fleet.job.incidents
    return incident.to_record()


async def test_two_replicas_that_differ_are_rechecked_and_the_one_that_fails_is_replaced(
    make_fleet: MakeFleet,
) -> None:
    fleet = sdc_fleet(make_fleet, ["n0", "n1", "n2"])
    fleet.answer("burn_in", node="n1", result=FAILED)
    diverge(fleet)
    await fleet.until(lambda: fleet.job.generation == 2)
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)

    assert sorted(fleet.ops("burn_in"))[:2] == [("n0", 0), ("n1", 0)]  # the recheck
    (incident,) = fleet.record()["incidents"]
    (failure,) = incident["failures"]
    assert (failure["kind"], failure["node"], failure["rank"]) == ("sdc", "n1", 2)
    assert "failed its recheck: recompute on GPU 0" in failure["detail"]
    assert incident["plan"]["quarantine"] == ["n1"]
    assert fleet.job.nodes == ["n0", "n2"]
    assert fleet.registry.nodes["n1"].drain is not None
    assert "sdc_suspect" in fleet.registry.nodes["n1"].drain.reason
    kinds = [e.kind for e in fleet.store.events(job=fleet.job.id)]
    assert "sdc_rechecked" in kinds and "ckpt_voided" in kinds


async def test_both_replicas_failing_the_recheck_are_both_replaced(make_fleet: MakeFleet) -> None:
    fleet = sdc_fleet(make_fleet, ["n0", "n1", "n2", "n3"])
    fleet.answer("burn_in", node="n0", result=FAILED)
    fleet.answer("burn_in", node="n1", result=FAILED)
    incident = await recovered(fleet)
    assert sorted(f["node"] for f in incident["failures"]) == ["n0", "n1"]
    assert incident["plan"]["quarantine"] == ["n0", "n1"]
    assert sorted(fleet.job.nodes) == ["n2", "n3"]


async def test_no_node_failing_the_recheck_restarts_the_gang_in_place_with_none_quarantined(
    make_fleet: MakeFleet,
) -> None:
    fleet = sdc_fleet(make_fleet, ["n0", "n1", "n2"])
    incident = await recovered(fleet)
    (failure,) = incident["failures"]
    assert (failure["kind"], failure["quarantine"]) == ("sdc", False)
    assert incident["plan"]["action"] == "restart_in_place"
    assert incident["plan"]["quarantine"] == []
    assert fleet.job.nodes == ["n0", "n1"]
    assert all(fleet.registry.nodes[n].drain is None for n in ("n0", "n1"))


async def test_a_divergence_within_one_group_only_is_judged_against_that_group(
    make_fleet: MakeFleet,
) -> None:
    # The two halves of the model differ from each other all the time: no divergence.
    fleet = sdc_fleet(make_fleet, ["n0", "n1", "n2"])
    digests(fleet, 5, {0: 10, 1: 11, 2: 10, 3: 11})
    digests(fleet, 10, {0: 20, 1: 21, 2: 20, 3: 21})

    assert fleet.job.state is JobState.RUNNING and fleet.job.recovery is None
    assert fleet.ops("burn_in") == []


async def test_a_recheck_that_could_not_run_blames_no_one(make_fleet: MakeFleet) -> None:
    # An expired command (or no ack) is no failed recheck: n1 is not quarantined.
    fleet = sdc_fleet(make_fleet, ["n0", "n1", "n2"])
    fleet.answer("burn_in", "expired", node="n1")
    incident = await recovered(fleet)
    (failure,) = incident["failures"]
    assert failure["quarantine"] is False and "n1: its recheck did not run" in failure["detail"]
    assert fleet.job.nodes == ["n0", "n1"]
    assert fleet.registry.nodes["n1"].drain is None


async def test_the_gang_is_stopped_before_its_nodes_are_rechecked(make_fleet: MakeFleet) -> None:
    fleet = sdc_fleet(make_fleet, ["n0", "n1", "n2"])
    fleet.hold("burn_in")  # the rechecks wait: released when the fleet closes
    diverge(fleet)
    await fleet.until(lambda: len(fleet.ops("burn_in")) == 2)

    ops = fleet.ops_sent
    assert ops.index("burn_in") > max(i for i, op in enumerate(ops) if op == "stop_ranks")
    assert fleet.job.state is JobState.RECOVERING
    assert fleet.job.recovery is not None and fleet.job.recovery.phase == "stopped"


async def test_a_node_that_fails_its_recheck_is_drained_even_if_the_job_was_cancelled(
    make_fleet: MakeFleet,
) -> None:
    fleet = sdc_fleet(make_fleet, ["n0", "n1", "n2"])
    fleet.answer("burn_in", node="n1", result=FAILED)
    burn_ins = fleet.hold("burn_in")
    diverge(fleet)
    await fleet.until(lambda: len(fleet.ops("burn_in")) == 2)
    fleet.ctl.cancel(fleet.job.id)
    burn_ins.set()

    await fleet.until(lambda: fleet.registry.nodes["n1"].drain is not None)
    drain = fleet.registry.nodes["n1"].drain
    assert drain is not None and drain.reason.startswith("sdc_suspect: ")
    assert fleet.registry.nodes["n0"].drain is None
    await fleet.until(lambda: fleet.job.state.final)


async def test_the_agreed_step_is_kept_with_the_job_and_a_new_board_starts_there(
    make_fleet: MakeFleet,
) -> None:
    # A restarted supervisor (a new watch, a new board) must not void the whole run at
    # the first divergence: it starts from the step the job's record says agreed.
    fleet = sdc_fleet(make_fleet, ["n0", "n1", "n2"])
    digests(fleet, 5, {0: 10, 1: 11, 2: 10, 3: 11})
    assert fleet.job.sdc_agreed == 5
    assert Job.from_record(fleet.job.id, fleet.job.record()).sdc_agreed == 5
    fleet.ctl.sdc.forget(fleet.job.id)  # as after a restart

    digests(fleet, 10, {0: 20, 1: 21, 2: 99, 3: 21})
    await fleet.until(lambda: fleet.job.generation == 2)
    voided = [e.detail for e in fleet.store.events(job=fleet.job.id) if e.kind == "ckpt_voided"]
    assert [v["after"] for v in voided] == [6]  # not -1


def test_a_generations_floor_is_no_newer_than_the_step_it_restored() -> None:
    spec = validate_spec({**SPEC, "sdc": {"every": 5}})
    job = Job("j", spec, generation=3, sdc_agreed=900)
    assert agreed_floor(job) == 900  # no incident started it: as recorded
    job.incidents = [Incident(next_generation=3, restored_step=500)]
    assert agreed_floor(job) == 499  # its ranks replay the steps after 500
    job.incidents = [Incident(next_generation=3, restored_step=None)]
    assert agreed_floor(job) is None  # it started from nothing


def test_a_stored_one_replica_sdc_job_still_loads() -> None:
    # Submitted before the lone-replica rule: the supervisor must still start.
    spec = {**SPEC, "nodes": 1, "ranks_per_node": 1, "sdc": {"every": 5}}
    with pytest.raises(JobSpecError, match="leaves one replica"):
        validate_spec(spec)
    record = Job("j", validate_spec({**spec, "sdc": None})).record()
    record["spec"]["sdc"] = {"every": 5}
    assert Job.from_record("j", record).spec.sdc is not None
