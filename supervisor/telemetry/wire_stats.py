"""What the supervisor heard on the wire: messages taken, by kind, and how late heartbeats
were when the registry took them.

Both are counted since the supervisor started and shown by ``GET /v1/stats``. An
operator (or ``bench/fleet_scale.py``) compares ``received`` with what the agents sent
to find messages lost on the way, and reads the heartbeat lag (a heartbeat's ``sent_at``,
by the agent's clock, to the moment the registry took it) to see whether the supervisor
keeps up with its fleet. The lag is kept as a histogram of fixed logarithmic buckets
(10 % wide, 1 ms to ~2 h): bounded memory whatever the fleet, and two readings of it
subtract to the lags of the time between them.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from phalanx import wire

_GROWTH = 1.1  # each bucket's upper bound is 10 % above the previous one
_FIRST_S = 0.001  # the first bucket: up to 1 ms (and every negative lag: clocks differ)
_BUCKETS = 160  # 1 ms * 1.1**160 ~ 4.2e3 s; the last bucket takes everything above


def bucket_bound(index: int) -> float:
    """The upper bound (seconds) of bucket ``index``."""
    return _FIRST_S * _GROWTH**index


class LagHistogram:
    """Counts of lags (seconds) by logarithmic bucket."""

    def __init__(self) -> None:
        self.counts = [0] * (_BUCKETS + 1)
        self.n = 0

    def add(self, lag_s: float) -> None:
        if not math.isfinite(lag_s) or lag_s <= _FIRST_S:
            index = 0
        else:
            index = min(_BUCKETS, math.ceil(math.log(lag_s / _FIRST_S, _GROWTH)))
        self.counts[index] += 1
        self.n += 1

    def view(self) -> dict[str, Any]:
        """``n`` and the non-empty buckets as ``[upper bound in s, count]`` pairs."""
        return {
            "n": self.n,
            "buckets": [[round(bucket_bound(i), 6), c] for i, c in enumerate(self.counts) if c],
        }


def quantile(buckets: dict[float, int], q: float) -> float | None:
    """The ``q`` quantile (upper bound of its bucket) of ``{upper bound: count}``."""
    total = sum(buckets.values())
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for bound in sorted(buckets):
        seen += buckets[bound]
        if seen >= rank:
            return bound
    return max(buckets)


class WireStats:
    """Messages taken by kind (their ``kind`` field; ``cleared`` for an empty retained
    payload) and the heartbeats' lag."""

    def __init__(self) -> None:
        self.received: Counter[str] = Counter()
        self.heartbeat_lag = LagHistogram()

    def on_message(self, message: wire.Message | None, now: float) -> None:
        if message is None:
            self.received["cleared"] += 1
            return
        if isinstance(message, wire.CkptLandings):  # counted as the landings they carry
            self.received["ckpt_batch"] += 1
            self.received["ckpt"] += len(message.landings)
            return
        if isinstance(message, wire.RankEvents):  # and the events
            self.received["rank_batch"] += 1
            self.received["rank"] += len(message.events)
            return
        self.received[message.kind] += 1
        if isinstance(message, wire.Heartbeat):
            self.heartbeat_lag.add(now - message.sent_at)

    def view(self) -> dict[str, Any]:
        return {
            "received": dict(sorted(self.received.items())),
            "heartbeat_lag_s": self.heartbeat_lag.view(),
        }
