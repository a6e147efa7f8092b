"""``GET /v1/jobs``: filters by state and team, and pages newest first with a cursor,
on a store of many jobs; without parameters, the answer of old."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOBS = 150  # teams a, b, c in turn; every fifth cancelled


def spec(i: int) -> dict[str, Any]:
    return {
        "name": f"train{i}",
        "team": "abc"[i % 3],
        "command": ["python", "train.py"],
        "workdir": "/work",
        "nodes": 1,
        "ranks_per_node": 1,
    }


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobs")


async def serve(state_dir: Path) -> tuple[Supervisor, TestClient[Any, Any]]:
    sup = Supervisor(SupervisorSettings(state_dir=state_dir), TOKEN)
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(sup)))
    await client.start_server()
    return sup, client


@pytest.fixture
async def api(state_dir: Path) -> AsyncIterator[TestClient[Any, Any]]:
    """The supervisor of a store with :data:`JOBS` jobs, submitted through the API by the
    first test that asks; the next ones read them back from the store (so the tests
    count the jobs there are, not :data:`JOBS`)."""
    sup, client = await serve(state_dir)
    if not sup.jobs.jobs:
        for i in range(JOBS):
            resp = await client.post("/v1/jobs", json={"spec": spec(i)}, headers=AUTH)
            assert resp.status == 201
            if i % 5 == 1:
                job = (await resp.json())["id"]
                assert (await client.post(f"/v1/jobs/{job}/cancel", headers=AUTH)).status == 200
    yield client
    await client.close()
    sup.store.close()


async def get(client: TestClient[Any, Any], query: str) -> tuple[list[dict[str, Any]], Any]:
    resp = await client.get(f"/v1/jobs{query}", headers=AUTH)
    assert resp.status == 200, await resp.text()
    return await resp.json(), resp.headers


async def walk(client: TestClient[Any, Any], query: str) -> list[list[str]]:
    """Every page of ``query``, following ``X-Phalanx-Next``."""
    pages, cursor = [], None
    while True:
        jobs, headers = await get(client, query + (f"&before={cursor}" if cursor else ""))
        pages.append([j["id"] for j in jobs])
        cursor = headers.get("X-Phalanx-Next")
        if cursor is None:
            return pages


def newest_first(jobs: list[dict[str, Any]]) -> list[str]:
    return [j["id"] for j in sorted(jobs, key=lambda j: (j["submitted_at"], j["id"]), reverse=True)]


async def test_without_parameters_the_answer_is_every_job_oldest_first_and_no_cursor(
    api: TestClient[Any, Any],
) -> None:
    jobs, headers = await get(api, "")

    assert len(jobs) >= JOBS  # (one test submits more)
    assert [j["submitted_at"] for j in jobs] == sorted(j["submitted_at"] for j in jobs)
    assert "X-Phalanx-Next" not in headers and "X-Phalanx-Total" not in headers


async def test_pages_walk_every_job_once_newest_first(api: TestClient[Any, Any]) -> None:
    everything, _ = await get(api, "")

    pages = await walk(api, "?limit=40")
    _, headers = await get(api, "?limit=40")

    assert len(pages) == -(-len(everything) // 40) and all(len(p) == 40 for p in pages[:-1])
    assert [job for page in pages for job in page] == newest_first(everything)
    assert headers["X-Phalanx-Total"] == str(len(everything))


async def test_state_and_team_filter_the_jobs_and_their_pages(api: TestClient[Any, Any]) -> None:
    everything, _ = await get(api, "")
    wanted = [j for j in everything if j["state"] == "cancelled" and j["team"] == "b"]

    filtered, _ = await get(api, "?state=cancelled&team=b")
    pages = await walk(api, "?state=cancelled,succeeded&team=b&limit=7")
    pending, _ = await get(api, "?state=pending,running")

    assert len(wanted) == JOBS // 15 and filtered == wanted
    assert [job for page in pages for job in page] == newest_first(wanted)
    assert {j["state"] for j in pending} == {"pending"} and len(pending) == sum(
        j["state"] == "pending" for j in everything
    )


async def test_a_page_stays_in_place_while_jobs_are_submitted(
    api: TestClient[Any, Any],
) -> None:
    first, headers = await get(api, "?limit=10")
    resp = await api.post("/v1/jobs", json={"spec": spec(0)}, headers=AUTH)
    fresh = (await resp.json())["id"]

    second, _ = await get(api, f"?limit=10&before={headers['X-Phalanx-Next']}")
    now_first, _ = await get(api, "?limit=10")

    everything, _ = await get(api, "")
    order = newest_first(everything)
    assert [j["id"] for j in second] == order[11:21]  # after the page it followed
    assert [j["id"] for j in now_first] == [fresh, *[j["id"] for j in first][:9]]
    assert (await api.post(f"/v1/jobs/{fresh}/cancel", headers=AUTH)).status == 200


async def test_only_before_pages_a_hundred_at_a_time(api: TestClient[Any, Any]) -> None:
    first, headers = await get(api, "?limit=1")

    page, after = await get(api, f"?before={headers['X-Phalanx-Next']}")

    assert len(page) == 100 and page[0]["id"] != first[0]["id"]
    assert "X-Phalanx-Next" in after


def cursor(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


@pytest.mark.parametrize(
    ("query", "parameter"),
    [
        ("state=bogus", "state"),
        ("state=running,Running", "state"),
        ("state=", "state"),
        ("team=", "team"),
        ("team=" + "t" * 201, "team"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("before=%%%", "before"),
        ("before=" + cursor(b"[1.0]"), "before"),
        ("before=" + cursor(b'[NaN, "j"]'), "before"),
        ("before=" + cursor(b'[true, "j"]'), "before"),
        ("before=" + cursor(b"\xff\xfe"), "before"),
        ("limit=5&before=" + cursor(b'{"a": 1}'), "before"),
    ],
)
async def test_a_bad_query_value_is_a_400_naming_the_parameter(
    api: TestClient[Any, Any], query: str, parameter: str
) -> None:
    resp = await api.get(f"/v1/jobs?{query}", headers=AUTH)

    assert resp.status == 400
    assert f"query '{parameter}'" in (await resp.json())["error"]
