"""The store's rolling online backup: a whole copy of ``state.db`` every few minutes.

A copy is taken with SQLite's online backup API (``sqlite3.Connection.backup``) while
the supervisor keeps writing, on a connection and a thread of its own, so the event
loop never waits for it:

* the source connection pins one read snapshot for the whole copy (WAL: the
  supervisor's writes go on beside it and never restart it), and the pages are copied
  ``PAGES_PER_STEP`` at a time, so a shutdown stops a copy between two steps;
* the copy is written to a hidden temporary name in the backup folder, switched to a
  self-contained file (rollback journal: no ``-wal`` beside it), checked with
  ``PRAGMA quick_check``, fsynced, and only then renamed to
  ``state-YYYYmmddTHHMMSS.fffZ.db`` (UTC, so the names sort by age) and the folder
  fsynced: a backup under its final name is whole and sound;
* the oldest are removed down to ``keep`` only once a new one is in place, and a copy
  that fails its check (a damaged store: SQLite copies damaged pages as they are) is
  dropped, so the older, sound backups stay.

The copy goes to a folder (``store.backup_path``) and, with ``store.backup_url``, each
sound copy is then uploaded to an object store (``s3://BUCKET/PREFIX`` or a folder), as
``phalanx-store/state-....db`` under the URL, keeping ``keep`` there too: an off-host copy
that outlives the host. An upload that fails is logged and counted; the folder's copy
stands. docs/operations.md ("The store's safety") says how to restore one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckpt.stores import ObjectStore
from supervisor.errors import StoreError
from supervisor.store_guard import quick_check

log = logging.getLogger(__name__)

PREFIX = "state-"
SUFFIX = ".db"
REMOTE_FOLDER = "phalanx-store"  # the backups' folder under store.backup_url
UPLOAD_PART_BYTES = 8 << 20
# Pages copied per step of the backup API (4 MiB of 4 KiB pages): a shutdown waits at
# most one step for a copy in flight.
PAGES_PER_STEP = 1024


class BackupStopped(Exception):
    """The copy was stopped between two steps (the supervisor is shutting down)."""


@dataclass(frozen=True)
class Backup:
    path: Path
    pages: int
    seconds: float


def backups_in(folder: Path) -> list[Path]:
    """The backups in ``folder``, oldest first (their names sort by time)."""
    try:
        found = [p for p in folder.iterdir() if p.name.startswith(PREFIX) and p.suffix == SUFFIX]
    except FileNotFoundError:
        return []
    return sorted(found, key=lambda p: p.name)


def backup_name(at: float) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(at))
    return f"{PREFIX}{stamp}.{int(at * 1000) % 1000:03d}Z{SUFFIX}"


def take_backup(
    source: Path, folder: Path, keep: int, stop: threading.Event | None = None
) -> Backup:
    """Copy the SQLite database ``source`` into ``folder`` as a new backup and keep the
    newest ``keep``; blocking (run it in a thread). Raises ``StoreError`` when the
    copy cannot be made or fails its check (nothing is left of it then),
    ``BackupStopped`` when ``stop`` is set meanwhile."""
    started = time.monotonic()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f".{PREFIX}*{SUFFIX}.tmp"):  # a copy a crash cut short
            stale.unlink(missing_ok=True)
    except OSError as exc:
        raise StoreError(source, f"cannot back up {source} to {folder}: {exc}") from exc
    at = time.time()
    while (final := folder / backup_name(at)).exists():  # two within one millisecond
        at += 0.001
    tmp = folder / f".{final.name}.tmp"
    pages = 0

    def progress(status: int, remaining: int, total: int) -> None:
        nonlocal pages
        pages = total
        if stop is not None and stop.is_set():
            raise BackupStopped(f"backup of {source} stopped: the supervisor is shutting down")

    try:
        src = sqlite3.connect(
            f"{source.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None
        )
        try:
            dst = sqlite3.connect(tmp, isolation_level=None)
            try:
                src.execute("BEGIN")  # one read snapshot for the whole copy
                src.execute("SELECT COUNT(*) FROM sqlite_master").fetchall()
                src.backup(dst, pages=PAGES_PER_STEP, progress=progress)
                src.execute("COMMIT")
                dst.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
                found = quick_check(dst)
            finally:
                dst.close()
        finally:
            src.close()
        if found is not None:
            raise StoreError(
                source,
                f"the backup of {source} failed its check ({found}): the store is likely "
                "damaged; the older backups are kept",
            )
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(folder)
    except (sqlite3.Error, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise StoreError(source, f"cannot back up {source} to {folder}: {exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        for old in backups_in(folder)[:-keep]:
            old.unlink(missing_ok=True)
    except OSError as exc:  # the new backup is in place all the same
        log.warning("cannot remove the old backups in %s: %s", folder, exc)
    return Backup(final, pages, time.monotonic() - started)


def upload_backup(
    path: Path, remote: ObjectStore, keep: int, stop: threading.Event | None = None
) -> str:
    """Upload the backup ``path`` to ``remote`` (streamed, visible only once whole) and
    keep the newest ``keep`` there; blocking. Returns where it went."""
    key = f"{REMOTE_FOLDER}/{path.name}"

    def parts() -> Iterator[bytes]:
        with path.open("rb") as f:
            while chunk := f.read(UPLOAD_PART_BYTES):
                if stop is not None and stop.is_set():
                    raise BackupStopped(f"upload of {path} stopped: the supervisor is stopping")
                yield chunk

    remote.put_stream(key, parts())
    ours = sorted(
        k
        for k in remote.keys(REMOTE_FOLDER)
        if k.rsplit("/", 1)[-1].startswith(PREFIX) and k.endswith(SUFFIX)
    )
    if len(ours) > keep:
        remote.delete(ours[:-keep])
    return f"{remote.url.rstrip('/')}/{key}"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StoreBackups:
    """The supervisor's backup loop: a backup of ``source`` into ``folder`` every
    ``interval_s`` (the first once the newest backup there is that old: a restart does
    not add one), ``keep`` of them. A failed backup is logged and counted; the loop goes
    on at the next interval."""

    def __init__(
        self,
        source: Path,
        folder: Path,
        *,
        interval_s: float,
        keep: int,
        remote: ObjectStore | None = None,
    ) -> None:
        self.source = source
        self.folder = folder
        self.interval_s = interval_s
        self.keep = keep
        self.remote = remote
        self.last_at: float | None = None  # wall time of the newest sound backup
        self.failures = 0
        self.uploaded_at: float | None = None  # wall time of the newest upload
        self.upload_failures = 0
        self._stop = threading.Event()
        try:
            newest = backups_in(folder)
            if newest:
                self.last_at = newest[-1].stat().st_mtime
        except OSError as exc:  # the first backup says it again, and counts it
            log.warning("cannot read the backup folder %s: %s", folder, exc)

    def due_in(self) -> float:
        """Seconds until the next backup is due (0: now)."""
        if self.last_at is None:
            return 0.0
        # Never more than one interval, even if the newest backup's time is ahead of the
        # clock (the clock was set back).
        return min(self.interval_s, max(0.0, self.last_at + self.interval_s - time.time()))

    async def loop(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(self.due_in())
            if await self.take() is None:
                await asyncio.sleep(self.interval_s)  # failed: try again in one interval

    async def take(self) -> Backup | None:
        """One backup now, on a thread; None when it failed (logged) or was stopped."""
        try:
            made = await asyncio.to_thread(
                take_backup, self.source, self.folder, self.keep, self._stop
            )
        except BackupStopped:
            return None
        except StoreError as exc:
            self.failures += 1
            log.error("%s", exc)
            return None
        self.last_at = time.time()
        log.info("store backed up to %s: %d pages in %.2f s", made.path, made.pages, made.seconds)
        if self.remote is not None:
            await self._upload(made.path, self.remote)
        return made

    async def _upload(self, path: Path, remote: ObjectStore) -> None:
        started = time.monotonic()
        try:
            where = await asyncio.to_thread(upload_backup, path, remote, self.keep, self._stop)
        except BackupStopped:
            return
        except Exception as exc:  # any store's error (OSError, botocore's): the loop goes on
            self.upload_failures += 1
            log.error(
                "cannot upload the store's backup %s to %s: %s (the folder's copy stands)",
                path,
                remote.url,
                exc,
            )
            return
        self.uploaded_at = time.time()
        log.info("store backup uploaded to %s in %.2f s", where, time.monotonic() - started)

    def close(self) -> None:
        """Stop: a copy in flight ends at its next step, and no other starts."""
        self._stop.set()
