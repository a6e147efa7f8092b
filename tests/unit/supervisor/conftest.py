"""Fixtures the supervisor's unit tests share: ``open_store`` runs a test once on each of
the store's databases, SQLite and PostgreSQL (the test session's own cluster,
``pg_cluster`` of ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import Store
from tests.pg import PgCluster

OpenStore = Callable[..., Store]


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
