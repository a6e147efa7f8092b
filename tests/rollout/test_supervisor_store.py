"""The supervisor role's store settings (issue 26): SQLite for one supervisor, or a shared
PostgreSQL for several (one leads, the others stand by). The role's own store tasks and
templates, applied by ansible-playbook to a staging tree for two supervisor hosts, and
the rendered supervisor.toml read back by the supervisor's loader."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import supervisor.config
from tests.rollout.rollout_env import run_playbook, tail

pytestmark = pytest.mark.rollout

URL = "postgresql://phalanx@db1.cluster.internal:5432/phalanx"
PASSWORD = "s3cr:et\\pw"  # a colon and a backslash, which pgpass escapes

# The role's configuration tasks (its store, supervisor.toml, the unit), as site.yml runs
# them on each supervisor host, without the installation around them.
PLAYBOOK = """
- name: The supervisor role's configuration
  hosts: supervisors
  gather_facts: false
  tasks:
    - name: Its store, supervisor.toml and unit
      ansible.builtin.include_role:
        name: supervisor
        tasks_from: config.yml
"""


def converge(tmp_path: Path, **common: Any) -> subprocess.CompletedProcess[str]:
    hosts = {
        name: {"phalanx_root": str(tmp_path / name), "phalanx_supervisor_api_port": 8740}
        for name in ("sup-a", "sup-b")
    }
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "phalanx_broker_host": "mqtt.cluster.internal",
                "phalanx_http_tls": False,
                **common,
            },
            "children": {"supervisors": {"hosts": hosts}},
        }
    }
    for name in hosts:  # what the role's main.yml creates before
        (tmp_path / name / "etc/phalanx").mkdir(parents=True)
        (tmp_path / name / "etc/systemd/system").mkdir(parents=True)
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    return run_playbook(str(tmp_path / "play.yml"), tmp_path / "hosts.yml", tmp_path / "home")


def test_two_supervisors_share_the_postgresql_store_each_naming_its_own_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in list(os.environ):
        if key.startswith("PHALANX_SUPERVISOR_"):
            monkeypatch.delenv(key)
    ran = converge(
        tmp_path,
        phalanx_supervisor_store_url=URL,
        phalanx_supervisor_store_password=PASSWORD,
        phalanx_supervisor_api_host="0.0.0.0",
    )
    assert ran.returncode == 0, tail(ran.stdout)

    for host in ("sup-a", "sup-b"):
        etc = tmp_path / host / "etc/phalanx"
        settings = supervisor.config.load(["--config", str(etc / "supervisor.toml")])
        assert settings.store.url == URL
        assert settings.ha.api_url == f"http://{host}:8740"
        assert (settings.ha.lease_s, settings.ha.poll_s) == (4.0, 1.0)
        pgpass = etc / "pgpass"
        assert pgpass.read_text() == "*:*:*:*:s3cr\\:et\\\\pw\n"
        assert stat.S_IMODE(pgpass.stat().st_mode) == 0o600
        unit = (tmp_path / host / "etc/systemd/system/phalanx-supervisor.service").read_text()
        assert f"Environment=PGPASSFILE={etc}/pgpass" in unit
        assert PASSWORD not in (etc / "supervisor.toml").read_text() + unit


def test_two_supervisors_on_sqlite_are_refused(tmp_path: Path) -> None:
    # Each would run the fleet alone from its own SQLite file.
    ran = converge(tmp_path)
    assert ran.returncode != 0
    assert "several supervisors need a shared PostgreSQL store" in ran.stdout


def test_a_password_in_the_stores_url_is_refused(tmp_path: Path) -> None:
    ran = converge(
        tmp_path, phalanx_supervisor_store_url="postgresql://phalanx:hunter2@db1/phalanx"
    )
    assert ran.returncode != 0
    assert "keep its password out of it" in ran.stdout


def test_standbys_whose_api_listens_on_loopback_only_are_refused(tmp_path: Path) -> None:
    # A standby would send clients to this host's api_url, where nothing listens.
    ran = converge(tmp_path, phalanx_supervisor_store_url=URL)
    assert ran.returncode != 0
    assert "bind the API where clients reach it" in ran.stdout


def test_failover_brokers_make_the_supervisors_broker_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in list(os.environ):
        if key.startswith("PHALANX_SUPERVISOR_"):
            monkeypatch.delenv(key)
    ran = converge(
        tmp_path,
        phalanx_supervisor_store_url=URL,
        phalanx_supervisor_store_password=PASSWORD,
        phalanx_supervisor_api_host="0.0.0.0",
        phalanx_broker_failover_hosts=["mqtt2.cluster.internal", "mqtt3.cluster.internal:1884"],
    )
    assert ran.returncode == 0, tail(ran.stdout)

    conf = tmp_path / "sup-a/etc/phalanx/supervisor.toml"
    settings = supervisor.config.load(["--config", str(conf)])
    assert settings.mqtt.endpoints() == [
        ("mqtt.cluster.internal", 8883),
        ("mqtt2.cluster.internal", 8883),
        ("mqtt3.cluster.internal", 1884),
    ]
