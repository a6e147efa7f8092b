"""The agent's checkpoint service as its parts meet: how a copy that cannot be read is
answered, what closing a rank's store leaves behind, and a close within its limit."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentd.ckpt import CkptService
from agentd.ckpt.errors import copy_failed
from agentd.ckpt.rank_stores import RankStore
from ckpt import CheckpointError, FormatError, ShardCorrupt, TierError, UnsupportedVersion
from phalanx import wire

JOB = "job-1"


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[CkptService]:
    (tmp_path / "shm").mkdir()
    service = CkptService(
        "n01",
        tmp_path / "data",
        tmp_path / "shm",
        (tmp_path / "objects").as_uri(),
        lambda msg: None,
    )
    service.configure(JOB, 1, wire.CkptPlan(tiers=["ram", "nvme"]))
    try:
        yield service
    finally:
        await service.close(timeout=10)


@pytest.mark.parametrize(
    ("error", "corrupt"),
    [
        (ShardCorrupt("checksum mismatch"), True),
        (FormatError("bad magic"), True),
        (UnsupportedVersion("format version 9"), False),
        (TierError("connection refused", tier="object"), False),
        (TierError("does not decompress", tier="object", corrupt=True), True),
    ],
)
def test_a_copy_that_cannot_be_read_is_answered_502_and_corrupt_only_when_proven_bad(
    error: CheckpointError, corrupt: bool
) -> None:
    refusal = copy_failed(error, tier="object", step=7)

    assert refusal.status == 502
    assert refusal.extra == {"tier": "object", "step": 7, "corrupt": corrupt}
    assert str(refusal).startswith("tier object: ")


def ram_segments(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "shm").iterdir())


async def reserved_store(service: CkptService) -> RankStore:
    store = service.store(JOB, 0)
    await asyncio.to_thread(store.ram.reserve, 4096)
    return store


async def test_a_closed_rank_store_leaves_its_ram_segments_for_a_restarted_agent(
    service: CkptService, tmp_path: Path
) -> None:
    store = await reserved_store(service)
    segments = ram_segments(tmp_path)

    await asyncio.to_thread(store.close, 5.0)

    assert segments and ram_segments(tmp_path) == segments


async def test_a_freed_rank_store_removes_its_ram_segments(
    service: CkptService, tmp_path: Path
) -> None:
    store = await reserved_store(service)
    assert ram_segments(tmp_path)

    await asyncio.to_thread(store.close, 5.0, free=True)

    assert ram_segments(tmp_path) == []


async def test_close_cancels_a_catalog_applier_that_outlives_the_limit(
    service: CkptService, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, gate = threading.Event(), threading.Event()

    def stuck(store: RankStore, catalog: wire.CkptCatalog) -> bool:
        entered.set()  # a manifest write to a black-holed tier
        gate.wait(30)
        return True

    monkeypatch.setattr(service.commits, "apply", stuck)
    service.store(JOB, 0)
    await service.on_catalog(wire.CkptCatalog(job=JOB, node="n01", world_size=1, generation=1))
    assert await asyncio.to_thread(entered.wait, 10)
    try:
        await service.close(timeout=0.5)

        assert service.commits.tasks.closed and len(service.commits.tasks) == 0
    finally:
        gate.set()
