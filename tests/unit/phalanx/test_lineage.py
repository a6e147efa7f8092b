"""A job's lineage: the code, data and hyperparameters recorded with its checkpoints."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from phalanx.cli.charts import lineage_lines
from phalanx.jobspec import JobSpecError, load_spec
from phalanx.lineage import code_ref_of
from supervisor.api.job_routes import add_losses
from supervisor.telemetry.series import Point

BASE = """\
name: tinylm
team: research
command: [python, train.py]
workdir: /srv/tinylm
nodes: 2
ranks_per_node: 4
"""


def test_a_spec_records_its_code_data_and_hyperparameters() -> None:
    spec = load_spec(
        BASE + "code_ref: {commit: 3f2c1ab, dirty: true}\n"
        "data_snapshot: c4-en/2026-11-01\n"
        "hyperparams: {lr: 0.0003, batch: 512, warmup: cosine, tied: true}\n"
    )

    assert spec.lineage() == {
        "code_ref": {"commit": "3f2c1ab", "dirty": True, "source": None},
        "data_snapshot": "c4-en/2026-11-01",
        "hyperparams": {"lr": 0.0003, "batch": 512, "warmup": "cosine", "tied": True},
    }


def test_a_hyperparameter_that_is_not_a_plain_value_is_refused_naming_it() -> None:
    with pytest.raises(JobSpecError) as caught:
        load_spec(BASE + "hyperparams: {schedule: {kind: cosine}}\n")

    assert any(field.startswith("hyperparams.schedule") for field, _, _ in caught.value.errors)


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_the_code_ref_of_a_checkout_is_its_commit_and_whether_the_tree_is_dirty(
    tmp_path: Path,
) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "train.py").write_text("print(1)\n")
    git(tmp_path, "add", "train.py")
    git(tmp_path, "commit", "-q", "-m", "first")
    head = git(tmp_path, "rev-parse", "HEAD")

    assert code_ref_of(tmp_path) == {"commit": head, "dirty": False, "source": None}
    (tmp_path / "train.py").write_text("print(2)\n")
    assert code_ref_of(tmp_path / ".") == {"commit": head, "dirty": True, "source": None}


def test_a_folder_that_is_no_checkout_has_no_code_ref(tmp_path: Path) -> None:
    assert code_ref_of(tmp_path) is None
    assert code_ref_of(tmp_path / "missing") is None


def test_a_checkpoint_shows_the_loss_at_its_step_or_the_nearest_before() -> None:
    steps = [{"step": 10}, {"step": 20}, {"step": 5}]
    losses = [
        Point(9, 100.0, 3.0, 3.0, 3.0),
        Point(19, 105.0, 2.5, 2.5, 2.5),
        Point(20, 130.0, 2.4, 2.4, 2.4),  # the run rolled back and trained step 20 again
        Point(20, 110.0, 2.6, 2.6, 2.6),
    ]

    add_losses(steps, losses)

    assert [(s["loss"], s["loss_step"]) for s in steps] == [(3.0, 9), (2.4, 20), (None, None)]


def test_the_lineage_reads_as_lines_above_the_checkpoints() -> None:
    lines = lineage_lines(
        {
            "code_ref": {"commit": "3f2c1ab", "dirty": True, "source": "git@x:y.git"},
            "data_snapshot": "c4@7",
            "hyperparams": {"lr": 0.1},
        }
    )

    assert lines == [
        "code: 3f2c1ab (dirty tree) from git@x:y.git",
        "data: c4@7",
        "hyperparams: lr=0.1",
    ]
