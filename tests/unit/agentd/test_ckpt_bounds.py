"""Memory bounds of the checkpoint store's readers: nothing a peer, an object store or a
manifest says about a size is trusted with memory.

Real payloads against real servers and files: zstd bombs, bodies past a limit, and
copies whose size lies, sent to a buddy's peer routes (aiohttp on a loopback port),
read from an object tier's folder, and streamed to a rank through the agent
(``AgentHarness``) or a fake agent on a unix socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import http.client
import json
import os
import struct
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zstandard
from aiohttp import web

import ckpt
from agentd.access import Access
from agentd.ckpt import add_peer_routes
from agentd.config import CkptSettings
from ckpt import (
    Checkpointer,
    CheckpointError,
    FormatError,
    HttpPeerStore,
    LocalFolderStore,
    ObjectTier,
    ObjectTooLarge,
    Pacing,
    PeerError,
    SealCheck,
    ShardKey,
    TierError,
)
from ckpt.remote import AgentClient, AgentEnv
from ckpt.stores import MAX_GET_NBYTES
from ckpt.tiers import TierManifest
from phalanx.http import serve
from tests.unit.agentd.test_ckpt_agent_mode import JOB, AgentHarness
from tests.unit.ckpt.helpers import (
    COPY_PATHS,
    assert_bit_identical,
    finish_reservations,
    hold_every_ram_slot,
    small_tmpfs,
)

GIB = 1 << 30
MIB = 1 << 20
TOKEN = "peer-token"


@functools.cache
def zstd_bomb(content_nbytes: int) -> bytes:
    """Zeros as zstd frames of 256 MiB each: about 32 KiB per GiB of content."""
    frame_nbytes = 256 * MIB
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    zeros = bytes(MIB)
    frame = b"".join(
        [compressor.compress(zeros) for _ in range(frame_nbytes // MIB)] + [compressor.flush()]
    )
    return frame * (content_nbytes // frame_nbytes)


def preamble(at_most: int) -> bytes:
    """A shard's preamble (version 2, a 2-byte header) declaring the largest size the
    format allows up to ``at_most`` bytes."""
    nbytes = 96 + (at_most - 96) // 64 * 64  # data_start 64, the trailer, whole data units
    return struct.pack("<8sIIQQ", b"PHXSHARD", 2, 2, nbytes, 0)


def declared(head: bytes) -> int:
    return int(struct.unpack_from("<Q", head, 16)[0])


def shard_bomb(content_nbytes: int, at_most: int) -> bytes:
    """A zstd body whose content is a preamble declaring at most ``at_most`` bytes, then
    ``content_nbytes`` of zeros (``zstd_bomb``: zstd frames decompress one after another)."""
    return zstandard.ZstdCompressor().compress(preamble(at_most)) + zstd_bomb(content_nbytes)


def sealed(state: Any, key: ShardKey) -> tuple[bytearray, str]:
    shard = ckpt.encode(state, ref=key.ref())
    return shard, ckpt.verify(shard)


# --------------------------------------------------------------------------- object tier


@pytest.fixture
def committed(tmp_path: Path) -> Iterator[tuple[ObjectTier, ShardKey, bytearray]]:
    """An object tier on a real folder holding one committed step of one rank."""
    tier = ObjectTier(LocalFolderStore(tmp_path / "objects"))
    key = ShardKey("job-1", 7, 0)
    shard, checksum = sealed({"w": torch.arange(1000, dtype=torch.float32)}, key)
    tier.put(key, memoryview(shard), checksum)
    tier.commit(TierManifest(key.job, key.step, {0: (checksum, len(shard))}))
    yield tier, key, shard
    tier.close()


def object_path(tier: ObjectTier, key: ShardKey) -> Path:
    assert isinstance(tier.store, LocalFolderStore)
    return tier.store.root / key.relpath(".zst")


def test_an_object_longer_than_its_manifest_lists_is_a_tier_error_naming_it(
    committed: tuple[ObjectTier, ShardKey, bytearray],
) -> None:
    tier, key, shard = committed
    object_path(tier, key).write_bytes(zstandard.ZstdCompressor().compress(bytes(shard) + b"x"))

    with pytest.raises(TierError) as refused:
        tier.open(key)

    assert refused.value.tier == "object"
    assert f"more than the {len(shard)} bytes its manifest lists" in str(refused.value)
    assert key.relpath(".zst") in str(refused.value)


def test_a_zstd_bomb_in_the_object_store_stops_at_the_manifest_size_in_bounded_memory(
    committed: tuple[ObjectTier, ShardKey, bytearray],
) -> None:
    tier, key, shard = committed
    object_path(tier, key).write_bytes(zstd_bomb(16 * GIB))

    tracemalloc.start()
    try:
        with pytest.raises(TierError, match=f"more than the {len(shard)} bytes"):
            tier.open(key)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 64 * MIB  # 16 GiB of content behind it


def test_a_manifest_that_lies_upward_costs_only_the_real_content_and_reads_as_corrupt(
    committed: tuple[ObjectTier, ShardKey, bytearray],
) -> None:
    tier, key, shard = committed
    assert isinstance(tier.store, LocalFolderStore)
    manifest_path = tier.store.root / key.job / "000000000007" / "manifest.json"
    raw = json.loads(manifest_path.read_text())
    raw["shards"][0]["nbytes"] = 1 << 40  # one TiB
    manifest_path.write_text(json.dumps(raw))

    try:
        stored = tier.open(key)
    except TierError as exc:  # a system that refuses even to reserve the address space
        assert "no room for the 1099511627776 bytes" in str(exc)
        return
    assert stored is not None and len(memoryview(stored.buffer)) == len(shard)
    with pytest.raises(CheckpointError):
        ckpt.decode(stored.buffer, expected=stored.expected, ref=key.ref())


def test_an_object_tier_refuses_a_manifest_size_other_than_the_catalogs(
    committed: tuple[ObjectTier, ShardKey, bytearray],
) -> None:
    tier, key, shard = committed

    with pytest.raises(
        TierError, match=f"lists {len(shard)} bytes, not the 99 bytes the catalog lists"
    ):
        tier.reader(key, 99)


def test_an_object_store_get_stops_at_its_limit(
    committed: tuple[ObjectTier, ShardKey, bytearray],
) -> None:
    tier, key, _ = committed

    with pytest.raises(ObjectTooLarge, match="larger than the 100-byte limit") as refused:
        tier.store.get(key.relpath(".zst"), max_nbytes=100)

    assert key.relpath(".zst") in refused.value.what


# --------------------------------------------------------------------------- peer tier


def test_a_seal_check_stops_decompressing_a_zstd_bomb_at_its_declared_size_in_bounded_memory() -> (
    None
):
    bomb = shard_bomb(16 * GIB, at_most=64 * MIB)
    size = declared(preamble(64 * MIB))
    seal = SealCheck(True, 64 * MIB, "job-1/000000000001/rank-00000.phx.zst")

    tracemalloc.start()
    try:
        with pytest.raises(
            ObjectTooLarge,
            match=r"\(decompressed\) is larger than the "
            f"{size}-byte limit its preamble declares",
        ):
            for start in range(0, len(bomb), 64 << 10):
                seal.feed(bomb[start : start + (64 << 10)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert seal.total <= size
    assert peak < 16 * MIB


def test_a_seal_check_refuses_a_preamble_declaring_past_its_limit_at_once() -> None:
    seal = SealCheck(False, 64 * MIB, "its content")

    with pytest.raises(
        ObjectTooLarge, match=rf"its preamble declares {declared(preamble(1 << 40))}"
    ):
        seal.feed(preamble(1 << 40))

    assert seal.total == 0


def test_a_seal_check_refuses_content_that_is_no_shard_from_its_first_bytes() -> None:
    seal = SealCheck(True, 64 * MIB, "its content")

    with pytest.raises(FormatError, match="not a Phalanx shard"):
        seal.feed(zstd_bomb(GIB))

    assert seal.total == 0


@contextlib.asynccontextmanager
async def running_buddy(root: Path, limit: int) -> AsyncIterator[HttpPeerStore]:
    """A buddy's peer routes on a loopback port, keeping objects under ``root`` and
    refusing shards past ``limit`` bytes."""
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-peer")
    agent = SimpleNamespace(
        node="n02",
        ckpt=SimpleNamespace(
            peer_root=root, peer_io=pool, peer_store=LocalFolderStore(root), pacing=Pacing()
        ),
    )
    app = web.Application()
    add_peer_routes(
        app,
        agent,
        Access("n02", TOKEN),
        max_shard_bytes=CkptSettings(peer_max_shard_bytes=limit).peer_max_shard_bytes,
    )
    try:
        async with serve(
            app, lambda runner: web.TCPSite(runner, "127.0.0.1", 0), "test buddy"
        ) as runner:
            yield HttpPeerStore("n02", "127.0.0.1", runner.addresses[0][1], TOKEN, timeout_s=60)
    finally:
        pool.shutdown(wait=True)


@pytest.fixture
async def buddy(tmp_path: Path) -> AsyncIterator[tuple[HttpPeerStore, Path]]:
    """A buddy refusing shards past 8 MiB."""
    root = tmp_path / "ckpt-peer"
    async with running_buddy(root, 8 * MIB) as store:
        yield store, root


async def cut_short(request: web.Request) -> web.StreamResponse:
    """Announce 1000 bytes, send 600, close the connection."""
    resp = web.StreamResponse()
    resp.content_length = 1000
    await resp.prepare(request)
    await resp.write(bytes(600))
    assert request.transport is not None
    request.transport.close()
    return resp


async def test_a_buddy_that_cuts_its_answer_short_is_a_failed_transfer_not_a_short_copy(
    tmp_path: Path,
) -> None:
    # http.client ends a body cut short without an error; the peer store must not.
    app = web.Application()
    app.router.add_get("/v1/ckpt/peer/objects/{key:.+}", cut_short)
    async with serve(
        app, lambda runner: web.TCPSite(runner, "127.0.0.1", 0), "cutting buddy"
    ) as runner:
        store = HttpPeerStore("n02", "127.0.0.1", runner.addresses[0][1], TOKEN, timeout_s=10)

        def read() -> int:
            return sum(map(len, store.get_stream("job-1/000000000005/rank-00001.phx.zst")))

        with pytest.raises(PeerError, match="closed the connection 400 bytes short of the 1000"):
            await asyncio.to_thread(read)


def stored_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


async def test_a_buddy_refuses_a_zstd_bomb_with_413_naming_the_limit_and_stores_nothing(
    buddy: tuple[HttpPeerStore, Path],
) -> None:
    store, root = buddy

    with pytest.raises(PeerError) as refused:
        await asyncio.to_thread(
            store.put_stream,
            "job-1/000000000001/rank-00000.phx.zst",
            [shard_bomb(GIB, at_most=1 << 40)],
        )

    assert "answered 413" in str(refused.value)
    assert "content (decompressed) is larger than the 8388608-byte limit" in str(refused.value)
    assert f"its preamble declares {declared(preamble(1 << 40))}" in str(refused.value)
    assert "peer_max_shard_bytes is 8388608" in str(refused.value)
    assert stored_files(root) == []


async def test_a_buddy_refuses_a_zstd_bomb_past_the_size_its_preamble_declares(
    buddy: tuple[HttpPeerStore, Path],
) -> None:
    store, root = buddy  # its limit: 8 MiB
    size = declared(preamble(4096))

    with pytest.raises(PeerError) as refused:
        await asyncio.to_thread(
            store.put_stream,
            "job-1/000000000001/rank-00000.phx.zst",
            [shard_bomb(GIB, at_most=4096)],
        )

    assert "answered 413" in str(refused.value)
    assert f"larger than the {size}-byte limit its preamble declares" in str(refused.value)
    assert stored_files(root) == []


async def test_a_buddy_refuses_a_shard_push_whose_first_bytes_are_no_shard_with_422(
    buddy: tuple[HttpPeerStore, Path],
) -> None:
    store, root = buddy

    with pytest.raises(PeerError, match=r"answered 422.*not a Phalanx shard"):
        await asyncio.to_thread(
            store.put_stream, "job-1/000000000001/rank-00000.phx.zst", [zstd_bomb(GIB)]
        )

    assert stored_files(root) == []


async def test_a_buddy_refuses_a_manifest_past_what_its_readers_accept(
    buddy: tuple[HttpPeerStore, Path],
) -> None:
    store, root = buddy  # a manifest used to be capped only by the 8 MiB shard limit
    pieces = [bytes(MIB)] * (MAX_GET_NBYTES // MIB) + [b"x"]

    with pytest.raises(PeerError) as refused:
        await asyncio.to_thread(store.put_stream, "job-1/000000000001/manifest.json", pieces)

    assert "answered 413" in str(refused.value)
    assert f"its body is larger than the {MAX_GET_NBYTES}-byte limit" in str(refused.value)
    assert stored_files(root) == []


async def test_a_buddy_refuses_a_streamed_body_past_its_limit_with_413_and_stores_nothing(
    buddy: tuple[HttpPeerStore, Path],
) -> None:
    store, root = buddy
    pieces = [preamble(8 * MIB), *(os.urandom(MIB) for _ in range(12))]

    with pytest.raises(PeerError, match=r"answered 413.*larger than the"):
        await asyncio.to_thread(store.put_stream, "job-1/000000000001/rank-00000.phx", pieces)

    assert stored_files(root) == []


async def test_a_buddy_refuses_a_declared_length_past_its_limit_before_reading_the_body(
    buddy: tuple[HttpPeerStore, Path],
) -> None:
    store, root = buddy

    def put_headers_only() -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection(store.address, store.port, timeout=30)
        try:
            conn.putrequest("PUT", "/v1/ckpt/peer/objects/job-1/000000000001/rank-00000.phx")
            conn.putheader("Authorization", f"Bearer {TOKEN}")
            conn.putheader("Content-Length", str(1 << 40))
            conn.endheaders()  # and never a byte of the TiB it announced
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    status, answer = await asyncio.to_thread(put_headers_only)

    assert status == 413
    assert answer["limit"] == 8 * MIB and "1099511627776 bytes" in answer["error"]
    assert stored_files(root) == []


async def test_a_buddy_stores_a_sealed_compressed_shard_under_its_limit(
    buddy: tuple[HttpPeerStore, Path],
) -> None:
    store, root = buddy
    key = ShardKey("job-1", 1, 0)
    shard, _ = sealed({"w": torch.zeros(MIB)}, key)  # 4 MiB of content: under the limit

    await asyncio.to_thread(
        store.put_stream,
        key.relpath(".zst"),
        [zstandard.ZstdCompressor(level=1).compress(bytes(shard))],
    )

    assert stored_files(root) == [root / key.relpath(".zst")]


async def test_a_buddy_stores_a_shard_of_many_parts_bit_for_bit_whatever_the_pieces(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt-peer"
    key = ShardKey("job-1", 2, 0)
    shard, _ = sealed({"w": torch.randn(5 * MIB + 333)}, key)  # 20 MiB and an odd tail
    pieces = [bytes(shard[i : i + 3 * MIB + 1]) for i in range(0, len(shard), 3 * MIB + 1)]

    async with running_buddy(root, 64 * MIB) as store:
        await asyncio.to_thread(store.put_stream, key.relpath(), pieces)

    assert stored_files(root) == [root / key.relpath()]  # no temp file left beside it
    assert (root / key.relpath()).read_bytes() == bytes(shard)


async def test_a_buddy_whose_disk_is_full_answers_507_naming_it_and_keeps_what_it_had(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "small", "4m") as root:
        kept, _ = sealed({"w": torch.ones(128 << 10)}, ShardKey("job-1", 1, 0))  # 512 KiB
        # 12 MiB: the disk fills while the first 8 MiB part goes out, mid-body
        big, _ = sealed({"w": torch.ones(3 * MIB)}, ShardKey("job-1", 2, 0))
        async with running_buddy(root, 64 * MIB) as store:
            await asyncio.to_thread(
                store.put_stream, "job-1/000000000001/rank-00000.phx", [bytes(kept)]
            )
            with pytest.raises(PeerError) as full:
                await asyncio.to_thread(
                    store.put_stream, "job-1/000000000002/rank-00000.phx", [bytes(big)]
                )

        assert "answered 507" in str(full.value) and "disk is full" in str(full.value)
        assert "000000000002/rank-00000.phx" in str(full.value)
        assert stored_files(root) == [root / "job-1/000000000001/rank-00000.phx"]
        assert (root / "job-1/000000000001/rank-00000.phx").read_bytes() == bytes(kept)


# --------------------------------------------------------------------------- the rank route


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentHarness]:
    (tmp_path / "shm").mkdir()
    harness = AgentHarness(tmp_path)
    for key, value in harness.env().items():
        monkeypatch.setenv(key, value)
    yield harness
    harness.close()


def leave_only_the_object_copy(agent: AgentHarness, step: int) -> bytes:
    """Remove the RAM and NVMe copies of ``step``; the shard's bytes, as sealed."""
    for segment in (agent.root / "shm").iterdir():
        segment.unlink()
    nvme = agent.root / "data" / "ckpt" / ShardKey(JOB, step, 0).relpath()
    shard = nvme.read_bytes()
    nvme.unlink()
    return shard


def save_and_commit(state: Any, step: int) -> None:
    c = Checkpointer()
    c.save(step, state)
    c.wait(timeout=60)
    c.close()


def staged_in_ram(agent: AgentHarness, step: int) -> bool:
    """Whether one of rank 0's RAM slot files now holds ``step``, sealed."""
    from ckpt.ram import read_slot_view
    from ckpt.remote import read_file

    for segment in (agent.root / "shm").iterdir():
        mm = read_file(str(segment))
        if mm is not None and read_slot_view(mm, step) is not None:
            return True
    return False


@COPY_PATHS
def test_a_rank_restores_a_shard_of_many_pieces_from_the_object_tier(
    agent: AgentHarness, path: str
) -> None:
    state = {"w": torch.randn(5 * MIB), "step": 3}  # 20 MiB: three pieces on the wire
    save_and_commit(state, 3)
    leave_only_the_object_copy(agent, 3)
    if path == "streamed":
        hold_every_ram_slot()

    reader = Checkpointer()
    found = reader.restore(step=3, into={"w": torch.zeros(5 * MIB), "step": 0})

    assert found is not None and found[0] == 3 and reader.restored_from == "object"
    assert_bit_identical(found[1], state)
    assert staged_in_ram(agent, 3) == (path == "staged")


@COPY_PATHS
def test_an_object_copy_longer_than_the_catalog_lists_is_refused_by_the_agent(
    agent: AgentHarness, path: str
) -> None:
    save_and_commit({"w": torch.ones(100)}, 4)
    shard = leave_only_the_object_copy(agent, 4)
    obj = agent.root / "objects" / ShardKey(JOB, 4, 0).relpath(".zst")
    obj.write_bytes(zstandard.ZstdCompressor().compress(shard + b"\0" * MIB))
    if path == "streamed":
        hold_every_ram_slot()

    with pytest.raises(CheckpointError, match=f"more than the {len(shard)} bytes its manifest"):
        Checkpointer().restore(step=4)
    assert not staged_in_ram(agent, 4)


@COPY_PATHS
def test_an_object_copy_that_runs_long_mid_body_is_refused(agent: AgentHarness, path: str) -> None:
    save_and_commit({"w": torch.randn(3 * MIB)}, 5)  # 12 MiB: the excess is in piece two
    shard = leave_only_the_object_copy(agent, 5)
    obj = agent.root / "objects" / ShardKey(JOB, 5, 0).relpath(".zst")
    obj.write_bytes(zstandard.ZstdCompressor().compress(shard + b"\0" * MIB))
    if path == "streamed":
        hold_every_ram_slot()
    # Staged, the agent reads past the end itself; streamed, it cuts the body off.
    why = (
        f"more than the {len(shard)} bytes its manifest lists"
        if path == "staged"
        else f"ended after {8 * MIB} of its {len(shard)} bytes"
    )

    with pytest.raises(CheckpointError, match=why):
        Checkpointer().restore(step=5)
    assert not staged_in_ram(agent, 5)


def test_a_copy_the_agent_has_no_ram_to_stage_is_streamed(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {"w": torch.randn(MIB), "step": 8}
    save_and_commit(state, 8)
    leave_only_the_object_copy(agent, 8)  # its slot files gone: staging must allocate one

    def full(fd: int, offset: int, length: int) -> None:  # the fault: /dev/shm is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    reader = Checkpointer()
    found = reader.restore(step=8)

    assert found is not None and reader.restored_from == "object"
    assert_bit_identical(found[1], state)
    assert not [m for m in agent.landings if m.event == "corrupt"]


def test_a_staged_copy_that_does_not_verify_is_reported_and_never_sealed_in_ram(
    agent: AgentHarness,
) -> None:
    save_and_commit({"w": torch.randn(MIB)}, 6)
    shard = bytearray(leave_only_the_object_copy(agent, 6))
    shard[len(shard) // 2] ^= 0xFF  # one bit of the content, under an intact size and seal
    obj = agent.root / "objects" / ShardKey(JOB, 6, 0).relpath(".zst")
    obj.write_bytes(zstandard.ZstdCompressor().compress(bytes(shard)))

    with pytest.raises(CheckpointError, match="content hashes to"):
        Checkpointer().restore(step=6)

    assert not staged_in_ram(agent, 6)
    corrupt = [m for m in agent.landings if m.event == "corrupt"]
    assert [(m.step, m.tier) for m in corrupt] == [(6, "object")]


# --------------------------------------------------------------------------- the rank's reader


@contextlib.asynccontextmanager
async def fake_agent(socket: Path, handler: Any) -> AsyncIterator[AgentClient]:
    """A unix-socket server answering ``GET /v1/ckpt/shard`` with ``handler``."""
    app = web.Application()
    app.router.add_get("/v1/ckpt/shard", handler)
    async with serve(app, lambda runner: web.UnixSite(runner, str(socket)), "fake agent"):
        yield AgentClient(AgentEnv(str(socket), JOB, 1, 0, 1), timeout_s=30)


async def test_the_rank_refuses_an_announced_length_past_the_catalogs_size(
    tmp_path: Path,
) -> None:
    async def longer(request: web.Request) -> web.Response:
        return web.Response(body=bytes(2000))

    async with fake_agent(tmp_path / "a.sock", longer) as client:
        with pytest.raises(TierError, match="sends 2000 bytes for step 1, more than the 1000"):
            await asyncio.to_thread(client.fetch_shard, "object", 1, 1000)


async def test_the_rank_stops_reading_an_endless_body_one_byte_past_the_catalogs_size(
    tmp_path: Path,
) -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # chunked, no length announced
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            while True:
                await resp.write(bytes(MIB))
        return resp

    async with fake_agent(tmp_path / "a.sock", endless) as client:
        with pytest.raises(TierError, match="sends more than the 3000000 bytes"):
            await asyncio.to_thread(client.fetch_shard, "peer", 1, 3_000_000)


async def test_the_rank_reports_a_body_shorter_than_announced_as_a_tier_error(
    tmp_path: Path,
) -> None:
    async with fake_agent(tmp_path / "a.sock", cut_short) as client:
        with pytest.raises(TierError, match="ended after 600 of its 1000 bytes"):
            await asyncio.to_thread(client.fetch_shard, "object", 1, 1000)


async def test_the_rank_reads_a_body_of_the_catalogs_size_into_one_buffer(
    tmp_path: Path,
) -> None:
    body = os.urandom(3 * MIB + 5)

    async def exact(request: web.Request) -> web.Response:
        return web.Response(body=body)

    async def absent(request: web.Request) -> web.Response:
        return web.Response(body=b"")

    async with fake_agent(tmp_path / "a.sock", exact) as client:
        got = await asyncio.to_thread(client.fetch_shard, "object", 1, len(body))
    async with fake_agent(tmp_path / "b.sock", absent) as client:
        gone = await asyncio.to_thread(client.fetch_shard, "object", 1, len(body))

    assert isinstance(got, bytearray) and got == body
    assert gone is None


async def test_a_rank_streams_the_copy_from_an_older_agent_that_stages_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent from before ``/v1/ckpt/stage`` (a rolling upgrade) answers it 404."""
    state = {"w": torch.randn(MIB), "step": 7}
    shard = ckpt.encode(state, ref=ShardKey(JOB, 7, 0).ref())
    plan = {
        "steps": [
            {
                "step": 7,
                "candidates": [
                    {"tier": "object", "checksum": ckpt.checksum(shard), "nbytes": len(shard)}
                ],
            }
        ]
    }

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"tiers": ["ram", "object"]})

    async def restore(request: web.Request) -> web.Response:
        return web.json_response(plan)

    async def shard_route(request: web.Request) -> web.Response:
        return web.Response(body=bytes(shard))

    app = web.Application()
    app.router.add_post("/v1/ckpt/hello", hello)
    app.router.add_get("/v1/ckpt/restore", restore)
    app.router.add_get("/v1/ckpt/shard", shard_route)
    socket = tmp_path / "older.sock"
    for key, value in AgentHarness.env(SimpleNamespace(socket=socket)).items():  # type: ignore[arg-type]
        monkeypatch.setenv(key, value)
    async with serve(app, lambda runner: web.UnixSite(runner, str(socket)), "older agent"):
        found = await asyncio.to_thread(lambda: Checkpointer().restore())
        await asyncio.to_thread(finish_reservations)  # it asks this agent to reserve, too

    assert found is not None and found[0] == 7
    assert_bit_identical(found[1], state)
