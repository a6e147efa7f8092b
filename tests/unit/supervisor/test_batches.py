"""A batch of a node's rank events or landings is taken message by message: one that
its handler cannot take is dropped alone, and the counts are of what the batch carries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx import wire
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    built = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    yield built
    built.store.close()


def event(rank: int) -> wire.RankEvent:
    return wire.RankEvent(
        node="n1", job="j-1", generation=1, rank=rank, event="exited", code=0, at=1.0
    )


async def test_an_event_its_handler_cannot_take_drops_alone(
    sup: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []

    def on_rank_event(ev: wire.RankEvent) -> None:
        if ev.rank == 1:
            raise RuntimeError("a bug in one event's handling")
        taken.append(ev.rank)

    monkeypatch.setattr(sup.jobs, "on_rank_event", on_rank_event)
    batch = wire.RankEvents(node="n1", events=[event(r) for r in range(4)])

    await sup._on_message(wire.rank_topic("n1"), wire.encode(batch))

    assert taken == [0, 2, 3]
    assert sup.wire_stats.received["rank"] == 4
    assert sup.wire_stats.received["rank_batch"] == 1


async def test_a_batch_of_landings_reaches_the_publisher_one_by_one_in_order(
    sup: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []
    monkeypatch.setattr(sup.publisher, "on_landing", lambda msg: taken.append(msg.rank))
    landings = [
        wire.CkptLanding(node="n1", job="j-1", step=5, rank=r, tier="ram", at=1.0)
        for r in (3, 1, 2)
    ]

    await sup._on_message(
        wire.ckpt_topic("n1"), wire.encode(wire.CkptLandings(node="n1", landings=landings))
    )

    assert taken == [3, 1, 2]
    assert sup.wire_stats.received["ckpt"] == 3
