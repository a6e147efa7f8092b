"""A recovery's orders (issue 22): a relaunch that follows at once stops only the nodes
that leave the gang, waiting for no ack; each node that stays stops the old ranks at its
start. One that stops the whole gang first waits for its acks at most
``recovery_stop_wait_s``.
The next generation's starts go out beside its checkpoint catalogs (an elastic job's
after them), with
the rendezvous port rank 0's node offered in its heartbeat (no ``alloc_port`` round
trip) when it offered one.

The controller, its store, registry, catalog and planner are real; the commands go to the
fake fleet's recording ``send`` (``fake_fleet``), whose stops are acknowledged only when
the test lets them.
"""

from __future__ import annotations

import gc
import time

import pytest

from phalanx import wire
from phalanx.jobspec import validate_spec
from supervisor import actuator
from supervisor.control import prewarm
from supervisor.jobs import JobState
from supervisor.recovery.incidents import cold_ranks, rank_ranges
from supervisor.recovery.planner import Failure, FailureKind
from tests.unit.supervisor.conftest import MakeFleet
from tests.unit.supervisor.fake_fleet import FakeFleet, drain_health, heartbeat


async def test_a_restart_in_place_sends_no_stop_the_starts_stop_the_old_ranks(
    make_fleet: MakeFleet,
) -> None:
    # Every node stays: each gets its start order at once, and its agent stops the old
    # generation's ranks before it starts the new (agentd.ranks: a start stops every older
    # generation first), the start's ack waiting for them. A stop and its ack less per
    # node: at 2,048 nodes they took seconds before the first start (issue 22).
    fleet = make_fleet(["n0", "n1", "n2"], gang=["n0", "n1", "n2"], recovery_stop_wait_s=60)
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    assert fleet.ops("stop_ranks") == []
    assert sorted(fleet.ops("start_ranks")) == [("n0", 2), ("n1", 2), ("n2", 2)]
    assert fleet.job.generation == 2 and fleet.job.restarts == 1
    phases = fleet.job.incidents[-1].phases
    assert {"plan", "stop", "prepare", "port", "catalogs", "starts"} <= set(phases)
    assert phases["stop"] == 0.0


async def test_a_replacement_joins_with_only_the_leaver_stopped_and_no_ack_awaited(
    make_fleet: MakeFleet,
) -> None:
    # n0 drained under the job: it leaves the gang, its ranks stopped; the spare n2 takes
    # its ranks, its link probed with n1, which stays (the gang's collectives stall once
    # n0's ranks are gone). Neither waits for n0's ack: a round trip that took seconds on
    # a busy fleet (issue 22).
    fleet = make_fleet(["n0", "n1", "n2"], spares=1, gang=["n0", "n1"], recovery_stop_wait_s=60)
    fleet.tick()
    await fleet.until(lambda: fleet.ctl.burnins.passed("n2"))
    probes = len(fleet.ops("probe_link"))
    stops = fleet.hold("stop_ranks", node="n0")
    fleet.beat("n0", health=drain_health())
    fleet.tick()
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING and fleet.job.generation == 2)
    assert fleet.ops("stop_ranks") == [("n0", 1)]
    assert fleet.last("acked", "n0", "stop_ranks") == -1  # still held
    assert all(a.keep_warm for a in fleet.args("stop_ranks"))  # RAM tiers and warm ranks
    assert sorted(fleet.ops("start_ranks")) == [("n1", 2), ("n2", 2)]
    probed = {n for n, _ in fleet.ops("probe_link")[probes:]}
    assert "n2" in probed and probed <= {"n1", "n2"}
    assert fleet.first("sent", None, "start_ranks") > fleet.last("acked", None, "probe_link")
    stops.set()
    await fleet.until(lambda: not fleet.ctl.recoveries._late_stops)


async def test_a_relaunch_goes_ahead_when_stops_are_not_all_acknowledged_in_time(
    make_fleet: MakeFleet,
) -> None:
    # The spare is still burning in: the recovery stops the whole gang first. A stop's ack
    # may take seconds (a busy node): after recovery_stop_wait_s the relaunch goes ahead,
    # the node's agent stopping the old ranks before it starts the new, and each start's
    # ack may take the stop's grace longer.
    fleet = make_fleet(["n0", "n1", "n2"], spares=1, gang=["n0", "n1"], recovery_stop_wait_s=0.2)
    burn_in = fleet.hold("burn_in", node="n2")
    fleet.tick()
    await fleet.until(lambda: fleet.ops("burn_in") == [("n2", 0)])
    stops = fleet.hold("stop_ranks", node="n1")
    fleet.beat("n0", health=drain_health())
    fleet.tick()
    await fleet.until(lambda: ("n1", 1) in fleet.ops("stop_ranks"))
    burn_in.set()
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING and fleet.job.generation == 2)
    assert sorted(fleet.ops("stop_ranks")) == [("n0", 1), ("n1", 1)]
    assert sorted(fleet.ops("start_ranks")) == [("n1", 2), ("n2", 2)]
    assert fleet.first("sent", "n1", "start_ranks") > fleet.first("sent", "n1", "stop_ranks")
    assert fleet.last("acked", "n1", "stop_ranks") == -1  # still held
    assert 0.2 <= fleet.job.incidents[-1].phases["stop"] < 5
    assert fleet.ctl.recoveries._late_stops  # still waited for, and logged if it fails

    stops.set()
    await fleet.until(lambda: not fleet.ctl.recoveries._late_stops)
    assert fleet.last("acked", "n1", "stop_ranks") > fleet.first("sent", "n1", "start_ranks")


async def test_a_recovery_that_waits_for_a_node_waits_for_every_stop_first(
    make_fleet: MakeFleet,
) -> None:
    # Not a relaunch: the gang's GPUs must be free before anything else runs on them.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"], recovery_stop_wait_s=0.0)
    stops = fleet.hold("stop_ranks", node="n0")
    fleet.will("n1")  # no spare: the recovery waits for a node
    await fleet.until(lambda: fleet.job.waiting is not None or len(fleet.ops("stop_ranks")) > 0)
    await fleet.settle()
    assert fleet.job.state is JobState.RECOVERING
    assert fleet.job.waiting is None  # not before n0's stop is acknowledged
    stops.set()
    await fleet.until(lambda: fleet.job.waiting is not None)
    assert fleet.job.waiting.reason == "no_spare"


async def test_a_relaunchs_starts_go_out_beside_its_catalogs(make_fleet: MakeFleet) -> None:
    # Not after them: at 2,048 nodes publishing the catalogs takes seconds (issue 22). A
    # rank asks its node what to restore only once it runs, and the node waits for its
    # generation's catalog (agentd.ckpt.restores), so nothing needs them out first.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    fleet.catalogs_out.clear()  # the broker takes no catalog yet
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: len(fleet.ops("start_ranks")) == 2)
    assert sorted(fleet.ops("start_ranks")) == [("n0", 2), ("n1", 2)]
    assert fleet.first("catalog", None, "2") == -1
    await fleet.settle()
    assert fleet.job.state is JobState.STARTING  # its launch is not over without them

    fleet.catalogs_out.set()
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    assert {n for w, n, o in fleet.log if w == "catalog" and o == "2"} == {"n0", "n1"}
    assert {"catalogs", "starts"} <= set(fleet.job.incidents[-1].phases)


async def test_a_relaunchs_starts_are_written_to_the_broker_before_its_catalogs_are_built(
    make_fleet: MakeFleet,
) -> None:
    # Not at the loop's next turn, after the catalogs' first slice (its reads and the
    # restore step's choice: up to half a second at 2,048 nodes on a busy host, issue 22).
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    await fleet.until(lambda: fleet.first("catalog", None, "2") >= 0)
    last_start = fleet.last("sent", None, "start_ranks")
    written = next(
        (i for i, (w, _, _) in enumerate(fleet.log) if w == "written" and i > last_start), -1
    )
    assert last_start < written < fleet.first("catalog", None, "2")


async def test_a_relaunchs_catalogs_wait_until_its_starts_are_all_on_the_wire(
    make_fleet: MakeFleet,
) -> None:
    # What the socket did not take at once goes before the catalogs' first slice, which
    # held the rest of 2,048 orders in the client for 0.5 s (issue 22).
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    fleet.on_the_wire.clear()  # the socket full
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: len(fleet.ops("start_ranks")) == 2)
    await fleet.settle()
    assert fleet.first("catalog", None, "2") == -1  # not while the starts wait

    fleet.on_the_wire.set()
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    await fleet.until(lambda: fleet.first("catalog", None, "2") >= 0)
    assert fleet.first("on the wire", None, "") < fleet.first("catalog", None, "2")


async def test_a_relaunchs_catalogs_go_once_the_wait_for_the_wire_is_over(
    make_fleet: MakeFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A socket that never drains (a broker that stopped reading) holds them only so long.
    monkeypatch.setattr(actuator, "WRITTEN_WAIT_S", 0.2)
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    fleet.on_the_wire.clear()
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    await fleet.until(lambda: fleet.first("catalog", None, "2") >= 0)
    assert fleet.first("on the wire", None, "") == -1


async def test_a_relaunch_whose_catalogs_fail_to_go_out_runs_and_sends_them_again(
    make_fleet: MakeFleet,
) -> None:
    # The starts went out beside them: the launch is not failed for it (that would stop a
    # gang that is starting, and spend a restart); its nodes wait for the catalogs.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    fleet.catalogs_refused = 1
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    await fleet.until(
        lambda: {n for w, n, o in fleet.log if w == "catalog" and o == "2"} == {"n0", "n1"}
    )
    assert fleet.job.generation == 2 and fleet.job.restarts == 1
    assert fleet.ops("stop_ranks") == []  # the starts stopped the old ranks; none failed


async def test_an_elastic_jobs_catalogs_go_out_before_its_starts(make_fleet: MakeFleet) -> None:
    # Its start orders carry the samples consumed up to the restore step, which the
    # catalogs' build decides: they are built once the catalogs are out.
    fleet = make_fleet(["n0", "n1"])
    fleet.running(
        ["n0", "n1"],
        elastic={"min_nodes": 1, "global_batch": 32, "micro_batch": 1},
    )
    fleet.catalogs_out.clear()
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: fleet.job.state is JobState.STARTING)
    await fleet.settle()
    assert fleet.ops("start_ranks") == []

    fleet.catalogs_out.set()
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    assert fleet.last("catalog", None, "2") < fleet.first("sent", None, "start_ranks")


async def test_a_relaunchs_incident_names_the_ranks_launched_cold_and_why(
    make_fleet: MakeFleet,
) -> None:
    # The launch phase of such a recovery paid a cold start (issue 28): the incident says
    # which ranks and why, from the agents' start acks. Garbage in an ack is left out.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    fleet.answer("start_ranks", node="n0", result={"pids": {}, "cold": {}})
    cold = {"2": "its warm interpreter was still importing", "x": "?", "3": 7}
    fleet.answer("start_ranks", node="n1", result={"pids": {}, "cold": cold})
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)

    assert fleet.job.incidents[-1].cold_ranks == {"its warm interpreter was still importing": "2"}
    # An agent that says nothing of it (older than warm interpreters): unknown.
    fleet.answer("start_ranks", node="n0", result={"pids": {}})
    fleet.answer("start_ranks", node="n1", result={"pids": {}, "cold": "not a dict"})
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=2)
    )
    await fleet.until(lambda: fleet.job.generation == 3)
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    assert fleet.job.incidents[-1].cold_ranks is None


def test_cold_ranks_are_kept_as_ranges_by_reason_and_bounded() -> None:
    def ack(cold: dict[str, str]) -> wire.CommandAck:
        return wire.CommandAck(
            id="c", node="n0", status=wire.AckStatus.DONE, result={"cold": cold}, acked_at=0
        )

    off = "restart.warm is off"
    acks = [ack({str(r): off for r in range(8 * n, 8 * n + 8)}) for n in range(2048)]
    assert cold_ranks(acks) == {off: "0-16383"}  # 16,384 ranks in one line
    assert cold_ranks([ack({"0": off, "1": off, "3": off, "5": "x"})]) == {off: "0-1, 3", "x": "5"}
    many = cold_ranks([ack({str(r): f"reason {r:02d}" for r in range(20)})])
    assert many is not None and len(many) == 9 and many["other reasons"] == "8-19"
    assert rank_ranges(range(0, 200, 2)).endswith(", 62, and 68 more")
    assert cold_ranks([ack({})]) == {} and cold_ranks([]) is None


async def test_a_launch_takes_the_rendezvous_port_from_rank_0s_heartbeat(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    for i, node in enumerate(("n0", "n1")):
        fleet.registry.on_heartbeat(
            wire.Heartbeat(
                node=node,
                seq=1,
                n=1,
                sent_at=time.time(),
                health=wire.Health(status=wire.HealthStatus.OK),
                port=41000 + i,
            )
        )
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)

    assert fleet.ops("alloc_port") == []  # no round trip for it
    assert fleet.job.master_port == 41000
    # The next launch has no port from n0 until its next heartbeat: it asks.
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=2)
    )
    await fleet.until(lambda: fleet.job.generation == 3)
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    assert fleet.ops("alloc_port") == [("n0", 0)]
    assert fleet.job.master_port == 29500


async def test_a_recovery_that_waits_for_a_node_has_its_stops_acknowledged_first(
    make_fleet: MakeFleet,
) -> None:
    # No spare: n1 drained by its failure, the job waits for a node.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    stops = fleet.hold("stop_ranks")
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.NODE_DRAIN, "n1", detail="ecc", generation=1)
    )
    await fleet.until(lambda: len(fleet.ops("stop_ranks")) == 2)
    await fleet.settle()
    assert fleet.job.recovery is not None
    assert fleet.job.recovery.phase == "plan"  # still stopping
    assert fleet.ops("start_ranks") == []

    stops.set()
    await fleet.until(lambda: fleet.job.recovery.phase == "stopped")  # type: ignore[union-attr]
    assert fleet.ops("start_ranks") == []  # nothing to start on: it waits


async def test_a_spare_is_sent_the_start_order_of_a_running_job_without_its_checkpoint_plan(
    make_fleet: MakeFleet,
) -> None:
    # A spare starts no rank: no buddy, and no node's credential at one, goes to it.
    fleet = make_fleet(["n0", "n1", "n2"], gang=["n0", "n1"])
    fleet.ctl.spares = ("n2",)
    fleet.ctl.tick()
    await fleet.until(lambda: fleet.ops("prewarm") == [("n2", 0)])

    (sent,) = fleet.args("prewarm")
    start = fleet.ctl.orders.start_args(fleet.job, 0, "n0")
    assert start.ckpt is not None and sent.start.ckpt is None
    assert sent.start == start.model_copy(update={"ckpt": None})
    assert sent.lease_s == prewarm.LEASE_S


def in_process(fleet: FakeFleet) -> None:
    fleet.job.spec = validate_spec(
        {
            **fleet.job.spec.model_dump(mode="json", exclude_none=True),
            "restart": {"max_restarts": 3, "in_process": True},
        }
    )


async def test_an_in_process_restart_leaves_the_survivors_running_and_says_so_to_the_agents(
    make_fleet: MakeFleet,
) -> None:
    # restart.in_process: a rank exited; the others wait, parked, for the next generation:
    # no stop goes to the gang, and each start tells its agent to resume them.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    in_process(fleet)
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=None, generation=1)
    )
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING and fleet.job.generation == 2)
    assert fleet.ops("stop_ranks") == []
    starts = fleet.args("start_ranks")
    assert sorted(a.group_rank for a in starts) == [0, 1]
    assert all(a.in_process and a.env["PHALANX_IN_PROCESS"] == "1" for a in starts)


async def test_an_in_process_job_that_hangs_is_restarted_as_usual(make_fleet: MakeFleet) -> None:
    # A hang leaves no rank to resume (they are stuck in a collective): the starts stop
    # them, and resume none.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    in_process(fleet)
    fleet.ctl.on_failure(fleet.job, Failure(FailureKind.HANG, "n1", rank=2, generation=1))
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING and fleet.job.generation == 2)
    assert fleet.ops("stop_ranks") == []
    assert not any(a.in_process for a in fleet.args("start_ranks"))


async def test_parked_survivors_in_a_heartbeat_are_no_orphans_while_their_job_starts(
    make_fleet: MakeFleet,
) -> None:
    # A heartbeat sent between a survivor's park and its agent's resume still lists the
    # failed generation: an in-process job starting its next one leaves it to the agent.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    beat = wire.Heartbeat(
        node="n0",
        seq=1,
        n=1,
        sent_at=time.time(),
        health=wire.Health(status=wire.HealthStatus.OK),
        jobs=[wire.JobRanks(job="j-1", generation=1, ranks=[0, 1])],
    )
    fleet.job.state, fleet.job.generation = JobState.STARTING, 2
    in_process(fleet)
    fleet.ctl.reconciler.on_heartbeat(beat)
    await fleet.settle()
    assert fleet.ops("stop_ranks") == []


async def test_an_older_generation_is_no_orphan_while_its_relaunch_stops_it(
    make_fleet: MakeFleet,
) -> None:
    # A relaunch that went ahead before every stop was acknowledged (recovery_stop_wait_s):
    # the node's agent stops the old ranks before it starts the new ones. At 2,048 nodes
    # ~190 orphan stops went out beside the launch's starts (issue 22). Past the stop's
    # grace, ranks still listed are orphans as before.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    old = [wire.JobRanks(job="j-1", generation=1, ranks=[0, 1])]
    fleet.job.state, fleet.job.generation = JobState.STARTING, 2
    fleet.ctl.reconciler.on_heartbeat(heartbeat("n0", jobs=old))
    fleet.job.state, fleet.job.started_at = JobState.RUNNING, time.time()
    fleet.ctl.reconciler.on_heartbeat(heartbeat("n0", jobs=old))
    await fleet.settle()
    assert fleet.ops("stop_ranks") == []

    fleet.job.started_at = time.time() - 60  # the old ranks outlived their stop
    fleet.ctl.reconciler.on_heartbeat(heartbeat("n0", jobs=old))
    await fleet.until(lambda: fleet.ops("stop_ranks") == [("n0", 1)])
    (stop,) = fleet.args("stop_ranks")
    assert "orphaned" in stop.reason and stop.keep_warm


async def test_the_garbage_collector_waits_until_a_relaunchs_orders_are_out(
    make_fleet: MakeFleet,
) -> None:
    # A young collection took up to 0.3 s of the second a recovery has at 2,048 nodes: it
    # is held off from the recovery's start until every start order is handed to the link.
    fleet = make_fleet(["n0", "n1"], gang=["n0", "n1"])
    port = fleet.hold("alloc_port")
    starts = fleet.hold("start_ranks")
    fleet.ctl.on_failure(
        fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
    )
    await fleet.until(lambda: len(fleet.ops("alloc_port")) == 1)
    assert not gc.isenabled()
    port.set()
    await fleet.until(lambda: len(fleet.ops("start_ranks")) == 2)
    await fleet.settle()
    assert gc.isenabled()  # the starts' acks are still to come
    assert fleet.job.state is JobState.STARTING
    starts.set()
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
    assert gc.isenabled()


async def test_a_node_that_fails_soon_after_a_recovery_is_replaced_without_a_backoff(
    make_fleet: MakeFleet,
) -> None:
    # restart.backoff is for a crash loop of the code; a failed node is quarantined and
    # replaced at once. Its generation's steps are known from the ranks' exits, which a
    # relaunch straight after a node's drain does not wait for.
    fleet = make_fleet(["n0", "n1", "n2", "n3"], spares=2, gang=["n0", "n1"])
    fleet.job.spec = validate_spec(
        {
            **fleet.job.spec.model_dump(mode="json", exclude_none=True),
            "restart": {"max_restarts": 3, "backoff": 30},
        }
    )
    fleet.tick()
    await fleet.until(lambda: fleet.ctl.burnins.passed("n2") and fleet.ctl.burnins.passed("n3"))
    fleet.beat("n0", health=drain_health())
    fleet.tick()
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING and fleet.job.generation == 2)
    fleet.tick()
    replacement = next(n for n in fleet.job.nodes if n in ("n2", "n3"))
    fleet.beat(replacement, health=drain_health())
    fleet.tick()
    await fleet.until(lambda: fleet.job.state is JobState.RUNNING and fleet.job.generation == 3)
    assert [i.get("backoff_s") for i in fleet.record()["incidents"]] == [None, None]
    assert fleet.ops("stop_ranks") == [("n0", 1), (replacement, 2)]  # the leavers only
