"""phalanx top: one screen of the fleet and its jobs, whatever the fleet's size."""

from __future__ import annotations

import io
from typing import Any

from phalanx.cli.top import MAX_NODES_LISTED, frame, run


def node(i: int, state: str = "up", rack: str = "r1", **extra: Any) -> dict[str, Any]:
    return {"id": f"n{i:05d}", "state": state, "rack": rack, "reasons": [], **extra}


def job(id_: str, state: str, **extra: Any) -> dict[str, Any]:
    return {"id": id_, "state": state, "world_size": 8, "generation": 1, "restarts": 0, **extra}


def test_a_fleet_of_2048_nodes_fits_one_screen_listing_only_nodes_not_up() -> None:
    nodes = [node(i, rack=f"r{i // 16:03d}") for i in range(2048)]
    for i in range(0, 400, 20):
        nodes[i] = node(i, "drain", rack=f"r{i // 16:03d}", reasons=[{"code": "ecc_dbe"}])

    text = frame(nodes, [], 0.0)

    assert "nodes 2048: 2028 up · 20 drain" in text
    assert text.count("ecc_dbe") == MAX_NODES_LISTED
    assert "8 more nodes not up" in text
    assert len(text.splitlines()) < 60


def test_running_jobs_show_their_training_figures_and_ended_ones_only_the_last_five() -> None:
    summary = {
        "step": 120,
        "loss": 2.25,
        "tokens_per_s": 51234.0,
        "step_time_s": 0.21,
        "stragglers": [{"rank": 3}],
    }
    jobs = [job("train-a", "running", summary=summary)]
    jobs += [job(f"old-{i}", "succeeded", ended_at=float(i)) for i in range(8)]

    text = frame([node(1)], jobs, 0.0)

    row = next(line for line in text.splitlines() if line.startswith("train-a"))
    assert row.split() == [
        "train-a",
        "running",
        "8",
        "1",
        "0/-",
        "120",
        "2.25",
        "51,234",
        "0.21",
        "1",
    ]
    assert "old-7" in text and "old-3" in text and "old-2" not in text
    assert "1 running" in text and "8 ended" in text


def test_run_draws_the_frames_it_is_asked_for() -> None:
    out = io.StringIO()
    calls = []

    def fetch() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        calls.append(1)
        return [node(1)], []

    run(fetch, interval_s=0.0, frames=2, out=out, clear=False)

    assert len(calls) == 2 and out.getvalue().count("phalanx top") == 2
