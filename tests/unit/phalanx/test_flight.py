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


def test_the_rank_furthest_behind_is_named_when_several_are() -> None:
    verdict = flight.culprit(
        points(
            {
                0: [*done(9), entry(10, "started")],
                1: [*done(9), entry(10, "started")],
                2: done(7),
                3: done(9),
            }
        )
    )
    assert verdict is not None and (verdict.rank, verdict.kind) == (2, "behind")
    assert "in which ranks 0, 1 wait; its newest is #7" in verdict.detail


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
