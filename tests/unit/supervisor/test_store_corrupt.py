"""A damaged state database is refused at open with how to recover, and damage met later
is reported, never a bare ``sqlite3.DatabaseError``.

The damage is real: pages of a real store's file are overwritten with garbage, as a
failing disk or a copy taken mid-write leaves them.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.errors import StoreCorrupt
from supervisor.store import Store
from tests.harness import TOKEN

NODES = 2000  # ~150 pages of node records: most of the file is the nodes table
PAGE = 4096


def filled_store(path: Path) -> None:
    """A store of ``NODES`` node records, its write-ahead log folded into the file."""
    store = Store(path)
    with store.batch():
        for i in range(NODES):
            store.save_node(f"n{i:04d}", {"rack": f"r{i % 16}", "note": "x" * 200})
    store.close()
    fold(path)


def fold(path: Path) -> None:
    """Fold the write-ahead log into the file: the pages to damage are all in it."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


def commit_aside(path: Path) -> None:
    """Another connection's commit: it makes the store's connection drop the pages it
    cached and read them from the file again (as after any change it did not make)."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("INSERT INTO events (ts, kind, node, detail) VALUES (1.0, 'aside', NULL, '{}')")
    other.close()


def damage(path: Path, first: int, count: int = 3) -> None:
    """Overwrite ``count`` pages of ``path`` from page index ``first`` (0: the header)."""
    with path.open("r+b") as f:
        f.seek(first * PAGE)
        f.write(b"\xde\xad\xbe\xef" * (PAGE // 4) * count)


def page_at(path: Path, fraction: float = 0.5) -> int:
    """The index of the page at ``fraction`` of the file (0.5: its middle)."""
    return int(path.stat().st_size // PAGE * fraction)


def test_store_with_damaged_pages_is_refused_at_open_naming_the_file_and_the_backups(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    filled_store(path)
    damage(path, page_at(path))

    with pytest.raises(StoreCorrupt) as caught:
        Store(path, backups=tmp_path / "backup")

    message = str(caught.value)
    assert f"the supervisor store {path} is corrupt" in message
    assert f"copy the newest state-*.db of {tmp_path / 'backup'} in its place" in message
    assert "\n" not in message
    assert caught.value.path == path


def test_file_whose_header_is_damaged_is_refused_as_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    filled_store(path)
    damage(path, 0, count=1)

    with pytest.raises(StoreCorrupt, match="file is not a database"):
        Store(path)


def test_damage_met_at_runtime_raises_store_corrupt_and_marks_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db"
    filled_store(path)
    store = Store(path, backups=tmp_path / "backup")
    try:
        damage(path, page_at(path))
        commit_aside(path)

        with pytest.raises(StoreCorrupt, match="database disk image is malformed"):
            store.load_nodes()
        with pytest.raises(StoreCorrupt):
            store.load_nodes()
    finally:
        store.close()

    assert store.corrupt is not None
    said = [r for r in caplog.records if r.levelname == "CRITICAL"]
    assert len(said) == 1  # once, not at every read
    assert "copy the newest state-*.db" in said[0].getMessage()


async def test_api_answers_503_naming_the_store_once_damage_is_met_and_healthz_says_so(
    tmp_path: Path,
) -> None:
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    path = tmp_path / "state.db"
    try:
        with sup.store.batch():
            for i in range(NODES):
                sup.store.add_event("note", None, {"n": i, "note": "x" * 200})
        fold(path)
        damage(path, page_at(path, 0.75))  # among the newest events, which a page shows
        commit_aside(path)
        async with TestClient(TestServer(make_app(sup))) as client:
            events = await client.get(
                "/v1/events", params={"limit": "1000"}, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            health = await client.get("/healthz")

            assert events.status == 503
            assert f"the supervisor store {path} is corrupt" in (await events.json())["error"]
            assert health.status == 200
            assert (await health.json())["store_ok"] is False
    finally:
        sup.store.close()


def test_supervisor_refuses_a_corrupt_store_in_one_line_without_a_traceback(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    filled_store(state / "state.db")
    damage(state / "state.db", page_at(state / "state.db"))
    conf = tmp_path / "supervisor.toml"
    conf.write_text(
        f'state_dir = "{state}"\n[mqtt]\nport = 1\n[api]\nport = 0\ntoken = "{TOKEN}"\n'
    )

    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "--config", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(
        f"phalanx-supervisor: the supervisor store {state / 'state.db'} is corrupt"
    )
    assert "to recover" in lines[-1]
