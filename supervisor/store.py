"""The supervisor's persistent store: SQLite under the state directory.

Only what must survive a restart is written: a node's identity, its drain and
last known health and state, the event log, the checkpoint catalog, the jobs'
downsampled metric series (``supervisor.series_rows``) and the API tokens, hashed
(``supervisor.token_rows``). Heartbeats that change
nothing never touch the disk. Writes are small and synchronous (WAL mode), so
that a change acknowledged to an operator is on disk.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.errors import StoreError
from supervisor.series_rows import SeriesRows, open_series
from supervisor.token_rows import TOKEN_SCHEMA, TokenRows

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


class CatalogQueries:
    """The checkpoint catalog's reads, on ``self._db``: the store's own connection, or a
    snapshot's (``Store.snapshot``)."""

    _db: sqlite3.Connection

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

    def committed_shards(self, job: str) -> list[tuple[int, str, int, str, str | None, int, str]]:
        """Like ``shards``, for the (step, tier) pairs committed only."""
        rows = self._db.execute(
            "SELECT s.step, s.tier, s.rank, s.node, s.holder, s.nbytes, s.checksum "
            "FROM ckpt_shards s JOIN ckpt_commits c "
            "ON s.job = c.job AND s.step = c.step AND s.tier = c.tier "
            "WHERE s.job = ? ORDER BY s.step, s.tier, s.rank",
            (job,),
        ).fetchall()
        return [
            (int(r[0]), str(r[1]), int(r[2]), str(r[3]), r[4], int(r[5]), str(r[6])) for r in rows
        ]

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


class Store(CatalogQueries, SeriesRows, TokenRows):
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            open_series(self._db)
            self._db.executescript(TOKEN_SCHEMA)
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(ckpt_shards)")}
            if "generation" not in columns:  # a store from before landings had one
                self._db.execute(
                    "ALTER TABLE ckpt_shards ADD COLUMN generation INTEGER NOT NULL DEFAULT 0"
                )
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(path, f"cannot open the supervisor store {path}: {exc}") from exc

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[CatalogQueries]:
        """The catalog's reads on a connection of their own, for another thread: one read
        transaction, so they see one committed state (WAL: never a batch in progress on
        the store's connection, never one that is rolled back), while the event loop
        keeps writing."""
        try:
            db = sqlite3.connect(
                f"{self.path.resolve().as_uri()}?mode=ro",
                uri=True,
                isolation_level=None,
                check_same_thread=False,
            )
            db.execute("BEGIN")
            db.execute("SELECT 1 FROM ckpt_commits LIMIT 1").fetchall()  # the snapshot starts
        except sqlite3.Error as exc:
            raise StoreError(
                self.path, f"cannot read the supervisor store {self.path}: {exc}"
            ) from exc
        view = CatalogQueries()
        view._db = db
        try:
            yield view
        except sqlite3.Error as exc:
            raise StoreError(
                self.path, f"cannot read the supervisor store {self.path}: {exc}"
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
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.path}: {exc}"
            ) from exc
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._db.execute("ROLLBACK")
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.path}: {exc}"
            ) from exc

    def load_nodes(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT id, record FROM nodes").fetchall()
        return {node_id: json.loads(record) for node_id, record in rows}

    def save_node(self, node_id: str, record: dict[str, Any]) -> None:
        self._write(
            "INSERT INTO nodes (id, record, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET record = excluded.record, "
            "updated_at = excluded.updated_at",
            (node_id, json.dumps(record), time.time()),
        )

    def load_jobs(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT id, record FROM jobs").fetchall()
        return {job_id: json.loads(record) for job_id, record in rows}

    def save_job(self, job_id: str, state: str, record: dict[str, Any]) -> None:
        self._write(
            "INSERT INTO jobs (id, state, record, updated_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET state = excluded.state, record = excluded.record, "
            "updated_at = excluded.updated_at",
            (job_id, state, json.dumps(record), time.time()),
        )

    def add_event(self, kind: str, node: str | None, detail: dict[str, Any]) -> Event:
        ts = time.time()
        cur = self._write(
            "INSERT INTO events (ts, kind, node, detail) VALUES (?, ?, ?, ?)",
            (ts, kind, node, json.dumps(detail)),
        )
        return Event(int(cur.lastrowid or 0), ts, kind, node, detail)

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
        self._write(
            "INSERT OR REPLACE INTO ckpt_shards (job, step, tier, rank, node, holder, nbytes, "
            "checksum, at, generation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job, step, tier, rank, node, holder, nbytes, checksum, at, generation),
        )

    def drop_step(self, job: str, step: int, tier: str) -> bool:
        """Forget a step at a tier (retention removed it); True if anything was known."""
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
        cur = self._write(
            "INSERT OR IGNORE INTO ckpt_commits (job, step, tier, committed_at) "
            "VALUES (?, ?, ?, ?)",
            (job, step, tier, at),
        )
        return cur.rowcount > 0

    def ended_catalogs_sent(self, job: str, nodes: list[str]) -> None:
        """The job's ended catalog goes out, retained, to ``nodes``."""
        with self.batch():
            for node in nodes:
                self._write(
                    "INSERT OR IGNORE INTO ckpt_ended_catalogs (job, node) VALUES (?, ?)",
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

    def _write(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, args)
        except sqlite3.Error as exc:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.path}: {exc}"
            ) from exc
