"""The publisher sends each node its catalog; two publishes of one job never interleave.

The publisher, its catalog, its SQLite store and registry and the jobs are real; the
link is a stand-in at the I/O boundary whose publishes land in ``retained``, and that
makes one PUBACK slow (the fault injected).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from phalanx import wire
from phalanx.jobspec import validate_spec
from supervisor.checkpoints import publisher as publisher_module
from supervisor.checkpoints import rows as rows_module
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.publisher import BUILD_SLICE_S, CatalogPublisher
from supervisor.checkpoints.rows import CkptRows
from supervisor.errors import StoreError
from supervisor.fleet.registry import Registry
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.store import Store
from tests.unit.supervisor.conftest import OpenStore, hold_commits
from tests.unit.supervisor.fake_fleet import birth
from tests.wait import settle, until

WORLD = 8
NODES = [f"n{i:02d}" for i in range(WORLD)]


def landing(step: int, rank: int, event: str = "landed", job: str = "j-1") -> wire.CkptLanding:
    return wire.CkptLanding(
        node=NODES[rank],
        job=job,
        step=step,
        rank=rank,
        tier="object",
        event=event,  # type: ignore[arg-type]
        nbytes=100,
        checksum=f"xxh3_128:{rank:032x}",
        at=time.time(),
    )


def running_job(job_id: str = "j-1", world: int = WORLD) -> Job:
    spec = validate_spec(
        {
            "name": "j",
            "team": "t",
            "command": ["true"],
            "workdir": "/tmp",
            "nodes": world,
            "ranks_per_node": 1,
        }
    )
    return Job(
        job_id,
        spec,
        state=JobState.RUNNING,
        generation=1,
        nodes=NODES[:world],
        ranks=[RankPlace(rank=r, node=NODES[r], local_rank=0) for r in range(world)],
    )


class SlowLink:
    """Publishes land in ``retained``; the one for n02 announcing step 5 is slow."""

    def __init__(self) -> None:
        self.retained: dict[str, bytes] = {}
        self.published = 0
        self.slow = asyncio.Event()  # set once the slow publish has begun

    async def publish(
        self, topic: str, payload: bytes, retain: bool = False, timeout: float = 5.0
    ) -> None:
        slow = topic.endswith("/n02") and b'"restore_step":5' in payload
        if slow:
            self.slow.set()
        await asyncio.sleep(0.2 if slow else 0.01)
        self.retained[topic] = payload
        self.published += 1

    def catalog(self, node: str, job: str = "j-1") -> wire.CkptCatalog | None:
        payload = self.retained.get(wire.catalog_topic(job, node))
        if not payload:
            return None
        msg = wire.parse(wire.catalog_topic(job, node), payload).message
        assert isinstance(msg, wire.CkptCatalog)
        return msg


class HeldLink(SlowLink):
    """Publishes to n02 wait until ``release`` is set (a slow PUBACK); a cleared retained
    message is an empty payload, as the broker keeps none."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.held = 0  # publishes to n02 waiting for their release now

    async def publish(
        self, topic: str, payload: bytes, retain: bool = False, timeout: float = 5.0
    ) -> None:
        if topic.endswith("/n02") and payload:
            self.held += 1
            try:
                await self.release.wait()
            finally:
                self.held -= 1
        self.retained[topic] = payload


Make = Callable[..., CatalogPublisher]


@pytest.fixture
def make(tmp_path: Path, open_store: OpenStore) -> Iterator[Make]:
    """Build a publisher on a real store in ``tmp_path`` (one store per test)."""
    store = open_store()
    built: list[CatalogPublisher] = []

    def build(
        link: SlowLink, jobs: dict[str, Job] | None = None, *, linger: float = 900.0
    ) -> CatalogPublisher:
        found = {"j-1": running_job()} if jobs is None else jobs
        publisher = CatalogPublisher(
            CheckpointCatalog(store),
            link.publish,
            job=found.get,
            registry=Registry(store, offline_after_s=15.0),
            ram_linger_s=linger,
        )
        built.append(publisher)
        return publisher

    yield build
    for publisher in built:
        publisher.stop()
        publisher.close()
    store.close()


def commit(publisher: CatalogPublisher, step: int, world: int = WORLD) -> None:
    for rank in range(world):
        publisher.catalog.on_landing(landing(step, rank), world)


async def test_a_publish_started_before_a_change_never_leaves_its_stale_catalog_behind(
    make: Make,
) -> None:
    link = SlowLink()
    publisher = make(link)
    commit(publisher, 4)
    await publisher.publish("j-1")
    commit(publisher, 5)
    first = asyncio.create_task(publisher.publish("j-1"))

    def reached() -> bool:  # n00 and n01 hold step 5's catalog; n02's is on its slow way
        near = [link.catalog(n) for n in ("n00", "n01")]
        return link.slow.is_set() and all(c is not None and c.restore_step == 5 for c in near)

    await until(reached, 5.0, "step 5's catalog at n00 and n01, n02's slow")
    publisher.catalog.on_landing(landing(5, 3, "corrupt"), WORLD)  # step 5 is not whole any more
    second = asyncio.create_task(publisher.publish("j-1"))
    await asyncio.gather(first, second)

    steps = set()
    for node in NODES:
        msg = link.catalog(node)
        assert msg is not None
        steps.add(msg.restore_step)
    assert steps == {4}  # every node restores the step that is still committed


async def test_landings_a_failed_store_write_rolled_back_are_queued_again_and_commit_later(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = make(SlowLink(), {"j-1": running_job(world=2)})
    store = publisher.store
    real_batch = store.batch

    @contextlib.contextmanager
    def full_disk() -> Iterator[None]:  # the fault: the transaction cannot commit
        with real_batch():
            yield
            raise StoreError(store.path, "cannot write the supervisor store: disk is full")

    publisher.on_landing(landing(5, 0))
    publisher.on_landing(landing(5, 1))
    monkeypatch.setattr(store, "batch", full_disk)
    with pytest.raises(StoreError):
        publisher.record_landings()
    assert CkptRows.of(store).commits("j-1") == []

    monkeypatch.setattr(store, "batch", real_batch)
    assert publisher.record_landings() == {"j-1"}
    assert [c[0] for c in CkptRows.of(store).commits("j-1")] == [5]


async def test_a_landing_the_store_cannot_take_is_dropped_and_never_holds_up_the_others(
    make: Make,
) -> None:
    publisher = make(SlowLink(), {"j-1": running_job(world=1), "j-2": running_job("j-2", 1)})
    store = publisher.store
    # Past what SQLite holds: the wire refuses it now, but a value a store cannot take
    # (OverflowError, not a StoreError) must still cost that landing alone.
    poison = wire.CkptLanding.model_construct(
        **{**landing(7, 0).model_dump(), "job": "j-2", "step": 2**63}
    )
    good = [landing(step, 0) for step in range(1, 65)]
    for msg in [*good[:40], poison, *good[40:]]:
        publisher.on_landing(msg)
    transactions = 0
    real_batch = store.batch

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        nonlocal transactions
        transactions += 1
        with real_batch():
            yield

    store.batch = counted  # type: ignore[method-assign]
    assert publisher.record_landings() == {"j-1"}
    assert [c[0] for c in CkptRows.of(store).commits("j-1")] == list(range(1, 65))
    assert CkptRows.of(store).commits("j-2") == []
    assert transactions <= 15  # halves around the one that fails, not one per landing
    assert publisher.record_landings() == set()  # nothing left queued


async def test_a_landing_whose_row_fails_when_the_batchs_rows_are_written_is_dropped_alone(
    make: Make,
) -> None:
    publisher = make(SlowLink(), {"j-1": running_job(world=1), "j-2": running_job("j-2", 2)})
    store = publisher.store
    # The shard rows of a batch are written at once at its end (or before the next read):
    # a row the store cannot take fails there, not at its own landing, and must still
    # cost that landing alone, never the others of its batch.
    poison = wire.CkptLanding.model_construct(
        **{**landing(7, 0, job="j-2").model_dump(), "nbytes": 2**63}
    )
    good = [landing(step, 0) for step in range(1, 33)]
    for msg in [*good[:20], poison, *good[20:]]:
        publisher.on_landing(msg)
    await publisher.flush_landings()
    assert [c[0] for c in CkptRows.of(store).commits("j-1")] == list(range(1, 33))
    assert CkptRows.of(store).shard_rows_of("j-2", 7, "object") == {}
    assert publisher.record_landings() == set()  # nothing left queued


class LoopTurns:
    """Counts the event loop's turns while entered (``async with``)."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _turn(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.create_task(self._turn())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


AsyncBatch = Callable[[], contextlib.AbstractAsyncContextManager[None]]  # batch_async


def noting(store: Store, note: Callable[[], None]) -> AsyncBatch:
    """The store's ``batch_async`` (a flush's transactions), calling ``note()`` as each
    transaction begins."""
    real_batch = store.batch_async

    @contextlib.asynccontextmanager
    async def batch() -> AsyncIterator[None]:
        note()
        async with real_batch():
            yield

    return batch


def failing_at(monkeypatch: pytest.MonkeyPatch, store: Store, nth: int) -> None:
    """The ``nth`` COMMIT of ``store``'s commit thread (``batch_async``'s, a flush's
    transactions) fails, as on a disk that fills; the others go through."""

    def before() -> None:
        if len(commits) == nth:
            raise sqlite3.OperationalError("database or disk is full")

    commits = hold_commits(monkeypatch, store, before)


async def test_a_flush_records_its_landings_in_slices_with_the_loop_turning_between(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tier's 16,384 landings within a second were one transaction a 50 ms batch: the
    # loop's longest stalls at 2,048 nodes (issue 22). Sliced: every one still counts.
    monkeypatch.setattr(publisher_module, "RECORD_AT_ONCE", 2)
    link = SlowLink()
    publisher = make(link)
    store = publisher.store
    turns = LoopTurns()
    at: list[int] = []  # the loop's turns as each transaction began
    monkeypatch.setattr(store, "batch_async", noting(store, lambda: at.append(turns.count)))
    for step in (4, 5):
        for rank in range(WORLD):
            publisher._landings.append(landing(step, rank))  # queued, no flush timer
    async with turns:
        await publisher.flush_landings()

    assert len(at) == (2 * WORLD + 1) // 2  # two landings a transaction
    assert all(later > earlier for earlier, later in itertools.pairwise(at)), at
    assert [c[0] for c in CkptRows.of(store).commits("j-1")] == [4, 5]
    catalog = link.catalog("n00")
    assert catalog is not None and catalog.restore_step == 5  # published once all were in
    assert publisher._landings == []


async def test_a_flush_begun_while_another_commits_records_after_it(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each slice's COMMIT runs on a worker thread, so a flush can start while another
    # awaits one. Retention's deletion of a step recorded before a landing of it (in a
    # later slice of the first flush) would be undone by it: the step committed again.
    monkeypatch.setattr(publisher_module, "RECORD_AT_ONCE", 2)
    publisher = make(SlowLink())
    store = publisher.store
    go = threading.Event()  # the first COMMIT waits for it
    hold_commits(monkeypatch, store, lambda: go.wait(30))
    publisher._landings.extend(landing(4, rank) for rank in range(WORLD))
    first = asyncio.create_task(publisher.flush_landings())
    await until(store.db.gate.locked, 30, "the first slice's COMMIT under way")
    publisher._landings.append(landing(4, 0, "deleted"))
    second = asyncio.create_task(publisher.flush_landings())
    await settle()  # the second flush waits, and the loop is not held meanwhile
    go.set()
    await asyncio.gather(first, second)

    rows = CkptRows.of(store)
    assert rows.commits("j-1") == []  # deleted after it landed: gone, not committed
    assert rows.shards("j-1") == [] and rows.purging == 0


@pytest.mark.parametrize("commit_fails", [False, True], ids=["commits", "fails"])
async def test_a_flush_cancelled_mid_commit_leaves_its_landings_for_close(
    make: Make, monkeypatch: pytest.MonkeyPatch, commit_fails: bool
) -> None:
    # A shutdown's drain that runs out of time cancels the flush while a slice commits:
    # that slice (its COMMIT may fail yet) and the ones after it go back to the queue,
    # and close() records them. None is lost; one recorded twice counts once.
    monkeypatch.setattr(publisher_module, "RECORD_AT_ONCE", 2)
    publisher = make(SlowLink())
    store = publisher.store
    go = threading.Event()

    def before() -> None:
        if len(commits) == 2:  # the second slice's
            assert go.wait(30)
            if commit_fails:
                raise sqlite3.OperationalError("database or disk is full")

    commits = hold_commits(monkeypatch, store, before)
    queued = [landing(4, rank) for rank in range(WORLD)]
    publisher._landings.extend(queued)
    flush = asyncio.create_task(publisher.flush_landings())
    await until(lambda: len(commits) == 2, 30, "the second slice's COMMIT under way")
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    assert publisher._landings == queued[2:]  # the slice committing, and those after it
    go.set()
    await until(lambda: not store.db.gate.locked(), 30, "the COMMIT's end")

    publisher.stop()
    publisher.close()  # as the daemon's shutdown does, once the link is closed
    rows = CkptRows.of(store)
    assert [c[0] for c in rows.commits("j-1")] == [4]
    assert {r for _s, _t, r, *_ in rows.shards("j-1")} == set(range(WORLD))
    assert publisher._landings == []


async def test_a_store_failing_mid_flush_keeps_the_landings_not_recorded_in_order(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher_module, "RECORD_AT_ONCE", 2)
    publisher = make(SlowLink())
    store = publisher.store
    queued = [landing(step, rank) for step in (4, 5) for rank in range(WORLD)]
    publisher._landings.extend(queued)
    failing_at(monkeypatch, store, 3)  # the disk fills then
    await publisher.flush_landings()
    assert publisher._landings == queued[4:]  # the first two slices are in; the rest wait

    await publisher.flush_landings()
    assert [c[0] for c in CkptRows.of(store).commits("j-1")] == [4, 5]
    assert publisher._landings == []


def stored_steps(publisher: CatalogPublisher) -> dict[int, int]:
    """Step -> the shard rows the store's file holds of it (retired or not)."""
    rows = publisher.store.db.execute(
        "SELECT step, COUNT(*) FROM ckpt_shards WHERE job = 'j-1' GROUP BY step"
    ).fetchall()
    return {int(r[0]): int(r[1]) for r in rows}


async def test_the_rows_of_a_step_retention_dropped_go_in_slices_after_its_catalogs(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One statement deleting a step's 16,384 rows at a tier held the event loop 0.1-0.35 s
    # at 2,048 nodes, four times a checkpoint (issue 22): now a slice a transaction.
    monkeypatch.setattr(rows_module, "PURGE_AT_ONCE", 3)
    link = SlowLink()
    publisher = make(link)
    store = publisher.store
    for step in (4, 5):
        commit(publisher, step)
    turns = LoopTurns()
    at: list[tuple[int, int]] = []  # the loop's turns and the link's publishes at each
    monkeypatch.setattr(
        store, "batch_async", noting(store, lambda: at.append((turns.count, link.published)))
    )
    publisher._landings.extend(landing(4, rank, "deleted") for rank in range(WORLD))
    async with turns:
        await publisher.flush_landings()

    rows = CkptRows.of(store)
    assert [c[0] for c in rows.commits("j-1")] == [5] and rows.purging == 0
    assert stored_steps(publisher) == {5: WORLD}
    assert len(at) == 1 + 3  # the reports recorded, then 3 + 3 + 2 rows
    assert all(later[0] > earlier[0] for earlier, later in itertools.pairwise(at)), at
    assert at[1][1] >= WORLD  # every node's catalog was out before the first slice
    catalog = link.catalog("n00")
    assert catalog is not None and [s.step for s in catalog.steps] == [5]


async def test_a_store_failing_while_retired_rows_go_leaves_them_hidden_for_the_next_flush(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rows_module, "PURGE_AT_ONCE", 3)
    publisher = make(SlowLink())
    store = publisher.store
    for step in (4, 5):
        commit(publisher, step)
    failing_at(monkeypatch, store, 2)  # the disk fills at the first slice
    publisher._landings.extend(landing(4, rank, "deleted") for rank in range(WORLD))
    await publisher.flush_landings()

    rows = CkptRows.of(store)
    assert rows.purging == 1 and stored_steps(publisher) == {4: WORLD, 5: WORLD}
    assert {s for s, *_ in rows.shards("j-1")} == {5}  # step 4 is gone from every read
    assert [c[0] for c in rows.commits("j-1")] == [5]
    assert publisher._landing_flush.pending  # a flush again soon, which goes on deleting

    await publisher.flush_landings()
    assert rows.purging == 0 and stored_steps(publisher) == {5: WORLD}


async def test_the_event_loop_runs_between_the_messages_of_a_long_build(make: Make) -> None:
    link = SlowLink()
    publisher = make(link)
    commit(publisher, 4)
    catalog = publisher.catalog
    real = catalog.iter_payloads
    turns = LoopTurns()  # the loop's turns: what a heartbeat handler needs
    seen: list[int] = []  # the turns the loop had taken as each message was made

    def iter_payloads(*args: Any, **kwargs: Any) -> Iterator[tuple[wire.CkptCatalog, bytes]]:
        for made in real(*args, **kwargs):
            time.sleep(BUILD_SLICE_S)  # each a slice's worth (a job of many thousand ranks)
            seen.append(turns.count)
            yield made

    catalog.iter_payloads = iter_payloads  # type: ignore[method-assign]
    async with turns:
        await publisher.publish("j-1")

    assert len(seen) == WORLD
    assert all(later > earlier for earlier, later in itertools.pairwise(seen)), seen
    assert len(link.retained) == WORLD


async def test_an_ended_jobs_catalog_goes_out_and_leaves_no_cache_behind(make: Make) -> None:
    link = SlowLink()
    job = running_job()
    publisher = make(link, {"j-1": job})
    commit(publisher, 4)
    publisher.catalog.on_landing(landing(8, 0), WORLD)  # a step that never completed
    job.state = JobState.SUCCEEDED
    assert any(key[0] == "j-1" for key in publisher.catalog._landed)

    await publisher.publish("j-1")

    for node in NODES:
        msg = link.catalog(node)
        assert msg is not None and msg.ended and msg.restore_step == 4
    assert not any(key[0] == "j-1" for key in publisher.catalog._landed)
    await publisher.publish("j-1")  # nothing cached says "unchanged": all sent again
    assert link.published == 2 * WORLD


@pytest.mark.parametrize(("failed_ago", "ended"), [(10.0, False), (1000.0, True)])
async def test_a_failed_jobs_catalog_frees_ram_only_once_the_linger_is_over(
    make: Make, failed_ago: float, ended: bool
) -> None:
    link = SlowLink()
    job = running_job()
    publisher = make(link, {"j-1": job}, linger=900.0)
    commit(publisher, 4)
    job.state, job.ended_at = JobState.FAILED, time.time() - failed_ago

    await publisher.publish("j-1")

    msg = link.catalog(NODES[0])
    assert msg is not None and msg.ended is ended
    assert ("j-1" in publisher.lingering) is not ended  # sent again when the time is up


async def test_a_failed_jobs_catalog_is_sent_again_saying_ended_when_the_linger_is_over(
    make: Make,
) -> None:
    link = SlowLink()
    job = running_job()
    publisher = make(link, {"j-1": job}, linger=0.3)
    commit(publisher, 4)
    job.state, job.ended_at = JobState.FAILED, time.time()

    await publisher.publish("j-1")
    first = link.catalog(NODES[0])
    assert first is not None and not first.ended

    later = await until(
        lambda: (c := link.catalog(NODES[0])) is not None and c.ended and c,
        5.0,
        "the catalog saying ended once the linger is over",
    )
    assert later.ended
    assert publisher.lingering == set()


def ended_job(make: Make, link: SlowLink) -> CatalogPublisher:
    """A job that committed step 4 on every rank and succeeded."""
    job = running_job()
    job.state = JobState.SUCCEEDED
    publisher = make(link, {"j-1": job})
    commit(publisher, 4)
    return publisher


async def test_a_node_that_let_go_is_cleared_even_when_a_catalog_for_it_was_in_flight(
    make: Make,
) -> None:
    """n02 answers the first ended catalog while a second publish of the job (a late
    landing changed it) is on its way to n02: the clear must not land before it."""
    link = HeldLink()
    publisher = ended_job(make, link)
    store = publisher.store
    topic = wire.catalog_topic("j-1", "n02")

    link.release.set()
    await publisher.publish("j-1")
    link.release.clear()
    second = asyncio.create_task(publisher.publish("j-1"))
    await until(lambda: link.held == 1, 5.0, "the second publish to wait on n02's PUBACK")
    clear = asyncio.create_task(publisher.clear_ended_catalogs("j-1", {"n02"}))
    await settle()  # the clear waits for the publish's lock
    assert not clear.done()
    link.release.set()
    await asyncio.gather(second, clear)
    # n02's agent answers the second catalog too, as it does every one it is handed.
    await publisher.clear_ended_catalogs("j-1", {"n02"})

    assert link.retained[topic] == b""
    assert CkptRows.of(store).ended_catalogs_let_go("j-1") == {"n02"}
    assert not CkptRows.of(store).ended_catalogs_released("j-1")  # the other nodes still hold it
    await publisher.clear_ended_catalogs("j-1", set(NODES))
    assert CkptRows.of(store).ended_catalogs_released("j-1")
    assert all(link.retained[wire.catalog_topic("j-1", n)] == b"" for n in NODES)


async def test_a_release_for_a_job_whose_catalog_never_ended_clears_nothing(make: Make) -> None:
    link = SlowLink()
    publisher = make(link)  # the job runs
    commit(publisher, 4)
    await publisher.publish("j-1")

    await publisher.clear_ended_catalogs("j-1", {"n03"})

    assert link.retained[wire.catalog_topic("j-1", "n03")] != b""


async def test_releases_are_cleared_in_batches_off_the_message_loop(make: Make) -> None:
    """Handing a release over only queues it: a whole gang's answers are cleared by one
    flush, in one store transaction, while the message loop takes the next message."""
    link = SlowLink()
    publisher = ended_job(make, link)
    store = publisher.store
    batches: list[list[str]] = []
    real_batch = store.batch

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        batches.append([])
        with real_batch():
            yield

    await publisher.publish("j-1")
    store.batch = counted  # type: ignore[method-assign]
    for node in NODES:
        publisher.on_release(wire.CkptReleased(node=node, job="j-1", at=time.time()))
    # Handed over, and nothing cleared yet: nothing was published on the way.
    assert all(link.retained[wire.catalog_topic("j-1", n)] != b"" for n in NODES)
    await until(
        lambda: all(link.retained[wire.catalog_topic("j-1", n)] == b"" for n in NODES),
        5.0,
        "the flush to clear every node's catalog",
    )

    assert CkptRows.of(store).ended_catalogs_released("j-1")
    assert len(batches) == 1


async def test_the_drain_records_the_landings_queued_and_sends_their_catalogs(make: Make) -> None:
    link = SlowLink()
    publisher = make(link)
    for rank in range(WORLD):
        publisher.on_landing(landing(4, rank))
    publisher.stop()  # before the batch was due: only the drain handles it now

    await publisher.drain(timeout=5.0)

    assert [c[0] for c in CkptRows.of(publisher.store).commits("j-1")] == [4]
    assert all((c := link.catalog(n)) is not None and c.restore_step == 4 for n in NODES)


async def test_each_flush_and_publish_is_accounted_for_with_its_phases(make: Make) -> None:
    # GET /v1/stats shows them: where a step's commit spent its time on its way out.
    link = SlowLink()
    publisher = make(link)
    for rank in range(WORLD):
        publisher.on_landing(landing(4, rank))

    await publisher.flush_landings()
    await publisher.publish("j-1")  # nothing changed since: built, not sent again

    [flush] = publisher.recorded
    assert flush["landings"] == WORLD and flush["changed"] == ["j-1"]
    assert flush["record_s"] >= 0
    first, again = publisher.published
    assert (first["job"], first["messages"], first["sent"]) == ("j-1", WORLD, WORLD)
    assert (again["messages"], again["sent"]) == (WORLD, 0)
    assert first["send_s"] >= 0.01  # the link took 0.01 s a message, all at once
    assert all(p[k] >= 0 for p in (first, again) for k in ("wait_s", "build_s", "send_s"))
    assert first["at"] <= again["at"]


async def test_the_drain_clears_the_catalogs_of_the_releases_queued(make: Make) -> None:
    link = SlowLink()
    publisher = ended_job(make, link)
    await publisher.publish("j-1")
    for node in NODES:
        publisher.on_release(wire.CkptReleased(node=node, job="j-1", at=time.time()))
    publisher.stop()

    await publisher.drain(timeout=5.0)

    assert all(link.retained[wire.catalog_topic("j-1", n)] == b"" for n in NODES)
    assert CkptRows.of(publisher.store).ended_catalogs_released("j-1")


async def test_landings_that_come_after_the_drain_are_recorded_as_it_closes(make: Make) -> None:
    link = SlowLink()
    publisher = make(link)
    publisher.stop()
    await publisher.drain(timeout=5.0)
    for rank in range(WORLD):
        publisher.on_landing(landing(4, rank))  # the link is not closed yet

    publisher.close()

    assert [c[0] for c in CkptRows.of(publisher.store).commits("j-1")] == [4]
    assert link.published == 0  # sent at the next start


async def test_a_catalog_publish_still_running_at_shutdown_is_cancelled_within_the_limit(
    make: Make,
) -> None:
    link = HeldLink()  # n02's PUBACK never comes
    publisher = make(link)
    commit(publisher, 4)
    publisher.publish_soon("j-1")
    await until(lambda: link.held == 1, 5.0, "the publish to wait on n02's PUBACK")
    publisher.stop()
    assert publisher.tasks.names() == ["ckpt-catalog-j-1"]

    started = time.monotonic()
    await publisher.shutdown(timeout=0.2)

    assert time.monotonic() - started < 1.0
    assert len(publisher.tasks) == 0


async def test_a_holder_reborn_at_another_address_is_named_there_in_the_next_catalog(
    make: Make,
) -> None:
    # The fleet's addresses are made once per registry version, not at every publish
    # (27 % of a busy supervisor's CPU at 2,048 nodes, issue 22): a new birth changes it.
    link = SlowLink()
    publisher = make(link)
    registry = publisher._registry
    for node in NODES:
        registry.on_birth(birth(node))
    for rank in range(WORLD):
        holder = NODES[(rank + 1) % WORLD]
        publisher.catalog.on_landing(
            landing(5, rank).model_copy(update={"tier": "peer", "holder": holder}), WORLD
        )

    def peer_of_rank_0() -> wire.PeerAddr | None:
        catalog = link.catalog("n00")
        assert catalog is not None and catalog.steps
        (shard,) = [s for s in catalog.steps[0].shards if s.rank == 0]
        return shard.peer

    await publisher.publish("j-1")
    first = peer_of_rank_0()
    assert first is not None and (first.node, first.http_port) == ("n01", 9400)

    registry.on_birth(birth("n01", seq=2).model_copy(update={"http_port": 9555}))
    await publisher.publish("j-1")
    again = peer_of_rank_0()
    assert again is not None and (again.node, again.http_port) == ("n01", 9555)


class BatchLink(SlowLink):
    """The link's batch (``publish_many``): each call's topics, and how many messages the
    build had made when it came."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0
        self.calls: list[tuple[int, list[str]]] = []

    async def publish_many(
        self, items: Any, *, retain: bool = False, timeout: float = 5.0
    ) -> list[BaseException | None]:
        self.calls.append((self.made, [topic for topic, _ in items]))
        await asyncio.sleep(0.01)
        for topic, payload in items:
            self.retained[topic] = payload
        return [None] * len(items)


def batched(make: Make, link: BatchLink) -> CatalogPublisher:
    publisher = make(link)
    publisher._publish_many = link.publish_many
    real = publisher.catalog.iter_payloads

    def iter_payloads(*args: Any, **kwargs: Any) -> Iterator[tuple[wire.CkptCatalog, bytes]]:
        for made in real(*args, **kwargs):
            time.sleep(BUILD_SLICE_S)  # each a slice's worth (a job of many thousand ranks)
            link.made += 1
            yield made

    publisher.catalog.iter_payloads = iter_payloads  # type: ignore[method-assign]
    return publisher


async def test_a_slices_catalogs_go_to_the_link_while_the_next_are_built(make: Make) -> None:
    # The broker takes the first nodes' catalogs while the rest are built: at 2,048 nodes
    # the build and the hand-off took 0.3-0.8 s each, one after the other.
    link = BatchLink()
    publisher = batched(make, link)
    commit(publisher, 4)

    await publisher.publish("j-1")

    assert len(link.calls) > 1
    assert link.calls[0][0] < WORLD  # handed before the build's last message was made
    topics = [topic for _, batch in link.calls for topic in batch]
    assert topics == [wire.catalog_topic("j-1", node) for node in NODES]  # each once, in order
    assert all((c := link.catalog(n)) is not None and c.restore_step == 4 for n in NODES)
    [account] = publisher.published
    assert (account["messages"], account["sent"]) == (WORLD, WORLD)


async def test_a_build_that_fails_midway_waits_for_what_it_handed_then_tries_again(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    link = BatchLink()
    publisher = batched(make, link)
    commit(publisher, 4)
    built = publisher.catalog.iter_payloads

    def failing(*args: Any, **kwargs: Any) -> Iterator[tuple[wire.CkptCatalog, bytes]]:
        for n, made in enumerate(built(*args, **kwargs)):
            if n == WORLD // 2:
                raise StoreError(
                    publisher.store.path, "cannot read the supervisor store: database is locked"
                )
            yield made

    monkeypatch.setattr(publisher.catalog, "iter_payloads", failing)
    monkeypatch.setattr(publisher_module, "RETRY_S", 0.05)

    await publisher.publish("j-1")  # the first half handed and taken, the rest not built

    handed = [topic for _, batch in link.calls for topic in batch]
    assert handed == [wire.catalog_topic("j-1", node) for node in NODES[: WORLD // 2]]
    assert set(link.retained) == set(handed)  # each was out before the publish returned
    assert publisher._retry.pending

    monkeypatch.setattr(publisher.catalog, "iter_payloads", built)
    await until(lambda: len(link.retained) == WORLD, 5.0, "every catalog out at the retry")
    again = [topic for _, batch in link.calls[len(link.calls) - 1 :] for topic in batch]
    assert wire.catalog_topic("j-1", NODES[0]) not in again  # sent already: not sent again
