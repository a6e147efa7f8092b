"""site.yml converged for real into a temporary root per host, then again (idempotence)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

import agentd.config
import supervisor.config
from phalanx.agent_tokens import node_token
from phalanx.settings import MqttSettings
from tests.rollout.rollout_env import (
    AGENT_HTTP_TOKEN,
    NODE_PASSWORDS,
    OBJECT_STORE,
    OBJECT_STORE_ENV,
    FleetTree,
    recap,
    tail,
)

pytestmark = [pytest.mark.rollout, pytest.mark.integration]


def test_agent_role_installs_phalanx_agentd_into_its_own_venv(fleet_tree: FleetTree) -> None:
    venv = fleet_tree.host("gpu-a01") / "opt/phalanx/venv"

    assert (venv / "bin/phalanx-agentd").is_file()
    assert list((venv / "lib").glob("python3*/site-packages/agentd/daemon.py"))


def test_supervisor_role_installs_phalanx_supervisor_into_its_own_venv(
    fleet_tree: FleetTree,
) -> None:
    venv = fleet_tree.host("sup1") / "opt/phalanx-supervisor/venv"

    assert (venv / "bin/phalanx-supervisor").is_file()


@pytest.mark.parametrize(
    ("host", "venv", "module"),
    [
        ("gpu-a01", "opt/phalanx/venv", "agentd.__main__"),
        ("sup1", "opt/phalanx-supervisor/venv", "supervisor.__main__"),
    ],
)
def test_installed_venv_has_everything_its_daemon_imports(
    fleet_tree: FleetTree, host: str, venv: str, module: str
) -> None:
    python = fleet_tree.host(host) / venv / "bin/python"

    # -I: only the venv's own site-packages, not this checkout (the working directory).
    result = subprocess.run(
        [str(python), "-I", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=fleet_tree.root,
    )

    assert result.returncode == 0, result.stderr[-2000:]


def test_a_second_converge_changes_nothing(fleet_tree: FleetTree) -> None:
    second = fleet_tree.converge()

    assert second.returncode == 0, tail(second.stdout + second.stderr)
    changed = {host: counts["changed"] for host, counts in recap(second.stdout).items()}
    assert changed == {"localhost": 0, "broker1": 0, "sup1": 0, "gpu-a01": 0}, tail(second.stdout)


def test_rendered_agentd_toml_is_accepted_by_the_agents_loader(
    fleet_tree: FleetTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_daemon_environment(monkeypatch)
    etc = fleet_tree.host("gpu-a01") / "etc/phalanx"

    settings = agentd.config.load(["--config", str(etc / "agentd.toml")])

    assert (settings.node_id, settings.rack, settings.nvlink_domain, settings.gpu.backend) == (
        "gpu-a01",
        "r1",
        "nvl72-1",
        "sim",
    )
    assert (settings.mqtt.host, settings.mqtt.port, settings.mqtt.tls, settings.mqtt.username) == (
        "127.0.0.1",
        fleet_tree.broker_port,
        True,
        "gpu-a01",
    )
    assert settings.mqtt.ca_file == etc / "ca.pem"
    http = settings.http
    assert (http.tls_cert_file, http.tls_key_file, http.tls_ca_file) == (
        etc / "http.pem",
        etc / "http.key",
        etc / "http-ca.pem",
    )
    assert (etc / "http.pem").read_bytes() == fleet_tree.pki.http["gpu-a01"].cert.read_bytes()
    assert settings.data_dir == fleet_tree.host("gpu-a01") / "var/lib/phalanx"
    assert settings.ckpt.object_store == OBJECT_STORE
    assert _password(settings.mqtt) == NODE_PASSWORDS["gpu-a01"]


def test_rendered_supervisor_toml_is_accepted_by_the_supervisors_loader(
    fleet_tree: FleetTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_daemon_environment(monkeypatch)
    etc = fleet_tree.host("sup1") / "etc/phalanx"

    settings = supervisor.config.load(["--config", str(etc / "supervisor.toml")])

    assert (settings.mqtt.username, settings.mqtt.tls, settings.api.port) == (
        "phalanx-supervisor",
        True,
        fleet_tree.api_port,
    )
    assert settings.api_token() == "rollout-test-token-0123456789"
    assert (settings.api.tls_cert_file, settings.api.tls_key_file) == (
        etc / "http.pem",
        etc / "http.key",
    )
    assert (settings.agent_tls, settings.agent_ca_file) == (True, etc / "http-ca.pem")
    assert settings.state_dir == fleet_tree.host("sup1") / "var/lib/phalanx-supervisor"


def test_supervisor_holds_back_as_many_spares_as_the_inventory_marks(
    fleet_tree: FleetTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_daemon_environment(monkeypatch)
    conf = fleet_tree.host("sup1") / "etc/phalanx/supervisor.toml"

    assert supervisor.config.load(["--config", str(conf)]).spares == 1  # gpu-a02


@pytest.mark.parametrize(
    "path",
    [
        "gpu-a01/etc/phalanx/agentd-mqtt-password",
        "gpu-a01/etc/phalanx/agent-http-token",
        "gpu-a01/etc/phalanx/agentd.toml",
        "gpu-a01/etc/phalanx/http.key",
        "sup1/etc/phalanx/http.key",
        "sup1/etc/phalanx/supervisor-mqtt-password",
        "sup1/etc/phalanx/api-token",
        "sup1/etc/phalanx/agent-http-token",
        "broker1/etc/mosquitto/phalanx/server.key",
        "broker1/etc/mosquitto/phalanx/passwd",
        "broker1/etc/mosquitto/phalanx/acl",
    ],
)
def test_secrets_are_unreadable_by_other_users(fleet_tree: FleetTree, path: str) -> None:
    mode = stat.S_IMODE((fleet_tree.root / "hosts" / path).stat().st_mode)

    assert mode & 0o007 == 0, f"{path} has mode {mode:o}"


def test_an_agent_gets_its_own_derived_token_and_the_fleet_secret_stays_on_the_supervisor(
    fleet_tree: FleetTree,
) -> None:
    agent = fleet_tree.host("gpu-a01")
    sup = fleet_tree.host("sup1")

    installed = (agent / "etc/phalanx/agent-http-token").read_text().strip()

    assert installed == node_token(AGENT_HTTP_TOKEN, "gpu-a01")
    assert (sup / "etc/phalanx/agent-http-token").read_text().strip() == AGENT_HTTP_TOKEN
    assert [
        str(p)
        for p in agent.rglob("*")
        if p.is_file() and "venv" not in p.parts and AGENT_HTTP_TOKEN.encode() in p.read_bytes()
    ] == []


def test_the_object_stores_environment_is_a_secret_file_the_agents_unit_reads(
    fleet_tree: FleetTree,
) -> None:
    host = fleet_tree.host("gpu-a01")
    env = host / "etc/phalanx/agentd-object-store.env"
    unit = (host / "etc/systemd/system/phalanx-agentd.service").read_text()

    assert stat.S_IMODE(env.stat().st_mode) == 0o640
    lines = [line for line in env.read_text().splitlines() if line]
    assert lines == [f"{k}={v}" for k, v in sorted(OBJECT_STORE_ENV.items())]
    assert f"EnvironmentFile=-{env}\n" in unit


def test_password_file_holds_one_user_per_node_and_the_supervisor(fleet_tree: FleetTree) -> None:
    passwd = fleet_tree.host("broker1") / "etc/mosquitto/phalanx/passwd"

    users = [line.split(":", 1)[0] for line in passwd.read_text().splitlines()]

    assert users == ["gpu-a01", "gpu-a02", "phalanx-supervisor"]


def test_no_secret_lands_in_a_file_in_clear_except_the_secret_files(fleet_tree: FleetTree) -> None:
    secret_files = {
        "agentd-mqtt-password",
        "agent-http-token",
        "supervisor-mqtt-password",
        "api-token",
        "agentd-object-store.env",
    }
    leaks = [
        str(p)
        for p in (fleet_tree.root / "hosts").rglob("*")
        if p.is_file()
        and p.name not in secret_files
        and "venv" not in p.parts
        and any(
            s.encode() in p.read_bytes()
            for s in [*NODE_PASSWORDS.values(), OBJECT_STORE_ENV["AWS_SECRET_ACCESS_KEY"]]
        )
    ]

    assert leaks == []


def _no_daemon_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("PHALANX_AGENTD_", "PHALANX_SUPERVISOR_")):
            monkeypatch.delenv(key)


def _password(mqtt: MqttSettings) -> str:
    secret = mqtt.resolved().password
    assert secret is not None
    return secret.get_secret_value()


def test_wheel_is_built_once_and_reused(fleet_tree: FleetTree) -> None:
    wheels = sorted(p.name for p in Path(fleet_tree.build_dir).glob("*.whl"))

    assert wheels == ["phalanx-0.1.0-py3-none-any.whl"]


def test_wheel_build_leaves_no_temporary_directory(fleet_tree: FleetTree) -> None:
    assert list((fleet_tree.ansible_home / "tmp-files").glob("*phalanx-wheel*")) == []
