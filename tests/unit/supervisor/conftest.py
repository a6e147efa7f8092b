"""Fixtures the supervisor's unit tests share: ``open_store`` runs a test once on each of
the store's databases, SQLite and PostgreSQL (the test session's own cluster,
``pg_cluster`` of ``tests/conftest.py``); ``make_fleet`` builds the fake fleet
(``fake_fleet.FakeFleet``) around a real job controller."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import Store
from tests.pg import PgCluster
from tests.unit.supervisor.fake_fleet import FakeFleet

OpenStore = Callable[..., Store]


def hold_commits(
    monkeypatch: pytest.MonkeyPatch, store: Store, before: Callable[[], None]
) -> list[str]:
    """Each COMMIT that ``store``'s commit thread runs (``Store.batch_async``) first calls
    ``before()`` on that thread: the fault (it raises, as a full disk does) or the wait a
    test injects there. Returns the committing threads' names, one per COMMIT so far."""
    real = store.db.execute_held
    threads: list[str] = []

    def execute_held(sql: str, /) -> Any:
        if sql == "COMMIT":
            threads.append(threading.current_thread().name)
            before()
        return real(sql)

    monkeypatch.setattr(store.db, "execute_held", execute_held)
    return threads


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStore]:
    """``open_store(path=tmp_path / "state.db", **kw)``: a ``Store`` on the test's database;
    the same ``path`` opens the same database again (a restart). Each is closed after
    the test."""
    urls: dict[Path, str] = {}
    opened: list[Store] = []

    def open_(path: Path | None = None, **kw: Any) -> Store:
        path = path or tmp_path / "state.db"
        if request.param == "sqlite":
            store = Store(path, **kw)
        else:
            if path not in urls:
                cluster: PgCluster = request.getfixturevalue("pg_cluster")
                urls[path] = cluster.new_database()
            store = Store(path, url=urls[path], **kw)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


MakeFleet = Callable[..., FakeFleet]


@pytest.fixture
async def make_fleet(tmp_path: Path) -> AsyncIterator[MakeFleet]:
    """``make_fleet(nodes, gang=None, **kw)``: a :class:`FakeFleet` of ``nodes`` (``kw``:
    its settings), with a job running on ``gang`` when one is named (``FakeFleet.running``).
    Each is closed after the test (what it holds released, its tasks cancelled)."""
    made: list[FakeFleet] = []

    def make(nodes: Iterable[str], *, gang: list[str] | None = None, **kw: Any) -> FakeFleet:
        fleet = FakeFleet(tmp_path, nodes, **kw)
        made.append(fleet)
        if gang is not None:
            fleet.running(gang)
        return fleet

    yield make
    for fleet in made:
        await fleet.close()
