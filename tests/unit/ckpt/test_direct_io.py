"""Shard files written with O_DIRECT where the filesystem and the source allow it,
through the page cache where not: the same bytes either way."""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from ckpt import DiskTier, LocalFolderStore, ObjectTier, Pacing, ShardKey, files
from ckpt.format import BufferLike, checksum
from ckpt.objects import _regroup
from ckpt.stores import PART_NBYTES
from ckpt.tiers import TierManifest


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


@pytest.mark.parametrize("compression", ["zstd", None])
def test_the_folder_object_store_writes_whole_parts_by_direct_io(
    root: Path, compression: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[bool, bool]] = []  # (asked for O_DIRECT on, got it on)
    real = files._set_direct

    def recorded(fd: int, on: bool) -> bool:
        got = real(fd, on)
        asked.append((on, got))
        return got

    monkeypatch.setattr(files, "_set_direct", recorded)
    store = LocalFolderStore(root / "objects")
    aligned: list[int] = []  # of each part, the bytes an O_DIRECT write can take
    put_stream = store.put_stream

    def put_parts(key: str, parts: Iterable[BufferLike]) -> None:
        def seen() -> Iterator[BufferLike]:
            for part in parts:
                aligned.append(files._aligned_prefix(memoryview(part)))
                yield part

        put_stream(key, seen())

    monkeypatch.setattr(store, "put_stream", put_parts)
    tier = ObjectTier(store, compression=compression)
    key = ShardKey("job", 1, 0)
    for view in shard_in_shared_memory(2 * PART_NBYTES + 3 * 4096 + 123):
        sealed = checksum(view)
        tier.put(key, view, sealed)
        asked_for_the_shard, aligned_parts = list(asked), list(aligned)
        tier.commit(TierManifest(key.job, key.step, {key.rank: (sealed, len(view))}))
        found = tier.open(key)
        assert found is not None and bytes(found.buffer) == bytes(view)
    tier.close()

    assert aligned_parts[:2] == [PART_NBYTES, PART_NBYTES]  # whole parts: page-aligned
    first, *then = asked_for_the_shard
    assert first[0]  # asked for (tmpfs before Linux 6.6 refuses: the cache throughout)
    if first[1]:
        assert then == [(False, False)]  # only the tail that is no whole page went through it


@pytest.mark.parametrize(
    "sizes", [[1], [PART_NBYTES], [3, PART_NBYTES - 3, 7], [PART_NBYTES // 3] * 7, [0, 5, 0]]
)
def test_parts_refilled_into_one_buffer_are_the_parts_joined(sizes: list[int]) -> None:
    pieces = [os.urandom(n) for n in sizes]
    joined = [bytes(part) for part in _regroup(pieces)]
    buffer = files.AlignedBuffer(PART_NBYTES)
    refilled = [bytes(part) for part in _regroup(pieces, buffer)]  # copied before the next

    assert refilled == joined
    assert b"".join(refilled) == b"".join(pieces)
    assert all(len(part) == PART_NBYTES for part in refilled[:-1])


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


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 253:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:50 / /mnt/shared rw,relatime - nfs4 server:/export rw,vers=4.2
41 40 0:51 / /mnt/shared/scratch rw,relatime - xfs /dev/nvme0n1 rw
42 27 0:52 / /mnt/my\\040disk rw,relatime - fuse.s3fs s3fs rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/mnt/shared/ckpt", "nfs4"),
        ("/mnt/shared", "nfs4"),
        ("/mnt/sharedx/a", "ext4"),
        ("/mnt/shared/scratch/a", "xfs"),
        ("/mnt/my disk/a", "fuse.s3fs"),
        ("/var/tmp", "ext4"),
    ],
)
def test_the_filesystem_of_a_path_is_that_of_its_deepest_mount(path: str, kind: str) -> None:
    assert files.filesystem_type(Path(path), MOUNTINFO) == kind


def test_a_folder_on_a_network_filesystem_is_written_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert LocalFolderStore(tmp_path / "local").direct  # this test's own disk
    monkeypatch.setattr("ckpt.stores.filesystem_type", lambda path: "nfs4")
    shared = LocalFolderStore(tmp_path / "shared")
    asked: list[bool] = []
    real = files._set_direct
    monkeypatch.setattr(files, "_set_direct", lambda fd, on: asked.append(on) or real(fd, on))
    tier = ObjectTier(shared, compression=None)
    for view in shard_in_shared_memory(PART_NBYTES + 4096):
        tier.put(ShardKey("job", 1, 0), view, checksum(view))
        assert (tmp_path / "shared" / "job/000000000001/rank-00000.phx").read_bytes() == bytes(view)

    assert not shared.direct and asked == []
