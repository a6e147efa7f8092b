"""The event loop's stalls: how long a daemon's loop ran one thing while everything
else (messages, heartbeats, REST) waited, and where.

A daemon's figures that matter to a fleet (a heartbeat taken, a recovery's orders out,
a REST answer) all wait behind whatever the one event loop runs. A profile says where
the CPU goes over a run; it does not say which 0.4 s stretch without a yield made the
heartbeats lag and the API answer late (issue 22). :class:`LoopWatch` does: a callback
on the loop stamps the clock every ``TICK_S``; a daemon thread looks every ``SAMPLE_S``
and, while the loop is late by more than ``threshold_s``, samples the loop thread's
stack (``sys._current_frames``: the thread needs the GIL for that, which a loop busy in
Python code gives up every switch interval). When the loop ticks again the stall is
kept (the last ``keep``), with where it was most of the time: the innermost frame of
the project's own code, and the innermost frame of all (a library's, when it was in
one). Stalls of a second or more are logged.

The watch starts and stops with its daemon (an async context manager); it decides
nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

TICK_S = 0.05
SAMPLE_S = 0.01
THRESHOLD_S = 0.1  # a stall shorter than this is not kept
LOG_S = 1.0  # a stall this long or longer is logged, as a warning
KEEP = 64
DEPTH = 6  # the project's frames a stall's ``stack`` names
# The histogram's upper bounds, seconds (Prometheus ``le``); the last is +Inf.
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The folders of the project's own code: a stall's ``where`` is the innermost frame of
# a file under one of them.
OWN = ("supervisor", "agentd", "phalanx", "ckpt")
_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Stall:
    """One stretch the loop ran without a yield, ``at`` (wall clock) for ``s`` seconds;
    ``where`` the project's frame most of the samples were in, ``stack`` the project's
    frames most of those samples were in (``where`` first, then its callers), ``leaf``
    the innermost frame of those samples (a library's, or ``where`` again), ``share``
    the fraction of the samples in ``where``; ``samples``: how many were taken (0: none,
    the stall was over before the thread looked, and ``where`` is empty); ``cpu_s`` the
    CPU time the loop's thread had from the tick before the stall to its end (``s`` +
    ``TICK_S`` of wall time): far less than ``s``, the loop was not working but waiting
    (for the CPU, on a busy host; for the disk; for the GIL)."""

    at: float
    s: float
    where: str
    leaf: str
    share: float
    samples: int
    stack: str = ""
    cpu_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "s": round(self.s, 3),
            "where": self.where,
            "leaf": self.leaf,
            "share": round(self.share, 2),
            "samples": self.samples,
            "stack": self.stack,
            "cpu_s": round(self.cpu_s, 3),
        }


@functools.lru_cache(maxsize=4096)
def _file(filename: str) -> tuple[str, str]:
    """(how a file is shown, its top folder under the project's root or "")."""
    path = Path(filename)
    try:
        rel = path.resolve().relative_to(_ROOT)
    except (ValueError, OSError):
        parts = path.parts  # a library's: from its package folder on
        return ("/".join(parts[-2:]) if len(parts) >= 2 else filename), ""
    return str(rel), rel.parts[0] if len(rel.parts) > 1 else ""


def _name(frame: FrameType) -> str:
    code = frame.f_code
    return f"{_file(code.co_filename)[0]}:{frame.f_lineno} {code.co_name}"


def _own(frame: FrameType, own: tuple[str, ...]) -> bool:
    return _file(frame.f_code.co_filename)[1] in own


def locate(frame: FrameType | None, own: tuple[str, ...] = OWN) -> tuple[str, str]:
    """(the project's own frames, innermost first and ``DEPTH`` at most, joined by " < ";
    the innermost frame) of a stack whose innermost frame is ``frame``; the first is ""
    when no frame is the project's (the folders ``own``)."""
    if frame is None:
        return "", ""
    leaf = _name(frame)
    found: list[str] = []
    f: FrameType | None = frame
    while f is not None and len(found) < DEPTH:
        if _own(f, own):
            found.append(_name(f))
        f = f.f_back
    return " < ".join(found), leaf


class LoopWatch:
    """Watches the running loop's stalls (module doc). ``stalls``: the last ``keep``;
    ``count``, ``total_s``, ``longest_s`` and the histogram's ``buckets`` cover every
    stall since the start."""

    def __init__(
        self,
        threshold_s: float = THRESHOLD_S,
        keep: int = KEEP,
        log_s: float = LOG_S,
        name: str = "event loop",
        own: tuple[str, ...] = OWN,
    ) -> None:
        if threshold_s <= 0:
            raise ValueError(f"threshold_s must be positive, got {threshold_s}")
        self.threshold_s = threshold_s
        self.log_s = log_s
        self.name = name
        self.own = own
        self.stalls: deque[Stall] = deque(maxlen=keep)
        self.count = 0
        self.total_s = 0.0
        self.longest_s = 0.0
        self.buckets = [0] * (len(BUCKETS) + 1)  # per bound, not cumulative; last: +Inf
        self._due = 0.0  # monotonic: when the next tick is due
        self._cpu = 0.0  # the loop thread's CPU time at the last tick
        self._lock = threading.Lock()
        self._samples: Counter[tuple[str, str]] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._loop_thread = 0

    async def __aenter__(self) -> LoopWatch:
        loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._due = time.monotonic() + TICK_S
        self._cpu = time.thread_time()
        self._handle = loop.call_later(TICK_S, self._tick)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="loopwatch", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop watching (idempotent): the tick is cancelled, the thread joined."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def _tick(self) -> None:
        now, cpu = time.monotonic(), time.thread_time()
        late = now - self._due
        if late >= self.threshold_s:
            with self._lock:
                samples, self._samples = self._samples, Counter()
            self._keep(late, samples, cpu - self._cpu)
        elif self._samples:
            with self._lock:
                self._samples.clear()
        self._due, self._cpu = now + TICK_S, cpu
        self._handle = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def _watch(self) -> None:
        wait = SAMPLE_S
        while not self._stop.wait(wait):
            # Asleep until the loop would be late by the threshold (a few wake-ups a
            # second, each taking the GIL from the loop), every SAMPLE_S while it is.
            early = self._due + self.threshold_s - time.monotonic()
            wait = max(SAMPLE_S, early)
            if early > 0:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            found = locate(frame, self.own)
            del frame
            with self._lock:
                self._samples[found] += 1

    def _keep(self, s: float, samples: Counter[tuple[str, str]], cpu_s: float) -> None:
        taken = sum(samples.values())
        where, leaf, stack, share = "", "", "", 0.0
        if taken:
            by_where: Counter[str] = Counter()
            for (st, _), n in samples.items():
                by_where[st.split(" < ", 1)[0]] += n
            where, n_where = by_where.most_common(1)[0]
            share = n_where / taken
            mine = {k: n for k, n in samples.items() if k[0].split(" < ", 1)[0] == where}
            leaf = Counter({lf: n for (_, lf), n in mine.items()}).most_common(1)[0][0]
            stack = Counter({st: n for (st, _), n in mine.items()}).most_common(1)[0][0]
        stall = Stall(time.time() - s, s, where, leaf, share, taken, stack, cpu_s)
        self.stalls.append(stall)
        self.count += 1
        self.total_s += s
        self.longest_s = max(self.longest_s, s)
        self.buckets[next((i for i, b in enumerate(BUCKETS) if s <= b), len(BUCKETS))] += 1
        if s >= self.log_s:
            log.warning(
                "%s stalled %.2f s (%.2f s of CPU), mostly (%d of %d samples) in %s%s",
                self.name,
                s,
                cpu_s,
                round(share * taken),
                taken,
                stack or "code outside the project",
                f" (in {leaf})" if leaf and leaf != where else "",
            )

    def cumulative(self) -> list[tuple[str, int]]:
        """The histogram as Prometheus wants it: (upper bound, stalls at or under it)."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip([*map(str, BUCKETS), "+Inf"], self.buckets, strict=True):
            total += n
            out.append((bound, total))
        return out

    def view(self, recent: int = 16) -> dict[str, Any]:
        """What ``GET /v1/stats`` shows: the totals, and the last ``recent`` stalls."""
        last: Iterable[Stall] = list(self.stalls)[-recent:] if recent else ()
        return {
            "threshold_s": self.threshold_s,
            "stalls": self.count,
            "stalled_s": round(self.total_s, 3),
            "longest_s": round(self.longest_s, 3),
            "recent": [s.as_dict() for s in last],
        }
