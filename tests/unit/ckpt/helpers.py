"""Shared pieces of the checkpoint store's tests: a small real training state,
a bit-exact comparison, and a tier whose writes a test can hold back."""

from __future__ import annotations

import contextlib
import random
import subprocess
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt import Checkpointer, ShardKey, StoredShard, Tier, verify


def training_state(seed: int = 0, width: int = 64) -> dict[str, Any]:
    """Model + Adam + LR scheduler after two real steps, every RNG, a loader position."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        loss = model(torch.randn(8, width)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
        "loader": {"epoch": 3, "index": 1234, "order_seed": 99},
        "step": 2,
    }


def assert_bit_identical(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        if isinstance(a, OrderedDict):
            assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        for k in a:
            assert_bit_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class GatedTier(Tier):
    """A tier that holds every write until the test opens the gate, then checks
    the bytes it was handed against the seal (a hand-written fake, not a mock)."""

    def __init__(self, name: str = "gated") -> None:
        self.name = name
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.landed: dict[int, bytes] = {}
        self.bad: list[int] = []

    def put(self, key: ShardKey, shard: memoryview, checksum: str) -> str:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        try:
            verify(shard, checksum)
        except Exception:
            self.bad.append(key.step)
            raise
        self.landed[key.step] = bytes(shard)
        return f"gated://{key.step}"

    def open(self, key: ShardKey) -> StoredShard | None:
        data = self.landed.get(key.step)
        return None if data is None else StoredShard(key, bytearray(data), f"gated://{key.step}")

    def steps(self, job: str) -> list[int]:
        return sorted(self.landed)

    def delete(self, job: str, step: int) -> None:
        self.landed.pop(step, None)


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str = "4m") -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``mnt`` (made if missing) for the block; the
    test is skipped where mounting is not permitted (it needs root, as in a container)."""
    mnt.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def open_ckpt(opened: list[Checkpointer], path: Path, **kwargs: Any) -> Checkpointer:
    c = Checkpointer(dir=path, **kwargs)
    opened.append(c)
    return c


def saved_ckpt(
    opened: list[Checkpointer], path: Path, step: int, state: Any, **kwargs: Any
) -> Checkpointer:
    """``open_ckpt``, then ``state`` saved at ``step`` and committed at every tier."""
    c = open_ckpt(opened, path, **kwargs)
    c.save(step, state)
    c.wait()
    return c


def hold_every_ram_slot() -> None:
    """Take every RAM slot the agent can hand this rank (its environment names both)
    through the rank protocol, and never submit them: no slot is free to stage a copy
    in (as while an older generation's saves are still being written down, the newest
    committed step protected), so the agent streams the copy instead."""
    from ckpt.remote import AgentClient, AgentEnv

    client = AgentClient(AgentEnv.from_environ())
    for step in range(1001, 1009):
        got = client.call(
            "POST",
            "/v1/ckpt/acquire",
            {"step": step, "nbytes": 4096, "when_busy": "skip", "timeout": 1},
        )
        if got.get("skipped"):
            assert step > 1001, "no slot was free to take"
            return
    raise AssertionError("the agent kept handing out RAM slots")


# How a copy at a lower tier reaches a rank under an agent: read by the agent into a free
# RAM slot of the rank's, or with no slot free, streamed over the socket into its memory.
COPY_PATHS = pytest.mark.parametrize("path", ["staged", "streamed"])


def finish_reservations(timeout: float = 30.0) -> None:
    """Wait for the RAM slots ranks reserve behind a restore (``Checkpointer`` threads
    ``ckpt-reserve-*``): an agent a test stops must not cut one of those requests off."""
    for thread in threading.enumerate():
        if thread.name.startswith("ckpt-reserve-"):
            thread.join(timeout)
