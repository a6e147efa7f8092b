"""Fixtures of the rollout tests.

``fleet_tree``: the roles converged once (site.yml) into a temporary root per host.
``rendered_broker``: a real Mosquitto running the broker role's rendered configuration.
``live_fleet``: the supervisor and an agent with the configurations the roles rendered,
connected to ``rendered_broker`` over TLS.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.client import Client
from phalanx.local import find_mosquitto, free_port
from tests.rollout.notify_socket import NotifySocket
from tests.rollout.rollout_env import (
    API_TOKEN,
    Daemon,
    FleetTree,
    LiveFleet,
    listening,
    make_pki,
    recap,
    tail,
    wait_until,
    write_inventory,
)


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    s = NotifySocket(str(tmp_path / "notify.sock"))
    yield s
    s.close()


@pytest.fixture(scope="session")
def fleet_tree(tmp_path_factory: pytest.TempPathFactory) -> FleetTree:
    root = tmp_path_factory.mktemp("rollout")
    pki = make_pki(root / "pki")
    ports = free_port(), free_port(), free_port()
    inventory = root / "hosts.yml"
    write_inventory(
        inventory,
        root / "hosts",
        pki,
        broker_port=ports[0],
        api_port=ports[1],
        agent_http_port=ports[2],
    )
    tree = FleetTree(
        root,
        inventory,
        root / "ansible-home",
        root / "build",
        pki,
        *ports,
        first=subprocess.CompletedProcess([], 0),
    )
    tree.first = tree.converge()
    assert tree.first.returncode == 0, tail(tree.first.stdout + tree.first.stderr)
    assert set(recap(tree.first.stdout)) == {"localhost", "broker1", "sup1", "gpu-a01"}
    return tree


@pytest.fixture(scope="session")
def rendered_broker(fleet_tree: FleetTree) -> Iterator[Daemon]:
    mosquitto = find_mosquitto()
    if mosquitto is None:
        raise RuntimeError("these tests need Mosquitto: apt-get install -y mosquitto")
    conf = fleet_tree.host("broker1") / "etc/mosquitto/conf.d/phalanx.conf"
    broker = Daemon([mosquitto, "-c", str(conf)], fleet_tree.root / "mosquitto.log")
    wait_until(lambda: listening(fleet_tree.broker_port), 10, "the rendered broker", broker)
    time.sleep(0.3)  # a second listener that cannot bind would end it right after the first
    wait_until(lambda: True, 1, "the rendered broker", broker)
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def live_fleet(fleet_tree: FleetTree, rendered_broker: Daemon) -> Iterator[LiveFleet]:
    sup, node = fleet_tree.host("sup1"), fleet_tree.host("gpu-a01")
    # The daemons run from this interpreter with the configurations the roles rendered (the
    # installed virtual environments are checked apart: test_converge.py). The inventory marks
    # gpu-a02 a hot spare (supervisor.toml says spares = 1) but only gpu-a01 runs here, so no
    # spare is held back, or gpu-a01 would never get a job.
    supervisor = Daemon(
        [
            sys.executable,
            "-m",
            "supervisor",
            "--config",
            str(sup / "etc/phalanx/supervisor.toml"),
            "--spares",
            "0",
        ],
        fleet_tree.root / "supervisor.log",
    )
    agent = Daemon(
        [sys.executable, "-m", "agentd", "--config", str(node / "etc/phalanx/agentd.toml")],
        fleet_tree.root / "agent.log",
    )
    client = Client(
        f"https://127.0.0.1:{fleet_tree.api_port}", API_TOKEN, timeout=5, ca_file=fleet_tree.pki.ca
    )
    fleet = LiveFleet(supervisor, agent, client)
    try:
        wait_until(
            lambda: client.get("/v1/nodes/gpu-a01")["state"] == "up",
            60,
            "gpu-a01 up at the supervisor",
            supervisor,
            agent,
        )
        yield fleet
    finally:
        agent.stop()
        supervisor.stop()
