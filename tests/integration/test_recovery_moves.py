"""Recovery of a real training job onto a spare, and preemption: tinylm with
checkpoints, a node's GPU failing (ECC), rank 0's agent lost, the supervisor restarted
during a recovery, the job preempted by an urgent one (after its first checkpoint and
before it). Each ends with the job ``succeeded`` and rank 0's final digest equal to that
of an undisturbed run (``training``). Restarts in place: ``test_recovery_training``.
"""

from __future__ import annotations

import json

import pytest

from phalanx.simgpu import inject
from tests.harness import Fleet, rank_pid, wait_for
from tests.integration.training import (
    committed_step,
    final_digest,
    rank_log,
    restored_from,
    restored_steps,
    running_after_a_commit,
    start,
    submit,
    undisturbed_digest,
)

pytestmark = pytest.mark.integration


def test_ecc_error_moves_the_ranks_to_the_spare_which_restores_remotely_bit_identical(
    fleet: Fleet,
) -> None:
    start(fleet)
    job = submit(fleet, "ecc")
    running = running_after_a_commit(fleet, job)
    victim = running["nodes"][1]

    inject(fleet.sim_file(victim), 0, "ecc-dbe")

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert victim not in done["nodes"]
    spare = done["nodes"][1]
    (incident,) = done["incidents"]
    planned = incident["plan"]["restore_from"]
    assert {planned["0"], planned["1"]} == {"ram"}  # the healthy node reads its own RAM
    assert {planned["2"], planned["3"]} <= {"peer", "object"}  # the spare had no copy
    froms = restored_from(fleet, done)
    assert set(froms) == {0, 1, 2, 3}  # (the spare's agent staged its copy in RAM first)
    assert fleet.node(victim)["state"] == "drain"
    assert final_digest(fleet, done) == undisturbed_digest()
    assert spare != victim


def test_losing_the_rank_0_nodes_agent_moves_its_ranks_and_the_rendezvous_to_the_spare(
    fleet: Fleet,
) -> None:
    start(fleet)
    # Warm, as for a user: the spare's interpreters take the new rendezvous (rank 0 moved).
    job = submit(fleet, "lost", restart={"warm": True})
    running = running_after_a_commit(fleet, job)
    victim = running["nodes"][0]  # hosts rank 0 and the rendezvous

    fleet.agents[victim].kill9()

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert victim not in done["nodes"]
    (incident,) = done["incidents"]
    # The first signal may be the other node's ranks exiting as their peers vanish (the
    # node's own loss is confirmed 2 s later); the plan sees the node gone either way.
    assert incident["failures"][0]["kind"] in ("node_offline", "rank_exit")
    assert incident["plan"]["cause"] == "hardware"
    ((failed, spare),) = incident["plan"]["swaps"]
    assert failed == victim
    assert done["nodes"][0] == spare  # the spare is GROUP_RANK 0, the rendezvous with it
    assert final_digest(fleet, done) == undisturbed_digest()
    # The dead agent's ranks outlived it; back (systemd restarts it), it reaps them.
    fleet.start_agent(victim, rack=fleet.node(victim)["rack"])
    wait_for(
        lambda: rank_pid(job, 0, generation=1) is None or None,
        30,
        "the old generation's ranks on the lost node to be reaped",
    )


def test_a_supervisor_restarted_during_a_recovery_finishes_it(fleet: Fleet) -> None:
    start(fleet)
    job = submit(fleet, "sup")
    running = running_after_a_commit(fleet, job)
    assert fleet.supervisor is not None
    victim = running["nodes"][1]

    inject(fleet.sim_file(victim), 0, "xid-79")
    wait_for(
        lambda: fleet.job(job)["state"] in ("recovering", "starting") or None,
        30,
        "the recovery to start",
    )
    fleet.supervisor.stop()
    fleet.start_supervisor(spares=1)

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert victim not in done["nodes"]
    assert final_digest(fleet, done) == undisturbed_digest()


def test_a_preempted_job_checkpoints_first_and_resumes_from_that_step_on_its_return(
    fleet: Fleet,
) -> None:
    start(fleet, nodes=2, spares=0)
    job = submit(fleet, "victim", "--ckpt-digests", priority=10, preemptible=True)
    running_after_a_commit(fleet, job)

    urgent = fleet.submit(
        name="urgent", nodes=2, ranks_per_node=1, priority=900, command=["bash", "-c", "sleep 2"]
    )

    fleet.wait_job(urgent["id"], "succeeded", timeout=120)
    done = fleet.wait_job(job, "succeeded", timeout=240)
    events = fleet.client().get(f"/v1/events?job={job}&limit=1000")
    (saved,) = [e["detail"] for e in events if e["kind"] == "job_preempt_checkpoint"]
    assert saved["committed"] is True
    step = saved["step"]
    assert step > 20
    for r in done["ranks"]:  # the resumed generation restored exactly the step saved ...
        log = rank_log(fleet, done, r["rank"])
        restored = [
            json.loads(line)["ckpt_restored"]
            for line in log.read_text().splitlines()
            if "ckpt_restored" in line
        ]
        assert restored == [step]
    # ... and the preempted one trained no step past it: it saved on request and held.
    held = []
    for log in (fleet.root / "nodes").glob(f"*/data/jobs/{job}/g1/rank-*.log"):
        held += [
            json.loads(line)["ckpt_saved_on_request"]
            for line in log.read_text().splitlines()
            if "ckpt_saved_on_request" in line
        ]
    assert held == [step] * 4
    assert final_digest(fleet, done) == undisturbed_digest()


def test_a_job_preempted_before_its_first_checkpoint_saves_and_resumes_from_that_step(
    fleet: Fleet,
) -> None:
    start(fleet, nodes=2, spares=0)
    # Its own cadence would save first at step 500, long after the preemption.
    job = submit(
        fleet,
        "early",
        "--ckpt-every",
        "500",
        "--log-every",
        "5",
        "--steps",
        "150",
        priority=10,
        preemptible=True,
    )
    running = fleet.wait_job(job, "running", timeout=60)
    node0 = next(r["node"] for r in running["ranks"] if r["rank"] == 0)
    log0 = fleet.root / "nodes" / node0 / "data" / "jobs" / job / "g1" / "rank-0.log"
    wait_for(
        lambda: (log0.exists() and '"step": 20' in log0.read_text()) or None, 120, "step 20 trained"
    )
    assert committed_step(fleet, job, 0, tier="ram") is None  # nothing checkpointed yet

    urgent = fleet.submit(
        name="urgent", nodes=2, ranks_per_node=1, priority=900, command=["bash", "-c", "sleep 2"]
    )

    fleet.wait_job(urgent["id"], "succeeded", timeout=120)
    done = fleet.wait_job(job, "succeeded", timeout=240)
    events = fleet.client().get(f"/v1/events?job={job}&limit=1000")
    (saved,) = [e["detail"] for e in events if e["kind"] == "job_preempt_checkpoint"]
    assert saved["committed"] is True and saved["step"] >= 20
    assert set(restored_steps(fleet, done).values()) == {saved["step"]}  # not step 0
