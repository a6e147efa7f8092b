"""The supervisor's persistent store: SQLite under the state directory.

Only what must survive a restart is written: a node's identity, its drain and
last known health and state, and the event log. Heartbeats that change
nothing never touch the disk. Writes are small and synchronous (WAL mode), so
that a change acknowledged to an operator is on disk.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    PRIMARY KEY (job, step, tier, rank)
);
CREATE TABLE IF NOT EXISTS ckpt_commits (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier TEXT NOT NULL,
    committed_at REAL NOT NULL,
    PRIMARY KEY (job, step, tier)
);
"""


class StoreError(RuntimeError):
    """The state database cannot be opened or written; names the path."""


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str
    node: str | None
    detail: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "ts": self.ts, "kind": self.kind, "node": self.node,
                "detail": self.detail}


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the supervisor store {path}: {exc}") from exc

    def close(self) -> None:
        self._db.close()

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
        cur = self._write("INSERT INTO events (ts, kind, node, detail) VALUES (?, ?, ?, ?)",
                          (ts, kind, node, json.dumps(detail)))
        return Event(int(cur.lastrowid or 0), ts, kind, node, detail)

    def events(self, *, node: str | None = None, job: str | None = None, limit: int = 100,
               after: int = 0) -> list[Event]:
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

    # --- the checkpoint catalog -----------------------------------------------------

    def add_shard(self, job: str, step: int, tier: str, rank: int, node: str,
                  holder: str | None, nbytes: int, checksum: str, at: float) -> None:
        self._write(
            "INSERT OR REPLACE INTO ckpt_shards (job, step, tier, rank, node, holder, nbytes, "
            "checksum, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job, step, tier, rank, node, holder, nbytes, checksum, at),
        )

    def drop_step(self, job: str, step: int, tier: str) -> bool:
        """Forget a step at a tier (retention removed it); True if anything was known."""
        cur = self._write("DELETE FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ?",
                          (job, step, tier))
        self._write("DELETE FROM ckpt_commits WHERE job = ? AND step = ? AND tier = ?",
                    (job, step, tier))
        return cur.rowcount > 0

    def shard_ranks(self, job: str, step: int, tier: str) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM ckpt_shards WHERE job = ? AND step = ? "
                               "AND tier = ?", (job, step, tier)).fetchone()
        return int(row[0])

    def add_commit(self, job: str, step: int, tier: str, at: float) -> bool:
        cur = self._write("INSERT OR IGNORE INTO ckpt_commits (job, step, tier, committed_at) "
                          "VALUES (?, ?, ?, ?)", (job, step, tier, at))
        return cur.rowcount > 0

    def commits(self, job: str) -> list[tuple[int, str, float]]:
        rows = self._db.execute("SELECT step, tier, committed_at FROM ckpt_commits WHERE job = ? "
                                "ORDER BY step", (job,)).fetchall()
        return [(int(r[0]), str(r[1]), float(r[2])) for r in rows]

    def shards(self, job: str) -> list[tuple[int, str, int, str, str | None, int, str]]:
        """(step, tier, rank, node, holder, nbytes, checksum) of every landed shard."""
        rows = self._db.execute("SELECT step, tier, rank, node, holder, nbytes, checksum FROM "
                                "ckpt_shards WHERE job = ? ORDER BY step, tier, rank",
                                (job,)).fetchall()
        return [(int(r[0]), str(r[1]), int(r[2]), str(r[3]), r[4], int(r[5]), str(r[6]))
                for r in rows]

    def _write(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, args)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write the supervisor store {self.path}: {exc}") from exc
