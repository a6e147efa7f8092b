"""The jobs' metric series in the supervisor's store: their table, reads and writes.

One table, ``metric_points``: a row per point of a series (job, name) at a level of
:mod:`supervisor.telemetry.series`, so a series holds at most ``KEEP_PER_LEVEL x (MAX_LEVEL + 1)``
rows whatever the run's length, and a job's rows grow with its named series (a handful),
never with ranks or time. Per-rank latest values are not stored: the supervisor keeps
them in memory (``supervisor.telemetry.training``), bounded by the world size, and rebuilds them
within one window after a restart.

SQLite stores a NaN as NULL: a NULL value reads back as NaN.

**The insertion cursor.** Each row has an ``id`` (``AUTOINCREMENT``: never reused, not
even after a restart or a ``VACUUM``); a new full-resolution point gets the next one.
A merged point (thinning) keeps the larger ``id`` of the two it replaces, so "rows with
an ``id`` above C" means exactly "points that stand for a window inserted after C": a
client that polls with ``after`` = the cursor it was given (:meth:`SeriesRows.cursor`)
gets every window that came since, a late one with an older time included (a poll by
time, ``since``, misses those), and no merged point for windows it already has. A
merged point it does get may share its (time, step) with a point it holds: the newer
one stands for both.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from supervisor.store import Store
from supervisor.store_db import Cursor
from supervisor.telemetry.series import MAX_LEVEL, Point, pairwise, to_merge

SERIES_SCHEMA = """
CREATE TABLE IF NOT EXISTS metric_points (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the insertion cursor (see the module doc)
    job TEXT NOT NULL,
    name TEXT NOT NULL,
    level INTEGER NOT NULL,        -- a point of level k stands for 2**k windows
    step INTEGER NOT NULL,
    ts REAL NOT NULL,
    value REAL,                    -- NULL: NaN
    low REAL,
    high REAL,
    n INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS metric_points_series ON metric_points (job, name, level, ts);
CREATE INDEX IF NOT EXISTS metric_points_inserted ON metric_points (job, id);
"""
_COLUMNS = "job, name, level, step, ts, value, low, high, n"
_MARKS = ", ".join("?" * 9)


def open_series(db: sqlite3.Connection) -> None:
    """Create the table, or give a store's table from before the cursor its ``id``
    column: its rows are copied in their insertion order (their rowid), in one
    transaction."""
    columns = {r[1] for r in db.execute("PRAGMA table_info(metric_points)")}
    if columns and "id" not in columns:
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("ALTER TABLE metric_points RENAME TO metric_points_before_cursor")
            db.execute("DROP INDEX IF EXISTS metric_points_series")
            for statement in SERIES_SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(
                f"INSERT INTO metric_points ({_COLUMNS}) SELECT {_COLUMNS} "
                "FROM metric_points_before_cursor ORDER BY rowid"
            )
            db.execute("DROP TABLE metric_points_before_cursor")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    db.executescript(SERIES_SCHEMA)


def _float(value: float | None) -> float:
    return math.nan if value is None else float(value)


class SeriesRows:
    """The metric series' reads and writes, on the store's connection; the table is
    created (or migrated) when the rows are made."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._db = store.db
        store.open_tables("metric series", open_series)

    def _write(self, sql: str, args: tuple[Any, ...]) -> Cursor:
        return self._store.write(sql, args)

    def batch(self) -> AbstractContextManager[None]:
        """The store's transaction (:meth:`Store.batch`)."""
        return self._store.batch()

    def batch_async(self) -> AbstractAsyncContextManager[None]:
        """The store's transaction committed off the event loop (:meth:`Store.batch_async`)."""
        return self._store.batch_async()

    def series_counts(self, job: str) -> dict[tuple[str, int], int]:
        """Rows per (name, level) of ``job``'s series."""
        rows = self._db.execute(
            "SELECT name, level, COUNT(*) FROM metric_points WHERE job = ? GROUP BY name, level",
            (job,),
        ).fetchall()
        return {(str(r[0]), int(r[1])): int(r[2]) for r in rows}

    def add_point(
        self, job: str, name: str, point: Point, counts: dict[tuple[str, int], int]
    ) -> None:
        """Append a full-resolution point and thin the series as :mod:`supervisor.telemetry.series`
        says; ``counts`` (from :meth:`series_counts`, kept by the caller) is updated."""
        with self.batch():
            self._insert(job, name, 0, [point])
            counts[(name, 0)] = counts.get((name, 0), 0) + 1
            for level in range(MAX_LEVEL + 1):
                n = to_merge(counts.get((name, level), 0))
                if not n:
                    break
                rows = self._db.execute(
                    "SELECT id, step, ts, value, low, high, n FROM metric_points WHERE "
                    "job = ? AND name = ? AND level = ? ORDER BY ts, id LIMIT ?",
                    (job, name, level, n),
                ).fetchall()
                oldest = [
                    Point(int(r[1]), float(r[2]), _float(r[3]), _float(r[4]), _float(r[5]), r[6])
                    for r in rows
                ]
                self._write(
                    f"DELETE FROM metric_points WHERE id IN ({','.join('?' * len(rows))})",
                    tuple(r[0] for r in rows),
                )
                up = min(level + 1, MAX_LEVEL)
                merged = pairwise(oldest[: len(oldest) - len(oldest) % 2])
                # a merged point keeps the cursor of the newer window of its two
                ids = [max(rows[i][0], rows[i + 1][0]) for i in range(0, len(merged) * 2, 2)]
                self._insert(job, name, up, merged, ids)
                counts[(name, level)] -= len(oldest)
                counts[(name, up)] = counts.get((name, up), 0) + len(merged)

    def _insert(
        self,
        job: str,
        name: str,
        level: int,
        points: Sequence[Point],
        ids: Sequence[int | None] | None = None,
    ) -> None:
        """Insert ``points``, each with its ``ids`` entry as its id (None: the next)."""
        for p, row_id in zip(points, ids or [None] * len(points), strict=True):
            row = (job, name, level, p.step, p.ts, p.value, p.low, p.high, p.n)
            if row_id is None:  # the next id (PostgreSQL takes no NULL for it)
                self._write(f"INSERT INTO metric_points ({_COLUMNS}) VALUES ({_MARKS})", row)
            else:
                self._write(
                    f"INSERT INTO metric_points (id, {_COLUMNS}) VALUES (?, {_MARKS})",
                    (row_id, *row),
                )

    def cursor(self, job: str) -> int:
        """The high-water mark of ``job``'s series: the largest ``id`` of its rows (0:
        none yet). A later read with ``after`` = this returns what comes next."""
        row = self._db.execute("SELECT MAX(id) FROM metric_points WHERE job = ?", (job,)).fetchone()
        return int(row[0] or 0)

    def series(
        self,
        job: str,
        names: Sequence[str] | None = None,
        *,
        since: float | None = None,
        step_from: int | None = None,
        after: int | None = None,
        upto: int | None = None,
    ) -> dict[str, list[Point]]:
        """``job``'s series by name (every name when ``names`` is None), oldest point
        first, from time ``since`` and step ``step_from`` on, of the rows inserted after
        cursor ``after`` and up to cursor ``upto`` (see the module doc)."""
        query = "SELECT name, step, ts, value, low, high, n FROM metric_points WHERE job = ?"
        args: list[Any] = [job]
        if names is not None:
            query += f" AND name IN ({','.join('?' * len(names))})"
            args.extend(names)
        for clause, value in (
            ("ts >= ?", since),
            ("step >= ?", step_from),
            ("id > ?", after),
            ("id <= ?", upto),
        ):
            if value is not None:
                query += f" AND {clause}"
                args.append(value)
        query += " ORDER BY name, ts, level DESC"
        found: dict[str, list[Point]] = {name: [] for name in names or ()}
        for r in self._iter(query, args):
            found.setdefault(str(r[0]), []).append(
                Point(int(r[1]), float(r[2]), _float(r[3]), _float(r[4]), _float(r[5]), r[6])
            )
        return found

    def latest_points(self, job: str, names: Sequence[str]) -> dict[str, Point]:
        """The newest point of each of ``job``'s series in ``names`` that has one."""
        found = {}
        for name in names:
            r = self._db.execute(
                "SELECT step, ts, value, low, high, n FROM metric_points WHERE job = ? AND "
                "name = ? AND level = 0 ORDER BY ts DESC LIMIT 1",
                (job, name),
            ).fetchone()
            if r is not None:
                found[name] = Point(
                    int(r[0]), float(r[1]), _float(r[2]), _float(r[3]), _float(r[4]), r[5]
                )
        return found

    def _iter(self, query: str, args: list[Any]) -> Iterator[tuple[Any, ...]]:
        yield from self._db.execute(query, args)
