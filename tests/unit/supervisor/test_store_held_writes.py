"""Writes a wing holds back within a batch and makes at once before its COMMIT
(``Store.before_commit``, ``Store.write_many``): the checkpoint catalog's shard rows,
one statement for a batch's landings instead of one each (issue 22).

The stores are real (SQLite and PostgreSQL); the only stand-in is a wrapper that counts
the store's ``write_many`` calls.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from phalanx import wire
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.rows import CkptRows
from supervisor.errors import StoreError
from supervisor.store import Store
from tests.unit.supervisor.conftest import OpenStore


def kinds(store: Store) -> list[str]:
    return [e.kind for e in store.events()]


def count_write_many(monkeypatch: pytest.MonkeyPatch, store: Store) -> list[int]:
    """The rows of each ``store.write_many`` call from now on."""
    calls: list[int] = []
    real = store.write_many

    def counted(sql: str, rows: Any) -> None:
        calls.append(len(rows))
        real(sql, rows)

    monkeypatch.setattr(store, "write_many", counted)
    return calls


def landing(step: int, rank: int, nbytes: int = 100) -> wire.CkptLanding:
    return wire.CkptLanding.model_construct(  # nbytes past the wire's bound in one test
        **wire.CkptLanding(
            node=f"n{rank:02d}",
            job="j-1",
            step=step,
            rank=rank,
            tier="nvme",
            nbytes=100,
            checksum=f"xxh3_128:{rank:032x}",
            at=time.time(),
        ).model_dump()
        | {"nbytes": nbytes}
    )


# --- the store -----------------------------------------------------------------------


async def test_the_hooks_run_at_the_end_of_each_batchs_block_in_its_transaction(
    open_store: OpenStore,
) -> None:
    store = open_store()
    seen: list[tuple[bool, bool]] = []

    def hook() -> None:
        seen.append((store.in_batch, store.db.in_transaction))
        store.add_event("held", None, {})  # written in the transaction being committed

    store.before_commit(hook)
    assert not store.in_batch
    with store.batch():
        assert store.in_batch
        with store.batch():  # nested: joins the outer one, whose end runs the hooks
            store.add_event("inner", None, {})
        assert store.in_batch
        assert seen == []
    assert not store.in_batch
    async with store.batch_async():
        assert store.in_batch
        store.add_event("async", None, {})
    assert not store.in_batch
    assert seen == [(True, True), (True, True)]
    assert kinds(open_store()) == ["inner", "held", "async", "held"]  # committed


async def test_a_block_that_raises_runs_no_hook_and_a_hook_that_raises_rolls_back(
    open_store: OpenStore,
) -> None:
    store = open_store()
    fail = False
    ran = 0

    def hook() -> None:
        nonlocal ran
        ran += 1
        if fail:
            raise ValueError("a value the store cannot take")

    store.before_commit(hook)
    with pytest.raises(RuntimeError), store.batch():
        store.add_event("lost", None, {})
        raise RuntimeError("the block failed")
    assert ran == 0
    fail = True
    with pytest.raises(ValueError, match="cannot take"), store.batch():
        store.add_event("lost", None, {})
    with pytest.raises(ValueError, match="cannot take"):
        async with store.batch_async():
            store.add_event("lost", None, {})
    assert ran == 2
    assert not store.in_batch
    assert kinds(store) == []  # both rolled back
    fail = False
    with store.batch():
        store.add_event("kept", None, {})
    assert kinds(open_store()) == ["kept"]


def test_write_many_writes_each_row_and_names_the_store_when_it_fails(
    open_store: OpenStore,
) -> None:
    store = open_store()
    sql = "INSERT INTO events (ts, kind, node, detail) VALUES (?, ?, ?, ?)"
    store.write_many(sql, [(1.0, "a", None, "{}"), (2.0, "b", "n1", "{}")])  # autocommit
    with store.batch():
        store.write_many(sql, [(3.0, "c", None, "{}")])
    assert kinds(open_store()) == ["a", "b", "c"]
    with pytest.raises(StoreError, match="cannot write the supervisor store"):
        store.write_many("INSERT INTO no_such_table VALUES (?)", [(1,)])


# --- the checkpoint catalog's shard rows ---------------------------------------------


def test_a_batchs_landings_are_written_by_one_statement_before_its_commit(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    catalog = CheckpointCatalog(store)
    calls = count_write_many(monkeypatch, store)
    with store.batch():
        for rank in range(3):
            assert not catalog.on_landing(landing(5, rank), world_size=4)
        assert calls == []  # held, the step's rows read once (its first landing)
    assert calls == [3]
    assert sorted(CkptRows.of(open_store()).shard_rows_of("j-1", 5, "nvme")) == [0, 1, 2]
    # The last rank commits the step; outside a batch its row is written at once.
    assert catalog.on_landing(landing(5, 3), world_size=4)
    assert calls == [3]
    assert CkptRows.of(open_store()).commits("j-1")[0][:2] == (5, "nvme")


def test_what_is_read_or_written_in_the_batch_comes_after_the_rows_held(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    rows = CkptRows.of(store)
    calls = count_write_many(monkeypatch, store)
    with store.batch():
        for rank in range(3):
            rows.add_shard("j-1", 5, "nvme", rank, f"n{rank:02d}", None, 10, "c", 1.0)
        assert calls == []
        assert sorted(rows.shard_rows_of("j-1", 5, "nvme")) == [0, 1, 2]  # a read: written
        rows.add_shard("j-1", 5, "nvme", 1, "n09", None, 20, "d", 2.0)
        assert rows.drop_shard("j-1", 5, "nvme", 1)  # deletes the newer row, held before
        rows.add_shard("j-1", 5, "nvme", 3, "n03", None, 10, "c", 1.0)
    assert calls == [3, 1, 1]
    found = CkptRows.of(open_store()).shard_rows_of("j-1", 5, "nvme")
    assert sorted(found) == [0, 2, 3]


def test_rows_held_by_a_batch_that_fails_are_never_written_by_the_next(
    open_store: OpenStore,
) -> None:
    store = open_store()
    rows = CkptRows.of(store)
    with pytest.raises(RuntimeError), store.batch():
        rows.add_shard("j-1", 5, "nvme", 0, "n00", None, 10, "c", 1.0)
        raise RuntimeError("the flush failed half way")
    with store.batch():
        rows.add_shard("j-1", 6, "nvme", 0, "n00", None, 10, "c", 1.0)
    again = CkptRows.of(open_store())
    assert again.shard_rows_of("j-1", 5, "nvme") == {}
    assert sorted(again.shard_rows_of("j-1", 6, "nvme")) == [0]


def test_a_held_row_the_store_cannot_take_fails_its_batch_and_nothing_of_it_is_kept(
    open_store: OpenStore,
) -> None:
    store = open_store()
    catalog = CheckpointCatalog(store)
    with pytest.raises((ValueError, OverflowError)), store.batch():
        assert not catalog.on_landing(landing(5, 0), world_size=2)
        assert not catalog.on_landing(landing(5, 1, nbytes=2**63), world_size=2)
    catalog.forget()
    assert CkptRows.of(store).shard_rows_of("j-1", 5, "nvme") == {}
    with store.batch():
        assert not catalog.on_landing(landing(5, 0), world_size=2)
    assert catalog.on_landing(landing(5, 1), world_size=2)
    assert CkptRows.of(open_store()).commits("j-1")[0][:2] == (5, "nvme")


def test_a_store_from_before_loses_its_index_by_rank_and_still_finds_a_ranks_saves(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    store = Store(path)
    rows = CkptRows.of(store)
    for tier in ("nvme", "object"):
        rows.add_shard("j-1", 5, tier, 3, "n03", None, 10, "xxh3:c", 1.0, generation=2)
    store.db.execute("CREATE INDEX ckpt_shards_rank ON ckpt_shards (job, step, rank)")
    store.close()
    again = Store(path)
    try:
        assert CkptRows.of(again).saved_in("j-1", 5, 3, "xxh3:c") == {2}
        with sqlite3.connect(path) as db:
            listed = db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
            indexes = {r[0] for r in listed}
            plan = " ".join(
                str(r[3])
                for r in db.execute(
                    "EXPLAIN QUERY PLAN SELECT generation FROM ckpt_shards WHERE job = 'j-1' "
                    "AND step = 5 AND tier IN ('ram', 'nvme', 'peer', 'object') AND rank = 3"
                )
            )
        assert "ckpt_shards_rank" not in indexes
        assert "rank=?" in plan  # the primary key's lookup, not a scan of the step
    finally:
        again.close()
