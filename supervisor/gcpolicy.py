"""How the supervisor uses CPython's cyclic garbage collector.

The supervisor's garbage goes by reference counts, nearly all of it: the cyclic
collector's passes find next to nothing, yet each one stops the event loop for as long
as it takes to scan what it looks at. At 2,048 nodes (issue 22) the supervisor keeps
~300,000 tracked objects that live for minutes or for good (the nodes' births, the
job's ranks, the checkpoint catalogs' shards); a full collection scanned all of them,
0.3-0.7 s on a 2-core machine, and came every minute or two, as checkpoints' catalogs
and promoted windows added up. So:

* :data:`GC_THRESHOLDS`: the young generation is collected every 50,000 objects kept
  (default: 700), the middle one every 20 young collections;
* what the imports made (modules, classes: never garbage) is frozen at start
  (:func:`gc.freeze`), and so is whatever lived through a full collection, right after
  it (:func:`_after`): a full collection scans what was made since the last one, not the
  whole heap again;
* so is what piled up while :mod:`supervisor.gcdefer` held the collector off (a
  commit's catalogs, a recovery's orders), at its release (:func:`freeze_held`): the
  next young pass would scan it all at once;
* once every :data:`RECLAIM_S` a full collection's survivors are put back instead
  (:func:`gc.unfreeze`): the next full collection then scans everything and takes the
  cycles that frozen objects made since (a task that lived through a freeze and ended
  in an exception, say). One long pause an hour, not one a minute.

Nothing here keeps an object alive or frees one early: a frozen object is freed by its
reference count as any other; only a cycle of frozen objects waits for the next reclaim.
:mod:`supervisor.gcdefer` holds the collector off during a recovery.

Every pass of the collector is timed (:data:`PAUSES`: ``GET /v1/stats`` ``gc``, and
``phalanx_supervisor_gc_pause_seconds``): a pass stops the event loop as any stall does,
and the loop's stall watch sees only where the loop was when it began (an allocation
anywhere, often a weakref's callback as the pass frees what it found).
"""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any, Final

GC_THRESHOLDS: Final = (50_000, 20, 10)
RECLAIM_S: Final = 3600.0
# A pause's histogram's upper bounds, seconds (Prometheus ``le``); the last is +Inf.
PAUSE_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
RECENT_S: Final = 0.02  # a pause this long or longer is kept in ``Pauses.recent``
KEEP_RECENT: Final = 64

_reclaimed_at = time.monotonic()


class Pauses:
    """The collector's passes since :func:`tune`, by generation (0, 1, 2): how many, the
    seconds they took in all, the longest and the histogram; and the last
    :data:`KEEP_RECENT` of :data:`RECENT_S` or more: (when, generation, seconds, objects
    collected). Written by the collector's callback (the interpreter's lock held)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.longest_s = [0.0, 0.0, 0.0]
        self.buckets = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(3)]
        self.recent: deque[tuple[float, int, float, int]] = deque(maxlen=KEEP_RECENT)
        self._began = 0.0

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        s = time.perf_counter() - self._began
        generation = min(2, max(0, int(info.get("generation", 0))))
        self.count[generation] += 1
        self.total_s[generation] += s
        self.longest_s[generation] = max(self.longest_s[generation], s)
        bucket = next((i for i, b in enumerate(PAUSE_BUCKETS) if s <= b), len(PAUSE_BUCKETS))
        self.buckets[generation][bucket] += 1
        if s >= RECENT_S:
            self.recent.append((time.time() - s, generation, s, int(info.get("collected", 0))))

    def cumulative(self, generation: int) -> list[tuple[str, int]]:
        """A generation's histogram as Prometheus wants it: (upper bound, passes at or
        under it)."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip(
            [*map(str, PAUSE_BUCKETS), "+Inf"], self.buckets[generation], strict=True
        ):
            total += n
            out.append((bound, total))
        return out

    def view(self) -> dict[str, Any]:
        """What ``GET /v1/stats`` shows under ``gc``."""
        return {
            "thresholds": list(gc.get_threshold()),
            # each generation's count now, against its threshold (not the objects frozen:
            # gc.get_freeze_count walks them all, 0.1-0.2 s of the loop at 2,048 nodes)
            "counts": list(gc.get_count()),
            "generations": [
                {
                    "generation": g,
                    # what its passes found garbage since the process began (gc.get_stats)
                    "collected": found["collected"],
                    "passes": self.count[g],
                    "paused_s": round(self.total_s[g], 3),
                    "longest_s": round(self.longest_s[g], 4),
                }
                for g, found in enumerate(gc.get_stats())
            ],
            "recent": [
                {"at": round(at, 3), "generation": g, "s": round(s, 4), "collected": n}
                for at, g, s, n in self.recent
            ],
        }


PAUSES = Pauses()  # the process's


def tune() -> None:
    """Set :data:`GC_THRESHOLDS`, freeze what the imports made, and freeze each full
    collection's survivors from now on (a reclaim an hour). For the daemon's process."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.collect()
    gc.freeze()
    if PAUSES.on_gc not in gc.callbacks:
        gc.callbacks.insert(0, PAUSES.on_gc)  # first at the start and first at the stop
    if _after not in gc.callbacks:
        gc.callbacks.append(_after)


def freeze_held() -> None:
    """While the policy is on (:func:`tune`): freeze what the collector holds now, unscanned.
    For :mod:`supervisor.gcdefer`'s release: what piled up while the collector was held
    off (a commit's 2,048 catalogs and their steps and shards, a recovery's orders) was
    scanned by the next young pass at once, 0.1-0.26 s of the event loop at 2,048 nodes
    after every commit's catalogs (issue 22), and again by the middle one. Every object
    not frozen yet is frozen, so also what the young and middle generations held: all
    are freed by their reference counts as ever, but cyclic garbage among them waits for
    the hourly reclaim. What that costs was measured: in a 2,048-node run the young
    passes found ~70 objects of cyclic garbage a minute, and the supervisor's RSS was
    flat (389 MiB after 600 s, 399 MiB without this); code that
    makes cycles as it goes shows as growing memory (``phalanx.link``'s batches did,
    ~10 MB of catalogs each, until they let go of their publishes).

    Once every :data:`RECLAIM_S` it reclaims instead: everything is put back and
    collected in one full pass, and what lives through it is frozen again. With the
    young generation frozen at every release the middle and full passes come hours
    apart, so the hourly reclaim cannot wait for a full pass of their own."""
    global _reclaimed_at
    if _after not in gc.callbacks:
        return
    now = time.monotonic()
    if now - _reclaimed_at >= RECLAIM_S:
        _reclaimed_at = now
        gc.unfreeze()
        gc.collect()  # _after freezes what lived through it
        return
    gc.freeze()


def untune() -> None:
    """Stop freezing after full collections and timing the passes (the process's
    collector as it was, but for its thresholds and what is frozen)."""
    for callback in (_after, PAUSES.on_gc):
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)


def _after(phase: str, info: dict[str, Any]) -> None:
    """After a full collection: freeze what lived through it, or, once every
    :data:`RECLAIM_S`, unfreeze everything, for the next full collection to look at.
    (Runs inside the collector, the interpreter's lock held: no logging, no I/O.)"""
    global _reclaimed_at
    if phase != "stop" or info.get("generation") != 2:
        return
    now = time.monotonic()
    if now - _reclaimed_at >= RECLAIM_S:
        _reclaimed_at = now
        gc.unfreeze()
        return
    gc.freeze()
