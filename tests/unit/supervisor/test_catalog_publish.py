"""The supervisor publishes each node's catalog; two publishes of one job never interleave.

The link is a stand-in at the I/O boundary that makes one PUBACK slow (the fault
injected); the catalog, its SQLite store and ``Supervisor.publish_catalog`` are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from phalanx import wire
from supervisor.catalog import CheckpointCatalog
from supervisor.daemon import Supervisor
from supervisor.errors import StoreError
from supervisor.jobs import JobState, RankPlace
from supervisor.store import Store

WORLD = 8
NODES = [f"n{i:02d}" for i in range(WORLD)]


def landing(step: int, rank: int, event: str = "landed") -> wire.CkptLanding:
    return wire.CkptLanding(
        node=NODES[rank],
        job="j-1",
        step=step,
        rank=rank,
        tier="object",
        event=event,
        nbytes=100,  # type: ignore[arg-type]
        checksum=f"xxh3_128:{rank:032x}",
        at=time.time(),
    )


class SlowLink:
    """Publishes land in ``retained``; the one for n02 announcing step 5 is slow."""

    def __init__(self) -> None:
        self.retained: dict[str, bytes] = {}

    async def publish(
        self, topic: str, payload: bytes, retain: bool = False, timeout: float = 5.0
    ) -> None:
        slow = topic.endswith("/n02") and b'"restore_step":5' in payload
        await asyncio.sleep(0.2 if slow else 0.01)
        self.retained[topic] = payload


def supervisor_of(catalog: CheckpointCatalog, link: SlowLink) -> types.SimpleNamespace:
    """What ``Supervisor.publish_catalog`` reads, around one running job on ``NODES``."""
    job = types.SimpleNamespace(
        id="j-1",
        state=JobState.RUNNING,
        generation=1,
        nodes=NODES,
        ended_at=None,
        spec=types.SimpleNamespace(world_size=WORLD),
        ranks=[RankPlace(rank=r, node=NODES[r], local_rank=0) for r in range(WORLD)],
    )
    sup = types.SimpleNamespace(
        jobs=types.SimpleNamespace(jobs={"j-1": job}),
        registry=types.SimpleNamespace(nodes={}),
        catalog=catalog,
        store=catalog.store,
        link=link,
        _catalog_sent={},
        _catalog_locks={},
        _catalog_retry_jobs=set(),
        _catalog_builder=ThreadPoolExecutor(1),
        settings=types.SimpleNamespace(ckpt_failed_ram_linger_s=900.0),
        _ram_lingers={},
        _catalog_tasks=set(),
        _closed=False,
    )
    sup._ram_freed = types.MethodType(Supervisor._ram_freed, sup)
    return sup


def test_a_publish_started_before_a_change_never_leaves_its_stale_catalog_behind(
    tmp_path: Path,
) -> None:
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))
    link = SlowLink()
    sup = supervisor_of(catalog, link)

    async def scenario() -> None:
        for rank in range(WORLD):
            catalog.on_landing(landing(4, rank), WORLD)
        await Supervisor.publish_catalog(sup, "j-1")  # type: ignore[arg-type]
        for rank in range(WORLD):
            catalog.on_landing(landing(5, rank), WORLD)
        first = asyncio.create_task(Supervisor.publish_catalog(sup, "j-1"))  # type: ignore[arg-type]
        await asyncio.sleep(0.025)  # it has reached n00 and n01, n02 is slow
        catalog.on_landing(landing(5, 3, "corrupt"), WORLD)  # step 5 is not whole any more
        second = asyncio.create_task(Supervisor.publish_catalog(sup, "j-1"))  # type: ignore[arg-type]
        await asyncio.gather(first, second)

    asyncio.run(scenario())

    steps = set()
    for node in NODES:
        msg = wire.parse(
            wire.catalog_topic("j-1", node), link.retained[wire.catalog_topic("j-1", node)]
        ).message
        assert isinstance(msg, wire.CkptCatalog)
        steps.add(msg.restore_step)
    assert steps == {4}  # every node restores the step that is still committed


def test_landings_a_failed_store_write_rolled_back_are_queued_again_and_commit_later(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Store(tmp_path / "state.db")
    catalog = CheckpointCatalog(store)
    job = types.SimpleNamespace(spec=types.SimpleNamespace(world_size=2))
    sup = types.SimpleNamespace(
        jobs=types.SimpleNamespace(jobs={"j-1": job}),
        store=store,
        catalog=catalog,
        _landings=[landing(5, 0), landing(5, 1)],
    )
    real_batch = store.batch

    @contextlib.contextmanager
    def full_disk() -> Iterator[None]:  # the fault: the transaction cannot commit
        with real_batch():
            yield
            raise StoreError(store.path, "cannot write the supervisor store: disk is full")

    monkeypatch.setattr(store, "batch", full_disk)
    with pytest.raises(StoreError):
        Supervisor._record_landings(sup)  # type: ignore[arg-type]
    assert len(sup._landings) == 2 and store.commits("j-1") == []

    monkeypatch.setattr(store, "batch", real_batch)
    assert Supervisor._record_landings(sup) == {"j-1"}  # type: ignore[arg-type]
    assert sup._landings == [] and [c[0] for c in store.commits("j-1")] == [5]


def test_a_landing_the_store_cannot_take_is_dropped_and_never_holds_up_the_others(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    catalog = CheckpointCatalog(store)
    job = types.SimpleNamespace(spec=types.SimpleNamespace(world_size=1))
    # Past what SQLite holds: the wire refuses it now, but a value a store cannot take
    # (OverflowError, not a StoreError) must still cost that landing alone.
    poison = wire.CkptLanding.model_construct(
        **{**landing(7, 0).model_dump(), "job": "j-2", "step": 2**63}
    )
    good = [landing(step, 0) for step in range(1, 65)]
    sup = types.SimpleNamespace(
        jobs=types.SimpleNamespace(jobs={"j-1": job, "j-2": job}),
        store=store,
        catalog=catalog,
        _landings=[*good[:40], poison, *good[40:]],
    )
    transactions = 0
    real_batch = store.batch

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        nonlocal transactions
        transactions += 1
        with real_batch():
            yield

    store.batch = counted  # type: ignore[method-assign]
    assert Supervisor._record_landings(sup) == {"j-1"}  # type: ignore[arg-type]
    assert sup._landings == [] and [c[0] for c in store.commits("j-1")] == list(range(1, 65))
    assert store.commits("j-2") == []
    assert transactions <= 15  # halves around the one that fails, not one per landing


def test_a_snapshot_sees_committed_rows_only_never_a_batch_in_progress(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.add_commit("j-1", 4, "nvme", 1.0)
    seen: list[list[int]] = []

    def read() -> None:
        with store.snapshot() as snapshot:
            seen.append([step for step, _, _ in snapshot.commits("j-1")])

    with store.batch():
        store.add_commit("j-1", 5, "nvme", 2.0)
        with ThreadPoolExecutor(1) as pool:  # the builder's thread, as publish_catalog uses
            pool.submit(read).result()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(read).result()

    assert seen == [[4], [4, 5]]
    assert [s for s, _, _ in store.commits("j-1")] == [4, 5]


def test_the_event_loop_keeps_running_while_a_catalog_is_built(tmp_path: Path) -> None:
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))
    for rank in range(WORLD):
        catalog.on_landing(landing(4, rank), WORLD)
    real = catalog.messages
    loop_ran = threading.Event()
    during: list[bool] = []

    def messages(*args: object, **kwargs: object) -> list[wire.CkptCatalog]:
        # A long build (a job of many thousand ranks): only a loop that is free sets it.
        during.append(loop_ran.wait(10))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    catalog.messages = messages  # type: ignore[method-assign]
    link = SlowLink()
    sup = supervisor_of(catalog, link)

    async def scenario() -> None:
        publish = asyncio.create_task(Supervisor.publish_catalog(sup, "j-1"))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the publish has started its build
        loop_ran.set()  # what a heartbeat handler needs: the loop's turn, mid-build
        await publish

    asyncio.run(scenario())

    assert during == [True]
    assert len(link.retained) == WORLD


def test_an_ended_jobs_catalog_goes_out_and_leaves_no_cache_behind(tmp_path: Path) -> None:
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))
    for rank in range(WORLD):
        catalog.on_landing(landing(4, rank), WORLD)
    catalog.on_landing(landing(8, 0), WORLD)  # a step that never completed
    link = SlowLink()
    sup = supervisor_of(catalog, link)
    sup.jobs.jobs["j-1"].state = JobState.SUCCEEDED
    assert any(key[0] == "j-1" for key in catalog._landed)

    asyncio.run(Supervisor.publish_catalog(sup, "j-1"))  # type: ignore[arg-type]

    for node in NODES:
        msg = wire.parse(
            wire.catalog_topic("j-1", node), link.retained[wire.catalog_topic("j-1", node)]
        ).message
        assert isinstance(msg, wire.CkptCatalog) and msg.ended and msg.restore_step == 4
    assert sup._catalog_sent == {}
    assert not any(key[0] == "j-1" for key in catalog._landed)


@pytest.mark.parametrize(("failed_ago", "ended"), [(10.0, False), (1000.0, True)])
def test_a_failed_jobs_catalog_frees_ram_only_once_the_linger_is_over(
    tmp_path: Path,
    failed_ago: float,
    ended: bool,
) -> None:
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))
    for rank in range(WORLD):
        catalog.on_landing(landing(4, rank), WORLD)
    link = SlowLink()
    sup = supervisor_of(catalog, link)  # linger: 900 s
    job = sup.jobs.jobs["j-1"]
    job.state, job.ended_at = JobState.FAILED, time.time() - failed_ago

    async def scenario() -> bool:
        await Supervisor.publish_catalog(sup, "j-1")  # type: ignore[arg-type]
        pending = "j-1" in sup._ram_lingers  # the catalog is sent again when time is up
        for handle in sup._ram_lingers.values():
            handle.cancel()
        return pending

    resend_scheduled = asyncio.run(scenario())

    msg = wire.parse(
        wire.catalog_topic("j-1", NODES[0]), link.retained[wire.catalog_topic("j-1", NODES[0])]
    ).message
    assert isinstance(msg, wire.CkptCatalog) and msg.ended is ended
    assert resend_scheduled is not ended


class HeldLink(SlowLink):
    """Publishes to n02 wait until ``release`` is set (a slow PUBACK); a cleared retained
    message is an empty payload, as the broker keeps none."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def publish(
        self, topic: str, payload: bytes, retain: bool = False, timeout: float = 5.0
    ) -> None:
        if topic.endswith("/n02") and payload:
            await self.release.wait()
        self.retained[topic] = payload


def ended_job(tmp_path: Path, link: SlowLink) -> tuple[CheckpointCatalog, types.SimpleNamespace]:
    """A job that committed step 4 on every rank and succeeded."""
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))
    for rank in range(WORLD):
        catalog.on_landing(landing(4, rank), WORLD)
    sup = supervisor_of(catalog, link)
    sup.jobs.jobs["j-1"].state = JobState.SUCCEEDED
    return catalog, sup


def test_a_node_that_let_go_is_cleared_even_when_a_catalog_for_it_was_in_flight(
    tmp_path: Path,
) -> None:
    """n02 answers the first ended catalog while a second publish of the job (a late
    landing changed it) is on its way to n02: the clear must not land before it."""
    link = HeldLink()
    catalog, sup = ended_job(tmp_path, link)
    topic = wire.catalog_topic("j-1", "n02")

    async def scenario() -> None:
        link.release.set()
        await Supervisor.publish_catalog(sup, "j-1")  # type: ignore[arg-type]
        link.release.clear()
        second = asyncio.create_task(Supervisor.publish_catalog(sup, "j-1"))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # it waits on n02's PUBACK
        clear = asyncio.create_task(Supervisor.clear_ended_catalogs(sup, "j-1", {"n02"}))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        link.release.set()
        await asyncio.gather(second, clear)
        # n02's agent answers the second catalog too, as it does every one it is handed.
        await Supervisor.clear_ended_catalogs(sup, "j-1", {"n02"})  # type: ignore[arg-type]

    asyncio.run(scenario())

    assert link.retained[topic] == b""
    assert catalog.store.ended_catalogs_let_go("j-1") == {"n02"}
    assert not catalog.store.ended_catalogs_released("j-1")  # the other nodes still hold it
    asyncio.run(Supervisor.clear_ended_catalogs(sup, "j-1", set(NODES)))  # type: ignore[arg-type]
    assert catalog.store.ended_catalogs_released("j-1")
    assert all(link.retained[wire.catalog_topic("j-1", n)] == b"" for n in NODES)


def test_a_release_for_a_job_whose_catalog_never_ended_clears_nothing(tmp_path: Path) -> None:
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))
    for rank in range(WORLD):
        catalog.on_landing(landing(4, rank), WORLD)
    link = SlowLink()
    sup = supervisor_of(catalog, link)  # the job runs
    asyncio.run(Supervisor.publish_catalog(sup, "j-1"))  # type: ignore[arg-type]

    asyncio.run(Supervisor.clear_ended_catalogs(sup, "j-1", {"n03"}))  # type: ignore[arg-type]

    assert link.retained[wire.catalog_topic("j-1", "n03")] != b""


def test_releases_are_cleared_in_batches_off_the_message_loop(tmp_path: Path) -> None:
    """The message handler only queues a release: a whole gang's answers are cleared by
    one flush, in one store transaction, while the loop takes the next message."""
    link = SlowLink()
    catalog, sup = ended_job(tmp_path, link)
    sup.bad_messages, sup._releases, sup._release_flush = 0, [], None
    for name in ("_on_message", "_schedule", "flush_releases", "clear_ended_catalogs"):
        setattr(sup, name, types.MethodType(getattr(Supervisor, name), sup))
    batches: list[list[str]] = []
    real_batch = catalog.store.batch

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        batches.append([])
        with real_batch():
            yield

    async def scenario() -> None:
        await Supervisor.publish_catalog(sup, "j-1")  # type: ignore[arg-type]
        catalog.store.batch = counted  # type: ignore[method-assign]
        for node in NODES:
            msg = wire.CkptReleased(node=node, job="j-1", at=time.time())
            await sup._on_message(wire.ckpt_topic(node), wire.encode(msg))
        # Handled, and nothing cleared yet: the handler published nothing itself.
        assert all(link.retained[wire.catalog_topic("j-1", n)] != b"" for n in NODES)
        await asyncio.sleep(0.5)  # the flush

    asyncio.run(scenario())

    assert all(link.retained[wire.catalog_topic("j-1", n)] == b"" for n in NODES)
    assert catalog.store.ended_catalogs_released("j-1")
    assert len(batches) == 1
