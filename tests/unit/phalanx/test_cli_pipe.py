"""The ``phalanx`` CLI piped into a reader that stops early (``| head -1``) exits quietly.

A real ``phalanx`` process writes into a real pipe whose reader has gone: every write
then fails with EPIPE, as it does once ``head`` has read its line and exited.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from phalanx import local

ROOT = Path(__file__).resolve().parents[3]


def fleet_dir(tmp_path: Path) -> Path:
    fleet = local.Fleet(
        dir=str(tmp_path), api="http://127.0.0.1:1", token="t" * 32, broker_port=1, processes=[]
    )
    fleet.save()
    return tmp_path


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    try:
        return subprocess.run(
            [sys.executable, "-m", "phalanx.cli", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        os.close(write_end)


def test_a_command_whose_reader_closed_the_pipe_exits_141_without_a_word(
    tmp_path: Path,
) -> None:
    done = run_into_closed_pipe("local", "env", "--dir", str(fleet_dir(tmp_path)))

    assert (done.returncode, done.stderr) == (141, "")


def test_head_reads_the_first_line_of_local_env_and_nothing_is_printed_on_stderr(
    tmp_path: Path,
) -> None:
    directory = fleet_dir(tmp_path)
    pipeline = subprocess.run(
        f"{sys.executable} -m phalanx.cli local env --dir {directory} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )

    assert pipeline.stdout == "export PHALANX_API=http://127.0.0.1:1\n"
    assert pipeline.stderr == ""
