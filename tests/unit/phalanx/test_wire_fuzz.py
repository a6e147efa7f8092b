"""``wire.parse`` under fuzz: for every topic kind and any payload (random bytes, random
JSON, deep JSON, and every valid message with one field replaced, removed or added) it
returns a message or raises ``WireError``, and nothing else. Hypothesis, derandomized,
with a bounded number of examples per property."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx import wire
from tests.unit.phalanx.test_wire import NODE, ROUND_TRIPS

JOB = "j-1"
TOPICS = [
    wire.birth_topic(NODE),
    wire.death_topic(NODE),
    wire.heartbeat_topic(NODE),
    wire.command_topic(NODE),
    wire.ack_topic(NODE),
    wire.rank_topic(NODE),
    wire.ckpt_topic(NODE),
    wire.catalog_topic(JOB, NODE),
    wire.SUPERVISOR_STATUS_TOPIC,
]
SAMPLES: list[wire.Message] = [make() for _, make in ROUND_TRIPS] + [
    wire.RankEvent(node=NODE, job=JOB, generation=1, rank=0, event="exited", code=1, at=1.0),
    wire.CkptCatalog(
        job=JOB,
        node=NODE,
        world_size=2,
        steps=[
            wire.CkptStep(
                step=4,
                committed={"nvme": 1.0},
                shards=[
                    wire.CkptShard(
                        rank=0,
                        checksum="xxh3_128:" + "0" * 32,
                        nbytes=10,
                        peer=wire.PeerAddr(node="n02", address="10.0.0.2", http_port=9400),
                    )
                ],
            )
        ],
        restore_step=4,
    ),
    wire.SupervisorStatus(online=True, since=1.0),
]
SETTINGS = settings(
    max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**64)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from([NODE, JOB, "n02", "", "ghost", "bad id!", "ram", "nvme", "ping"])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid message as JSON with one field, at any depth, replaced, removed or added."""
    data: Any = draw(st.sampled_from(SAMPLES)).model_dump(mode="json")
    holder, key = None, None
    node = data
    while isinstance(node, dict | list) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        holder, key = node, draw(st.sampled_from(keys))
        node = node[key]
    if holder is None:
        holder, key = data, draw(st.sampled_from(list(data)))
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "replace":
        holder[key] = draw(json_values)
    elif action == "remove" and isinstance(holder, dict):
        del holder[key]
    elif isinstance(holder, dict):
        holder[draw(st.text(max_size=8))] = draw(json_values)
    return json.dumps(data, allow_nan=True).encode()


payloads = (
    st.binary(max_size=300)
    | json_values.map(lambda v: json.dumps(v).encode())
    | mutated()
    | st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n)
    | st.integers(1, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)
)


def only_wire_errors(topic: str, payload: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.parse(topic, payload)


@pytest.mark.parametrize("topic", TOPICS)
@SETTINGS
@given(payload=payloads)
def test_any_payload_on_a_topic_kind_parses_or_is_a_wire_error(topic: str, payload: bytes) -> None:
    only_wire_errors(topic, payload)


@SETTINGS
@given(topic=st.text(max_size=60) | st.sampled_from(TOPICS).map(lambda t: t + "/x"))
def test_any_topic_parses_or_is_a_wire_error(topic: str) -> None:
    only_wire_errors(topic, b'{"kind": "supervisor", "online": true, "since": 1}')


@pytest.mark.parametrize("topic", TOPICS)
@pytest.mark.parametrize(
    "payload",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 40_000 + b"1" + b"}" * 40_000],
    ids=["deep arrays", "deep objects"],
)
def test_deep_json_on_any_topic_kind_is_a_wire_error(topic: str, payload: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.parse(topic, payload)


def topic_of(message: wire.Message) -> str:
    if isinstance(message, wire.CkptCatalog):
        return wire.catalog_topic(JOB, NODE)
    if isinstance(message, wire.SupervisorStatus):
        return wire.SUPERVISOR_STATUS_TOPIC
    kinds = {
        wire.NodeBirth: wire.birth_topic,
        wire.NodeDeath: wire.death_topic,
        wire.Heartbeat: wire.heartbeat_topic,
        wire.Command: wire.command_topic,
        wire.CommandAck: wire.ack_topic,
        wire.RankEvent: wire.rank_topic,
        wire.CkptLanding: wire.ckpt_topic,
        wire.CkptReleased: wire.ckpt_topic,
    }
    return kinds[type(message)](NODE)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_sample_message_parses_on_its_topic(message: wire.Message) -> None:
    # the mutations start from valid messages
    assert wire.parse(topic_of(message), wire.encode(message)).message == message


LANDING = {
    "kind": "ckpt",
    "node": NODE,
    "job": JOB,
    "step": 4,
    "rank": 0,
    "tier": "nvme",
    "nbytes": 10,
    "checksum": "xxh3_128:" + "0" * 32,
    "at": 1.0,
}


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
@pytest.mark.parametrize(
    ("topic", "payload"),
    [
        (wire.ckpt_topic(NODE), json.dumps(LANDING).replace('"at": 1.0', '"at": X')),
        (
            wire.command_topic(NODE),
            json.dumps(
                {
                    "kind": "cmd",
                    "id": "c1",
                    "node": NODE,
                    "issued_at": 1.0,
                    "deadline": 2.0,
                    "args": {"op": "stop_ranks", "job": JOB, "generation": 1, "grace_s": 1.0},
                }
            ).replace('"grace_s": 1.0', '"grace_s": X'),
        ),
        (
            wire.SUPERVISOR_STATUS_TOPIC,
            '{"kind": "supervisor", "online": true, "since": X}',
        ),
    ],
    ids=["landing at", "command grace_s", "status since"],
)
def test_a_number_that_is_not_finite_is_a_wire_error(
    topic: str, payload: str, number: bytes
) -> None:
    with pytest.raises(wire.WireError, match="finite number"):
        wire.parse(topic, payload.replace("X", number.decode()).encode())
