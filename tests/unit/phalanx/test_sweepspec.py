"""The sweep spec (issue 25): validated with errors naming the field and line; a
trial's job spec carries its parameters; the pruner's rungs in steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.sweepspec import PrunerSpec, SweepSpecError, load_sweep, load_sweep_file

SPEC = """\
name: lm
team: research
trial:
  command: [python, tinylm.py, --lr, "{lr}", --dim, "{dim}", --tag, "${HOME}"]
  workdir: /w
  nodes: 1
  ranks_per_node: 2
space:
  lr: {type: float, low: 1.0e-4, high: 0.03, log: true}
  dim: {type: categorical, choices: [16, 32]}
  layers: {type: int, low: 1, high: 3}
objective: {metric: loss, direction: minimize, at: best}
pruner: {type: asha, min_steps: 10, reduction_factor: 2, max_steps: 100}
n_trials: 8
parallelism: 2
priority: 20
"""


def error_of(text: str) -> str:
    with pytest.raises(SweepSpecError) as caught:
        load_sweep(text)
    return str(caught.value)


def test_a_trials_job_spec_carries_its_params_in_hyperparams_env_and_command() -> None:
    spec = load_sweep(SPEC)

    job = spec.trial_spec("lm-0a1b2c-t3", {"lr": 0.001, "dim": 32, "layers": 2})

    assert job.name == "lm-0a1b2c-t3" and job.team == "research" and job.priority == 20
    assert job.command == [
        "python",
        "tinylm.py",
        "--lr",
        "0.001",
        "--dim",
        "32",
        "--tag",
        "${HOME}",
    ]
    assert job.env == {"HP_LR": "0.001", "HP_DIM": "32", "HP_LAYERS": "2"}
    assert job.hyperparams == {"lr": 0.001, "dim": 32, "layers": 2}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("low: 1.0e-4", "low: 0"), "space.lr (line 9): a log scale needs low > 0"),
        (("nodes: 1", "nodes: 0"), "trial.nodes (line 6): Input should be greater than"),
        (('"{dim}"', '"{dm}"'), "trial.command (line 4): {dm} names no parameter of the space"),
        (("type: categorical", "type: cat"), "space.dim (line 10): Input tag 'cat'"),
        (("at: best", "at: first"), "objective.at (line 12): Input should be 'last' or 'best'"),
        (("n_trials: 8", "n_trials: 0"), "n_trials (line 14): Input should be greater than"),
        (("type: asha", "type: hyperband"), ""),
        (("max_steps: 100", "max_steps: 5"), "pruner (line 13): max_steps must be at least"),
        (("name: lm", "name: LM"), "name (line 1): String should match pattern"),
    ],
)
def test_a_bad_sweep_spec_is_refused_naming_the_field_and_line(
    change: tuple[str, str], message: str
) -> None:
    text = SPEC.replace(*change)
    if not message:
        load_sweep(text)  # hyperband with max_steps: valid
        return
    assert message in error_of(text)


def test_a_grid_over_a_float_without_a_step_is_refused() -> None:
    text = SPEC.replace("n_trials: 8", "n_trials: 8\nsampler: {type: grid}")

    assert "grid: float parameter 'lr' needs a step" in error_of(text)


def test_asha_rungs_grow_by_the_reduction_factor_up_to_max_steps() -> None:
    pruner = PrunerSpec(type="asha", min_steps=10, reduction_factor=3, max_steps=200)

    assert pruner.rungs(1000) == [10, 30, 90]
    assert [pruner.next_rung(s) for s in (0, 10, 29, 90)] == [10, 30, 30, None]


def test_median_rungs_are_every_interval_after_the_warmup() -> None:
    pruner = PrunerSpec(type="median", warmup_steps=20, interval_steps=10)

    assert pruner.rungs(55) == [20, 30, 40, 50]
    assert [pruner.next_rung(s) for s in (0, 20, 25)] == [20, 30, 30]


def test_the_example_sweep_is_valid_and_substitutes_lr_and_dim() -> None:
    spec = load_sweep_file(Path(__file__).resolve().parents[3] / "examples" / "tinylm-sweep.yaml")

    job = spec.trial_spec("tinylm-sweep-0a1b2c-t0", {"lr": 0.002, "dim": 64})

    assert spec.pruner.rungs(300) == [25, 75, 225]
    assert job.command[:6] == ["python", "tinylm.py", "--lr", "0.002", "--dim", "64"]
    assert job.priority == 30 and job.preemptible
