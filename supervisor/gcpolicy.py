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
* once every :data:`RECLAIM_S` a full collection's survivors are put back instead
  (:func:`gc.unfreeze`): the next full collection then scans everything and takes the
  cycles that frozen objects made since (a task that lived through a freeze and ended
  in an exception, say). One long pause an hour, not one a minute.

Nothing here keeps an object alive or frees one early: a frozen object is freed by its
reference count as any other; only a cycle of frozen objects waits for the next reclaim.
:mod:`supervisor.gcdefer` holds the collector off during a recovery.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Final

GC_THRESHOLDS: Final = (50_000, 20, 10)
RECLAIM_S: Final = 3600.0

_reclaimed_at = time.monotonic()


def tune() -> None:
    """Set :data:`GC_THRESHOLDS`, freeze what the imports made, and freeze each full
    collection's survivors from now on (a reclaim an hour). For the daemon's process."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.collect()
    gc.freeze()
    if _after not in gc.callbacks:
        gc.callbacks.append(_after)


def untune() -> None:
    """Stop freezing after full collections (the process's collector as it was, but for
    its thresholds and what is frozen)."""
    if _after in gc.callbacks:
        gc.callbacks.remove(_after)


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
