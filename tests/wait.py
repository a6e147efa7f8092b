"""Waiting for a condition in a test, one way: poll it until it holds, with a deadline that
fails naming what was awaited (issue 21). A test waits for what it asserts, never for a
fixed time: ``wait_for`` in threads and plain tests, ``until`` in a coroutine.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from phalanx.client import ApiError

T = TypeVar("T")

Why = str | Callable[[], str]  # what was awaited; a callable is asked only on a timeout


def _named(what: Why) -> str:
    return what() if callable(what) else what


def wait_for(
    predicate: Callable[[], T | None], timeout: float, what: Why, interval: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return it; fail naming
    ``what`` after ``timeout`` s. An API error or ``OSError`` (a daemon not up yet) counts
    as not yet."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except (ApiError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.1f}s waiting for {_named(what)}; last: {last!r}"
    )


async def until(
    predicate: Callable[[], T | Awaitable[T | None] | None],
    timeout: float,
    what: Why,
    interval: float = 0.01,
) -> T:
    """``wait_for`` in a coroutine: the event loop runs meanwhile. ``predicate`` may be a
    coroutine function (each try awaited)."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.1f}s waiting for {_named(what)}; last: {last!r}"
    )


async def settle(turns: int = 20) -> None:
    """Let every task that is ready run until it waits (``turns`` turns of the event loop,
    no clock): before asserting that something did not happen, or after starting a task
    that must reach its first wait (a lock, an event) before the test goes on."""
    for _ in range(turns):
        await asyncio.sleep(0)
