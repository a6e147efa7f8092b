"""The agent's settings: the address it advertises to the supervisor, its peers and ranks."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

from agentd.config import AgentSettings
from phalanx.settings import MqttSettings


def outside_address() -> str:
    """An address of this host that is not loopback (the broker's, in these tests)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    raise AssertionError("this host has no IPv4 address besides loopback")


def settings(tmp_path: Path, broker: str, address: str = "") -> AgentSettings:
    return AgentSettings(
        node_id="n1", data_dir=tmp_path, address=address, mqtt=MqttSettings(host=broker)
    )


def test_a_configured_address_is_advertised_as_it_is(tmp_path: Path) -> None:
    assert settings(tmp_path, "127.0.0.1", "10.1.2.3").advertised_address() == "10.1.2.3"


def test_a_host_name_on_loopback_advertises_the_address_that_reaches_the_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "gethostbyname", lambda _name: "127.0.1.1")  # Debian's /etc/hosts
    broker = outside_address()

    assert settings(tmp_path, broker).advertised_address() == broker


def test_a_local_fleet_on_loopback_advertises_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "gethostbyname", lambda _name: "127.0.1.1")

    assert settings(tmp_path, "127.0.0.1").advertised_address() == "127.0.1.1"


def test_a_host_name_with_a_real_address_advertises_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "gethostbyname", lambda _name: "10.9.8.7")

    assert settings(tmp_path, outside_address()).advertised_address() == "10.9.8.7"
