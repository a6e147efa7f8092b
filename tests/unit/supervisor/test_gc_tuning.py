"""The supervisor's garbage collector: young collections in long intervals, full ones
rare, and what the imports made out of them all (``supervisor.__main__.tune_gc``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from supervisor.__main__ import GC_THRESHOLDS, tune_gc


@pytest.fixture
def restored() -> Iterator[None]:
    before = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.usefixtures("restored")
def test_the_supervisor_collects_in_long_intervals_and_never_scans_its_modules() -> None:
    tune_gc()

    assert gc.get_threshold() == GC_THRESHOLDS
    assert GC_THRESHOLDS[0] >= 50 * 700  # CPython's default young threshold: 700
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the modules, classes and functions imported
    made = [[i] for i in range(1000)]  # what the daemon makes from now on
    gc.collect()
    assert gc.get_freeze_count() == frozen  # is collected as ever, never frozen
    assert all(gc.is_tracked(m) for m in made)
