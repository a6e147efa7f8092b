"""The store's writes soon: queued, written together, in order, the newest record only."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "state.db")
    yield store
    store.close()


def reread(path: Path) -> Store:
    return Store(path)


def test_writes_soon_are_written_at_once_without_defer(store: Store) -> None:
    store.add_event_soon("rank_exited", "n1", {"rank": 3})
    assert store.pending == 0
    assert [e.kind for e in store.events()] == ["rank_exited"]


def test_writes_soon_wait_for_the_flush_once_deferred(store: Store) -> None:
    scheduled: list[int] = []
    store.defer(lambda: scheduled.append(1))
    store.add_event_soon("rank_exited", "n1", {"rank": 3})
    store.add_event_soon("rank_exited", "n1", {"rank": 4})
    assert scheduled == [1]  # once for the burst
    assert store.events() == []
    store.flush()
    assert [e.detail["rank"] for e in store.events()] == [3, 4]
    assert store.pending == 0


def test_another_write_writes_what_was_queued_first(store: Store) -> None:
    store.defer(lambda: None)
    store.add_event_soon("rank_exited", "n1", {"rank": 3})
    store.add_event("job_failure", "n1", {"why": "rank 3"})
    assert [e.kind for e in store.events()] == ["rank_exited", "job_failure"]


def test_only_the_newest_record_of_a_job_is_built(store: Store, tmp_path: Path) -> None:
    store.defer(lambda: None)
    built: list[int] = []

    def record(n: int) -> dict[str, int]:
        built.append(n)
        return {"n": n}

    for n in range(3):
        store.save_job_soon("job-1", lambda: "running", functools.partial(record, n))
    store.flush()
    assert built == [2]
    assert store.load_jobs() == {"job-1": {"n": 2}}


def test_what_is_queued_is_written_at_close(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.defer(lambda: None)
    store.save_node_soon("n1", lambda: {"birth_seq": 7})
    store.close()
    again = reread(tmp_path / "state.db")
    try:
        assert again.load_nodes() == {"n1": {"birth_seq": 7}}
    finally:
        again.close()


def test_records_are_strict_json_with_non_finite_numbers_as_null(
    store: Store, tmp_path: Path
) -> None:
    """Records are encoded by orjson (phalanx.jsonenc): a NaN or infinity reads back as
    None, as the API always showed it; an int past 64 bits and int keys survive."""
    record = {
        "guard": {"value": float("nan"), "baseline": float("inf"), "ratio": 2.5},
        "ranks": [{"rank": 0, "node": "n1", "code": None}],
        "progress": {1: [10, 1.5, 20, 3.0]},
        "big": 2**70,
    }
    store.save_job("job-1", "running", record)
    store.save_node("n1", {"health": {"gpu": float("-inf")}})
    store.add_event("job_failure", "n1", {"loss": float("nan")})
    store.defer(lambda: None)
    store.save_job_soon("job-2", lambda: "running", lambda: {"loss": float("nan")})
    store.flush()
    rows = store._db.execute("SELECT record FROM jobs ORDER BY id").fetchall()
    assert all("NaN" not in r[0] and "Infinity" not in r[0] for r in rows)
    again = reread(tmp_path / "state.db")
    try:
        jobs = again.load_jobs()
        assert jobs["job-1"]["guard"] == {"value": None, "baseline": None, "ratio": 2.5}
        assert jobs["job-1"]["ranks"] == record["ranks"]
        assert jobs["job-1"]["progress"] == {"1": [10, 1.5, 20, 3.0]}
        assert jobs["job-1"]["big"] == 2**70
        assert jobs["job-2"] == {"loss": None}
        assert again.load_nodes()["n1"] == {"health": {"gpu": None}}
        assert again.events()[-1].detail == {"loss": None}
    finally:
        again.close()
