"""``phalanx sweep``: a bad spec is refused before any request, naming the field; the
status table shows the best trial and every trial's state, value and params."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.cli import commands as cli
from phalanx.cli.base import EXIT_USAGE
from phalanx.cli.sweeps import status_text

VIEW = {
    "id": "lm-0a1b2c",
    "team": "research",
    "priority": 30,
    "state": "complete",
    "reason": "1 of 2 trials complete",
    "objective": {"metric": "loss", "direction": "minimize", "at": "last"},
    "sampler": {"type": "tpe"},
    "pruner": {"type": "asha"},
    "n_trials": 2,
    "parallelism": 2,
    "counts": {"complete": 1, "pruned": 1, "failed": 0, "running": 0},
    "best": {"number": 0, "value": 0.51234, "params": {"lr": 0.001, "dim": 32}, "job": "j0"},
    "trials": [
        {
            "number": 0,
            "state": "complete",
            "value": 0.51234,
            "params": {"lr": 0.001, "dim": 32},
            "job": "j0",
            "pruned_at": None,
            "reason": None,
        },
        {
            "number": 1,
            "state": "pruned",
            "value": 2.5,
            "params": {"lr": 0.3, "dim": 16},
            "job": "j1",
            "pruned_at": 10,
            "reason": "pruned by sweep lm-0a1b2c at step 10",
        },
    ],
}


def test_status_shows_the_best_trial_and_each_trials_state_value_and_params() -> None:
    text = status_text(VIEW)

    assert "best:       trial 0: 0.5123  lr=0.001 dim=32  (job j0)" in text
    assert "1 done, 1 pruned, 0 failed, 0 running of 2" in text
    row = next(line for line in text.splitlines() if line.startswith("1 "))
    assert row.split()[:5] == ["1", "pruned", "@10", "2.5", "lr=0.3"]


def test_submit_refuses_a_bad_spec_naming_the_field_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        "name: lm\nteam: t\ntrial: {command: [x], workdir: /, nodes: 1, ranks_per_node: 1}\n"
        "space: {lr: {type: float, low: 0, high: 1, log: true}}\n"
        "objective: {metric: loss}\nn_trials: 2\n"
    )

    code = cli.main(["--api", "http://127.0.0.1:9", "--token", "x", "sweep", "submit", str(spec)])

    assert code == EXIT_USAGE
    assert "space.lr (line 4): a log scale needs low > 0" in capsys.readouterr().err
