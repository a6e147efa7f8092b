"""A catalog build reads only what changed since the last, and says what a fresh one says.

The publisher keeps the committed rows each build read (``CheckpointCatalog.pin_rows``,
``keep_rows``) while the store says nothing of them was written since, and makes one build
for the publishes asked while another waited. What a build says must never depend on
what was cached: every test here compares it with a build from the store alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from phalanx import wire
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.rows import NOT_RETIRED, CkptQueries, CkptRows
from supervisor.jobs import hold_steps
from supervisor.store import Store
from tests.unit.supervisor.test_catalog_publish import (
    NODES,
    WORLD,
    Make,
    SlowLink,
    commit,
    landing,
    make,  # noqa: F401  (a fixture)
    running_job,
)
from tests.wait import until

JOB = "j-1"
PLACEMENT = {rank: NODES[rank] for rank in range(WORLD)}


def credential(holder: str, node: str) -> str:
    return f"{holder}-lets-{node}-in"


def said(messages: Iterable[wire.CkptCatalog]) -> list[str]:
    return [wire.encode(m).decode() for m in messages]


def fresh(store: Store, world: int = WORLD, **kw: Any) -> list[str]:
    """What a catalog that never cached anything builds from the store."""
    return said(CheckpointCatalog(store).messages(JOB, world, placement=PLACEMENT, **kw))


def cached(catalog: CheckpointCatalog, world: int = WORLD, **kw: Any) -> list[str]:
    """A build as the publisher makes it: the rows still current, the rest read from the
    store."""
    pinned, rows = catalog.pin_rows(JOB)
    built = catalog.messages(JOB, world, placement=PLACEMENT, rows=rows, **kw)
    catalog.keep_rows(JOB, pinned, rows)
    return said(built)


class ReadCounter:
    """Counts the (step, tier) pairs the builds read from the store."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[tuple[int, str]] = []
        real = CkptQueries.shard_rows

        def shard_rows(
            queries: CkptQueries, job: str, keys: Iterable[tuple[int, str]]
        ) -> dict[tuple[int, str], Any]:
            keys = list(keys)
            self.keys += keys
            return real(queries, job, keys)

        monkeypatch.setattr(CkptQueries, "shard_rows", shard_rows)


async def test_a_build_reads_none_of_the_shards_it_knows_and_says_the_same(
    make: Make,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The steps built before are kept; a step committed since came with its landings.
    link = SlowLink()
    publisher = make(link)
    reads = ReadCounter(monkeypatch)
    commit(publisher, 4)
    await publisher.publish(JOB)
    commit(publisher, 5)
    reads.keys.clear()

    await publisher.publish(JOB)

    assert reads.keys == []
    sent = [link.retained[wire.catalog_topic(JOB, node)].decode() for node in NODES]
    job = running_job()
    assert sent == fresh(publisher.store, generation=1, alive=set(), hold_steps=hold_steps(job))


def test_a_step_committed_while_a_build_is_out_is_not_read_back_by_the_next(
    tmp_path: Path,
) -> None:
    # The build that was out when it committed (its slices let landings in) must not
    # drop what the commit's landings left for the next.
    store = Store(tmp_path / "state.db")
    try:
        catalog = CheckpointCatalog(store)
        for rank in range(WORLD):
            catalog.on_landing(landing(5, rank), WORLD)
        pinned, rows = catalog.pin_rows(JOB)
        built = catalog.messages(JOB, WORLD, placement=PLACEMENT, rows=rows)
        for rank in range(WORLD):  # committed while that build was out
            catalog.on_landing(landing(6, rank), WORLD)
        catalog.keep_rows(JOB, pinned, rows)
        assert [m.restore_step for m in built] == [5] * len(built)

        _, kept = catalog.pin_rows(JOB)

        assert set(kept) == {(5, "object"), (6, "object")}  # nothing to read back
        assert cached(catalog) == fresh(store)
    finally:
        store.close()


@pytest.mark.parametrize(
    "peers", [{}, {"n00": wire.PeerAddr(node="n00", address="h", http_port=9)}]
)
def test_a_step_unchanged_is_listed_again_as_kept_with_or_without_peer_addresses(
    tmp_path: Path, peers: dict[str, wire.PeerAddr]
) -> None:
    # The publisher hands every build the fleet's addresses as one object while the
    # registry stands: none known (no agent serves peer routes) is such an object too.
    # An empty one was replaced by a new dict at every build, and no step was ever
    # listed again from the last build (issue 22).
    store = Store(tmp_path / "state.db")
    try:
        catalog = CheckpointCatalog(store)
        for rank in range(WORLD):
            catalog.on_landing(landing(5, rank), WORLD)

        def build() -> list[wire.CkptCatalog]:
            pinned, rows = catalog.pin_rows(JOB)
            built = catalog.messages(JOB, WORLD, placement=PLACEMENT, rows=rows, peers=peers)
            catalog.keep_rows(JOB, pinned, rows)
            return built

        first = build()
        for rank in range(WORLD):
            catalog.on_landing(landing(6, rank), WORLD)
        again = build()

        assert [m.steps[0].step for m in again] == [5] * len(again)
        assert all(a.steps[0] is b.steps[0] for a, b in zip(again, first, strict=True))
        assert said(again) == fresh(store, peers=peers)
    finally:
        store.close()


async def test_a_step_dropped_behind_the_catalogs_back_is_gone_from_the_next_build(
    make: Make,  # noqa: F811
) -> None:
    link = SlowLink()
    publisher = make(link)
    commit(publisher, 4)
    commit(publisher, 5)
    await publisher.publish(JOB)
    assert link.catalog("n00") is not None and link.catalog("n00").restore_step == 5  # type: ignore[union-attr]

    # as a rollback does, on the store's rows themselves
    CkptRows.of(publisher.store).drop_step(JOB, 5, "object")
    await publisher.publish(JOB)

    msg = link.catalog("n00")
    assert msg is not None and [s.step for s in msg.steps] == [4] and msg.restore_step == 4


async def test_publishes_asked_while_one_is_out_make_one_more_build_and_all_return(
    make: Make,  # noqa: F811
) -> None:
    link = SlowLink()  # n02's catalog of step 5 is slow: the first publish is out a while
    publisher = make(link)
    commit(publisher, 5)
    builds = 0
    real = publisher.catalog.iter_payloads

    def counted(*args: Any, **kw: Any) -> Iterator[tuple[wire.CkptCatalog, bytes]]:
        nonlocal builds
        builds += 1
        return real(*args, **kw)

    publisher.catalog.iter_payloads = counted  # type: ignore[method-assign]
    first = asyncio.create_task(publisher.publish(JOB))
    await until(link.slow.is_set, 5.0, "the first build, n02's publish in flight")
    commit(publisher, 6)  # changes after the first build: a later publish must show them
    rest = [asyncio.create_task(publisher.publish(JOB)) for _ in range(5)]
    await asyncio.wait_for(asyncio.gather(first, *rest), 10)

    assert builds == 2
    for node in NODES:
        msg = link.catalog(node)
        assert msg is not None and msg.restore_step == 6


# One job of 4 ranks on 2 nodes at two tiers; what happens to its shards, in any order.
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "commit",
                "partial",
                "corrupt",
                "deleted",  # retention: the step's rows go later, a slice at a time
                "purge",  # a slice of the retired steps' rows deleted (1-4 rows)
                "drop",
                "moved",
                "placed",
                "newer",  # a newer generation saves the step again
                "reopen",  # a restarted supervisor: what was landed is loaded again
                "rollback",  # a landing whose transaction the store rolls back
            ]
        ),
        st.integers(1, 4),  # step
        st.sampled_from(["nvme", "peer"]),
        st.integers(0, 3),  # rank
        st.booleans(),  # a build follows (else the next op's build sees both changes)
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
# dropped and committed again between two builds: the same tiers, a new commit
@example(
    [("commit", 1, "nvme", 0, True), ("drop", 1, "nvme", 0, False), ("commit", 1, "nvme", 0, True)]
)
# a partial step dropped behind the catalog's back, then landed again: read again
@example(
    [
        ("partial", 1, "nvme", 1, False),
        ("drop", 1, "nvme", 0, False),
        ("partial", 1, "nvme", 1, False),
    ]
)
def test_whatever_happens_to_the_shards_a_cached_build_says_what_a_fresh_one_says(
    ops: list[tuple[str, int, str, int, bool]],
) -> None:
    """Also as the publisher builds, with the fleet's peers and their credentials: a step
    listed for a node by the last build is listed again as it was while nothing it was
    made of changed (its tiers' rows, the node's ranks)."""
    world = 4
    # the same map from build to build while the fleet is unchanged (CatalogPublisher._fleet)
    peers = {
        n: wire.PeerAddr(node=n, address=f"10.0.0.{i}", http_port=8600)
        for i, n in enumerate(["n00", "n01", "n05", "n09"])
    }
    placement = {rank: f"n{rank // 2:02d}" for rank in range(world)}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "state.db")
        try:
            catalog = CheckpointCatalog(store)
            with_peers = CheckpointCatalog(store)

            def as_published() -> list[str]:
                pinned, rows = with_peers.pin_rows(JOB)
                built = with_peers.messages(
                    JOB,
                    world,
                    placement=placement,
                    rows=rows,
                    peers=peers,
                    credential=credential,
                    nodes=sorted(set(placement.values())),
                )
                with_peers.keep_rows(JOB, pinned, rows)
                return said(built)

            def fresh_with_peers() -> list[str]:
                return said(
                    CheckpointCatalog(store).messages(
                        JOB,
                        world,
                        placement=placement,
                        peers=peers,
                        credential=credential,
                        nodes=sorted(set(placement.values())),
                    )
                )

            generation = 1

            def land(
                step: int,
                tier: str,
                rank: int,
                event: str = "landed",
                node: str = "",
                *,
                rolled_back: bool = False,
            ) -> None:
                msg = wire.CkptLanding(
                    node=node or f"n{rank // 2:02d}",
                    job=JOB,
                    step=step,
                    rank=rank,
                    tier=tier,  # type: ignore[arg-type]
                    event=event,  # type: ignore[arg-type]
                    nbytes=100 + rank,
                    checksum=f"xxh3_128:{step:016x}{rank:016x}",
                    at=1.0,
                    holder="n09" if tier == "peer" else None,
                    generation=generation,
                )
                if not rolled_back:
                    with store.batch():
                        catalog.on_landing(msg, world)
                    return
                with contextlib.suppress(RuntimeError), store.batch():
                    catalog.on_landing(msg, world)
                    catalog.forget()  # as the publisher does when its batch fails
                    raise RuntimeError("the batch fails after its writes")

            def nodes_in_store() -> set[str]:  # but those of steps retention dropped
                rows = store.db.execute(
                    "SELECT DISTINCT node FROM ckpt_shards s WHERE job = ? " + NOT_RETIRED,
                    (JOB,),
                ).fetchall()
                return {str(r[0]) for r in rows}

            for op, step, tier, rank, build in ops:
                if op == "rollback":
                    land(step, tier, rank, node="n07", rolled_back=True)
                elif op == "commit":
                    for r in range(world):
                        land(step, tier, r)
                elif op == "partial":
                    land(step, tier, rank)
                elif op in ("corrupt", "deleted"):
                    land(step, tier, rank, op)
                elif op == "purge":
                    with store.batch():
                        CkptRows.of(store).purge_some(rank + 1)
                elif op == "drop":  # a rollback or the SDC watch, on the store itself
                    CkptRows.of(store).drop_step(JOB, step, tier)
                elif op == "moved":  # the row rewritten: a redelivery from another node
                    land(step, tier, rank, node="n05")
                elif op == "newer":
                    generation += 1
                    land(step, tier, rank)
                elif op == "reopen":
                    catalog = CheckpointCatalog(store)
                else:  # a relaunch put the rank on another node
                    placement = {**placement, rank: f"n{step:02d}"}
                assert CkptRows.of(store).shard_nodes(JOB) == nodes_in_store()
                if build:
                    assert cached(catalog, world) == fresh(store, world)
                    assert as_published() == fresh_with_peers()
            assert cached(catalog, world) == fresh(store, world)
            assert as_published() == fresh_with_peers()
        finally:
            store.close()


def test_a_store_opened_again_is_cached_from_its_first_build(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    catalog = CheckpointCatalog(store)
    for rank in range(WORLD):
        with store.batch():
            catalog.on_landing(landing(4, rank), WORLD)
    store.close()

    store = Store(tmp_path / "state.db")  # a restarted supervisor: no versions known
    try:
        catalog = CheckpointCatalog(store)
        first = cached(catalog)
        pinned, rows = catalog.pin_rows(JOB)

        assert first == fresh(store)
        assert set(rows) == {(4, "object")} and set(pinned) == {(4, "object")}
    finally:
        store.close()


def record(catalog: CheckpointCatalog, rank: int, event: str = "landed", step: int = 4) -> bool:
    """One landing of the job's object tier, in a transaction of its own."""
    with catalog.store.batch():
        return catalog.on_landing(landing(step, rank, event), WORLD)


def purge_all(store: Store, at_once: int) -> None:
    """Delete every retired step's rows, ``at_once`` a transaction."""
    rows = CkptRows.of(store)
    while rows.purging:
        with store.batch():
            rows.purge_some(at_once)


def stored_ranks(store: Store, step: int, tier: str) -> list[int]:
    """The ranks of ``step`` whose rows the store's file still has at ``tier``."""
    rows = store.db.execute(
        "SELECT rank FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ? ORDER BY rank",
        (JOB, step, tier),
    ).fetchall()
    return [int(r[0]) for r in rows]


def test_retentions_deletions_drop_a_step_once_and_again_after_it_landed_again(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    try:
        catalog = CheckpointCatalog(store)
        rows = CkptRows.of(store)
        retired: list[str] = []
        store.db.set_trace_callback(  # type: ignore[attr-defined]
            lambda sql: retired.append(sql) if sql.startswith("INSERT INTO ckpt_purges") else None
        )

        for rank in range(WORLD):
            record(catalog, rank)
        assert rows.commits(JOB) == [(4, "object", rows.commits(JOB)[0][2])]

        assert record(catalog, 0, "deleted") is True  # the commit went
        assert all(record(catalog, rank, "deleted") is False for rank in range(1, WORLD))
        assert len(retired) == 1  # every other rank's report of it found it dropped
        assert rows.shard_rows_of(JOB, 4, "object") == {} and rows.shard_nodes(JOB) == set()
        assert rows.purging == 1 and stored_ranks(store, 4, "object") == list(range(WORLD))

        with store.batch():
            assert rows.purge_some(2) == 2  # a slice of its rows
        assert stored_ranks(store, 4, "object") == list(range(2, WORLD))
        purge_all(store, 2)
        assert stored_ranks(store, 4, "object") == []

        record(catalog, 2)  # the step saved there again (a rollback to it)
        assert rows.shard_nodes(JOB) == {NODES[2]}
        assert record(catalog, 2, "deleted") is True  # its row went
        assert len(retired) == 2
        assert rows.shard_rows_of(JOB, 4, "object") == {} and rows.shard_nodes(JOB) == set()
    finally:
        store.close()


def test_a_partial_step_dropped_behind_the_catalogs_back_commits_only_when_landed_again(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    try:
        catalog = CheckpointCatalog(store)
        rows = CkptRows.of(store)

        for rank in range(WORLD - 1):
            record(catalog, rank)
        rows.drop_step(JOB, 4, "object")  # as a rollback or the SDC watch does, on the store

        assert record(catalog, WORLD - 1) is False  # the ranks it counted before are gone
        assert rows.commits(JOB) == [] and stored_ranks(store, 4, "object") == [WORLD - 1]
        assert rows.shard_nodes(JOB) == {NODES[WORLD - 1]}
        for rank in range(WORLD - 1):
            record(catalog, rank)
        assert [(s, t) for s, t, _ in rows.commits(JOB)] == [(4, "object")]
    finally:
        store.close()


def test_a_step_landed_again_before_its_retired_rows_are_deleted_counts_only_its_new_shards(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    try:
        catalog = CheckpointCatalog(store)
        rows = CkptRows.of(store)

        for rank in range(WORLD):
            record(catalog, rank)
        assert record(catalog, 0, "deleted") is True
        assert rows.purging == 1  # every rank's row is still in the file

        for rank in range(WORLD - 1):  # saved there again, by all ranks but the last
            assert record(catalog, rank) is False
        assert rows.commits(JOB) == []  # the stale row of the last rank does not count
        assert rows.purging == 0 and stored_ranks(store, 4, "object") == list(range(WORLD - 1))
        assert record(catalog, WORLD - 1) is True
        assert [(s, t) for s, t, _ in rows.commits(JOB)] == [(4, "object")]
        assert cached(catalog) == fresh(store)
    finally:
        store.close()


def test_a_retired_steps_rows_outlive_a_restart_hidden_and_are_deleted_after_it(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    catalog = CheckpointCatalog(store)
    for rank in range(WORLD):
        record(catalog, rank, step=4)
        record(catalog, rank, step=5)
    record(catalog, 0, "deleted", step=4)
    store.close()  # a supervisor stopped before the rows of step 4 were deleted

    store = Store(tmp_path / "state.db")
    try:
        rows = CkptRows.of(store)
        assert rows.purging == 1
        assert {s for s, *_ in rows.shards(JOB)} == {5}  # hidden from every read
        assert rows.shard_rows_by_node(JOB) == {node: 1 for node in NODES}
        assert [s for s, _t, _ in rows.commits(JOB)] == [5]
        purge_all(store, 3)
        assert stored_ranks(store, 4, "object") == []
        assert stored_ranks(store, 5, "object") == list(range(WORLD))
        assert store.db.execute("SELECT COUNT(*) FROM ckpt_purges").fetchone()[0] == 0
    finally:
        store.close()


def test_a_retirement_rolled_back_leaves_the_step_committed_and_whole(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    try:
        catalog = CheckpointCatalog(store)
        rows = CkptRows.of(store)
        for rank in range(WORLD):
            record(catalog, rank)
        before = cached(catalog)
        assert rows.shard_nodes(JOB) == set(NODES)  # counted, then kept by the writes

        with pytest.raises(RuntimeError), store.batch():
            assert catalog.on_landing(landing(4, 0, "deleted"), WORLD) is True
            assert rows.purging == 1 and rows.shard_nodes(JOB) == set()
            raise RuntimeError("the transaction fails after the retirement")
        catalog.forget()  # as the publisher does when its batch fails

        assert rows.purging == 0 and rows.shard_nodes(JOB) == set(NODES)
        assert [(s, t) for s, t, _ in rows.commits(JOB)] == [(4, "object")]
        assert cached(catalog) == before == fresh(store)
    finally:
        store.close()
