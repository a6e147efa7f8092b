"""Fault detection end to end: real broker, real daemons, real signals."""

from __future__ import annotations

import signal

import pytest

from phalanx.client import ApiError
from phalanx.simgpu import inject
from tests.harness import CuttableLink, Fleet, wait_for

pytestmark = pytest.mark.integration


def test_agent_killed_with_sigkill_goes_offline_through_its_last_will(fleet: Fleet) -> None:
    # The heartbeat timeout is far away, so only the will can explain "offline".
    fleet.start_supervisor(offline_after_s=120)
    agent = fleet.start_agent("n01")
    fleet.wait_state("n01", "up")

    agent.kill9()

    node = fleet.wait_state("n01", "offline", timeout=15)
    assert node["offline_cause"] == "last will"


def test_agent_stopped_cleanly_goes_offline_at_once_with_shutdown_cause(fleet: Fleet) -> None:
    fleet.start_supervisor(offline_after_s=120)
    agent = fleet.start_agent("n01")
    fleet.wait_state("n01", "up")

    assert agent.stop() == 0

    node = fleet.wait_state("n01", "offline", timeout=5)
    assert node["offline_cause"] == "clean shutdown"


def test_node_whose_link_is_cut_goes_offline_after_the_timeout_and_returns_when_healed(
    fleet: Fleet,
) -> None:
    fleet.start_supervisor(offline_after_s=2.0)
    link = CuttableLink(fleet.broker.port)
    fleet.links.append(link)
    # A long keepalive: the broker cannot notice the partition, so no will is sent.
    fleet.start_agent("n01", via=link, keepalive_s=120, heartbeat_s=0.5)
    fleet.wait_state("n01", "up")

    link.cut()
    node = fleet.wait_state("n01", "offline", timeout=10)
    assert node["offline_cause"].startswith("no heartbeat for")

    link.heal()
    fleet.wait_state("n01", "up", timeout=10)


def test_broker_restart_is_survived_by_both_daemons_which_reconnect_and_rebirth(
    fleet: Fleet,
) -> None:
    fleet.start_supervisor(offline_after_s=30)
    fleet.start_agent("n01")
    first = fleet.wait_state("n01", "up")

    fleet.broker.stop()
    fleet.broker.start()  # same port, no persistence: retained births are gone

    def reborn() -> dict[str, object] | None:
        view = fleet.node("n01")
        return view if view["birth_seq"] > first["birth_seq"] and view["state"] == "up" else None

    wait_for(reborn, 20, "n01 to publish a new birth after the broker restart")
    stats = fleet.client().get("/v1/stats")
    assert stats["mqtt_connects"] >= 2
    assert fleet.supervisor is not None and fleet.supervisor.alive()
    assert fleet.agents["n01"].alive()


def test_supervisor_restart_keeps_operator_and_automatic_drains(fleet: Fleet) -> None:
    sup = fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.start_agent("n02")
    fleet.wait_state("n01", "up")
    fleet.wait_state("n02", "up")
    fleet.client().post("/v1/nodes/n01/drain", {"reason": "bad cable, ticket 42"})
    inject(fleet.sim_file("n02"), 0, "ecc-dbe")
    fleet.wait_state("n02", "drain")

    assert sup.stop() == 0
    fleet.start_supervisor()

    n01 = fleet.wait_state("n01", "drain")
    n02 = fleet.wait_state("n02", "drain")
    assert n01["drain"]["by"] == "operator"
    assert n01["drain"]["reason"] == "bad cable, ticket 42"
    assert n02["drain"]["by"] == "auto"
    assert "ecc_dbe" in n02["drain"]["codes"]


def test_automatic_drain_is_not_lifted_when_the_fault_clears(fleet: Fleet) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01", extra="")
    fleet.wait_state("n01", "up")
    inject(fleet.sim_file("n01"), 0, "row-remap-pending")
    fleet.wait_state("n01", "warn")
    inject(fleet.sim_file("n01"), 0, "gpu-lost")
    fleet.wait_state("n01", "drain")

    inject(fleet.sim_file("n01"), 0, "clear")
    wait_for(lambda: fleet.node("n01")["health"] == "ok", 10, "n01's health to recover")

    assert fleet.node("n01")["state"] == "drain"
    undrained = fleet.client().post("/v1/nodes/n01/undrain")
    assert undrained["state"] == "up"


def test_undrain_is_refused_while_the_node_still_reports_a_drain_reason(fleet: Fleet) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.wait_state("n01", "up")
    inject(fleet.sim_file("n01"), 0, "ecc-dbe")
    fleet.wait_state("n01", "drain")

    with pytest.raises(ApiError) as refused:
        fleet.client().post("/v1/nodes/n01/undrain")

    assert refused.value.status == 409
    assert "ecc_dbe" in str(refused.value)


def test_hung_agent_goes_offline_by_timeout_and_comes_back_when_resumed(fleet: Fleet) -> None:
    fleet.start_supervisor(offline_after_s=2.0)
    agent = fleet.start_agent("n01", keepalive_s=120, heartbeat_s=0.5)
    fleet.wait_state("n01", "up")

    agent.signal(signal.SIGSTOP)
    fleet.wait_state("n01", "offline", timeout=10)
    agent.signal(signal.SIGCONT)

    fleet.wait_state("n01", "up", timeout=10)
