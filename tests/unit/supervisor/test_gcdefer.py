"""The cyclic collector held off a recovery's way to its start orders (issue 22)."""

from __future__ import annotations

import asyncio
import gc

from supervisor import gcdefer


async def test_holds_nest_and_the_collector_runs_again_after_the_last() -> None:
    assert gc.isenabled()
    first = gcdefer.hold()
    second = gcdefer.hold()
    assert not gc.isenabled()
    first.release()
    first.release()  # once only
    assert not gc.isenabled()
    second.release()
    assert gc.isenabled()


async def test_a_hold_not_released_lapses_after_its_bound() -> None:
    held = gcdefer.hold(max_s=0.05)
    assert not gc.isenabled()
    await asyncio.sleep(0.2)
    assert gc.isenabled()
    held.release()  # late: changes nothing
    assert gc.isenabled()


async def test_a_collector_off_before_stays_off() -> None:
    gc.disable()
    try:
        gcdefer.hold().release()
        assert not gc.isenabled()
    finally:
        gc.enable()
