"""The cyclic garbage collector held off a short, latency-critical stretch of the loop.

With :data:`supervisor.gcpolicy.GC_THRESHOLDS` the young generations are collected
every 50,000 objects kept, and a collection scans every object kept since the last:
up to 0.3 s at 2,048 nodes, with nothing to collect (the supervisor's garbage goes by
reference counts). A recovery's way from its plan to the last start order out
allocates more than that (the plan, the job's records, 2,048 orders), so one such
pause or more fell inside the second a recovery has (issue 22). :func:`hold` holds the
collector off until the orders are out (:meth:`Hold.release`), or ``max_s`` at most;
then what piled up meanwhile is frozen (:func:`supervisor.gcpolicy.freeze_held`, with
the daemon's policy on), not scanned by the next pass all at once.
Holds nest: the collector runs again once the last one is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc

from supervisor import gcpolicy

MAX_HOLD_S = 3.0

_holds: set[Hold] = set()
_enabled_before = True


class Hold:
    """One hold of the collector (:func:`hold`); released once, by :meth:`release` or
    its timer."""

    def __init__(self, max_s: float) -> None:
        self._timer: asyncio.TimerHandle | None = None
        with contextlib.suppress(RuntimeError):  # no loop: released by the caller only
            self._timer = asyncio.get_running_loop().call_later(max_s, self.release)

    def release(self) -> None:
        if self not in _holds:
            return
        _holds.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if not _holds and _enabled_before:
            gcpolicy.freeze_held()  # not scanned all at once now (gcpolicy.freeze_held)
            gc.enable()


def hold(max_s: float = MAX_HOLD_S) -> Hold:
    """Hold the cyclic collector off for at most ``max_s`` seconds."""
    global _enabled_before
    if not _holds:
        _enabled_before = gc.isenabled()
        gc.disable()
    held = Hold(max_s)
    _holds.add(held)
    return held
