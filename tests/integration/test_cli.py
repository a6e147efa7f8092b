"""The operator CLI against a real fleet: output contracts and exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from phalanx.local import fleet_shm_dir
from phalanx.simgpu import inject
from tests.harness import TOKEN, Fleet
from tests.pg import PgCluster

pytestmark = pytest.mark.integration


def phalanx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def exports(script: str) -> dict[str, str]:
    """The variables ``phalanx local env`` exports."""
    lines = [line.removeprefix("export ") for line in script.splitlines()]
    return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.fixture
def api_env(fleet: Fleet) -> dict[str, str]:
    fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.wait_state("n01", "up")
    return {"PHALANX_API": f"http://127.0.0.1:{fleet.api_port}", "PHALANX_TOKEN": TOKEN}


def test_drain_and_undrain_change_the_state_and_are_recorded_as_events(
    api_env: dict[str, str],
) -> None:
    drained = phalanx("drain", "n01", "--reason", "fan noise", "-o", "json", env=api_env)
    assert drained.returncode == 0, drained.stderr
    assert json.loads(drained.stdout)["state"] == "drain"

    undrained = phalanx("undrain", "n01", env=api_env)
    assert undrained.returncode == 0, undrained.stderr

    events = json.loads(phalanx("events", "-o", "json", env=api_env).stdout)
    kinds = [(e["kind"], e["detail"].get("reason")) for e in events if e["node"] == "n01"]
    assert ("node_drained", "fan noise") in kinds
    assert ("node_undrained", None) in kinds


def test_draining_an_unknown_node_exits_3_naming_it(api_env: dict[str, str]) -> None:
    done = phalanx("drain", "n99", "--reason", "x", env=api_env)
    assert done.returncode == 3
    assert "n99" in done.stderr


def test_undrain_of_a_sick_node_exits_4(fleet: Fleet, api_env: dict[str, str]) -> None:
    inject(fleet.sim_file("n01"), 0, "xid-79")
    fleet.wait_state("n01", "drain")
    done = phalanx("undrain", "n01", env=api_env)
    assert done.returncode == 4
    assert "xid_79" in done.stderr


def test_nodes_table_lists_state_and_reasons(fleet: Fleet, api_env: dict[str, str]) -> None:
    inject(fleet.sim_file("n01"), 1, "thermal")
    fleet.wait_state("n01", "warn")
    done = phalanx("nodes", env=api_env)
    assert done.returncode == 0
    header, row = done.stdout.splitlines()[:2]
    assert header.split() == ["NODE", "STATE", "RACK", "GPUS", "JOBS", "REASONS"]
    assert row.split()[:5] == ["n01", "warn", "rack1", "2", "-"]
    assert "temp_slowdown(gpu1)" in row


def test_top_once_shows_the_fleet_and_exits(api_env: dict[str, str]) -> None:
    result = phalanx("top", "--once", env=api_env)

    assert result.returncode == 0, result.stderr
    assert "nodes 1: 1 up · spares 0" in result.stdout
    assert "\x1b[" not in result.stdout  # no screen clearing in a single frame


def test_wrong_token_exits_1_and_missing_settings_exit_2(api_env: dict[str, str]) -> None:
    wrong = phalanx("nodes", env={**api_env, "PHALANX_TOKEN": "nope-nope-nope-nope"})
    assert wrong.returncode == 1
    assert "token" in wrong.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    missing = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "nodes"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert missing.returncode == 2
    assert "PHALANX_API" in missing.stderr


def test_agent_serves_healthz_and_prometheus_metrics_with_reasons_as_labels(
    fleet: Fleet, api_env: dict[str, str]
) -> None:
    inject(fleet.sim_file("n01"), 0, "ecc-dbe")
    node = fleet.wait_state("n01", "drain")
    base = f"http://127.0.0.1:{node['http_port']}"

    with urllib.request.urlopen(f"{base}/healthz", timeout=5) as resp:
        health = json.loads(resp.read())
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()

    assert health["status"] == "drain"
    assert (
        'phalanx_health_reason{code="ecc_dbe",gpu="0",node="n01",severity="drain"} 1.0' in metrics
    )
    assert 'phalanx_gpu_ecc_dbe_volatile{gpu="0",node="n01"} 1.0' in metrics
    assert 'phalanx_node_health{node="n01"} 2.0' in metrics
    assert 'phalanx_metrics_batches_dropped_total{node="n01"} 0.0' in metrics
    assert 'phalanx_progress_garbage_total{node="n01"} 0.0' in metrics
    for box in ("rank_events", "landings"):
        assert f'phalanx_outbox_dropped_total{{node="n01",outbox="{box}"}} 0.0' in metrics
        assert f'phalanx_outbox_queued{{node="n01",outbox="{box}"}} 0.0' in metrics


def test_local_fleet_comes_up_reports_its_processes_and_goes_down_leaving_none(
    tmp_path: Path,
) -> None:
    directory = str(tmp_path / "fleet")
    up = phalanx("local", "up", "--nodes", "2", "--gpus-per-node", "2", "--dir", directory)
    try:
        assert up.returncode == 0, up.stderr
        env_lines = phalanx("local", "env", "--dir", directory).stdout
        env = exports(env_lines)
        assert "unset PHALANX_CA" in env_lines.splitlines()  # no TLS: no CA of another fleet
        status = json.loads(phalanx("local", "status", "-o", "json", "--dir", directory).stdout)
        roles = sorted((p["role"], p["node"]) for p in status)
        assert roles == [("agent", "n01"), ("agent", "n02"), ("broker", None), ("supervisor", None)]
        assert all(p["alive"] for p in status)

        injected = phalanx(
            "local",
            "inject",
            "--node",
            "n02",
            "--gpu",
            "1",
            "--fault",
            "xid-79",
            "--dir",
            directory,
        )
        assert injected.returncode == 0, injected.stderr
        nodes = json.loads(phalanx("nodes", "-o", "json", env=env).stdout)
        assert {n["id"] for n in nodes} == {"n01", "n02"}
        # The fleet's RAM tier is a folder of its own, which down removes with what the
        # jobs left in it (the agents free a slot only a while after its job ended).
        shm = fleet_shm_dir(Path(directory))
        agentd_toml = (Path(directory) / "nodes/n01/agentd.toml").read_text()
        assert f'shm_dir = "{shm}"' in agentd_toml
        (shm / "phalanx-j1-r0.slot0").write_bytes(b"a slot a job left")
    finally:
        down = phalanx("local", "down", "--dir", directory)
    assert down.returncode == 0, down.stderr
    assert not shm.exists()
    for p in status:
        assert (
            not Path(f"/proc/{p['pid']}").exists()
            or Path(f"/proc/{p['pid']}/stat").read_text().split(") ", 1)[1][0] == "Z"
        )


def test_local_fleet_runs_on_the_embedded_broker_where_mosquitto_is_missing(
    tmp_path: Path,
) -> None:
    directory = str(tmp_path / "fleet")
    up = phalanx(
        "local",
        "up",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--broker",
        "embedded",
        "--dir",
        directory,
    )
    try:
        assert up.returncode == 0, up.stderr
        status = json.loads(phalanx("local", "status", "-o", "json", "--dir", directory).stdout)
        broker = next(p for p in status if p["role"] == "broker")
        assert "amqtt" in Path(f"/proc/{broker['pid']}/cmdline").read_text()
    finally:
        phalanx("local", "down", "--dir", directory)


def test_local_fleet_with_tls_serves_https_and_local_env_exports_its_ca(tmp_path: Path) -> None:
    directory = tmp_path / "fleet"
    up = phalanx(
        "local", "up", "--tls", "--nodes", "2", "--gpus-per-node", "1", "--dir", str(directory)
    )
    try:
        assert up.returncode == 0, up.stderr
        env = exports(phalanx("local", "env", "--dir", str(directory)).stdout)
        assert env["PHALANX_API"].startswith("https://127.0.0.1:")
        assert env["PHALANX_CA"] == str(directory / "tls" / "ca.pem")
        nodes = phalanx("nodes", "-o", "json", env=env)
        assert nodes.returncode == 0, nodes.stderr
        assert {n["id"] for n in json.loads(nodes.stdout)} == {"n01", "n02"}
        assert (directory / "tls" / "ca.key").stat().st_mode & 0o777 == 0o600
        assert sorted(p.name for p in (directory / "tls").glob("*.pem")) == [
            "ca.pem",
            "n01.pem",
            "n02.pem",
            "supervisor.pem",
        ]
    finally:
        phalanx("local", "down", "--dir", str(directory))


def test_jobs_filters_by_state_and_team_and_pages_newest_first(
    fleet: Fleet, api_env: dict[str, str]
) -> None:
    big = {"nodes": 8, "ranks_per_node": 1, "command": ["true"]}  # more than the fleet: waits
    ids = [fleet.submit(name=f"big{i}", team="ab"[i % 2], **big)["id"] for i in range(7)]
    for job in ids[:5]:
        fleet.client().post(f"/v1/jobs/{job}/cancel")

    first = phalanx("jobs", "--state", "cancelled", "--limit", "2", "-o", "json", env=api_env)
    cursor = first.stderr.split("--before ")[-1].strip()
    rest = phalanx("jobs", "--state", "cancelled", "--before", cursor, "-o", "json", env=api_env)
    team = phalanx("jobs", "--team", "b", "--state", "pending,cancelled", env=api_env)
    bad = phalanx("jobs", "--state", "done", env=api_env)

    assert first.returncode == 0, first.stderr
    assert "phalanx jobs --state cancelled --limit 2 --before " in first.stderr
    got = [j["id"] for j in json.loads(first.stdout)] + [j["id"] for j in json.loads(rest.stdout)]
    assert got == ids[4::-1]  # newest submitted first
    assert rest.returncode == 0 and "more jobs" not in rest.stderr
    assert {line.split()[0] for line in team.stdout.splitlines()[1:]} == set(ids[1::2])
    assert bad.returncode == 2 and "query 'state'" in bad.stderr


def test_submit_wait_ends_with_5_naming_why_when_the_fleet_can_never_hold_the_job(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_supervisor()
    for node in ("n01", "n02"):
        fleet.start_agent(node, gpus=1)
    for node in ("n01", "n02"):
        fleet.wait_state(node, "up")
    spec = tmp_path / "wide.yaml"
    spec.write_text(
        "name: wide\nteam: research\ncommand: [sleep, '4242']\n"
        f"workdir: {tmp_path}\nnodes: 2\nranks_per_node: 2\n"
    )

    done = fleet.cli("submit", str(spec), "--wait", timeout=60)

    assert done.returncode == 5, done.stderr
    job = done.stdout.strip()
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"phalanx: job {job} can never start: needs 2 nodes with 2 ")
    assert last.endswith(
        "the cluster has 0 such nodes; it stays pending until the fleet grows or it is "
        f"cancelled (phalanx cancel {job})"
    )
    assert fleet.job(job)["state"] == "pending"


def leading(url: str) -> bool | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/leader", timeout=5) as resp:
            return bool(json.loads(resp.read())["leading"])
    except OSError:
        return None


def test_a_local_fleet_with_a_standby_supervisor_keeps_its_api_when_the_leader_dies(
    tmp_path: Path, pg_cluster: PgCluster
) -> None:
    directory = str(tmp_path / "fleet")
    refused = phalanx("local", "up", "--standbys", "1", "--dir", directory)
    assert refused.returncode != 0 and "give --store-url postgresql://" in refused.stderr
    up = phalanx(
        "local",
        "up",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--store-url",
        pg_cluster.new_database(),
        "--standbys",
        "1",
        "--dir",
        directory,
    )
    try:
        assert up.returncode == 0, up.stderr
        env = exports(phalanx("local", "env", "--dir", directory).stdout)
        first, second = env["PHALANX_API"].split(",")
        status = json.loads(phalanx("local", "status", "-o", "json", "--dir", directory).stdout)
        supervisors = [p for p in status if p["role"] == "supervisor"]
        assert len(supervisors) == 2 and all(p["alive"] for p in supervisors)
        assert (leading(first), leading(second)) == (True, False)

        os.kill(supervisors[0]["pid"], signal.SIGKILL)  # the leader's host dies

        deadline = time.monotonic() + 30
        while leading(second) is not True:
            assert time.monotonic() < deadline, "the standby did not take the lead"
            time.sleep(0.2)
        nodes = phalanx("nodes", "-o", "json", env=env)  # the CLI passes over the dead one
        assert nodes.returncode == 0, nodes.stderr
        assert [n["id"] for n in json.loads(nodes.stdout)] == ["n01"]
    finally:
        down = phalanx("local", "down", "--dir", directory)
    assert down.returncode == 0, down.stderr
