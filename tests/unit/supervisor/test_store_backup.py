"""The store's rolling online backup (``supervisor.backup``) on real SQLite files: a
backup is a sound, self-contained database with the store's rows, the newest ``keep``
are kept, and a damaged store never replaces a sound backup."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ckpt.stores import LocalFolderStore, S3Store
from supervisor.auth.rows import TokenRows
from supervisor.backup import REMOTE_FOLDER, StoreBackups, backups_in, take_backup
from supervisor.checkpoints.rows import CkptRows
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
    rows = CkptRows.of(store)
    rows.add_shard("j-1", 100, "nvme", 0, "n01", None, 4096, "xxh3_128:00", 1.0, generation=2)
    rows.add_commit("j-1", 100, "nvme", 2.0)
    rows.ended_catalogs_sent("j-1", ["n01"])
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


async def test_each_backup_is_also_uploaded_whole_and_the_newest_are_kept_there(
    tmp_path: Path,
) -> None:
    store = store_with_rows(tmp_path / "state.db")
    remote = LocalFolderStore(tmp_path / "bucket")
    try:
        backups = StoreBackups(
            store.path, tmp_path / "backup", interval_s=300.0, keep=2, remote=remote
        )
        made = [await backups.take() for _ in range(3)]
    finally:
        store.close()

    assert all(m is not None for m in made)
    names = [m.path.name for m in made if m is not None]
    assert remote.keys(REMOTE_FOLDER) == [f"{REMOTE_FOLDER}/{n}" for n in names[1:]]
    for name in names[1:]:  # each upload is the folder's backup, byte for byte
        uploaded = remote.get(f"{REMOTE_FOLDER}/{name}", max_nbytes=1 << 30)
        assert uploaded == (tmp_path / "backup" / name).read_bytes()
    assert backups.upload_failures == 0 and backups.uploaded_at is not None


async def test_an_upload_that_fails_is_logged_and_counted_and_the_folders_copy_stands(
    tmp_path: Path,
) -> None:
    store = store_with_rows(tmp_path / "state.db")
    blocked = tmp_path / "bucket"
    remote = LocalFolderStore(blocked)
    blocked.rmdir()
    blocked.write_text("a file where the bucket's folder should be")
    try:
        backups = StoreBackups(
            store.path,
            tmp_path / "backup",
            interval_s=300.0,
            keep=2,
            remote=remote,
        )
        made = await backups.take()
    finally:
        store.close()

    assert made is not None and backups_in(tmp_path / "backup") == [made.path]
    assert backups.upload_failures == 1 and backups.uploaded_at is None
    assert backups.failures == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://bucket/x", "no object store URL"),
        ("s3:///prefix", "names no bucket"),
        ("file://relative", "no object store URL"),
    ],
)
def test_a_backup_url_that_is_no_object_store_is_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StoreSettings(backup_url=url)
    assert StoreSettings(backup_url="s3://b/p").backup_url == "s3://b/p"


async def test_backups_go_to_a_real_s3_protocol_server(tmp_path: Path) -> None:
    moto_server = pytest.importorskip("moto.moto_server.threaded_moto_server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    remote = S3Store(
        "backups",
        "fleet-a/",
        endpoint_url=f"http://{host}:{port}",
        access_key="test",
        secret_key="test",
        timeout_s=30,
    )
    store = store_with_rows(tmp_path / "state.db")
    try:
        remote._run(remote.client.create_bucket(Bucket="backups"))
        backups = StoreBackups(
            store.path, tmp_path / "backup", interval_s=300.0, keep=1, remote=remote
        )
        first, second = await backups.take(), await backups.take()
        assert first is not None and second is not None
        assert remote.keys(REMOTE_FOLDER) == [f"{REMOTE_FOLDER}/{second.path.name}"]
        got = remote.get(f"{REMOTE_FOLDER}/{second.path.name}", max_nbytes=1 << 30)
        assert got == second.path.read_bytes()
        assert backups.upload_failures == 0
    finally:
        store.close()
        remote.close()
        server.stop()
