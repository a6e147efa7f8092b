"""The store's two databases behind one set of queries: SQLite (the embedded default)
or PostgreSQL (``store.url = "postgresql://..."``, through psycopg 3).

The queries are written once, in SQLite's spelling, in the portable subset of SQL both
speak (``INSERT ... ON CONFLICT``, ``RETURNING``); :class:`PgDb` translates the three
things that differ on their way to PostgreSQL: the ``?`` placeholders (``%s``),
``BEGIN IMMEDIATE`` (``BEGIN``) and ``json_extract(col, '$.key')`` (``col::jsonb ->>
'key'``). Each has its own schema (:data:`PG_SCHEMA` here): PostgreSQL's ``real`` is
4 bytes and its ``integer`` 4 bytes, so the columns are ``double precision`` and
``bigint``, and every text column sorts bytewise (``COLLATE "C"``), as SQLite's do.

psycopg 3 over asyncpg: the store is called synchronously from the event loop, as the
SQLite store is; psycopg has a synchronous API, asyncpg has none.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import pq

from supervisor.errors import StoreError


class Cursor(Protocol):
    """What the store reads of a statement's result (``sqlite3.Cursor``, psycopg's)."""

    @property
    def rowcount(self) -> int: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Db(Protocol):
    """The store's connection: a :class:`~supervisor.store_guard.GuardedConnection`
    (SQLite) or a :class:`PgDb`.

    ``gate`` is held by a worker thread while it commits a transaction for the event loop
    (:meth:`supervisor.store.Store.batch_async`): ``execute`` waits for it, so nothing
    runs on the connection meanwhile; ``execute_held`` is that thread's, which holds it.
    Should that COMMIT fail, the thread leaves the store's rollback hooks in
    ``rolled_back``: the next ``execute`` runs them first (a read too), so that nothing
    reads what is kept in memory of the rolled-back transaction."""

    gate: threading.Lock
    rolled_back: Callable[[], None] | None

    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...
    def executemany(self, sql: str, rows: Sequence[Any], /) -> Any: ...
    def execute_held(self, sql: str, /) -> Any: ...
    @property
    def in_transaction(self) -> bool: ...
    def close(self) -> None: ...


# The errors of either database, as the store catches them.
DB_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, psycopg.Error)

CONNECT_TIMEOUT_S = 10  # one connection attempt (libpq's connect_timeout)

_JSON = re.compile(r"json_extract\((\w+(?:\.\w+)?), '\$\.(\w+)'\)")


@functools.lru_cache(maxsize=256)
def to_pg(sql: str) -> str:
    """``sql`` as SQLite spells it, as PostgreSQL does (the module doc says what)."""
    sql = sql.replace("BEGIN IMMEDIATE", "BEGIN")
    sql = _JSON.sub(r"(\1::jsonb ->> '\2')", sql)
    return sql.replace("?", "%s")


def redacted(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class PgDb:
    """A PostgreSQL connection that takes the store's SQLite-spelled queries. It runs in
    autocommit, as the SQLite connection does (``isolation_level=None``): a statement
    outside a ``BEGIN`` block commits on its own."""

    def __init__(
        self,
        url: str,
        path: Path,
        *,
        options: Mapping[str, Any] | None = None,
        session: Sequence[str] = (),
    ) -> None:
        """``options``: libpq's connection options (keepalives); ``session``: statements
        every new session runs first (``SET ...``), also after a reconnect."""
        self.url = url
        self.path = path  # the store's, for its errors
        self._options = dict(options or {})
        self._session = tuple(session)
        self._conn = self._open()
        self.gate = threading.Lock()  # see Db
        self.rolled_back: Callable[[], None] | None = None  # see Db

    def _open(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, **self._options
        )
        for statement in self._session:
            conn.execute(statement)  # trusted SET statements, not user input
        return conn

    def execute(self, sql: str, parameters: Any = (), /) -> psycopg.Cursor[Any]:
        """Run ``sql``; a ``StoreError`` when the server cannot be reached (a read as well
        as a write), a ``ValueError`` for a value a column cannot take."""
        with self.gate:
            if self.rolled_back is not None:
                hooks, self.rolled_back = self.rolled_back, None
                hooks()
            return self._execute(sql, parameters)

    def executemany(self, sql: str, rows: Sequence[Any], /) -> psycopg.Cursor[Any]:
        """``sql`` once for each of ``rows`` (psycopg pipelines them); its errors as
        :meth:`execute`'s. Meant for a transaction: on a broken connection the error goes
        to the caller, who rolls back (the next transaction gets a new connection)."""
        with self.gate:
            if self.rolled_back is not None:
                hooks, self.rolled_back = self.rolled_back, None
                hooks()
            with self._errors():
                if self._conn.broken:
                    self._reconnect()
                cur = self._conn.cursor()
                cur.executemany(to_pg(sql), [tuple(row) for row in rows])
                return cur

    def execute_held(self, sql: str, /) -> psycopg.Cursor[Any]:
        """:meth:`execute`, by the thread that holds ``gate`` (see :class:`Db`)."""
        return self._execute(sql, ())

    def _execute(self, sql: str, parameters: Any) -> psycopg.Cursor[Any]:
        query, args = to_pg(sql), tuple(parameters) or None
        with self._errors():
            if self._conn.broken:
                self._reconnect()
            alone = not self.in_transaction
            try:
                return self._conn.execute(query, args)
            except psycopg.OperationalError:
                if not (alone and self._conn.broken):
                    raise
                # The connection was found dead (the server restarted, the link broke)
                # by a statement of its own: once more on a new connection (should the
                # link have broken after the server ran it, it runs twice: the store's
                # writes are upserts, but for an event or a metric point). Inside a
                # transaction the error goes to the caller, who rolls back; the next
                # transaction gets a new connection.
                self._reconnect()
                return self._conn.execute(query, args)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """The server out of reach is a ``StoreError``; a value a column cannot take (out
        of range, say) a ``ValueError``: the statement's fault, not the database's, as
        SQLite's OverflowError for the same value is."""
        try:
            yield
        except psycopg.OperationalError as exc:
            raise StoreError(
                self.path, f"cannot reach the supervisor store {redacted(self.url)}: {exc}"
            ) from exc
        except psycopg.errors.DataError as exc:
            raise ValueError(f"a value the store cannot take: {exc}") from exc

    def _reconnect(self) -> None:
        self._conn.close()
        self._conn = self._open()

    @property
    def in_transaction(self) -> bool:
        status = self._conn.info.transaction_status
        return status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)

    def close(self) -> None:
        self._conn.close()


PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT COLLATE "C" PRIMARY KEY,
    record TEXT NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    ts DOUBLE PRECISION NOT NULL,
    kind TEXT COLLATE "C" NOT NULL,
    node TEXT COLLATE "C",
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_node ON events (node, id);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT COLLATE "C" PRIMARY KEY,
    state TEXT COLLATE "C" NOT NULL,
    record TEXT NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS ckpt_shards (
    job TEXT COLLATE "C" NOT NULL,
    step BIGINT NOT NULL,
    tier TEXT COLLATE "C" NOT NULL,
    rank BIGINT NOT NULL,
    node TEXT COLLATE "C" NOT NULL,
    holder TEXT COLLATE "C",
    nbytes BIGINT NOT NULL,
    checksum TEXT COLLATE "C" NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    generation BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (job, step, tier, rank)
);
CREATE TABLE IF NOT EXISTS ckpt_commits (
    job TEXT COLLATE "C" NOT NULL,
    step BIGINT NOT NULL,
    tier TEXT COLLATE "C" NOT NULL,
    committed_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (job, step, tier)
);
DROP INDEX IF EXISTS ckpt_shards_rank;
DROP INDEX IF EXISTS ckpt_shards_node;
CREATE TABLE IF NOT EXISTS ckpt_purges (
    job TEXT COLLATE "C" NOT NULL,
    step BIGINT NOT NULL,
    tier TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (job, step, tier)
);
CREATE TABLE IF NOT EXISTS ckpt_ended_catalogs (
    job TEXT COLLATE "C" NOT NULL,
    node TEXT COLLATE "C" NOT NULL,
    released_at DOUBLE PRECISION,
    PRIMARY KEY (job, node)
);
CREATE TABLE IF NOT EXISTS metric_points (
    id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    job TEXT COLLATE "C" NOT NULL,
    name TEXT COLLATE "C" NOT NULL,
    level BIGINT NOT NULL,
    step BIGINT NOT NULL,
    ts DOUBLE PRECISION NOT NULL,
    value DOUBLE PRECISION,
    low DOUBLE PRECISION,
    high DOUBLE PRECISION,
    n BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS metric_points_series ON metric_points (job, name, level, ts);
CREATE INDEX IF NOT EXISTS metric_points_inserted ON metric_points (job, id);
CREATE TABLE IF NOT EXISTS leader (
    id BIGINT PRIMARY KEY CHECK (id = 1),
    term BIGINT NOT NULL,
    holder TEXT NOT NULL,
    api_url TEXT NOT NULL,
    since DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS api_tokens (
    id TEXT COLLATE "C" PRIMARY KEY,
    seq BIGINT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    role TEXT COLLATE "C" NOT NULL,
    team TEXT COLLATE "C",
    secret_sha256 TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    created_by TEXT NOT NULL,
    expires_at DOUBLE PRECISION,
    revoked_at DOUBLE PRECISION,
    revoked_by TEXT
);
"""


def open_pg(
    url: str,
    path: Path,
    *,
    options: Mapping[str, Any] | None = None,
    session: Sequence[str] = (),
) -> PgDb:
    """Connect to ``url`` and create the schema if it is not there (one transaction;
    concurrent starts wait on one another's lock). ``options``, ``session``: PgDb's."""
    db = PgDb(url, path, options=options, session=session)
    try:
        db.execute("BEGIN")
        db.execute("SELECT pg_advisory_xact_lock(7130101)")  # one schema creation at a time
        for statement in PG_SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute("COMMIT")
    except BaseException:
        db.close()
        raise
    return db
