"""The job controller and the recovery executor end to end, against the fake fleet
(issue 21): a job's launch, a failed rank, node or gang and its recovery, a spent
restart budget, a cancel, a clean end, a supervisor restarted mid-recovery.

The controller, store, registry, catalog, burn-ins, scheduler and planner are real; the
nodes are ``fake_fleet``'s: commands recorded in order and answered as each test
scripts, rank events, heartbeats and wills delivered by the test. Each test asserts
what was sent, the job's states and record, and the events in the store.
"""

from __future__ import annotations

import asyncio

from phalanx import wire
from supervisor.jobs import JobState
from tests.unit.supervisor.conftest import MakeFleet
from tests.unit.supervisor.fake_fleet import FakeFleet, drain_health

GANG = ["n0", "n1"]


def running(fleet: FakeFleet, generation: int) -> bool:
    return fleet.job.state is JobState.RUNNING and fleet.job.generation == generation


# --- launch ----------------------------------------------------------------------


async def test_a_submitted_job_is_placed_by_a_pass_started_on_its_nodes_and_runs(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1", "n2"])
    starts = fleet.hold("start_ranks")
    job = fleet.submit(nodes=2)

    await fleet.until(lambda: len(fleet.ops("start_ranks")) == 2)
    assert job.state is JobState.STARTING and job.generation == 1
    placed = sorted(node for node, _ in fleet.ops("start_ranks"))
    assert placed == sorted(job.nodes) and len(set(placed)) == 2
    assert fleet.ops("alloc_port") == [(job.nodes[0], 0)]  # no port in a heartbeat
    orders = {a.group_rank: a for a in fleet.args("start_ranks")}
    assert sorted(orders) == [0, 1]
    assert all(a.generation == 1 and a.job == job.id for a in orders.values())
    assert all(a.master_port == 29500 for a in orders.values())

    starts.set()
    await fleet.until(lambda: job.state is JobState.RUNNING)
    assert job.started_at is not None and job.world_size == 4
    kinds = fleet.kinds()
    assert kinds.index("job_submitted") < kinds.index("job_starting") < kinds.index("job_running")
    assert fleet.record()["state"] == "running"


async def test_a_job_that_does_not_fit_waits_pending_and_says_why(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(["n0", "n1"])
    job = fleet.submit(nodes=3)

    await fleet.settle()
    assert job.state is JobState.PENDING and fleet.ops("start_ranks") == []
    assert job.waiting is not None and job.waiting.reason


async def test_a_launch_whose_start_is_refused_fails_the_job_and_stops_the_gang(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1"])
    fleet.answer("start_ranks", "refused", node="n1", detail="no such workdir")
    job = fleet.submit(nodes=2)

    await fleet.until(lambda: job.state is JobState.FAILED)
    assert "launch failed" in job.reason and "no such workdir" in job.reason
    assert sorted(fleet.ops("stop_ranks")) == [("n0", 1), ("n1", 1)]
    assert fleet.last("sent", None, "stop_ranks") > fleet.last("acked", None, "start_ranks")
    assert "job_failed" in fleet.kinds()
    assert job.restarts == 0  # a first launch is no recovery: nothing charged


async def test_a_start_never_acknowledged_fails_the_launch_like_a_refusal(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1"])
    fleet.answer("start_ranks", "never", node="n0")
    job = fleet.submit(nodes=2)

    await fleet.until(lambda: job.state is JobState.FAILED)
    assert "no ack from node 'n0'" in job.reason
    assert sorted(fleet.ops("stop_ranks")) == [("n0", 1), ("n1", 1)]


# --- the end of a job ------------------------------------------------------------------


async def test_a_job_whose_every_rank_exits_0_succeeded(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(GANG, gang=GANG)

    fleet.exit(0, 0)
    fleet.exit(1, 0)
    fleet.exit(2, 0)
    assert fleet.job.state is JobState.RUNNING  # rank 3 still runs

    fleet.exit(3, 0)
    assert fleet.job.state is JobState.SUCCEEDED
    assert fleet.job.reason == "every rank exited 0"
    assert "job_succeeded" in fleet.kinds()
    await fleet.settle()
    assert fleet.ops("stop_ranks") == [] and fleet.ops("start_ranks") == []
    assert fleet.record()["state"] == "succeeded"


async def test_a_rank_event_of_an_older_generation_changes_nothing(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(GANG, gang=GANG)
    fleet.job.generation = 2  # the event below is generation 1's, late

    fleet.ctl.on_rank_event(
        wire.RankEvent(node="n1", job="j-1", generation=1, rank=2, event="exited", code=1, at=0.0)
    )
    await fleet.settle()
    assert fleet.job.state is JobState.RUNNING and fleet.job.recovery is None
    assert fleet.sent == []


# --- recoveries ----------------------------------------------------------------------


async def test_a_rank_that_exits_non_zero_restarts_the_gang_in_place(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1", "n2"], gang=GANG)

    fleet.exit(2, 1, step=40)
    assert fleet.job.state is JobState.RECOVERING
    await fleet.until(lambda: running(fleet, 2))
    # No stop: each node's agent stops the old ranks before it starts the new.
    assert fleet.ops("stop_ranks") == []
    assert sorted(fleet.ops("start_ranks")) == [("n0", 2), ("n1", 2)]
    assert fleet.job.nodes == GANG and fleet.job.restarts == 1
    assert fleet.job.recovery is None

    (incident,) = fleet.record()["incidents"]
    (failure,) = incident["failures"]
    assert (failure["kind"], failure["node"], failure["rank"]) == ("rank_exit", "n1", 2)
    assert incident["plan"]["action"] == "restart_in_place"
    assert incident["next_generation"] == 2
    kinds = fleet.kinds()
    assert kinds.index("job_failure") < kinds.index("recovery_planned")
    assert kinds.index("recovery_planned") < kinds.index("job_recovering")
    assert kinds.index("job_recovering") < len(kinds) - 1 - kinds[::-1].index("job_running")
    assert fleet.registry.nodes["n1"].drain is None  # a software failure: no quarantine


async def test_a_node_lost_by_its_will_is_replaced_by_the_burned_in_spare(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1", "n2"], spares=1, gang=GANG)
    fleet.tick()  # the pass takes n2 into the spare pool and burns it in
    await fleet.until(lambda: fleet.ctl.spares == ("n2",) and fleet.ctl.burnins.passed("n2"))
    assert fleet.ops("burn_in") == [("n2", 0)]

    fleet.will("n1")
    await fleet.until(lambda: running(fleet, 2))

    assert fleet.job.nodes == ["n0", "n2"]
    # n1 is offline: no stop to it; n0 stays: its start stops the old ranks.
    assert fleet.ops("stop_ranks") == []
    assert sorted(fleet.ops("start_ranks")) == [("n0", 2), ("n2", 2)]
    assert fleet.first("sent", "n2", "start_ranks") > fleet.first("acked", "n2", "burn_in")
    drain = fleet.registry.nodes["n1"].drain
    assert drain is not None and drain.by == "supervisor"  # quarantined
    (incident,) = fleet.record()["incidents"]
    assert incident["failures"][0]["kind"] == "node_offline"
    assert incident["plan"]["action"] == "replace"
    assert incident["plan"]["swaps"] == [["n1", "n2"]]
    assert "node_quarantined" in fleet.kinds()


async def test_the_time_from_the_stop_to_the_launch_is_the_incidents_prepare_phase(
    make_fleet: MakeFleet,
) -> None:
    # Here the spare's burn-in, held 0.3 s: at 4,096 nodes such checks took seconds that no
    # phase timed (issue 22).
    fleet = make_fleet(["n0", "n1", "n2"], spares=1, gang=GANG)
    burn_in = fleet.hold("burn_in", node="n2")
    fleet.tick()  # n2 into the spare pool, its burn-in held
    fleet.will("n1")
    await fleet.until(lambda: fleet.ops("stop_ranks") == [("n0", 1)])
    await asyncio.sleep(0.3)
    assert fleet.ops("start_ranks") == []
    burn_in.set()
    await fleet.until(lambda: running(fleet, 2))

    (incident,) = fleet.record()["incidents"]
    assert incident["plan"]["swaps"] == [["n1", "n2"]]
    assert 0.3 <= incident["phases"]["prepare"] < 10


async def test_a_replacement_taken_out_of_the_spare_pool_while_probed_stays_the_jobs(
    make_fleet: MakeFleet,
) -> None:
    # While the spare's link is probed, a scheduling pass takes it out of the pool (the
    # recovery holds it) and puts the next one in. Planning again kept moving on to that one
    # and probing it too: at 2,048 nodes, seconds a recovery (issue 22).
    fleet = make_fleet(["n0", "n1", "n2", "n3"], spares=2, gang=GANG)
    fleet.tick()
    await fleet.until(lambda: fleet.ctl.burnins.passed("n2") and fleet.ctl.burnins.passed("n3"))
    await fleet.settle()  # the link survey between the two spares
    assert fleet.ctl.spares == ("n2", "n3")
    probes = len(fleet.ops("probe_link"))
    probe = fleet.hold("probe_link", node="n2")

    fleet.will("n1")
    await fleet.until(lambda: len(fleet.ops("probe_link")) > probes)
    assert fleet.job.recovery is not None and fleet.job.recovery.plan is not None
    fleet.tick()  # a pass while the recovery holds n2
    assert fleet.ctl.spares == ("n3",)
    probe.set()
    await fleet.until(lambda: running(fleet, 2))

    assert fleet.job.nodes == ["n0", "n2"]
    assert {node for node, _ in fleet.ops("probe_link")[probes:]} <= {"n0", "n2"}
    planned = [e.detail["swaps"] for e in fleet.events("recovery_planned")]
    assert planned == [[["n1", "n2"]]]


async def test_a_node_drained_for_its_health_is_replaced_by_a_spare(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1", "n2"], spares=1, gang=GANG)
    fleet.tick()
    await fleet.until(lambda: fleet.ctl.burnins.passed("n2"))

    fleet.beat("n0", health=drain_health())  # the agent saw a double-bit ECC error
    fleet.tick()
    await fleet.until(lambda: running(fleet, 2))

    assert fleet.job.nodes == ["n2", "n1"]  # n0's ranks (0 and 1) moved to the spare
    assert fleet.ops("stop_ranks") == [("n0", 1)]  # it leaves; n1's start stops its ranks
    assert sorted(fleet.ops("start_ranks")) == [("n1", 2), ("n2", 2)]
    (incident,) = fleet.record()["incidents"]
    failure = incident["failures"][0]
    assert (failure["kind"], failure["node"]) == ("node_drain", "n0")
    assert "ecc_dbe" in failure["detail"]


async def test_a_spare_that_fails_its_burn_in_is_drained_and_never_started_on(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1", "n2"], spares=1, gang=GANG)
    failed = {"passed": False, "reasons": ["matmul on GPU 1: wrong result"], "checks": []}
    fleet.answer("burn_in", node="n2", result=failed)
    fleet.tick()
    await fleet.until(lambda: fleet.registry.nodes["n2"].drain is not None)

    fleet.will("n1")
    await fleet.until(lambda: fleet.job.recovery is not None and fleet.job.waiting is not None)
    assert fleet.job.state is JobState.RECOVERING
    assert fleet.ops("start_ranks") == []
    assert "recovery_waiting" in fleet.kinds()


async def test_hang_reports_from_every_node_make_one_recovery_naming_the_culprit(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1", "n2"], gang=["n0", "n1", "n2"])

    fleet.hang("n0", 1, step=40, idle_s=31.0)
    fleet.hang("n2", 4, step=40, idle_s=30.0)
    assert fleet.job.state is JobState.RUNNING  # waits for n1's report (or a moment)
    fleet.hang("n1", 3, step=39, idle_s=30.5)  # furthest behind
    assert fleet.job.state is JobState.RECOVERING

    await fleet.until(lambda: running(fleet, 2))
    (incident,) = fleet.record()["incidents"]
    (failure,) = incident["failures"]
    assert (failure["kind"], failure["node"], failure["rank"]) == ("hang", "n1", 3)
    assert [e.node for e in fleet.events("ranks_hung")] == ["n0", "n2", "n1"]
    assert len(fleet.events("job_failure")) == 1
    assert fleet.ops("stop_ranks") == []  # the starts stop the hung ranks
    assert sorted(fleet.ops("start_ranks")) == [("n0", 2), ("n1", 2), ("n2", 2)]
    assert fleet.job.restarts == 1


async def test_a_stopped_process_is_the_hangs_culprit_over_the_rank_furthest_behind(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(GANG, gang=GANG)

    fleet.hang("n0", 0, step=10)
    fleet.hang("n1", 3, step=40, stopped=True)

    await fleet.until(lambda: running(fleet, 2))
    (failure,) = fleet.record()["incidents"][0]["failures"]
    assert (failure["node"], failure["rank"]) == ("n1", 3)


async def test_a_relaunch_whose_start_is_refused_is_recovered_again_until_the_budget_is_spent(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(GANG)
    fleet.running(GANG, restart={"max_restarts": 2, "backoff": 0})
    fleet.answer("start_ranks", "refused", node="n1", detail="its GPUs are busy")

    fleet.exit(2, 1)
    await fleet.until(lambda: fleet.job.state is JobState.FAILED)

    # Two relaunches (the budget), both refused by n1; the third recovery finds none left.
    assert fleet.job.restarts == 2
    assert [g for _, g in fleet.ops("start_ranks")] == [2, 2, 3, 3]
    # Each relaunch's starts stopped the generation before; the failed job's gang is
    # stopped at its end.
    assert sorted(fleet.ops("stop_ranks")) == [("n0", 3), ("n1", 3)]
    failures = fleet.events("job_failure")
    assert len(failures) == 3
    assert all("launch failed" in e.detail["detail"] for e in failures[1:])
    assert "its GPUs are busy" in failures[1].detail["detail"]
    outcomes = [i.get("outcome") for i in fleet.record()["incidents"]]
    assert outcomes[-1] == "failed" and outcomes.count("launch_failed") == 2
    assert fleet.job.reason.startswith("restart budget spent: 2 of max_restarts 2 used")
    assert "its GPUs are busy" in fleet.job.reason
    assert fleet.job.recovery is None


async def test_a_refused_relaunch_recovers_once_more_and_runs_when_the_next_start_is_taken(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(GANG, gang=GANG)
    fleet.answer("start_ranks", "refused", node="n0", times=1)

    fleet.exit(0, 1)
    await fleet.until(lambda: running(fleet, 3))

    assert fleet.job.restarts == 2  # the refused relaunch is charged too
    assert [g for _, g in fleet.ops("start_ranks")] == [2, 2, 3, 3]
    outcomes = [i.get("outcome") for i in fleet.record()["incidents"]]
    assert outcomes[0] == "launch_failed"


async def test_a_cancel_during_a_recovery_cancels_the_job_and_relaunches_nothing(
    make_fleet: MakeFleet,
) -> None:
    # n1 lost and no spare: the recovery stops the gang, then waits for a node.
    fleet = make_fleet(GANG, gang=GANG)
    stops = fleet.hold("stop_ranks")
    fleet.will("n1")
    await fleet.until(lambda: fleet.ops("stop_ranks") == [("n0", 1)])

    fleet.ctl.cancel(fleet.job.id)
    assert fleet.job.state is JobState.STOPPING
    stops.set()
    await fleet.until(lambda: fleet.job.state is JobState.CANCELLED)

    await fleet.settle()
    assert fleet.ops("start_ranks") == [] and fleet.ops("alloc_port") == []
    assert fleet.job.generation == 1 and fleet.job.restarts == 0
    assert fleet.job.recovery is None
    assert fleet.job.reason == "cancelled by operator"
    assert "job_cancelled" in fleet.kinds() and "job_recovering" not in fleet.kinds()
    assert fleet.record()["incidents"][-1]["outcome"] == "cancelled"


# --- what the heartbeats say -----------------------------------------------------------


async def test_ranks_a_node_stops_listing_are_lost_and_recovered(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(GANG, gang=GANG)
    listed = [wire.JobRanks(job="j-1", generation=1, ranks=[0, 1])]
    fleet.beat("n0", jobs=listed)
    fleet.beat("n1", jobs=[])  # its ranks are gone, unreported
    assert fleet.job.state is JobState.RUNNING  # one heartbeat may have raced them
    fleet.beat("n1", n=2, jobs=[])

    assert fleet.job.state is JobState.RECOVERING
    await fleet.until(lambda: running(fleet, 2))
    (failure,) = fleet.record()["incidents"][0]["failures"]
    assert (failure["kind"], failure["node"]) == ("rank_exit", "n1")
    assert "lost" in failure["detail"]
    assert "ranks_lost" in fleet.kinds()


async def test_ranks_no_live_job_owns_are_stopped_as_orphans(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(GANG, gang=GANG)
    fleet.beat("n1", jobs=[wire.JobRanks(job="j-gone", generation=4, ranks=[0])])

    await fleet.until(lambda: fleet.ops("stop_ranks") == [("n1", 4)])
    (stop,) = fleet.args("stop_ranks")
    assert stop.job == "j-gone" and "orphaned" in stop.reason
    assert fleet.job.state is JobState.RUNNING


async def test_an_offline_node_not_yet_confirmed_is_no_failure_until_it_is(
    make_fleet: MakeFleet,
) -> None:
    # A broker restart takes every node offline for a moment: the job waits for the
    # controller's word that the node is offline for sure.
    fleet = make_fleet(GANG, gang=GANG, offline_confirmed=False)
    fleet.will("n1")
    await fleet.settle()
    assert fleet.job.state is JobState.RUNNING and fleet.sent == []

    fleet.confirmed = True
    fleet.tick()
    assert fleet.job.state is JobState.RECOVERING


# --- a supervisor restarted ------------------------------------------------------------


async def test_a_supervisor_restarted_while_a_recovery_stopped_the_gang_runs_it_again(
    make_fleet: MakeFleet,
) -> None:
    # n0 drained, and the spare n2 still burning in: the recovery stops the gang first.
    fleet = make_fleet(["n0", "n1", "n2"], spares=1, gang=GANG, recovery_stop_wait_s=60)
    fleet.hold("burn_in", node="n2")
    fleet.tick()
    await fleet.until(lambda: fleet.ops("burn_in") == [("n2", 0)])
    fleet.hold("stop_ranks")  # the stops never come back to this supervisor
    fleet.beat("n0", health=drain_health())
    fleet.tick()
    await fleet.until(lambda: len(fleet.ops("stop_ranks")) == 2)
    assert fleet.record()["state"] == "recovering"

    again = await fleet.restart(offline_after_s=0.05)
    assert again.job.state is JobState.RECOVERING and again.job.recovery is not None

    await again.until(lambda: running(again, 2))
    assert sorted(again.ops("stop_ranks")) == [("n0", 1), ("n1", 1)]  # stopped again
    assert sorted(again.ops("start_ranks")) == [("n1", 2), ("n2", 2)]
    assert again.job.restarts == 1
    (incident,) = again.record()["incidents"]
    assert incident["failures"][0]["node"] == "n0"


async def test_a_supervisor_restarted_during_a_recoverys_launch_relaunches_over_it(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(GANG, gang=GANG)
    fleet.hold("start_ranks")  # the new generation's starts, their outcome never known
    fleet.exit(2, 1)
    await fleet.until(lambda: len(fleet.ops("start_ranks")) == 2)
    assert fleet.record()["state"] == "starting" and fleet.record()["generation"] == 2

    again = await fleet.restart(offline_after_s=0.05)
    assert again.job.state is JobState.RECOVERING  # its launch's outcome unknown

    await again.until(lambda: running(again, 3))
    assert again.ops("stop_ranks") == []  # the starts stop what it launched
    assert sorted(again.ops("start_ranks")) == [("n0", 3), ("n1", 3)]
    assert again.job.restarts == 1  # the relaunch, run again, is charged once
    moves = [(h["from"], h["to"], h["why"]) for h in again.record()["history"]]
    assert ("starting", "recovering", "supervisor restarted during recovery") in moves
