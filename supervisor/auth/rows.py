"""The API tokens in the supervisor's store: their table, reads and writes.

One table, ``api_tokens``: a row per token an admin created, kept after it is revoked
or expires (``phalanx token ls`` shows why a token stopped working). It holds the
SHA-256 of each token's secret, never the secret (:mod:`supervisor.auth.tokens` says why a
plain hash is enough here).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from supervisor.store import Store
from supervisor.store_db import Cursor

TOKEN_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_tokens (
    id TEXT PRIMARY KEY,           -- t1, t2, ...: the middle part of the secret
    seq INTEGER NOT NULL UNIQUE,   -- the number in the id
    name TEXT NOT NULL,
    role TEXT NOT NULL,            -- viewer, member, operator, admin
    team TEXT,                     -- a member's team (NULL: none)
    secret_sha256 TEXT NOT NULL,   -- hex SHA-256 of the whole secret
    created_at REAL NOT NULL,
    created_by TEXT NOT NULL,      -- the id of the admin token that created it
    expires_at REAL,               -- NULL: never
    revoked_at REAL,               -- NULL: not revoked
    revoked_by TEXT
);
"""

TOKEN_COLUMNS = (
    "id, name, role, team, secret_sha256, created_at, created_by, expires_at, revoked_at, "
    "revoked_by"
)


def _create(db: sqlite3.Connection) -> None:
    db.executescript(TOKEN_SCHEMA)


class TokenRows:
    """The API tokens' reads and writes, on the store's connection; the table is created
    when the rows are made."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._db = store.db
        store.open_tables("API token", _create)

    def _write(self, sql: str, args: tuple[Any, ...]) -> Cursor:
        return self._store.write(sql, args)

    def next_token_seq(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM api_tokens").fetchone()
        return int(row[0]) + 1

    def add_token(
        self,
        seq: int,
        token_id: str,
        name: str,
        role: str,
        team: str | None,
        secret_sha256: str,
        created_at: float,
        created_by: str,
        expires_at: float | None,
    ) -> None:
        self._write(
            "INSERT INTO api_tokens (id, seq, name, role, team, secret_sha256, created_at, "
            "created_by, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (token_id, seq, name, role, team, secret_sha256, created_at, created_by, expires_at),
        )

    def token_row(self, token_id: str) -> tuple[Any, ...] | None:
        """The row of ``token_id`` (columns :data:`TOKEN_COLUMNS`), None if unknown."""
        row = self._db.execute(
            f"SELECT {TOKEN_COLUMNS} FROM api_tokens WHERE id = ?", (token_id,)
        ).fetchone()
        return tuple(row) if row is not None else None

    def token_rows(self) -> list[tuple[Any, ...]]:
        """Every token's row, oldest first."""
        return [
            tuple(r)
            for r in self._db.execute(f"SELECT {TOKEN_COLUMNS} FROM api_tokens ORDER BY seq")
        ]

    def revoke_token(self, token_id: str, at: float, by: str) -> bool:
        """Mark ``token_id`` revoked; False when it was already (or is unknown)."""
        cur = self._write(
            "UPDATE api_tokens SET revoked_at = ?, revoked_by = ? WHERE id = ? AND "
            "revoked_at IS NULL",
            (at, by, token_id),
        )
        return cur.rowcount > 0
