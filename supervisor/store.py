"""The supervisor's persistent store: SQLite under the state directory, or PostgreSQL
(``store.url``; :mod:`supervisor.store_db` says how one set of queries serves both).

Only what must survive a restart is written: a node's identity, its drain and
last known health and state, the event log, the checkpoint catalog, the jobs'
downsampled metric series (``supervisor.telemetry.rows``) and the API tokens, hashed
(``supervisor.auth.rows``). Heartbeats that change
nothing never touch the disk. Writes are small and synchronous (WAL mode), so
that a change acknowledged to an operator is on disk.

The writes that come by the thousand from the fleet (a node's events and record at a
birth or a heartbeat timeout, a 16,384-rank gang's exits) may be written *soon*
instead (:meth:`Store.add_event_soon`, :meth:`~Store.save_node_soon`,
:meth:`~Store.save_job_soon`) once the daemon has said how (:meth:`Store.defer`):
queued, a record's JSON built only when written (the newest one per node or job),
and written together, in one transaction, within ``defer``'s delay or before any
other write, so the event log keeps its order. Without ``defer`` they are written at
once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from phalanx.jsonenc import dumps_text
from supervisor.errors import StoreCorrupt, StoreError
from supervisor.store_db import DB_ERRORS, Cursor, Db, PgDb, open_pg, redacted
from supervisor.store_guard import GuardedConnection, is_corrupt, quick_check

log = logging.getLogger(__name__)

_SAVE_NODE = (
    "INSERT INTO nodes (id, record, updated_at) VALUES (?, ?, ?) "
    "ON CONFLICT(id) DO UPDATE SET record = excluded.record, updated_at = excluded.updated_at"
)
_SAVE_JOB = (
    "INSERT INTO jobs (id, state, record, updated_at) VALUES (?, ?, ?, ?) "
    "ON CONFLICT(id) DO UPDATE SET state = excluded.state, record = excluded.record, "
    "updated_at = excluded.updated_at"
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL,          -- JSON: identity from the last birth, drain, health
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    node TEXT,
    detail TEXT NOT NULL           -- JSON object
);
CREATE INDEX IF NOT EXISTS events_node ON events (node, id);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    record TEXT NOT NULL,          -- JSON: spec, generation, rank map, timings, exits
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS ckpt_shards (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier TEXT NOT NULL,
    rank INTEGER NOT NULL,
    node TEXT NOT NULL,            -- the node that landed it
    holder TEXT,                   -- where the copy lies (the buddy, for the peer tier)
    nbytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    at REAL NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,  -- the job generation whose rank saved it
    PRIMARY KEY (job, step, tier, rank)
);
CREATE TABLE IF NOT EXISTS ckpt_commits (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier TEXT NOT NULL,
    committed_at REAL NOT NULL,
    PRIMARY KEY (job, step, tier)
);
CREATE INDEX IF NOT EXISTS ckpt_shards_rank ON ckpt_shards (job, step, rank);
CREATE TABLE IF NOT EXISTS ckpt_ended_catalogs (
    job TEXT NOT NULL,
    node TEXT NOT NULL,            -- a node the job's ended catalog was published for, retained
    released_at REAL,              -- when its agent let go of the job and the catalog was
    PRIMARY KEY (job, node)        -- cleared from the broker (NULL: not yet)
);
"""


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str
    node: str | None
    detail: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ts": self.ts,
            "kind": self.kind,
            "node": self.node,
            "detail": self.detail,
        }


# A shard as the catalog lists it: (node that landed it, holder, nbytes, checksum).
ShardRow = tuple[str, str | None, int, str]


class CatalogQueries:
    """The checkpoint catalog's reads, on ``self._db``: the store's own connection, or a
    snapshot's (``Store.snapshot``)."""

    _db: Db

    def commits(self, job: str) -> list[tuple[int, str, float]]:
        rows = self._db.execute(
            "SELECT step, tier, committed_at FROM ckpt_commits WHERE job = ? ORDER BY step", (job,)
        ).fetchall()
        return [(int(r[0]), str(r[1]), float(r[2])) for r in rows]

    def committed_tiers(self, job: str) -> dict[int, list[str]]:
        """Each step of ``job`` committed somewhere that still has a shard, and its tiers
        (what ``CheckpointCatalog.view`` says is committed, without reading every shard)."""
        rows = self._db.execute(
            "SELECT c.step, c.tier FROM ckpt_commits c WHERE c.job = ? AND EXISTS "
            "(SELECT 1 FROM ckpt_shards s WHERE s.job = c.job AND s.step = c.step) "
            "ORDER BY c.step, c.tier",
            (job,),
        ).fetchall()
        found: dict[int, list[str]] = {}
        for step, tier in rows:
            found.setdefault(int(step), []).append(str(tier))
        return found

    def shard_rows(
        self, job: str, keys: Iterable[tuple[int, str]]
    ) -> dict[tuple[int, str], dict[int, ShardRow]]:
        """Each (step, tier) of ``keys``: rank -> (node, holder, nbytes, checksum) of every
        shard landed there (one indexed read per key)."""
        found: dict[tuple[int, str], dict[int, ShardRow]] = {}
        for step, tier in keys:
            rows = self._db.execute(
                "SELECT rank, node, holder, nbytes, checksum FROM ckpt_shards "
                "WHERE job = ? AND step = ? AND tier = ?",
                (job, step, tier),
            ).fetchall()
            found[(step, tier)] = {int(r[0]): (str(r[1]), r[2], int(r[3]), str(r[4])) for r in rows}
        return found

    def ever_committed(self, job: str) -> bool:
        """Whether a step of ``job`` was ever committed at a tier (its event log says)."""
        row = self._db.execute(
            "SELECT 1 FROM events WHERE kind = 'ckpt_committed' AND "
            "json_extract(detail, '$.job') = ? LIMIT 1",
            (job,),
        ).fetchone()
        return row is not None

    def shard_nodes(self, job: str) -> set[str]:
        """The nodes that landed a shard of ``job`` that is still known."""
        rows = self._db.execute(
            "SELECT DISTINCT node FROM ckpt_shards WHERE job = ?", (job,)
        ).fetchall()
        return {str(r[0]) for r in rows}


class Store(CatalogQueries):
    """SQLite at ``path``, or PostgreSQL at ``url`` (``supervisor.store_db``; ``path`` then
    only names the store in its errors). ``backups``: the folder of the store's rolling
    backups (``supervisor.backup``), named in the message that refuses a damaged store.
    A store found damaged at open is refused (:class:`StoreCorrupt`); one met damaged
    later raises it from the read or write that met it, and ``corrupt`` keeps it
    (``supervisor.store_guard``)."""

    def __init__(
        self,
        path: Path,
        *,
        backups: Path | None = None,
        url: str | None = None,
        pg_options: Mapping[str, Any] | None = None,
        pg_session: Sequence[str] = (),
    ) -> None:
        self.path = path
        self._wing_tables: set[str] = set()
        # The writes queued by the *_soon methods, in order: (key, sql, args), where a key
        # (a node's or a job's record) holds the newest only; args is a thunk for those.
        self._soon: list[tuple[str | None, str, Callable[[], tuple[Any, ...]]]] = []
        self._soon_keys: dict[str, int] = {}
        self._schedule: Callable[[], None] | None = None
        # (job, step, tier) -> a number that changes at every write of its shards or
        # commit (a dropped key has none): what the catalog cached of it is current while
        # the number it was read at still stands. Every write of ckpt_shards and
        # ckpt_commits goes through the methods below, whoever calls them.
        self.shard_versions: dict[tuple[str, int, str], int] = {}
        self._shard_clock = itertools.count(1)
        self.backups = backups
        self.corrupt: StoreCorrupt | None = None
        self.url = url  # PostgreSQL's (None: SQLite at ``path``)
        # Called first in every write transaction (supervisor.leadership: a supervisor
        # that no longer leads writes nothing); None: no fence (SQLite, one supervisor).
        self.fence: Callable[[Db], None] | None = None
        self.where = redacted(url) if url is not None else str(path)  # in messages
        if url is not None:
            try:
                self._db = open_pg(url, path, options=pg_options, session=pg_session)
            except DB_ERRORS as exc:  # a StoreError (the server away) passes as it is
                raise StoreError(
                    path, f"cannot open the supervisor store {self.where}: {exc}"
                ) from exc
            return
        db: GuardedConnection | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(
                path, isolation_level=None, check_same_thread=False, factory=GuardedConnection
            )
            found = quick_check(db)  # before anything is loaded from it or written to it
            if found is not None:
                raise StoreCorrupt(path, found, backups)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(SCHEMA)
            columns = {r[1] for r in db.execute("PRAGMA table_info(ckpt_shards)")}
            if "generation" not in columns:  # a store from before landings had one
                db.execute(
                    "ALTER TABLE ckpt_shards ADD COLUMN generation INTEGER NOT NULL DEFAULT 0"
                )
        except (OSError, sqlite3.Error, StoreError) as exc:
            if db is not None:
                db.close()
            if isinstance(exc, StoreError):
                raise
            if is_corrupt(exc):
                raise StoreCorrupt(path, str(exc), backups) from exc
            raise StoreError(path, f"cannot open the supervisor store {path}: {exc}") from exc
        db.on_corrupt = self._on_corrupt
        self._db = db

    def _on_corrupt(self, exc: sqlite3.DatabaseError) -> NoReturn:
        """A damaged page met at runtime: said once, loudly; the caller gets StoreCorrupt."""
        err = StoreCorrupt(self.path, str(exc), self.backups)
        if self.corrupt is None:
            log.critical(
                "%s. Until then the supervisor runs on what it holds in memory, and "
                "what it cannot read or write is lost",
                err,
            )
        self.corrupt = err
        raise err from exc

    def close(self) -> None:
        with contextlib.suppress(StoreError):
            self.flush()
        self._db.close()

    @property
    def db(self) -> Db:
        """The store's connection, for a wing's rows (``telemetry.rows``, ``auth.rows``):
        each wing creates its own tables and reads and writes them through it, with
        :meth:`write` and :meth:`batch` for the writes."""
        return self._db

    def open_tables(self, name: str, create: Callable[[sqlite3.Connection], None]) -> None:
        """Create (or migrate) a wing's SQLite tables with ``create``, once per open store:
        the wing owns its schema, the store its file and transactions. On PostgreSQL the
        schema of every wing is made at open (``supervisor.store_db``), so this does nothing."""
        if name in self._wing_tables or self.url is not None:
            return
        assert isinstance(self._db, sqlite3.Connection)
        try:
            create(self._db)
        except sqlite3.Error as exc:
            raise StoreError(
                self.path, f"cannot open the {name} tables of the store {self.path}: {exc}"
            ) from exc
        self._wing_tables.add(name)

    def write(self, sql: str, args: tuple[Any, ...]) -> Cursor:
        """One write; a failure is a :class:`StoreError` naming the store's file."""
        return self._write(sql, args)

    def _snapshot_db(self) -> Db:
        if self.url is not None:
            return PgDb(self.url, self.path, read_only_snapshot=True)
        db = sqlite3.connect(
            f"{self.path.resolve().as_uri()}?mode=ro",
            uri=True,
            isolation_level=None,
            check_same_thread=False,
        )
        db.execute("BEGIN")
        return db

    # --- writes soon ----------------------------------------------------------------

    def defer(self, schedule: Callable[[], None] | None) -> None:
        """Write the ``*_soon`` writes later: ``schedule()`` is called when the first
        one is queued and must see that :meth:`flush` runs soon (the daemon's event loop
        calls it after a short delay). None: write them at once."""
        self._schedule = schedule

    def _queue(self, key: str | None, sql: str, args: Callable[[], tuple[Any, ...]]) -> None:
        if self._schedule is None:
            self._write(sql, args())
            return
        if key is not None and key in self._soon_keys:
            self._soon[self._soon_keys[key]] = (key, sql, args)
            return
        if key is not None:
            self._soon_keys[key] = len(self._soon)
        self._soon.append((key, sql, args))
        if len(self._soon) == 1:
            self._schedule()

    @property
    def pending(self) -> int:
        """Writes queued by the ``*_soon`` methods, not yet written."""
        return len(self._soon)

    def flush(self) -> None:
        """Write what the ``*_soon`` methods queued, in one transaction. On an error
        they stay queued (and the error is raised)."""
        if not self._soon:
            return
        queued = self._soon
        try:
            if self._db.in_transaction:  # within a batch: its transaction holds them
                for _key, sql, args in queued:
                    self._db.execute(sql, args())
            else:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._fenced()
                    for _key, sql, args in queued:
                        self._db.execute(sql, args())
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
        except DB_ERRORS as exc:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {exc}"
            ) from exc
        self._soon, self._soon_keys = [], {}

    def add_event_soon(self, kind: str, node: str | None, detail: dict[str, Any]) -> None:
        """:meth:`add_event`, written soon (see :meth:`defer`)."""
        row = (time.time(), kind, node, dumps_text(detail))
        self._queue(
            None, "INSERT INTO events (ts, kind, node, detail) VALUES (?, ?, ?, ?)", lambda: row
        )

    def save_node_soon(self, node_id: str, record: Callable[[], dict[str, Any]]) -> None:
        """:meth:`save_node` of the newest ``record()``, written soon."""
        self._queue(
            f"node:{node_id}",
            _SAVE_NODE,
            lambda: (node_id, dumps_text(record()), time.time()),
        )

    def save_job_soon(
        self, job_id: str, state: Callable[[], str], record: Callable[[], dict[str, Any]]
    ) -> None:
        """:meth:`save_job` of the newest ``state()`` and ``record()``, written soon."""
        self._queue(
            f"job:{job_id}",
            _SAVE_JOB,
            lambda: (job_id, state(), dumps_text(record()), time.time()),
        )

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[CatalogQueries]:
        """The catalog's reads on a connection of their own, for another thread: one read
        transaction, so they see one committed state (WAL, or PostgreSQL's repeatable
        read: never a batch in progress on the store's connection, never one that is
        rolled back), while the event loop keeps writing."""
        try:
            db = self._snapshot_db()
            db.execute("SELECT 1 FROM ckpt_commits LIMIT 1").fetchall()  # the snapshot starts
        except DB_ERRORS as exc:
            if is_corrupt(exc):
                self._on_corrupt(exc)
            raise StoreError(
                self.path, f"cannot read the supervisor store {self.where}: {exc}"
            ) from exc
        view = CatalogQueries()
        view._db = db
        try:
            yield view
        except DB_ERRORS as exc:
            if is_corrupt(exc):
                self._on_corrupt(exc)
            raise StoreError(
                self.path, f"cannot read the supervisor store {self.where}: {exc}"
            ) from exc
        finally:
            db.close()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Run the writes of the block as one transaction: one fsync for all of them (the
        checkpoint catalog takes thousands of landings per step). Nested blocks join the
        outer one; an error rolls the whole block back."""
        if self._db.in_transaction:
            yield
            return
        self.flush()  # what was queued before goes first, on its own
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except DB_ERRORS as exc:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {exc}"
            ) from exc
        try:
            self._fenced()
            yield
        except BaseException:
            with contextlib.suppress(*DB_ERRORS, StoreError):  # the error says what failed
                self._db.execute("ROLLBACK")
            raise
        try:
            self._db.execute("COMMIT")
        except DB_ERRORS as exc:
            with contextlib.suppress(*DB_ERRORS, StoreError):
                self._db.execute("ROLLBACK")
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {exc}"
            ) from exc

    def load_nodes(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT id, record FROM nodes").fetchall()
        return {node_id: json.loads(record) for node_id, record in rows}

    def save_node(self, node_id: str, record: dict[str, Any]) -> None:
        self._write(_SAVE_NODE, (node_id, dumps_text(record), time.time()))

    def load_jobs(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT id, record FROM jobs").fetchall()
        return {job_id: json.loads(record) for job_id, record in rows}

    def save_job(self, job_id: str, state: str, record: dict[str, Any]) -> None:
        self._write(_SAVE_JOB, (job_id, state, dumps_text(record), time.time()))

    def add_event(self, kind: str, node: str | None, detail: dict[str, Any]) -> Event:
        ts = time.time()
        cur = self._write(
            "INSERT INTO events (ts, kind, node, detail) VALUES (?, ?, ?, ?) RETURNING id",
            (ts, kind, node, dumps_text(detail)),
        )
        return Event(int(cur.fetchone()[0]), ts, kind, node, detail)

    def events(
        self, *, node: str | None = None, job: str | None = None, limit: int = 100, after: int = 0
    ) -> list[Event]:
        query = "SELECT id, ts, kind, node, detail FROM events WHERE id > ?"
        args: list[Any] = [after]
        if node is not None:
            query += " AND node = ?"
            args.append(node)
        if job is not None:
            query += " AND json_extract(detail, '$.job') = ?"
            args.append(job)
        query += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        rows = self._db.execute(query, args).fetchall()
        return [Event(r[0], r[1], r[2], r[3], json.loads(r[4])) for r in reversed(rows)]

    def first_events(self, kind: str) -> dict[str, float]:
        """Per node, the time of its first event of ``kind``."""
        rows = self._db.execute(
            "SELECT node, MIN(ts) FROM events WHERE kind = ? AND node IS NOT NULL GROUP BY node",
            (kind,),
        ).fetchall()
        return {str(r[0]): float(r[1]) for r in rows}

    def count_node_failures(self) -> int:
        """Nodes lost (offline but by a clean shutdown) or drained automatically."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM events WHERE (kind = 'state_changed' AND "
            "json_extract(detail, '$.state') = 'offline' AND "
            "json_extract(detail, '$.cause') != 'clean shutdown') OR "
            "(kind = 'node_drained' AND json_extract(detail, '$.by') = 'auto')"
        ).fetchone()
        return int(row[0])

    # --- the checkpoint catalog -----------------------------------------------------

    def add_shard(
        self,
        job: str,
        step: int,
        tier: str,
        rank: int,
        node: str,
        holder: str | None,
        nbytes: int,
        checksum: str,
        at: float,
        generation: int = 0,
    ) -> None:
        self._shards_changed(job, step, tier)
        self._write(
            "INSERT INTO ckpt_shards (job, step, tier, rank, node, holder, nbytes, "
            "checksum, at, generation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (job, step, tier, rank) DO UPDATE SET node = excluded.node, "
            "holder = excluded.holder, nbytes = excluded.nbytes, checksum = excluded.checksum, "
            "at = excluded.at, generation = excluded.generation",
            (job, step, tier, rank, node, holder, nbytes, checksum, at, generation),
        )

    def drop_step(self, job: str, step: int, tier: str) -> bool:
        """Forget a step at a tier (retention removed it); True if anything was known."""
        self.shard_versions.pop((job, step, tier), None)
        cur = self._write(
            "DELETE FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ?", (job, step, tier)
        )
        self._write(
            "DELETE FROM ckpt_commits WHERE job = ? AND step = ? AND tier = ?", (job, step, tier)
        )
        return cur.rowcount > 0

    def drop_shard(self, job: str, step: int, tier: str, rank: int) -> bool:
        """Forget one rank's copy of a step at a tier, and with it the step's commit there
        (a step is committed at a tier only while every rank's shard is); True if known."""
        self._shards_changed(job, step, tier)
        cur = self._write(
            "DELETE FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ? AND rank = ?",
            (job, step, tier, rank),
        )
        self._write(
            "DELETE FROM ckpt_commits WHERE job = ? AND step = ? AND tier = ?", (job, step, tier)
        )
        return cur.rowcount > 0

    def shard_ranks(self, job: str, step: int, tier: str) -> dict[int, int]:
        """The ranks with a shard of ``step`` at ``tier``, and the generation of each."""
        rows = self._db.execute(
            "SELECT rank, generation FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ?",
            (job, step, tier),
        ).fetchall()
        return {int(r[0]): int(r[1]) for r in rows}

    def saved_in(self, job: str, step: int, rank: int, checksum: str) -> set[int]:
        """The generations whose saves of rank ``rank``'s shard of ``step`` have
        ``checksum``, at any tier."""
        rows = self._db.execute(
            "SELECT DISTINCT generation FROM ckpt_shards WHERE job = ? AND "
            "step = ? AND rank = ? AND checksum = ?",
            (job, step, rank, checksum),
        ).fetchall()
        return {int(r[0]) for r in rows}

    def add_commit(self, job: str, step: int, tier: str, at: float) -> bool:
        self._shards_changed(job, step, tier)
        cur = self._write(
            "INSERT INTO ckpt_commits (job, step, tier, committed_at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (job, step, tier, at),
        )
        return cur.rowcount > 0

    def ended_catalogs_sent(self, job: str, nodes: list[str]) -> None:
        """The job's ended catalog goes out, retained, to ``nodes``."""
        with self.batch():
            for node in nodes:
                self._write(
                    "INSERT INTO ckpt_ended_catalogs (job, node) VALUES (?, ?) "
                    "ON CONFLICT DO NOTHING",
                    (job, node),
                )

    def ended_catalogs_sent_to(self, job: str) -> set[str]:
        """The nodes ``job``'s ended catalog was published for."""
        rows = self._db.execute(
            "SELECT node FROM ckpt_ended_catalogs WHERE job = ?", (job,)
        ).fetchall()
        return {str(r[0]) for r in rows}

    def ended_catalogs_cleared(self, job: str, nodes: list[str], at: float) -> None:
        """The job's ended catalogs of ``nodes`` were cleared from the broker."""
        with self.batch():
            for node in nodes:
                self._write(
                    "UPDATE ckpt_ended_catalogs SET released_at = ? WHERE job = ? AND "
                    "node = ? AND released_at IS NULL",
                    (at, job, node),
                )

    def ended_catalogs_let_go(self, job: str) -> set[str]:
        """The nodes that let go of the job, their ended catalogs cleared."""
        rows = self._db.execute(
            "SELECT node FROM ckpt_ended_catalogs WHERE job = ? AND released_at IS NOT NULL", (job,)
        ).fetchall()
        return {str(r[0]) for r in rows}

    def ended_catalogs_released(self, job: str) -> bool:
        """Whether the job's ended catalog went out and every node it went to let go."""
        row = self._db.execute(
            "SELECT COUNT(*), COUNT(released_at) FROM ckpt_ended_catalogs WHERE job = ?", (job,)
        ).fetchone()
        return bool(row[0]) and row[0] == row[1]

    def shards(self, job: str) -> list[tuple[int, str, int, str, str | None, int, str]]:
        """(step, tier, rank, node, holder, nbytes, checksum) of every landed shard."""
        rows = self._db.execute(
            "SELECT step, tier, rank, node, holder, nbytes, checksum FROM "
            "ckpt_shards WHERE job = ? ORDER BY step, tier, rank",
            (job,),
        ).fetchall()
        return [
            (int(r[0]), str(r[1]), int(r[2]), str(r[3]), r[4], int(r[5]), str(r[6])) for r in rows
        ]

    def shard_version(self, job: str, step: int, tier: str) -> int:
        """The version of (job, step, tier)'s shards and commit now (see ``shard_versions``);
        one that has none (nothing was written of it since the store opened) gets one."""
        key = (job, step, tier)
        version = self.shard_versions.get(key)
        if version is None:
            version = self.shard_versions[key] = next(self._shard_clock)
        return version

    def forget_versions(self, job: str) -> None:
        """Drop the versions of ``job``'s keys (its catalog is no longer cached): a later
        read gets new ones."""
        for key in [k for k in self.shard_versions if k[0] == job]:
            del self.shard_versions[key]

    def _shards_changed(self, job: str, step: int, tier: str) -> None:
        """Before a write of (job, step, tier)'s shards or commit: what was read of it is
        stale (a write rolled back only makes a cache read it again)."""
        self.shard_versions[(job, step, tier)] = next(self._shard_clock)

    def _fenced(self) -> None:
        """In a write transaction: refuse it unless this supervisor still leads."""
        if self.fence is not None:
            self.fence(self._db)

    def _write(self, sql: str, args: tuple[Any, ...]) -> Cursor:
        self.flush()  # the writes queued soon go first: the event log keeps its order
        if self.fence is not None and not self._db.in_transaction:
            with self.batch():  # the fence and the write in one transaction
                return self._write(sql, args)
        try:
            cur: Cursor = self._db.execute(sql, args)
            return cur
        except DB_ERRORS as exc:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {exc}"
            ) from exc
