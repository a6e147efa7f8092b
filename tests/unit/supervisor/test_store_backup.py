"""The store's rolling online backup (``supervisor.backup``) on real SQLite files: a
backup is a sound, self-contained database with the store's rows, the newest ``keep``
are kept, and a damaged store never replaces a sound backup."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from supervisor.auth.rows import TokenRows
from supervisor.backup import StoreBackups, backups_in, take_backup
from supervisor.config import StoreSettings, SupervisorSettings
from supervisor.errors import StoreError
from supervisor.store import Store
from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import Point
from tests.unit.supervisor.test_store_corrupt import damage, filled_store, fold, page_at

TABLES = (
    "nodes",
    "jobs",
    "events",
    "ckpt_shards",
    "ckpt_commits",
    "ckpt_ended_catalogs",
    "metric_points",
    "api_tokens",
)


def store_with_rows(path: Path) -> Store:
    """A store with rows in every table, left open (its latest writes in the WAL)."""
    store = Store(path)
    store.save_node("n01", {"rack": "r1", "drain": {"reason": "bad fan", "by": "operator"}})
    store.save_job("j-1", "running", {"spec": {"name": "train"}, "generation": 2})
    store.add_event("job_submitted", None, {"job": "j-1"})
    store.add_shard("j-1", 100, "nvme", 0, "n01", None, 4096, "xxh3_128:00", 1.0, generation=2)
    store.add_commit("j-1", 100, "nvme", 2.0)
    store.ended_catalogs_sent("j-1", ["n01"])
    counts = SeriesRows(store).series_counts("j-1")
    for step in range(40):
        SeriesRows(store).add_point(
            "j-1", "loss", Point(step, 10.0 + step, 1.0 / (step + 1), 0.0, 1.0), counts
        )
    TokenRows(store).add_token(1, "t1", "ci", "member", "research", "ab" * 32, 3.0, "t0", None)
    return store


def rows(path: Path) -> dict[str, list[tuple[object, ...]]]:
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in TABLES}
    finally:
        db.close()


def test_backup_is_a_sound_self_contained_database_with_the_stores_rows(tmp_path: Path) -> None:
    store = store_with_rows(tmp_path / "state.db")
    try:
        made = take_backup(store.path, tmp_path / "backup", keep=3)
        expected = rows(store.path)
    finally:
        store.close()

    assert backups_in(tmp_path / "backup") == [made.path]
    assert made.path.name.startswith("state-")
    assert sorted(p.name for p in made.path.parent.iterdir()) == [made.path.name]  # no -wal
    db = sqlite3.connect(made.path)
    try:
        assert db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA journal_mode").fetchall() == [("delete",)]
    finally:
        db.close()
    assert rows(made.path) == expected
    assert all(expected[t] for t in TABLES)


def test_only_the_newest_backups_are_kept(tmp_path: Path) -> None:
    store = store_with_rows(tmp_path / "state.db")
    try:
        made = [take_backup(store.path, tmp_path / "backup", keep=2).path for _ in range(3)]
    finally:
        store.close()

    assert backups_in(tmp_path / "backup") == made[1:]


def test_backup_of_a_damaged_store_fails_and_keeps_the_older_backups(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    filled_store(path)
    good = take_backup(path, tmp_path / "backup", keep=1).path
    fold(path)
    damage(path, page_at(path))

    with pytest.raises(StoreError, match="failed its check"):
        take_backup(path, tmp_path / "backup", keep=1)

    assert sorted((tmp_path / "backup").iterdir()) == [good]  # no half copy left either


def test_backups_go_next_to_the_state_unless_a_folder_is_named_or_they_are_off(
    tmp_path: Path,
) -> None:
    assert SupervisorSettings(state_dir=tmp_path).backup_dir() == tmp_path / "backup"
    named = SupervisorSettings(state_dir=tmp_path, store=StoreSettings(backup_path=Path("/mnt/b")))
    assert named.backup_dir() == Path("/mnt/b")
    off = SupervisorSettings(state_dir=tmp_path, store=StoreSettings(backup_interval_s=0))
    assert off.backup_dir() is None


async def test_a_backup_folder_that_cannot_be_used_is_logged_and_counted(tmp_path: Path) -> None:
    store = store_with_rows(tmp_path / "state.db")
    not_a_folder = tmp_path / "backup"
    not_a_folder.write_text("a file where the folder should be")
    try:
        backups = StoreBackups(store.path, not_a_folder, interval_s=300.0, keep=2)
        made = await backups.take()
    finally:
        store.close()

    assert made is None
    assert backups.failures == 1
    assert backups.last_at is None
