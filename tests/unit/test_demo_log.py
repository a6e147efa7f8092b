"""The demo's headings are bold on a terminal only: its log, written to a file or a pipe,
is plain text, and ``NO_COLOR`` turns them off on a terminal too.

The real ``examples/demo.sh`` runs with a stand-in ``phalanx`` first on its PATH whose
``local up`` fails: the demo prints its first heading, stops, and its exit trap prints
the second ("stopping the fleet"), in a few milliseconds and without a fleet.
"""

from __future__ import annotations

import os
import pty
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ESC = b"\x1b["


@pytest.fixture
def stub_path(tmp_path: Path) -> str:
    stub = tmp_path / "bin" / "phalanx"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\n[ "$1 $2" = "local up" ] && exit 1\nexit 0\n')
    stub.chmod(0o755)
    return f"{stub.parent}:{os.environ['PATH']}"


def demo_env(path: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    return {**env, "PATH": path, "PHALANX_LOCAL_DIR": "unused", **extra}


def demo_on_a_terminal(env: dict[str, str]) -> bytes:
    """What the demo writes to a terminal (its stdout a pseudo-terminal)."""
    controller, terminal = pty.openpty()
    try:
        done = subprocess.run(
            ["bash", "examples/demo.sh"],
            stdin=subprocess.DEVNULL,
            stdout=terminal,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
            env=env,
            timeout=30,
        )
    finally:
        os.close(terminal)
    out = b""
    try:
        while chunk := os.read(controller, 4096):
            out += chunk
    except OSError:  # EIO: the terminal's other side is closed and all of it was read
        pass
    finally:
        os.close(controller)
    assert done.returncode == 1  # the stand-in's `local up` failed
    return out


def test_the_demos_log_in_a_pipe_has_its_headings_without_escape_codes(stub_path: str) -> None:
    done = subprocess.run(
        ["bash", "examples/demo.sh"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=ROOT,
        env=demo_env(stub_path),
        timeout=30,
    )

    assert done.returncode == 1
    assert b"\n== bringing up a local fleet" in done.stdout
    assert b"\n== stopping the fleet\n" in done.stdout
    assert ESC not in done.stdout


def test_the_demo_on_a_terminal_shows_bold_headings(stub_path: str) -> None:
    out = demo_on_a_terminal(demo_env(stub_path))

    assert b"\x1b[1m== bringing up a local fleet" in out
    assert b"\x1b[1m== stopping the fleet\x1b[0m" in out


def test_no_color_keeps_the_demo_on_a_terminal_plain(stub_path: str) -> None:
    out = demo_on_a_terminal(demo_env(stub_path, NO_COLOR="1"))

    assert b"== stopping the fleet" in out
    assert ESC not in out
