"""Shard files written with O_DIRECT where the filesystem and the source allow it,
through the page cache where not: the same bytes either way."""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt import DiskTier, Pacing, ShardKey
from ckpt.format import checksum


def shard_in_shared_memory(nbytes: int) -> Iterator[memoryview]:
    """A page-aligned, writable source like a RAM slot, with a valid trailer-sized tail."""
    mm = mmap.mmap(-1, nbytes)
    mm[:] = os.urandom(nbytes)
    view = memoryview(mm)
    yield view
    view.release()
    mm.close()


@pytest.fixture(params=["disk", "tmpfs"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "disk":
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:  # tmpfs refuses O_DIRECT
        yield Path(shm)


@pytest.mark.parametrize("nbytes", [3 * (1 << 20) + 4096 * 3 + 96, 1 << 20, 1000])
def test_a_shard_written_with_direct_io_holds_the_same_bytes(root: Path, nbytes: int) -> None:
    tier = DiskTier(root / "tier", pacing=Pacing(chunk_bytes=1 << 20, sync_bytes=2 << 20))
    for view in shard_in_shared_memory(nbytes):
        key = ShardKey("job", 1, 0)
        where = tier.put(key, view, checksum(view))
        assert Path(where).read_bytes() == bytes(view)


def test_a_read_only_source_goes_through_the_page_cache(tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    tier = DiskTier(tmp_path, pacing=Pacing(chunk_bytes=1 << 20, sync_bytes=1 << 20))
    where = tier.put(ShardKey("job", 2, 0), memoryview(data), checksum(data))
    assert Path(where).read_bytes() == data


def test_populating_a_shared_slot_for_write_keeps_its_content(tmp_path: Path) -> None:
    from ckpt.ram import populate_for_write

    path = tmp_path / "slot"
    content = os.urandom(1 << 20)
    path.write_bytes(content)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, len(content), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    populate_for_write(mm)
    assert mm[:] == content
    mm.close()
    assert path.read_bytes() == content
