"""The training job the integration tests run: ``examples/tinylm.py`` with a tiny model.

One place for its command line, so that every test trains the same few-thousand-parameter
transformer (a step takes milliseconds on a CPU) and adds only what it is about: steps,
checkpoints, a sleep per step, a fault.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the command runs here (a job's workdir)
MODEL = ("--vocab", "32", "--dim", "16", "--layers", "1", "--heads", "2", "--seq", "8")
MODEL += ("--batch", "2")


def tinylm(*args: str) -> list[str]:
    """The command of a rank: tinylm with the tiny model and ``args`` (a later argument
    wins over an earlier one of the same name)."""
    return [sys.executable, "examples/tinylm.py", *MODEL, *args]
