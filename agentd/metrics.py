"""The agent's training metrics: step reports folded into one compact batch per job and window.

Ranks report every step (``phalanx.rank.step``); the progress monitor hands each report
of a job's current generation to :meth:`MetricsWindow.add`, and every
``metrics_interval_s`` (:data:`phalanx.wire.METRICS_INTERVAL_S`, 5 s) the agent sends
what :meth:`MetricsWindow.flush` returns: per job one :class:`phalanx.wire.MetricsBatch`
(more when the node runs more than ``MAX_METRIC_RANKS`` of its ranks), with per rank
its step range, mean step time, tokens/s, mean data wait and the (last, min, max, mean)
of each other scalar. Nothing here does I/O: the agent's loop publishes.

What it costs the fleet, per window of ``T`` = 5 s: one message per node and job, about
``120 + 240 x ranks on the node`` bytes with three named scalars (loss, grad_norm, lr;
each further scalar adds ~60 bytes per rank): 2.0 KB for a node of 8 ranks. A
16,384-GPU job (2,048 nodes x 8 ranks) sends the broker and the supervisor 2,048 / 5 =
**410 messages/s, 0.84 MB/s**; a 4,096-rank job on 512 such nodes 102 messages/s,
0.21 MB/s; 4,096 single-rank nodes 819 messages/s, ~0.3 MB/s (``bench/metrics.py``). A
message per step instead would be 16,384 x 10 steps/s = 164k messages/s. Folding a report
costs the agent ~1.6 us; the largest batch allowed (64 ranks x 16 names) is ~140 KB.

Names: ``tokens`` (this rank's tokens in the step) and ``data_wait_s`` (seconds the step
waited for data) are summarised as ``tokens_per_s`` and ``data_wait_s``; every other
scalar is kept by name, the first :data:`phalanx.wire.MAX_METRIC_NAMES` a rank reported in
the window (the others are counted in ``dropped_names`` and :attr:`MetricsWindow.dropped_names`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from phalanx import wire
from phalanx.progress import StepReport

TOKENS = "tokens"
DATA_WAIT = "data_wait_s"
FORGET_AFTER_S = 600.0  # a generation with no report for this long is forgotten


@dataclass
class _Scalar:
    last: float
    low: float
    high: float
    total: float
    n: int = 1

    def add(self, value: float) -> None:
        self.last = value
        # min/max that keep a NaN visible: once seen, it stays the window's min and max
        if math.isnan(value) or math.isnan(self.low):
            self.low = self.high = math.nan
        else:
            self.low = min(self.low, value)
            self.high = max(self.high, value)
        self.total += value
        self.n += 1

    def stats(self) -> wire.ScalarStats:
        return (self.last, self.low, self.high, self.total / self.n)


@dataclass
class _Rank:
    prev_step: int  # the last report, across windows: the next interval starts there
    prev_at: float
    first_step: int = -1  # the window's; -1: no report in this window yet
    last_step: int = 0
    last_at: float = 0.0
    reports: int = 0
    dt: float = 0.0  # seconds between reports of new steps in the window
    steps: int = 0  # steps those intervals covered
    tokens: float = 0.0  # tokens reported with those intervals
    timed_tokens: bool = False
    wait: float = 0.0
    waits: int = 0
    scalars: dict[str, _Scalar] = field(default_factory=dict)

    def window(self, rank: int) -> wire.RankWindow:
        return wire.RankWindow(
            rank=rank,
            step_first=self.first_step,
            step_last=self.last_step,
            at=self.last_at,
            reports=self.reports,
            step_time_s=_finite(self.dt / self.steps) if self.steps else None,
            tokens_per_s=_finite(self.tokens / self.dt) if self.timed_tokens and self.dt else None,
            data_wait_s=_finite(self.wait / self.waits) if self.waits else None,
            scalars={name: s.stats() for name, s in self.scalars.items()},
        )

    def reset(self) -> None:
        self.first_step, self.reports = -1, 0
        self.dt, self.steps, self.tokens, self.timed_tokens = 0.0, 0, 0.0, False
        self.wait, self.waits = 0.0, 0
        self.scalars = {}


@dataclass
class _Generation:
    job: str
    generation: int
    touched: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    dropped_names: int = 0


class MetricsWindow:
    """One node's step reports of the current window, by job generation and rank."""

    def __init__(self, node: str, *, max_names: int = wire.MAX_METRIC_NAMES) -> None:
        self.node = node
        self.max_names = max_names
        self._gens: dict[tuple[str, int], _Generation] = {}
        self._window_start: float | None = None
        self.added = 0  # reports folded in
        self.dropped_names = 0  # scalar values left out: past the names cap

    def add(self, report: StepReport) -> None:
        """Fold one step report in (of the job's current generation: the caller fences)."""
        if report.kind != "step":
            return
        key = (report.job, report.generation)
        gen = self._gens.get(key)
        if gen is None:
            gen = self._gens[key] = _Generation(report.job, report.generation, report.at)
        gen.touched = report.at
        r = gen.ranks.get(report.rank)
        if r is None:
            r = gen.ranks[report.rank] = _Rank(prev_step=report.step, prev_at=report.at)
            interval = None
        elif report.step > r.prev_step and report.at >= r.prev_at:
            interval = (report.at - r.prev_at, report.step - r.prev_step)
        else:
            interval = None  # the same step again, or a clock step back: no interval
        if r.first_step < 0:
            r.first_step = report.step
        r.last_step, r.last_at = report.step, report.at
        r.prev_step, r.prev_at = report.step, report.at
        r.reports += 1
        self.added += 1
        for name, value in report.scalars.items():
            if name == TOKENS:
                if interval is not None and math.isfinite(value) and value >= 0:
                    r.tokens += value
                    r.timed_tokens = True
            elif name == DATA_WAIT:
                if math.isfinite(value) and value >= 0:
                    r.wait += value
                    r.waits += 1
            elif (s := r.scalars.get(name)) is not None:
                s.add(value)
            elif len(r.scalars) < self.max_names:
                r.scalars[name] = _Scalar(value, value, value, value)
            else:
                gen.dropped_names += 1
                self.dropped_names += 1
        if interval is not None:
            r.dt += interval[0]
            r.steps += interval[1]

    def flush(self, now: float) -> list[wire.MetricsBatch]:
        """The batches of the window that ends ``now`` (by the ranks' clock, wall time);
        the next window starts empty. A job's older generations go once flushed."""
        start, self._window_start = self._window_start, now
        window_s = max(0.0, now - start) if start is not None else 0.0
        newest: dict[str, int] = {}
        for job, generation in self._gens:
            newest[job] = max(newest.get(job, 0), generation)
        batches = []
        for key, gen in list(self._gens.items()):
            windows = [r.window(n) for n, r in sorted(gen.ranks.items()) if r.reports]
            for i in range(0, len(windows), wire.MAX_METRIC_RANKS):
                batches.append(
                    wire.MetricsBatch(
                        node=self.node,
                        job=gen.job,
                        generation=gen.generation,
                        window_s=window_s,
                        sent_at=now,
                        ranks=windows[i : i + wire.MAX_METRIC_RANKS],
                        dropped_names=gen.dropped_names if i == 0 else 0,
                    )
                )
            for r in gen.ranks.values():
                r.reset()
            gen.dropped_names = 0
            if gen.generation < newest[gen.job] or now - gen.touched > FORGET_AFTER_S:
                del self._gens[key]
        return batches


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
