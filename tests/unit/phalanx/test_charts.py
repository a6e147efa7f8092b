"""The text charts of ``phalanx metrics`` and ``phalanx status``."""

from __future__ import annotations

import math

from phalanx.cli import charts


def test_a_sparkline_goes_from_the_lowest_block_to_the_highest() -> None:
    assert charts.sparkline([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == charts.BLOCKS


def test_a_long_series_is_drawn_in_at_most_width_blocks_ending_with_its_last_value() -> None:
    line = charts.sparkline([float(i) for i in range(1000)], width=20)
    assert len(line) == 20 and line[-1] == charts.BLOCKS[-1]


def test_a_nan_is_drawn_as_a_mark_and_does_not_break_the_scale() -> None:
    assert charts.sparkline([1.0, math.nan, 2.0]) == f"{charts.BLOCKS[0]}!{charts.BLOCKS[-1]}"


def test_a_flat_series_is_a_flat_line() -> None:
    assert len(set(charts.sparkline([3.0] * 5))) == 1


def test_the_metrics_table_shows_loss_first_with_its_last_value_and_step() -> None:
    data = {
        "job": "tinylm-abc",
        "generation": 1,
        "columns": ["step", "ts", "value", "min", "max", "n"],
        "series": {
            "lr": [[9, 1.0, 0.001, 0.001, 0.001, 1]],
            "loss": [[4, 1.0, 3.0, 3.0, 3.0, 1], [9, 2.0, "NaN", "NaN", "NaN", 1]],
        },
        "summary": {"step": 9, "stragglers": []},
    }
    lines = charts.metrics_table(data).splitlines()
    assert lines[1].split()[:4] == ["SERIES", "LAST", "STEP", "RANGE"]
    assert lines[2].split()[:3] == ["loss", "NaN", "9"] and lines[2].endswith("!")
    assert lines[3].split()[:3] == ["lr", "0.001", "9"]


def test_a_job_without_metrics_says_so() -> None:
    text = charts.metrics_table({"job": "j", "generation": 1, "series": {}, "summary": None})
    assert "no metrics yet" in text


def test_the_summary_line_names_loss_throughput_step_time_and_stragglers() -> None:
    line = charts.summary_line(
        {
            "step": 120,
            "loss": 2.5,
            "tokens_per_s": 123456.0,
            "step_time_s": 0.05,
            "stragglers": [{"rank": 3}],
        }
    )
    assert line == "step 120   loss 2.5   tokens/s 123,456   s/step 0.05   1 straggler(s)"
    assert charts.summary_line({"step": None}) is None


def test_a_straggler_against_a_zero_median_reads_as_infinitely_slower() -> None:
    """JSON has no infinity: the API writes a ratio over a median of 0 as null."""
    summary = {
        "stragglers": [
            {"rank": 3, "node": "n1", "step_time_s": 0.5, "ratio": None, "median_s": 0.0}
        ]
    }

    assert charts.straggler_lines(summary) == [
        "straggler: rank 3 on n1: 0.5s a step, inf x the gang's median 0s"
    ]
