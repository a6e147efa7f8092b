"""A job's metric series, downsampled so that a run of any length stays a few thousand rows.

Pure policy, no I/O (``supervisor.telemetry.rows`` applies it to the store). A series (one
job, one name: ``loss``, ``step_time_s``, ...) is kept in *levels*: level 0 holds points
at full resolution (one per supervisor window, 5 s), a point of level ``k`` stands for
``2**k`` of them. When a level holds more than :data:`KEEP_PER_LEVEL` points, its oldest
ones are merged pairwise into the next level until it holds :data:`KEEP_PER_LEVEL` / 2
(the top level, :data:`MAX_LEVEL`, merges into itself). Recent points stay exact, older
ones get coarser, like a round-robin database.

Bound: a level never holds more than ``KEEP_PER_LEVEL`` points, so a series has at most
``KEEP_PER_LEVEL x (MAX_LEVEL + 1)`` = 6,400 rows, ever; after ``n`` points it has at
most ``KEEP_PER_LEVEL x (2 + log2(n / KEEP_PER_LEVEL))`` (:func:`row_bound`). Three weeks
at one point per 5 s (362,880 points) is at most 3,328 rows a series; 2,009 in fact
(``bench/metrics.py`` measures it in the store).

A merged point keeps the *newer* point's step, time and value (a value the run really
had at that step: rank 0's loss stays a loss rank 0 logged) and the envelope (min and
max) of both, and counts the points it stands for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

KEEP_PER_LEVEL: Final = 256
MAX_LEVEL: Final = 24  # 256 points of 2**24 windows of 5 s: over 600 years


@dataclass(frozen=True, slots=True)
class Point:
    """One point of a series: ``value`` at ``step`` (time ``ts``), ``low``..``high`` the
    envelope of the ``n`` full-resolution points it stands for (NaN: one was NaN)."""

    step: int
    ts: float
    value: float
    low: float
    high: float
    n: int = 1


def merge(older: Point, newer: Point) -> Point:
    """Two neighbouring points as one (see the module doc)."""
    if math.isnan(older.low) or math.isnan(newer.low):
        low = high = math.nan
    else:
        low, high = min(older.low, newer.low), max(older.high, newer.high)
    return Point(newer.step, newer.ts, newer.value, low, high, older.n + newer.n)


def to_merge(count: int) -> int:
    """How many of a level's oldest points to merge pairwise, when it holds ``count``:
    none up to :data:`KEEP_PER_LEVEL`, else down to half of it (an even number)."""
    if count <= KEEP_PER_LEVEL:
        return 0
    excess = count - KEEP_PER_LEVEL // 2
    return excess - excess % 2


def pairwise(points: Sequence[Point]) -> list[Point]:
    """``points`` (oldest first, an even number) merged two by two."""
    if len(points) % 2:
        raise ValueError(f"{len(points)} points cannot be merged pairwise")
    return [merge(points[i], points[i + 1]) for i in range(0, len(points), 2)]


def row_bound(points: int) -> int:
    """The most rows a series of ``points`` full-resolution points can take."""
    if points <= KEEP_PER_LEVEL:
        return points
    levels = min(MAX_LEVEL + 1, 2 + math.ceil(math.log2(points / KEEP_PER_LEVEL)))
    return KEEP_PER_LEVEL * levels


class Series:
    """One series in memory, by level (what the store keeps, for tests and the bench)."""

    def __init__(self) -> None:
        self.levels: list[list[Point]] = [[] for _ in range(MAX_LEVEL + 1)]

    def add(self, point: Point) -> None:
        self.levels[0].append(point)
        for level in range(MAX_LEVEL + 1):
            rows = self.levels[level]
            n = to_merge(len(rows))
            if not n:
                break
            merged = pairwise(rows[:n])
            del rows[:n]
            up = min(level + 1, MAX_LEVEL)
            # the top level's merged points are older than what is left of it
            self.levels[up] = merged + rows if up == level else self.levels[up] + merged

    def points(self) -> list[Point]:
        """Every point, oldest first."""
        return sorted((p for rows in self.levels for p in rows), key=lambda p: p.ts)

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.levels)
