"""Jobs end to end: real broker, supervisor, agents and rank processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.client import ApiError
from tests.harness import Fleet, processes_matching, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def two_by_two(fleet: Fleet) -> None:
    fleet.start_supervisor()
    fleet.start_nodes(2)


def test_example_job_trains_to_a_lower_loss_and_succeeds_on_two_nodes_of_two_ranks(
    fleet: Fleet,
    tmp_path: Path,
) -> None:
    two_by_two(fleet)
    spec = tmp_path / "tinylm.yaml"
    spec.write_text(
        "name: tinylm\nteam: research\n"
        f"command: [{sys.executable}, examples/tinylm.py, --steps, '40', --log-every, '10']\n"
        f"workdir: {REPO}\nnodes: 2\nranks_per_node: 2\nmax_runtime: 5m\n"
    )

    submitted = fleet.cli("submit", str(spec), "--wait")

    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(fleet.cli("status", submitted.stdout.strip(), "-o", "json").stdout)
    assert job["state"] == "succeeded"
    assert job["world_size"] == 4
    assert [(r["rank"], r["node"], r["local_rank"], r["exit_code"]) for r in job["ranks"]] == [
        (0, "n01", 0, 0),
        (1, "n01", 1, 0),
        (2, "n02", 0, 0),
        (3, "n02", 1, 0),
    ]
    log = fleet.cli("logs", job["id"], "--rank", "0").stdout
    summary = json.loads(log.strip().splitlines()[-1])
    assert summary["done"] is True
    assert summary["last_loss"] < summary["first_loss"]


def test_submit_records_the_workdirs_commit_and_ckpt_ls_shows_the_lineage(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.wait_state("n01", "up")
    spec = tmp_path / "lineage.yaml"
    spec.write_text(
        'name: lineage\nteam: research\ncommand: ["true"]\n'
        f"workdir: {REPO}\nnodes: 1\nranks_per_node: 1\n"
        "data_snapshot: c4-en@2026-11-01\nhyperparams: {lr: 0.0003}\n"
    )
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()

    submitted = fleet.cli("submit", str(spec), "--wait")

    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    job = json.loads(fleet.cli("status", job_id, "-o", "json").stdout)
    assert job["spec"]["code_ref"]["commit"] == head
    listed = fleet.cli("ckpt", "ls", job_id)
    assert listed.returncode == 0, listed.stderr
    assert f"code: {head}" in listed.stdout
    assert "data: c4-en@2026-11-01" in listed.stdout and "hyperparams: lr=0.0003" in listed.stdout


def test_ranks_get_the_torch_distributed_environment_and_secrets_from_files(
    fleet: Fleet,
    tmp_path: Path,
) -> None:
    two_by_two(fleet)
    secret = tmp_path / "secret"
    secret.write_text("hunter2\n")
    job = fleet.submit(
        name="envcheck",
        nodes=2,
        ranks_per_node=2,
        command=["bash", "-c", "env | sort"],
        env={"SECRET": {"from_file": str(secret)}, "PLAIN": "yes"},
    )
    done = fleet.wait_job(job["id"], "succeeded")

    env = dict(
        line.split("=", 1)
        for line in fleet.client()
        .get_bytes(f"/v1/jobs/{job['id']}/logs?rank=3")[0]
        .decode()
        .splitlines()
        if "=" in line
    )
    assert {
        k: env[k]
        for k in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
        )
    } == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert env["MASTER_PORT"] == done["master"].split(":")[1]
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_FR_BUFFER_SIZE" in env and "TORCH_FR_DUMP_TEMP_FILE" in env
    assert env["PHALANX_JOB_ID"] == job["id"] and env["PHALANX_GENERATION"] == "1"
    assert env["PHALANX_AGENT_SOCKET"].endswith("agent.sock")
    assert env["SECRET"] == "hunter2" and env["PLAIN"] == "yes"
    # The secret's value never reaches the supervisor's view of the job.
    assert "hunter2" not in json.dumps(fleet.job(job["id"]))


def test_a_job_needing_more_nodes_than_are_up_stays_pending_and_starts_no_process(
    fleet: Fleet,
) -> None:
    two_by_two(fleet)
    job = fleet.submit(name="toobig", nodes=3, ranks_per_node=1, command=["sleep", "3131"])

    view = wait_for(lambda: (j := fleet.job(job["id"]))["waiting"] and j, 10, "a waiting reason")
    time.sleep(1.0)  # several scheduling passes

    assert fleet.job(job["id"])["state"] == "pending"
    assert view["waiting"]["reason"] == "resources"
    assert processes_matching("sleep 3131") == []
    assert not any((fleet.root / "nodes" / n / "data" / "jobs").exists() for n in ("n01", "n02"))


def test_cancel_leaves_no_rank_process_behind_even_one_ignoring_sigterm(fleet: Fleet) -> None:
    two_by_two(fleet)
    job = fleet.submit(
        name="stubborn",
        nodes=2,
        ranks_per_node=2,
        grace_period=1,
        command=["bash", "-c", "trap '' TERM; sleep 3232 & wait; sleep 3232"],
    )
    fleet.wait_job(job["id"], "running")
    wait_for(lambda: len(processes_matching("sleep 3232")) >= 4, 10, "four ranks")

    cancelled = fleet.cli("cancel", job["id"], "--wait")

    assert cancelled.returncode == 0, cancelled.stderr
    assert fleet.job(job["id"])["state"] == "cancelled"
    wait_for(lambda: processes_matching("sleep 3232") == [] or None, 5, "no rank left")


def test_a_rank_that_exits_1_fails_the_job_and_stops_its_peers(fleet: Fleet) -> None:
    two_by_two(fleet)
    job = fleet.submit(
        name="crashy",
        nodes=2,
        ranks_per_node=2,
        grace_period=2,
        restart={"max_restarts": 0},
        command=["bash", "-c", 'if [ "$RANK" = 2 ]; then sleep 1; exit 1; fi; sleep 3333'],
    )

    failed = fleet.wait_job(job["id"], "failed", timeout=30)

    assert failed["reason"] == "rank 2 on node n02 exited with code 1"
    assert next(r for r in failed["ranks"] if r["rank"] == 2)["exit_code"] == 1
    wait_for(lambda: processes_matching("sleep 3333") == [] or None, 5, "peers stopped")


def test_an_invalid_spec_is_rejected_naming_the_field_and_line(
    fleet: Fleet,
    tmp_path: Path,
) -> None:
    fleet.start_supervisor()
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nteam: t\ncommand: [x]\nworkdir: /\nnodes: 0\nranks_per_node: 1\n")

    done = fleet.cli("submit", str(spec))

    assert done.returncode == 2
    assert "nodes (line 5)" in done.stderr
    with pytest.raises(ApiError) as rejected:
        fleet.submit(name="bad", nodes=1, ranks_per_node=1, command=["x"], priority="high")
    assert rejected.value.status == 400
    assert "priority" in str(rejected.value)


def test_preemption_evicts_the_running_job_with_the_least_lost_work(fleet: Fleet) -> None:
    two_by_two(fleet)
    older = fleet.submit(
        name="older",
        nodes=1,
        ranks_per_node=2,
        priority=10,
        preemptible=True,
        command=["sleep", "3434"],
    )
    fleet.wait_job(older["id"], "running")
    time.sleep(2.0)  # the older job has more work to lose
    newer = fleet.submit(
        name="newer",
        nodes=1,
        ranks_per_node=2,
        priority=10,
        preemptible=True,
        command=["sleep", "3434"],
    )
    fleet.wait_job(newer["id"], "running")

    urgent = fleet.submit(
        name="urgent", nodes=1, ranks_per_node=2, priority=100, command=["sleep", "3535"]
    )
    fleet.wait_job(urgent["id"], "running", timeout=30)

    evicted = fleet.job(newer["id"])
    assert evicted["state"] == "pending"
    assert evicted["preemptions"] == 1
    assert fleet.job(older["id"])["state"] == "running"
    events = fleet.client().get(f"/v1/events?job={newer['id']}")
    assert any(e["kind"] == "job_preempted" and e["detail"]["by"] == urgent["id"] for e in events)


def test_a_restarted_supervisor_finds_a_running_job_running_and_can_still_cancel_it(
    fleet: Fleet,
) -> None:
    two_by_two(fleet)
    job = fleet.submit(name="longrun", nodes=2, ranks_per_node=1, command=["sleep", "3636"])
    fleet.wait_job(job["id"], "running")
    assert fleet.supervisor is not None
    fleet.supervisor.stop()

    fleet.start_supervisor()
    fleet.wait_heartbeats(6)  # three of each node: reconciliation must not lose the job

    assert fleet.job(job["id"])["state"] == "running"
    assert len(processes_matching("sleep 3636")) == 2
    fleet.client().post(f"/v1/jobs/{job['id']}/cancel")
    fleet.wait_job(job["id"], "cancelled", timeout=20)


def test_a_job_whose_node_dies_fails_naming_the_node(fleet: Fleet) -> None:
    two_by_two(fleet)
    job = fleet.submit(
        name="fragile",
        nodes=2,
        ranks_per_node=1,
        grace_period=1,
        restart={"max_restarts": 0},
        command=["sleep", "3737"],
    )
    fleet.wait_job(job["id"], "running")

    fleet.agents["n02"].kill9()

    failed = fleet.wait_job(job["id"], "failed", timeout=20)
    assert "node n02 went offline" in failed["reason"]


def test_two_jobs_sharing_a_node_get_disjoint_gpus(fleet: Fleet) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01", gpus=4)
    fleet.wait_state("n01", "up")
    command = ["bash", "-c", "echo GPUS=$CUDA_VISIBLE_DEVICES; sleep 3838"]
    first = fleet.submit(name="left", nodes=1, ranks_per_node=2, command=command)
    second = fleet.submit(name="right", nodes=1, ranks_per_node=2, command=command)
    fleet.wait_job(first["id"], "running")
    fleet.wait_job(second["id"], "running")

    def gpus(job_id: str) -> str | None:
        text = fleet.client().get_bytes(f"/v1/jobs/{job_id}/logs?rank=0")[0].decode()
        return text.split("GPUS=", 1)[1].split()[0] if "GPUS=" in text else None

    left = wait_for(lambda: gpus(first["id"]), 10, "the first job's GPUs")
    right = wait_for(lambda: gpus(second["id"]), 10, "the second job's GPUs")
    assert sorted([left, right]) == ["0,1", "2,3"]
    for job in (first, second):
        fleet.client().post(f"/v1/jobs/{job['id']}/cancel")


def test_hot_spares_are_held_back_from_normal_placement(fleet: Fleet) -> None:
    fleet.start_supervisor(spares=1)
    for node in ("n01", "n02", "n03"):
        fleet.start_agent(node)
        fleet.wait_state(node, "up")
    job = fleet.submit(name="wide", nodes=3, ranks_per_node=1, command=["sleep", "3939"])

    view = wait_for(lambda: (j := fleet.job(job["id"]))["waiting"] and j, 10, "a waiting reason")

    assert view["state"] == "pending"
    assert view["waiting"]["reason"] == "resources"
    spares = [n["id"] for n in fleet.client().get("/v1/nodes") if n["spare"]]
    assert len(spares) == 1
    two = fleet.submit(name="narrow", nodes=2, ranks_per_node=1, command=["sleep", "3939"])
    running = fleet.wait_job(two["id"], "running")
    assert spares[0] not in running["nodes"]
    fleet.client().post(f"/v1/jobs/{two['id']}/cancel")
    fleet.client().post(f"/v1/jobs/{job['id']}/cancel")


def test_ranks_no_live_job_owns_are_stopped_by_the_supervisor(fleet: Fleet) -> None:
    two_by_two(fleet)
    job = fleet.submit(
        name="forgotten", nodes=2, ranks_per_node=1, grace_period=1, command=["sleep", "4040"]
    )
    fleet.wait_job(job["id"], "running")
    assert fleet.supervisor is not None
    fleet.supervisor.stop()
    # The supervisor loses its state (a new disk, a restored old backup): nobody owns the ranks.
    for path in (fleet.root / "supervisor" / "state").glob("state.db*"):
        path.unlink()

    fleet.start_supervisor()

    wait_for(
        lambda: processes_matching("sleep 4040") == [] or None,
        30,
        "the orphaned ranks to be stopped",
    )


def test_an_agent_that_stops_takes_its_ranks_with_it_and_the_job_fails(fleet: Fleet) -> None:
    two_by_two(fleet)
    job = fleet.submit(
        name="underfoot",
        nodes=2,
        ranks_per_node=1,
        grace_period=1,
        restart={"max_restarts": 0},
        command=["sleep", "4141"],
    )
    fleet.wait_job(job["id"], "running")
    wait_for(lambda: len(processes_matching("sleep 4141")) == 2 or None, 10, "two ranks")

    assert fleet.agents["n02"].stop() == 0  # systemd's SIGTERM on `systemctl stop`

    failed = fleet.wait_job(job["id"], "failed", timeout=30)
    assert "n02" in failed["reason"]
    wait_for(lambda: processes_matching("sleep 4141") == [] or None, 15, "no rank left")
