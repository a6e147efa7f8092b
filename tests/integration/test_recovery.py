"""Recovery end to end with plain shell ranks: real broker, supervisor and agents.

The ranks here are small bash scripts, so each case shows one decision of the
recovery controller in seconds: restart in place, move to a spare, wait for
one, fail on a spent budget. The training cases (real tinylm with checkpoints,
final digests compared) are in test_recovery_training.py and test_recovery_moves.py.
"""

from __future__ import annotations

import time

import pytest

from phalanx.simgpu import inject
from tests.harness import Fleet, processes_matching, wait_for

pytestmark = pytest.mark.integration


def fleet_of(fleet: Fleet, nodes: int, *, spares: int = 0, racks: int = 2) -> None:
    fleet.start_supervisor(spares=spares)
    fleet.start_nodes(nodes, racks=racks)


# A rank that runs a while and succeeds; in generation 1, rank 2 exits 1 first.
CRASH_IN_GEN1 = (
    'if [ "$PHALANX_GENERATION" = 1 ] && [ "$RANK" = 2 ]; then sleep 1; exit 1; fi; sleep 3; exit 0'
)


def events(fleet: Fleet, job: str, kind: str) -> list[dict[str, object]]:
    found: list[dict[str, object]] = fleet.client().get(f"/v1/events?job={job}&limit=1000")
    return [e for e in found if e["kind"] == kind]


def test_a_rank_that_exits_1_is_restarted_in_place_on_the_same_nodes(fleet: Fleet) -> None:
    fleet_of(fleet, 3, spares=1)
    job = fleet.submit(
        name="crashy",
        nodes=2,
        ranks_per_node=2,
        grace_period=2,
        command=["bash", "-c", CRASH_IN_GEN1],
    )
    first = fleet.wait_job(job["id"], "running")

    done = fleet.wait_job(job["id"], "succeeded", timeout=60)

    assert done["generation"] == 2
    assert done["restarts"] == 1
    assert done["nodes"] == first["nodes"]  # a process failure: same nodes, no spare
    (incident,) = done["incidents"]
    assert incident["failures"][0]["kind"] == "rank_exit"
    assert (incident["failures"][0]["rank"], incident["failures"][0]["code"]) == (2, 1)
    assert incident["plan"]["action"] == "restart_in_place"
    assert incident["plan"]["quarantine"] == []
    for node in ("n01", "n02", "n03"):
        assert fleet.node(node)["state"] == "up"
    # The job started when generation 1 did; generation 2 has a start of its own.
    assert done["first_started_at"] == first["started_at"] < done["started_at"]
    shown = fleet.cli("status", job["id"]).stdout
    assert " (generation 2: " in shown.split("started: ", 1)[1].splitlines()[0]


def test_ranks_of_a_node_whose_gpu_fails_move_to_the_spare_in_its_rack(fleet: Fleet) -> None:
    fleet_of(fleet, 4, spares=1)
    job = fleet.submit(
        name="ecc",
        nodes=2,
        ranks_per_node=2,
        grace_period=2,
        command=["bash", "-c", 'if [ "$PHALANX_GENERATION" = 1 ]; then sleep 600; fi; sleep 2'],
    )
    running = fleet.wait_job(job["id"], "running")
    victim = running["nodes"][1]
    wait_for(lambda: len(processes_matching("sleep 600")) >= 4 or None, 10, "four ranks")

    inject(fleet.sim_file(victim), 1, "ecc-dbe")

    done = fleet.wait_job(job["id"], "succeeded", timeout=60)
    assert victim not in done["nodes"]
    assert done["generation"] == 2
    (incident,) = done["incidents"]
    assert incident["failures"][0]["kind"] == "node_drain"
    assert incident["plan"]["action"] == "replace"
    (swap,) = incident["plan"]["swaps"]
    assert swap[0] == victim
    # Same GROUP_RANK: the spare took the failed node's place in the gang.
    assert done["nodes"][1] == swap[1]
    assert fleet.node(victim)["state"] == "drain"
    assert wait_for(lambda: processes_matching("sleep 600") == [] or None, 10, "no old rank")


def test_a_node_whose_agent_dies_is_replaced_by_a_spare_and_quarantined(fleet: Fleet) -> None:
    fleet_of(fleet, 3, spares=1)
    job = fleet.submit(
        name="offline",
        nodes=2,
        ranks_per_node=1,
        grace_period=1,
        command=["bash", "-c", 'if [ "$PHALANX_GENERATION" = 1 ]; then sleep 600; fi; sleep 2'],
    )
    running = fleet.wait_job(job["id"], "running")
    victim = running["nodes"][0]  # the rank-0 node: the rendezvous must not go with it

    fleet.agents[victim].kill9()

    done = fleet.wait_job(job["id"], "succeeded", timeout=60)
    assert victim not in done["nodes"]
    (incident,) = done["incidents"]
    assert incident["failures"][0]["kind"] == "node_offline"
    assert done["master"].split(":")[0] == "127.0.0.1"
    assert fleet.node(victim)["drain"] is not None
    assert "quarantined by job" in fleet.node(victim)["drain"]["reason"]
    # Its ranks outlived the agent; the agent, back (systemd restarts it), reaps them.
    fleet.start_agent(victim, rack=fleet.node(victim)["rack"])
    wait_for(lambda: processes_matching("sleep 600") == [] or None, 20, "no rank left behind")
    # Back (its birth comes once it reaped its orphans), but still quarantined.
    fleet.wait_state(victim, "drain")


def test_two_hardware_failures_with_max_restarts_1_fail_the_job_with_both(
    fleet: Fleet,
) -> None:
    fleet_of(fleet, 4, spares=2)
    job = fleet.submit(
        name="unlucky",
        nodes=2,
        ranks_per_node=1,
        grace_period=1,
        restart={"max_restarts": 1},
        command=["sleep", "600"],
    )
    running = fleet.wait_job(job["id"], "running")
    inject(fleet.sim_file(running["nodes"][0]), 0, "ecc-dbe")
    second = fleet.wait_generation(job["id"], 2)  # the first recovery

    inject(fleet.sim_file(second["nodes"][1]), 0, "xid-79")

    failed = fleet.wait_job(job["id"], "failed", timeout=60)
    assert "restart budget spent" in failed["reason"]
    assert [i["failures"][0]["node"] for i in failed["incidents"]] == [
        running["nodes"][0],
        second["nodes"][1],
    ]
    assert [i["outcome"] for i in failed["incidents"]] == ["recovered", "failed"]


def test_with_no_spare_the_job_waits_recovering_until_a_node_is_undrained(
    fleet: Fleet,
) -> None:
    fleet_of(fleet, 2)
    job = fleet.submit(
        name="patient",
        nodes=2,
        ranks_per_node=1,
        grace_period=1,
        command=["bash", "-c", 'if [ "$PHALANX_GENERATION" = 1 ]; then sleep 600; fi; sleep 2'],
    )
    fleet.wait_job(job["id"], "running")
    inject(fleet.sim_file("n02"), 0, "gpu-lost")

    waiting = wait_for(
        lambda: (j := fleet.job(job["id"]))["state"] == "recovering" and j["waiting"] and j,
        30,
        "the job to wait for a node",
    )
    assert waiting["waiting"]["reason"] == "no_spare"
    assert "no healthy node" in waiting["waiting"]["detail"]
    inject(fleet.sim_file("n02"), 0, "clear")
    wait_for(lambda: fleet.node("n02")["health"] == "ok", 15, "n02 healthy again")
    fleet.client().post("/v1/nodes/n02/undrain")

    done = fleet.wait_job(job["id"], "succeeded", timeout=60)
    assert done["nodes"] == ["n01", "n02"]
    assert events(fleet, job["id"], "recovery_waiting")


def test_a_broker_restart_is_not_a_failure_and_the_job_keeps_running(fleet: Fleet) -> None:
    fleet_of(fleet, 2)
    job = fleet.submit(name="steady", nodes=2, ranks_per_node=1, command=["sleep", "600"])
    fleet.wait_job(job["id"], "running")

    fleet.broker.stop()
    # The outage: the supervisor hears neither node for longer than its offline_after_s (4 s).
    wait_for(
        lambda: all(time.time() - (fleet.node(n)["last_seen"] or 0) > 5.0 for n in ("n01", "n02")),
        30,
        "5 s of silence from both nodes",
        interval=0.2,
    )
    fleet.broker.start()
    back = time.time()
    wait_for(  # the daemons reconnect; each node's heartbeats resume (two since)
        lambda: all((fleet.node(n)["last_seen"] or 0) > back + 1.0 for n in ("n01", "n02")),
        30,
        "heartbeats from both nodes after the broker's restart",
    )

    view = fleet.job(job["id"])
    assert (view["state"], view["generation"], view["restarts"]) == ("running", 1, 0)
    for node in ("n01", "n02"):
        assert fleet.node(node)["state"] == "up"
    fleet.client().post(f"/v1/jobs/{job['id']}/cancel")
    fleet.wait_job(job["id"], "cancelled", timeout=30)


def test_an_operators_drain_lets_the_running_job_finish_where_it_is(fleet: Fleet) -> None:
    fleet_of(fleet, 3, spares=1)
    job = fleet.submit(
        name="upgrade", nodes=2, ranks_per_node=1, grace_period=1, command=["bash", "-c", "sleep 4"]
    )
    running = fleet.wait_job(job["id"], "running")

    fleet.client().post(f"/v1/nodes/{running['nodes'][0]}/drain", {"reason": "kernel upgrade"})

    done = fleet.wait_job(job["id"], "succeeded", timeout=30)
    assert (done["generation"], done["restarts"], done["nodes"]) == (1, 0, running["nodes"])


def test_a_job_that_waits_for_a_node_longer_than_spare_wait_fails_saying_so(
    fleet: Fleet,
) -> None:
    fleet_of(fleet, 2)
    job = fleet.submit(
        name="stranded",
        nodes=2,
        ranks_per_node=1,
        grace_period=1,
        restart={"spare_wait": 3},
        command=["sleep", "600"],
    )
    fleet.wait_job(job["id"], "running")

    inject(fleet.sim_file("n02"), 0, "gpu-lost")

    failed = fleet.wait_job(job["id"], "failed", timeout=30)
    assert "restart.spare_wait" in failed["reason"]
    assert failed["incidents"][-1]["outcome"] == "failed"
    assert wait_for(lambda: processes_matching("sleep 600") == [] or None, 10, "no rank left")


FAIL_IN_GEN1_THEN = 'if [ "$PHALANX_GENERATION" = 1 ]; then sleep 1; exit 1; fi; '


def test_a_one_node_gang_quarantined_on_software_strikes_is_burned_in_and_restarts_on_it(
    fleet: Fleet,
) -> None:
    fleet_of(fleet, 1)
    # First strike on n01: another job's rank exits; that job restarts in place.
    other = fleet.submit(
        name="other",
        nodes=1,
        ranks_per_node=1,
        grace_period=1,
        command=["bash", "-c", FAIL_IN_GEN1_THEN + "sleep 600"],
    )
    fleet.wait_generation(other["id"], 2, timeout=30)  # the other job restarted
    # Second strike: this job's rank exits on the same node within the hour. n01 is
    # quarantined as suspect, and no spare exists to take its ranks.
    job = fleet.submit(
        name="stranded",
        nodes=1,
        ranks_per_node=1,
        grace_period=1,
        command=["bash", "-c", FAIL_IN_GEN1_THEN + "sleep 2"],
    )

    done = fleet.wait_job(job["id"], "succeeded", timeout=60)  # not spare_wait (600 s)

    assert (done["generation"], done["nodes"]) == (2, ["n01"])
    (incident,) = done["incidents"]
    assert incident["plan"]["reinstate"] == ["n01"]
    assert "looks like software" in incident["plan"]["reason"]
    assert "passed a burn-in" in incident["plan"]["reason"]
    assert [e["detail"]["passed"] for e in events(fleet, job["id"], "suspect_burned_in")] == [True]
    assert fleet.node("n01")["state"] == "up"
    fleet.client().post(f"/v1/jobs/{other['id']}/cancel")
    fleet.wait_job(other["id"], "cancelled", timeout=30)
