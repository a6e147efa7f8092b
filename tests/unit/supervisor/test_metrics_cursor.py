"""``GET /v1/jobs/{id}/metrics?after=CURSOR``: the points inserted since a poll, late
windows included, on the real store and the real API (aiohttp's test client)."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.store import Store
from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import KEEP_PER_LEVEL, Point
from tests.unit.supervisor.conftest import OpenStore

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC = {
    "name": "train",
    "team": "ml",
    "command": ["python", "train.py"],
    "workdir": "/work",
    "nodes": 1,
    "ranks_per_node": 1,
}


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Supervisor, TestClient[Any, Any]]]:
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    async with TestClient(TestServer(make_app(sup))) as client:
        yield sup, client
    sup.store.close()


def add(store: Store, job: str, step: int, ts: float, name: str = "loss") -> None:
    SeriesRows(store).add_point(
        job, name, Point(step, ts, float(step), float(step), float(step)), counts(store, job)
    )


def counts(store: Store, job: str) -> dict[tuple[str, int], int]:
    return SeriesRows(store).series_counts(job)


async def submit(client: TestClient[Any, Any]) -> str:
    resp = await client.post("/v1/jobs", json={"spec": SPEC}, headers=AUTH)
    assert resp.status == 201
    return str((await resp.json())["id"])


async def poll(client: TestClient[Any, Any], job: str, query: str) -> dict[str, Any]:
    resp = await client.get(f"/v1/jobs/{job}/metrics?names=loss&{query}", headers=AUTH)
    assert resp.status == 200, await resp.text()
    body: dict[str, Any] = await resp.json()
    return body


def steps(body: dict[str, Any]) -> list[int]:
    return [p[0] for p in body["series"]["loss"]]


async def test_a_late_window_comes_with_after_polling_and_is_missed_by_since_polling(
    served: tuple[Supervisor, TestClient[Any, Any]],
) -> None:
    sup, client = served
    job = await submit(client)
    for step, ts in ((10, 100.0), (20, 105.0), (30, 110.0)):
        add(sup.store, job, step, ts)
    first = await poll(client, job, "")
    newest_ts = max(p[1] for p in first["series"]["loss"])
    # a node's window of time 107 arrives after the poll, then the next one
    add(sup.store, job, 25, 107.0)
    add(sup.store, job, 40, 115.0)

    by_time = await poll(client, job, f"since={newest_ts}")
    by_cursor = await poll(client, job, f"after={first['cursor']}")

    assert steps(first) == [10, 20, 30]
    assert steps(by_time) == [30, 40]  # the late window is lost to a client polling by time
    assert steps(by_cursor) == [25, 40]
    assert by_cursor["cursor"] > first["cursor"]


async def test_a_poll_with_nothing_new_answers_no_point_and_the_same_cursor(
    served: tuple[Supervisor, TestClient[Any, Any]],
) -> None:
    sup, client = served
    job = await submit(client)
    empty = await poll(client, job, "after=0")
    add(sup.store, job, 10, 100.0)
    once = await poll(client, job, f"after={empty['cursor']}")

    again = await poll(client, job, f"after={once['cursor']}")

    assert empty["cursor"] == 0 and steps(empty) == []
    assert steps(once) == [10]
    assert steps(again) == [] and again["cursor"] == once["cursor"]


async def test_the_cursor_covers_every_series_of_the_job_and_after_combines_with_names(
    served: tuple[Supervisor, TestClient[Any, Any]],
) -> None:
    sup, client = served
    job = await submit(client)
    add(sup.store, job, 10, 100.0)
    before = await poll(client, job, "")
    add(sup.store, job, 10, 100.0, name="grad_norm")
    add(sup.store, job, 20, 105.0)

    resp = await client.get(f"/v1/jobs/{job}/metrics?after={before['cursor']}", headers=AUTH)
    body = await resp.json()

    assert {name: [p[0] for p in pts] for name, pts in body["series"].items()} == {
        "grad_norm": [10],
        "loss": [20],
    }


@pytest.mark.parametrize("value", ["-1", "x", "1.5", str(2**63), ""])
async def test_a_bad_after_is_a_400_naming_it(
    served: tuple[Supervisor, TestClient[Any, Any]], value: str
) -> None:
    _, client = served
    job = await submit(client)

    resp = await client.get(f"/v1/jobs/{job}/metrics?after={value}", headers=AUTH)

    assert resp.status == 400
    assert "query 'after'" in (await resp.json())["error"]


def test_thinning_keeps_the_cursor_of_the_newer_window_so_no_cursor_is_reused(
    tmp_path: Path,
    open_store: OpenStore,
) -> None:
    store = open_store()
    rows = SeriesRows(store)  # its table made before the batch's transaction begins
    windows = 3 * KEEP_PER_LEVEL
    marks = {}
    with store.batch():  # one transaction: no fsync a window
        for i in range(1, windows + 1):
            add(store, "j", i, 1000.0 + 5 * i)
            marks[i] = rows.cursor("j")

    late = rows.series("j", ["loss"], after=marks[windows - 10])["loss"]

    assert rows.cursor("j") == windows  # one id per window: merged points take no new one
    assert sum(rows.series_counts("j").values()) < windows  # it did thin
    assert [p.step for p in late] == list(range(windows - 9, windows + 1))
    store.close()


def test_a_store_from_before_the_cursor_keeps_its_points_in_their_order(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE metric_points (job TEXT NOT NULL, name TEXT NOT NULL, level INTEGER "
        "NOT NULL, step INTEGER NOT NULL, ts REAL NOT NULL, value REAL, low REAL, high REAL, "
        "n INTEGER NOT NULL); CREATE INDEX metric_points_series ON metric_points "
        "(job, name, level, ts);"
    )
    for step in (1, 3, 2):
        db.execute(
            "INSERT INTO metric_points VALUES ('j', 'loss', 0, ?, ?, ?, ?, ?, 1)",
            (step, 100.0 + step, 0.5, 0.5, 0.5),
        )
    db.commit()
    db.close()

    store = Store(path)
    rows = SeriesRows(store)
    add(store, "j", 4, 104.0)

    assert [p.step for p in rows.series("j", ["loss"])["loss"]] == [1, 2, 3, 4]
    assert [p.step for p in rows.series("j", ["loss"], after=2)["loss"]] == [2, 4]
    assert rows.cursor("j") == 4
    store.close()
