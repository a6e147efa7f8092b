"""The supervisor's garbage collector (``supervisor.gcpolicy``): young collections in long
intervals, what the imports made and what lived through a full collection frozen, and
an hourly full collection over everything that takes the cycles frozen objects made."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from supervisor import gcpolicy


class Thing:
    pass


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def tuned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = gc.get_threshold()
    monkeypatch.setattr(gcpolicy, "_reclaimed_at", gcpolicy.time.monotonic())
    try:
        gcpolicy.tune()
        yield
    finally:
        gcpolicy.untune()
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.usefixtures("tuned")
def test_the_supervisor_collects_in_long_intervals_and_never_scans_its_modules_again() -> None:
    assert gc.get_threshold() == gcpolicy.GC_THRESHOLDS
    assert gcpolicy.GC_THRESHOLDS[0] >= 50 * 700  # CPython's default young threshold: 700
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the modules, classes and functions imported

    made = [[i] for i in range(1000)]  # what the daemon makes from now on
    gc.collect(0)
    assert gc.get_freeze_count() == frozen  # a young collection freezes nothing
    assert all(gc.is_tracked(m) for m in made)


@pytest.mark.usefixtures("tuned")
def test_what_lives_through_a_full_collection_is_frozen_and_freed_by_its_count_still() -> None:
    frozen = gc.get_freeze_count()
    kept = [Thing() for _ in range(1000)]
    gc.collect()

    assert gc.get_freeze_count() >= frozen + len(kept)  # not scanned by the next ones
    gone = weakref.ref(kept[0])
    del kept  # a frozen object goes by its reference count as any other
    assert gone() is None


@pytest.mark.usefixtures("tuned")
def test_an_hourly_reclaim_takes_the_cycles_frozen_objects_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cycle = Cycle()
    gc.collect()  # it lives through one: frozen
    assert gc.get_freeze_count() > 0
    del cycle  # garbage now, which only a look at the frozen objects finds
    assert gc.collect() == 0

    monkeypatch.setattr(gcpolicy, "_reclaimed_at", gcpolicy.time.monotonic() - gcpolicy.RECLAIM_S)
    gc.collect()  # the hour is up: this one's callback puts everything back...
    assert gc.get_freeze_count() == 0
    found = [o for o in gc.get_objects() if type(o) is Cycle]
    assert len(found) == 1
    del found
    assert gc.collect() >= 1  # ...and the next full collection takes the cycle
    assert gc.get_freeze_count() > 0  # then freezes what lived again
    assert not [o for o in gc.get_objects() if type(o) is Cycle]


@pytest.mark.usefixtures("tuned")
def test_every_pass_is_timed_by_generation_and_the_long_ones_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses = gcpolicy.PAUSES
    before = list(pauses.count)
    monkeypatch.setattr(gcpolicy, "RECENT_S", 0.0)  # every pass counts as long here
    gc.collect(0)
    gc.collect(1)
    cycle = Cycle()
    del cycle
    gc.collect(2)

    assert [pauses.count[g] - before[g] for g in range(3)] == [1, 1, 1]
    assert [r[1] for r in list(pauses.recent)[-3:]] == [0, 1, 2]
    assert list(pauses.recent)[-1][3] >= 1  # the full pass collected the cycle
    view = pauses.view()
    assert view["thresholds"] == list(gcpolicy.GC_THRESHOLDS)
    assert len(view["counts"]) == 3 and "frozen" not in view  # nothing that walks the heap
    assert [g["passes"] for g in view["generations"]] == pauses.count
    assert view["recent"][-1]["generation"] == 2 and view["recent"][-1]["s"] >= 0
    for g in range(3):
        assert pauses.cumulative(g)[-1] == ("+Inf", pauses.count[g])


def test_an_untuned_collector_is_not_timed_any_more() -> None:
    gcpolicy.tune()
    gcpolicy.untune()
    try:
        assert gcpolicy.PAUSES.on_gc not in gc.callbacks
        before = list(gcpolicy.PAUSES.count)
        gc.collect(0)
        assert gcpolicy.PAUSES.count == before
    finally:
        gc.unfreeze()
