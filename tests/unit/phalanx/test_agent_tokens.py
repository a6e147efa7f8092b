"""The per-node agent tokens: derived from the fleet secret, one per node, printed by
``phalanx agent-token`` for the Ansible role, and a fleet secret too short or unreadable
is refused naming the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx.cli.commands as cli
from phalanx.agent_tokens import AgentKeys, node_token, peer_credential
from phalanx.local import free_port

SECRET = "fleet-agent-secret-0123456789abcdef"


def test_each_node_gets_its_own_token_and_each_pair_its_own_credential() -> None:
    tokens = {node_token(SECRET, n) for n in ("n01", "n02", "n03")}
    credentials = {
        peer_credential(node_token(SECRET, holder), peer)
        for holder in ("n01", "n02", "n03")
        for peer in ("n01", "n02", "n03")
    }

    assert len(tokens) == 3 and len(credentials) == 9
    assert not tokens & credentials
    assert node_token("another-fleet-secret-0123456789", "n01") not in tokens


def test_the_supervisors_keys_hide_the_secret_in_their_repr() -> None:
    keys = AgentKeys(SECRET)

    assert SECRET not in repr(keys) and keys.node_token("n01") not in repr(keys)
    assert AgentKeys("").peer_credential("n01", "n02") is None


def test_a_node_id_that_is_no_node_id_is_refused() -> None:
    with pytest.raises(ValueError, match="invalid node id"):
        node_token(SECRET, "../n01")


def test_phalanx_agent_token_prints_the_nodes_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "agent-secret"
    secret.write_text(SECRET + "\n")

    code = cli.main(["agent-token", "--secret-file", str(secret), "gpu-a17"])

    assert code == 0
    assert capsys.readouterr().out == node_token(SECRET, "gpu-a17") + "\n"


@pytest.mark.parametrize(
    ("content", "says"), [(None, "cannot read"), ("short-secret", "under 16 characters")]
)
def test_phalanx_agent_token_refuses_an_unusable_secret_naming_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, says: str
) -> None:
    secret = tmp_path / "agent-secret"
    if content is not None:
        secret.write_text(content)

    code = cli.main(["agent-token", "--secret-file", str(secret), "n01"])

    err = capsys.readouterr().err
    assert code == 2
    assert says in err and str(secret) in err


def test_the_supervisor_refuses_a_fleet_secret_under_16_characters_with_exit_2(
    tmp_path: Path,
) -> None:
    (tmp_path / "api-token").write_text("api-token-0123456789abcdef")
    (tmp_path / "agent-secret").write_text("short")
    conf = tmp_path / "supervisor.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'agent_token_file = "{tmp_path / "agent-secret"}"\n'
        f"[mqtt]\nport = {free_port()}\n"
        f'[api]\nport = 0\ntoken_file = "{tmp_path / "api-token"}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_SUPERVISOR_")}

    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "--config", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )

    assert done.returncode == 2, done.stderr
    assert "agent_token_file" in done.stderr and "under 16 characters" in done.stderr
