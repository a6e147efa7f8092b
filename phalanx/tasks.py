"""Background work a daemon owns: supervised loops, one-off tasks, the shutdown deadline.

* :func:`supervised` runs a long-lived loop; a loop that crashes is logged and restarted,
  never lost.
* :class:`Tasks` is the one owner of a component's one-off tasks (a command being run, a
  catalog being applied, a job's launch): each is started through it, kept until it ends,
  its failure logged, and at shutdown it is waited for up to a deadline, then cancelled
  with a message naming it.
* :class:`Deadline` is the one overall deadline a shutdown's steps share, so that the
  steps' own timeouts cannot add up past it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from phalanx.link import Backoff

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long tasks cancelled at shutdown get to run their cleanup before they are left.
CANCEL_GRACE_S = 2.0


async def supervised(
    name: str, loop: Callable[[], Awaitable[None]], *, max_delay: float = 30.0
) -> None:
    """Run ``loop`` forever; restart it with capped backoff when it raises."""
    backoff = Backoff(0.5, max_delay)
    while True:
        try:
            await loop()
            log.warning("loop %s returned; restarting it", name)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("loop %s crashed; restarting it", name)
        await asyncio.sleep(backoff.next())


class Deadline:
    """A point in time the steps of a shutdown share: each waits at most what is left."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self, floor: float = 0.0) -> float:
        """Seconds left, never under ``floor`` (a step that must at least try)."""
        return max(floor, self._end - time.monotonic())

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self._end


class Tasks:
    """The one-off tasks of one component (``owner`` names it in logs and messages).

    ``spawn`` starts a task and keeps a reference until it ends (asyncio keeps only a weak
    one); a task that raises is logged with its name, never silently lost. ``shutdown``
    stops accepting, waits for what runs, and cancels what outlives the deadline."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        return self._closed

    def names(self) -> list[str]:
        return sorted(t.get_name() for t in self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T] | None:
        """Start ``coro`` as a task named ``name``; None (and the coroutine closed) once
        shutdown has begun: a component going down starts nothing new."""
        if self._closed:
            coro.close()
            log.info("%s is shutting down: %s not started", self.owner, name)
            return None
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("%s: task %s failed: %r", self.owner, task.get_name(), exc, exc_info=exc)

    def close(self) -> None:
        """Stop accepting: ``spawn`` starts nothing from now on (the first step of a
        shutdown; :meth:`shutdown` then waits for what runs)."""
        self._closed = True

    async def shutdown(self, timeout: float) -> None:
        """Stop accepting; wait up to ``timeout`` s for the running tasks (tasks they start
        meanwhile included); cancel the rest, each with a message naming it and the limit,
        and give them ``CANCEL_GRACE_S`` to run their cleanup."""
        self._closed = True
        deadline = Deadline(timeout)
        while self._tasks and not deadline.passed:
            await asyncio.wait(set(self._tasks), timeout=deadline.left())
        late = set(self._tasks)
        if not late:
            return
        log.warning(
            "%s: cancelling %d task(s) still running after the %.1f s shutdown limit: %s",
            self.owner,
            len(late),
            timeout,
            ", ".join(sorted(t.get_name() for t in late)),
        )
        for task in late:
            task.cancel(f"{self.owner} shut down: {task.get_name()} outlived {timeout:.1f} s")
        _, stuck = await asyncio.wait(late, timeout=CANCEL_GRACE_S)
        if stuck:
            log.error(
                "%s: %d task(s) ignored cancellation for %.1f s and are left: %s",
                self.owner,
                len(stuck),
                CANCEL_GRACE_S,
                ", ".join(sorted(t.get_name() for t in stuck)),
            )
