"""A job's training metrics in the supervisor: batches in, bounded series, anomalies, stragglers.

The agents send a :class:`phalanx.wire.MetricsBatch` per job per node every window
(``agentd.metrics``). :meth:`TrainingMetrics.on_batch` keeps, per job of its current
generation, what each rank sent since the last flush and each rank's latest window (in
memory: bounded by the world size). Every ``metrics_interval_s`` :meth:`flush` turns the
windows into one point per *gang series* and appends it to the store, downsampled
(:mod:`supervisor.telemetry.series`: at most a few thousand rows a series, whatever the length of
the run):

* every named scalar (``loss``, ``grad_norm``, ``lr``, ...) rank 0 reports: rank 0's
  last value at its last step (a value rank 0 logged), written once rank 0's window came
  (the other ranks' windows wait for it); a scalar rank 0 never reported: the mean over
  the ranks that report it, at their furthest step; the envelope (min, max) over every
  rank's windows since the last point;
* ``step_time_s``: the median over ranks of their mean step time (envelope: the
  fastest and the slowest rank); ``tokens_per_s``: the sum over ranks;
  ``data_wait_s``: the mean over ranks. These three use each rank's latest window
  heard within three intervals, so a node whose batch came a little late still counts.

A job has at most :data:`MAX_SERIES` series (names past it are dropped and counted).
``loss`` and ``grad_norm`` go through a :class:`~supervisor.telemetry.anomalies.SpikeWatch` and the
ranks' step times through a :class:`~supervisor.telemetry.anomalies.StragglerWatch`; their verdicts
become job events (``metric_anomaly``, at most one per series and kind a minute;
``straggler``, ``straggler_cleared``) and the job's :meth:`summary`. After each flush the
flags standing across all jobs go through :func:`supervisor.telemetry.slow_nodes.slow_nodes`: the
nodes slow in ``straggler_node_jobs`` jobs at once are handed to ``on_slow_nodes`` (the
registry's :meth:`~supervisor.fleet.registry.Registry.mark_slow`: a ``warn`` reason).

Cost (``bench/metrics.py``, one core of the reference machine): a batch of 8 ranks is
parsed in ~40-60 us and taken in ~8 us; a flush writes a handful of rows per job in one
transaction, ~10 ms for a 4,096-rank job and ~45 ms for a 16,384-rank one (the median
and straggler look over every rank). A 16,384-GPU job at 10 steps/s (410 batches/s)
takes ~4 % of a core; the supervisor ingests ~4.4M rank-steps/s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Final, NamedTuple

from phalanx import wire
from supervisor.jobs import Job
from supervisor.store import Store
from supervisor.telemetry.anomalies import SpikeWatch, StragglerWatch
from supervisor.telemetry.mfu import FLOPS, mfu, peak_flops
from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import Point
from supervisor.telemetry.slow_nodes import Flag, SlowNode, slow_nodes

log = logging.getLogger(__name__)

STEP_TIME: Final = "step_time_s"
TOKENS_PER_S: Final = "tokens_per_s"
DATA_WAIT: Final = "data_wait_s"
GANG_SERIES: Final = (STEP_TIME, TOKENS_PER_S, DATA_WAIT)
WATCHED: Final = ("loss", "grad_norm")  # series whose NaNs and spikes are job events
MAX_SERIES: Final = 32  # per job: its gang series and the first 29 scalar names heard
FRESH_WINDOWS: Final = 3.0  # a rank's latest window counts this many intervals
ANOMALY_EVENT_EVERY_S: Final = 60.0
DROP_LOG_EVERY_S: Final = 60.0


# A window's scalars: each one's name and (last, min, max, mean), one after the other in
# one flat tuple (a tuple a scalar would be one more object for the collector to look at).
Scalars = tuple[str | float, ...]


class Window(NamedTuple):
    """A rank's window (``wire.RankWindow``), or its windows since the last flush merged
    (:func:`merge_windows`), as the supervisor keeps them: a tuple of numbers, its
    scalars one flat tuple of names and numbers. The cyclic garbage collector stops
    tracking a tuple of numbers and strings once it has looked at it; kept as the wire's
    models, 16,384 ranks' windows were ~130,000 tracked objects living 5 s each,
    rescanned by every collection (young pauses of 200-250 ms at 2,048 nodes on this
    2-core machine: issue 22). ``node`` sent it, ``heard`` is the supervisor's clock
    when it came."""

    node: str
    heard: float
    step_first: int
    step_last: int
    at: float
    reports: int
    step_time_s: float | None
    tokens_per_s: float | None
    data_wait_s: float | None
    scalars: Scalars

    @classmethod
    def of(cls, w: wire.RankWindow, node: str, heard: float) -> Window:
        return cls(
            node,
            heard,
            w.step_first,
            w.step_last,
            w.at,
            w.reports,
            w.step_time_s,
            w.tokens_per_s,
            w.data_wait_s,
            _flat(w.scalars),
        )

    def names(self) -> tuple[str, ...]:
        """The names of its scalars, in the order they came."""
        return self.scalars[0::5]  # type: ignore[return-value]

    def stats(self, name: str) -> wire.ScalarStats | None:
        """The (last, min, max, mean) of scalar ``name``, or None when not reported."""
        s = self.scalars
        for i in range(0, len(s), 5):
            if s[i] == name:
                return s[i + 1 : i + 5]  # type: ignore[return-value]
        return None

    def stats_by_name(self) -> dict[str, wire.ScalarStats]:
        s = self.scalars
        return {s[i]: s[i + 1 : i + 5] for i in range(0, len(s), 5)}  # type: ignore[misc]


def _flat(scalars: Mapping[str, wire.ScalarStats]) -> Scalars:
    return tuple(v for name, stats in scalars.items() for v in (name, *stats))


@dataclass
class _JobMetrics:
    generation: int
    placement: dict[int, str] = field(default_factory=dict)  # rank -> node, this generation
    pending: dict[int, Window] = field(default_factory=dict)  # merged since the last flush
    latest: dict[int, Window] = field(default_factory=dict)
    counts: dict[tuple[str, int], int] | None = None  # the store's rows per (name, level)
    names: set[str] = field(default_factory=set)
    rank_0_names: set[str] = field(default_factory=set)  # scalars that are rank 0's series
    spikes: dict[str, SpikeWatch] = field(default_factory=dict)
    stragglers: StragglerWatch = field(default_factory=StragglerWatch)
    flagged_at: dict[int, float] = field(default_factory=dict)  # straggler rank -> since
    told: dict[tuple[str, str], float] = field(default_factory=dict)  # anomaly events sent
    dropped_names: int = 0


# A job's points made by a flush, to be written: the job, its metrics, its ranks' fresh
# windows, the points by name, and the flush's time.
_Made = tuple[Job, _JobMetrics, dict[int, Window], dict[str, Point], float]


def merge_windows(older: Window, newer: Window) -> Window:
    """Two windows of one rank as one: the newer's latest figures, both windows' scalar
    envelopes, means weighted by reports."""
    if newer.step_last < older.step_last or (
        newer.step_last == older.step_last and newer.at < older.at
    ):
        older, newer = newer, older
    scalars = older.stats_by_name()
    total = older.reports + newer.reports
    for name, (last, low, high, mean) in newer.stats_by_name().items():
        old = scalars.get(name)
        if old is None:
            scalars[name] = (last, low, high, mean)
            continue
        old_low, old_high = old[1], old[2]
        # (x != x: x is NaN; a NaN once seen stays the envelope's min and max)
        nan = old_low != old_low or old_high != old_high or low != low or high != high
        scalars[name] = (
            last,
            math.nan if nan else min(old_low, low),
            math.nan if nan else max(old_high, high),
            (old[3] * older.reports + mean * newer.reports) / total,
        )
    return newer._replace(
        step_first=min(older.step_first, newer.step_first),
        reports=total,
        scalars=_flat(dict(list(scalars.items())[: wire.MAX_METRIC_NAMES])),
    )


class _Gathered:
    """One scalar's figures over the windows that have it (:func:`gang_points`)."""

    __slots__ = ("at", "high", "lasts", "low", "nan", "step")

    def __init__(self) -> None:
        self.lasts: list[float] = []
        self.low = math.inf
        self.high = -math.inf
        self.nan = False  # a NaN among the lows or highs: the envelope is NaN
        self.step = -1
        self.at = -math.inf

    def add(
        self,
        lasts: Sequence[float],
        lows: Sequence[float],
        highs: Sequence[float],
        step: int,
        at: float,
    ) -> None:
        """The figures of some windows (column by column), the newest step and time
        among them."""
        self.lasts.extend(lasts)
        if not self.nan and (any(map(math.isnan, lows)) or any(map(math.isnan, highs))):
            self.nan = True
        if not self.nan:
            self.low = min(self.low, min(lows))
            self.high = max(self.high, max(highs))
        self.step = max(self.step, step)
        self.at = max(self.at, at)


def gang_points(
    pending: dict[int, Window],
    fresh: Iterable[Window],
    rank_0_names: Collection[str] = (),
) -> dict[str, Point]:
    """One point per gang series (see the module doc) from the windows received since
    the last point (``pending``, by rank) and every rank's fresh latest window. A scalar
    of ``rank_0_names`` has a point only when rank 0's window is pending."""
    points: dict[str, Point] = {}
    latest = list(fresh)
    first = pending.get(0)
    # One pass over every window's scalars, each name's figures gathered on the way: a
    # look-up of each name in each window (Window.stats) grew with the ranks times the
    # names squared, 0.4-0.6 s of the event loop a flush at 4,096 nodes (issue 22).
    # The windows that name the same scalars in the same order (at 16,384 ranks, most
    # or all) are taken as columns, each figure's column made by one pass in C (map over
    # an itemgetter): a Python pass over 16,384 windows per figure was ~70 ms of a turn
    # of the loaded supervisor's loop a flush at 2,048 nodes, and a transposition by
    # zip(*windows) makes an iterator per window, objects enough to set the collector off
    # (issue 22).
    gathered: dict[str, _Gathered] = {}
    for names, group, scalars in _alike(list(pending.values())):
        step = max(map(_STEP_LAST, group))
        at = max(map(_AT, group))
        for j, name in enumerate(names):
            lasts, lows, highs = (list(map(itemgetter(5 * j + k), scalars)) for k in (1, 2, 3))
            g = gathered.get(name)
            if g is None:
                g = gathered[name] = _Gathered()
            g.add(lasts, lows, highs, step, at)
    for name in sorted(gathered.keys() - set(GANG_SERIES)):
        of_first = first.stats(name) if first is not None else None
        if name in rank_0_names and of_first is None:
            continue
        g = gathered[name]
        low, high = (math.nan, math.nan) if g.nan else (g.low, g.high)
        if first is not None and of_first is not None:
            points[name] = Point(first.step_last, first.at, of_first[0], low, high)
        else:
            value = statistics.fmean(g.lasts)
            points[name] = Point(g.step, g.at, value, low, high)
    if not latest:
        return points
    step = max(map(_STEP_LAST, latest))
    at = max(map(_AT, latest))
    for name, field_of, combine in (
        (STEP_TIME, _STEP_TIME, statistics.median),
        (TOKENS_PER_S, _TOKENS, math.fsum),
        (DATA_WAIT, _DATA_WAIT, statistics.fmean),
    ):
        values = list(map(field_of, latest))  # floats and Nones
        known = values if None not in values else [v for v in values if v is not None]
        if known:
            points[name] = Point(step, at, float(combine(known)), min(known), max(known))
    return points


def _field(name: str) -> itemgetter[Any]:
    """A window's field ``name`` as a function of the window, run in C."""
    return itemgetter(Window._fields.index(name))


_STEP_LAST: Final = _field("step_last")
_AT: Final = _field("at")
_STEP_TIME: Final = _field("step_time_s")
_TOKENS: Final = _field("tokens_per_s")
_DATA_WAIT: Final = _field("data_wait_s")
_SCALARS: Final = _field("scalars")


def _alike(
    windows: list[Window],
) -> Iterator[tuple[tuple[str, ...], list[Window], list[Scalars]]]:
    """The windows in groups that name the same scalars in the same order: each group's
    names, windows and their scalars."""
    if not windows:
        return
    scalars = list(map(_SCALARS, windows))
    widths = list(map(len, scalars))
    if widths.count(widths[0]) == len(widths) and all(
        column.count(column[0]) == len(column)
        for column in (list(map(itemgetter(i), scalars)) for i in range(0, widths[0], 5))
    ):
        yield windows[0].names(), windows, scalars
        return
    groups: dict[tuple[str, ...], list[Window]] = {}
    for w in windows:
        groups.setdefault(w.names(), []).append(w)
    for names, group in groups.items():
        yield names, group, list(map(_SCALARS, group))


class TrainingMetrics:
    """The fleet's training metrics (see the module doc). ``job(id)`` finds a job."""

    def __init__(
        self,
        store: Store,
        job: Callable[[str], Job | None],
        *,
        interval_s: float = wire.METRICS_INTERVAL_S,
        straggler_margin: float = 0.2,
        straggler_windows: int = 6,
        straggler_node_jobs: int = 2,
        on_slow_nodes: Callable[[Mapping[str, SlowNode]], object] | None = None,
        clock: Callable[[], float] = time.time,
        gpu_model: Callable[[str], str | None] = lambda _node: None,
        gpu_peaks: Mapping[str, float] | None = None,
    ) -> None:
        """``gpu_model(node)``: the model of the node's GPUs (for MFU); ``gpu_peaks``:
        peak FLOP/s by exact model name, before :data:`supervisor.telemetry.mfu.PEAKS`;
        ``on_slow_nodes(slow)``: after every flush, the nodes slow in at least
        ``straggler_node_jobs`` jobs (see the module doc)."""
        self.store = store
        self.rows = SeriesRows(store)  # the series' table, on the store's connection
        self._job = job
        self._gpu_model = gpu_model
        self._gpu_peaks = dict(gpu_peaks or {})
        self.interval_s = interval_s
        self.straggler_margin = straggler_margin
        self.straggler_windows = straggler_windows
        self.straggler_node_jobs = straggler_node_jobs
        self._on_slow_nodes = on_slow_nodes
        self._clock = clock
        self._jobs: dict[str, _JobMetrics] = {}
        # Points a flush made and could not write (cancelled first): the next flush's.
        self._unwritten: list[_Made] = []
        self.batches = 0  # batches taken
        self.dropped = 0  # batches dropped: unknown job, older generation, ranks outside it
        self.points = 0  # points written
        self._dropped_logged = -math.inf

    # --- in ----------------------------------------------------------------------

    def on_batch(self, batch: wire.MetricsBatch) -> None:
        job = self._job(batch.job)
        if job is None or batch.generation != job.generation:
            why = "an unknown job" if job is None else f"generation {batch.generation}"
            self._drop(batch, why)
            return
        state = self._jobs.get(job.id)
        if state is None or state.generation != job.generation:
            state = self._new_state(job, state)
        now = self._clock()
        for w in batch.ranks:
            if w.rank >= job.world_size:
                self._drop(batch, f"rank {w.rank} outside world size {job.world_size}")
                continue
            if state.placement and state.placement.get(w.rank) != batch.node:
                self._drop(batch, f"rank {w.rank} is not placed on node {batch.node}")
                continue
            window = Window.of(w, batch.node, now)
            old = state.pending.get(w.rank)
            state.pending[w.rank] = window if old is None else merge_windows(old, window)
            state.latest[w.rank] = window
        state.dropped_names += batch.dropped_names
        self.batches += 1

    def _new_state(self, job: Job, old: _JobMetrics | None) -> _JobMetrics:
        state = _JobMetrics(
            job.generation,
            {r.rank: r.node for r in job.ranks},
            stragglers=StragglerWatch(self.straggler_margin, self.straggler_windows),
        )
        if old is not None:  # a new generation: the series go on, the ranks start afresh
            state.counts, state.names, state.spikes = old.counts, old.names, old.spikes
            state.rank_0_names = old.rank_0_names
        self._jobs[job.id] = state
        return state

    def _drop(self, batch: wire.MetricsBatch, why: str) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._dropped_logged >= DROP_LOG_EVERY_S:
            self._dropped_logged = now
            log.warning(
                "dropped metrics of job %s from node %s: %s (%d dropped so far)",
                batch.job,
                batch.node,
                why,
                self.dropped,
            )

    # --- flush -------------------------------------------------------------------

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush_async()

    def flush(self) -> None:
        """Every job's windows since the last flush into its series, and its watches: one
        transaction (one fsync) for all the jobs."""
        try:
            with self.rows.batch():
                self._flush(self._clock())
        except BaseException:
            self._rolled_back()
            raise
        self._tell_slow()

    async def flush_async(self) -> None:
        """:meth:`flush`, the event loop turning between its parts: each job's points made
        (at 16,384 ranks 0.05-0.15 s of the loop), then all of them written, their COMMIT
        on a worker thread (``Store.batch_async``; its fsync was one of the loop's longest
        waits at 2,048 nodes). The windows that come meanwhile are the next flush's."""
        now = self._clock()
        made: list[_Made] = []
        written = False
        try:
            for job, state, fresh, points in self._gather(now):
                made.append((job, state, fresh, points, now))
                await asyncio.sleep(0)  # the loop's messages, HTTP, timers
            async with self.rows.batch_async():
                for one in made:
                    self._record(*one)
                written = True
        except asyncio.CancelledError:
            if not written:  # cancelled before its writes (a shutdown): the close's flush
                self._unwritten.extend(made)
            else:
                self._rolled_back()
            raise
        except BaseException:
            self._rolled_back()
            raise
        self._tell_slow()

    def _rolled_back(self) -> None:
        for state in self._jobs.values():
            state.counts = None  # rolled back: read the rows per level again

    def _tell_slow(self) -> None:
        if self._on_slow_nodes is not None:
            self._on_slow_nodes(
                slow_nodes(self.straggler_flags(), self._live(), min_jobs=self.straggler_node_jobs)
            )

    def _flush(self, now: float) -> None:
        made, self._unwritten = self._unwritten, []
        for job, state, fresh, points in self._gather(now):
            made.append((job, state, fresh, points, now))
        for one in made:
            self._record(*one)

    def _gather(
        self, now: float
    ) -> Iterator[tuple[Job, _JobMetrics, dict[int, Window], dict[str, Point]]]:
        """Each job with windows pending: its ranks' fresh windows and the points they
        make (taken off ``pending``), one job at a time. Jobs gone or ended with nothing
        pending are forgotten."""
        for job_id, state in list(self._jobs.items()):
            job = self._job(job_id)
            if job is None or (job.state.final and not state.pending):
                del self._jobs[job_id]
                continue
            if not state.pending:
                continue
            fresh = {
                rank: latest
                for rank, latest in state.latest.items()
                if now - latest.heard <= FRESH_WINDOWS * self.interval_s
            }
            # A scalar rank 0 reports is rank 0's series: its point waits for rank 0's
            # window (another rank's alone would repeat a step or mix in its own value);
            # the windows stay pending meanwhile, merged with the next ones.
            if (first := state.pending.get(0)) is not None:
                state.rank_0_names.update(first.names())
            deferred = (
                first is None
                and not job.state.final
                and any(n in state.rank_0_names for w in state.pending.values() for n in w.names())
            )
            points = gang_points(
                {} if deferred else state.pending, fresh.values(), state.rank_0_names
            )
            if not deferred:
                state.pending = {}
            yield job, state, fresh, points

    def _record(
        self,
        job: Job,
        state: _JobMetrics,
        fresh: dict[int, Window],
        points: dict[str, Point],
        now: float,
    ) -> None:
        """Write a job's points (:meth:`_gather`) and look at them with its watches, in the
        caller's transaction."""
        job_id = job.id
        if state.counts is None:
            state.counts = self.rows.series_counts(job_id)
            state.names = {name for name, _ in state.counts}
        with self.rows.batch():
            for name, point in points.items():
                if name not in state.names and len(state.names) >= MAX_SERIES:
                    state.dropped_names += 1
                    continue
                state.names.add(name)
                self.rows.add_point(job_id, name, point, state.counts)
                self.points += 1
                if name in WATCHED:
                    self._watch(job, state, name, point, now)
            self._stragglers(job, state, fresh, now)

    def _watch(self, job: Job, state: _JobMetrics, name: str, point: Point, now: float) -> None:
        watch = state.spikes.setdefault(name, SpikeWatch(name))
        # A NaN or an infinity of any rank, at any step of the window, is in the envelope.
        odd = next((v for v in (point.low, point.high) if not math.isfinite(v)), None)
        found = watch.see(point.step, point.value if odd is None else odd)
        if found is None:
            return
        if now - state.told.get((name, found.kind), -math.inf) < ANOMALY_EVENT_EVERY_S:
            return
        state.told[(name, found.kind)] = now
        log.warning(
            "job %s: %s %s at step %d: %s (moving average %s)",
            job.id,
            name,
            found.kind,
            found.step,
            found.value,
            found.baseline,
            extra={"job": job.id, "event": "metric_anomaly"},
        )
        self.store.add_event(
            "metric_anomaly",
            None,
            {
                "job": job.id,
                "generation": job.generation,
                "name": name,
                "kind": found.kind,
                "step": found.step,
                "value": json_number(found.value),
                "baseline": None if found.baseline is None else json_number(found.baseline),
            },
        )

    def _stragglers(
        self, job: Job, state: _JobMetrics, fresh: dict[int, Window], now: float
    ) -> None:
        times = dict(zip(fresh.keys(), map(_STEP_TIME, fresh.values()), strict=True))
        if None in times.values():
            times = {r: t for r, t in times.items() if t is not None}
        new, cleared = state.stragglers.see(times)
        for s in new:
            state.flagged_at[s.rank] = now
            node = fresh[s.rank].node
            log.warning(
                "job %s: rank %d on node %s is a straggler: %.3fs a step, the gang's median %.3fs",
                job.id,
                s.rank,
                node,
                s.step_time_s,
                s.median_s,
                extra={"job": job.id, "rank": s.rank, "event": "straggler"},
            )
            self.store.add_event(
                "straggler",
                node,
                {
                    "job": job.id,
                    "generation": job.generation,
                    "rank": s.rank,
                    "step_time_s": round(s.step_time_s, 6),
                    "median_s": round(s.median_s, 6),
                    "ratio": round(s.ratio, 3),
                },
            )
        for rank in cleared:
            state.flagged_at.pop(rank, None)
            node = fresh[rank].node
            self.store.add_event(
                "straggler_cleared",
                node,
                {"job": job.id, "generation": job.generation, "rank": rank},
            )

    # --- out ---------------------------------------------------------------------

    def straggler_flags(self) -> list[Flag]:
        """Every rank flagged as a straggler now, in every job still followed."""
        flags = []
        for job_id, state in self._jobs.items():
            for rank, s in state.stragglers.flagged.items():
                at = state.latest.get(rank)
                node = at.node if at is not None else state.placement.get(rank)
                if node is None:
                    continue
                since = state.flagged_at.get(rank, self._clock())
                flags.append(Flag(job_id, state.generation, rank, node, since, s.ratio))
        return flags

    def _live(self) -> dict[str, int]:
        """The generation of every followed job that has not ended."""
        live = {}
        for job_id in self._jobs:
            job = self._job(job_id)
            if job is not None and not job.state.final:
                live[job_id] = job.generation
        return live

    def summary(self, job_id: str) -> dict[str, Any]:
        """The job's latest figures: step, loss, step time, tokens/s, stragglers."""
        latest = self.rows.latest_points(job_id, ("loss", STEP_TIME, TOKENS_PER_S))
        state = self._jobs.get(job_id)
        stragglers = []
        if state is not None:
            for rank, s in sorted(state.stragglers.flagged.items()):
                at = state.latest.get(rank)
                stragglers.append(
                    {
                        "rank": rank,
                        "node": at.node if at else None,
                        "step_time_s": round(s.step_time_s, 6),
                        "median_s": round(s.median_s, 6),
                        "ratio": round(s.ratio, 3),
                    }
                )
        newest = max(latest.values(), key=lambda p: p.ts, default=None)
        utilisation = None
        if state is not None:
            utilisation = mfu(
                (
                    flops[0] if (flops := w.stats(FLOPS)) is not None else None,
                    w.step_time_s,
                    peak_flops(self._gpu_model(w.node), self._gpu_peaks),
                )
                for w in state.latest.values()
            )
        return {
            "step": newest.step if newest else None,
            "at": newest.ts if newest else None,
            "loss": _value(latest.get("loss")),
            "step_time_s": _value(latest.get(STEP_TIME)),
            "tokens_per_s": _value(latest.get(TOKENS_PER_S)),
            "mfu": None if utilisation is None else float(f"{utilisation:.4g}"),
            "ranks_reporting": len(state.latest) if state is not None else 0,
            "stragglers": stragglers,
        }


def json_number(value: float) -> float | str:
    """A float JSON can carry: NaN and the infinities as the strings ``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _value(point: Point | None) -> float | str | None:
    return None if point is None else json_number(point.value)
