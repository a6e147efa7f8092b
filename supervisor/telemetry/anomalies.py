"""What is wrong with a run, judged from its metrics: pure watches, state in, verdicts out.

:class:`SpikeWatch` follows one gang series (``loss``, ``grad_norm``): a NaN or infinite
value is an anomaly at once; a value above the series' exponential moving average by
``sigmas`` moving standard deviations *and* by ``min_rise`` of the average is a spike
(after ``warmup`` points, so a run's first steps are not judged).

:class:`StragglerWatch` follows a job's ranks' step times, one look per supervisor
window: a rank whose step time stays above the gang's median by ``margin`` (0.2: 20 %
slower) for ``windows`` looks in a row is a straggler, until a look finds it back within
the margin. With synchronous data parallelism every rank waits for the slowest at each
collective, so the ranks' step times converge: the watch catches ranks whose steps are
timed apart (pipeline stages, asynchronous workers); a slow rank of a synchronous gang
shows as a slower gang instead.

Nothing here does I/O; :mod:`supervisor.telemetry.training` turns verdicts into job events.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import compress
from typing import Literal


@dataclass(frozen=True)
class Anomaly:
    name: str
    kind: Literal["nonfinite", "spike"]
    step: int
    value: float
    baseline: float | None  # the moving average before this value (None: none yet)


@dataclass
class SpikeWatch:
    """One series' moving average and deviation (see the module doc)."""

    name: str
    alpha: float = 0.1  # weight of a new value in the moving average (~20 points)
    sigmas: float = 4.0
    min_rise: float = 0.25  # a spike is also this much above the average, relatively
    warmup: int = 10
    mean: float | None = None
    var: float = 0.0
    seen: int = 0

    def see(self, step: int, value: float) -> Anomaly | None:
        if not math.isfinite(value):
            return Anomaly(self.name, "nonfinite", step, value, self.mean)
        mean = self.mean
        if mean is None:
            self.mean, self.seen = value, 1
            return None
        deviation = value - mean
        spike = (
            self.seen >= self.warmup
            and deviation > self.sigmas * math.sqrt(self.var)
            and deviation > self.min_rise * abs(mean)
        )
        # Spikes count too: a lasting jump becomes the new normal instead of an alarm
        # every window.
        self.mean = mean + self.alpha * deviation
        self.var = (1 - self.alpha) * (self.var + self.alpha * deviation * deviation)
        self.seen += 1
        return Anomaly(self.name, "spike", step, value, mean) if spike else None


@dataclass(frozen=True)
class Straggler:
    rank: int
    step_time_s: float
    median_s: float

    @property
    def ratio(self) -> float:
        return self.step_time_s / self.median_s if self.median_s > 0 else math.inf


@dataclass
class StragglerWatch:
    """A job's ranks' step times, one look per window (see the module doc)."""

    margin: float = 0.2
    windows: int = 6
    min_ranks: int = 2  # a median of one rank says nothing
    slow_for: dict[int, int] = field(default_factory=dict)  # rank -> looks in a row
    flagged: dict[int, Straggler] = field(default_factory=dict)

    def see(self, step_times: Mapping[int, float]) -> tuple[list[Straggler], list[int]]:
        """Look at the ranks' latest step times; returns the ranks newly flagged and the
        ranks no longer flagged. A rank missing from ``step_times`` keeps its state."""
        # Only the slow ranks and those slow at the last look are visited one by one, and
        # the passes over every rank are made in C: at 16,384 ranks a look a window was
        # 0.1 s of the supervisor's loop (issue 22).
        times: Mapping[int, float] = step_times
        if not (math.isfinite(sum(times.values())) and min(times.values(), default=0) >= 0):
            times = {r: t for r, t in times.items() if math.isfinite(t) and t >= 0}
        if len(times) < self.min_ranks:
            return [], []
        median = statistics.median(times.values())
        limit = median * (1 + self.margin)
        slow = sorted(compress(times.keys(), map(limit.__lt__, times.values())))
        new: list[Straggler] = []
        cleared: list[int] = []
        for rank in sorted(r for r in self.slow_for if r in times and times[r] <= limit):
            del self.slow_for[rank]
            if self.flagged.pop(rank, None) is not None:  # flagged: slow at the last looks
                cleared.append(rank)
        for rank in slow:
            self.slow_for[rank] = self.slow_for.get(rank, 0) + 1
            if self.slow_for[rank] >= self.windows:
                flagged = Straggler(rank, times[rank], median)
                if rank not in self.flagged:
                    new.append(flagged)
                self.flagged[rank] = flagged
        return new, cleared
