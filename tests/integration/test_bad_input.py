"""Bad input on the wire and in config files never crashes a daemon."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx import wire
from tests.harness import Fleet, RawMqtt, wait_for

pytestmark = pytest.mark.integration

GARBAGE: list[bytes] = [
    b"\x00\xff\xfe not json at all",
    b"{",
    b"[]",
    b"null",
    b'{"kind": "heartbeat"}',
    b'{"kind": "birth", "node": "n01", "seq": -5}',
    json.dumps(
        {
            "kind": "heartbeat",
            "node": "someone-else",
            "seq": 1,
            "n": 0,
            "sent_at": 0,
            "health": {"status": "ok"},
        }
    ).encode(),
    json.dumps(
        {
            "kind": "cmd",
            "id": "x",
            "node": "n01",
            "issued_at": 0,
            "deadline": 9e12,
            "args": {"op": "format-disk"},
        }
    ).encode(),
    b"A" * (wire.MAX_PAYLOAD_BYTES + 1),
    ("[" * 5000 + "]" * 5000).encode(),
]


def test_garbage_on_every_topic_is_dropped_and_both_daemons_keep_working(fleet: Fleet) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.wait_state("n01", "up")
    raw = RawMqtt(fleet.broker.port)
    topics = [
        wire.birth_topic("n01"),
        wire.death_topic("n01"),
        wire.heartbeat_topic("n01"),
        wire.command_topic("n01"),
        wire.ack_topic("n01"),
        wire.metrics_topic("n01"),
        wire.SUPERVISOR_STATUS_TOPIC,
        wire.birth_topic("ghost"),
        "phalanx/v1/node/bad id!/heartbeat",
        "phalanx/v1/node/n01/x",
    ]
    try:
        for topic in topics:
            for payload in GARBAGE:
                raw.publish(topic, payload)
    finally:
        raw.close()

    stats = wait_for(
        lambda: (s := fleet.client().get("/v1/stats"))["bad_messages"] > 0 and s,
        10,
        "the supervisor to count bad messages",
    )
    assert stats["bad_messages"] >= len(GARBAGE)
    # Both still alive and still doing their jobs: a command round trip through both.
    ack = fleet.client().post("/v1/nodes/n01/ping")
    assert ack["status"] == "done"
    assert fleet.node("n01")["state"] == "up"
    assert fleet.supervisor is not None and fleet.supervisor.alive()
    assert fleet.agents["n01"].alive()
    assert "Traceback" not in fleet.agents["n01"].output()
    assert "Traceback" not in fleet.supervisor.output()


def _command(cmd_id: str, *, deadline_in: float) -> bytes:
    now = time.time()
    return wire.encode(
        wire.Command(
            id=cmd_id, node="n01", issued_at=now, deadline=now + deadline_in, args=wire.PingArgs()
        )
    )


def test_a_command_delivered_twice_is_executed_once_and_acked_as_duplicate(fleet: Fleet) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.wait_state("n01", "up")
    raw = RawMqtt(fleet.broker.port)
    try:
        raw.subscribe(wire.ack_topic("n01"))
        payload = _command("cmd-twice", deadline_in=30)
        raw.publish(wire.command_topic("n01"), payload)
        raw.publish(wire.command_topic("n01"), payload)
        acks = wait_for(
            lambda: len(got := raw.received(wire.ack_topic("n01"))) >= 2 and got, 10, "two acks"
        )
    finally:
        raw.close()
    first, second = (wire.CommandAck.model_validate_json(a) for a in acks[:2])
    assert (first.duplicate, second.duplicate) == (False, True)
    # Ping's result is the time it ran: the same in both acks, so it ran once.
    assert first.result == second.result


def test_a_command_arriving_after_its_deadline_is_acked_expired_and_not_run(
    fleet: Fleet,
) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.wait_state("n01", "up")
    raw = RawMqtt(fleet.broker.port)
    try:
        raw.subscribe(wire.ack_topic("n01"))
        raw.publish(wire.command_topic("n01"), _command("cmd-late", deadline_in=-1))
        acks = wait_for(lambda: raw.received(wire.ack_topic("n01")), 10, "an ack")
    finally:
        raw.close()
    ack = wire.CommandAck.model_validate_json(acks[0])
    assert ack.status == "expired"
    assert ack.result == {}


@pytest.mark.parametrize(
    ("module", "toml", "field"),
    [
        ("agentd", "[mqtt]\nport = 99999\n", "mqtt.port"),
        ("agentd", 'heartbeat_interval_s = "often"\n', "heartbeat_interval_s"),
        ("agentd", '[gpu]\nbackend = "cuda"\n', "gpu.backend"),
        ("agentd", "[thresholds]\nretired_pages = 3\n", "thresholds.retired_pages"),
        ("supervisor", "offline_after_s = -1\n", "offline_after_s"),
        ("supervisor", "[api]\nprot = 1\n", "api.prot"),
    ],
)
def test_bad_config_exits_2_naming_the_field(
    tmp_path: Path, module: str, toml: str, field: str
) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text(toml)
    done = subprocess.run(
        [sys.executable, "-m", module, "--config", str(conf)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert field in done.stderr


def test_agent_refuses_auto_backend_without_nvml_and_says_how_to_choose_sim(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agentd", "--data-dir", str(tmp_path), "--gpu.backend", "auto"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--gpu.backend sim" in done.stderr
