"""rolling-upgrade.yml against the supervisor and agent the roles installed, with a real job.

The agent is not restarted here (no systemd in the test container: the roles converge into a
staging root, where handlers restart nothing); everything around the restart is real: the
drain, the wait while a job holds the node, the upgrade after the job ended, the health check
and the undrain, all through the supervisor's REST API.
"""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from phalanx.client import Client
from tests.rollout.rollout_env import (
    ANSIBLE,
    FleetTree,
    LiveFleet,
    ansible_env,
    run_playbook,
    tail,
    tool,
)
from tests.rollout.test_leader import serving, standby

pytestmark = [pytest.mark.rollout, pytest.mark.integration]

# ansible's line for a poll that found the node still holding a job (delegated to sup1).
WAITING_FOR_JOB = re.compile(r"FAILED - RETRYING: \[gpu-a01[^\]]*\]: Wait until .*job")
# The agent role's first task that upgrades (its leader discovery runs before the drain).
UPGRADE_STARTED = "TASK [agent : Copy the Phalanx wheel]"


def _wait(predicate: object, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}\n{tail(log.read_text(), 15)}"
    )


def _job_state(client: Client, job: str) -> str:
    state: str = client.get(f"/v1/jobs/{job}")["state"]
    return state


def _start_job(client: Client, workdir: Path) -> str:
    """A one-rank job on gpu-a01 (the only node) that runs until cancelled."""
    job: str = client.post(
        "/v1/jobs",
        {
            "spec": {
                "name": "long-run",
                "team": "research",
                "nodes": 1,
                "ranks_per_node": 1,
                "command": [sys.executable, "-c", "import time; time.sleep(600)"],
                "workdir": str(workdir),
                "max_runtime": "15m",
            }
        },
    )["id"]
    deadline = time.monotonic() + 60
    while _job_state(client, job) != "running":
        assert time.monotonic() < deadline, f"job {job} did not start: {client.get('/v1/jobs')}"
        time.sleep(0.2)
    return job


def test_upgrade_drains_waits_for_the_running_job_then_upgrades_and_undrains(
    fleet_tree: FleetTree, live_fleet: LiveFleet, tmp_path: Path
) -> None:
    client = live_fleet.client
    job = _start_job(client, tmp_path)
    log = tmp_path / "rolling-upgrade.log"
    with log.open("w") as out:
        playbook = subprocess.Popen(
            [
                tool("ansible-playbook"),
                "-i",
                str(fleet_tree.inventory),
                "rolling-upgrade.yml",
                "--limit",
                "localhost,sup1,gpu-a01",
                "-e",
                f"phalanx_build_dir={fleet_tree.build_dir}",
                "-e",
                "phalanx_upgrade_poll_s=1",
            ],
            cwd=ANSIBLE,
            env=ansible_env(fleet_tree.ansible_home),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        _wait(
            lambda: WAITING_FOR_JOB.search(log.read_text()) is not None,
            180,
            "the playbook to wait for the job",
            log,
        )
        node = client.get("/v1/nodes/gpu-a01")
        assert (node["state"], node["drain"]["reason"]) == (
            "drain",
            "rolling upgrade to phalanx 0.1.0",
        )
        assert _job_state(client, job) == "running"
        assert UPGRADE_STARTED not in log.read_text().split("Upgrade the agents", 1)[1]

        client.post(f"/v1/jobs/{job}/cancel")
        assert playbook.wait(240) == 0, tail(log.read_text(), 25)
    finally:
        if playbook.poll() is None:
            playbook.kill()
            playbook.wait()

    output = log.read_text().split("Upgrade the agents", 1)[1]
    waits = list(WAITING_FOR_JOB.finditer(output))
    assert waits[-1].start() < output.index(UPGRADE_STARTED)
    assert _job_state(client, job) == "cancelled"
    node = client.get("/v1/nodes/gpu-a01")
    assert (node["state"], node["drain"]) == ("up", None)


def test_restart_handler_refuses_to_restart_an_agent_under_a_running_job(
    fleet_tree: FleetTree, live_fleet: LiveFleet, tmp_path: Path
) -> None:
    client = live_fleet.client
    job = _start_job(client, tmp_path)
    playbook = tmp_path / "restart.yml"
    playbook.write_text(
        "- hosts: gpu-a01\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role: {name: agent, tasks_from: restart.yml}\n"
    )
    try:
        result = subprocess.run(
            [tool("ansible-playbook"), "-i", str(fleet_tree.inventory), str(playbook)],
            cwd=ANSIBLE,
            env=ansible_env(fleet_tree.ansible_home)
            | {"ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles")},
            capture_output=True,
            text=True,
            timeout=180,
        )

        assert result.returncode != 0
        assert f"job(s) {job} run on it: a restart would kill their ranks" in " ".join(
            result.stdout.split()
        ), tail(result.stdout, 20)
        assert "TASK [agent : Restart phalanx-agentd]" not in result.stdout
        assert _job_state(client, job) == "running"
    finally:
        client.post(f"/v1/jobs/{job}/cancel")


def test_upgrade_calls_the_leader_when_the_first_supervisor_host_stands_by(
    fleet_tree: FleetTree, live_fleet: LiveFleet, tmp_path: Path
) -> None:
    # sup0, listed first, is a real standby API (503 and X-Phalanx-Leader on every call but
    # GET /v1/leader) naming sup1, the supervisor the roles installed, which leads. Only
    # gpu-a01 is upgraded: the supervisors' plays have no host in the limit.
    inventory = yaml.safe_load(fleet_tree.inventory.read_text())
    supervisors = inventory["all"]["children"]["supervisors"]
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert = fleet_tree.pki.http["sup1"]
    tls.load_cert_chain(cert.cert, cert.key)
    leader_url = f"https://127.0.0.1:{fleet_tree.api_port}"
    with serving(standby(leader_url), tls) as (port, asked):
        supervisors["hosts"] = {
            "sup0": {
                "phalanx_root": str(tmp_path / "sup0"),
                "phalanx_supervisor_api_url": f"https://127.0.0.1:{port}",
            },
            **supervisors["hosts"],
        }
        (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory, sort_keys=False))
        ran = run_playbook(
            "rolling-upgrade.yml",
            tmp_path / "hosts.yml",
            fleet_tree.ansible_home,
            "--limit",
            "localhost,gpu-a01",
            "-e",
            f"phalanx_build_dir={fleet_tree.build_dir}",
            "-e",
            "phalanx_upgrade_poll_s=1",
        )

    assert ran.returncode == 0, tail(ran.stdout, 40)
    assert asked == ["/v1/leader"]
    assert "changed: [gpu-a01 -> sup1]" in ran.stdout  # the drain, on the leader's host
    node = live_fleet.client.get("/v1/nodes/gpu-a01")
    assert (node["state"], node["drain"]) == ("up", None)
