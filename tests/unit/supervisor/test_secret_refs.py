"""A ``from_file`` env value is a reference wherever the supervisor keeps or shows a job:
its stored record, the API's views of it, its events and the start order sent to a node
hold the file's path, never what the file holds (the supervisor never reads it).

The supervisor is the real one, built but never started (no broker), its API served by
aiohttp's test server; its SQLite files are read raw, -wal and -shm included.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from phalanx import wire
from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.jobs import RankPlace

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def secret(tmp_path: Path) -> tuple[Path, str]:
    """A file holding a secret, as a node would have it (here the supervisor could read it)."""
    value = f"s3cr3t-{secrets.token_hex(16)}"
    path = tmp_path / "secrets" / "db-password"
    path.parent.mkdir()
    path.write_text(value + "\n")
    return path, value


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Supervisor, TestClient[object, object]]]:
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path / "state"), TOKEN)
    async with TestClient(TestServer(make_app(sup))) as client:
        yield sup, client
    sup.store.close()


def _stored(state_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(state_dir.glob("state.db*")))


async def test_a_job_is_stored_shown_and_ordered_with_its_secret_as_a_reference_only(
    served: tuple[Supervisor, TestClient[object, object]],
    secret: tuple[Path, str],
    tmp_path: Path,
) -> None:
    sup, client = served
    path, value = secret
    spec = {
        "name": "train",
        "team": "ml",
        "command": ["python", "train.py"],
        "workdir": "/work",
        "nodes": 1,
        "ranks_per_node": 1,
        "env": {"DB_PASSWORD": {"from_file": str(path)}, "MODE": "fast"},
    }
    resp = await client.post("/v1/jobs", json={"spec": spec}, headers=AUTH)
    assert resp.status == 201, await resp.text()
    job_id = (await resp.json())["id"]

    answers = {}
    for url in ("/v1/jobs", f"/v1/jobs/{job_id}", f"/v1/events?job={job_id}", "/v1/events"):
        got = await client.get(url, headers=AUTH)
        assert got.status == 200, url
        answers[url] = await got.read()
    view = json.loads(answers[f"/v1/jobs/{job_id}"])
    assert view["spec"]["env"] == {"DB_PASSWORD": f"<from_file {path}>", "MODE": "fast"}

    record = sup.store.load_jobs()[job_id]
    assert record["spec"]["env"]["DB_PASSWORD"] == {"from_file": str(path)}
    stored = _stored(tmp_path / "state")
    assert str(path).encode() in stored

    job = sup.jobs.get(job_id)
    job.generation, job.nodes, job.ranks = 1, ["n01"], [RankPlace(0, "n01", 0)]
    order = sup.jobs.orders.start_args(job, 0, "n01")
    assert order.env["DB_PASSWORD"] == wire.EnvFromFile(from_file=str(path))
    sent = order.model_dump_json().encode()

    places = {**answers, "the store": stored, "the start order": sent}
    assert [where for where, data in places.items() if value.encode() in data] == []
