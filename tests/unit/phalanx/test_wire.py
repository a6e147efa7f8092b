"""The wire contract: every message survives encode/parse; everything else is a WireError."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from phalanx import wire
from phalanx.wire import (
    MAX_PAYLOAD_BYTES,
    SUPERVISOR_STATUS_TOPIC,
    AckStatus,
    Command,
    CommandAck,
    GpuDescriptor,
    GpuGauges,
    Health,
    HealthStatus,
    Heartbeat,
    HostGauges,
    NodeBirth,
    NodeDeath,
    PingArgs,
    Reason,
    RebirthArgs,
    ResampleArgs,
    SupervisorStatus,
    Topology,
    WireError,
    parse,
)

NODE = "gpu-node-01"


def _health() -> Health:
    return Health(
        status=HealthStatus.DRAIN,
        reasons=[Reason(code="ecc_dbe", severity="drain", gpu=1, detail="1 uncorrected")],
        gpus=[GpuGauges(index=0, temperature_c=41.0, throttle=["hw_thermal"])],
        host=HostGauges(
            disk_free_bytes=10,
            disk_total_bytes=100,
            mem_available_bytes=5,
            mem_total_bytes=50,
            load1=0.5,
            cpu_count=8,
        ),
        sampled_at=1700000000.0,
    )


def _birth(node: str = NODE) -> NodeBirth:
    return NodeBirth(
        node=node,
        seq=3,
        hostname="gpu-node-01.example",
        address="10.0.0.1",
        http_port=9400,
        gpus=[GpuDescriptor(index=0, uuid="GPU-0", model="H100", memory_bytes=80 * 2**30)],
        gpu_backend="sim",
        topology=Topology(rack="r1", nvlink_domain="nvl-a"),
        version="0.1.0",
        started_at=1700000000.0,
        health=_health(),
    )


def _heartbeat(node: str = NODE) -> Heartbeat:
    return Heartbeat(node=node, seq=3, n=7, sent_at=1700000001.0, health=_health())


def _ack(node: str = NODE) -> CommandAck:
    return CommandAck(
        id="c1", node=node, status=AckStatus.DONE, result={"pong": True}, acked_at=1700000002.0
    )


ROUND_TRIPS: list[tuple[str, Callable[[], wire.Message]]] = [
    ("birth", _birth),
    ("death", lambda: NodeDeath(node=NODE, seq=3, cause="shutdown")),
    ("heartbeat", _heartbeat),
    ("cmd", lambda: Command.new(NODE, PingArgs())),
    ("cmd", lambda: Command.new(NODE, ResampleArgs())),
    ("cmd", lambda: Command.new(NODE, RebirthArgs())),
    ("ack", _ack),
    (
        "ckpt",
        lambda: wire.CkptLanding(
            node=NODE,
            job="j-1",
            step=4,
            rank=0,
            tier="nvme",
            nbytes=10,
            checksum="xxh3_128:" + "0" * 32,
            at=1700000003.0,
        ),
    ),
    ("ckpt", lambda: wire.CkptReleased(node=NODE, job="j-1", at=1700000004.0)),
]

TOPIC_OF = {
    "birth": wire.birth_topic,
    "death": wire.death_topic,
    "heartbeat": wire.heartbeat_topic,
    "cmd": wire.command_topic,
    "ack": wire.ack_topic,
    "ckpt": wire.ckpt_topic,
}


@pytest.mark.parametrize(("kind", "make"), ROUND_TRIPS)
def test_every_node_message_round_trips_through_encode_and_parse_on_its_topic(
    kind: str, make: Callable[[], wire.Message]
) -> None:
    message = make()

    inbound = parse(TOPIC_OF[kind](NODE), wire.encode(message))

    assert inbound.node == NODE
    assert inbound.message == message


@pytest.mark.parametrize(("kind", "make"), ROUND_TRIPS)
def test_encode_writes_what_pydantics_json_dump_writes(
    kind: str, make: Callable[[], wire.Message]
) -> None:
    # encode takes the serializer's bytes as they are, not through a str: the same JSON
    message = make()

    assert wire.encode(message) == message.model_dump_json().encode()


def test_encode_writes_text_as_utf8_and_non_finite_numbers_as_pydantic_does() -> None:
    batch = _metrics_batch(2, 3)
    note = wire.CkptLanding(
        node=NODE,
        job="j-1",
        step=1,
        rank=0,
        tier="nvme",
        at=1700000005.0,
        event="failed",
        error="disque plein — écrit 0 octet",
    )

    for message in (batch, note):
        assert wire.encode(message) == message.model_dump_json().encode()
    assert "—".encode() in wire.encode(note)


def test_supervisor_status_round_trips_on_the_fleet_wide_topic() -> None:
    status = SupervisorStatus(online=True, since=1700000000.0)

    inbound = parse(SUPERVISOR_STATUS_TOPIC, wire.encode(status))

    assert inbound.node is None
    assert inbound.message == status


def test_a_str_payload_parses_like_its_bytes() -> None:
    death = NodeDeath(node=NODE, seq=1)

    assert parse(wire.death_topic(NODE), wire.encode(death).decode()).message == death


@pytest.mark.parametrize("payload", [b"", None])
def test_an_empty_payload_parses_as_a_cleared_retained_message(payload: bytes | None) -> None:
    inbound = parse(wire.birth_topic(NODE), payload)

    assert inbound.node == NODE
    assert inbound.message is None


def test_an_empty_payload_on_the_supervisor_status_topic_is_a_cleared_retained_message() -> None:
    assert parse(SUPERVISOR_STATUS_TOPIC, b"") == wire.Inbound(None, None)


@pytest.mark.parametrize(
    "payload",
    [b"not json at all", b"\xff\xfe\x00\x81binary", b'{"node": ', b"[1, 2, 3]", b"42"],
    ids=["text", "binary", "truncated-json", "json-array", "json-number"],
)
def test_garbage_raises_wire_error_naming_the_topic(payload: bytes) -> None:
    topic = wire.heartbeat_topic(NODE)

    with pytest.raises(WireError, match="heartbeat") as caught:
        parse(topic, payload)

    assert caught.value.topic == topic


def test_json_of_another_message_schema_raises_wire_error_naming_the_topic() -> None:
    topic = wire.birth_topic(NODE)

    with pytest.raises(WireError, match="NodeBirth invalid") as caught:
        parse(topic, wire.encode(_heartbeat()))

    assert caught.value.topic == topic


def test_a_checkpoint_report_of_no_kind_raises_wire_error_naming_each() -> None:
    topic = wire.ckpt_topic(NODE)

    with pytest.raises(WireError, match="CkptLanding, CkptLandings or CkptReleased invalid"):
        parse(topic, json.dumps({"kind": "ckpt_gone", "node": NODE, "job": "j"}).encode())
    with pytest.raises(WireError, match="job"):
        parse(topic, json.dumps({"kind": "ckpt_released", "node": NODE, "at": 1.0}).encode())


def test_a_landing_that_names_no_kind_still_parses_as_a_landing() -> None:
    landing = ROUND_TRIPS[-2][1]()
    data = json.loads(wire.encode(landing))
    del data["kind"]

    assert parse(wire.ckpt_topic(NODE), json.dumps(data).encode()).message == landing


@pytest.mark.parametrize(
    ("field", "value"),
    [("step", 10**12), ("rank", 10**5), ("nbytes", 2**63), ("generation", 2**63)],
)
def test_a_landing_past_what_the_store_can_name_or_hold_raises_wire_error(
    field: str,
    value: int,
) -> None:
    data = json.loads(wire.encode(ROUND_TRIPS[-2][1]()))
    data[field] = value

    with pytest.raises(WireError, match=field):
        parse(wire.ckpt_topic(NODE), json.dumps(data).encode())


def test_the_wire_limits_are_the_checkpoint_stores() -> None:
    import ckpt.tiers

    assert (wire.MAX_STEP, wire.MAX_RANK) == (ckpt.tiers.MAX_STEP, ckpt.tiers.MAX_RANK)


def test_a_payload_with_an_extra_field_raises_wire_error() -> None:
    topic = wire.death_topic(NODE)
    data = json.loads(wire.encode(NodeDeath(node=NODE, seq=1)))
    data["surprise"] = 1

    with pytest.raises(WireError, match="surprise") as caught:
        parse(topic, json.dumps(data).encode())

    assert caught.value.topic == topic


def test_an_oversized_payload_raises_wire_error_before_it_is_read() -> None:
    topic = wire.heartbeat_topic(NODE)
    payload = b" " * (MAX_PAYLOAD_BYTES + 1)

    with pytest.raises(WireError, match="exceeds") as caught:
        parse(topic, payload)

    assert caught.value.topic == topic


def test_a_payload_of_exactly_the_size_limit_is_not_rejected_for_its_size() -> None:
    encoded = wire.encode(NodeDeath(node=NODE, seq=1))
    payload = encoded + b" " * (MAX_PAYLOAD_BYTES - len(encoded))

    assert parse(wire.death_topic(NODE), payload).message == NodeDeath(node=NODE, seq=1)


def test_heartbeat_naming_another_node_than_its_topic_is_rejected() -> None:
    topic = wire.heartbeat_topic(NODE)

    with pytest.raises(WireError, match="other-node") as caught:
        parse(topic, wire.encode(_heartbeat("other-node")))

    assert caught.value.topic == topic


def test_an_invalid_node_id_in_the_topic_raises_wire_error() -> None:
    topic = "phalanx/v1/node/-dash-first/birth"

    with pytest.raises(WireError, match="invalid node id") as caught:
        parse(topic, wire.encode(_birth()))

    assert caught.value.topic == topic


@pytest.mark.parametrize(
    "topic",
    [
        "phalanx/v2/node/n1/birth",
        "phalanx/v1/node/n1/unknown",
        "phalanx/v1/node/n1/birth/extra",
        "other/topic",
        "",
    ],
)
def test_a_non_phalanx_topic_raises_wire_error_naming_it(topic: str) -> None:
    with pytest.raises(WireError, match="not a phalanx/v1 topic") as caught:
        parse(topic, b"{}")

    assert caught.value.topic == topic


@pytest.mark.parametrize(
    "builder",
    [
        wire.birth_topic,
        wire.death_topic,
        wire.heartbeat_topic,
        wire.command_topic,
        wire.ack_topic,
        wire.agent_subscriptions,
    ],
)
@pytest.mark.parametrize("node", ["", "-lead", "has/slash", "+", "#", "x" * 64, "sp ace"])
def test_topic_builders_reject_invalid_node_ids(
    builder: Callable[[str], object], node: str
) -> None:
    with pytest.raises(ValueError, match="invalid node id"):
        builder(node)


def test_topic_builders_put_the_node_under_the_versioned_prefix() -> None:
    assert wire.birth_topic("n1") == "phalanx/v1/node/n1/birth"
    assert wire.agent_subscriptions("n1") == (
        "phalanx/v1/node/n1/cmd",
        "phalanx/v1/job/+/ckpt/n1",
        "phalanx/v1/supervisor/status",
    )
    assert wire.ckpt_topic("n1") == "phalanx/v1/node/n1/ckpt"
    assert wire.catalog_topic("j-1", "n1") == "phalanx/v1/job/j-1/ckpt/n1"


def test_every_catalog_topic_of_a_job_starts_with_its_prefix_and_matches_its_filter() -> None:
    prefix = wire.catalog_prefix("j-1")
    assert prefix == "phalanx/v1/job/j-1/ckpt/"
    assert wire.catalog_topic("j-1", "n1").startswith(prefix)
    assert not wire.catalog_topic("j-10", "n1").startswith(prefix)
    assert wire.catalog_filter("j-1") == prefix + "+"


def test_a_catalog_topic_of_an_invalid_job_id_is_refused() -> None:
    with pytest.raises(ValueError, match="invalid job id 'J_1'"):
        wire.catalog_prefix("J_1")


def test_the_supervisor_hears_every_node_topic_but_the_commands() -> None:
    heard = wire.SUPERVISOR_SUBSCRIPTIONS
    assert heard == tuple(f"phalanx/v1/node/+/{k}" for k in wire.NODE_TOPIC_KINDS if k != "cmd")
    assert "phalanx/v1/node/+/ckpt" in heard


def test_command_new_sets_a_deadline_ttl_seconds_after_issued_at() -> None:
    cmd = Command.new(NODE, PingArgs(), ttl=12.5)

    assert cmd.deadline > cmd.issued_at
    assert cmd.deadline - cmd.issued_at == pytest.approx(12.5)


def test_command_new_gives_every_command_a_fresh_id() -> None:
    assert Command.new(NODE, PingArgs()).id != Command.new(NODE, PingArgs()).id


def test_a_command_with_an_unknown_op_raises_wire_error() -> None:
    data = json.loads(wire.encode(Command.new(NODE, PingArgs())))
    data["args"] = {"op": "format-disk"}

    with pytest.raises(WireError, match="args"):
        parse(wire.command_topic(NODE), json.dumps(data).encode())


def test_health_statuses_are_ordered_by_severity() -> None:
    assert [s.severity for s in (HealthStatus.OK, HealthStatus.WARN, HealthStatus.DRAIN)] == [
        0,
        1,
        2,
    ]


def _metrics_batch(ranks: int, names: int) -> wire.MetricsBatch:
    return wire.MetricsBatch(
        node=NODE,
        job="tinylm-abc123",
        generation=2,
        window_s=5.0,
        sent_at=1.7e9,
        ranks=[
            wire.RankWindow(
                rank=r,
                step_first=10**11,
                step_last=10**11 + 99,
                at=1.7e9 + 0.123456789,
                reports=100,
                step_time_s=0.0501234567,
                tokens_per_s=123456.789012,
                data_wait_s=0.00123456789,
                scalars={
                    f"scalar_with_a_long_name_{n:02d}_{'x' * 30}": (
                        -1.2345678901234567e-300,
                        float("nan"),
                        float("inf"),
                        2.2250738585072014e-308,
                    )
                    for n in range(names)
                },
            )
            for r in range(ranks)
        ],
    )


def test_metrics_batch_survives_encode_and_parse_with_nan_and_infinity() -> None:
    batch = _metrics_batch(2, 3)
    got = parse(wire.metrics_topic(NODE), wire.encode(batch)).message
    assert isinstance(got, wire.MetricsBatch)
    assert got.ranks[1].step_last == batch.ranks[1].step_last
    stats = next(iter(got.ranks[0].scalars.values()))
    assert stats[0] == -1.2345678901234567e-300 and stats[1] != stats[1]
    assert stats[2] == float("inf")


def test_largest_metrics_batch_fits_in_one_payload() -> None:
    batch = _metrics_batch(wire.MAX_METRIC_RANKS, wire.MAX_METRIC_NAMES)
    assert len(wire.encode(batch)) < MAX_PAYLOAD_BYTES


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ranks", []),
        ("ranks", [{"rank": 0}]),
        ("generation", 0),
        ("job", "Bad Job"),
    ],
)
def test_bad_metrics_batch_is_a_wire_error_naming_the_field(field: str, value: object) -> None:
    payload = json.loads(wire.encode(_metrics_batch(1, 1)).replace(b"NaN", b"0"))
    payload[field] = value
    with pytest.raises(WireError, match=field):
        parse(wire.metrics_topic(NODE), json.dumps(payload).encode())


def test_metrics_batch_with_too_many_scalar_names_is_a_wire_error() -> None:
    payload = json.loads(wire.encode(_metrics_batch(1, 1)).replace(b"NaN", b"0"))
    payload["ranks"][0]["scalars"] = {f"n{i}": [0, 0, 0, 0] for i in range(17)}
    with pytest.raises(WireError, match="scalars"):
        parse(wire.metrics_topic(NODE), json.dumps(payload).encode())


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_metrics_window_whose_time_is_not_finite_is_a_wire_error(value: str) -> None:
    payload = wire.encode(_metrics_batch(1, 1)).replace(
        b'"at":1700000000.1234567', b'"at":' + value.encode()
    )
    assert value.encode() in payload
    with pytest.raises(WireError, match=r"ranks\.0\.at"):
        parse(wire.metrics_topic(NODE), payload)


def _rank_event(job: str) -> bytes:
    event = wire.RankEvent(node=NODE, job="j-1", generation=1, rank=0, event="started", at=1.0)
    return json.dumps({**json.loads(wire.encode(event)), "job": job}).encode()


def _catalog(job: str) -> bytes:
    catalog = wire.CkptCatalog(job="j-1", node=NODE, world_size=1)
    return json.dumps({**json.loads(wire.encode(catalog)), "job": job}).encode()


def _landing(job: str) -> bytes:
    return json.dumps({**json.loads(wire.encode(ROUND_TRIPS[-2][1]())), "job": job}).encode()


def _heartbeat_with(job: str) -> bytes:
    beat = json.loads(wire.encode(_heartbeat()))
    beat["jobs"] = [{"job": job, "generation": 1, "ranks": [0]}]
    return json.dumps(beat).encode()


@pytest.mark.parametrize(
    ("topic", "payload", "model"),
    [
        (wire.rank_topic(NODE), _rank_event, "RankEvent or RankEvents"),
        (f"phalanx/v1/job/Bad_Job!/ckpt/{NODE}", _catalog, "CkptCatalog"),
        (wire.ckpt_topic(NODE), _landing, "CkptLanding, CkptLandings or CkptReleased"),
        (wire.heartbeat_topic(NODE), _heartbeat_with, "Heartbeat"),
    ],
    ids=["rank event", "catalog", "landing", "heartbeat's jobs"],
)
def test_a_message_naming_a_job_id_outside_the_pattern_is_a_wire_error_naming_the_field(
    topic: str, payload: Callable[[str], bytes], model: str
) -> None:
    assert parse(topic.replace("Bad_Job!", "j-1"), payload("j-1")).message is not None

    with pytest.raises(WireError, match=f"{model} invalid: .*job: String should match pattern"):
        parse(topic, payload("Bad_Job!"))


def test_a_catalog_carries_its_restore_sources_only_when_it_has_some() -> None:
    """An agent from before ``sources`` refuses a catalog that has the field (extra fields
    are forbidden) and the supervisor is upgraded first: only an elastic job's resize
    sends it."""
    plain = wire.CkptCatalog(job="j-1", node=NODE, world_size=4, restore_step=20)
    assert "sources" not in json.loads(wire.encode(plain))
    resized = plain.model_copy(update={"sources": {2: 4, 3: 5}})
    encoded = wire.encode(resized)
    assert json.loads(encoded)["sources"] == {"2": 4, "3": 5}
    got = wire.parse(wire.catalog_topic("j-1", NODE), encoded).message
    assert isinstance(got, wire.CkptCatalog) and got.sources == {2: 4, 3: 5}


def test_a_one_way_probe_is_sent_without_both_ways() -> None:
    """An agent from before ``both_ways`` refuses a command that has the field (extra
    fields are forbidden): a one-way probe is sent as it was before it."""
    peer = wire.PeerAddr(node="n2", address="10.0.0.2", http_port=9400)
    one_way = Command.new(NODE, wire.ProbeLinkArgs(peer=peer, nbytes=1 << 20))
    assert "both_ways" not in json.loads(wire.encode(one_way))["args"]
    both = Command.new(NODE, wire.ProbeLinkArgs(peer=peer, nbytes=1 << 20, both_ways=True))
    encoded = wire.encode(both)
    assert json.loads(encoded)["args"]["both_ways"] is True
    got = parse(wire.command_topic(NODE), encoded).message
    assert isinstance(got, Command) and isinstance(got.args, wire.ProbeLinkArgs)
    assert got.args.both_ways


def test_a_birth_announces_its_features_only_when_it_has_some() -> None:
    """An agent from before ``features`` sends a birth without the field, and one with
    none sends what it did: only what the agent can do is added (the supervisor, which
    refuses an unknown field, is upgraded first)."""
    plain = _birth()
    assert "features" not in json.loads(wire.encode(plain))
    announcing = plain.model_copy(update={"features": [wire.FEATURE_PROBE_BOTH_WAYS]})
    encoded = wire.encode(announcing)
    assert json.loads(encoded)["features"] == ["probe_both_ways"]
    got = parse(wire.birth_topic(NODE), encoded).message
    assert isinstance(got, NodeBirth) and got.features == [wire.FEATURE_PROBE_BOTH_WAYS]
