"""zstd where it pays: the peer and object tiers compress a chunk only when a sample of
it shrinks enough; other chunks go as raw zstd frames that any zstd decoder reads."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zstandard

import ckpt
from ckpt import LocalFolderStore, ObjectTier, ShardKey
from ckpt.objects import zstd_raw_frame
from ckpt.pacing import Pacing
from ckpt.peer import SealCheck
from ckpt.tiers import TierManifest

MIB = 1 << 20


def decompress_all(data: bytes) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    return reader.read()


@pytest.mark.parametrize("nbytes", [0, 1, 128 << 10, (128 << 10) + 1, 3 * MIB + 5])
def test_a_raw_frame_decodes_to_its_bytes_alone_and_between_compressed_frames(
    nbytes: int,
) -> None:
    data = os.urandom(nbytes)
    frame = b"".join(zstd_raw_frame(memoryview(data)))
    assert len(frame) == 6 + nbytes + 3 * max(1, -(-nbytes // (128 << 10)))
    assert decompress_all(bytes(frame)) == data

    packed = zstandard.ZstdCompressor().compress(b"head" * 100)
    mixed = packed + bytes(frame) + zstandard.ZstdCompressor().compress(b"tail")
    assert decompress_all(mixed) == b"head" * 100 + data + b"tail"


@pytest.mark.skipif(shutil.which("zstd") is None, reason="the zstd command is not installed")
def test_the_zstd_command_reads_a_raw_frame(tmp_path: Path) -> None:
    data = os.urandom(MIB + 7)
    path = tmp_path / "raw.zst"
    path.write_bytes(b"".join(zstd_raw_frame(memoryview(data))))
    out = subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True)
    assert out.stdout == data


def noise_and_zeros() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "noise": torch.randn(4 * MIB, generator=gen),  # 16 MiB of fp32: saves ~8%
        "zeros": torch.zeros(4 * MIB),
    }


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[Path, bytearray, ShardKey]]:
    key = ShardKey("job-1", 3, 0)
    shard = ckpt.encode(noise_and_zeros(), ref=key.ref())
    yield tmp_path, shard, key


def put_and_read(root: Path, shard: bytearray, key: ShardKey, pacing: Pacing) -> tuple[int, bytes]:
    tier = ObjectTier(LocalFolderStore(root), pacing=pacing)
    try:
        checksum = ckpt.verify(shard)
        tier.put(key, memoryview(shard), checksum)
        tier.commit(TierManifest(key.job, key.step, {key.rank: (checksum, len(shard))}))
        stored = (root / key.relpath(".zst")).stat().st_size
        found = tier.open(key)
        assert found is not None
        return stored, bytes(found.buffer)
    finally:
        tier.close()


def test_noise_goes_raw_and_zeros_compress_by_default_and_it_reads_back_bit_for_bit(
    stored: tuple[Path, bytearray, ShardKey],
) -> None:
    root, shard, key = stored
    size, back = put_and_read(root / "default", shard, key, Pacing())

    assert back == bytes(shard)
    noise = 16 * MIB
    assert noise < size < noise + MIB  # the noise stored raw, the zeros compressed away


def test_with_no_minimum_saving_every_chunk_is_compressed(
    stored: tuple[Path, bytearray, ShardKey],
) -> None:
    root, shard, key = stored
    size, back = put_and_read(root / "always", shard, key, Pacing(compress_min_saving=0))

    assert back == bytes(shard)
    assert size < 16 * MIB * 0.95  # zstd level 1 takes ~8% off fp32 noise


def test_a_half_precision_state_still_compresses_by_default(tmp_path: Path) -> None:
    key = ShardKey("job-1", 4, 0)
    gen = torch.Generator().manual_seed(1)
    shard = ckpt.encode(
        {"w": torch.randn(8 * MIB, generator=gen).to(torch.bfloat16)}, ref=key.ref()
    )
    size, back = put_and_read(tmp_path, shard, key, Pacing())

    assert back == bytes(shard)
    assert size < 16 * MIB * 0.85  # bf16 noise: ~22% smaller


def test_a_peer_seal_check_accepts_a_stream_of_raw_and_compressed_frames(
    stored: tuple[Path, bytearray, ShardKey],
) -> None:
    root, shard, key = stored
    tier = ObjectTier(LocalFolderStore(root))
    tier.put(key, memoryview(shard), ckpt.verify(shard))
    body = (root / key.relpath(".zst")).read_bytes()
    check = SealCheck(True, len(shard) + 1)
    for start in range(0, len(body), 100_000):
        check.feed(body[start : start + 100_000])

    assert check.problem() is None and check.total == len(shard)


@pytest.mark.parametrize("saving", [-0.1, 1.0, 2.0])
def test_a_minimum_saving_outside_0_to_1_is_refused(saving: float) -> None:
    with pytest.raises(ValueError, match="compress_min_saving"):
        Pacing(compress_min_saving=saving)
