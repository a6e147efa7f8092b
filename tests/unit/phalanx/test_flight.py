"""The flight recorder's verdict (phalanx.flight): the rank a hung gang waits for.

``fixtures/flight-gloo-hang`` holds two dumps recorded on this machine with torch
2.13's ``_dump_fr_trace()`` on gloo: rank 0 waits in its 4th all-reduce, which rank 1
(asleep in Python) never entered. The NCCL cases are built as torch documents its
entries (torch/distributed/flight_recorder: ``process_group``, ``collective_seq_id``,
``profiling_name``, ``state``, ``retired``, ``is_p2p``)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from phalanx import flight

GLOO_HANG = Path(__file__).parent / "fixtures" / "flight-gloo-hang"


def entry(seq: int, state: str, op: str = "nccl:all_reduce", **more: Any) -> dict[str, Any]:
    return {
        "record_id": seq,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": op,
        "input_sizes": [[1024]],
        "output_sizes": [[1024]],
        "state": state,
        "retired": state == "completed",
        "is_p2p": False,
        "frames": [],
    } | more


def points(dumps: dict[int, list[dict[str, Any]]]) -> list[flight.Point]:
    return [
        p for rank, entries in dumps.items() for p in flight.summarize({"entries": entries}, rank)
    ]


def done(n: int) -> list[dict[str, Any]]:
    return [entry(i, "completed") for i in range(1, n + 1)]


def test_a_gloo_hang_recorded_here_names_the_rank_that_never_entered_the_collective() -> None:
    found = [
        p
        for rank in (0, 1)
        for p in flight.summarize(flight.load(GLOO_HANG / f"nccl-trace-rank-{rank}-{rank}"), rank)
    ]

    verdict = flight.culprit(found)

    assert verdict == flight.Verdict(
        1,
        "0:default_pg",
        "behind",
        "rank 1 never entered collective #4 (gloo:all_reduce) of process group "
        "0:default_pg, in which rank 0 waits; its newest is #3 (gloo:all_reduce)",
    )


def test_the_lowest_rank_behind_is_named_when_several_are() -> None:
    verdict = flight.culprit(
        points(
            {
                0: [*done(6), entry(7, "started")],
                1: [*done(6), entry(7, "started")],
                2: done(6),
                3: done(6),
            }
        )
    )
    assert verdict is not None and (verdict.rank, verdict.kind) == (2, "behind")
    assert "collective #7 (nccl:all_reduce)" in verdict.detail
    assert "in which ranks 0, 1 wait; its newest is #6" in verdict.detail


def test_the_stuck_collective_is_the_oldest_not_completed_everywhere() -> None:
    # NCCL enqueues asynchronously: rank 0 enqueued #6 while #5 hangs on both ranks.
    # Neither is behind: the dumps name no one (not rank 1 as "never entered #6").
    both = {
        0: [*done(4), entry(5, "started"), entry(6, "scheduled")],
        1: [*done(4), entry(5, "started")],
    }
    assert flight.culprit(points(both)) is None


def test_a_rank_behind_in_one_group_that_waits_in_another_is_not_the_culprit() -> None:
    # Rank 3 is the root: rank 2 waits for it in tensor-parallel group "6", and rank 0
    # waits for rank 2 in data-parallel group "1" (whose name sorts first).
    def group(name: str, seq: int, state: str) -> dict[str, Any]:
        return entry(seq, state, process_group=(name, "undefined"))

    dumps = {
        0: [group("1", 4, "completed"), group("1", 5, "started")],
        2: [group("1", 4, "completed"), group("6", 8, "completed"), group("6", 9, "started")],
        3: [group("6", 8, "completed")],
    }
    verdict = flight.culprit(points(dumps))
    assert verdict is not None and (verdict.rank, verdict.pg) == (3, "6")


def test_a_collective_that_never_started_on_one_gpu_names_that_rank() -> None:
    verdict = flight.culprit(
        points({r: [*done(4), entry(5, "scheduled" if r == 2 else "started")] for r in range(4)})
    )
    assert verdict is not None and (verdict.rank, verdict.kind) == (2, "not started")


def test_a_rank_that_entered_another_operation_is_a_mismatch() -> None:
    verdict = flight.culprit(
        points(
            {
                r: [
                    *done(4),
                    entry(5, "started", op="nccl:broadcast" if r == 1 else "nccl:all_reduce"),
                ]
                for r in range(3)
            }
        )
    )
    assert verdict is not None and (verdict.rank, verdict.kind) == (1, "mismatch")


def test_dumps_that_show_no_stuck_collective_or_no_difference_name_no_one() -> None:
    assert flight.culprit(points({0: done(5), 1: done(5)})) is None  # all completed
    # A value of any other type than a string or a number is not read (its repr could be
    # exponentially long), nor a sequence number past 2**62.
    nested: list[Any] = []
    for _ in range(30):
        nested = [nested, nested]
    weird = [entry(3, "started", profiling_name=nested, process_group=(nested, nested))]
    assert [(p.pg, p.op) for p in flight.summarize({"entries": weird}, 0)] == [("?", "?")]
    assert flight.summarize({"entries": [entry(2**63, "started")]}, 0) == []
    both = {r: [*done(4), entry(5, "started")] for r in range(2)}
    assert flight.culprit(points(both)) is None  # alike: the progress culprit stands
    assert flight.culprit(points({0: [*done(4), entry(5, "started")]})) is None  # one rank


def test_point_to_point_entries_and_malformed_ones_are_left_out() -> None:
    entries = [
        *done(3),
        entry(9, "started", is_p2p=True),
        {"collective_seq_id": "x"},
        "garbage",
        entry(4, "started", process_group="not a tuple"),
    ]
    summary = flight.summarize({"entries": entries}, 0)
    assert [(p.pg, p.seq, p.completed) for p in summary] == [("0", 4, -1), ("0:default_pg", 3, 3)]


def test_a_dump_is_loaded_as_plain_data_only(tmp_path: Path) -> None:
    # torch's own list builders are allowed (its pickler names them)...
    ok = tmp_path / "ok"
    ok.write_bytes(pickle.dumps({"entries": [], "version": "2.10"}))
    assert flight.load(ok)["entries"] == []
    builder = tmp_path / "builder"
    builder.write_bytes(
        b"\x80\x02}X\x07\x00\x00\x00entriesctorch.jit._pickle\nbuild_intlist\n]\x85Rs."
    )
    assert flight.load(builder) == {"entries": []}
    # ... anything else is refused unread: a dump must not run code in the agent.
    evil = tmp_path / "evil"
    evil.write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    with pytest.raises(flight.DumpError, match=r"it names os\.system"):
        flight.load(evil)
    assert not (tmp_path / "pwned").exists()
    for name, data in (("garbage", b"\x00\x01 not a pickle"), ("list", pickle.dumps([1]))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(flight.DumpError, match="not a flight-recorder dump"):
            flight.load(tmp_path / name)
    with pytest.raises(flight.DumpError, match="No such file"):
        flight.load(tmp_path / "missing")
