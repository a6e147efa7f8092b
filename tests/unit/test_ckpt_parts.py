"""A step committed in parts: each node writes the checksums of its own ranks.

Under Phalanx a node learns the checksums of its own ranks only (its catalog
message stays small however many ranks the job has), so a shared tier (the
object store, a buddy's folder) gets one manifest part per node beside a step
manifest that every node writes alike. Real files, real shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt import (
    CheckpointError,
    LocalFolderStore,
    ObjectTier,
    ShardKey,
    TierManifest,
    decode,
    encode,
    verify,
)

JOB = "j-1"


def put_shard(tier: ObjectTier, step: int, rank: int) -> tuple[str, int]:
    shard = encode({"rank": rank, "step": step})
    digest = verify(shard)
    tier.put(ShardKey(JOB, step, rank), memoryview(shard), digest)
    return digest, len(shard)


def test_every_rank_reads_its_copy_from_a_step_committed_in_one_part_per_node(
    tmp_path: Path,
) -> None:
    tier = ObjectTier(LocalFolderStore(tmp_path / "objects"))
    world = 6
    shards = {r: put_shard(tier, 7, r) for r in range(world)}
    nodes = {"n01": [0, 1, 2], "n02": [3, 4], "n03": [5]}
    assert tier.steps(JOB) == []

    for ranks in nodes.values():
        tier.commit(TierManifest(JOB, 7, {r: shards[r] for r in ranks}, committed_at=1.0,
                                 world_size=world))  # fmt: skip

    assert tier.steps(JOB) == [7]
    names = sorted(p.name for p in (tmp_path / "objects" / JOB).rglob("manifest*"))
    assert names == ["manifest-r00000-r00002.json", "manifest-r00003-r00004.json",
                     "manifest-r00005-r00005.json", "manifest.json"]
    for rank in range(world):
        stored = tier.open(ShardKey(JOB, 7, rank))
        assert stored is not None
        try:
            assert stored.expected == shards[rank][0]
            assert decode(stored.buffer, copy=True, expected=stored.expected) == {
                "rank": rank, "step": 7}
        finally:
            stored.close()


def test_a_rank_whose_part_is_not_written_yet_finds_no_copy_and_retention_takes_the_parts(
    tmp_path: Path,
) -> None:
    tier = ObjectTier(LocalFolderStore(tmp_path / "objects"))
    shards = {r: put_shard(tier, 7, r) for r in range(2)}
    tier.commit(TierManifest(JOB, 7, {0: shards[0]}, committed_at=1.0, world_size=2))

    assert tier.open(ShardKey(JOB, 7, 1)) is None  # n02's part is still on its way
    found = tier.manifest(JOB, 7, 0)
    assert found is not None and found.partial and set(found.shards) == {0}

    tier.delete(JOB, 7)

    assert tier.steps(JOB) == [] and tier.landed_steps(JOB) == []
    assert not list((tmp_path / "objects").rglob("manifest*"))


def test_a_whole_manifest_is_still_written_in_one_piece(tmp_path: Path) -> None:
    tier = ObjectTier(LocalFolderStore(tmp_path / "objects"))
    shards = {r: put_shard(tier, 3, r) for r in range(2)}

    tier.commit(TierManifest(JOB, 3, shards, committed_at=1.0, world_size=2))

    names = sorted(p.name for p in (tmp_path / "objects").rglob("manifest*"))
    assert names == ["manifest.json"]
    found = tier.manifest(JOB, 3)
    assert found is not None and not found.partial and found.shards == shards


def test_the_catalog_checksum_reads_a_rank_whose_node_died_before_writing_its_part(
    tmp_path: Path,
) -> None:
    tier = ObjectTier(LocalFolderStore(tmp_path / "objects"))
    shards = {r: put_shard(tier, 7, r) for r in range(2)}
    tier.commit(TierManifest(JOB, 7, {0: shards[0]}, committed_at=1.0, world_size=2))
    key = ShardKey(JOB, 7, 1)  # rank 1's node landed its shard, then died: no part

    assert tier.reader(key, shards[1][1]) is None
    reader = tier.reader(key, shards[1][1], shards[1][0])
    assert reader is not None
    data = b"".join(reader)
    assert decode(bytearray(data), expected=shards[1][0]) == {"rank": 1, "step": 7}
    wrong = tier.reader(key, shards[1][1], "xxh3_128:" + "0" * 32)
    assert wrong is not None
    with pytest.raises(CheckpointError):
        decode(bytearray(b"".join(wrong)), expected="xxh3_128:" + "0" * 32)
