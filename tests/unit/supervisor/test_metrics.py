"""The supervisor's training metrics: agents' batches become bounded gang series, events
and a job summary."""

from __future__ import annotations

import asyncio
import gc
import math
import sqlite3
import statistics
import threading
from collections.abc import Iterator
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx import wire
from phalanx.jobspec import validate_spec
from supervisor.errors import StoreError
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.store import Store
from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import Point, row_bound
from supervisor.telemetry.training import (
    DATA_WAIT,
    GANG_SERIES,
    MAX_SERIES,
    STEP_TIME,
    TOKENS_PER_S,
    TrainingMetrics,
    Window,
    gang_points,
    merge_windows,
)
from tests.unit.supervisor.conftest import OpenStore, hold_commits

JOB = "tinylm-abc123"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path, open_store: OpenStore) -> Iterator[Store]:
    s = open_store()
    yield s
    s.close()


def make_job(world: int = 4) -> Job:
    spec = validate_spec(
        {
            "name": "tinylm",
            "team": "research",
            "command": ["python", "t.py"],
            "workdir": "/srv/t",
            "nodes": 2,
            "ranks_per_node": world // 2,
        }
    )
    ranks = [RankPlace(r, f"n{r * 2 // world + 1}", r % (world // 2)) for r in range(world)]
    return Job(id=JOB, spec=spec, state=JobState.RUNNING, generation=2, ranks=ranks)


def window(
    rank: int, step: int, *, st: float = 0.1, at: float | None = None, **scalars: float
) -> wire.RankWindow:
    return wire.RankWindow(
        rank=rank,
        step_first=step - 9,
        step_last=step,
        at=1000.0 + step if at is None else at,
        reports=10,
        step_time_s=st,
        tokens_per_s=100.0,
        scalars={k: (v, v - 1, v + 1, v) for k, v in scalars.items()},
    )


def batch(node: str, *windows: wire.RankWindow, generation: int = 2) -> wire.MetricsBatch:
    return wire.MetricsBatch(
        node=node, job=JOB, generation=generation, window_s=5.0, sent_at=1.0, ranks=list(windows)
    )


def metrics(store: Store, job: Job, clock: Clock, **kw: Any) -> TrainingMetrics:
    return TrainingMetrics(store, {job.id: job}.get, interval_s=5.0, clock=clock, **kw)


def test_rank_0s_loss_at_its_last_step_is_the_gangs_loss(store: Store) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 19, loss=2.5), window(1, 19, loss=9.0)))
    m.on_batch(batch("n2", window(2, 18, loss=1.0), window(3, 19, loss=3.0)))
    m.flush()
    [loss] = SeriesRows(store).series(JOB, ["loss"])["loss"]
    assert (loss.step, loss.value, loss.low, loss.high) == (19, 2.5, 0.0, 10.0)


def test_step_time_is_the_median_and_throughput_the_sum_over_ranks(store: Store) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 9, st=0.1), window(1, 9, st=0.2)))
    m.on_batch(batch("n2", window(2, 9, st=0.3), window(3, 9, st=1.0)))
    m.flush()
    series = SeriesRows(store).series(JOB, ["step_time_s", "tokens_per_s"])
    [st], [tps] = series["step_time_s"], series["tokens_per_s"]
    assert st.value == pytest.approx(0.25) and (st.low, st.high) == (0.1, 1.0)
    assert tps.value == 400.0


def test_two_windows_of_a_rank_in_one_flush_make_one_point(store: Store) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 9, loss=5.0)))
    m.on_batch(batch("n1", window(0, 19, loss=4.0)))
    m.flush()
    [loss] = SeriesRows(store).series(JOB, ["loss"])["loss"]
    assert (loss.step, loss.value, loss.low, loss.high) == (19, 4.0, 3.0, 6.0)


async def test_the_loops_flush_commits_on_a_worker_thread_and_a_failed_one_is_redone(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop's flush (flush_async) commits off the event loop; a COMMIT that fails
    # there (the disk full) rolls the points back, and the next flush reads the series'
    # rows again: nothing is counted that the store does not hold.
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    full = [True]

    def before() -> None:
        if full[0]:
            raise sqlite3.OperationalError("database or disk is full")

    threads = hold_commits(monkeypatch, store, before)
    m.on_batch(batch("n1", window(0, 9, loss=5.0), window(1, 9, loss=5.0)))
    with pytest.raises(StoreError, match="disk is full"):
        await m.flush_async()
    assert SeriesRows(store).series(JOB, ["loss"])["loss"] == []

    full[0] = False
    m.on_batch(batch("n1", window(0, 19, loss=4.0), window(1, 19, loss=4.0)))
    await m.flush_async()
    [loss] = SeriesRows(store).series(JOB, ["loss"])["loss"]
    assert (loss.step, loss.value) == (19, 4.0)
    assert len(threads) == 2 and threading.current_thread().name not in threads


async def test_the_loops_flush_lets_the_loop_turn_between_making_the_points_and_writing_them(
    store: Store,
) -> None:
    # At 16,384 ranks a job's points take 0.05-0.15 s to make: the loop's flush makes
    # them, lets the loop run (its messages: a window heard then is the next flush's),
    # then writes them.
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 9, loss=5.0), window(1, 9, loss=5.0)))
    flushing = asyncio.create_task(m.flush_async())
    await asyncio.sleep(0)  # the flush made the job's points and let the loop turn
    assert not flushing.done()
    assert SeriesRows(store).series(JOB, ["loss"])["loss"] == []  # not written yet
    m.on_batch(batch("n1", window(0, 19, loss=4.0), window(1, 19, loss=4.0)))
    await flushing
    assert [p.step for p in SeriesRows(store).series(JOB, ["loss"])["loss"]] == [9]
    await m.flush_async()
    assert [p.step for p in SeriesRows(store).series(JOB, ["loss"])["loss"]] == [9, 19]


async def test_points_a_cancelled_flush_made_are_written_by_the_next_one(store: Store) -> None:
    # A shutdown cancels the loop's flush while the loop turns between making the points
    # and writing them: the close's flush writes them, none is lost.
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 9, loss=5.0), window(1, 9, loss=5.0)))
    flushing = asyncio.create_task(m.flush_async())
    await asyncio.sleep(0)
    flushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flushing
    assert SeriesRows(store).series(JOB, ["loss"])["loss"] == []
    m.flush()
    [loss] = SeriesRows(store).series(JOB, ["loss"])["loss"]
    assert (loss.step, loss.value) == (9, 5.0)


def test_merged_windows_keep_the_newer_figures_whatever_their_order() -> None:
    older = Window.of(window(0, 9, loss=5.0), "n1", 1.0)
    newer = Window.of(window(0, 19, loss=4.0), "n1", 2.0)
    got = merge_windows(newer, older)
    assert (got.step_first, got.step_last, got.reports) == (0, 19, 20)
    assert got.stats("loss") == (4.0, 3.0, 6.0, 4.5)
    assert got.stats("grad_norm") is None


def test_a_kept_window_is_tuples_of_numbers_the_garbage_collector_lets_go() -> None:
    kept = Window.of(window(0, 9, loss=5.0, grad_norm=1.0), "n1", 1.0)
    gc.collect()
    assert kept.names() == ("loss", "grad_norm")
    assert kept.stats("grad_norm") == (1.0, 0.0, 2.0, 1.0)
    assert not gc.is_tracked(kept.scalars)


def test_gang_series_come_from_fresh_windows_only_when_pending_is_empty() -> None:
    assert gang_points({}, []) == {}


@pytest.mark.parametrize(
    ("job_id", "generation", "rank", "why"),
    [
        ("other-job", 2, 0, "unknown job"),
        (JOB, 1, 0, "older generation"),
        (JOB, 2, 4, "rank outside the world"),
        (JOB, 2, 3, "rank placed on another node"),
    ],
)
def test_a_batch_that_does_not_fit_the_job_is_dropped_and_counted(
    store: Store, job_id: str, generation: int, rank: int, why: str
) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(
        wire.MetricsBatch(
            node="n1",
            job=job_id,
            generation=generation,
            window_s=5.0,
            sent_at=1.0,
            ranks=[window(rank, 9, loss=1.0)],
        )
    )
    m.flush()
    assert m.dropped == 1, why
    assert SeriesRows(store).series(JOB) == {}


def test_a_nan_loss_is_a_job_event_once_a_minute(store: Store) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    for i in range(3):
        m.on_batch(batch("n1", window(0, 10 * i + 9, loss=math.nan)))
        m.flush()
        clock.now += 5
    [event] = store.events(job=JOB)
    assert event.kind == "metric_anomaly"
    assert event.detail | {"value": "x"} == {
        "job": JOB,
        "generation": 2,
        "name": "loss",
        "kind": "nonfinite",
        "step": 9,
        "value": "x",
        "baseline": None,
    }
    assert event.detail["value"] == "NaN"
    assert m.summary(JOB)["loss"] == "NaN"


def test_a_slow_rank_becomes_a_straggler_event_and_is_in_the_summary(store: Store) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock, straggler_margin=0.2, straggler_windows=2)
    for i in range(3):
        m.on_batch(batch("n1", window(0, 10 * i + 9, st=0.1), window(1, 10 * i + 9, st=0.1)))
        m.on_batch(batch("n2", window(2, 10 * i + 9, st=0.1), window(3, 10 * i + 9, st=0.5)))
        m.flush()
        clock.now += 5
    [event] = store.events(job=JOB)
    assert (event.kind, event.node, event.detail["rank"]) == ("straggler", "n2", 3)
    summary = m.summary(JOB)
    assert summary["stragglers"] == [
        {"rank": 3, "node": "n2", "step_time_s": 0.5, "median_s": 0.1, "ratio": 5.0}
    ]
    assert summary["step"] == 29 and summary["step_time_s"] == pytest.approx(0.1)
    assert summary["tokens_per_s"] == 400.0 and summary["ranks_reporting"] == 4


def test_a_job_keeps_at_most_max_series_names(store: Store) -> None:
    job, clock = make_job(world=64), Clock()
    m = metrics(store, job, clock)
    for rank in range(8):  # each rank its own 16 names: 128 names in all
        names = {f"r{rank}_n{i}": 1.0 for i in range(wire.MAX_METRIC_NAMES)}
        m.on_batch(batch("n1", window(rank, 9, **names)))
    m.flush()
    assert len(SeriesRows(store).series(JOB)) == MAX_SERIES


def test_an_ended_job_is_forgotten_once_its_last_windows_are_written(store: Store) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 9, loss=1.0)))
    job.state = JobState.SUCCEEDED
    m.flush()
    assert [p.step for p in SeriesRows(store).series(JOB, ["loss"])["loss"]] == [9]
    m.flush()
    assert m.summary(JOB)["loss"] == 1.0 and m.summary(JOB)["ranks_reporting"] == 0


def test_a_new_generation_continues_the_series_and_drops_the_old_ones_batches(
    store: Store,
) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 49, loss=2.0)))
    m.flush()
    job.generation = 3  # a recovery: restored step 30, the ranks start again
    m.on_batch(batch("n1", window(0, 59, loss=3.0), generation=2))
    m.on_batch(batch("n1", window(0, 39, at=2000.0, loss=2.2), generation=3))
    clock.now += 5
    m.flush()
    assert [(p.step, p.value) for p in SeriesRows(store).series(JOB, ["loss"])["loss"]] == [
        (49, 2.0),
        (39, 2.2),
    ]
    assert m.dropped == 1
    assert m.summary(JOB)["ranks_reporting"] == 1


def test_a_nan_grad_norm_of_another_rank_than_rank_0_is_an_event_too(store: Store) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    nan = wire.RankWindow(
        rank=1,
        step_first=0,
        step_last=9,
        at=1009.0,
        reports=10,
        scalars={"grad_norm": (1.0, math.nan, math.nan, math.nan)},
    )
    m.on_batch(batch("n1", window(0, 9, grad_norm=1.0), nan))
    m.flush()
    [event] = store.events(job=JOB)
    assert (event.kind, event.detail["name"], event.detail["value"]) == (
        "metric_anomaly",
        "grad_norm",
        "NaN",
    )


def test_a_restarted_supervisor_continues_the_series_it_stored(store: Store) -> None:
    job, clock = make_job(), Clock()
    before = metrics(store, job, clock)
    for i in range(200):
        before.on_batch(batch("n1", window(0, 10 * i + 9, at=1000.0 + i, loss=1.0)))
        before.flush()
    after = metrics(store, job, clock)  # a new supervisor: nothing in memory
    for i in range(200, 400):
        after.on_batch(batch("n1", window(0, 10 * i + 9, at=1000.0 + i, loss=1.0)))
        after.flush()
    points = SeriesRows(store).series(JOB, ["loss"])["loss"]
    assert sum(p.n for p in points) == 400 and points[-1].step == 3999
    assert len(points) < 400 and len(points) <= row_bound(400)  # thinned after the restart
    assert [p.ts for p in points] == sorted(p.ts for p in points)


def test_the_other_ranks_windows_wait_for_rank_0s_so_a_step_is_never_repeated(
    store: Store,
) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 9, loss=2.0)))
    m.on_batch(batch("n2", window(2, 9, loss=2.0)))
    m.flush()
    clock.now += 5
    m.on_batch(batch("n2", window(2, 19, loss=7.0)))  # rank 0's window is late
    m.flush()
    clock.now += 5
    m.on_batch(batch("n1", window(0, 19, loss=1.5)))
    m.flush()
    points = SeriesRows(store).series(JOB, ["loss"])["loss"]
    assert [(p.step, p.value, p.high) for p in points] == [(9, 2.0, 3.0), (19, 1.5, 8.0)]
    assert len(SeriesRows(store).series(JOB, ["step_time_s"])["step_time_s"]) == 3


def test_without_rank_0_the_gang_value_is_the_mean_of_the_ranks_that_report(
    store: Store,
) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n2", window(2, 19, loss=2.0), window(3, 18, loss=4.0)))
    m.flush()
    [point] = SeriesRows(store).series(JOB, ["loss"])["loss"]
    assert (point.step, point.value) == (19, 3.0)


def test_an_ended_jobs_last_windows_without_rank_0_add_no_point_at_a_step_it_has(
    store: Store,
) -> None:
    job, clock = make_job(), Clock()
    m = metrics(store, job, clock)
    m.on_batch(batch("n1", window(0, 19, loss=2.0), window(1, 19, loss=2.0)))
    m.flush()
    m.on_batch(batch("n2", window(2, 19, loss=2.0), window(3, 19, loss=2.0)))  # came late
    job.state = JobState.SUCCEEDED
    clock.now += 5
    m.flush()
    assert [p.step for p in SeriesRows(store).series(JOB, ["loss"])["loss"]] == [19]


def _gang_points_by_name(pending: dict[int, Window], rank_0_names: set[str]) -> dict[str, Point]:
    """The scalars' gang points as first written: each name looked up in each window."""
    points: dict[str, Point] = {}
    first = pending.get(0)
    names = {n for w in pending.values() for n in w.names()}
    for name in sorted(names - set(GANG_SERIES)):
        of_first = first.stats(name) if first is not None else None
        if name in rank_0_names and of_first is None:
            continue
        having = [(w, st) for w in pending.values() if (st := w.stats(name)) is not None]
        lows = [st[1] for _, st in having]
        highs = [st[2] for _, st in having]
        nan = any(math.isnan(v) for v in (*lows, *highs))
        low, high = (math.nan, math.nan) if nan else (min(lows), max(highs))
        if first is not None and of_first is not None:
            points[name] = Point(first.step_last, first.at, of_first[0], low, high)
        else:
            value = statistics.fmean(st[0] for _, st in having)
            step = max(w.step_last for w, _ in having)
            points[name] = Point(step, max(w.at for w, _ in having), value, low, high)
    return points


def _gang_series_by_window(latest: list[Window]) -> dict[str, Point]:
    """The gang series' points as first written: a pass over the windows per figure."""
    points: dict[str, Point] = {}
    step = max(w.step_last for w in latest)
    at = max(w.at for w in latest)
    for name, values, combine in (
        (STEP_TIME, [w.step_time_s for w in latest], statistics.median),
        (TOKENS_PER_S, [w.tokens_per_s for w in latest], math.fsum),
        (DATA_WAIT, [w.data_wait_s for w in latest], statistics.fmean),
    ):
        known = [v for v in values if v is not None]
        if known:
            points[name] = Point(step, at, float(combine(known)), min(known), max(known))
    return points


_figure = st.floats(min_value=-1e6, max_value=1e6) | st.just(math.nan)
_gang_figure = st.none() | st.floats(min_value=0, max_value=1e6)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.integers(min_value=0, max_value=6),
        st.tuples(
            st.integers(min_value=0, max_value=50),  # step
            st.dictionaries(
                st.sampled_from(["loss", "lr", "grad_norm", "acc", STEP_TIME]),
                st.tuples(_figure, _figure, _figure, _figure),
                max_size=5,
            ),
            st.tuples(_gang_figure, _gang_figure, _gang_figure),  # step time, tokens/s, wait
        ),
        max_size=6,
    ),
    st.sets(st.sampled_from(["loss", "lr"])),
    st.booleans(),  # every rank names the first one's scalars, in its order
)
def test_the_scalars_gang_points_in_one_pass_are_those_by_name(
    ranks: dict[int, tuple[int, dict[str, tuple[float, float, float, float]], tuple[Any, ...]]],
    rank_0_names: set[str],
    alike: bool,
) -> None:
    if alike and ranks:
        names = list(next(iter(ranks.values()))[1])
        ranks = {
            rank: (step, {n: scalars.get(n, (1.0, 0.5, 2.0, 1.0)) for n in names}, gang)
            for rank, (step, scalars, gang) in ranks.items()
        }
    pending = {
        rank: Window(
            "n1",
            1.0,
            step - 1,
            step,
            1000.0 + step + rank,
            2,
            *gang,
            tuple(v for name, stats in scalars.items() for v in (name, *stats)),
        )
        for rank, (step, scalars, gang) in ranks.items()
    }
    got = gang_points(pending, pending.values(), rank_0_names)
    want = _gang_points_by_name(pending, rank_0_names)
    if pending:
        want.update(_gang_series_by_window(list(pending.values())))
    assert got.keys() == want.keys()
    for name, point in got.items():  # figure by figure, a NaN as good as a NaN
        pairs = zip(astuple(point), astuple(want[name]), strict=True)
        assert all((a != a and b != b) or a == b for a, b in pairs), (name, point, want[name])
