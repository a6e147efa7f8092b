"""Agent mode's pure parts: buddies, the supervisor's catalog, its wire messages, the env."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zstandard

import ckpt
from ckpt import Checkpointer, CheckpointError
from ckpt.peer import SealCheck
from phalanx import wire
from supervisor.catalog import CheckpointCatalog, pick_buddies
from supervisor.store import Store


def landing(step: int, rank: int, tier: str = "nvme", event: str = "landed",
            node: str = "n01") -> wire.CkptLanding:  # fmt: skip
    return wire.CkptLanding(node=node, job="j-1", step=step, rank=rank, tier=tier,  # type: ignore[arg-type]
                            event=event, nbytes=100 + rank, checksum=f"xxh3_128:{rank:032x}",  # type: ignore[arg-type]
                            at=time.time())


def test_buddies_leave_the_rack_when_another_rack_exists() -> None:
    racks = {"a1": "r1", "a2": "r1", "b1": "r2", "b2": "r2"}

    buddies = pick_buddies(list(racks), racks)

    assert set(buddies) == set(racks)
    assert all(racks[n] != racks[b] for n, b in buddies.items())
    assert sorted(buddies.values()) == sorted(racks)  # nobody holds two nodes' copies


def test_buddies_in_one_rack_form_a_ring_and_a_lone_node_has_none() -> None:
    racks = {"n1": "r", "n2": "r", "n3": "r"}

    assert pick_buddies(list(racks), racks) == {"n1": "n2", "n2": "n3", "n3": "n1"}
    assert pick_buddies(["n1"], racks) == {}


def test_a_step_is_committed_at_a_tier_only_once_every_rank_landed_there(tmp_path: Path) -> None:
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))

    assert catalog.on_landing(landing(5, 0), world_size=2) is False
    assert catalog.message("j-1", 2).steps == []
    assert catalog.on_landing(landing(5, 1, node="n02"), world_size=2) is True
    assert catalog.on_landing(landing(5, 1, node="n02"), world_size=2) is False  # redelivery

    msg = catalog.message("j-1", 2)
    assert [(s.step, sorted(s.committed)) for s in msg.steps] == [(5, ["nvme"])]
    assert [(s.rank, s.nbytes) for s in msg.steps[0].shards] == [(0, 100), (1, 101)]
    view = catalog.view("j-1", 2, ["ram", "nvme"])
    assert view["steps"][0]["partial"] == {} and view["steps"][0]["where"]["nvme"] == {
        "0": "n01", "1": "n02"}


def test_a_deleted_step_leaves_the_catalog_at_that_tier_only(tmp_path: Path) -> None:
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))
    for tier in ("nvme", "object"):
        for rank in (0, 1):
            catalog.on_landing(landing(5, rank, tier), world_size=2)

    assert catalog.on_landing(landing(5, 0, "object", "deleted"), world_size=2) is True

    assert [sorted(s.committed) for s in catalog.message("j-1", 2).steps] == [["nvme"]]


def test_the_catalog_message_is_retained_per_job_and_checks_its_topic() -> None:
    msg = wire.CkptCatalog(job="j-1", world_size=1, steps=[wire.CkptStep(
        step=3, committed={"ram": 1.0}, shards=[wire.CkptShard(rank=0, checksum="c", nbytes=1)])])

    parsed = wire.parse(wire.catalog_topic("j-1"), wire.encode(msg))

    assert parsed.message == msg
    assert wire.parse(wire.catalog_topic("j-1"), b"").message is None
    with pytest.raises(wire.WireError, match="names job"):
        wire.parse(wire.catalog_topic("j-2"), wire.encode(msg))
    assert isinstance(wire.parse(wire.ckpt_topic("n01"), wire.encode(landing(1, 0))).message,
                      wire.CkptLanding)


def test_checkpointer_without_dir_outside_phalanx_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("PHALANX_AGENT_SOCKET", "PHALANX_JOB_ID", "PHALANX_GENERATION"):
        monkeypatch.delenv(key, raising=False)

    with pytest.raises(CheckpointError, match=r"PHALANX_AGENT_SOCKET.*pass dir=PATH"):
        Checkpointer()


@pytest.mark.parametrize("compressed", [True, False])
def test_a_buddy_accepts_a_sealed_shard_and_refuses_one_with_a_flipped_bit(
    compressed: bool,
) -> None:
    shard = ckpt.encode({"w": list(range(1000)), "b": b"x" * 5000})
    ckpt.seal(shard)
    bad = bytearray(shard)
    bad[100] ^= 0x01

    def check(data: bytes) -> str | None:
        if compressed:
            data = zstandard.ZstdCompressor(level=1).compress(data)
        seal = SealCheck(compressed)
        for start in range(0, len(data), 777):  # in pieces, as a body streams in
            seal.feed(data[start : start + 777])
        return seal.problem()

    assert check(bytes(shard)) is None
    assert "content hashes to" in (check(bytes(bad)) or "")
    assert "truncated" in (check(bytes(shard[:-5])) or "")
