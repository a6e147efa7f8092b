"""A step committed in parts: each node writes the checksums of its own ranks.

Under Phalanx a node learns the checksums of its own ranks only (its catalog
message stays small however many ranks the job has), so a shared tier (the
object store, a buddy's folder) gets one manifest part per node beside a step
manifest that every node writes alike. Real files, real shards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

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
        tier.commit(
            TierManifest(JOB, 7, {r: shards[r] for r in ranks}, committed_at=1.0, world_size=world)
        )

    assert tier.steps(JOB) == [7]
    names = sorted(p.name for p in (tmp_path / "objects" / JOB).rglob("manifest*"))
    assert names == [
        "manifest-r00000-r00002.json",
        "manifest-r00003-r00004.json",
        "manifest-r00005-r00005.json",
        "manifest.json",
    ]
    for rank in range(world):
        stored = tier.open(ShardKey(JOB, 7, rank))
        assert stored is not None
        try:
            assert stored.expected == shards[rank][0]
            assert decode(stored.buffer, copy=True, expected=stored.expected) == {
                "rank": rank,
                "step": 7,
            }
        finally:
            stored.close()


def one_part_of_two(tmp_path: Path) -> tuple[ObjectTier, dict[int, tuple[str, int]]]:
    """Step 7 of two ranks: both shards landed, only rank 0's node wrote its part."""
    tier = ObjectTier(LocalFolderStore(tmp_path / "objects"))
    shards = {r: put_shard(tier, 7, r) for r in range(2)}
    tier.commit(TierManifest(JOB, 7, {0: shards[0]}, committed_at=1.0, world_size=2))
    return tier, shards


def test_a_rank_whose_part_is_not_written_yet_finds_no_copy_and_retention_takes_the_parts(
    tmp_path: Path,
) -> None:
    tier, _ = one_part_of_two(tmp_path)

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
    tier, shards = one_part_of_two(tmp_path)
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


def test_a_step_saved_again_after_the_gang_moved_reads_its_newest_part(tmp_path: Path) -> None:
    """Ranks 0-3 on one node wrote part r0-r3 of step 9 and a node died before the step
    was committed anywhere; the gang, placed anew on two nodes, saved step 9 again with
    other bytes: parts r0-r1 and r2-r3. The older part's span still holds every rank."""
    tier = ObjectTier(LocalFolderStore(tmp_path / "objects"))
    world = 4
    before = {r: put_shard(tier, 9, r) for r in range(world)}
    tier.commit(TierManifest(JOB, 9, before, committed_at=1.0, world_size=world + 1))
    again = {}
    for rank in range(world):
        shard = encode({"rank": rank, "step": 9, "generation": 2})
        again[rank] = (verify(shard), len(shard))
        tier.put(ShardKey(JOB, 9, rank), memoryview(shard), again[rank][0])
    for ranks in ([0, 1], [2, 3]):
        tier.commit(
            TierManifest(
                JOB, 9, {r: again[r] for r in ranks}, committed_at=2.0, world_size=world + 1
            )
        )

    for rank in range(world):
        key = ShardKey(JOB, 9, rank)
        found = tier.manifest(JOB, 9, rank)
        assert found is not None and found.shards[rank] == again[rank]
        stored = tier.open(key)
        assert stored is not None
        try:
            assert decode(stored.buffer, copy=True, expected=stored.expected)["generation"] == 2
        finally:
            stored.close()
        reader = tier.reader(key, again[rank][1], again[rank][0])  # the catalog's own
        assert reader is not None
        assert decode(bytearray(b"".join(reader)), expected=again[rank][0])["rank"] == rank


def test_the_catalog_checksum_wins_over_a_part_that_lists_other_bytes(tmp_path: Path) -> None:
    tier = ObjectTier(LocalFolderStore(tmp_path / "objects"))
    old = put_shard(tier, 5, 0)
    tier.commit(TierManifest(JOB, 5, {0: old}, committed_at=3.0, world_size=2))
    shard = encode({"rank": 0, "step": 5, "saved": "again"})  # a part left from before says
    committed = (verify(shard), len(shard))  # otherwise, its clock ahead of this node's
    tier.put(ShardKey(JOB, 5, 0), memoryview(shard), committed[0])

    reader = tier.reader(ShardKey(JOB, 5, 0), committed[1], committed[0])

    assert reader is not None and reader.expected == committed[0]
    assert decode(bytearray(b"".join(reader)), expected=committed[0])["saved"] == "again"


def test_folder_store_listing_skips_a_step_folder_removed_while_it_walks(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckpt.stores import LocalFolderStore

    store = LocalFolderStore(tmp_path)
    for step in ("000000000010", "000000000020"):
        store.put_stream(f"job/{step}/rank-00000.phx", [b"x"])
    real_scandir = os.scandir

    def scandir_after_retention(path: Any) -> Any:
        # Another node's retention removes step 10 just as this walk reaches it.
        if str(path).endswith("000000000010"):
            shutil.rmtree(path, ignore_errors=True)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir_after_retention)
    assert store.keys("job") == ["job/000000000020/rank-00000.phx"]
