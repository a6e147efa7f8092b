"""The store's rows of the jobs' metric series (a part of :class:`supervisor.store.Store`).

One table, ``metric_points``: a row per point of a series (job, name) at a level of
:mod:`supervisor.series`, so a series holds at most ``KEEP_PER_LEVEL x (MAX_LEVEL + 1)``
rows whatever the run's length, and a job's rows grow with its named series (a handful),
never with ranks or time. Per-rank latest values are not stored: the supervisor keeps
them in memory (``supervisor.metrics``), bounded by the world size, and rebuilds them
within one window after a restart.

SQLite stores a NaN as NULL: a NULL value reads back as NaN.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from supervisor.series import MAX_LEVEL, Point, pairwise, to_merge

SERIES_SCHEMA = """
CREATE TABLE IF NOT EXISTS metric_points (
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
"""


def _float(value: float | None) -> float:
    return math.nan if value is None else float(value)


class SeriesRows:
    """The metric series' reads and writes, on the store's connection."""

    _db: sqlite3.Connection

    def _write(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Cursor:
        raise NotImplementedError

    def batch(self) -> AbstractContextManager[None]:
        raise NotImplementedError

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
        """Append a full-resolution point and thin the series as :mod:`supervisor.series`
        says; ``counts`` (from :meth:`series_counts`, kept by the caller) is updated."""
        with self.batch():
            self._insert(job, name, 0, [point])
            counts[(name, 0)] = counts.get((name, 0), 0) + 1
            for level in range(MAX_LEVEL + 1):
                n = to_merge(counts.get((name, level), 0))
                if not n:
                    break
                rows = self._db.execute(
                    "SELECT rowid, step, ts, value, low, high, n FROM metric_points WHERE "
                    "job = ? AND name = ? AND level = ? ORDER BY ts, rowid LIMIT ?",
                    (job, name, level, n),
                ).fetchall()
                oldest = [
                    Point(int(r[1]), float(r[2]), _float(r[3]), _float(r[4]), _float(r[5]), r[6])
                    for r in rows
                ]
                self._write(
                    f"DELETE FROM metric_points WHERE rowid IN ({','.join('?' * len(rows))})",
                    tuple(r[0] for r in rows),
                )
                up = min(level + 1, MAX_LEVEL)
                merged = pairwise(oldest[: len(oldest) - len(oldest) % 2])
                self._insert(job, name, up, merged)
                counts[(name, level)] -= len(oldest)
                counts[(name, up)] = counts.get((name, up), 0) + len(merged)

    def _insert(self, job: str, name: str, level: int, points: Sequence[Point]) -> None:
        for p in points:
            self._write(
                "INSERT INTO metric_points (job, name, level, step, ts, value, low, high, n) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job, name, level, p.step, p.ts, p.value, p.low, p.high, p.n),
            )

    def series(
        self,
        job: str,
        names: Sequence[str] | None = None,
        *,
        since: float | None = None,
        step_from: int | None = None,
    ) -> dict[str, list[Point]]:
        """``job``'s series by name (every name when ``names`` is None), oldest point
        first, from time ``since`` and step ``step_from`` on."""
        query = "SELECT name, step, ts, value, low, high, n FROM metric_points WHERE job = ?"
        args: list[Any] = [job]
        if names is not None:
            query += f" AND name IN ({','.join('?' * len(names))})"
            args.extend(names)
        if since is not None:
            query += " AND ts >= ?"
            args.append(since)
        if step_from is not None:
            query += " AND step >= ?"
            args.append(step_from)
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
