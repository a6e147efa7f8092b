"""The object-store tier against a real S3-protocol server (moto) on loopback."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zstandard

import ckpt
from ckpt import Checkpointer, ObjectTier, S3Store, ShardKey, TierError
from ckpt.stores import PART_NBYTES
from ckpt.tiers import TierManifest
from tests.unit.ckpt.helpers import assert_bit_identical, training_state

moto_server = pytest.importorskip("moto.moto_server.threaded_moto_server")


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> Iterator[S3Store]:
    name = "ckpt-" + str(abs(hash(request.node.name)))[:12]
    store = S3Store(
        name, "runs/", endpoint_url=s3_endpoint, access_key="test", secret_key="test", timeout_s=30
    )
    store._run(store.client.create_bucket(Bucket=name))
    yield store
    with contextlib.suppress(Exception):
        store.close()


def s3(bucket: S3Store, endpoint: str) -> S3Store:
    """A second client on the same bucket (each Checkpointer owns and closes its store)."""
    return S3Store(
        bucket.bucket,
        "runs/",
        endpoint_url=endpoint,
        access_key="test",
        secret_key="test",
        timeout_s=30,
    )


def test_restore_uses_s3_after_ram_and_disk_are_gone(
    tmp_path: Path, bucket: S3Store, s3_endpoint: str
) -> None:
    state = training_state()
    with Checkpointer(dir=tmp_path, object_store=s3(bucket, s3_endpoint)) as c:
        c.save(2, state)
        c.wait()
    for path in (tmp_path / "disk").rglob("*.phx"):
        path.unlink()
    fresh = Checkpointer(dir=tmp_path, object_store=s3(bucket, s3_endpoint))
    try:
        found = fresh.restore()
        assert found is not None and found[0] == 2 and fresh.restored_from == "object"
        assert_bit_identical(state, found[1])
    finally:
        fresh.close()


def test_the_s3_copy_is_compressed_and_described_by_a_manifest_written_last(
    tmp_path: Path, bucket: S3Store, s3_endpoint: str
) -> None:
    state = {"zeros": torch.zeros(3 * PART_NBYTES // 4)}  # 24 MiB: a multipart upload
    with Checkpointer(dir=tmp_path, object_store=s3(bucket, s3_endpoint)) as c:
        c.save(1, state)
        c.wait()
    keys = bucket.keys("local/")
    assert keys == ["local/000000000001/manifest.json", "local/000000000001/rank-00000.phx.zst"]
    manifest = json.loads(bucket.get("local/000000000001/manifest.json"))
    assert manifest["compression"] == "zstd" and manifest["checksum_algorithm"] == "xxh3_128"
    (shard,) = manifest["shards"]
    assert shard["rank"] == 0 and shard["nbytes"] > 3 * PART_NBYTES
    assert len(bucket.get("local/000000000001/rank-00000.phx.zst")) < PART_NBYTES


def test_an_unreachable_object_store_is_a_tier_error_and_disk_still_commits(
    tmp_path: Path,
) -> None:
    dead = S3Store(
        "nowhere", endpoint_url="http://127.0.0.1:9", access_key="x", secret_key="x", timeout_s=5
    )
    c = Checkpointer(dir=tmp_path, object_store=dead)
    try:
        c.save(1, {"w": torch.ones(10)})
        with pytest.raises(TierError) as caught:
            c.wait()
        assert caught.value.tier == "object" and "s3://nowhere/" in str(caught.value)
        assert c.tiers[0].steps("local") == [1]
    finally:
        c.close()


def test_a_zstd_bomb_in_s3_is_refused_at_the_manifest_size_and_the_store_still_answers(
    bucket: S3Store,
) -> None:
    tier = ObjectTier(bucket)
    key = ShardKey("local", 1, 0)
    shard = ckpt.encode({"w": torch.ones(10)}, ref=key.ref())
    checksum = ckpt.verify(shard)
    tier.put(key, memoryview(shard), checksum)
    tier.commit(TierManifest("local", 1, {0: (checksum, len(shard))}))
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    zeros = bytes(1 << 20)
    bomb = b"".join([compressor.compress(zeros) for _ in range(1024)] + [compressor.flush()])
    bucket.put_stream(key.relpath(".zst"), [bomb])  # 1 GiB of zeros in about 32 KiB

    for _ in range(2):  # the abandoned download let go of its connection
        with pytest.raises(TierError, match=f"more than the {len(shard)} bytes its manifest"):
            tier.open(key)
    assert tier.steps("local") == [1]
