"""The broker role's rendered config, password file and ACL, in a real Mosquitto over TLS."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest

from phalanx import wire
from tests.rollout.mqtt_probe import BAD_USER_NAME_OR_PASSWORD, NOT_AUTHORIZED, SUCCESS, Probe
from tests.rollout.rollout_env import NODE_PASSWORDS, SUPERVISOR_PASSWORD, Daemon, FleetTree

pytestmark = [pytest.mark.rollout, pytest.mark.integration]

NODE_KINDS = sorted(set(wire.NODE_TOPIC_KINDS) - {"cmd"})


@pytest.fixture
def probes(fleet_tree: FleetTree, rendered_broker: Daemon) -> Iterator[ProbeMaker]:
    maker = ProbeMaker(fleet_tree)
    yield maker
    maker.close()


class ProbeMaker:
    def __init__(self, tree: FleetTree) -> None:
        self.tree = tree
        self.made: list[Probe] = []

    def raw(
        self,
        user: str | None,
        password: str | None,
        *,
        tls: bool = True,
        client_id: str = "",
        will: tuple[str, bytes] | None = None,
    ) -> Probe:
        probe = Probe(
            self.tree.broker_port,
            user,
            password,
            ca=self.tree.pki.ca if tls else None,
            client_id=client_id,
            will=will,
        )
        self.made.append(probe)
        return probe

    def node(self, node: str, client_id: str = "") -> Probe:
        probe = self.raw(node, NODE_PASSWORDS[node], client_id=client_id)
        assert probe.connect() == SUCCESS
        return probe

    def supervisor(self) -> Probe:
        probe = self.raw("phalanx-supervisor", SUPERVISOR_PASSWORD)
        assert probe.connect() == SUCCESS
        return probe

    def close(self) -> None:
        for probe in self.made:
            with contextlib.suppress(Exception):
                probe.close()


def _marker() -> bytes:
    return uuid.uuid4().hex.encode()


@pytest.mark.parametrize("kind", NODE_KINDS)
def test_node_publishes_its_own_topic_to_the_supervisor(probes: ProbeMaker, kind: str) -> None:
    supervisor, node = probes.supervisor(), probes.node("gpu-a01")
    assert supervisor.subscribe("phalanx/v1/node/+/" + kind) == 1
    payload = _marker()

    assert node.publish(f"phalanx/v1/node/gpu-a01/{kind}", payload) == SUCCESS
    supervisor.wait_message(f"phalanx/v1/node/gpu-a01/{kind}", payload)


@pytest.mark.parametrize(
    "topic",
    [f"phalanx/v1/node/gpu-a02/{kind}" for kind in NODE_KINDS]
    + ["phalanx/v1/job/job-1/ckpt/gpu-a02", "phalanx/v1/job/job-1/ckpt/gpu-a01"],
)
def test_node_publishing_into_another_nodes_topics_is_refused_and_never_delivered(
    probes: ProbeMaker, topic: str
) -> None:
    # A forged birth, heartbeat, death, rank event or landing of gpu-a02, or a checkpoint
    # catalog (the supervisor's, even the one for gpu-a01 itself).
    supervisor, node = probes.supervisor(), probes.node("gpu-a01")
    assert supervisor.subscribe("phalanx/v1/#") == 1
    forged, own = _marker(), _marker()

    refused = node.publish(topic, forged)
    assert node.publish("phalanx/v1/node/gpu-a01/heartbeat", own) == SUCCESS
    # Messages of one client arrive in order: once the later one is in, the forged one never is.
    supervisor.wait_message("phalanx/v1/node/gpu-a01/heartbeat", own)

    assert refused == NOT_AUTHORIZED
    assert supervisor.received(topic) == []


def test_node_whose_last_will_names_another_nodes_death_never_gets_it_delivered(
    probes: ProbeMaker,
) -> None:
    # The agent's will is its death topic, which the broker publishes on its behalf: one
    # naming gpu-a02's would declare a healthy node dead.
    supervisor = probes.supervisor()
    assert supervisor.subscribe("phalanx/v1/node/#") == 1
    forger = probes.raw(
        "gpu-a01", NODE_PASSWORDS["gpu-a01"], will=("phalanx/v1/node/gpu-a02/death", _marker())
    )
    honest = probes.raw(
        "gpu-a01",
        NODE_PASSWORDS["gpu-a01"],
        client_id="honest",
        will=("phalanx/v1/node/gpu-a01/death", will := _marker()),
    )

    connack = forger.connect()
    if connack == SUCCESS:  # else the broker refused the will at CONNECT: also fine
        forger.close_with_will()
    assert honest.connect() == SUCCESS
    honest.close_with_will()
    # One broker thread handles both: the later will is in, so the earlier one never comes.
    supervisor.wait_message("phalanx/v1/node/gpu-a01/death", will)

    assert connack in (SUCCESS, NOT_AUTHORIZED)
    assert supervisor.received("phalanx/v1/node/gpu-a02/death") == []


def test_node_cannot_publish_a_command_even_to_itself(probes: ProbeMaker) -> None:
    node = probes.node("gpu-a01")
    assert node.subscribe("phalanx/v1/node/gpu-a01/cmd") == 1

    refused = node.publish("phalanx/v1/node/gpu-a01/cmd", _marker())

    assert refused == NOT_AUTHORIZED
    assert node.received("phalanx/v1/node/gpu-a01/cmd") == []


# Mosquitto's ACL grants every SUBSCRIBE (its SUBACK says nothing) and checks `read` when it
# delivers; what a node cannot read therefore never reaches it, whatever it subscribed to.
def test_node_subscribed_to_another_nodes_commands_never_receives_them(probes: ProbeMaker) -> None:
    supervisor, node = probes.supervisor(), probes.node("gpu-a01")
    node.subscribe("phalanx/v1/node/gpu-a02/cmd")
    node.subscribe("phalanx/v1/node/gpu-a01/cmd")
    sentinel = _marker()

    assert supervisor.publish("phalanx/v1/node/gpu-a02/cmd", _marker()) == SUCCESS
    assert supervisor.publish("phalanx/v1/node/gpu-a01/cmd", sentinel) == SUCCESS
    # One publisher's messages arrive in order: once the later one is in, the other never is.
    node.wait_message("phalanx/v1/node/gpu-a01/cmd", sentinel)

    assert node.received("phalanx/v1/node/gpu-a02/cmd") == []


def test_node_subscribed_to_every_nodes_topics_receives_only_its_own_commands(
    probes: ProbeMaker,
) -> None:
    supervisor, node, other = probes.supervisor(), probes.node("gpu-a01"), probes.node("gpu-a02")
    node.subscribe("phalanx/v1/node/#")
    sentinel = _marker()

    assert other.publish("phalanx/v1/node/gpu-a02/heartbeat", _marker()) == SUCCESS
    assert supervisor.publish("phalanx/v1/node/gpu-a02/cmd", _marker()) == SUCCESS
    assert supervisor.publish("phalanx/v1/node/gpu-a01/cmd", sentinel) == SUCCESS
    node.wait_message("phalanx/v1/node/gpu-a01/cmd", sentinel)

    assert [topic for topic, _ in node.messages] == ["phalanx/v1/node/gpu-a01/cmd"]


@pytest.mark.parametrize("subscription", wire.agent_subscriptions("gpu-a01"))
def test_node_receives_what_the_supervisor_publishes_on_each_of_its_subscriptions(
    probes: ProbeMaker, subscription: str
) -> None:
    supervisor, node = probes.supervisor(), probes.node("gpu-a01")
    node.subscribe(subscription)
    topic, payload = subscription.replace("+", "job-1"), _marker()

    assert supervisor.publish(topic, payload) == SUCCESS
    node.wait_message(topic, payload)


def test_supervisor_status_reaches_nodes_and_no_node_can_forge_it(probes: ProbeMaker) -> None:
    supervisor, node = probes.supervisor(), probes.node("gpu-a01")
    assert node.subscribe(wire.SUPERVISOR_STATUS_TOPIC) == 1
    payload = _marker()

    assert node.publish(wire.SUPERVISOR_STATUS_TOPIC, _marker()) == NOT_AUTHORIZED
    assert supervisor.publish(wire.SUPERVISOR_STATUS_TOPIC, payload) == SUCCESS
    node.wait_message(wire.SUPERVISOR_STATUS_TOPIC, payload)
    assert node.received(wire.SUPERVISOR_STATUS_TOPIC) == [payload]


def test_a_wrong_password_is_refused(probes: ProbeMaker) -> None:
    probe = probes.raw("gpu-a01", NODE_PASSWORDS["gpu-a02"])

    assert probe.connect() in (BAD_USER_NAME_OR_PASSWORD, NOT_AUTHORIZED)


def test_an_anonymous_client_is_refused(probes: ProbeMaker) -> None:
    probe = probes.raw(None, None)

    assert probe.connect() in (BAD_USER_NAME_OR_PASSWORD, NOT_AUTHORIZED)


def test_a_client_without_tls_gets_no_session(probes: ProbeMaker) -> None:
    probe = probes.raw("gpu-a01", NODE_PASSWORDS["gpu-a01"], tls=False)

    with contextlib.suppress(TimeoutError, OSError):
        assert probe.connect(timeout=3) != SUCCESS
    assert probe.connack != SUCCESS


def test_a_node_cannot_take_over_another_nodes_session_by_its_client_id(probes: ProbeMaker) -> None:
    victim = probes.node("gpu-a01", client_id="agentd-gpu-a01")

    probes.node("gpu-a02", client_id="agentd-gpu-a01")

    assert victim.still_connected_after(0.5)
