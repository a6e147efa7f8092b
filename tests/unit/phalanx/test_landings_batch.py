"""An agent's landings go several in one message (CkptLandings), in order, never lost."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from phalanx import wire
from phalanx.link import MqttLink, Outbox

TOPIC = wire.ckpt_topic("n1")


def landing(rank: int, *, node: str = "n1", error: str = "") -> wire.CkptLanding:
    return wire.CkptLanding(
        node=node, job="j-1", step=10, rank=rank, tier="ram", at=1.0, error=error
    )


def released() -> wire.CkptReleased:
    return wire.CkptReleased(node="n1", job="j-1", at=2.0)


def test_the_landings_that_lead_the_queue_go_in_one_message() -> None:
    queued = [landing(0), landing(1), landing(2), released(), landing(3)]

    message, count = wire.pack_landings(queued)

    assert count == 3
    assert isinstance(message, wire.CkptLandings)
    assert [x.rank for x in message.landings] == [0, 1, 2]


def test_a_lone_landing_a_release_and_a_long_error_go_as_they_are() -> None:
    assert wire.pack_landings([landing(0), released()]) == (landing(0), 1)
    assert wire.pack_landings([released(), landing(0), landing(1)]) == (released(), 1)
    long = landing(1, error="x" * (wire._ckpt.MAX_BATCHED_ERROR + 1))
    assert wire.pack_landings([landing(0), long, landing(2)]) == (landing(0), 1)
    with pytest.raises(ValueError, match="nothing queued"):
        wire.pack_landings([])


def test_a_batch_holds_at_most_its_limit_and_stays_under_the_payload_limit() -> None:
    many = [landing(r, error="e" * wire._ckpt.MAX_BATCHED_ERROR) for r in range(200)]

    message, count = wire.pack_landings(many)

    assert count == wire.MAX_LANDINGS_BATCHED
    assert len(wire.encode(message)) < wire.MAX_PAYLOAD_BYTES


def test_a_batch_of_long_escaped_strings_stops_below_the_payload_limit() -> None:
    """A control character takes six bytes in JSON: 64 errors of 1,024 of them would be
    423 KB, which the supervisor would refuse."""
    errors = "\x01" * wire._ckpt.MAX_BATCHED_ERROR
    many = [landing(r, error=errors) for r in range(64)]
    events = [rank_event(r, detail="\x02" * 1000) for r in range(64)]

    for (packed, count), topic in (
        (wire.pack_landings(many), TOPIC),
        (wire.pack_rank_events(events), wire.rank_topic("n1")),
    ):
        assert 1 < count < 64
        assert len(wire.encode(packed)) < wire.MAX_PAYLOAD_BYTES
        assert wire.parse(topic, wire.encode(packed)).message == packed


def test_a_batch_parses_on_the_ckpt_topic_and_names_one_node() -> None:
    batch = wire.CkptLandings(node="n1", landings=[landing(0), landing(1)])

    parsed = wire.parse(TOPIC, wire.encode(batch))

    assert parsed.message == batch
    foreign = wire.encode(batch).replace(b'"node":"n1","job"', b'"node":"n2","job"', 1)
    with pytest.raises(wire.WireError, match="a landing of node 'n2' in a batch of node 'n1'"):
        wire.parse(TOPIC, foreign)
    with pytest.raises(wire.WireError, match="names node"):
        wire.parse(wire.ckpt_topic("n2"), wire.encode(batch))
    with pytest.raises(wire.WireError):
        wire.parse(TOPIC, b'{"kind": "ckpt_batch", "node": "n1", "landings": []}')


class RecordingLink:
    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.connects = 1

    async def until_connected(self) -> None:
        return None

    async def publish(self, topic: str, payload: bytes, **_: Any) -> None:
        assert topic == TOPIC
        self.payloads.append(payload)


async def test_an_outbox_that_packs_sends_what_queued_up_in_order_and_empties() -> None:
    link = RecordingLink()
    box = Outbox(cast(MqttLink, link), TOPIC, "landing", pack=wire.pack_landings)
    for m in [landing(0), landing(1), released(), landing(2)]:
        box.put(m)

    await box.flush(timeout=5.0)

    sent = [wire.parse(TOPIC, p).message for p in link.payloads]
    assert sent == [
        wire.CkptLandings(node="n1", landings=[landing(0), landing(1)]),
        released(),
        landing(2),
    ]
    assert len(box) == 0


async def test_an_outbox_run_sends_a_burst_in_few_messages() -> None:
    link = RecordingLink()
    box = Outbox(cast(MqttLink, link), TOPIC, "landing", pack=wire.pack_landings)
    for r in range(100):
        box.put(landing(r))
    runner = asyncio.create_task(box.run())
    try:
        async with asyncio.timeout(5):
            while len(box):  # noqa: ASYNC110 - the outbox has no event to wait on
                await asyncio.sleep(0.01)
    finally:
        runner.cancel()
    ranks = [
        x.rank
        for p in link.payloads
        for x in cast(wire.CkptLandings, wire.parse(TOPIC, p).message).landings
    ]
    assert ranks == list(range(100))
    assert len(link.payloads) == 2  # 64, then 36


def rank_event(rank: int, *, dumps: list[str] | None = None, detail: str = "") -> wire.RankEvent:
    return wire.RankEvent(
        node="n1",
        job="j-1",
        generation=2,
        rank=rank,
        event="started",
        at=1.0,
        dumps=dumps or [],
        detail=detail,
    )


def test_a_nodes_rank_events_go_several_in_one_message_and_parse_in_order() -> None:
    queued = [rank_event(0), rank_event(1), rank_event(2, dumps=["/tmp/nccl.0"]), rank_event(3)]

    message, count = wire.pack_rank_events(queued)

    assert count == 2
    assert isinstance(message, wire.RankEvents)
    parsed = wire.parse(wire.rank_topic("n1"), wire.encode(message)).message
    assert parsed == wire.RankEvents(node="n1", events=[rank_event(0), rank_event(1)])
    assert wire.pack_rank_events(queued[2:]) == (queued[2], 1)  # dumps go alone
    with pytest.raises(wire.WireError, match="RankEvent or RankEvents invalid"):
        wire.parse(wire.rank_topic("n2"), wire.encode(message).replace(b'"n1"', b'"n2"', 1))
