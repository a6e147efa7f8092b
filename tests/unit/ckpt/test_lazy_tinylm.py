"""tinylm (real DDP on gloo, one rank) saving every step, lazily and blocking: the same run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import xxhash

from ckpt import Checkpointer, encode

REPO = Path(__file__).resolve().parents[3]
STEPS = 12


def tinylm(*args: str) -> list[dict[str, Any]]:
    """Run tinylm by hand (no agent) and return its JSON lines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PHALANX_")  # by hand: no agent, no progress socket
    }
    env.update(
        PYTHONPATH=str(REPO),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, "examples/tinylm.py", "--steps", str(STEPS), "--log-every", "100", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def saves(lines: list[dict[str, Any]]) -> dict[int, str]:
    """The digest of the state each save was called with, by step."""
    return {line["ckpt_saved"]: line["digest"] for line in lines if "ckpt_saved" in line}


def test_tinylm_saving_lazily_every_step_trains_and_saves_exactly_as_with_blocking_saves(
    tmp_path: Path,
) -> None:
    every_step = ["--ckpt-every", "1", "--ckpt-digests"]
    lazy = tinylm(*every_step, "--ckpt-dir", str(tmp_path / "lazy"))
    blocking = tinylm(*every_step, "--ckpt-dir", str(tmp_path / "blocking"), "--blocking-saves")

    final = [line["digest"] for line in lazy if line.get("done")]
    assert final and final == [line["digest"] for line in blocking if line.get("done")]
    saved = saves(lazy)
    assert sorted(saved) == list(range(1, STEPS + 1)) and saved == saves(blocking)
    # What the last lazy save committed is the state at its call, bit for bit.
    c = Checkpointer(dir=tmp_path / "lazy" / "rank-0")
    try:
        found = c.restore()
        assert found is not None and found[0] == STEPS
        assert xxhash.xxh3_128_hexdigest(bytes(encode(found[1]))) == saved[STEPS]
    finally:
        c.close()
        c.ram.unlink()
