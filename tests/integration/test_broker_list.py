"""A fleet on two brokers (``mqtt.brokers``) whose broker dies: the agents move to the
other, the supervisor (on both all along) hears them there, and the job trains on.

Real processes throughout: two Mosquittos, a supervisor, two agents running tinylm on gloo.
The broker the fleet is on is killed (``kill -9``) mid-job; the job must keep its
generation, commit its steps through the other broker and end with the undisturbed
run's digest (``training``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Broker, CuttableLink, Fleet, wait_for
from tests.integration.training import (
    committed_step,
    final_digest,
    submit,
    undisturbed_digest,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def second_broker(tmp_path: Path) -> Iterator[Broker]:
    directory = tmp_path / "broker-b"
    directory.mkdir()
    b = Broker(directory).start()
    yield b
    b.stop()


def test_the_fleet_moves_to_the_second_broker_when_its_broker_dies_and_no_job_fails(
    fleet: Fleet, second_broker: Broker
) -> None:
    a, b = fleet.broker, second_broker
    brokers = f'brokers = ["127.0.0.1:{a.port}", "127.0.0.1:{b.port}"]\n'
    fleet.start_supervisor(mqtt=brokers)
    both = {f"127.0.0.1:{a.port}": True, f"127.0.0.1:{b.port}": True}
    # The API serves before every link is up: wait for both.
    wait_for(
        lambda: fleet.client().get("/healthz")["mqtt_brokers"] == both or None,
        30,
        "the supervisor on both brokers",
    )
    fleet.start_nodes(2, mqtt=brokers)
    for node in ("n01", "n02"):  # the first listed
        assert f"connected to MQTT broker 127.0.0.1:{a.port}" in fleet.agents[node].output()

    job = submit(fleet, "brokers")
    fleet.wait_job(job, "running", timeout=60)
    before = wait_for(lambda: committed_step(fleet, job, 20, tier="ram"), 90, "step 20")
    generation = fleet.job(job)["generation"]

    assert a.process is not None
    a.process.kill9()  # the broker every agent is on
    killed = time.monotonic()
    for node in ("n01", "n02"):
        wait_for(
            lambda n=node: (
                f"connected to MQTT broker 127.0.0.1:{b.port}" in fleet.agents[n].output()
            ),
            30,
            f"{node} on the second broker",
        )
    moved_s = time.monotonic() - killed
    # The steps saved through the second broker are committed, by the same generation.
    wait_for(lambda: committed_step(fleet, job, before + 40, tier="ram"), 90, "commits via b")
    view = fleet.job(job)
    assert view["generation"] == generation and view["restarts"] == 0, view
    health = fleet.client().get("/healthz")
    assert health["mqtt_brokers"] == {f"127.0.0.1:{a.port}": False, f"127.0.0.1:{b.port}": True}
    nodes = {n["id"]: n["state"] for n in fleet.client().get("/v1/nodes")}
    assert nodes == {"n01": "up", "n02": "up"}, nodes

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert done["restarts"] == 0
    assert final_digest(fleet, done) == undisturbed_digest()
    events = fleet.client().get("/v1/events?limit=5000")
    offline = [
        e
        for e in events
        if e["kind"] == "ranks_lost"
        or (e["kind"] == "state_changed" and e["detail"]["state"] == "offline")
    ]
    assert not offline, offline
    print(json.dumps({"moved_s": round(moved_s, 2)}))


def test_the_agents_follow_the_supervisor_when_it_loses_their_broker(
    fleet: Fleet, second_broker: Broker
) -> None:
    """Only the supervisor loses broker a (its path to it is cut); the agents still reach
    it. The supervisor's will tells them it is gone from there: they move on to b, where
    it is, and no node is taken for lost."""
    a, b = fleet.broker, second_broker
    relay = CuttableLink(a.port)  # the supervisor's path to a
    try:
        fleet.start_supervisor(mqtt=f'brokers = ["127.0.0.1:{relay.port}", "127.0.0.1:{b.port}"]\n')
        fleet.start_nodes(2, mqtt=f'brokers = ["127.0.0.1:{a.port}", "127.0.0.1:{b.port}"]\n')
        job = submit(fleet, "follow")
        fleet.wait_job(job, "running", timeout=60)
        before = wait_for(lambda: committed_step(fleet, job, 20, tier="ram"), 90, "step 20")

        relay.close()  # the supervisor is cut off from a, for good
        for node in ("n01", "n02"):
            wait_for(
                lambda n=node: (
                    f"connected to MQTT broker 127.0.0.1:{b.port}" in fleet.agents[n].output()
                ),
                30,
                f"{node} on the second broker",
            )
            assert "the supervisor went offline on this broker" in fleet.agents[node].output()
        wait_for(lambda: committed_step(fleet, job, before + 40, tier="ram"), 90, "commits via b")
        done = fleet.wait_job(job, "succeeded", timeout=180)
        assert done["restarts"] == 0
    finally:
        relay.close()
    events = fleet.client().get("/v1/events?limit=5000")
    offline = [
        e
        for e in events
        if e["kind"] == "ranks_lost"
        or (e["kind"] == "state_changed" and e["detail"]["state"] == "offline")
    ]
    assert not offline, offline
