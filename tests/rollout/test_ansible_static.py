"""The Ansible tree lints clean and every playbook parses."""

from __future__ import annotations

import subprocess

import pytest

import phalanx.wire
from tests.rollout.rollout_env import ANSIBLE, ansible_env, tail, tool

pytestmark = pytest.mark.rollout

PLAYBOOKS = sorted(p.name for p in ANSIBLE.glob("*.yml"))


def test_ansible_lint_passes_the_production_profile(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    home = tmp_path_factory.mktemp("ansible-lint")
    env = ansible_env(home) | {"XDG_CACHE_HOME": str(home / "cache")}

    result = subprocess.run(
        [tool("ansible-lint"), "--nocolor"],
        cwd=ANSIBLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert result.returncode == 0, tail(result.stdout + result.stderr)


def test_every_playbook_is_found() -> None:
    assert PLAYBOOKS == ["rolling-upgrade.yml", "site.yml", "wheel.yml"]


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbook_passes_syntax_check(
    playbook: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    home = tmp_path_factory.mktemp("syntax")

    result = subprocess.run(
        [tool("ansible-playbook"), "--syntax-check", "-i", "inventory/example/hosts.yml", playbook],
        cwd=ANSIBLE,
        env=ansible_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, tail(result.stdout + result.stderr)


def test_acl_lets_a_node_publish_every_node_topic_of_the_wire_contract_but_cmd() -> None:
    import yaml

    defaults = yaml.safe_load((ANSIBLE / "roles/broker/defaults/main.yml").read_text())
    kinds = set(phalanx.wire.NODE_TOPIC_KINDS) - {"cmd"}

    assert set(defaults["phalanx_broker_node_publish_topics"]) == kinds
