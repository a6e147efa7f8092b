"""``Store.batch_async``: a transaction whose COMMIT (the fsync) runs on a worker thread
while the event loop turns, the store's other statements waiting for it (issue 22).

The store is real (SQLite and PostgreSQL); the COMMIT is held back or made to fail at
the connection's edge (``execute_held``), the fault injected.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest

from supervisor.errors import StoreError
from supervisor.store import Store
from tests.unit.supervisor.conftest import OpenStore, hold_commits
from tests.wait import until

WAIT_S = 30  # a bound on each wait of these tests, never reached when they pass


async def commit_started(store: Store, kind: str = "landed") -> asyncio.Task[None]:
    """A task that writes an event in ``store.batch_async()``, once its COMMIT is under
    way (the gate held)."""

    async def committing() -> None:
        async with store.batch_async():
            store.add_event(kind, None, {})

    task = asyncio.create_task(committing())
    await until(store.db.gate.locked, WAIT_S, "the COMMIT under way")
    return task


def kinds(store: Store) -> list[str]:
    return [e.kind for e in store.events()]


async def test_the_commit_runs_on_a_worker_thread_while_the_loop_turns(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    turned = threading.Event()  # set by the loop: the COMMIT waits for it
    threads = hold_commits(monkeypatch, store, lambda: turned.wait(WAIT_S))

    async def turn() -> None:
        while not turned.is_set():
            await asyncio.sleep(0)
            turned.set()  # this ran while the commit was under way

    async with asyncio.TaskGroup() as tasks, store.batch_async():
        store.add_event("landed", "n1", {"rank": 0})
        tasks.create_task(turn())

    assert turned.is_set()
    assert threads and threads[0].startswith("store-commit")  # its own, not the loop's pool
    assert kinds(open_store()) == ["landed"]  # on disk: another connection reads it


async def test_a_read_from_elsewhere_waits_for_the_commit_and_sees_what_it_wrote(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    read: list[list[str]] = []
    reading = threading.Event()

    def reader() -> None:
        reading.set()
        read.append(kinds(store))

    def before() -> None:  # on the committing thread: a read starts, and must wait
        other = threading.Thread(target=reader)
        other.start()
        assert reading.wait(WAIT_S)
        other.join(0.2)
        assert other.is_alive() and read == []  # held by the commit, not interleaved
        release.append(other)

    release: list[threading.Thread] = []
    hold_commits(monkeypatch, store, before)
    async with store.batch_async():
        store.add_event("landed", "n1", {"rank": 0})
    release[0].join(WAIT_S)
    assert read == [["landed"]]


async def test_a_batch_begun_during_the_commit_is_a_transaction_of_its_own(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While the worker commits, the connection is still in a transaction: a batch that
    # joined it would write into a transaction already ending, and its rollback would
    # take the other's writes (or none). It waits, then has its own.
    store = open_store()
    go = threading.Event()
    hold_commits(monkeypatch, store, lambda: go.wait(WAIT_S))

    task = await commit_started(store, "first")
    threading.Timer(0.05, go.set).start()  # let it end, from elsewhere than the loop
    with pytest.raises(RuntimeError), store.batch():  # waits for it, on the loop
        store.add_event("second", None, {})
        raise RuntimeError("the second transaction fails")
    await task
    assert kinds(store) == ["first"]
    assert kinds(open_store()) == ["first"]


async def test_a_commit_that_fails_on_its_thread_rolls_back_and_runs_the_hooks_once(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    hooks: list[int] = []
    store.on_rollback(lambda: hooks.append(1))
    full = [True]

    def before() -> None:
        if full[0]:
            raise sqlite3.OperationalError("database or disk is full")

    hold_commits(monkeypatch, store, before)
    with pytest.raises(StoreError, match=r"cannot write the supervisor store.*disk is full"):
        async with store.batch_async():
            store.add_event("landed", "n1", {"rank": 0})
    assert hooks == [1]
    assert kinds(store) == []

    full[0] = False  # room again: the store goes on
    async with store.batch_async():
        store.add_event("landed", "n1", {"rank": 1})
    assert hooks == [1]
    assert [e.detail["rank"] for e in open_store().events()] == [1]


async def test_a_read_after_a_failed_commit_runs_the_rollbacks_hooks_first(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What is kept in memory of a rolled-back transaction (the catalog's counts, the
    # retired steps) must not be read with the store: the hooks run before any statement
    # after the failed COMMIT, a read too, not only when its batch's coroutine resumes.
    store = open_store()
    hooks: list[str] = []
    store.on_rollback(lambda: hooks.append(threading.current_thread().name))
    go = threading.Event()
    read: list[list[str]] = []

    def before() -> None:
        assert go.wait(WAIT_S)
        raise sqlite3.OperationalError("database or disk is full")

    hold_commits(monkeypatch, store, before)

    task = await commit_started(store)
    reader = threading.Thread(target=lambda: read.append(kinds(store)), name="reader")
    reader.start()  # waits for the gate
    go.set()
    reader.join(WAIT_S)
    assert read == [[]] and hooks == ["reader"]  # before the read, on the reader's way
    with pytest.raises(StoreError):
        await task
    assert hooks == ["reader"]  # once


async def test_a_block_that_fails_is_rolled_back_on_the_loop_without_a_commit(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    hooks: list[int] = []
    store.on_rollback(lambda: hooks.append(1))
    threads = hold_commits(monkeypatch, store, lambda: None)
    with pytest.raises(ValueError):
        async with store.batch_async():
            store.add_event("landed", "n1", {"rank": 0})
            raise ValueError("a landing the store cannot take")
    assert hooks == [1] and threads == [] and kinds(store) == []


@pytest.mark.parametrize("fails", [False, True], ids=["commits", "fails"])
async def test_cancelled_while_committing_the_commit_still_ends(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    store = open_store()
    hooks: list[int] = []
    store.on_rollback(lambda: hooks.append(1))
    go = threading.Event()

    def before() -> None:
        assert go.wait(WAIT_S)
        if fails and not hooks:  # the first only
            raise sqlite3.OperationalError("disk I/O error")

    hold_commits(monkeypatch, store, before)

    task = await commit_started(store)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go.set()
    await until(
        lambda: not store.db.gate.locked() and (hooks or not fails), WAIT_S, "the COMMIT's end"
    )
    assert kinds(open_store()) == ([] if fails else ["landed"])
    assert hooks == ([1] if fails else [])
    async with store.batch_async():  # and the store goes on
        store.add_event("after", None, {})
    assert kinds(store)[-1] == "after" and hooks == ([1] if fails else [])
