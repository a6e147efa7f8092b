"""A job's metric series stay bounded, in memory and in the store, however long the run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import KEEP_PER_LEVEL, Point, Series, merge, row_bound
from tests.unit.supervisor.conftest import OpenStore


def point(i: int, value: float | None = None) -> Point:
    v = float(i) if value is None else value
    return Point(i, 1000.0 + i, v, v, v)


@pytest.mark.parametrize("points", [1, KEEP_PER_LEVEL, KEEP_PER_LEVEL + 1, 5_000, 100_000])
def test_a_series_never_holds_more_rows_than_its_bound(points: int) -> None:
    series = Series()
    for i in range(points):
        series.add(point(i))
        assert len(series) <= row_bound(i + 1)
    kept = series.points()
    assert sum(p.n for p in kept) == points  # every point is accounted for
    assert kept[-1].step == points - 1


def test_recent_points_stay_at_full_resolution() -> None:
    series = Series()
    for i in range(10_000):
        series.add(point(i))
    newest = series.points()[-KEEP_PER_LEVEL // 2 :]
    assert [p.step for p in newest] == list(range(10_000 - KEEP_PER_LEVEL // 2, 10_000))
    assert all(p.n == 1 for p in newest)


def test_a_merged_point_keeps_the_newer_value_and_both_envelopes() -> None:
    got = merge(Point(1, 1.0, 5.0, 4.0, 9.0, 2), Point(3, 3.0, 2.0, 1.0, 3.0, 2))
    assert got == Point(3, 3.0, 2.0, 1.0, 9.0, 4)


def test_a_nan_in_a_merged_point_stays_in_its_envelope() -> None:
    got = merge(Point(1, 1.0, math.nan, math.nan, math.nan), Point(2, 2.0, 1.0, 1.0, 1.0))
    assert got.value == 1.0 and math.isnan(got.low) and math.isnan(got.high)


def test_the_store_thins_a_series_exactly_as_the_policy_says(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store()
    rows = SeriesRows(store)
    series = Series()
    counts: dict[tuple[str, int], int] = {}
    with store.batch():
        for i in range(3_000):
            p = point(i, math.nan if i == 7 else None)
            series.add(p)
            rows.add_point("job-1", "loss", p, counts)
    stored = rows.series("job-1", ["loss"])["loss"]
    expected = series.points()
    assert len(stored) == len(expected) == sum(counts.values())
    assert [(p.step, p.n) for p in stored] == [(p.step, p.n) for p in expected]
    assert math.isnan(stored[0].low)  # the NaN of step 7 is in the oldest point's envelope
    assert rows.series_counts("job-1") == {k: v for k, v in counts.items() if v}
    store.close()


def test_series_are_read_by_name_time_and_step(tmp_path: Path, open_store: OpenStore) -> None:
    store = open_store()
    rows = SeriesRows(store)
    counts: dict[tuple[str, int], int] = {}
    for i in range(10):
        rows.add_point("job-1", "loss", point(i), counts)
        rows.add_point("job-1", "lr", point(i), counts)
    assert set(rows.series("job-1")) == {"loss", "lr"}
    assert [p.step for p in rows.series("job-1", ["loss"], step_from=7)["loss"]] == [
        7,
        8,
        9,
    ]
    assert [p.step for p in rows.series("job-1", ["lr"], since=1008.0)["lr"]] == [8, 9]
    assert rows.series("job-1", ["nothing"]) == {"nothing": []}
    assert rows.latest_points("job-1", ["loss", "nothing"]) == {"loss": point(9)}
    store.close()
