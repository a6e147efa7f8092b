"""The event loop's stall watch: a callback that holds the loop is kept as a stall,
named by the code it was in, counted in the histogram, and logged when long."""

from __future__ import annotations

import asyncio
import difflib
import logging
import threading
import time

import pytest

from phalanx.loopwatch import LoopWatch

OWN = ("tests",)  # these tests' own frames count as the project's


def _hold_the_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # busy, in Python: the GIL changes hands as it runs
        sum(range(1000))


def _compare_at_length(seconds: float) -> None:
    """Holds the loop inside a library's pure-Python code (difflib), called from here."""
    a, b = "ab" * 2000, "ba" * 2000
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        difflib.SequenceMatcher(None, a, b).ratio()


async def _settle() -> None:
    await asyncio.sleep(0.3)  # a few ticks: the stall is kept at the first one after it


async def test_a_callback_that_holds_the_loop_is_kept_as_a_stall_named_by_its_function() -> None:
    async with LoopWatch(threshold_s=0.1, own=OWN) as watch:
        await _settle()
        asyncio.get_running_loop().call_soon(_hold_the_loop, 0.5)
        await _settle()

    mine = [s for s in watch.stalls if "_hold_the_loop" in s.where]
    assert len(mine) == 1, list(watch.stalls)
    stall = mine[0]
    assert stall.s >= 0.3
    assert stall.where.startswith("tests/unit/phalanx/test_loopwatch.py:")
    assert stall.samples > 0 and stall.share > 0.5
    assert watch.count >= 1 and watch.longest_s >= stall.s
    seen = watch.view()
    assert seen["stalls"] == watch.count
    assert any("_hold_the_loop" in s["where"] for s in seen["recent"])


async def test_a_stall_in_a_library_names_the_projects_caller_and_the_librarys_frame() -> None:
    async with LoopWatch(threshold_s=0.1, own=OWN) as watch:
        await _settle()
        asyncio.get_running_loop().call_soon(_compare_at_length, 0.5)
        await _settle()

    stall = next(s for s in watch.stalls if "_compare_at_length" in s.where)
    assert stall.leaf.startswith("difflib.py:") or "/difflib.py:" in stall.leaf, stall
    assert stall.stack.startswith(stall.where), stall  # then its callers, if the project's


async def test_stalls_are_counted_in_the_histogram_by_length() -> None:
    async with LoopWatch(threshold_s=0.1, own=OWN) as watch:
        await _settle()
        asyncio.get_running_loop().call_soon(_hold_the_loop, 0.7)
        await _settle()

    buckets = dict(watch.cumulative())
    assert buckets["+Inf"] == watch.count >= 1
    assert buckets["0.25"] < buckets["+Inf"]  # the 0.7 s stall is over 0.25 s
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative
    assert watch.total_s >= 0.5


async def test_a_long_stall_is_logged_with_where_it_was(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="phalanx.loopwatch")
    async with LoopWatch(threshold_s=0.1, log_s=0.3, own=OWN, name="the test's loop"):
        await _settle()
        asyncio.get_running_loop().call_soon(_hold_the_loop, 0.6)
        await _settle()

    said = [r.getMessage() for r in caplog.records if "_hold_the_loop" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("the test's loop stalled ")


async def test_leaving_the_watch_stops_its_thread_and_its_tick() -> None:
    async with LoopWatch(own=OWN) as watch:
        assert any(t.name == "loopwatch" for t in threading.enumerate())
    assert not any(t.name == "loopwatch" for t in threading.enumerate())
    counted = watch.count
    _hold_the_loop(0.3)  # no longer watched
    await _settle()
    assert watch.count == counted
    watch.close()  # again: nothing to do


def test_a_threshold_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="threshold_s must be positive"):
        LoopWatch(threshold_s=0)


def _sleep_on_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # the loop waits (as for a disk, or the CPU), using none


async def test_a_stall_says_how_much_of_it_the_loop_spent_working() -> None:
    async with LoopWatch(threshold_s=0.1, own=OWN) as watch:
        await _settle()
        loop = asyncio.get_running_loop()
        loop.call_soon(_sleep_on_the_loop, 0.5)
        await _settle()
        loop.call_soon(_hold_the_loop, 0.5)
        await _settle()

    waited = next(s for s in watch.stalls if "_sleep_on_the_loop" in s.where)
    worked = next(s for s in watch.stalls if "_hold_the_loop" in s.where)
    assert waited.cpu_s < waited.s / 2  # waiting, not working
    assert worked.cpu_s > waited.cpu_s
    assert watch.view()["recent"][-1]["cpu_s"] == round(worked.cpu_s, 3)
